"""The controller's durable journal: incidents, actions and rank exits on their way to the store.

It sits below everyone who writes to the store from the controller: the supervisor and alert
recording (`controller.alerts`). Its files are written through `tracing.durable`.

The supervisor writes to the store what it saw (rank exits) and what it did (incidents and their
actions). A store outage must not lose any of them, however long it lasts, and must not store any
of them twice. So each record is first appended to the journal, an append-only JSON-lines file
that is fsync'd before the append returns, and only then written to the store (`Outbox`):

    {"n": 7, "put": "incident", "record": {...}}    a record to write (its fields by name)
    {"n": 7, "done": true}                          the store has it
    {"n": 7, "refused": "<error>"}                  the store refused it for good

Pending records are written whenever the supervisor polls, rank exits first (the analysis
waits for them), then incidents and actions in journal order (an incident before its actions).
A temporary failure leaves them, and the rest, for a later poll (the wait between tries follows
`tracing.retry`: 0.5 s, doubling, at most 5 s), so the supervisor keeps acting on the job while
the store is away. Once nothing is pending the file is emptied. A new
supervisor on the same journal (after a crash or a stop of the controller) writes what was left.

Exactly once: a write whose outcome is unknown (the connection broke after the server took it)
may have landed. Before such a record is written again the store is asked whether it holds it:
an incident by (job, incident_id, detected_at_us), an action by (job, incident_id, kind,
target, time_us), a job state by (job, seq, time_us). Every record found in a journal at startup
counts as such. Rank exits need no check: they are written as a batch with a stable id and
`maybe_duplicate=True`.

A record the store refuses for good (PermanentStoreError, StoreConfigError) is logged and copied
to `<journal>.refused` for a human; it is not retried. One supervisor at a time per journal.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracehound.tracing import kinds, wire
from tracehound.tracing.durable import write_atomic, write_durably
from tracehound.tracing.errors import StoreError, TemporaryStoreError
from tracehound.tracing.events import Action, ActionKind, Batch, Incident, JobState, RankExit
from tracehound.tracing.ids import JobId
from tracehound.tracing.retry import Backoff, BackoffState, call_with_retry
from tracehound.tracing.store import HeldRecords, TraceStore

log = logging.getLogger(__name__)

JOURNAL_FILE = "journal.jsonl"
"""The journal's file name in a job's state directory."""

STORE_RETRY = Backoff(initial_s=0.5, maximum_s=5.0)
"""Waits between tries of pending records while the store is away."""

Journaled = Incident | Action | RankExit | JobState
"""What the supervisor journals."""

_KINDS = ("incident", "action", "exit", "state")
"""The record kinds (their wire `type`) the journal takes."""


# -- records as JSON ---------------------------------------------------------------------------

def kind_of(record: Journaled) -> str:
    """The journal's name for the kind of `record`: its wire `type`."""
    return kinds.layout(type(record)).tag


def to_json(record: Journaled) -> dict[str, Any]:
    """The record in its wire form (`tracing.wire`) without its `type` (the journal line names
    it); an incident without its actions, which are journaled as records of their own."""
    values = wire.encode(record)
    del values["type"]
    values.pop("actions", None)
    return values


def from_json(kind: str, values: dict[str, Any]) -> Journaled:
    """The record `to_json` gave `values` for; ValueError if they do not fit."""
    if kind not in _KINDS:
        raise ValueError(f"unknown journal record kind {kind!r}")
    record: Journaled = wire.decode({**values, "type": kind}, batch_only=False)
    return record


def exit_batch_id(exit_: RankExit) -> str:
    """The stable batch id a rank exit is stored under (the same on every try)."""
    return f"exit/{exit_.job}/{exit_.attempt}/{exit_.rank}"


# -- the file ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Entry:
    """One journaled record on its way to the store."""

    number: int
    record: Journaled
    maybe_stored: bool = False
    """An earlier write may have landed: check the store before writing again."""


class Journal:
    """The pending records of one supervisor, kept in an fsync'd JSON-lines file (or only in
    memory when `path` is None: retried the same way, but lost with the process)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._pending: dict[int, Entry] = {}
        self._next = 1
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._load(path)
            self._rewrite()

    def _load(self, path: Path) -> None:
        """Read back what an earlier supervisor left: every record put and not settled."""
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return
        for number, line in enumerate(raw.splitlines(), 1):
            try:
                self._replay(json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("journal %s: line %d unreadable, skipped: %s", path, number, exc)
        for entry in self._pending.values():
            entry.maybe_stored = True
        if self._pending:
            log.info("journal %s: %d records not yet in the store", path, len(self._pending))

    def _replay(self, line: dict[str, Any]) -> None:
        number = int(line["n"])
        self._next = max(self._next, number + 1)
        if "put" in line:
            self._pending[number] = Entry(number, from_json(line["put"], line["record"]))
        else:
            self._pending.pop(number, None)

    def pending(self) -> list[Entry]:
        """Records not yet in the store, oldest first."""
        return sorted(self._pending.values(), key=lambda e: e.number)

    def append(self, *records: Journaled) -> list[Entry]:
        """Journal records (durably, unless the disk fails: then they are kept in memory), in
        one write: a process killed meanwhile leaves all of them or none."""
        entries = []
        for record in records:
            entry = Entry(self._next, record)
            self._next += 1
            self._pending[entry.number] = entry
            entries.append(entry)
        if self.path is not None:
            _append(self.path, b"".join(_line(_put(e)) for e in entries))
        return entries

    def done(self, entry: Entry) -> None:
        """The store has the record."""
        self._settle(entry, {"n": entry.number, "done": True})

    def refused(self, entry: Entry, reason: str) -> None:
        """The store refused the record for good: keep a copy aside, stop retrying it."""
        line = {"n": entry.number, "refused": reason}
        if self.path is not None:
            aside = {**_put(entry), **line}
            _append(self.path.with_name(self.path.name + ".refused"), _line(aside))
        self._settle(entry, line)

    def _settle(self, entry: Entry, line: dict[str, Any]) -> None:
        """Forget a record; the file is emptied once nothing is pending."""
        self._pending.pop(entry.number, None)
        if self._pending:
            self._write(line)
        else:
            self._rewrite()

    def _write(self, line: dict[str, Any]) -> None:
        if self.path is not None:
            _append(self.path, _line(line))

    def _rewrite(self) -> None:
        """Replace the file by the pending records alone (empty when nothing is pending); a
        torn last line left by a crash goes with it."""
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        lines = [_put(e) for e in self.pending()]
        try:
            write_atomic(self.path, b"".join(_line(line) for line in lines), tmp=tmp)
        except OSError as exc:
            log.error("journal %s: could not compact: %s", self.path, exc)


def _put(entry: Entry) -> dict[str, Any]:
    """The journal line that puts an entry's record."""
    return {"n": entry.number, "put": kind_of(entry.record), "record": to_json(entry.record)}


def _line(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def _append(path: Path, data: bytes) -> None:
    """Append durably; a failing disk is logged, not raised: the supervisor must go on acting
    (the records stay in memory and are still written to the store)."""
    try:
        write_durably(path, data)
    except OSError as exc:
        log.error("journal %s: could not write (records kept in memory only): %s", path, exc)


# -- writing to the store ----------------------------------------------------------------------

class Outbox:
    """Writes journaled records to the store in order, each exactly once."""

    def __init__(
        self,
        journal: Journal,
        store: TraceStore,
        *,
        clock: Callable[[], float],
        policy: Backoff = STORE_RETRY,
    ) -> None:
        """`clock` gives seconds (any epoch); it times the waits between tries."""
        self.journal = journal
        self.store = store
        self.clock = clock
        self.policy = policy
        self._backoff = BackoffState(policy)
        self._next_try = 0.0

    def put(self, *records: Journaled) -> None:
        """Journal records (together: all or none survive a kill) and try to store them now
        (and whatever waits before them)."""
        self.journal.append(*records)
        self.flush(force=not self._backoff.failures)

    def pending(self) -> list[Entry]:
        return self.journal.pending()

    def flush(self, *, force: bool = False) -> bool:
        """Write pending records, oldest first, stopping at the first temporary failure; True
        when none is left. Waits for nothing: while the store is away, tries are spaced by the
        retry policy unless `force`."""
        if not self.journal.pending():
            return True
        if not force and self.clock() < self._next_try:
            return False
        held: dict[JobId, HeldRecords] = {}
        for entry in self._in_write_order():
            try:
                self._store_once(entry, held)
            except TemporaryStoreError as exc:
                self._failed(exc)
                return False
            except StoreError as exc:
                log.error("the store refused %s for good (copy kept beside journal %s): %s",
                          _describe(entry.record), self.journal.path, exc)
                self.journal.refused(entry, str(exc))
        if self._backoff.failures:
            log.info("store available again after %d failed tries; the journal is written",
                     self._backoff.failures)
        self._backoff.succeeded()
        return True

    def _in_write_order(self) -> list[Entry]:
        """Rank exits first (the analysis waits for them), then incidents and actions in
        journal order (an incident before its actions)."""
        return sorted(self.journal.pending(),
                      key=lambda e: (not isinstance(e.record, RankExit), e.number))

    def drain(self, timeout_s: float, sleep: Callable[[float], None]) -> bool:
        """Flush until nothing is pending or `timeout_s` passed (on `clock`); True if none is
        left (the rest stays in the journal for the next supervisor)."""
        def flushed() -> None:
            if not self.flush(force=True):
                raise TemporaryStoreError(f"{len(self.pending())} journaled records not stored")

        with contextlib.suppress(TemporaryStoreError):
            call_with_retry(flushed, policy=self.policy, deadline_s=timeout_s,
                            clock=self.clock, sleep=sleep, on_retry=None)
        return not self.pending()

    def _failed(self, exc: TemporaryStoreError) -> None:
        delay = self._backoff.failed(exc)
        self._next_try = self.clock() + delay
        if self._backoff.failures == 1:
            log.warning("store unavailable: %d records kept in journal %s until it answers: %s",
                        len(self.pending()), self.journal.path or "(memory)", exc)

    def _store_once(self, entry: Entry, held: dict[JobId, HeldRecords]) -> None:
        """Write the entry's record unless an earlier try already landed; mark it done."""
        record = entry.record
        if entry.maybe_stored and self._holds(record, held):
            log.info("%s was stored by an earlier try; not written again", _describe(record))
        else:
            entry.maybe_stored = True  # from here on a failure leaves its fate unknown
            self._write(record)
        self.journal.done(entry)

    def _write(self, record: Journaled) -> None:
        if isinstance(record, Incident):
            self.store.record_incident(record)
        elif isinstance(record, Action):
            self.store.record_action(record)
        elif isinstance(record, JobState):
            self.store.record_state(record)
        else:
            batch = Batch(batch_id=exit_batch_id(record), records=(record,))
            self.store.insert(batch, maybe_duplicate=True)

    def _holds(self, record: Journaled, held: dict[JobId, HeldRecords]) -> bool:
        """Whether the store already has the record (read once per job and flush)."""
        if isinstance(record, RankExit):
            return False  # its batch id makes a second write a no-op
        job = JobId(record.job)
        if job not in held:
            held[job] = HeldRecords.read(self.store, [job])
        return held[job].has(record)


def _describe(record: Journaled) -> str:
    if isinstance(record, Incident):
        return f"incident {record.incident_id}"
    if isinstance(record, Action):
        return f"action {ActionKind(record.kind).value} of {record.incident_id}"
    if isinstance(record, JobState):
        return f"state {record.state.value} #{record.seq} of job {record.job}"
    return f"the exit of rank {record.rank} (attempt {record.attempt})"
