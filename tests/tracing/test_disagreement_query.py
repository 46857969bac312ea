"""The disagreement query under load, on every store adapter (a real ClickHouse 18.16 server and
chdb) and in the numpy reference: collectives that are uneven by design are left out before the
limit, group ids that are numbers are listed as numbers, and a cut says how many it dropped."""

from __future__ import annotations

import pytest
from summary_data import T0, Case, Row, columns

from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.sim import reference
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore
from tracehound.tracing.summaries import Disagreement, Disagreements

JOB = JobId("job-d")
UNEVEN = DetectionSettings().mismatch.size_exempt_ops


def member(rank: int, group: str, seq: int, *, op: str = "all_reduce", nbytes: int = 4096,
           dtype: str = "bfloat16") -> Row:
    enqueue = T0 + seq * 100 + rank
    return Row(rank=rank, group=group, seq=seq, op=op, nbytes=nbytes, dtype=dtype, peer=-1,
               completed=True, enqueue_us=enqueue, complete_us=enqueue + 50)


def window(rows: list[Row]) -> Case:
    ranks = {r.rank for r in rows}
    return Case(cols=columns(rows), node_of_rank={r: f"node-{r // 8}" for r in ranks},
                start_us=T0, end_us=T0 + 10**9, window_us=10**6)


def both(store: TraceStore, case: Case, limit: int = 100, uneven: tuple[str, ...] = ()
         ) -> tuple[Disagreements, Disagreements]:
    """The store's disagreements and the numpy reference's, after checking they are equal."""
    store.insert_columns(JOB, 0, case.cols, case.node_of_rank, batch_id="b")
    got = store.disagreements(JOB, 0, case.start_us, case.end_us, limit, uneven_ops=uneven)
    want = reference.disagreements(case.cols, case.start_us, case.end_us, limit,
                                   uneven_ops=uneven)
    assert (tuple(got), got.dropped) == (tuple(want), want.dropped)
    return got, want


def moe_window() -> Case:
    """500 all_to_all collectives of the expert group "727" whose members pass uneven splits
    (as MoE token routing does), and one all_reduce in group "9000" where rank 6 passes half
    the bytes its three peers pass. Both orders of group ids put "727" first."""
    rows = [
        member(r, "727", seq, op="all_to_all_single", nbytes=1024 * (1 + (seq + r) % 4))
        for seq in range(1, 501) for r in range(4)
    ]
    rows += [member(r, "9000", 3, nbytes=2048 if r == 6 else 4096) for r in range(4, 8)]
    return window(rows)


def test_a_size_mismatch_among_500_uneven_all_to_all_is_found(store: TraceStore) -> None:
    got, _ = both(store, moe_window(), uneven=UNEVEN)
    assert [(d.group, d.seq, d.ranks, d.nbytes) for d in got] == [
        ("9000", 3, (4, 5, 6, 7), (4096, 4096, 2048, 4096))
    ]
    assert got.dropped == 0


def test_without_the_uneven_ops_the_all_to_all_rows_fill_the_limit(store: TraceStore) -> None:
    # What the query did before it knew the uneven ops: the first 100 rows are all_to_all and
    # the real mismatch is cut, but the cut now says so.
    got, _ = both(store, moe_window())
    assert len(got) == 100
    assert {d.group for d in got} == {"727"}
    assert got.dropped == 401


def test_an_uneven_op_still_disagrees_on_its_dtype_or_with_another_op(store: TraceStore) -> None:
    rows = [member(r, "5", 1, op="all_to_all", nbytes=1024 * (r + 1)) for r in range(3)]
    rows += [member(r, "5", 2, op="all_to_all", dtype="float32" if r == 1 else "bfloat16")
             for r in range(3)]
    rows += [member(r, "5", 3, op="all_reduce" if r == 2 else "all_to_all") for r in range(3)]
    got, _ = both(store, window(rows), uneven=UNEVEN)
    assert [(d.seq, d.ops, d.dtypes) for d in got] == [
        (2, ("all_to_all",) * 3, ("bfloat16", "float32", "bfloat16")),
        (3, ("all_to_all", "all_to_all", "all_reduce"), ("bfloat16",) * 3),
    ]


def test_group_ids_that_are_numbers_are_listed_as_numbers(store: TraceStore) -> None:
    groups = ["1500", "727", "10", "tp-3", "9", "dp-12"]
    rows = [member(r, g, 1, dtype="float32" if r == 0 else "bfloat16")
            for g in groups for r in range(2)]
    got, _ = both(store, window(rows))
    assert [d.group for d in got] == ["9", "10", "727", "1500", "tp-3", "dp-12"]


def test_the_cut_says_how_many_disagreements_it_dropped(store: TraceStore) -> None:
    rows = [member(r, g, seq, nbytes=2048 if r == seq % 3 else 4096)
            for g in ("2", "11") for seq in range(1, 5) for r in range(3)]
    case = window(rows)
    store.insert_columns(JOB, 0, case.cols, case.node_of_rank, batch_id="b")
    expected = [("2", s) for s in range(1, 5)] + [("11", s) for s in range(1, 5)]
    for limit in (1, 3, 8, 100):
        got = store.disagreements(JOB, 0, case.start_us, case.end_us, limit)
        want = reference.disagreements(case.cols, case.start_us, case.end_us, limit)
        assert [(d.group, d.seq) for d in got] == expected[:limit]
        assert got.dropped == want.dropped == max(0, 8 - limit)
    with pytest.raises(ValueError, match="limit must be at least 1"):
        store.disagreements(JOB, 0, case.start_us, case.end_us, 0)
    with pytest.raises(ValueError, match="limit must be at least 1"):
        reference.disagreements(case.cols, case.start_us, case.end_us, 0)
    # An empty window cuts nothing.
    assert store.disagreements(JOB, 0, T0, T0).dropped == 0


def test_uneven_op_names_are_bound_values(store: TraceStore) -> None:
    odd = "all_to_all') OR ('1'='1\\"
    rows = [member(r, "3", 1, op=odd, nbytes=1024 * (r + 1)) for r in range(3)]
    rows += [member(r, "3", 2, nbytes=1024 * (r + 1)) for r in range(3)]
    got, _ = both(store, window(rows), uneven=(odd, "x\ty", "é"))
    assert [(d.group, d.seq) for d in got] == [("3", 2)]
    # A disagreement row is the same dataclass as before: only the container is new.
    assert isinstance(got[0], Disagreement)


def counted_rows() -> list[Row]:
    """A size mismatch in group "5" at seq 7, and counted groups (`<group>:ddp`: DDP's own
    communication, agent/hooks.py `_DdpCount`, one `ddp_comm` a step whose seq is a count of
    operations, so it lines up with other groups' seqs by chance) at seq 7 and 9."""
    rows = [member(r, "5", 7, nbytes=2048 if r == 3 else 4096) for r in range(4)]
    rows += [member(r, "5:ddp", 7, op="ddp_comm", nbytes=0, dtype="") for r in range(4)]
    rows += [member(r, "6:ddp", 9, op="ddp_comm", nbytes=r, dtype="") for r in range(4)]
    return rows


def test_a_counted_group_neither_disagrees_nor_votes_as_a_sibling(store: TraceStore) -> None:
    got, _ = both(store, window(counted_rows()))
    assert [(d.group, d.seq, d.peer_op, d.peer_groups) for d in got] == [("5", 7, "", 0)]


def test_beside_a_counted_group_a_real_sibling_is_the_reference(store: TraceStore) -> None:
    rows = counted_rows() + [member(r, "8", 7) for r in range(4)]
    got, _ = both(store, window(rows))
    assert [(d.group, d.peer_op, d.peer_nbytes, d.peer_groups) for d in got] == [
        ("5", "all_reduce", 4096, 1)]
