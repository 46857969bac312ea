"""A controller killed in each state of the job's state machine, and started again on the same
journal and store, finishes the recovery exactly once.

The kill is simulated in-process: the moment the supervisor has journaled the state (or taken
the step) named by the test, an exception no code catches unwinds it, and its journal is not
drained (a SIGKILLed controller writes nothing more). The ranks live in a `World` that outlives
both controllers, as real rank processes outlive a killed controller (they run in sessions of
their own); a second supervisor with a fresh orchestrator on that world must adopt what runs,
finish the plan the first one started and launch each attempt once. The real processes are
killed for real in test_run_controller_kill.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from store_urls import on_adapter
from supervisor_fakes import Clock, S, clean_exits, heartbeat

from tracehound.analysis.settings import DetectionSettings, HangSettings
from tracehound.controller.cli.status import format_status, job_status
from tracehound.controller.orchestrators.port import AttemptPlan, Launched
from tracehound.controller.supervision.jobstate import read_history
from tracehound.controller.supervision.supervisor import (
    JobSpec,
    PollView,
    Supervisor,
    SupervisorSettings,
)
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Batch,
    Incident,
    JobPhase,
    JobState,
    RankExit,
)
from tracehound.tracing.ids import JobId, NodeId
from tracehound.tracing.store import TraceStore

JOB = JobId("kill")
SPEC = JobSpec(job=JOB, command=("python", "train.py"), nnodes=2, nproc_per_node=2,
               spare_nodes=1)


class Killed(BaseException):
    """The controller's process ends here (nothing catches a BaseException in the loop)."""


@dataclass
class World:
    """The rank processes, which outlive any controller."""

    running: dict[int, AttemptPlan] = field(default_factory=dict)
    launches: list[int] = field(default_factory=list)
    isolations: list[str] = field(default_factory=list)
    stops: int = 0


@dataclass
class Orch:
    """One controller's orchestrator over the shared world."""

    world: World
    on_launch: Callable[[AttemptPlan], None] | None = None
    current: AttemptPlan | None = None
    exits: list[RankExit] = field(default_factory=list)
    killed: bool = False

    def launch(self, plan: AttemptPlan) -> Launched:
        self.world.launches.append(plan.attempt)
        self.world.running[plan.attempt] = plan
        self.current = plan
        if self.on_launch is not None:
            self.on_launch(plan)
        return Launched(cold=plan.world_size)

    def wait_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> bool:
        sleep(timeout_s)
        return False

    def warm_up(self) -> None:
        pass

    def adopt(self, plan: AttemptPlan) -> bool:
        found = self.world.running.get(plan.attempt)
        if found is None:
            return False
        assert found.nodes == plan.nodes, "adopted on the nodes it was launched on"
        self.current = found
        return True

    def kill_leftovers(self, attempt: int) -> int:
        return 1 if self.world.running.pop(attempt, None) is not None else 0

    def poll_exits(self) -> list[RankExit]:
        out, self.exits = self.exits, []
        return out

    def pid_of(self, rank: int) -> int | None:
        return 1000 + rank

    def finish(self) -> None:
        if self.current is not None:
            self.world.running.pop(self.current.attempt, None)

    def stop(self, *, grace_s: float = 3.0) -> None:
        self.world.stops += 1
        if self.current is not None:
            self.world.running.pop(self.current.attempt, None)

    def isolate(self, node: NodeId, *, reason: str) -> None:
        self.world.isolations.append(node)

    def close(self) -> None:
        if not self.killed and self.current is not None:
            self.world.running.pop(self.current.attempt, None)


beat = functools.partial(heartbeat, JOB)


class Ranks:
    """Attempt 0: rank 3 stops at #40 while 0-2 wait in #41 (a hang). Later attempts train and
    exit cleanly at their second poll."""

    def __init__(self, store: TraceStore, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self.stall_at = clock.now + 2 * S
        self.polls: dict[int, int] = {}
        self.n = 0

    def __call__(self, view: PollView, orch: Orch) -> None:
        self.n += 1
        plan = orch.current
        assert plan is not None and plan.attempt == view.attempt
        nodes = plan.rank_nodes()
        now = self.clock.now
        self.polls[view.attempt] = self.polls.get(view.attempt, 0) + 1
        if view.attempt == 0:
            beats = [beat(0, r, now, 41, 40, self.stall_at, nodes[r]) for r in range(3)]
            beats.append(beat(0, 3, self.stall_at, 40, 40, self.stall_at - S // 10, nodes[3]))
        else:
            beats = [beat(view.attempt, r, now, 5, 5, now, nodes[r]) for r in range(4)]
            if self.polls[view.attempt] >= 2:
                orch.exits = clean_exits(JOB, view.attempt, nodes, now)
        self.store.insert(Batch(batch_id=f"b{self.n}", records=tuple(beats)))


def controller(store: TraceStore, tmp_path: Path, clock: Clock, ranks: Ranks, orch: Orch,
               kill: Callable[[Supervisor, object], None] | None = None) -> Supervisor:
    sup = Supervisor(
        spec=SPEC, store=store, orchestrator=orch, clock=clock, sleep=clock.sleep,
        observer=lambda view: ranks(view, orch),
        settings=SupervisorSettings(
            poll_s=0.5, detection=DetectionSettings(hang=HangSettings(after_s=5.0))),
        journal_path=tmp_path / "journal.jsonl",
    )
    if kill is not None:
        append = sup.journal.append

        def append_then_maybe_die(*records: object) -> object:
            entries = append(*records)  # type: ignore[arg-type]
            for record in records:
                kill(sup, record)
            return entries

        sup.journal.append = append_then_maybe_die  # type: ignore[method-assign]
        sup._drain_journal = lambda: None  # type: ignore[method-assign]
    return sup


def when_state(phase: JobPhase, attempt: int) -> Callable[[Supervisor, object], None]:
    def kill(sup: Supervisor, record: object) -> None:
        if isinstance(record, JobState) and record.state is phase and record.attempt == attempt:
            sup.orch.killed = True  # type: ignore[attr-defined]
            raise Killed(phase.value)
    return kill


def when_action(kind: ActionKind) -> Callable[[Supervisor, object], None]:
    def kill(sup: Supervisor, record: object) -> None:
        if getattr(record, "kind", None) == kind:
            sup.orch.killed = True  # type: ignore[attr-defined]
            raise Killed(kind.value)
    return kill


KILLS = {
    "diagnosing": when_state(JobPhase.DIAGNOSING, 0),
    "isolating": when_state(JobPhase.ISOLATING, 0),
    "isolating, node isolated": when_action(ActionKind.ISOLATE_NODE),
    "restarting": when_state(JobPhase.RESTARTING, 1),
    "restart recorded": when_action(ActionKind.RESTART),
    # attempt 1 launched and running, its first steps not yet measured: the incident still
    # waits for its `resumed`, which the next controller records
    "running again": when_state(JobPhase.RUNNING, 1),
}


def in_turn(name: str, *values: object) -> pytest.MarkDecorator:
    """Parametrize `name` over `values`, each on one adapter in turn (embedded, server,
    cluster): every kill point once, every adapter under several of them, instead of every
    pair (three times the CI run's time for the same steps of the supervisor)."""
    adapters = ("embedded", "server", "cluster")
    return pytest.mark.parametrize(
        ("store_url", name),
        [on_adapter(adapters[i % len(adapters)], v) for i, v in enumerate(values)],
        indirect=["store_url"])


@in_turn("where", "running", *KILLS, "restarting, attempt launched")
def test_a_controller_killed_mid_recovery_finishes_it_exactly_once(
    store: TraceStore, tmp_path: Path, where: str
) -> None:
    clock = Clock()
    world = World()
    ranks = Ranks(store, clock)
    first_orch = Orch(world)
    if where == "restarting, attempt launched":
        def die_after_launch(plan: AttemptPlan) -> None:
            if plan.attempt == 1:
                first_orch.killed = True
                raise Killed("launched")
        first_orch.on_launch = die_after_launch
        kill = None
    elif where == "running":
        kill = None
    else:
        kill = KILLS[where]
    first = controller(store, tmp_path, clock, ranks, first_orch, kill)
    if where == "running":  # killed at the 4th poll of attempt 0, before the hang is seen
        observe = first.observer
        assert observe is not None

        def die_at_fourth_poll(view: PollView) -> None:
            observe(view)
            if ranks.polls.get(0) == 4:
                first_orch.killed = True
                raise Killed("running")
        first.observer = die_at_fourth_poll
    with pytest.raises(Killed):
        first.run()

    second_orch = Orch(world)
    second = controller(store, tmp_path, clock, ranks, second_orch)
    result = second.run()

    assert result.completed is True, result.reason
    assert world.launches == [0, 1], "each attempt launched once"
    assert world.isolations == ["node-1"], "node-1 isolated once"
    (incident,) = store.incidents(JOB)
    assert incident.kind == "hang" and incident.culprit_nodes == ("node-1",)
    kinds = [a.kind for a in incident.actions]
    assert kinds[:3] == [ActionKind.STOP_JOB, ActionKind.ISOLATE_NODE, ActionKind.RESTART]
    assert kinds[3:] == [ActionKind.RESUMED], kinds
    assert [a.target for a in incident.actions][:3] == ["attempt 0", "node-1", "attempt 1"]
    assert not world.running, "nothing left running"

    states = store.job_states(JOB)
    assert [s.seq for s in states] == list(range(1, len(states) + 1)), "each state once"
    phases = [s.state for s in states]
    assert phases[0] is JobPhase.RUNNING and phases[-1] is JobPhase.FINISHED
    assert JobPhase.DIAGNOSING in phases and JobPhase.RESTARTING in phases
    assert states[-1].isolated == ("node-1",) and states[-1].nodes == ("node-0", "node-2")
    assert len({s.controller for s in states}) == 1, "one process wrote both (in-process)"
    assert (tmp_path / "journal.jsonl").read_bytes() == b""
    assert read_history(store, JOB, []).latest == states[-1]


def test_a_controller_started_on_a_finished_job_starts_a_new_run(
    store: TraceStore, tmp_path: Path
) -> None:
    clock = Clock()
    world = World()
    ranks = Ranks(store, clock)
    first = controller(store, tmp_path, clock, ranks, Orch(world))
    assert first.run().completed
    again = controller(store, tmp_path, clock, ranks, Orch(world))
    again.run()
    assert world.launches == [0, 1, 0, 1], "a new run: attempt 0 again"
    ids = [i.incident_id for i in store.incidents(JOB)]
    assert len(ids) == len(set(ids)) == 2, "incident numbers go on across runs"
    seqs = [s.seq for s in store.job_states(JOB)]
    assert seqs == list(range(1, len(seqs) + 1))


@in_turn("phase", JobPhase.SUSPECT, JobPhase.STALLED)
def test_a_controller_killed_while_watching_adopts_the_attempt_and_records_nothing_twice(
    store: TraceStore, tmp_path: Path, phase: JobPhase
) -> None:
    """The first controller is represented by what it left in the store: attempt 0 launched on
    node-0 and node-1, a watched incident (observed only) and the state naming it."""
    clock = Clock()
    world = World()
    plan = AttemptPlan(job=JOB, attempt=0, nodes=(NodeId("node-0"), NodeId("node-1")),
                       nproc_per_node=2, command=SPEC.command)
    world.running[0] = plan
    world.launches.append(0)
    watched = Incident(
        job=JOB, incident_id=f"{JOB}/0/1", attempt=0, detected_at_us=clock.now, kind="stall",
        culprit_ranks=(3,), culprit_nodes=("node-1",), confidence=0.5, summary="busy",
        verdict_json='{"group": "0", "evidence": []}')
    store.record_incident(watched)
    store.record_action(Action(job=JOB, incident_id=watched.incident_id,
                               kind=ActionKind.OBSERVE, target="node-1", time_us=clock.now,
                               ok=True))
    for seq, state in enumerate((JobPhase.RUNNING, phase), 1):
        store.record_state(JobState(job=JOB, time_us=clock.now + seq, seq=seq, state=state,
                                    attempt=0, nodes=plan.nodes, controller="gone:1",
                                    incident_id=watched.incident_id if seq == 2 else ""))
    ranks = Ranks(store, clock)
    result = controller(store, tmp_path, clock, ranks, Orch(world)).run()

    assert result.completed is True, result.reason
    assert world.launches == [0, 1], "attempt 0 adopted, not launched again"
    assert [i.kind for i in store.incidents(JOB)] == ["stall", "hang"]
    states = store.job_states(JOB)
    assert [s.seq for s in states] == list(range(1, len(states) + 1))
    assert [s.controller for s in states][:2] == ["gone:1", "gone:1"]


def test_status_names_the_state_attempts_isolated_nodes_and_open_incidents(
    store: TraceStore, tmp_path: Path
) -> None:
    clock = Clock()
    world = World()
    ranks = Ranks(store, clock)
    first = controller(store, tmp_path, clock, ranks, Orch(world),
                       when_state(JobPhase.RESTARTING, 1))
    with pytest.raises(Killed):
        first.run()
    first.outbox.flush(force=True)  # what a killed controller journaled: read by `status` too

    status = job_status(store, JOB)
    assert status is not None
    assert (status["state"], status["attempt"], status["ended"]) == ("restarting", 1, False)
    assert status["isolated"] == ["node-1"] and status["attempts"] == [0, 1]
    (open_,) = status["open_incidents"]
    assert open_["kind"] == "hang" and [a["kind"] for a in open_["actions"]] == [
        "stop_job", "isolate_node", "restart"]
    assert [a["rule"] for a in open_["actions"]] == ["rules.hang.isolate_from"] * 3
    text = format_status(status)
    assert "restarting (attempt 1)" in text and "isolated: node-1" in text
    assert "open incidents: 1" in text

    controller(store, tmp_path, clock, ranks, Orch(world)).run()
    status = job_status(store, JOB)
    assert status is not None and status["state"] == "finished"
    assert status["open_incidents"] == [] and status["incidents"] == 1
    assert job_status(store, JobId("nobody")) is None


@in_turn("where", "diagnosing", "isolating, node isolated")
def test_an_alert_recorded_on_the_incident_changes_nothing_for_the_next_controller(
    store: TraceStore, tmp_path: Path, where: str
) -> None:
    """The firing alert reached a receiver (its `alert` action stored, as `AlertRecorder`
    stores it, later than anything the first controller did) before the second controller
    picks the plan up: it carries out the same steps, once each, in the same order."""
    clock = Clock()
    world = World()
    ranks = Ranks(store, clock)
    first = controller(store, tmp_path, clock, ranks, Orch(world), KILLS[where])
    with pytest.raises(Killed):
        first.run()
    first.outbox.flush(force=True)
    latest = read_history(store, JOB, []).latest
    assert latest is not None and latest.incident_id
    alert_at = clock.now + 60 * S
    store.record_action(Action(
        job=JOB, incident_id=latest.incident_id, kind=ActionKind.ALERT, target="oncall",
        time_us=alert_at, ok=True, detail="firing alert delivered to oncall (slack) "
        "after 1 try"))
    status = job_status(store, JOB)
    assert status is not None and len(status["open_incidents"]) == 1

    result = controller(store, tmp_path, clock, ranks, Orch(world)).run()

    assert result.completed is True, result.reason
    assert world.launches == [0, 1] and world.isolations == ["node-1"]
    (incident,) = store.incidents(JOB)
    steps = [a for a in incident.actions if a.kind is not ActionKind.ALERT]
    assert [(a.kind, a.target) for a in steps][:3] == [
        (ActionKind.STOP_JOB, "attempt 0"), (ActionKind.ISOLATE_NODE, "node-1"),
        (ActionKind.RESTART, "attempt 1")]
    assert [a.time_us for a in steps] == sorted(a.time_us for a in steps)
    assert steps[2].time_us < alert_at, "the plan's steps are not timed after the alert"
    assert [a.target for a in incident.actions if a.kind is ActionKind.ALERT] == ["oncall"]
    status = job_status(store, JOB)
    assert status is not None and status["open_incidents"] == []
