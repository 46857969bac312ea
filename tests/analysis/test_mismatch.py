"""Mismatch by majority vote: recorded disagreements, pending ops and shifted sequence ids."""

from __future__ import annotations

from observation_builders import T0, S, beat, observe, progress, snapshot

from tracehound.analysis.confidence import CERTAIN, LIKELY, STRONG, WEAK
from tracehound.analysis.detect import detect_hang
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.mismatch import detect_mismatch
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import Disagreement

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S


def disagreement(ops: list[str], *, nbytes: list[int] | None = None,
                 dtypes: list[str] | None = None, group: str = "tp-0", seq: int = 88,
                 ranks: list[int] | None = None,
                 peer: tuple[str, int, str, int] = ("", 0, "", 0)) -> Disagreement:
    """`peer`: what the sibling groups ran (op, nbytes, dtype) and how many of them."""
    k = len(ops)
    return Disagreement(group=group, seq=seq, ranks=tuple(ranks or range(k)), ops=tuple(ops),
                        nbytes=tuple(nbytes or [4096] * k),
                        dtypes=tuple(dtypes or ["bfloat16"] * k), peer_op=peer[0],
                        peer_nbytes=peer[1], peer_dtype=peer[2], peer_groups=peer[3])


def test_the_rank_that_ran_another_op_is_named_not_the_majority() -> None:
    d = disagreement(["all_reduce"] * 5 + ["broadcast"] + ["all_reduce"] * 2)
    verdict = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH
    assert verdict.basis is Basis.MAJORITY_VOTE
    assert verdict.culprit_ranks == (5,)
    assert verdict.culprit_nodes == ("node-0",)
    assert verdict.group == "tp-0"
    assert verdict.confidence == CERTAIN
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
    assert verdict.confidence == WEAK
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
    assert verdict.confidence == LIKELY


def test_two_of_four_members_that_disagree_wait_for_the_other_two() -> None:
    # The rows of ranks 0 and 3 have not reached the store yet: ranks 1 and 2 alone are no tie
    # of a two-member group (which would name rank 1 first); the vote waits for the others.
    world = {"0": [0, 1, 2, 3]}
    partial = disagreement(["all_reduce", "broadcast"], group="0", ranks=[1, 2])
    assert detect_mismatch(observe(snapshot(NOW, 4, members=world),
                                   disagreements=(partial,)), SETTINGS) is None
    whole = disagreement(["all_reduce", "all_reduce", "broadcast", "all_reduce"], group="0")
    verdict = detect_mismatch(observe(snapshot(NOW, 4, members=world), disagreements=(whole,)),
                              SETTINGS)
    assert verdict is not None and verdict.culprit_ranks == (2,)
    # three of four seen, two against one: the unseen member cannot turn it, a majority of four
    # needs three
    three = disagreement(["all_reduce", "broadcast", "all_reduce"], group="0", ranks=[0, 2, 3])
    assert detect_mismatch(observe(snapshot(NOW, 4, members=world), disagreements=(three,)),
                           SETTINGS) is None


def test_pending_ops_seen_on_two_of_four_members_wait_for_the_other_two() -> None:
    stuck = NOW - 8 * S
    world = {"0": [0, 1, 2, 3]}
    beats = [beat(0, NOW - S // 5, progress("0", 40, 39, enq_us=stuck)),
             beat(1, NOW - S // 5, progress("0", 41, 40, enq_us=stuck)),
             beat(2, NOW - S // 5, progress("0", 41, 40, enq_us=stuck, op="broadcast")),
             beat(3, NOW - S // 5, progress("0", 40, 40, enq_us=stuck))]
    assert detect_mismatch(observe(snapshot(NOW, 4, beats, members=world)), SETTINGS) is None
    beats[0] = beat(0, NOW - S // 5, progress("0", 41, 40, enq_us=stuck))
    beats[3] = beat(3, NOW - S // 5, progress("0", 41, 40, enq_us=stuck))
    verdict = detect_mismatch(observe(snapshot(NOW, 4, beats, members=world)), SETTINGS)
    assert verdict is not None and verdict.culprit_ranks == (2,)


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
    assert verdict.confidence == STRONG
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


def test_a_rank_back_from_a_pause_is_not_read_as_a_shift_before_its_peers_report_again() -> None:
    # Rank 0 wrote a checkpoint for 20 s while ranks 1-3 waited in #32. Back, it runs through
    # #32 and enters #33..#39 (gradient buckets) before ranks 1-3 next report #32 complete:
    # their last heartbeats, taken before rank 0 came back, still say pending in #32.
    waited = NOW - 20 * S
    back = NOW - S // 2
    members = {"dp-0": [0, 1, 2, 3]}
    beats = [beat(r, back - S // 10, progress("dp-0", 32, 31, enq_us=waited)) for r in (1, 2, 3)]
    beats.append(beat(0, NOW - S // 10, progress("dp-0", 39, 32, enq_us=back)))
    obs = observe(snapshot(NOW, 4, beats, members))
    assert detect_mismatch(obs, SETTINGS) is None
    # The same picture `hang_after_s` later, everybody having reported since, is a shift.
    later = NOW + 6 * S
    beats = [beat(r, later - S // 10, progress("dp-0", 32, 31, enq_us=waited)) for r in (1, 2, 3)]
    beats.append(beat(0, later - S // 10, progress("dp-0", 39, 32, enq_us=back)))
    verdict = detect_mismatch(observe(snapshot(later, 4, beats, members)), SETTINGS)
    assert verdict is not None and verdict.culprit_ranks == (0,)
    assert "issued 7 collective(s) more" in verdict.summary


def test_healthy_group_in_flight_has_no_mismatch() -> None:
    # Members pass through #66 and #67 at slightly different moments: same op on every id.
    beats = [beat(r, NOW - S // 10, progress("tp-0", 66 + r % 2, 65 + r % 2,
                                             enq_us=NOW - S // 20)) for r in range(8)]
    beats += [beat(8, NOW - S // 10, progress("pp-0:p2p:0-8", 5, 4, enq_us=NOW, op="recv"))]
    beats += [beat(0, NOW - S // 10, progress("pp-0:p2p:0-8", 5, 4, enq_us=NOW, op="send"))]
    assert detect_mismatch(observe(snapshot(NOW, 9, beats)), SETTINGS) is None


# --- sibling groups: other groups of the same size that agree at the same sequence id ---------


def dtype_tie(peer: tuple[str, int, str, int]) -> Disagreement:
    """dp-22 = {38, 46}: rank 46 ran float32 at twice the size, rank 38 bfloat16."""
    return disagreement(["all_reduce"] * 2, nbytes=[4096, 8192], dtypes=["bfloat16", "float32"],
                        group="dp-22", seq=10215, ranks=[38, 46], peer=peer)


def test_siblings_break_a_tie_of_two_members() -> None:
    d = dtype_tie(("all_reduce", 4096, "bfloat16", 31))
    verdict = detect_mismatch(observe(snapshot(NOW, 64), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (46,)
    assert verdict.basis is Basis.MAJORITY_VOTE
    assert verdict.confidence == STRONG
    assert verdict.group == "dp-22"
    assert verdict.summary == (
        "rank 46 on node node-5 ran a different dtype at collective #10215 of group dp-22: "
        "all_reduce of 8192 B float32 while 1 of 2 members ran all_reduce of 4096 B bfloat16, "
        "as did 31 other groups of 2 members at the same sequence id (the group itself has no "
        "majority)"
    )
    assert [(e.rank, e.group, e.seq) for e in verdict.evidence] == [(46, "dp-22", 10215)]
    # Whichever side the siblings back is the one kept.
    other = dtype_tie(("all_reduce", 8192, "float32", 5))
    flipped = detect_mismatch(observe(snapshot(NOW, 64), disagreements=(other,)), SETTINGS)
    assert flipped is not None and flipped.culprit_ranks == (38,)


def test_too_few_or_unrelated_siblings_leave_the_tie() -> None:
    for peer in [("all_reduce", 4096, "bfloat16", 1),  # one sibling is not enough
                 ("all_reduce", 2048, "bfloat16", 9),  # they ran neither call
                 ("", 0, "", 0)]:  # no sibling at all
        verdict = detect_mismatch(
            observe(snapshot(NOW, 64), disagreements=(dtype_tie(peer),)), SETTINGS)
        assert verdict is not None
        assert verdict.culprit_ranks == (38, 46)
        assert verdict.confidence == WEAK
        assert "no majority" in verdict.summary


def test_siblings_break_a_tie_of_more_members_only_between_the_tied_calls() -> None:
    # 2 against 2: the siblings back the broadcast, so the all_reduce pair is named.
    d = disagreement(["all_reduce", "broadcast", "all_reduce", "broadcast"],
                     peer=("broadcast", 4096, "bfloat16", 4))
    verdict = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (0, 2)
    assert verdict.confidence == LIKELY
    # 2 against 1 against 1 is a majority: siblings backing a minority call change nothing.
    d = disagreement(["all_reduce", "broadcast", "all_reduce", "all_gather"],
                     peer=("broadcast", 4096, "bfloat16", 4))
    verdict = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (1, 3)
    assert verdict.confidence == LIKELY
    assert "other groups" not in verdict.summary


def test_a_majority_within_the_group_outweighs_its_siblings() -> None:
    d = disagreement(["all_reduce"] * 4, nbytes=[4096, 4096, 2048, 4096],
                     peer=("all_reduce", 2048, "bfloat16", 12))
    verdict = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (2,)
    assert verdict.confidence == CERTAIN
    assert "other groups" not in verdict.summary


def test_siblings_that_agree_with_the_majority_add_confidence() -> None:
    ops = ["all_reduce", "all_reduce", "broadcast", "all_reduce", "all_gather"]
    alone = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(disagreement(ops),)),
                            SETTINGS)
    assert alone is not None and alone.confidence == LIKELY
    d = disagreement(ops, peer=("all_reduce", 4096, "bfloat16", 7))
    verdict = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(d,)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == alone.culprit_ranks == (2, 4)
    assert verdict.confidence == STRONG
    assert verdict.summary.endswith(
        "while 3 of 5 members ran all_reduce of 4096 B bfloat16, as did 7 other groups of 5 "
        "members at the same sequence id"
    )


def test_a_majority_within_a_group_leads_a_tie_broken_by_siblings() -> None:
    by_siblings = dtype_tie(("all_reduce", 4096, "bfloat16", 31))
    own = disagreement(["all_reduce", "all_reduce", "broadcast"], group="tp-4", seq=900,
                       ranks=[32, 33, 39])
    verdict = detect_mismatch(
        observe(snapshot(NOW, 64), disagreements=(by_siblings, own)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (39, 46)
    assert verdict.group == "tp-4"
    assert verdict.confidence == CERTAIN
