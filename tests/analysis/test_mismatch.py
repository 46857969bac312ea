"""Mismatch by majority vote: recorded disagreements, pending ops and shifted sequence ids."""

from __future__ import annotations

from observation_builders import T0, S, beat, observe, progress, snapshot

from tracehound.analysis.detect import DetectionSettings, detect_hang
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.mismatch import detect_mismatch
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import Disagreement

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S


def disagreement(ops: list[str], *, nbytes: list[int] | None = None,
                 dtypes: list[str] | None = None, group: str = "tp-0", seq: int = 88
                 ) -> Disagreement:
    k = len(ops)
    return Disagreement(group=group, seq=seq, ranks=tuple(range(k)), ops=tuple(ops),
                        nbytes=tuple(nbytes or [4096] * k),
                        dtypes=tuple(dtypes or ["bfloat16"] * k))


def test_the_rank_that_ran_another_op_is_named_not_the_majority() -> None:
    d = disagreement(["all_reduce"] * 5 + ["broadcast"] + ["all_reduce"] * 2)
    verdict = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH
    assert verdict.basis is Basis.MAJORITY_VOTE
    assert verdict.culprit_ranks == (5,)
    assert verdict.culprit_nodes == ("node-0",)
    assert verdict.group == "tp-0"
    assert verdict.confidence == 0.95
    assert verdict.summary == (
        "rank 5 on node node-0 ran a different op at collective #88 of group tp-0: broadcast of "
        "4096 B bfloat16 while 7 of 8 members ran all_reduce of 4096 B bfloat16"
    )
    assert [(e.fact, e.rank, e.seq) for e in verdict.evidence] == [(Fact.DIFFERS, 5, 88)]


def test_size_and_dtype_differences_are_named() -> None:
    size = disagreement(["all_reduce"] * 4, nbytes=[4096, 4096, 2048, 4096])
    dtype = disagreement(["all_reduce"] * 4, dtypes=["bfloat16", "float32", "bfloat16",
                                                     "bfloat16"], group="dp-1")
    v_size = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(size,)), SETTINGS)
    v_dtype = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(dtype,)), SETTINGS)
    assert v_size is not None and v_size.culprit_ranks == (2,)
    assert "ran a different size" in v_size.summary
    assert v_dtype is not None and v_dtype.culprit_ranks == (1,)
    assert "ran a different dtype" in v_dtype.summary


def test_uneven_sizes_of_an_all_to_all_are_no_mismatch() -> None:
    d = disagreement(["all_to_all_single"] * 4, nbytes=[4096, 1024, 8192, 4096])
    assert detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS) is None


def test_two_members_without_a_majority_are_both_named_with_low_confidence() -> None:
    d = disagreement(["all_reduce", "broadcast"], group="dp-3")
    verdict = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (0, 1)
    assert verdict.confidence == 0.5
    assert "no majority" in verdict.summary


def test_of_two_members_the_one_that_left_the_group_is_named_first() -> None:
    # Rank 1 skipped a bucket: its sizes disagree with rank 0's, and it has moved on to the
    # world all_reduce while rank 0 still waits in dp-3.
    d = disagreement(["all_reduce", "all_reduce"], nbytes=[4096, 2048], group="dp-3")
    beats = [
        beat(0, NOW - S // 5, progress("dp-3", 90, 89, enq_us=NOW - 6 * S)),
        beat(1, NOW - S // 5, progress("dp-3", 89, 89, enq_us=NOW - 6 * S),
             progress("0", 12, 11, enq_us=NOW - 6 * S)),
    ]
    verdict = detect_mismatch(observe(snapshot(NOW, 2, beats), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (1, 0)
    assert verdict.confidence == 0.7


def test_pending_ops_that_differ_on_one_sequence_id_name_the_minority() -> None:
    # broadcast against all_reduce: everybody hangs on #41, nobody lags, nobody is silent.
    stuck = NOW - 8 * S
    beats = [beat(r, NOW - S // 5, progress("tp-0", 41, 40, enq_us=stuck)) for r in range(8)
             if r != 6]
    beats.append(beat(6, NOW - S // 5, progress("tp-0", 41, 40, enq_us=stuck, op="broadcast")))
    obs = observe(snapshot(NOW, 8, beats))
    assert detect_hang(obs.snapshot, SETTINGS) is not None  # alone, an unlocalized hang
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH
    assert verdict.culprit_ranks == (6,)
    assert verdict.evidence[0].detail == (
        "rank 6 on node node-0 ran broadcast #41 as #41 of group tp-0 while 7 of its 8 peers "
        "ran all_reduce #41"
    )


def test_a_rank_pending_one_collective_ahead_is_the_culprit_not_the_ones_it_waits_for() -> None:
    # Rank 2 issued an extra collective: it waits in #11 while its three peers wait in #10.
    # Control dependency alone would blame the peers (they "never entered" #11).
    stuck = NOW - 7 * S
    members = {"dp-0": [0, 1, 2, 3]}
    beats = [beat(r, NOW - S // 5, progress("dp-0", 10, 9, enq_us=stuck)) for r in (0, 1, 3)]
    beats.append(beat(2, NOW - S // 5, progress("dp-0", 11, 10, enq_us=stuck, op="broadcast")))
    obs = observe(snapshot(NOW, 4, beats, members))
    hang = detect_hang(obs.snapshot, SETTINGS)
    assert hang is not None and hang.culprit_ranks == (0, 1, 3)
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH
    assert verdict.culprit_ranks == (2,)
    assert verdict.confidence == 0.85
    assert verdict.summary == (
        "rank 2 on node node-0 issued 1 collective(s) more than its peers in group dp-0: it is "
        "pending in broadcast #11 while 3 of 4 members are pending in all_reduce #10"
    )


def test_a_shift_is_not_judged_before_the_hang_threshold() -> None:
    recent = NOW - 2 * S
    beats = [beat(r, NOW - S // 5, progress("dp-0", 10, 9, enq_us=recent)) for r in (0, 1, 3)]
    beats.append(beat(2, NOW - S // 5, progress("dp-0", 11, 10, enq_us=recent)))
    obs = observe(snapshot(NOW, 4, beats, {"dp-0": [0, 1, 2, 3]}))
    assert detect_mismatch(obs, SETTINGS) is None


def test_healthy_group_in_flight_has_no_mismatch() -> None:
    # Members pass through #66 and #67 at slightly different moments: same op on every id.
    beats = [beat(r, NOW - S // 10, progress("tp-0", 66 + r % 2, 65 + r % 2,
                                             enq_us=NOW - S // 20)) for r in range(8)]
    beats += [beat(8, NOW - S // 10, progress("pp-0:p2p:0-8", 5, 4, enq_us=NOW, op="recv"))]
    beats += [beat(0, NOW - S // 10, progress("pp-0:p2p:0-8", 5, 4, enq_us=NOW, op="send"))]
    assert detect_mismatch(observe(snapshot(NOW, 9, beats)), SETTINGS) is None
