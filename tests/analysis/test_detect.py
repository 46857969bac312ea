"""Hang and crash localization on hand-built snapshots with exact expectations."""

from __future__ import annotations

from dataclasses import replace

from tracehound.analysis import diagnose_observation as diagnose
from tracehound.analysis.confidence import CERTAIN, STRONG, WEAK
from tracehound.analysis.detect import detect_crash, detect_hang
from tracehound.analysis.settings import CrashSettings, DetectionSettings, HangSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import (
    GroupProgress,
    Heartbeat,
    IncidentKind,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank

S = 1_000_000
T0 = 1_700_000_000 * S
SETTINGS = DetectionSettings(hang=HangSettings(after_s=5.0, heartbeat_timeout_s=2.5),
                             crash=CrashSettings(settle_s=0.3))


def node_of(rank: int) -> str:
    return f"node-{rank // 2}"


def progress(
    group: str, enq: int, comp: int, *, enq_us: int, op: str = "all_reduce"
) -> GroupProgress:
    return GroupProgress(
        group=GroupId(group), last_enqueued=enq, last_completed=comp,
        pending_op=op if enq > comp else "", last_enqueue_us=enq_us, last_complete_us=enq_us,
    )


def beat(rank: int, at_us: int, *groups: GroupProgress, step: int = 10) -> Heartbeat:
    return Heartbeat(
        job=JobId("j"), attempt=0, node=NodeId(node_of(rank)), rank=Rank(rank), time_us=at_us,
        pid=1000 + rank, step=step, step_us=at_us, start_step=0, first_step_us=T0, dropped=0,
        groups=groups,
    )


def snap(now_us: int, beats: list[Heartbeat], exits: tuple[RankExit, ...] = (),
         ranks: int = 4) -> JobSnapshot:
    return JobSnapshot(
        job=JobId("j"), attempt=0, now_us=now_us, heartbeats=tuple(beats), exits=exits,
        expected_ranks={r: node_of(r) for r in range(ranks)},
    )


def exit_(rank: int, code: int, at_us: int) -> RankExit:
    return RankExit(job=JobId("j"), attempt=0, node=NodeId(node_of(rank)), rank=Rank(rank),
                    pid=1000 + rank, exit_code=code, time_us=at_us)


def test_healthy_job_has_no_verdict() -> None:
    now = T0 + 100 * S
    beats = [beat(r, now - S // 10, progress("0", 66, 65, enq_us=now - S // 20)) for r in range(4)]
    assert diagnose(snap(now, beats), SETTINGS) is None


def test_stopped_rank_that_lags_is_the_culprit() -> None:
    # Rank 3 was SIGSTOPped at 64; the others entered #66 six seconds ago and still report.
    stop = T0 + 50 * S
    now = stop + 6 * S
    beats = [beat(r, now - S // 5, progress("0", 66, 65, enq_us=stop)) for r in range(3)]
    beats.append(beat(3, stop - S // 3, progress("0", 64, 64, enq_us=stop - S // 2)))
    verdict = diagnose(snap(now, beats), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (3,)
    assert verdict.culprit_nodes == ("node-1",)
    assert verdict.basis is Basis.CONTROL_DEPENDENCY
    assert verdict.confidence == CERTAIN  # lagging and silent
    lag = [e for e in verdict.evidence if e.fact is Fact.LAGGING]
    assert [(e.rank, e.group, e.seq) for e in lag] == [(3, "0", 66)]
    assert "never entered collective #66 of group 0" in lag[0].detail


def test_no_hang_before_the_threshold() -> None:
    stop = T0 + 50 * S
    now = stop + 4 * S
    beats = [beat(r, now - S // 5, progress("0", 66, 65, enq_us=stop)) for r in range(3)]
    beats.append(beat(3, stop, progress("0", 64, 64, enq_us=stop)))
    assert detect_hang(snap(now, beats), SETTINGS) is None


def test_delayed_heartbeats_never_invent_a_hang() -> None:
    # The pipeline was down: the newest heartbeats are old, so nobody is known to wait long.
    last = T0 + 50 * S
    now = last + 30 * S
    beats = [beat(r, last, progress("0", 66, 65, enq_us=last - S // 100)) for r in range(4)]
    assert diagnose(snap(now, beats), SETTINGS) is None


def test_stopped_inside_the_collective_is_found_by_silence() -> None:
    # Every rank entered #66; rank 1 then stopped reporting: nobody lags, one is silent.
    stop = T0 + 50 * S
    now = stop + 7 * S
    beats = [beat(r, now - S // 5, progress("0", 66, 65, enq_us=stop)) for r in (0, 2, 3)]
    beats.append(beat(1, stop + S // 10, progress("0", 66, 65, enq_us=stop)))
    verdict = detect_hang(snap(now, beats), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (1,)
    assert verdict.basis is Basis.HEARTBEAT_LOSS


def test_late_reports_of_waiters_beside_a_stopped_rank_do_not_make_them_culprits() -> None:
    """The shape a CI run found: rank 1 stopped (process state T) before collective #11 that
    ranks 0, 2 and 3 entered; the heartbeats of ranks 2 and 3 (one node, its agent on a loaded
    machine) were 3.3 s late. Rank 1 explains the hang; ranks 2 and 3 are waiters whose
    reports are late, named in the evidence as such, not culprits. Alone (nobody stopped and
    nobody lagging), the same silence is still a hang on the silent ranks."""
    stop = T0 + 50 * S
    now = stop + 6 * S
    beats = [beat(0, now - S // 5, progress("0", 11, 10, enq_us=stop))]
    beats += [beat(r, now - 33 * S // 10, progress("0", 11, 10, enq_us=stop)) for r in (2, 3)]
    beats.append(beat(1, stop - S // 3, progress("0", 10, 10, enq_us=stop - S // 2)))
    stopped = ProcessSample(
        job=JobId("j"), attempt=0, node=NodeId(node_of(1)), rank=Rank(1), pid=1001,
        time_us=now - S // 2, state="T", cpu_s=1.0, cpu_rate=0.0, read_bytes=0, write_bytes=0,
        io_rate=0.0)
    verdict = detect_hang(replace(snap(now, beats), processes=(stopped,)), SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (1,) and verdict.confidence == CERTAIN
    late = {e.rank: e.detail for e in verdict.evidence if e.fact is Fact.SILENT}
    assert sorted(late) == [2, 3]
    assert all("its reports are late, it is not what they wait for" in d for d in late.values())
    # without the stopped rank's sample nor its lag, the silent ones are what is known
    alone = [b if b.rank != 1 else beat(1, now - S // 5, progress("0", 11, 10, enq_us=stop))
             for b in beats]
    silent = detect_hang(snap(now, alone), SETTINGS)
    assert silent is not None and silent.culprit_ranks == (2, 3)


def test_cross_group_dependency_leads_to_the_root() -> None:
    # Group "dp" = {0, 2}, group "tp" = {2, 3}. Rank 0 waits in dp #5 for rank 2; rank 2 is stuck
    # in tp #9 waiting for rank 3, which never entered tp #9: rank 3 is the root.
    start = T0 + 10 * S
    now = start + 8 * S
    fresh = now - S // 5
    beats = [
        beat(0, fresh, progress("dp", 5, 4, enq_us=start)),
        beat(2, fresh, progress("dp", 4, 4, enq_us=start - S), progress("tp", 9, 8, enq_us=start)),
        beat(3, fresh, progress("tp", 8, 8, enq_us=start - S)),
        beat(1, fresh, progress("dp2", 3, 3, enq_us=start - S)),
    ]
    # Rank 3 lags but reports and is in no operation: busy (computing), a stall, not a hang.
    stall = detect_hang(snap(now, beats), SETTINGS)
    assert stall is not None
    assert stall.kind is IncidentKind.STALL
    assert stall.culprit_ranks == (3,)
    # Stuck inside another operation for longer than the hang threshold, it is a hang.
    beats[2] = beat(3, fresh, progress("tp", 8, 8, enq_us=start - S),
                    progress("x", 4, 3, enq_us=start - S))
    verdict = detect_hang(snap(now, beats), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (3,)
    assert verdict.confidence == STRONG  # lagging and stuck, but still reporting


def test_stall_without_laggard_or_silence_names_the_group_with_low_confidence() -> None:
    start = T0 + 10 * S
    now = start + 9 * S
    beats = [beat(r, now - S // 5, progress("0", 7, 6, enq_us=start)) for r in range(4)]
    verdict = detect_hang(snap(now, beats), SETTINGS)
    assert verdict is not None
    assert verdict.basis is Basis.UNLOCALIZED
    assert verdict.culprit_ranks == (0, 1, 2, 3)
    assert verdict.confidence < WEAK


def test_first_failure_is_the_culprit_not_the_peers_that_followed() -> None:
    kill = T0 + 20 * S
    exits = (exit_(0, 1, kill + 400_000), exit_(3, -9, kill), exit_(1, 1, kill + 350_000))
    verdict = detect_crash(snap(kill + S, [], exits), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.CRASH
    assert verdict.culprit_ranks == (3,)
    assert verdict.culprit_nodes == ("node-1",)
    assert verdict.confidence == CERTAIN
    assert verdict.summary.startswith("rank 3 on node node-1 killed by signal 9 first")
    assert [e.rank for e in verdict.evidence] == [3, 1, 0]


def test_crash_waits_for_exits_to_settle_and_ignores_clean_exits() -> None:
    t = T0 + 20 * S
    assert detect_crash(snap(t + 100_000, [], (exit_(2, 1, t),)), SETTINGS) is None
    assert detect_crash(snap(t + S, [], (exit_(2, 0, t),)), SETTINGS) is None


def test_crash_takes_precedence_over_the_hang_it_causes() -> None:
    kill = T0 + 20 * S
    now = kill + 7 * S
    beats = [beat(r, now - S // 5, progress("0", 30, 29, enq_us=kill)) for r in range(3)]
    verdict = diagnose(snap(now, beats, (exit_(3, 1, kill),)), SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.CRASH
    assert verdict.culprit_ranks == (3,)


def test_simultaneous_failures_are_named_together_with_less_confidence() -> None:
    t = T0 + 20 * S
    verdict = detect_crash(snap(t + S, [], (exit_(1, 1, t), exit_(2, 1, t + 500))), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (1, 2)
    assert verdict.confidence == WEAK


def test_verdict_serializes_to_json_with_evidence() -> None:
    import json

    kill = T0 + 20 * S
    verdict = detect_crash(snap(kill + S, [], (exit_(3, -9, kill),)), SETTINGS)
    assert verdict is not None
    data = json.loads(verdict.to_json())
    assert data["kind"] == "crash"
    assert data["culprit_ranks"] == [3]
    assert data["evidence"][0]["fact"] == "exit"
    assert data["schema_version"] == 1


def test_a_peer_still_inside_the_previous_collective_is_not_blamed() -> None:
    # Recorded from a real SIGSTOP of rank 1: ranks 2 and 3 got through #91 and wait in #92;
    # rank 0 still waits in #91 (just under the threshold) because rank 1 never entered it.
    stop = T0 + 50 * S
    now = stop + 6 * S
    beats = [
        beat(0, now - S // 2, progress("0", 91, 90, enq_us=now - S // 2 - 4_990_000)),
        beat(1, stop, progress("0", 88, 88, enq_us=stop - S // 100)),
        beat(2, now - S // 3, progress("0", 92, 91, enq_us=now - S // 3 - 5_260_000)),
        beat(3, now - S // 3, progress("0", 92, 91, enq_us=now - S // 3 - 5_150_000)),
    ]
    verdict = detect_hang(snap(now, beats), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (1,)
    assert verdict.basis is Basis.CONTROL_DEPENDENCY


def test_waiters_that_seem_to_wait_on_each_other_for_a_moment_are_no_hang() -> None:
    # Seen in a loaded run of a real job: rank 3 loaded data for 12 s while ranks 0-2 waited in
    # the backend's #246 of group 0 (reported as "0:c10d" by the ranks that waited in it, never
    # by rank 3, which arrived last). Rank 0's newest heartbeat is from just before #246
    # completed; ranks 1-3 have moved on into the next DDP bucket, which rank 0 has not entered.
    # Rank 0 seems to wait on rank 3 and rank 3 on rank 0: a cycle of reports, not a deadlock.
    now = T0 + 100 * S
    entered = now - 12 * S
    beats = [
        beat(0, now - S // 2, progress("0:c10d", 246, 245, enq_us=entered),
             progress("0:ddp", 100, 100, enq_us=entered - S)),
        *(beat(r, now - S // 10, progress("0:c10d", 246, 246, enq_us=entered),
               progress("0:ddp", 101, 100, enq_us=now - S // 5)) for r in (1, 2)),
        beat(3, now - S // 10, progress("0:ddp", 101, 100, enq_us=now - S // 5)),
    ]
    backend = ProcessGroupInfo(job=JobId("j"), attempt=0, rank=Rank(0), group=GroupId("0:c10d"),
                               ranks=(0, 1, 2, 3), backend="c10d", time_us=entered)
    assert detect_hang(replace(snap(now, beats), groups=(backend,)), SETTINGS) is None


def test_a_deadlock_across_two_groups_is_a_hang_of_its_ranks() -> None:
    # Rank 0 waits in a #5 for rank 1, which waits in b #9 for rank 0: both for longer than the
    # threshold, so nobody will ever move; ranks 2 and 3 are healthy elsewhere.
    now = T0 + 100 * S
    entered = now - 8 * S
    beats = [
        beat(0, now - S // 10, progress("a", 5, 4, enq_us=entered), progress("b", 8, 8, enq_us=0)),
        beat(1, now - S // 10, progress("a", 4, 4, enq_us=0), progress("b", 9, 8, enq_us=entered)),
        *(beat(r, now - S // 10, progress("c", 30, 30, enq_us=now - S)) for r in (2, 3)),
    ]
    verdict = detect_hang(snap(now, beats), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert set(verdict.culprit_ranks) == {0, 1}
