"""Per-window summaries of collective traces, as numpy columns: what the analysis reads at scale.

A detection window over a 10,000-rank job holds hundreds of thousands of collective events; the
analysis never looks at them one by one. The store computes these summaries in SQL
(`TraceStore.rank_stats`, `link_stats`, `disagreements`, `node_windows`), and the numpy
reference in `tracehound.analysis.sim.reference` computes the very same summaries from
`CollectiveColumns` (the simulator's output; the SQL is tested against it). The definitions
here are shared by both (differences of times are signed: a clock that runs backwards gives
negative values, never wrapped ones):

- A window is `start_us <= enqueue_us < end_us`, one job and attempt. Rows outside it are ignored
  before anything else is computed (a sequence is judged by its rows inside the window).
- Collective rows are those whose group is not a point-to-point pair group (`":p2p:"` not in the
  group id) and whose state is `completed`. Per (group, seq): first_us = min(enqueue_us),
  last_us = max(enqueue_us), members = count of rows.
- RankStats, per rank over its collective rows in sequences with members >= 2 (ranks without
  such rows are absent): n, lateness_mean_us = mean(enqueue_us - first_us), last_count = number
  of sequences where the rank's enqueue_us == last_us (ties count for every tied rank),
  wait_mean_us = mean(complete_us - enqueue_us), span_us = max(enqueue_us) - min(enqueue_us)
  (how far the rank's counted collectives spread: with n it gives the time between collectives,
  whatever part of the window the job was running in). blame_us = the sum, over the sequences
  where the rank is the only member with enqueue_us == last_us, of last_us minus the second
  latest enqueue_us of the sequence (how long the group waited on this rank alone).
  From ALL the rank's completed rows in the window (any group, p2p included), sorted by
  (enqueue_us, complete_us): gaps = enqueue_us of each row minus complete_us of the row before
  it, negative gaps counting 0; busy_us = sum(gaps) (the time the rank spent outside its
  operations: its compute, as the trace sees it), busy_max_us = max(gaps) (0 without a gap),
  active_us = max(complete_us) - min(enqueue_us) of those rows. These three compare times of one
  rank only, so no clock correction applies to them.
- Clock correction (optional, `ClockCorrection`): every enqueue_us and complete_us a summary
  compares across ranks is first aligned: t - floor(offset_us[node] + drift[node] * (t - ref_us))
  in float64, node being the row's node (absent nodes: no correction). RankStats (except busy_us,
  busy_max_us, active_us), LinkStats and NodeWindows are computed on aligned times; the window
  itself (start_us <= enqueue_us < end_us) is always on the recorded times.
- ClockSamples: what node clock offsets are estimated from. Rows: in the window, completed, op in
  SYMMETRIC_OPS (members leave these within a short interval of each other) or a p2p pair
  group's send/recv rows; per (group, seq) whose rows come from at least two nodes: center =
  the upper median of complete_us (sorted[count // 2], ClickHouse's quantileExact(0.5)), kept
  when start_us <= center < end_us (a call entered in the window that completed past its end
  would make a bucket of its own from a few samples, which a node's drift would be fitted to);
  each row's diff = complete_us - center; bucket = (center - start_us) // width_us. Per (group,
  node, bucket): offset_us = upper median of diff, n = count; sorted by (group, node, bucket).
- LinkStats, per (src, dst) over p2p pair groups (`":p2p:"` in the group id). Per (group, seq),
  only its send-side rows (op send/isend) and recv-side rows (op recv/irecv) count, any other op
  is ignored; it is a transfer when there is exactly one send-side row (src = its rank) and
  exactly one recv-side row (dst = its rank), both completed: transfer_us = min(complete_us) -
  max(enqueue_us) of those two rows, at least 0 (from the moment both sides posted to the first
  side's completion: a side whose call also waited for something else, such as a send issued in
  one call with the next receive, completes later than the transfer did). n, transfer_mean_us,
  transfer_max_us per (src, dst).
- Disagreement: a (group, seq) among the non-p2p rows of the window that are not of a counted
  group (`COUNTED_SUFFIX`: its operations are counted, not calls), completed or failed, whose rows
  do not all share one op, one nbytes and one dtype, unless they are uneven by design: all share
  one op that is one of the caller's `uneven_ops` and one dtype, and differ in nbytes only (an
  all_to_all whose members send different splits); or, where every row has a shape
  (`tracing.shapes`), whose shapes differ as `shapes.comparable` compares them. Its ranks with
  their op, nbytes, dtype and shape, sorted by rank. Listed in group order (`group_order`: shorter
  ids first, ids of one length by code point, which is ClickHouse's byte order of UTF-8; so ids
  that are numbers compare as numbers, "727" before "1500"), then by seq; the first `limit` (at
  least 1) are kept and `Disagreements.dropped` counts the rest. With each, the reference of its
  siblings: for a disagreement at seq s with m rows, its siblings are the OTHER groups with
  exactly m rows at seq s among the same rows (non-p2p, not counted, in the window, completed or
  failed) that all share one op, one nbytes, one dtype and one shape (so a disagreeing group is
  never a sibling). Each sibling votes for its (op, nbytes, dtype); peer_op, peer_nbytes,
  peer_dtype are the key with the most votes (ties go to the smallest key, comparing op, then
  nbytes, then dtype, strings by code point) and peer_groups is its number of votes; "", 0, "" and
  0 when there is no sibling.
- NodeWindows: windows of `window_us` aligned at `start_us`, bucket = (enqueue_us - start_us)
  // window_us, ceil((end_us - start_us) / window_us) buckets (the last may be shorter), with
  window_start_us = start_us + bucket * window_us. Rows are the collective rows RankStats counts
  (first_us, last_us and members are per (group, seq) over the whole window, not per bucket;
  a row falls in the bucket of its own enqueue_us, clamped to the first or last bucket when
  a clock-corrected time falls outside them). Per (bucket, node) over that node's rows in
  the bucket: lateness_mean_us, last_fraction (= last_count / n), wait_mean_us, as a dense array
  [buckets, nodes, features] with NaN where a node has no rows in a bucket. Nodes are those
  with at least one such row in the window, sorted by name; a rank's node is `node_of_rank` in
  the numpy reference and the node stored with the row in a store. At most MAX_BUCKETS buckets
  (ValueError beyond).

The dashboard's views of one attempt, `ProgressGrid` (ranks x recent seqs of one group) and
`LatenessSeries` (the worst ranks' arrival lateness over time), are defined in their docstrings;
the stores compute them in SQL and nothing else does.

This module holds the summaries' data and definitions, and the numpy helpers the stores share
with the reference; it never queries a store.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Self

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

P2P_MARK = ":p2p:"
COUNTED_SUFFIX = ":ddp"
"""Ends the id of a group whose progress is counted, not recorded call by call: the operations
of the DDP models on the group before it (agent/hooks.py `_DdpCount`). Its ids are counts of
operations and skip; heartbeats report it, and one event a training step."""
SEND_OPS = ("send", "isend")
RECV_OPS = ("recv", "irecv")


@dataclass(frozen=True, slots=True, eq=False)
class CollectiveColumns:
    """Collective events as parallel columns (one row per rank per operation)."""

    rank: I64
    group: npt.NDArray[np.str_]
    seq: I64
    op: npt.NDArray[np.str_]
    nbytes: I64
    dtype: npt.NDArray[np.str_]
    peer: I64
    completed: npt.NDArray[np.bool_]
    """state == completed (False: failed)."""
    enqueue_us: I64
    complete_us: I64
    shape: npt.NDArray[np.str_] | None = None
    """Shape texts (`tracing.shapes`); None: unknown for every row ("")."""

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    def shapes(self) -> npt.NDArray[np.str_]:
        """The shape column, "" for every row where none was given."""
        if self.shape is None:
            return np.full(len(self), "", dtype=np.str_)
        return self.shape


@dataclass(frozen=True, slots=True, eq=False)
class RankStats:
    """Per-rank arrival statistics over a window, sorted by rank. The last four columns are
    None where a source does not compute them."""

    rank: I64
    n: I64
    lateness_mean_us: F64
    last_count: I64
    wait_mean_us: F64
    span_us: I64
    blame_us: F64 | None = None
    busy_us: F64 | None = None
    busy_max_us: F64 | None = None
    active_us: F64 | None = None


SYMMETRIC_OPS = (
    "all_reduce", "allreduce", "allreduce_coalesced", "all_gather", "all_gather_into_tensor",
    "allgather", "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "alltoall", "alltoall_base", "barrier",
)
"""Collectives every member leaves at about the same moment (no root): their completion times
tell node clocks apart."""


@dataclass(frozen=True, slots=True)
class ClockCorrection:
    """Per-node clock corrections: a node's clock reads `offset_us + drift * (t - ref_us)`
    ahead of the job's common time at its own time t."""

    ref_us: int
    nodes: tuple[str, ...]
    offset_us: tuple[float, ...]
    drift: tuple[float, ...]
    """Seconds gained per second (ppm / 1e6)."""

    def __post_init__(self) -> None:
        if not len(self.nodes) == len(self.offset_us) == len(self.drift):
            raise ValueError("nodes, offset_us and drift must have one entry per node")

    def align(self, times: I64, node_codes: I64, nodes: npt.NDArray[np.str_]) -> I64:
        """`times` on the common clock; `node_codes` index `nodes`, the node of each time."""
        index = {n: i for i, n in enumerate(self.nodes)}
        where = np.array([index.get(str(n), -1) for n in nodes], dtype=np.int64)
        offset = np.append(np.asarray(self.offset_us, np.float64), 0.0)[where]
        drift = np.append(np.asarray(self.drift, np.float64), 0.0)[where]
        if times.shape[0] == 0:
            return times.astype(np.int64)
        row_offset = offset[node_codes]
        row_drift = drift[node_codes]
        correction = np.floor(row_offset + row_drift * (times - self.ref_us).astype(np.float64))
        aligned: I64 = (times - correction.astype(np.int64)).astype(np.int64)
        return aligned


@dataclass(frozen=True, slots=True, eq=False)
class ClockSamples:
    """Per (group, node, bucket) how far a node's completion times sit from its collectives'
    centers (see the module docstring), what clock offsets are estimated from."""

    group: npt.NDArray[np.str_]
    node: npt.NDArray[np.str_]
    bucket: I64
    offset_us: F64
    n: I64
    start_us: int
    width_us: int

    def __len__(self) -> int:
        return int(self.group.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class LinkStats:
    """Per-link transfer statistics over a window, sorted by (src, dst)."""

    src: I64
    dst: I64
    n: I64
    transfer_mean_us: F64
    transfer_max_us: F64


@dataclass(frozen=True, slots=True)
class Disagreement:
    """One collective whose participants disagree on what it is."""

    group: str
    seq: int
    ranks: tuple[int, ...]
    ops: tuple[str, ...]
    nbytes: tuple[int, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[str, ...] = ()
    """Each rank's shape text (`tracing.shapes`), "" where unknown; () from older sources."""
    peer_op: str = ""
    """What most sibling groups (same seq, as many rows, agreeing) ran; "" without siblings."""
    peer_nbytes: int = 0
    peer_dtype: str = ""
    peer_groups: int = 0
    """How many sibling groups ran (peer_op, peer_nbytes, peer_dtype); 0 without siblings."""


class Disagreements(tuple[Disagreement, ...]):
    """The disagreements a limit kept, in group order (see `group_order`), and how many more
    disagreeing (group, seq) it dropped.

    A tuple of the kept rows, so it iterates, slices and compares like them; equality ignores
    `dropped` (compare it apart)."""

    dropped: int
    """Disagreeing (group, seq) past the limit; 0 when nothing was cut."""

    def __new__(cls, rows: Iterable[Disagreement] = (), *, dropped: int = 0) -> Self:
        if dropped < 0:
            raise ValueError(f"dropped must not be negative, got {dropped}")
        kept = super().__new__(cls, rows)
        object.__setattr__(kept, "dropped", dropped)
        return kept

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({tuple.__repr__(self)}, dropped={self.dropped})"


def group_order(group: str) -> tuple[int, str]:
    """The key groups are listed by: shorter ids first, ids of one length by code point, so ids
    that are numbers compare as numbers ("727" before "1500"). The stores sort by
    (lengthUTF8(group_id), group_id), the same order."""
    return (len(group), group)


@dataclass(frozen=True, slots=True, eq=False)
class NodeWindows:
    """Per-node features per time window, for the machine-level outlier model."""

    nodes: tuple[str, ...]
    window_start_us: I64
    """Start of each window (len = buckets)."""
    features: F64
    """[buckets, nodes, len(FEATURES)], NaN where a node had no rows in a window."""

    FEATURES = ("lateness_mean_us", "last_fraction", "wait_mean_us")


@dataclass(frozen=True, slots=True)
class ProgressCell:
    """One cell of a progress grid: the rows of one bucket of ranks at one seq of the group."""

    bucket: int
    """The first rank of the bucket (a multiple of the grid's width)."""
    seq: int
    ranks: int
    """Rows in the cell (one per rank of the bucket that recorded this seq)."""
    failed: int
    """Rows of the cell whose state is failed."""
    late_max_us: int
    """Max over the cell's rows of enqueue_us minus the earliest enqueue_us of this (group,
    seq) over all its ranks."""
    late_mean_us: float
    """Mean of the same over the cell's rows."""
    op: str
    """The op of the cell's rows (the smallest by code point when they disagree)."""


@dataclass(frozen=True, slots=True)
class BucketProgress:
    """How far the ranks of one bucket got in a group, from each rank's latest heartbeat of the
    attempt that reports the group."""

    bucket: int
    """The first rank of the bucket (a multiple of the grid's width)."""
    ranks: int
    """Ranks of the bucket that sent a heartbeat reporting the group."""
    min_completed: int
    """Lowest last_completed among them."""
    max_completed: int
    """Highest last_completed among them."""
    max_enqueued: int
    """Highest last_enqueued among them."""
    pending: int
    """Ranks among them whose heartbeat shows last_enqueued > last_completed (waiting in an op
    of the group)."""


@dataclass(frozen=True, slots=True)
class ProgressGrid:
    """A ranks x recent sequence ids grid of one process group of an attempt
    (`TraceStore.progress_grid`), aggregated in the store.

    Ranks are bucketed by global rank: width = max(1, ceil((max_rank + 1) / rank_buckets)),
    max_rank being the highest rank among the group's collective rows of the attempt and the
    ranks whose heartbeats report the group; a rank's bucket is rank // width * width. The seqs
    are [seq_lo, seq_hi]: seq_hi is the group's highest stored seq of the attempt, seq_lo =
    max(seq_hi - last_seqs + 1, the group's lowest stored seq). Collective rows are stored when
    an op ends (completed or failed), so a pending op is seen in `buckets`, not in `cells`.
    With no collective row of the group, seq_lo = seq_hi = 0 and `cells` is empty; with no
    heartbeat reporting it, `buckets` is empty."""

    group: str
    width: int
    """Ranks per bucket."""
    seq_lo: int
    seq_hi: int
    cells: tuple[ProgressCell, ...]
    """Cells with at least one row, ordered by bucket then seq."""
    buckets: tuple[BucketProgress, ...]
    """Buckets with at least one rank reporting the group, ordered by bucket."""


@dataclass(frozen=True, slots=True, eq=False)
class LatenessSeries:
    """Per-rank arrival lateness over time, for a stragglers view
    (`TraceStore.lateness_series`).

    Rows: the collective rows (peer = -1, so no send/recv) of the window start_us <= enqueue_us
    < end_us of one job and attempt, completed or failed. A row's lateness = its enqueue_us minus
    the earliest enqueue_us of its (group, seq) among those rows (0 for the first to arrive).
    Time buckets of `width_us` from `start_us` by enqueue_us; a bucket is named by its start,
    start_us + k * width_us. The top ranks are the `top` ranks with the highest mean lateness
    over the whole window (ties: lower rank first)."""

    start_us: int
    width_us: int
    top_rank: I64
    """The top ranks, highest mean lateness first."""
    top_node: npt.NDArray[np.str_]
    """Each top rank's node."""
    top_mean_us: F64
    """Each top rank's mean lateness over the window."""
    top_n: I64
    """Each top rank's rows in the window."""
    bucket_us: I64
    """Per (bucket, top rank) with rows, ordered by bucket then rank: the bucket's start..."""
    rank: I64
    """...the rank..."""
    mean_us: F64
    """...its mean lateness in the bucket..."""
    max_us: I64
    """...its max lateness in the bucket..."""
    n: I64
    """...and its rows in the bucket."""
    typical_bucket_us: I64
    """Per bucket with rows (of any rank), ordered: the bucket's start..."""
    typical_us: F64
    """...the upper median lateness of all its rows (sorted[n // 2], ClickHouse's
    quantileExact(0.5)): what a typical rank's lateness was, to draw the top ranks against..."""
    typical_n: I64
    """...and its rows."""

    def series(self, rank: int) -> tuple[I64, F64, I64]:
        """(bucket starts, mean lateness, max lateness) of one of the top ranks."""
        mine = self.rank == rank
        return self.bucket_us[mine], self.mean_us[mine], self.max_us[mine]


# --- shared by the stores and the numpy reference ---------------------------------------------


def factorize(values: npt.NDArray[np.str_]) -> tuple[npt.NDArray[np.str_], I64]:
    """(sorted distinct values, code of each value). Runs of equal neighbours are collapsed
    first: the columns usually come grouped, and sorting strings is the costly part."""
    n = values.shape[0]
    if n == 0:
        return values[:0], np.zeros(0, np.int64)
    heads = np.empty(n, np.bool_)
    heads[0] = True
    np.not_equal(values[1:], values[:-1], out=heads[1:])
    run = np.cumsum(heads) - 1
    uniques, run_codes = np.unique(values[heads], return_inverse=True)
    return uniques, run_codes.reshape(-1).astype(np.int64)[run]


MAX_BUCKETS = 100_000
"""The most windows a node_windows summary has (it is dense): more is a caller's mistake."""


def bucket_count(start_us: int, end_us: int, window_us: int) -> int:
    """How many windows of `window_us` cover [start_us, end_us) (the last may be shorter).
    Raises ValueError for a width that is not positive or more than MAX_BUCKETS windows."""
    if window_us <= 0:
        raise ValueError(f"window_us must be positive, got {window_us}")
    buckets = max(0, -(-(end_us - start_us) // window_us))
    if buckets > MAX_BUCKETS:
        raise ValueError(
            f"[{start_us}, {end_us}) holds {buckets} windows of {window_us} us; at most "
            f"{MAX_BUCKETS} are allowed (node_windows returns a dense array)"
        )
    return buckets
