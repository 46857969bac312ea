"""The supervisor's journal: a store outage of any length loses no incident, action or exit, and
stores none twice.

- A private ClickHouse server goes down (stopped) right when the supervisor acts on a crash, for
  60 s of the supervisor's time (its clock and sleep are injected: the minute passes in the
  seconds its polls and retries take, with the real server stopped all along): the incident and
  its stop/isolate/restart actions are written while it is away, the next attempt is launched
  and watched meanwhile, and once the server is back (same port, same data) every record is
  stored exactly once.
- A supervisor that ends while the store is away leaves its records in the journal; a new
  supervisor on the same journal writes them, once.
- A write that landed but looked failed (the store took it, then the connection broke) is not
  written again.

The suite's shared server (TRACEHOUND_TEST_CLICKHOUSE_URL) is never stopped here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from clickhouse_harness import RunningServer, start_server
from supervisor_fakes import Clock, S, ScriptedOrchestrator

from tracehound.controller.journal import Journal, from_json, to_json
from tracehound.controller.policy.recovery import PolicySettings
from tracehound.controller.supervision.supervisor import (
    JobSpec,
    PollView,
    RunResult,
    Supervisor,
    SupervisorSettings,
)
from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Incident,
    JobPhase,
    JobState,
    RankExit,
    now_us,
)
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore, bulk, open_store

JOB = JobId("journal")
OUTAGE_S = 60.0
SPEC = JobSpec(job=JOB, command=("python", "train.py"), nnodes=2, nproc_per_node=1,
               spare_nodes=1)
RESTART = [ActionKind.STOP_JOB, ActionKind.ISOLATE_NODE, ActionKind.RESTART]


class CrashThenClean:
    """The job: rank 1 of attempt 0 is killed; every rank of a later attempt exits cleanly.
    `on_crash_seen` runs once the crash is in the store, before the verdict is acted on."""

    def __init__(self, orch: ScriptedOrchestrator, clock: Any = now_us,
                 on_crash_seen: Any = None) -> None:
        self.orch = orch
        self.clock = clock
        self.on_crash_seen = on_crash_seen
        self.queued: set[int] = set()

    def __call__(self, view: PollView) -> None:
        nodes = self.orch.plans[-1].rank_nodes()
        if view.attempt == 0 and view.snapshot.exits and self.on_crash_seen is not None:
            self.on_crash_seen()
            self.on_crash_seen = None
        if view.attempt in self.queued:
            return
        self.queued.add(view.attempt)
        ranks = [1] if view.attempt == 0 else sorted(nodes)
        self.orch.exits = [
            RankExit(job=JOB, attempt=view.attempt, node=NodeId(nodes[r]), rank=Rank(r),
                     pid=1000 + r, exit_code=-9 if view.attempt == 0 else 0,
                     time_us=self.clock())
            for r in ranks
        ]


class FlakyStore:
    """A store whose incident and action writes fail: `down` ones without writing, `landed`
    ones after writing (the store took it, the answer was lost). Reads pass."""

    def __init__(self, store: TraceStore) -> None:
        self.store = store
        self.down = False
        self.land_then_fail: set[str] = set()
        """Kinds ("incident", "action") whose next write lands and then fails."""
        self.writes: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def record_incident(self, incident: Incident) -> None:
        self._write("incident", lambda: self.store.record_incident(incident))

    def record_action(self, action: Action) -> None:
        self._write("action", lambda: self.store.record_action(action))

    def record_state(self, state: JobState) -> None:
        self._write("state", lambda: self.store.record_state(state))

    def _write(self, kind: str, write: Any) -> None:
        self.writes.append(kind)
        if self.down:
            raise TemporaryStoreError(f"{kind}: store down", retry_after=0.0)
        write()
        if kind in self.land_then_fail:
            self.land_then_fail.discard(kind)
            raise TemporaryStoreError(f"{kind}: connection reset after the write")


def supervisor(store: TraceStore, orch: ScriptedOrchestrator, journal: Path, **kwargs: Any
               ) -> Supervisor:
    return Supervisor(spec=SPEC, store=store, orchestrator=orch, journal_path=journal, **kwargs)


def assert_stored_exactly_once(store: TraceStore, result: RunResult) -> None:
    """Every incident and action of the run is in the store once, as the supervisor made it;
    counted from the raw rows (duplicates included) and through `incidents()`."""
    raw_incidents = bulk(store).records(Incident, JOB)
    raw_actions = bulk(store).records(Action, JOB)
    assert [to_json(i) for i in raw_incidents] == [to_json(i) for i in result.incidents]
    expected_actions = [a for i in result.incidents for a in i.actions]
    assert sorted(map(_key, raw_actions)) == sorted(map(_key, expected_actions))
    assert len(raw_actions) == len(expected_actions)
    stored = store.incidents(JOB)
    assert [(i.incident_id, [a.kind for a in i.actions]) for i in stored] == [
        (i.incident_id, [a.kind for a in i.actions]) for i in result.incidents
    ]
    states = store.job_states(JOB)
    assert [s.seq for s in states] == list(range(1, len(states) + 1)), "each state once"


def _key(action: Action) -> tuple[Any, ...]:
    return (action.incident_id, ActionKind(action.kind).value, action.target, action.time_us,
            action.ok, action.detail)


# -- a 60 s outage of a real server ------------------------------------------------------------

class Outage:
    """Stops a private server when told, and starts it again (same port and data) from the
    supervisor's sleep once it has been down for `length_s` of the supervisor's clock, which that
    sleep advances without waiting."""

    def __init__(self, server: RunningServer, length_s: float, clock: Clock) -> None:
        self.server = server
        self.length_s = length_s
        self.clock = clock
        self.began = 0.0
        self.ended = 0.0
        """When the outage began and ended, in seconds of the supervisor's clock."""
        self.pending_during: list[int] = []
        self.states_pending: list[list[str]] = []
        self.supervisor: Supervisor | None = None

    def now(self) -> float:
        return self.clock() / S

    def begin(self) -> None:
        self.server.stop()
        self.began = self.now()

    def sleep(self, seconds: float) -> None:
        self.clock.sleep(seconds)
        if not self.began or self.ended:
            return
        if self.supervisor is not None:
            self.pending_during.append(sum(not isinstance(e.record, JobState)
                                           for e in self.supervisor.outbox.pending()))
            self.states_pending.append(sorted({e.record.state.value
                                               for e in self.supervisor.outbox.pending()
                                               if isinstance(e.record, JobState)}))
        if self.now() - self.began >= self.length_s:
            self.ended = self.now()
            self.server = start_server(self.server.workdir, tcp_port=self.server.tcp_port)


@pytest.mark.e2e
@pytest.mark.clickhouse_server
def test_a_60_s_outage_while_acting_loses_nothing_and_stores_nothing_twice(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path / "clickhouse")
    clock = Clock()
    outage = Outage(server, OUTAGE_S, clock)
    try:
        store = open_store(server.url)
        orch = ScriptedOrchestrator(clock=outage.now)
        sup = supervisor(
            store, orch, tmp_path / "journal.jsonl", clock=clock, sleep=outage.sleep,
            observer=CrashThenClean(orch, clock, on_crash_seen=outage.begin),
            settings=SupervisorSettings(poll_s=0.5),
        )
        outage.supervisor = sup
        try:
            result = sup.run()
        finally:
            store.close()
        assert outage.ended - outage.began >= OUTAGE_S

        assert result.completed is True and result.attempts == 2
        assert orch.isolated == ["node-1"] and orch.stopped == 1
        (incident,) = result.incidents
        assert incident.kind == "crash" and incident.culprit_ranks == (1,)
        assert [a.kind for a in incident.actions] == RESTART
        # It acted while the server was away: the incident, its actions and the next attempt
        # all happened during the outage, with the records waiting in the journal.
        assert outage.began * S <= incident.detected_at_us < outage.ended * S
        assert outage.began <= orch.launched_at[1] < outage.ended
        assert max(outage.pending_during) == 4, "the incident and its 3 actions waited"
        assert max(outage.states_pending, key=len) == [
            "diagnosing", "isolating", "restarting", "running"], "and the job's states"

        again = open_store(outage.server.url)
        try:
            assert_stored_exactly_once(again, result)
            assert [e.rank for e in again.exits(JOB, 0)] == [1]
            assert [e.rank for e in again.exits(JOB, 1)] == [0, 1]
        finally:
            again.close()
        assert (tmp_path / "journal.jsonl").read_bytes() == b"", "nothing left pending"
    finally:
        outage.server.stop()


# -- replay and exactly once, on each adapter --------------------------------------------------

def test_a_new_supervisor_on_the_same_journal_stores_what_the_last_one_left(
    store: TraceStore, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    flaky = FlakyStore(store)
    flaky.down = True
    clock = Clock()
    orch = ScriptedOrchestrator()
    first = supervisor(
        cast(TraceStore, flaky), orch, journal, clock=clock, sleep=clock.sleep,
        observer=CrashThenClean(orch, clock), settings=SupervisorSettings(
            policy=PolicySettings(max_restarts=0), journal_drain_s=3.0),
    )
    result = first.run()
    assert result.completed is False and "gave up" in result.reason
    (incident,) = result.incidents
    assert [a.kind for a in incident.actions] == [ActionKind.STOP_JOB, ActionKind.GIVE_UP]
    assert store.incidents(JOB) == [], "the store was away for the whole run"
    left = Journal(journal).pending()
    assert [to_json(e.record) for e in left if not isinstance(e.record, JobState)] == [
        to_json(r) for r in (incident, *incident.actions)
    ]
    assert [e.record.state for e in left if isinstance(e.record, JobState)] == [
        JobPhase.RUNNING, JobPhase.DIAGNOSING, JobPhase.FAILED]
    assert all(e.maybe_stored for e in left), "a journal read back is checked before writing"

    # A write of the first supervisor landed after all (its answer was lost).
    store.record_incident(incident)
    orch = ScriptedOrchestrator()
    second = supervisor(store, orch, journal, clock=clock, sleep=clock.sleep,
                        observer=CrashThenClean(orch, clock))
    second.outbox.flush(force=True)
    assert second.outbox.pending() == []
    assert_stored_exactly_once(store, result)
    assert journal.read_bytes() == b""


def test_a_write_that_landed_but_looked_failed_is_not_written_again(
    store: TraceStore, tmp_path: Path
) -> None:
    flaky = FlakyStore(store)
    flaky.land_then_fail = {"incident", "action"}
    clock = Clock()
    orch = ScriptedOrchestrator()
    sup = supervisor(cast(TraceStore, flaky), orch, tmp_path / "journal.jsonl", clock=clock,
                     sleep=clock.sleep, observer=CrashThenClean(orch, clock))
    result = sup.run()
    assert result.completed is True and result.attempts == 2
    (incident,) = result.incidents
    assert [a.kind for a in incident.actions] == RESTART
    assert flaky.writes.count("incident") == 1, "found in the store, not written again"
    assert flaky.writes.count("action") == 3
    assert_stored_exactly_once(store, result)


def test_the_journal_keeps_pending_records_across_a_reopen_and_skips_a_torn_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    records = [
        Incident(job=JOB, incident_id="journal/0/1", attempt=0, detected_at_us=5 * S,
                 kind="crash", culprit_ranks=(1,), culprit_nodes=("node-1",), confidence=0.75,
                 summary="rank 1 was killed", verdict_json='{"k": 1}'),
        Action(job=JOB, incident_id="journal/0/1", kind=ActionKind.ISOLATE_NODE,
               target="node-1", time_us=6 * S, ok=True, detail="isolated"),
        RankExit(job=JOB, attempt=0, node=NodeId("node-1"), rank=Rank(1), pid=7, exit_code=-9,
                 time_us=4 * S),
    ]
    entries = [journal.append(r)[0] for r in records]
    journal.done(entries[1])
    with open(path, "ab") as handle:
        handle.write(b'{"n": 9, "put": "incid')  # a crash in the middle of an append

    again = Journal(path)
    assert [to_json(e.record) for e in again.pending()] == [
        to_json(records[0]), to_json(records[2])
    ]
    assert [type(e.record) for e in again.pending()] == [Incident, RankExit]
    assert b"incid\n" not in path.read_bytes() and path.read_bytes().count(b"\n") == 2
    for entry in again.pending():
        again.done(entry)
    assert path.read_bytes() == b""
    assert Journal(path).pending() == []


def test_records_round_trip_through_their_journal_json() -> None:
    action = Action(job=JOB, incident_id="i", kind=ActionKind.RESTART, target="attempt 1",
                    time_us=1, ok=False, detail="")
    assert from_json("action", to_json(action)) == action
    assert to_json(action)["kind"] == "restart"
    with pytest.raises(ValueError, match="unknown"):
        from_json("verdict", {})
