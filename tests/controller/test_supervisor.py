"""The supervision loop driven step by step: a scripted orchestrator (our own port; the real one
is exercised end to end in test_demo_e2e) and a real store on each adapter. Time is injected, so
the hang threshold is crossed exactly when the test says.
"""

from __future__ import annotations

import functools
from pathlib import Path

import msgspec
import pytest
from store_urls import on_adapter
from supervisor_fakes import Clock, S, ScriptedOrchestrator, clean_exits, heartbeat

from tracehound.analysis.settings import DetectionSettings, HangSettings
from tracehound.analysis.snapshot import snapshot_from_json
from tracehound.controller.alerts import Alert
from tracehound.controller.policy.recovery import PolicySettings
from tracehound.controller.supervision.restarts import PHASES
from tracehound.controller.supervision.supervisor import (
    JobSpec,
    PollView,
    Supervisor,
    SupervisorSettings,
)
from tracehound.tracing.events import (
    ActionKind,
    Batch,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore

JOB = JobId("sup")


beat = functools.partial(heartbeat, JOB)


def test_hang_is_recorded_isolated_and_restarted_on_the_spare(
    store: TraceStore, tmp_path: Path
) -> None:
    clock = Clock()
    orch = ScriptedOrchestrator()
    stall_at = clock.now + 2 * S
    polls: list[int] = []
    alerts: list[Alert] = []

    def world(view: PollView) -> None:
        """Attempt 0: rank 3 stops at #40 while 0-2 wait in #41. Attempt 1: trains and exits."""
        polls.append(view.attempt)
        plan = orch.plans[-1]
        nodes = plan.rank_nodes()
        now = clock.now
        if view.attempt == 0:
            beats = [beat(0, r, now, 41, 40, stall_at, nodes[r]) for r in range(3)]
            beats.append(beat(0, 3, stall_at, 40, 40, stall_at - S // 10, nodes[3]))
        else:
            beats = [beat(1, r, now, 5, 5, now, nodes[r]) for r in range(4)]
            orch.exits = clean_exits(JOB, 1, nodes, now)
        store.insert(Batch(batch_id=f"b{len(polls)}", records=tuple(beats)))

    sup = Supervisor(
        spec=JobSpec(job=JOB, command=("python", "train.py"), nnodes=2, nproc_per_node=2,
                     spare_nodes=1),
        store=store, orchestrator=orch, clock=clock, sleep=clock.sleep, observer=world,
        settings=SupervisorSettings(
            poll_s=0.5, detection=DetectionSettings(hang=HangSettings(after_s=5.0))),
        evidence_dir=tmp_path, notify=alerts.append,
    )
    result = sup.run()

    assert result.completed is True
    assert result.attempts == 2
    assert [p.nodes for p in orch.plans] == [("node-0", "node-1"), ("node-0", "node-2")]
    # announced when it fired, resolved once the restarted attempt made its first steps
    assert [(a.status, a.incident_id, a.kind, a.culprit_nodes) for a in alerts] == [
        ("firing", f"{JOB}/0/1", "hang", ("node-1",)),
        ("resolved", f"{JOB}/0/1", "hang", ("node-1",)),
    ]
    assert alerts[0].severity == "critical" and alerts[1].at_us >= alerts[0].at_us
    assert orch.isolated == ["node-1"]
    assert orch.stopped == 1 and orch.finished == 1 and orch.closed
    # Polls every 0.5 s; ranks 0-2 entered #41 at 2.0 s. Their heartbeats sent at 7.0 s (5 s of
    # waiting on their own clocks) are first read by the poll at 7.5 s, the 15th: it gives the
    # verdict, and the 16th poll belongs to attempt 1.
    assert polls.index(1) == 15

    (incident,) = store.incidents(JOB)
    assert incident.kind == "hang"
    assert incident.culprit_ranks == (3,)
    assert incident.culprit_nodes == ("node-1",)
    assert [(a.kind, a.target, a.ok) for a in incident.actions] == [
        (ActionKind.STOP_JOB, "attempt 0", True),
        (ActionKind.ISOLATE_NODE, "node-1", True),
        (ActionKind.RESTART, "attempt 1", True),
        (ActionKind.RESUMED, "attempt 1", True),
    ]
    # every decision names the policy rule that made it
    assert [a.rule for a in incident.actions] == ["rules.hang.isolate_from"] * 3 + [""]
    # the restart is measured through to attempt 1's first steps, phase by phase
    (restart,) = result.restarts
    assert restart.incident_id == incident.incident_id and restart.attempt == 1
    assert list(restart.phases) == list(PHASES)
    assert all(v >= 0 for v in restart.phases.values())
    assert restart.resume_s == pytest.approx(sum(restart.phases.values()))
    assert "resumed" in incident.actions[-1].detail
    (evidence,) = tmp_path.glob("*.snapshot.json")
    replay = snapshot_from_json(evidence.read_text())
    assert replay.attempt == 0 and len(replay.heartbeats) == 4
    assert [e.rank for e in store.exits(JOB, 1)] == [0, 1, 2, 3]


def test_crash_without_spares_restarts_in_place_and_gives_up_only_when_restarts_run_out(
    store: TraceStore,
) -> None:
    clock = Clock()
    orch = ScriptedOrchestrator()

    def world(view: PollView) -> None:
        if not orch.exits and not store.exits(JOB, view.attempt):
            orch.exits = [RankExit(job=JOB, attempt=view.attempt, node=NodeId("node-0"),
                                   rank=Rank(1), pid=1001, exit_code=-9, time_us=clock.now)]

    sup = Supervisor(
        spec=JobSpec(job=JOB, command=("python", "t.py"), nnodes=1, nproc_per_node=2),
        store=store, orchestrator=orch, clock=clock, sleep=clock.sleep, observer=world,
        settings=SupervisorSettings(policy=PolicySettings(max_restarts=1)),
    )
    result = sup.run()
    assert result.completed is False
    assert result.attempts == 2
    assert "1 restarts used of 1" in result.reason
    first, second = store.incidents(JOB)
    assert (first.kind, first.culprit_ranks) == ("crash", (1,))
    assert [a.kind for a in first.actions] == [ActionKind.STOP_JOB, ActionKind.RESTART]
    assert "only 0 spare(s) left; nobody evicted" in first.actions[1].detail
    assert [a.kind for a in second.actions] == [ActionKind.STOP_JOB, ActionKind.GIVE_UP]


# each case on one adapter: the waiting is the supervisor's, the store only holds the stacks
# (nine cases took about 70 s of a CI worker)
@pytest.mark.parametrize(("store_url", "stack_at_s", "ends_at_s"), [
    on_adapter("embedded", 9.0, 30.0), on_adapter("server", None, 30.0),
    on_adapter("cluster", None, 12.0),
], indirect=["store_url"])
def test_a_stall_waits_for_a_stack_of_its_rank_taken_since_the_peers_began_to_wait(
    store: TraceStore, tmp_path: Path, stack_at_s: float | None, ends_at_s: float
) -> None:
    """Rank 3 is busy outside collectives (its heartbeats go on) while 0-2 wait in #41 from
    2 s on, until `ends_at_s`. Its only stack is from before they began to wait, until the
    agent's capture of where it is now lands at `stack_at_s` (or never): the stall is recorded
    with that stack; without one, `stall_stack_wait_s` after it was first seen, or when it
    ends if that comes first."""
    clock = Clock()
    orch = ScriptedOrchestrator()
    start = clock.now
    stall_at = start + 2 * S
    ends_at = start + int(ends_at_s * S)
    old = StackSample(job=JOB, attempt=0, node=NodeId("node-1"), rank=Rank(3),
                      time_us=stall_at - S, frames=("train.py:9 main", "ddp.py:1 __init__"))
    new = msgspec.structs.replace(old, time_us=start + int((stack_at_s or 0) * S),
                                  frames=("train.py:9 main", "train.py:20 first_step"))

    def world(view: PollView) -> None:
        nodes = orch.plans[-1].rank_nodes()
        now = clock.now
        if now < ends_at:
            beats: list[object] = [beat(0, r, now, 41, 40, stall_at, nodes[r]) for r in range(3)]
            beats.append(beat(0, 3, now, 40, 40, stall_at - S // 10, nodes[3]))
        else:  # rank 3 came back: all of them train on
            beats = [beat(0, r, now, 42, 42, now, nodes[r]) for r in range(4)]
        if now == start + S // 2:
            beats.append(old)
        if stack_at_s is not None and now == new.time_us:
            beats.append(new)
        if now >= start + 30 * S:
            orch.exits = clean_exits(JOB, 0, nodes, now)
        store.insert(Batch(batch_id=f"b{now}", records=tuple(beats)))  # type: ignore[arg-type]

    sup = Supervisor(
        spec=JobSpec(job=JOB, command=("python", "train.py"), nnodes=2, nproc_per_node=2),
        store=store, orchestrator=orch, clock=clock, sleep=clock.sleep, observer=world,
        settings=SupervisorSettings(
            poll_s=0.5, detection=DetectionSettings(hang=HangSettings(after_s=5.0)),
            stall_stack_wait_s=10.0),
        evidence_dir=tmp_path,
    )
    result = sup.run()

    assert result.completed is True and result.attempts == 1
    (incident,) = store.incidents(JOB)
    assert incident.kind == "stall" and incident.culprit_ranks == (3,)
    assert [a.kind for a in incident.actions] == [ActionKind.OBSERVE]
    # 0-2 have waited 5 s at 7 s: the stall is first seen by the poll at 7.5 s
    first_seen = start + 7_500_000
    if stack_at_s is not None:
        assert "train.py:20 first_step" in incident.summary
        assert incident.detected_at_us == new.time_us + S // 2
    else:
        assert "(at " not in incident.summary and "__init__" not in incident.verdict_json
        # the poll after the last one that saw it (the heartbeats of 12 s are read at 12.5 s)
        assert incident.detected_at_us == min(first_seen + 10 * S, ends_at + S // 2)


# each case on one adapter: the rhythm is the supervisor's, the store only holds the stacks
# and states (six cases took about a minute of the CI run's two cores)
@pytest.mark.parametrize(("store_url", "length_s", "stack_after_s"), [
    on_adapter("embedded", 6, 1.0), on_adapter("server", 3, 3.5),
], indirect=["store_url"])
def test_a_pause_that_recurs_at_one_place_is_the_jobs_rhythm_and_a_far_longer_one_a_stall(
    store: TraceStore, tmp_path: Path, length_s: int, stack_after_s: float,
) -> None:
    """Rank 3 writes a checkpoint every 12 s: ranks 0-2 wait `length_s` for it each time, at
    the same line of its code (its stack, taken `stack_after_s` into each pause, goes on into
    torch; a short pause is over before its stack comes in). The first is a stall incident;
    the next ones are the job's rhythm, noted on the job as expected pauses and not alerted;
    the last, 30 s long, is a stall incident again with that history in its words, and is
    alerted as a warning once it has lasted the policy's `stall_alert_after_s` (20 s). The
    first stall's alert is info-level."""
    clock = Clock()
    orch = ScriptedOrchestrator()
    start = clock.now
    pauses = [(2, length_s), (14, length_s), (26, length_s), (38, length_s), (50, 30)]
    alerts: list[Alert] = []

    def world(view: PollView) -> None:
        nodes = orch.plans[-1].rank_nodes()
        now = clock.now
        t = (now - start) / S
        beats: list[object] = []
        inside = next(((i, p) for i, (p, n) in enumerate(pauses) if p <= t < p + n), None)
        if inside is not None:
            i, p = inside
            at = start + p * S
            n = 1000 + 100 * i
            beats += [beat(0, r, now, n, n - 1, at, nodes[r]) for r in range(3)]
            beats.append(beat(0, 3, now, n - 1, n - 1, at - S // 10, nodes[3]))
        else:
            n = 2000 + int(t * 2)  # training on between the pauses
            beats += [beat(0, r, now, n, n, now, nodes[r]) for r in range(4)]
        if any(now == start + int((p + stack_after_s) * S) for p, _ in pauses):
            beats.append(StackSample(
                job=JOB, attempt=0, node=NodeId(nodes[3]), rank=Rank(3), time_us=now,
                frames=("train.py:9 main", "train.py:30 save_checkpoint",
                        "torch/serialization.py:944 save", "torch/serialization.py:12 w")))
        if t >= 85:
            orch.exits = clean_exits(JOB, 0, nodes, now)
        store.insert(Batch(batch_id=f"b{now}", records=tuple(beats)))  # type: ignore[arg-type]

    sup = Supervisor(
        spec=JobSpec(job=JOB, command=("python", "train.py"), nnodes=2, nproc_per_node=2),
        store=store, orchestrator=orch, clock=clock, sleep=clock.sleep, observer=world,
        settings=SupervisorSettings(
            poll_s=0.5, detection=DetectionSettings(hang=HangSettings(after_s=2.0)),
            policy=PolicySettings(stall_alert_after_s=20.0)),
        evidence_dir=tmp_path, notify=alerts.append,
    )
    result = sup.run()

    assert result.completed is True and result.attempts == 1
    incidents = store.incidents(JOB)
    assert [(i.kind, i.culprit_ranks) for i in incidents] == [("stall", (3,)), ("stall", (3,))]
    first, long = incidents
    assert "rhythm" not in first.summary
    assert "more than 3 times its rhythm: paused at this place 4 times before" in long.summary
    # recorded once its peers had waited 3 times the longest wait seen in the others
    assert (start + (50 + 3 * (length_s - 1)) * S < long.detected_at_us
            < start + (50 + 3 * length_s + 2) * S)
    # pauses 2-4, and the long one until it lasted three times as long as they did
    expected = [s for s in store.job_states(JOB) if s.detail.startswith("expected pause")]
    assert len(expected) == 4
    assert all("rank 3 at train.py:9 main > train.py:30 save_checkpoint" in s.detail
               for s in expected)
    assert "paused at this place 4 times before" in expected[-1].detail
    assert expected[-1].time_us < long.detected_at_us
    # info when recorded (receivers take those only with min_severity: info), a warning once
    # the long one lasted 20 s, each resolved as loud as it went out when the job finished
    assert [(a.incident_id, a.status, a.severity) for a in alerts] == [
        (first.incident_id, "firing", "info"), (long.incident_id, "firing", "info"),
        (long.incident_id, "firing", "warning"),
        (first.incident_id, "resolved", "info"), (long.incident_id, "resolved", "warning"),
    ]


# on the server alone: the analysis is scripted and the store only holds what the supervisor
# records (the embedded engine's queries ran in the test's own process: 23 s against 9 s)
@pytest.mark.parametrize("store_url", [on_adapter("server")], indirect=True)
def test_a_straggler_seen_in_one_window_leaves_the_job_suspect_and_is_an_incident_when_seen_again(
    store: TraceStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The analysis is scripted (the straggler rule has tests of its own): it names rank 3 from
    12 s to 14 s (one window), then from 40 s to 55 s (two windows in a row). The first sighting
    only marks the job suspect, saying what was seen; the second run of sightings is one incident
    at its second window, whose plan only watches (confidence 0.8 is below the straggler's
    `isolate_from`), so nothing is done to the job."""
    from tracehound.analysis.verdict import Basis, Verdict
    from tracehound.controller.supervision import supervisor as module
    from tracehound.tracing.events import IncidentKind, JobPhase

    clock = Clock()
    orch = ScriptedOrchestrator()
    t0 = clock.now

    def scripted(_store: object, obs: object, _settings: object) -> tuple[Verdict | None, object]:
        t = (clock.now - t0) / S
        if not (12 <= t < 14 or 40 <= t < 55):
            return None, obs
        return Verdict(job=JOB, attempt=0, kind=IncidentKind.STRAGGLER, culprit_ranks=(3,),
                       culprit_nodes=("node-1",), confidence=0.8, basis=Basis.ARRIVAL_LATENESS,
                       summary="rank 3 computes 1.4x as long as its peers", evidence=(),
                       observed_at_us=clock.now), obs

    monkeypatch.setattr(module, "diagnose_with_records", scripted)

    def world(view: PollView) -> None:
        nodes = orch.plans[-1].rank_nodes()
        now = clock.now
        step = int((now - t0) / S)
        store.insert(Batch(batch_id=f"b{now}", records=tuple(
            beat(0, r, now, step, step, now, nodes[r]) for r in range(4))))
        if now - t0 >= 70 * S:
            orch.exits = clean_exits(JOB, 0, nodes, now)

    sup = Supervisor(
        spec=JobSpec(job=JOB, command=("python", "train.py"), nnodes=2, nproc_per_node=2),
        store=store, orchestrator=orch, clock=clock, sleep=clock.sleep, observer=world,
        settings=SupervisorSettings(poll_s=0.5, window_s=10.0), evidence_dir=tmp_path,
    )
    result = sup.run()

    assert result.completed is True and result.attempts == 1
    assert orch.isolated == [] and orch.stopped == 0
    (incident,) = store.incidents(JOB)
    assert (incident.kind, incident.culprit_ranks) == ("straggler", (3,))
    assert [a.kind for a in incident.actions] == [ActionKind.OBSERVE]
    assert 50 * S <= incident.detected_at_us - t0 < 51 * S  # the second window's first poll
    states = [(s.state, s.detail, s.incident_id, (s.time_us - t0) // S)
              for s in store.job_states(JOB)]
    suspects = [s for s in states if s[0] is JobPhase.SUSPECT]
    assert [(when, incident_id) for _, _, incident_id, when in suspects] == [
        (12, ""), (40, ""), (50, incident.incident_id)], states
    # back to running once a window passed without it (from 14 s, from 55 s)
    assert [when for state, _, _, when in states if state is JobPhase.RUNNING][1:3] == [24, 65]
    assert all("straggler of rank(s) 3 on node-1 seen in one window" in detail
               for _, detail, incident_id, _ in suspects if not incident_id), states
