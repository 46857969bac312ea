"""The dashboard's content, computed without Streamlit: progress cells, timelines, jobs."""

from __future__ import annotations

import json
from dataclasses import replace

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
    assert [got[("4-7 culprit", s)] for s in (9, 10, 11)] == [
        "completed", "completed", "not entered"]
    assert [got[("8-11", s)] for s in (9, 10, 11)] == ["failed", "late", "waiting"]
    frame = data.progress_frame(grid, (5,))
    assert set(frame.loc[frame["culprit"], "ranks"]) == {"4-7 culprit"}


def _incident(*evidence: dict[str, object], ranks: tuple[int, ...] = (5,)) -> Incident:
    verdict = {"kind": "hang", "group": "0", "evidence": list(evidence)}
    return Incident(job=JobId("j"), incident_id="j/0/1", attempt=0, detected_at_us=1,
                    kind="hang", culprit_ranks=ranks, culprit_nodes=("node-1",),
                    confidence=0.95, summary="s", verdict_json=json.dumps(verdict))


STOPPED = {"fact": "frozen", "rank": 5, "detail": "rank 5's process is stopped (state T)"}


def test_the_culprits_cell_at_the_hang_shows_its_own_state_and_furthest_behind_leads_with_it(
) -> None:
    # the FSDP2 case: the culprit's last heartbeat is older than its records; its peers wait
    # in #11 and report completing #10, as it does by its records
    lag = {"fact": "lagging", "rank": 5, "group": "0", "seq": 11, "value": 1.0,
           "detail": "rank 5 on node node-1 was not seen entering collective #11 of group 0 "
                     "(completed #10 by its stored records; its last heartbeat, 1 "
                     "collective(s) older, said #9); 3 rank(s) wait on it"}
    incident = _incident(lag, STOPPED)
    states = data.culprit_states(incident)
    assert list(states) == [5]
    assert states[5].status == "culprit: not entered" and states[5].seq == 11
    assert states[5].words == ("not entered #11 (completed #10 by its stored records; its last "
                               "heartbeat, 1 collective(s) older, said #9); its process is "
                               "stopped")
    grid = ProgressGrid(
        group="0", width=4, seq_lo=9, seq_hi=10,
        cells=(cell(0, 9), cell(0, 10), cell(4, 9), cell(4, 10), cell(8, 9), cell(8, 10)),
        buckets=(beat(0, 10, 11), beat(4, 9, 9), beat(8, 8, 8)),
    )
    frame = data.progress_frame(grid, (5,), states)
    at_hang = frame[(frame["seq"] == 11)].set_index("ranks")
    assert at_hang.loc["4-7 culprit", "status"] == "culprit: not entered"
    assert at_hang.loc["4-7 culprit", "state"].startswith("rank 5: not entered #11")
    assert at_hang.loc["0-3", "status"] == "waiting" and at_hang.loc["0-3", "state"] == ""
    # ranks 8-11 completed less by their heartbeats, but the evidence puts the culprit first
    behind = data.behind_frame(grid, culprits=(5,), states=states)
    assert list(behind["ranks"]) == ["4-7", "8-11", "0-3"]
    assert behind["evidence"].iloc[0].startswith("culprit rank 5: not entered #11")
    assert list(behind["evidence"].iloc[1:]) == ["", ""]
    # the state of another group's collective is not put in this group's cells
    other = data.progress_frame(replace(grid, group="1"), (5,), states)
    assert "culprit: not entered" not in set(other["status"])


def test_a_culprit_frozen_inside_the_collective_is_frozen_there_one_alive_pending() -> None:
    inside = {"fact": "lagging", "rank": 5, "group": "0", "seq": 11, "value": 0.0,
              "detail": "rank 5 on node node-1 entered collective #11 of group 0 and froze "
                        "there; 3 rank(s) wait on it"}
    assert data.culprit_states(_incident(inside, STOPPED))[5].status == "culprit: frozen"
    assert data.culprit_states(_incident(inside))[5].status == "culprit: pending"
    blocked = {**inside, "detail": "2 other rank(s) of group 0 (e.g. rank 5 on node node-1) "
                                   "have not entered #11 either"}
    assert data.culprit_states(_incident(blocked)) == {}
    assert data.culprit_states(None) == {}


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
