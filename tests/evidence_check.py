"""One check for every fact: an incident's evidence must agree with what the store holds.

Every fact of a verdict that names a rank, a process group and a sequence id says something
about where that rank was in that group when the verdict was made (`observed_at_us`, the
detection). The stored collective records (one per collective a rank completed or failed) and
heartbeats of that rank say the same thing from another side; `contradictions` lists where they
disagree:

- a laggard's position (`lagging`, "never entered #S ... last entered #K", "was not seen
  entering #S ... completed #K"): no record of the rank past #K completed before detection,
  and no heartbeat past #K sent before it (K is the furthest of both, never less);
- a rank that entered #S and froze there, or has waited in #S, or is one of the others that
  have not entered #S: no record of the rank at #S or later completed before detection;
- a rank waiting in #S, entered and frozen, or calling #S against its peers (`differs`): some
  record or heartbeat of the rank shows it issued #S (the fact is grounded).

"Before detection" leaves out the last `SLACK_US`: a record or heartbeat on its way (in a
node agent's spool) when the verdict was made could not have been read by it.

The golden traces, the Flight Recorder import and the analysis tests run it, and every test of
a real job that records an incident (`assert_facts_agree`). A real job's incidents are held to
what the store held when each verdict read it: a fact must not be behind the rows the store
stamped (`schema.ARRIVAL`, to the second) a second or more before the verdict's snapshot, and
what a fact says a rank issued must be in a row stamped no later than a second after it. A rank
stopped by SIGSTOP ships the records and heartbeats it still held when it is continued or killed,
after the verdict, with times from before it; and a record may arrive between the verdict's
reading and its incident.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tracehound.tracing.events import CollectiveEvent, CollectiveState, Heartbeat, Incident
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore

SLACK_US = 1_000_000
"""Records and heartbeats stored this close before a detection may have been on their way."""

ARRIVAL_SLACK_US = 1_000_000
"""How much earlier than a verdict's snapshot a row must have been stamped by the store to have
surely been there for it (`schema.ARRIVAL` is to the second)."""

POSITION_FACTS = ("lagging", "waiting", "differs")
"""The facts that say where a rank was in a group at a sequence id."""


class _Rank:
    """One rank's records and heartbeats in one group of one attempt."""

    def __init__(self, records: Sequence[CollectiveEvent], beats: Sequence[Heartbeat],
                 group: str) -> None:
        self.done = sorted((r.seq, r.complete_us) for r in records
                           if r.group == group and r.state == CollectiveState.COMPLETED)
        self.seqs = {r.seq for r in records if r.group == group}
        self.beats = sorted(
            (hb.time_us, g.last_enqueued, g.last_completed)
            for hb in beats for g in hb.groups if g.group == group
        )

    def completed_by(self, until_us: int) -> int:
        """The highest seq completed before `until_us` by the records (0: none)."""
        return max((seq for seq, at in self.done if at <= until_us), default=0)

    def heard_by(self, until_us: int) -> int:
        """The highest seq entered by the heartbeats sent before `until_us` (0: none)."""
        return max((enq for at, enq, _ in self.beats if at <= until_us), default=0)

    def issued(self, seq: int, until_us: int) -> bool:
        """Whether a record or a heartbeat sent by `until_us` shows the rank issued `seq`."""
        return seq in self.seqs or any(enq >= seq for at, enq, _ in self.beats
                                       if at <= until_us)


def _claims(fact: Mapping[str, Any]) -> tuple[int | None, bool, bool]:
    """What a position fact claims: (the furthest seq it says the rank reached, or None; that
    the rank had not completed the fact's seq; that it had issued it)."""
    kind, detail, seq = fact["fact"], str(fact.get("detail", "")), int(fact["seq"])
    value = float(fact.get("value", 0.0))
    if kind == "lagging" and "other rank(s)" in detail:
        return None, True, False  # the blocked ones behind a culprit: not at #seq either
    if kind == "lagging":
        froze_in_it = "froze there" in detail
        return (seq if froze_in_it else seq - round(value)), froze_in_it, froze_in_it
    if kind == "waiting" and "has waited" in detail:
        return None, True, True
    if kind == "waiting":  # a crashed rank was inside #seq when it last reported
        return None, False, True
    return None, False, True  # differs: it called #seq


def contradictions(records: Sequence[CollectiveEvent], beats: Sequence[Heartbeat],
                   incident: Mapping[str, Any], *,
                   readable: tuple[Sequence[CollectiveEvent], Sequence[Heartbeat]] | None = None,
                   ) -> tuple[list[str], int]:
    """The facts of one incident (as `tracehound incidents --json` lists it, or its stored
    verdict) that the records and heartbeats of its attempt contradict, in words; and how many
    facts were checked. `records` and `beats` are what the verdict surely could read (a fact
    must not be behind them); `readable`, if other, all it might have read (what a fact says
    was issued must be there): by default the same."""
    verdict = incident.get("verdict") or incident
    attempt = int(incident["attempt"])
    until = int(verdict["observed_at_us"]) - SLACK_US
    found: list[str] = []
    checked = 0
    for fact in verdict.get("evidence", ()):
        if fact.get("fact") not in POSITION_FACTS or not fact.get("group") or not fact.get("seq"):
            continue
        rank, group, seq = int(fact["rank"]), str(fact["group"]), int(fact["seq"])
        mine = _Rank([r for r in records if r.attempt == attempt and r.rank == rank],
                     [b for b in beats if b.attempt == attempt and b.rank == rank], group)
        seen = mine if readable is None else _Rank(
            [r for r in readable[0] if r.attempt == attempt and r.rank == rank],
            [b for b in readable[1] if b.attempt == attempt and b.rank == rank], group)
        reach, not_done, issued = _claims(fact)
        checked += 1
        where = f"{incident.get('incident_id', '?')} {fact['fact']} rank {rank} #{seq} of {group}"
        done = mine.completed_by(until)
        if reach is not None and done > reach:
            found.append(f"{where}: says it reached #{reach}; its records completed #{done} "
                         f"before detection ({fact['detail']})")
        if reach is not None and mine.heard_by(until) > reach:
            found.append(f"{where}: says it reached #{reach}; its heartbeats said "
                         f"#{mine.heard_by(until)} before detection ({fact['detail']})")
        if not_done and done >= seq:
            found.append(f"{where}: says it had not completed #{seq}; its records completed "
                         f"#{done} before detection ({fact['detail']})")
        if issued and not seen.issued(seq, until + SLACK_US):
            found.append(f"{where}: says it issued #{seq}; no record or heartbeat of it shows "
                         f"that ({fact['detail']})")
    return found, checked


def check_incidents(store: TraceStore, job: str,
                    incidents: Iterable[Mapping[str, Any] | Incident] | None = None, *,
                    as_stored: bool = False) -> int:
    """Runs `contradictions` over the job's incidents (default: every stored one) and fails
    with all that contradict their records; returns how many facts were checked.

    `as_stored`: against the records and heartbeats the store surely held when each verdict
    read it (`TraceStore.records(..., stored_by_us=)`), for a job that ran live on this
    machine. A rank stopped by SIGSTOP ships what it still held when it is continued or killed,
    after the verdict, stamped before it: the verdict could not have read those. Without it,
    against everything stored (traces loaded after the fact carry no such arrivals)."""
    import json

    if incidents is None:
        incidents = store.incidents(JobId(job))
    listed = [
        {"incident_id": i.incident_id, "attempt": i.attempt,
         "verdict": json.loads(i.verdict_json)} if isinstance(i, Incident) else i
        for i in incidents
    ]
    every: tuple[list[CollectiveEvent], list[Heartbeat]] | None = None
    problems: list[str] = []
    checked = 0
    for incident in listed:
        readable = None
        if as_stored:
            # the store stamps arrivals to the second: a row stamped a whole second before the
            # verdict's snapshot had surely arrived when the verdict read the store, and one
            # stamped a second after it surely had not
            at = int((incident.get("verdict") or incident)["observed_at_us"])
            by, maybe = at - ARRIVAL_SLACK_US, at + ARRIVAL_SLACK_US
            held = (store.records(CollectiveEvent, JobId(job), stored_by_us=by),
                    store.records(Heartbeat, JobId(job), stored_by_us=by))
            readable = (store.records(CollectiveEvent, JobId(job), stored_by_us=maybe),
                        store.records(Heartbeat, JobId(job), stored_by_us=maybe))
        else:
            every = every or (store.records(CollectiveEvent, JobId(job)),
                              store.records(Heartbeat, JobId(job)))
            held = every
        found, n = contradictions(*held, incident, readable=readable)
        problems += found
        checked += n
    assert not problems, "facts the stored records contradict:\n" + "\n".join(problems)
    return checked


def assert_facts_agree(store_url: str, job: str) -> int:
    """`check_incidents` as stored, on the store of a real job that ran here, by its URL, once
    the job has ended; how many facts were checked."""
    from tracehound.tracing.store import open_store

    store = open_store(store_url, create=False)
    try:
        return check_incidents(store, job, as_stored=True)
    finally:
        store.close()
