"""A job's latest run, open incidents and effective training time, from its stored records."""

from __future__ import annotations

import pytest

from tracehound.tracing.events import Action, ActionKind, Incident, JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.jobs import latest_run, open_incidents, training_time

S = 1_000_000
T0 = 1_700_000_000 * S
P = JobPhase


def states(*steps: tuple[int, JobPhase, int]) -> list[JobState]:
    """(seconds after T0, state, attempt) per step."""
    return [JobState(job=JobId("j"), time_us=T0 + t * S, seq=i + 1, state=phase, attempt=a)
            for i, (t, phase, a) in enumerate(steps)]


def incident(at_s: int, attempt: int, *kinds: ActionKind, iid: str = "j/0/1") -> Incident:
    return Incident(
        job=JobId("j"), incident_id=iid, attempt=attempt, detected_at_us=T0 + at_s * S,
        kind="hang", culprit_ranks=(3,), culprit_nodes=("node-1",), confidence=0.9,
        summary="s", verdict_json="{}",
        actions=tuple(Action(job=JobId("j"), incident_id=iid, kind=k, target="t",
                             time_us=T0 + at_s * S, ok=True) for k in kinds),
    )


RECOVERED = states((0, P.RUNNING, 0), (100, P.DIAGNOSING, 0), (104, P.ISOLATING, 0),
                   (105, P.RESTARTING, 1), (110, P.RUNNING, 1), (200, P.FINISHED, 1))


def test_time_outside_training_states_is_lost() -> None:
    # trains 0-100 and 110-200: 190 of 200 s
    spent = training_time(RECOVERED, now_us=T0 + 999 * S)
    assert (spent.training_us, spent.wall_us) == (190 * S, 200 * S)
    assert spent.ratio == pytest.approx(0.95)


def test_a_running_job_is_measured_up_to_now_and_a_stall_is_lost_time() -> None:
    run = states((0, P.RUNNING, 0), (30, P.SUSPECT, 0), (40, P.STALLED, 0), (50, P.RUNNING, 0))
    spent = training_time(run, now_us=T0 + 60 * S)
    assert (spent.training_us, spent.wall_us) == (50 * S, 60 * S)
    # a reader whose clock lags the writer's does not get negative time
    assert training_time(run, now_us=T0).wall_us == 50 * S
    assert training_time([], now_us=T0).ratio is None


def test_only_the_latest_run_of_a_job_id_counts() -> None:
    again = RECOVERED + states((500, P.RUNNING, 0), (520, P.FAILED, 0))
    assert [s.state for s in latest_run(again)] == [P.RUNNING, P.FAILED]
    spent = training_time(again, now_us=T0 + 999 * S)
    assert (spent.training_us, spent.wall_us) == (20 * S, 20 * S)


def test_open_incidents_are_the_unresolved_ones_of_the_latest_run() -> None:
    acting = states((0, P.RUNNING, 0), (100, P.DIAGNOSING, 0))
    stopped = incident(100, 0, ActionKind.STOP_JOB)
    resumed = incident(50, 0, ActionKind.RESTART, ActionKind.RESUMED, iid="j/0/0")
    watched = incident(90, 0, ActionKind.OBSERVE, iid="j/0/2")
    older_attempt = incident(95, 7, ActionKind.OBSERVE, iid="j/0/3")
    found = open_incidents(acting, [resumed, watched, older_attempt, stopped])
    assert [i.incident_id for i in found] == ["j/0/2", "j/0/1"]
    assert open_incidents(RECOVERED, [stopped]) == []
    before_run = states((0, P.FAILED, 0), (300, P.RUNNING, 0))
    assert open_incidents(before_run, [stopped]) == []
