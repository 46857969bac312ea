"""Pollers of a node's other sources of evidence: GPU and host health, NCCL RAS and Inspector.

A `Source` is read every `interval_s` seconds by the node agent's `SourcePoller` thread and
returns records (health samples, collectives, ...) that go to the agent's spool like the ranks'
own. Sources are adapters of outside systems (NVML, `/sys`, a local TCP port, files); each is
polled on its own schedule, and one that raises is counted and logged (once per kind of error)
and polled again at its next turn: a broken source never stops the agent or the other sources.

Nothing here runs inside a training process.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tracehound.tracing import logs
from tracehound.tracing.events import Record, now_us

log = logging.getLogger(__name__)

Emit = Callable[[Sequence[Record]], None]
"""Where a poller's records go (the agent's spool). May raise; the poller counts and goes on."""


class Source(Protocol):
    """One outside source of records, polled by the node agent."""

    name: str
    """Short name for logs and stats (`gpu`, `host`, `nccl_ras`, ...)."""

    interval_s: float
    """Seconds between polls (> 0)."""

    def poll(self, now_us: int) -> Sequence[Record]:
        """The records this source has now (may be empty). May raise: the poller counts it."""
        ...

    def close(self) -> None:
        """Release what the source holds (handles, sockets); called once, at the agent's stop."""
        ...


@dataclass
class SourceStats:
    """Per source: polls done, records emitted, polls that raised, records the spool refused."""

    polls: dict[str, int] = field(default_factory=dict)
    records: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    emit_failed: int = 0


class SourcePoller:
    """Polls each source on its own interval in one thread; `clock` (monotonic seconds) and
    `wall_us` are injectable so tests can drive `tick` directly."""

    def __init__(
        self,
        sources: Sequence[Source],
        emit: Emit,
        *,
        job: str = "",
        node: str = "",
        clock: Callable[[], float] = time.monotonic,
        wall_us: Callable[[], int] = now_us,
    ) -> None:
        for source in sources:
            if not source.interval_s > 0:
                raise ValueError(f"source {source.name!r}: interval_s must be > 0, "
                                 f"got {source.interval_s!r}")
        self.sources = list(sources)
        self.emit = emit
        self.clock = clock
        self.wall_us = wall_us
        self.stats = SourceStats()
        self.log = logs.JobLogger(log, job=job, node=node)
        self._due = {id(s): 0.0 for s in self.sources}
        self._logged: set[tuple[str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> float:
        """Poll the sources that are due; returns seconds until the next one is."""
        now = self.clock()
        for source in self.sources:
            key = id(source)
            if now < self._due[key]:
                continue
            self._due[key] = now + source.interval_s
            self._poll(source)
        if not self.sources:
            return 1.0
        return max(0.0, min(self._due.values()) - self.clock())

    def _poll(self, source: Source) -> None:
        name = source.name
        self.stats.polls[name] = self.stats.polls.get(name, 0) + 1
        try:
            records = list(source.poll(self.wall_us()))
        except Exception as exc:
            self.stats.errors[name] = self.stats.errors.get(name, 0) + 1
            kind = (name, type(exc).__name__)
            if kind not in self._logged:
                self._logged.add(kind)
                self.log.warning("source %s failed: %r (logged once per kind of error; "
                                 "counted in source_errors)", name, exc)
            return
        if not records:
            return
        try:
            self.emit(records)
        except Exception as exc:
            self.stats.emit_failed += len(records)
            self.log.warning("could not spool %d records of source %s: %r",
                             len(records), name, exc)
            return
        self.stats.records[name] = self.stats.records.get(name, 0) + len(records)

    def start(self) -> None:
        if self._thread is not None or not self.sources:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tracehound-node-sources",
                                        daemon=True)
        self._thread.start()
        self.log.info("polling %s", ", ".join(f"{s.name} every {s.interval_s:g}s"
                                              for s in self.sources))

    def _run(self) -> None:
        wait = 0.0
        while not self._stop.wait(wait):
            try:
                wait = self.tick()
            except Exception as exc:
                self.log.exception("source round failed: %r", exc)
                wait = 1.0

    def stop(self, timeout_s: float = 2.0) -> bool:
        """Stop the thread and close every source; True if the thread ended in time."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=timeout_s)
        for source in self.sources:
            try:
                source.close()
            except Exception as exc:
                self.log.warning("source %s did not close cleanly: %r", source.name, exc)
        return thread is None or not thread.is_alive()

    def flat_stats(self) -> dict[str, int]:
        """Totals for the agent's stats file: source_polls, source_records, source_errors."""
        s = self.stats
        return {
            "source_polls": sum(s.polls.values()),
            "source_records": sum(s.records.values()),
            "source_errors": sum(s.errors.values()),
            "source_emit_failed": s.emit_failed,
        }
