"""The dashboard's content, computed without Streamlit: progress cells, timelines, jobs."""

from __future__ import annotations

import json

from tracehound.tracing.events import Action, ActionKind, Incident, JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.summaries import BucketProgress, ProgressCell, ProgressGrid
from tracehound.ui import data

S = 1_000_000
T0 = 1_700_000_000 * S


def cell(bucket: int, seq: int, *, ranks: int = 4, late_us: int = 100,
         failed: int = 0) -> ProgressCell:
    return ProgressCell(bucket=bucket, seq=seq, ranks=ranks, failed=failed,
                        late_max_us=late_us, late_mean_us=float(late_us), op="all_reduce")


def beat(bucket: int, completed: int, entered: int, ranks: int = 4) -> BucketProgress:
    return BucketProgress(bucket=bucket, ranks=ranks, min_completed=completed,
                          max_completed=completed, max_enqueued=entered,
                          pending=ranks if entered > completed else 0)


def statuses(grid: ProgressGrid, culprits: tuple[int, ...] = ()) -> dict[tuple[str, int], str]:
    frame = data.progress_frame(grid, culprits)
    return {(r, s): st for r, s, st in zip(frame["ranks"], frame["seq"], frame["status"],
                                           strict=True)}


def test_a_hang_wavefront_the_late_and_the_failed() -> None:
    # buckets of 4 ranks; ranks 4-7 stopped after #10 (a stale heartbeat at #9 is outranked
    # by their rows), the others wait in #11; ranks 8-11 failed #9 and arrived late at #10
    grid = ProgressGrid(
        group="0", width=4, seq_lo=8, seq_hi=10,
        cells=(cell(0, 8), cell(0, 9), cell(0, 10),
               cell(4, 8), cell(4, 9), cell(4, 10),
               cell(8, 8), cell(8, 9, failed=1), cell(8, 10, late_us=90_000)),
        buckets=(beat(0, 10, 11), beat(4, 9, 9), beat(8, 10, 11)),
    )
    got = statuses(grid, culprits=(5,))
    # the window moved on to the call the waiting ranks entered, keeping its length
    assert data.seq_window(grid) == (9, 11)
    assert {s for _, s in got} == {9, 10, 11}
    assert [got[("0-3", s)] for s in (9, 10, 11)] == ["completed", "completed", "waiting"]
    assert [got[("4-7", s)] for s in (9, 10, 11)] == ["completed", "completed", "not entered"]
    assert [got[("8-11", s)] for s in (9, 10, 11)] == ["failed", "late", "waiting"]
    frame = data.progress_frame(grid, (5,))
    assert set(frame.loc[frame["culprit"], "ranks"]) == {"4-7"}


def test_cells_without_rows_come_from_heartbeats_or_are_unknown() -> None:
    grid = ProgressGrid(group="0", width=1, seq_lo=1, seq_hi=2,
                        cells=(cell(0, 1, ranks=1), cell(1, 2, ranks=1)),
                        buckets=(beat(0, 2, 2, ranks=1),))
    got = statuses(grid)
    assert got[("0", 2)] == "completed, not recorded"
    assert got[("1", 1)] == "no record"
    # part of a bucket recorded a call the rest of it has not completed: waiting
    partial = ProgressGrid(group="0", width=4, seq_lo=5, seq_hi=5, cells=(cell(0, 5, ranks=3),),
                           buckets=(beat(0, 4, 5),))
    assert statuses(partial)[("0-3", 5)] == "waiting"


def test_timeline_steps_in_order_with_alerts_apart() -> None:
    def act(kind: ActionKind, after_s: float, target: str = "t") -> Action:
        return Action(job=JobId("j"), incident_id="j/0/1", kind=kind, target=target,
                      time_us=T0 + int(after_s * S), ok=True, rule="rules.hang")

    incident = Incident(
        job=JobId("j"), incident_id="j/0/1", attempt=0, detected_at_us=T0, kind="hang",
        culprit_ranks=(3,), culprit_nodes=("node-1",), confidence=0.95, summary="s",
        verdict_json=json.dumps({"evidence": [
            {"fact": "lagging", "rank": 3, "node": "node-1", "detail": "d", "group": "0",
             "seq": 100, "value": 1.0},
            {"fact": "clock", "rank": -1, "node": "node-1", "detail": "+2 ms", "group": "",
             "seq": 0, "value": 2.0}]}),
        actions=(act(ActionKind.RESUMED, 12.5), act(ActionKind.STOP_JOB, 0.2),
                 act(ActionKind.ALERT, 0.3, "oncall"), act(ActionKind.ISOLATE_NODE, 1.0),
                 act(ActionKind.RESTART, 1.5)),
    )
    timeline = data.timeline_frame(incident)
    assert list(timeline["step"]) == ["detect", "decide: stop", "isolate", "restart", "resumed"]
    assert list(timeline["after (s)"]) == [0.0, 0.2, 1.0, 1.5, 12.5]
    alerts = data.alerts_frame(incident)
    assert list(alerts["receiver"]) == ["oncall"]
    verdict = data.verdict_of(incident)
    assert list(data.evidence_frame(verdict, exclude=("clock",))["fact"]) == ["lagging"]
    assert list(data.evidence_frame(verdict, facts=("clock",))["detail"]) == ["+2 ms"]
    assert data.verdict_of(incident.__class__(**{
        **{f: getattr(incident, f) for f in incident.__struct_fields__},
        "verdict_json": "not json"})) == {}


def test_job_row_counts_restarts_and_training_time() -> None:
    steps = [(0, JobPhase.RUNNING, 0), (90, JobPhase.DIAGNOSING, 0),
             (95, JobPhase.RESTARTING, 1), (100, JobPhase.RUNNING, 1),
             (200, JobPhase.FINISHED, 1)]
    states = [JobState(job=JobId("j"), time_us=T0 + t * S, seq=i + 1, state=p, attempt=a,
                       isolated=("node-1",) if t >= 95 else ())
              for i, (t, p, a) in enumerate(steps)]
    row = data.job_row("j", states, [], now_us=T0 + 500 * S)
    assert (row.state, row.attempt, row.restarts, row.isolated, row.ended) == (
        "finished", 1, 1, ("node-1",), True)
    assert row.training_ratio == 190 / 200
    frame = data.jobs_frame([row, data.job_row("sim", [], [], now_us=T0)])
    assert list(frame["training time"]) == ["95.0 %", ""]
    assert list(frame["state"]) == ["finished", "no controller state"]


def test_the_health_view_opens_on_a_telling_metric() -> None:
    assert data.metric_order({"clocks_event_reasons", "gpu_util", "temperature_c"}) == [
        "temperature_c", "clocks_event_reasons", "gpu_util"]
    assert data.metric_order({"b", "a"}) == ["a", "b"]


def test_the_group_an_incident_names_is_read_from_its_verdict() -> None:
    def incident(verdict_json: str) -> Incident:
        return Incident(job=JobId("j"), incident_id="j/0/1", attempt=0, detected_at_us=T0,
                        kind="hang", culprit_ranks=(3,), culprit_nodes=("node-1",),
                        confidence=0.9, summary="s", verdict_json=verdict_json)

    assert data.incident_group(incident(json.dumps({"group": "0:ddp"}))) == "0:ddp"
    assert data.incident_group(incident(json.dumps({"group": 7}))) == ""
    assert data.incident_group(incident("{not json")) == ""
    assert data.incident_group(incident("[]")) == ""
    assert data.incident_group(None) == ""
