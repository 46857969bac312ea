"""Collective columns for the summary tests: random ones (seeded, and as a hypothesis strategy)
full of the awkward cases, and comparisons of summaries that allow float means to differ by
rounding only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st

from tracehound.tracing.summaries import (
    ClockCorrection,
    ClockSamples,
    CollectiveColumns,
    LinkStats,
    NodeWindows,
    RankStats,
)

T0 = 1_700_000_000_000_000
"""Realistic epoch microseconds, so UInt64/Int64 arithmetic in SQL is exercised for real."""


@dataclass(frozen=True, slots=True)
class Row:
    rank: int
    group: str
    seq: int
    op: str
    nbytes: int
    dtype: str
    peer: int
    completed: bool
    enqueue_us: int
    complete_us: int
    shape: str = ""


@dataclass(frozen=True, slots=True)
class Case:
    cols: CollectiveColumns
    node_of_rank: dict[int, str]
    start_us: int
    end_us: int
    window_us: int


def columns(rows: Sequence[Row]) -> CollectiveColumns:
    def ints(name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in rows], dtype=np.int64)

    def texts(name: str) -> np.ndarray:
        return np.array([getattr(r, name) for r in rows], dtype=np.str_)

    return CollectiveColumns(
        rank=ints("rank"), group=texts("group"), seq=ints("seq"), op=texts("op"),
        nbytes=ints("nbytes"), dtype=texts("dtype"), peer=ints("peer"),
        completed=np.array([r.completed for r in rows], dtype=np.bool_),
        enqueue_us=ints("enqueue_us"), complete_us=ints("complete_us"), shape=texts("shape"),
    )


def random_case(seed: int, *, ranks: int = 16) -> Case:
    """A window with collective groups (all ranks, subsets, odd names), p2p pair groups with
    transfers that count and ones that must not, failed rows, tied arrivals, negative waits,
    mismatching op/nbytes/dtype, and rows on both sides of the window."""
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    everyone = list(range(ranks))
    groups = {"0": everyone, "Z-upper": everyone[::2], "a-lower": everyone[1::3],
              "tp:é": everyone[:4], "10": everyone[4:9]}
    for group, members in groups.items():
        for seq in range(1, 9):
            base = T0 + seq * 1_000 + int(rng.integers(0, 200))
            size = int(rng.integers(1, len(members) + 1))
            chosen = sorted(rng.choice(members, size=size, replace=False).tolist())
            for rank in chosen:
                done = rng.random() > 0.1
                enqueue = base + int(rng.integers(0, 4)) * 10  # few values: ties
                rows.append(Row(
                    rank=rank, group=group, seq=seq,
                    op="broadcast" if rng.random() < 0.04 else "all_reduce",
                    nbytes=2048 if rng.random() < 0.03 else 1024,
                    dtype="bfloat16" if rng.random() < 0.03 else "float32", peer=-1,
                    completed=done, enqueue_us=enqueue,
                    complete_us=enqueue + int(rng.integers(-5, 400)) if done else 0,
                ))
    for a, b in ((0, 1), (2, 3), (3, 4), (5, 2)):
        group = f"0:p2p:{min(a, b)}-{max(a, b)}"
        for seq in range(1, 10):
            base = T0 + seq * 900 + int(rng.integers(0, 100))
            send = ("send", "isend")[int(rng.integers(2))]
            recv = ("recv", "irecv")[int(rng.integers(2))]
            pattern = int(rng.integers(7))
            e1, e2 = base + int(rng.integers(0, 30)), base + int(rng.integers(0, 30))
            finish = max(e1, e2) + int(rng.integers(-10, 300))
            pair = [Row(rank=a, group=group, seq=seq, op=send, nbytes=512, dtype="float32",
                        peer=b, completed=True, enqueue_us=e1, complete_us=finish),
                    Row(rank=b, group=group, seq=seq, op=recv, nbytes=512, dtype="float32",
                        peer=a, completed=True, enqueue_us=e2, complete_us=finish + 3)]
            if pattern == 1:  # the receiver failed: no transfer
                pair[1] = Row(**{**_fields(pair[1]), "completed": False, "complete_us": 0})
            elif pattern == 2:  # only one side traced
                pair = pair[:1]
            elif pattern == 3:  # both sides claim to send: no transfer
                pair[1] = Row(**{**_fields(pair[1]), "op": "send"})
            elif pattern == 4:  # a third row with another op is ignored
                pair.append(Row(rank=9, group=group, seq=seq, op="barrier", nbytes=0,
                                dtype="", peer=-1, completed=True, enqueue_us=e1 + 999,
                                complete_us=e1 + 5_000))
            elif pattern == 5:  # a third send-side row: no transfer
                pair.append(Row(rank=10, group=group, seq=seq, op="isend", nbytes=512,
                                dtype="float32", peer=b, completed=True, enqueue_us=e1,
                                complete_us=finish))
            rows.extend(pair)
    rows.extend(_sibling_groups(np.random.default_rng([seed, 1]), ranks))
    times = [r.enqueue_us for r in rows]
    lo, hi = min(times), max(times)
    start = lo + int(rng.integers(0, (hi - lo) // 5))
    end = hi - int(rng.integers(0, (hi - lo) // 5))
    nodes = {r: f"node-{r // 3}" for r in range(ranks + 2)}
    return Case(cols=columns(rows), node_of_rank=nodes, start_us=start, end_us=end,
                window_us=int(rng.integers(300, 3_000)))


SIBLING_KEYS = (("all_reduce", 1024, "float32"), ("all_reduce", 1024, "bfloat16"),
                ("all_reduce", 512, "float32"), ("broadcast", 1024, "float32"))


def _sibling_groups(rng: np.random.Generator, ranks: int) -> list[Row]:
    """Groups of the same size running the same program, as data-parallel groups do: at each
    seq every group runs one of a few keys (so sibling votes tie often), a member sometimes
    runs another key or is missing (a disagreement, or a group of another size)."""
    rows = []
    for j in range(7):
        members = [j, j + ranks // 2]
        if j >= 4:
            members.append(j + ranks // 4)
        for seq in range(1, 9):
            key = SIBLING_KEYS[int(rng.integers(0, 2 if seq % 2 else len(SIBLING_KEYS)))]
            base = T0 + seq * 1_000 + int(rng.integers(0, 200))
            for rank in members:
                if rng.random() < 0.08:
                    continue
                op, nbytes, dtype = (
                    SIBLING_KEYS[int(rng.integers(len(SIBLING_KEYS)))]
                    if rng.random() < 0.12 else key
                )
                enqueue = base + int(rng.integers(0, 4)) * 10
                rows.append(Row(rank=rank, group=f"dp-{j}", seq=seq, op=op, nbytes=nbytes,
                                dtype=dtype, peer=-1, completed=rng.random() > 0.1,
                                enqueue_us=enqueue, complete_us=enqueue + 50))
    return rows


def _fields(row: Row) -> dict[str, object]:
    return {name: getattr(row, name) for name in Row.__slots__}


def _sib(rank: int, group: str, op: str, nbytes: int, dtype: str, *, seq: int = 7) -> Row:
    return Row(rank=rank, group=group, seq=seq, op=op, nbytes=nbytes, dtype=dtype, peer=-1,
               completed=True, enqueue_us=T0 + rank, complete_us=T0 + 50)


_AR, _BC = "all_reduce", "broadcast"
SIBLING_EXAMPLE = (
    _sib(0, "dp-0", _AR, 8, "bf16"), _sib(1, "dp-0", _AR, 16, "f32"),  # the 2-member tie
    _sib(2, "dp-1", _AR, 8, "bf16"), _sib(3, "dp-1", _AR, 8, "bf16"),  # votes (ar, 8, bf16)
    _sib(4, "dp-2", _AR, 8, "bf16"), _sib(5, "dp-2", _AR, 8, "bf16"),  # votes (ar, 8, bf16)
    _sib(6, "dp-3", _BC, 8, "bf16"), _sib(7, "dp-3", _BC, 8, "bf16"),  # votes (bc, 8, bf16)
    _sib(8, "dp-4", _AR, 8, "bf16"), _sib(9, "dp-4", _AR, 8, "f32"),  # disagrees: no vote
    _sib(10, "dp-5", _AR, 8, "bf16"),  # one row, not two: no vote
    _sib(11, "dp-6", _AR, 8, "bf16", seq=8), _sib(12, "dp-6", _AR, 8, "bf16", seq=8),  # seq 8
    _sib(13, "x:p2p:13-14", _AR, 8, "bf16"), _sib(14, "x:p2p:13-14", _AR, 8, "bf16"),  # p2p
    # At seq 9 the only two siblings tie: the smaller key wins (op, then nbytes, then dtype).
    _sib(0, "dp-0", _AR, 8, "bf16", seq=9), _sib(1, "dp-0", _BC, 8, "bf16", seq=9),
    _sib(2, "dp-1", _AR, 16, "bf16", seq=9), _sib(3, "dp-1", _AR, 16, "bf16", seq=9),
    _sib(4, "dp-2", _AR, 8, "f32", seq=9), _sib(5, "dp-2", _AR, 8, "f32", seq=9),
    # At seq 10 there is no sibling.
    _sib(0, "dp-0", _AR, 8, "bf16", seq=10), _sib(1, "dp-0", _BC, 8, "bf16", seq=10),
)
"""Disagreements with sibling groups that vote, tie, or do not count (tests of the reference)."""


GROUPS = ("0", "1", "a", "0:p2p:1-2", "0:p2p:2-3")
SHAPES = ("", "", "[2]:f", "[2]:f -> [4]:f", "[3]:f -> [4]:f", "[2]:f -> [4]:h", " -> [4]:f")
"""Unknown, agreeing, and differing in an input's size, an output's size or dtype, or in
what a rooted op's root alone passes."""
OPS = ("all_reduce", "broadcast", "send", "recv", "isend", "irecv", "all_to_all_single",
       "gather", "scatter")


@st.composite
def small_cases(draw: st.DrawFn) -> Case:
    """Few ranks, groups, seqs and times, so that collisions (ties, mismatches, p2p patterns)
    are common."""
    keys = draw(st.lists(
        st.tuples(st.sampled_from(GROUPS), st.integers(1, 3), st.integers(0, 5)),
        unique=True, max_size=40,
    ))
    rows = []
    for group, seq, rank in keys:
        completed = draw(st.booleans())
        enqueue = T0 + draw(st.integers(0, 20))
        rows.append(Row(
            rank=rank, group=group, seq=seq, op=draw(st.sampled_from(OPS)),
            nbytes=draw(st.sampled_from((8, 16))), dtype=draw(st.sampled_from(("f", "h"))),
            peer=-1, completed=completed, enqueue_us=enqueue,
            complete_us=enqueue + draw(st.integers(-3, 20)) if completed else 0,
            shape=draw(st.sampled_from(SHAPES)),
        ))
    start = T0 + draw(st.integers(-2, 10))
    end = start + draw(st.integers(0, 25))
    return Case(cols=columns(rows), node_of_rank={r: f"n{r // 2}" for r in range(6)},
                start_us=start, end_us=end, window_us=draw(st.integers(1, 12)))


def assert_rank_stats(got: RankStats, want: RankStats) -> None:
    np.testing.assert_array_equal(got.rank, want.rank)
    np.testing.assert_array_equal(got.n, want.n)
    np.testing.assert_array_equal(got.last_count, want.last_count)
    np.testing.assert_allclose(got.lateness_mean_us, want.lateness_mean_us, rtol=1e-12)
    np.testing.assert_allclose(got.wait_mean_us, want.wait_mean_us, rtol=1e-12)
    np.testing.assert_array_equal(got.span_us, want.span_us)
    for name in ("blame_us", "busy_us", "busy_max_us", "active_us"):
        mine, theirs = getattr(got, name), getattr(want, name)
        assert mine is not None and theirs is not None, name
        np.testing.assert_allclose(mine, theirs, rtol=1e-12, err_msg=name)


def assert_clock_samples(got: ClockSamples, want: ClockSamples) -> None:
    assert got.group.tolist() == want.group.tolist()
    assert got.node.tolist() == want.node.tolist()
    np.testing.assert_array_equal(got.bucket, want.bucket)
    np.testing.assert_array_equal(got.offset_us, want.offset_us)
    np.testing.assert_array_equal(got.n, want.n)


def assert_link_stats(got: LinkStats, want: LinkStats) -> None:
    np.testing.assert_array_equal(got.src, want.src)
    np.testing.assert_array_equal(got.dst, want.dst)
    np.testing.assert_array_equal(got.n, want.n)
    np.testing.assert_allclose(got.transfer_mean_us, want.transfer_mean_us, rtol=1e-12)
    np.testing.assert_array_equal(got.transfer_max_us, want.transfer_max_us)


def assert_node_windows(got: NodeWindows, want: NodeWindows) -> None:
    assert got.nodes == want.nodes
    np.testing.assert_array_equal(got.window_start_us, want.window_start_us)
    assert got.features.shape == want.features.shape
    np.testing.assert_allclose(got.features, want.features, rtol=1e-12, equal_nan=True)


def skewed_clock(case: Case) -> ClockCorrection:
    """A correction for the case's nodes: offsets of milliseconds either way and drift of some
    ppm, one node left uncorrected."""
    nodes = sorted(set(case.node_of_rank.values()))[1:]
    return ClockCorrection(
        ref_us=T0 + 3, nodes=tuple(nodes),
        offset_us=tuple(float((-1) ** i * (1500.25 * (i + 1))) for i in range(len(nodes))),
        drift=tuple(((-1) ** i) * 7e-6 * (i + 1) for i in range(len(nodes))),
    )
