"""Mismatches the disagreement query and the pending calls reveal: a size or dtype mismatch that
hangs (told from heartbeats alone), group ids in numeric order, and a cut list that says so."""

from __future__ import annotations

import msgspec
from observation_builders import T0, S, beat, observe, progress, snapshot

from tracehound.analysis.confidence import CERTAIN, WEAK
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.mismatch import detect_mismatch
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.verdict import Fact, Verdict
from tracehound.tracing.events import Heartbeat, IncidentKind
from tracehound.tracing.summaries import Disagreement

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S


def waiting(rank: int, *, nbytes: int = 4096, dtype: str = "bfloat16",
            op: str = "all_reduce", group: str = "tp-0", seq: int = 41) -> Heartbeat:
    """Rank `rank` reporting now, pending for 6 s (past `hang_after_s`) in `op` #`seq`."""
    pending = msgspec.structs.replace(
        progress(group, seq, seq - 1, enq_us=NOW - 6 * S, op=op),
        pending_nbytes=nbytes, pending_dtype=dtype,
    )
    return beat(rank, NOW - S // 5, pending)


def hung(beats: list[Heartbeat]) -> tuple[Verdict | None, Verdict | None]:
    """detect_mismatch's verdict on a job of these heartbeats, and the diagnosis."""
    obs = observe(snapshot(NOW, len(beats), beats, members={"tp-0": range(len(beats))}))
    return detect_mismatch(obs, SETTINGS), diagnose_observation(obs, SETTINGS)


def test_a_hung_size_mismatch_is_told_from_heartbeats_alone() -> None:
    beats = [waiting(r, nbytes=2048 if r == 5 else 4096) for r in range(8)]
    verdict, diagnosed = hung(beats)
    assert verdict is not None and verdict == diagnosed  # a mismatch, not a hang
    assert verdict.kind is IncidentKind.MISMATCH
    assert verdict.culprit_ranks == (5,)
    assert verdict.group == "tp-0"
    assert verdict.confidence == CERTAIN
    assert verdict.summary == (
        "rank 5 on node node-0 called collective #41 of group tp-0 with a different size and "
        "the group hangs in it: it waits in all_reduce of 2048 B bfloat16 while 7 of 8 members "
        "wait in all_reduce of 4096 B bfloat16"
    )
    assert [(e.fact, e.rank, e.group, e.seq) for e in verdict.evidence] == [
        (Fact.DIFFERS, 5, "tp-0", 41)
    ]


def test_a_mismatch_behind_newer_calls_in_flight_is_told_by_the_oldest() -> None:
    """DDP's gradient buckets: every rank has entered buckets #41..#45 when the group hangs.
    Rank 3 called reduce_scatter_tensor at #41, the call the group is blocked on; the last
    call entered (#45) is all_reduce everywhere, so only the oldest call in flight shows it."""
    beats = []
    for r in range(8):
        hb = waiting(r, seq=45)
        g = msgspec.structs.replace(
            hb.groups[0], last_completed=40, oldest_seq=41, oldest_nbytes=4096,
            oldest_dtype="bfloat16",
            oldest_op="reduce_scatter_tensor" if r == 3 else "all_reduce")
        beats.append(msgspec.structs.replace(hb, groups=(g,)))
    verdict, diagnosed = hung(beats)
    assert verdict is not None and verdict == diagnosed
    assert verdict.kind is IncidentKind.MISMATCH and verdict.culprit_ranks == (3,)
    assert "reduce_scatter_tensor #41" in verdict.summary
    assert "7 of 8 members ran all_reduce #41" in verdict.summary


def test_a_hung_dtype_mismatch_names_the_odd_rank() -> None:
    beats = [waiting(r, dtype="float32" if r == 2 else "bfloat16") for r in range(4)]
    verdict, _ = hung(beats)
    assert verdict is not None and verdict.culprit_ranks == (2,)
    assert "with a different dtype" in verdict.summary
    assert "float32" in verdict.summary


def test_without_size_and_dtype_in_the_heartbeats_it_stays_a_hang() -> None:
    # Heartbeats from a recorder that did not report them: nothing to vote on.
    beats = [waiting(r, nbytes=0, dtype="") for r in range(8)]
    verdict, diagnosed = hung(beats)
    assert verdict is None
    assert diagnosed is not None and diagnosed.kind is IncidentKind.HANG


def test_members_without_a_reported_size_have_no_say() -> None:
    # Four members of an older recorder (size 0, dtype "") beside four that agree.
    beats = [waiting(r, nbytes=0, dtype="") if r % 2 else waiting(r) for r in range(8)]
    verdict, _ = hung(beats)
    assert verdict is None


def test_uneven_sizes_of_a_hung_all_to_all_are_no_mismatch() -> None:
    beats = [waiting(r, op="all_to_all_single", nbytes=1024 * (r + 1)) for r in range(4)]
    verdict, diagnosed = hung(beats)
    assert verdict is None
    assert diagnosed is not None and diagnosed.kind is IncidentKind.HANG
    # ... but their dtypes are still compared.
    beats[3] = waiting(3, op="all_to_all_single", nbytes=4096, dtype="float32")
    verdict, _ = hung(beats)
    assert verdict is not None and verdict.culprit_ranks == (3,)


def test_two_members_that_differ_in_size_have_no_majority() -> None:
    beats = [waiting(0, nbytes=4096), waiting(1, nbytes=8192)]
    verdict, _ = hung(beats)
    assert verdict is not None
    assert verdict.culprit_ranks == (0, 1)
    assert verdict.confidence == WEAK


def disagreement(group: str, culprit: int) -> Disagreement:
    ranks = tuple(range(4))
    return Disagreement(group=group, seq=7, ranks=ranks, ops=("all_reduce",) * 4,
                        nbytes=tuple(2048 if r == culprit else 4096 for r in ranks),
                        dtypes=("bfloat16",) * 4)


def test_groups_are_judged_in_numeric_order() -> None:
    # Equal evidence in two groups: the lead is the first group in numeric order.
    obs = observe(snapshot(NOW, 8),
                  disagreements=(disagreement("1500", 3), disagreement("727", 1)))
    verdict = detect_mismatch(obs, SETTINGS)
    assert verdict is not None
    assert verdict.group == "727"
    assert [(e.group, e.rank) for e in verdict.evidence] == [("727", 1), ("1500", 3)]


def test_a_cut_list_says_how_many_it_did_not_read() -> None:
    obs = observe(snapshot(NOW, 8), disagreements=(disagreement("727", 1),),
                  disagreements_dropped=250)
    verdict = detect_mismatch(obs, SETTINGS)
    assert verdict is not None and verdict.culprit_ranks == (1,)
    words = "250 more disagreeing collectives of the window lay past the store's limit"
    assert words in verdict.summary
    assert words in verdict.evidence[0].detail
    whole = detect_mismatch(observe(snapshot(NOW, 8), disagreements=(disagreement("727", 1),)),
                            SETTINGS)
    assert whole is not None and "limit" not in whole.summary
