"""The numpy reference summaries (analysis.sim.reference) against a literal, row-by-row reading
of their definitions (the module docstring of tracing.summaries), on random windows full of ties,
mismatches and p2p oddities."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from statistics import fmean

import numpy as np
import pytest
from hypothesis import given, settings
from summary_data import (
    SIBLING_EXAMPLE,
    T0,
    Case,
    Row,
    assert_clock_samples,
    assert_link_stats,
    assert_node_windows,
    assert_rank_stats,
    columns,
    random_case,
    skewed_clock,
    small_cases,
)

from tracehound.analysis.sim import reference
from tracehound.tracing import shapes as shapes_mod
from tracehound.tracing import summaries
from tracehound.tracing.summaries import (
    ClockCorrection,
    ClockSamples,
    CollectiveColumns,
    Disagreement,
    LinkStats,
    NodeWindows,
    RankStats,
)

# --- the definitions, read literally ----------------------------------------------------------


def rows_of(cols: CollectiveColumns) -> list[Row]:
    return [
        Row(rank=int(cols.rank[i]), group=str(cols.group[i]), seq=int(cols.seq[i]),
            op=str(cols.op[i]), nbytes=int(cols.nbytes[i]), dtype=str(cols.dtype[i]),
            peer=int(cols.peer[i]), completed=bool(cols.completed[i]),
            enqueue_us=int(cols.enqueue_us[i]), complete_us=int(cols.complete_us[i]),
            shape=str(cols.shapes()[i]))
        for i in range(len(cols))
    ]


def counted(case: Case) -> list[tuple[Row, int, int]]:
    """(row, first_us, last_us) of the collective rows in sequences with members >= 2."""
    rows = [r for r in rows_of(case.cols)
            if case.start_us <= r.enqueue_us < case.end_us
            and ":p2p:" not in r.group and r.completed]
    by_seq: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for r in rows:
        by_seq[(r.group, r.seq)].append(r)
    out = []
    for members in by_seq.values():
        if len(members) >= 2:
            first = min(m.enqueue_us for m in members)
            last = max(m.enqueue_us for m in members)
            out.extend((m, first, last) for m in members)
    return out


def naive_rank_stats(case: Case) -> RankStats:
    per: dict[int, list[tuple[Row, int, int]]] = defaultdict(list)
    for row, first, last in counted(case):
        per[row.rank].append((row, first, last))
    ranks = sorted(per)
    per_seq: dict[tuple[str, int], list[int]] = defaultdict(list)
    for row, _, _ in counted(case):
        per_seq[(row.group, row.seq)].append(row.enqueue_us)
    return RankStats(
        rank=np.array(ranks, dtype=np.int64),
        n=np.array([len(per[r]) for r in ranks], dtype=np.int64),
        lateness_mean_us=np.array([fmean(x.enqueue_us - f for x, f, _ in per[r]) for r in ranks]),
        last_count=np.array([sum(x.enqueue_us == la for x, _, la in per[r]) for r in ranks],
                            dtype=np.int64),
        wait_mean_us=np.array([fmean(x.complete_us - x.enqueue_us for x, _, _ in per[r])
                               for r in ranks]),
        span_us=np.array([max(x.enqueue_us for x, _, _ in per[r])
                          - min(x.enqueue_us for x, _, _ in per[r]) for r in ranks],
                         dtype=np.int64),
        blame_us=np.array([float(sum(blame(x, per_seq) for x, _, _ in per[r]))
                           for r in ranks]),
        busy_us=np.array([own_time(case, r)[0] for r in ranks]),
        busy_max_us=np.array([own_time(case, r)[1] for r in ranks]),
        active_us=np.array([own_time(case, r)[2] for r in ranks]),
    )


def blame(row: Row, per_seq: dict[tuple[str, int], list[int]]) -> int:
    """What the group waited on this row's rank alone: its lead over the second latest, when it
    is the only latest member."""
    enqueues = sorted(per_seq[(row.group, row.seq)], reverse=True)
    if row.enqueue_us == enqueues[0] and enqueues[1] < enqueues[0]:
        return row.enqueue_us - enqueues[1]
    return 0


def own_time(case: Case, rank: int) -> tuple[float, float, float]:
    """(busy, longest gap, active) of a rank from all its completed rows in the window."""
    mine = sorted((r.enqueue_us, r.complete_us) for r in rows_of(case.cols)
                  if r.rank == rank and r.completed
                  and case.start_us <= r.enqueue_us < case.end_us)
    gaps = [max(0, mine[i + 1][0] - mine[i][1]) for i in range(len(mine) - 1)]
    active = max(c for _, c in mine) - min(e for e, _ in mine) if mine else 0
    return float(sum(gaps)), float(max(gaps, default=0)), float(active)


def naive_link_stats(case: Case) -> LinkStats:
    by_seq: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for r in rows_of(case.cols):
        if (case.start_us <= r.enqueue_us < case.end_us and ":p2p:" in r.group
                and r.op in summaries.SEND_OPS + summaries.RECV_OPS):
            by_seq[(r.group, r.seq)].append(r)
    transfers: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rows in by_seq.values():
        sends = [r for r in rows if r.op in summaries.SEND_OPS]
        recvs = [r for r in rows if r.op in summaries.RECV_OPS]
        if len(sends) == 1 and len(recvs) == 1 and sends[0].completed and recvs[0].completed:
            t = max(0, min(r.complete_us for r in rows) - max(r.enqueue_us for r in rows))
            transfers[(sends[0].rank, recvs[0].rank)].append(t)
    links = sorted(transfers)
    return LinkStats(
        src=np.array([s for s, _ in links], dtype=np.int64),
        dst=np.array([d for _, d in links], dtype=np.int64),
        n=np.array([len(transfers[k]) for k in links], dtype=np.int64),
        transfer_mean_us=np.array([fmean(transfers[k]) for k in links]),
        transfer_max_us=np.array([float(max(transfers[k])) for k in links]),
    )


def naive_disagreements(case: Case, limit: int = 100, uneven_ops: tuple[str, ...] = ()
                        ) -> summaries.Disagreements:
    by_seq: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for r in rows_of(case.cols):
        if case.start_us <= r.enqueue_us < case.end_us and ":p2p:" not in r.group:
            by_seq[(r.group, r.seq)].append(r)
    out = []
    # Group order: shorter ids first, then by code point; then by seq.
    for (group, seq), rows in sorted(by_seq.items(),
                                     key=lambda kv: (len(kv[0][0]), kv[0][0], kv[0][1])):
        rows.sort(key=lambda r: r.rank)
        uneven = len({(r.op, r.dtype) for r in rows}) == 1 and rows[0].op in uneven_ops
        # shapes count where every row has one, compared as `shapes.comparable` says
        shapes = {shapes_mod.comparable(r.shape, r.op, uneven_ops) for r in rows}
        shape_split = all(r.shape for r in rows) and len(shapes) > 1
        if (len({(r.op, r.nbytes, r.dtype) for r in rows}) > 1 and not uneven) or shape_split:
            votes: Counter[tuple[str, int, str]] = Counter()
            for (other, other_seq), theirs in by_seq.items():
                keys = {(r.op, r.nbytes, r.dtype) for r in theirs}
                if (other != group and other_seq == seq and len(theirs) == len(rows)
                        and len(keys) == 1 and len({r.shape for r in theirs}) == 1):
                    votes[keys.pop()] += 1
            peer, n = min(votes.items(), key=lambda kv: (-kv[1], kv[0]), default=(("", 0, ""), 0))
            out.append(Disagreement(
                group=group, seq=seq, ranks=tuple(r.rank for r in rows),
                ops=tuple(r.op for r in rows), nbytes=tuple(r.nbytes for r in rows),
                dtypes=tuple(r.dtype for r in rows), shapes=tuple(r.shape for r in rows),
                peer_op=peer[0], peer_nbytes=peer[1], peer_dtype=peer[2], peer_groups=n,
            ))
    return summaries.Disagreements(out[:limit], dropped=max(0, len(out) - limit))


def naive_node_windows(case: Case) -> NodeWindows:
    buckets = max(0, math.ceil((case.end_us - case.start_us) / case.window_us))
    cells: dict[tuple[int, str], list[tuple[Row, int, int]]] = defaultdict(list)
    for row, first, last in counted(case):
        bucket = (row.enqueue_us - case.start_us) // case.window_us
        cells[(bucket, case.node_of_rank[row.rank])].append((row, first, last))
    nodes = sorted({node for _, node in cells})
    features = np.full((buckets, len(nodes), 3), np.nan)
    for (bucket, node), items in cells.items():
        features[bucket, nodes.index(node)] = (
            fmean(r.enqueue_us - f for r, f, _ in items),
            sum(r.enqueue_us == la for r, _, la in items) / len(items),
            fmean(r.complete_us - r.enqueue_us for r, _, _ in items),
        )
    return NodeWindows(
        nodes=tuple(nodes),
        window_start_us=np.array([case.start_us + b * case.window_us for b in range(buckets)],
                                 dtype=np.int64),
        features=features,
    )


# --- the numpy summaries agree with the definitions -------------------------------------------


def check(case: Case) -> None:
    c = case
    assert_rank_stats(reference.rank_stats(c.cols, c.start_us, c.end_us), naive_rank_stats(c))
    assert_link_stats(reference.link_stats(c.cols, c.start_us, c.end_us), naive_link_stats(c))
    for limit, uneven in ((100, ()), (2, ()), (2, ("all_reduce", "broadcast"))):
        got = reference.disagreements(c.cols, c.start_us, c.end_us, limit, uneven_ops=uneven)
        want = naive_disagreements(c, limit, uneven)
        assert (got, got.dropped) == (want, want.dropped)
    assert_node_windows(
        reference.node_windows(c.cols, c.node_of_rank, c.start_us, c.end_us, c.window_us),
        naive_node_windows(c),
    )
    check_clocked(c)
    assert_clock_samples(
        reference.clock_samples(c.cols, c.node_of_rank, c.start_us, c.end_us, c.window_us),
        naive_clock_samples(c, c.window_us),
    )


def aligned_case(case: Case, clock: ClockCorrection) -> Case:
    """The case's rows inside its window with times on the common clock, and a window that
    holds them all: what the summaries with `clock` must equal (they pick rows by recorded
    time, then compare aligned times)."""
    inside = (case.cols.enqueue_us >= case.start_us) & (case.cols.enqueue_us < case.end_us)
    cols = dataclasses.replace(
        case.cols, **{f: getattr(case.cols, f)[inside] for f in (
            "rank", "group", "seq", "op", "nbytes", "dtype", "peer", "completed",
            "enqueue_us", "complete_us")})
    nodes = np.array(sorted(set(case.node_of_rank.values())), dtype=np.str_)
    code = np.array([list(nodes).index(case.node_of_rank[int(r)]) for r in cols.rank],
                    dtype=np.int64)
    cols = dataclasses.replace(cols, enqueue_us=clock.align(cols.enqueue_us, code, nodes),
                               complete_us=clock.align(cols.complete_us, code, nodes))
    return dataclasses.replace(case, cols=cols, start_us=-(2**62), end_us=2**62)


def check_clocked(case: Case) -> None:
    c, clock = case, skewed_clock(case)
    got = reference.rank_stats(c.cols, c.start_us, c.end_us, clock=clock,
                               node_of_rank=c.node_of_rank)
    want = naive_rank_stats(aligned_case(c, clock))
    plain = naive_rank_stats(c)
    # busy, longest gap and active time compare one rank's times only: never corrected
    want = dataclasses.replace(want, busy_us=plain.busy_us, busy_max_us=plain.busy_max_us,
                               active_us=plain.active_us)
    assert_rank_stats(got, want)
    assert_link_stats(reference.link_stats(c.cols, c.start_us, c.end_us, clock=clock,
                                           node_of_rank=c.node_of_rank),
                      naive_link_stats(aligned_case(c, clock)))


def naive_clock_samples(case: Case, width_us: int) -> ClockSamples:
    rows = [r for r in rows_of(case.cols)
            if case.start_us <= r.enqueue_us < case.end_us and r.completed
            and (r.op in summaries.SEND_OPS + summaries.RECV_OPS if ":p2p:" in r.group
                 else r.op in summaries.SYMMETRIC_OPS)]
    by_seq: dict[tuple[str, int], list[Row]] = defaultdict(list)
    for r in rows:
        by_seq[(r.group, r.seq)].append(r)
    cells: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for (group, _), members in by_seq.items():
        if len({case.node_of_rank[m.rank] for m in members}) < 2:
            continue
        completes = sorted(m.complete_us for m in members)
        center = completes[len(completes) // 2]
        if not case.start_us <= center < case.end_us:
            continue
        for m in members:
            bucket = (center - case.start_us) // width_us
            cells[(group, case.node_of_rank[m.rank], bucket)].append(m.complete_us - center)
    keys = sorted(cells)
    return ClockSamples(
        group=np.array([k[0] for k in keys], dtype=np.str_),
        node=np.array([k[1] for k in keys], dtype=np.str_),
        bucket=np.array([k[2] for k in keys], dtype=np.int64),
        offset_us=np.array([sorted(cells[k])[len(cells[k]) // 2] for k in keys], np.float64),
        n=np.array([len(cells[k]) for k in keys], dtype=np.int64),
        start_us=case.start_us, width_us=width_us,
    )


@settings(max_examples=300, deadline=None)
@given(case=small_cases())
def test_numpy_summaries_follow_the_definitions(case: Case) -> None:
    check(case)


@pytest.mark.parametrize("seed", range(8))
def test_numpy_summaries_follow_the_definitions_on_bigger_windows(seed: int) -> None:
    case = random_case(seed)
    check(case)
    # The case is not degenerate: every summary has something to say.
    assert len(reference.rank_stats(case.cols, case.start_us, case.end_us).rank) > 5
    assert len(reference.link_stats(case.cols, case.start_us, case.end_us).src) > 0
    assert reference.disagreements(case.cols, case.start_us, case.end_us)


def row(rank: int, group: str, seq: int, enqueue: int, complete: int, *, op: str = "all_reduce",
        completed: bool = True, dtype: str = "float32") -> Row:
    return Row(rank=rank, group=group, seq=seq, op=op, nbytes=8, dtype=dtype, peer=-1,
               completed=completed, enqueue_us=T0 + enqueue, complete_us=T0 + complete)


WORKED = [
    row(0, "0", 1, 10, 20), row(1, "0", 1, 12, 20), row(2, "0", 1, 12, 21),  # 1 and 2 tie last
    row(0, "0", 2, 30, 40), row(1, "0", 2, 31, 40, op="broadcast"),  # disagree on op
    row(2, "0", 2, 33, 0, completed=False),  # failed: not counted, but part of the disagreement
    row(0, "1", 1, 50, 60),  # alone in its sequence: not counted
    row(3, "0:p2p:3-4", 1, 5, 25, op="send"), row(4, "0:p2p:3-4", 1, 9, 26, op="recv"),
    row(0, "0", 3, 999, 1000), row(1, "0", 3, 999, 1000),  # outside the window
]


def test_a_worked_example() -> None:
    case = Case(cols=columns(WORKED), node_of_rank={0: "a", 1: "a", 2: "b", 3: "b", 4: "c"},
                start_us=T0, end_us=T0 + 100, window_us=25)
    ranks = reference.rank_stats(case.cols, case.start_us, case.end_us)
    assert ranks.rank.tolist() == [0, 1, 2]
    assert ranks.n.tolist() == [2, 2, 1]
    assert ranks.lateness_mean_us.tolist() == [0.0, 1.5, 2.0]
    assert ranks.last_count.tolist() == [0, 2, 1]
    assert ranks.wait_mean_us.tolist() == [10.0, 8.5, 9.0]
    assert ranks.span_us.tolist() == [20, 19, 0]
    links = reference.link_stats(case.cols, case.start_us, case.end_us)
    assert (links.src.tolist(), links.dst.tolist(), links.n.tolist()) == ([3], [4], [1])
    # from both posted (9) to the first side done (the send, 25)
    assert links.transfer_mean_us.tolist() == links.transfer_max_us.tolist() == [16.0]
    assert reference.disagreements(case.cols, case.start_us, case.end_us) == (
        Disagreement(group="0", seq=2, ranks=(0, 1, 2), ops=("all_reduce", "broadcast",
                     "all_reduce"), nbytes=(8, 8, 8), dtypes=("float32",) * 3,
                     shapes=("",) * 3),
    )
    windows = reference.node_windows(case.cols, case.node_of_rank, case.start_us, case.end_us,
                                     case.window_us)
    assert windows.nodes == ("a", "b")
    assert windows.window_start_us.tolist() == [T0, T0 + 25, T0 + 50, T0 + 75]
    np.testing.assert_array_equal(windows.features[0], [[1.0, 0.5, 9.0], [2.0, 1.0, 9.0]])
    np.testing.assert_array_equal(windows.features[1], [[0.5, 0.5, 9.5], [np.nan] * 3])
    assert np.isnan(windows.features[2:]).all()


def test_an_empty_window_gives_empty_summaries() -> None:
    cols = columns(WORKED)
    assert len(reference.rank_stats(cols, T0 + 2000, T0 + 3000).rank) == 0
    assert len(reference.link_stats(cols, T0 + 2000, T0 + 3000).src) == 0
    assert reference.disagreements(cols, T0, T0) == ()
    windows = reference.node_windows(cols, {}, T0 + 2000, T0 + 2010, 3)
    assert windows.nodes == ()
    assert windows.features.shape == (4, 0, 3)
    assert reference.node_windows(cols, {}, T0, T0 - 5, 3).features.shape == (0, 0, 3)


def test_node_windows_refuses_a_rank_without_a_node_and_a_bad_width() -> None:
    cols = columns(WORKED)
    with pytest.raises(ValueError, match=r"no node for ranks \[2\]"):
        reference.node_windows(cols, {0: "a", 1: "a"}, T0, T0 + 100, 10)
    with pytest.raises(ValueError, match="window_us must be positive"):
        reference.node_windows(cols, {}, T0, T0 + 100, 0)


def test_node_windows_refuses_more_windows_than_it_can_hold() -> None:
    with pytest.raises(ValueError, match="at most 100000 are allowed"):
        reference.node_windows(columns(WORKED), {}, 0, 2**62, 1_000)


def test_a_disagreement_carries_what_its_sibling_groups_ran() -> None:
    ar = "all_reduce"
    rows = SIBLING_EXAMPLE
    got = reference.disagreements(columns(rows), T0, T0 + 100)
    assert [(d.group, d.seq, d.peer_op, d.peer_nbytes, d.peer_dtype, d.peer_groups)
            for d in got] == [
        ("dp-0", 7, ar, 8, "bf16", 2), ("dp-0", 9, ar, 8, "f32", 1), ("dp-0", 10, "", 0, "", 0),
        ("dp-4", 7, ar, 8, "bf16", 2),
    ]
    assert got == naive_disagreements(Case(cols=columns(rows), node_of_rank={}, start_us=T0,
                                           end_us=T0 + 100, window_us=10))
