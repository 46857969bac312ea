"""Per-window summaries of collective traces, as numpy columns: what the analysis reads at scale.

A detection window over a 10,000-rank job holds hundreds of thousands of collective events; the
analysis never looks at them one by one. The store computes these summaries in SQL
(`TraceStore.rank_stats`, `link_stats`, `disagreements`, `node_windows`), and the functions
here compute the very same summaries with numpy from `CollectiveColumns` (the simulator's output
and the reference the SQL is tested against). Definitions, shared by both (differences of
times are signed: a clock that runs backwards gives negative values, never wrapped ones):

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
  whatever part of the window the job was running in).
- LinkStats, per (src, dst) over p2p pair groups (`":p2p:"` in the group id). Per (group, seq),
  only its send-side rows (op send/isend) and recv-side rows (op recv/irecv) count, any other op
  is ignored; it is a transfer when there is exactly one send-side row (src = its rank) and
  exactly one recv-side row (dst = its rank), both completed: transfer_us = max(complete_us) -
  max(enqueue_us) of those two rows. n, transfer_mean_us, transfer_max_us per (src, dst).
- Disagreement: a (group, seq) among the non-p2p rows of the window, completed or failed, whose
  rows do not all share one op, one nbytes and one dtype; its ranks with their op, nbytes and
  dtype, sorted by rank. The first `limit` by (group, seq) (group ids compare by code point,
  which is ClickHouse's byte order of UTF-8). With each, the reference of its siblings: for a
  disagreement at seq s with m rows, its siblings are the OTHER groups with exactly m rows at
  seq s among the same rows (non-p2p, in the window, completed or failed) that all share one
  op, one nbytes and one dtype (so a disagreeing group is never a sibling). Each sibling votes
  for its (op, nbytes, dtype); peer_op, peer_nbytes, peer_dtype are the key with the most votes
  (ties go to the smallest key, comparing op, then nbytes, then dtype, strings by code point)
  and peer_groups is its number of votes; "", 0, "" and 0 when there is no sibling.
- NodeWindows: windows of `window_us` aligned at `start_us`, bucket = (enqueue_us - start_us)
  // window_us, ceil((end_us - start_us) / window_us) buckets (the last may be shorter), with
  window_start_us = start_us + bucket * window_us. Rows are the collective rows RankStats counts
  (first_us, last_us and members are per (group, seq) over the whole window, not per bucket;
  a row falls in the bucket of its own enqueue_us). Per (bucket, node) over that node's rows in
  the bucket: lateness_mean_us, last_fraction (= last_count / n), wait_mean_us, as a dense array
  [buckets, nodes, features] with NaN where a node has no rows in a bucket. Nodes are those
  with at least one such row in the window, sorted by name; a rank's node is `node_of_rank` here
  and the node stored with the row in a store. At most MAX_BUCKETS buckets (ValueError beyond).

This module holds data and pure numpy; it never queries a store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

P2P_MARK = ":p2p:"
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

    def __len__(self) -> int:
        return int(self.rank.shape[0])


@dataclass(frozen=True, slots=True, eq=False)
class RankStats:
    """Per-rank arrival statistics over a window, sorted by rank."""

    rank: I64
    n: I64
    lateness_mean_us: F64
    last_count: I64
    wait_mean_us: F64
    span_us: I64


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
    peer_op: str = ""
    """What most sibling groups (same seq, as many rows, agreeing) ran; "" without siblings."""
    peer_nbytes: int = 0
    peer_dtype: str = ""
    peer_groups: int = 0
    """How many sibling groups ran (peer_op, peer_nbytes, peer_dtype); 0 without siblings."""


@dataclass(frozen=True, slots=True, eq=False)
class NodeWindows:
    """Per-node features per time window, for the machine-level outlier model."""

    nodes: tuple[str, ...]
    window_start_us: I64
    """Start of each window (len = buckets)."""
    features: F64
    """[buckets, nodes, len(FEATURES)], NaN where a node had no rows in a window."""

    FEATURES = ("lateness_mean_us", "last_fraction", "wait_mean_us")


# --- the numpy reference --------------------------------------------------------------------


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


def _segments(*keys: I64) -> tuple[I64, I64]:
    """For rows sorted by `keys`: the start of every run of equal keys, and each row's run."""
    n = keys[0].shape[0]
    new = np.zeros(n, np.bool_)
    if n:
        new[0] = True
        for key in keys:
            new[1:] |= key[1:] != key[:-1]
    return np.flatnonzero(new).astype(np.int64), np.cumsum(new, dtype=np.int64) - 1


def _in_window(cols: CollectiveColumns, start_us: int, end_us: int) -> npt.NDArray[np.bool_]:
    return (cols.enqueue_us >= start_us) & (cols.enqueue_us < end_us)


def _p2p_rows(group_codes: I64, groups: npt.NDArray[np.str_]) -> npt.NDArray[np.bool_]:
    is_p2p: npt.NDArray[np.bool_] = np.char.find(groups, P2P_MARK) >= 0
    return is_p2p[group_codes]


@dataclass(frozen=True, slots=True, eq=False)
class _Arrivals:
    """The collective rows RankStats and NodeWindows count, with their per-row measures."""

    rank: I64
    enqueue_us: I64
    lateness_us: I64
    is_last: npt.NDArray[np.bool_]
    wait_us: I64


def _arrivals(cols: CollectiveColumns, start_us: int, end_us: int) -> _Arrivals:
    window = np.flatnonzero(_in_window(cols, start_us, end_us) & cols.completed)
    groups, gcode = factorize(cols.group[window])
    keep = ~_p2p_rows(gcode, groups)
    rows, gcode = window[keep], gcode[keep]
    seq = cols.seq[rows]
    order = np.lexsort((seq, gcode))
    rows, gcode, seq = rows[order], gcode[order], seq[order]
    enqueue = cols.enqueue_us[rows]
    starts, seg = _segments(gcode, seq)
    if rows.shape[0]:
        first = np.minimum.reduceat(enqueue, starts)
        last = np.maximum.reduceat(enqueue, starts)
    else:
        first = last = np.zeros(0, np.int64)
    members = np.diff(np.append(starts, rows.shape[0]))
    counted = members[seg] >= 2
    rows, seg, enqueue = rows[counted], seg[counted], enqueue[counted]
    return _Arrivals(
        rank=cols.rank[rows],
        enqueue_us=enqueue,
        lateness_us=enqueue - first[seg],
        is_last=enqueue == last[seg],
        wait_us=cols.complete_us[rows] - enqueue,
    )


def rank_stats(cols: CollectiveColumns, start_us: int, end_us: int) -> RankStats:
    """Per-rank arrival statistics of a window (see the module docstring)."""
    a = _arrivals(cols, start_us, end_us)
    ranks, code = np.unique(a.rank, return_inverse=True)
    code = code.reshape(-1)
    n = np.bincount(code, minlength=ranks.shape[0]).astype(np.int64)
    return RankStats(
        rank=ranks.astype(np.int64),
        n=n,
        lateness_mean_us=np.bincount(code, weights=a.lateness_us, minlength=ranks.shape[0]) / n,
        last_count=np.bincount(code, weights=a.is_last, minlength=ranks.shape[0]).astype(
            np.int64
        ),
        wait_mean_us=np.bincount(code, weights=a.wait_us, minlength=ranks.shape[0]) / n,
        span_us=_span(code, a.enqueue_us, ranks.shape[0]),
    )


def _span(code: I64, values: I64, size: int) -> I64:
    """max - min of `values` per code (0..size-1)."""
    if size == 0:
        return np.zeros(0, np.int64)
    high = np.full(size, np.iinfo(np.int64).min, np.int64)
    low = np.full(size, np.iinfo(np.int64).max, np.int64)
    np.maximum.at(high, code, values)
    np.minimum.at(low, code, values)
    return (high - low).astype(np.int64)


def link_stats(cols: CollectiveColumns, start_us: int, end_us: int) -> LinkStats:
    """Per-link transfer statistics of a window (see the module docstring)."""
    window = np.flatnonzero(_in_window(cols, start_us, end_us))
    groups, gcode = factorize(cols.group[window])
    ops, opcode = factorize(cols.op[window])
    send_op = np.isin(ops, SEND_OPS)[opcode]
    recv_op = np.isin(ops, RECV_OPS)[opcode]
    keep = _p2p_rows(gcode, groups) & (send_op | recv_op)
    rows, gcode, send_op = window[keep], gcode[keep], send_op[keep]
    seq = cols.seq[rows]
    order = np.lexsort((seq, gcode))
    rows, gcode, seq, send_op = rows[order], gcode[order], seq[order], send_op[order]
    empty = LinkStats(
        src=np.zeros(0, np.int64), dst=np.zeros(0, np.int64), n=np.zeros(0, np.int64),
        transfer_mean_us=np.zeros(0, np.float64), transfer_max_us=np.zeros(0, np.float64),
    )
    if rows.shape[0] == 0:
        return empty
    starts, _ = _segments(gcode, seq)
    rank = cols.rank[rows]
    n_send = np.add.reduceat(send_op.astype(np.int64), starts)
    n_rows = np.diff(np.append(starts, rows.shape[0]))
    n_done = np.add.reduceat(cols.completed[rows].astype(np.int64), starts)
    ok = (n_send == 1) & (n_rows == 2) & (n_done == 2)
    src = np.add.reduceat(np.where(send_op, rank, 0), starts)[ok]
    dst = np.add.reduceat(np.where(send_op, 0, rank), starts)[ok]
    transfer = (
        np.maximum.reduceat(cols.complete_us[rows], starts)
        - np.maximum.reduceat(cols.enqueue_us[rows], starts)
    )[ok]
    if transfer.shape[0] == 0:
        return empty
    order = np.lexsort((dst, src))
    src, dst, transfer = src[order], dst[order], transfer[order]
    starts, _ = _segments(src, dst)
    n = np.diff(np.append(starts, src.shape[0])).astype(np.int64)
    return LinkStats(
        src=src[starts].astype(np.int64),
        dst=dst[starts].astype(np.int64),
        n=n,
        transfer_mean_us=np.add.reduceat(transfer.astype(np.float64), starts) / n,
        transfer_max_us=np.maximum.reduceat(transfer, starts).astype(np.float64),
    )


def disagreements(
    cols: CollectiveColumns, start_us: int, end_us: int, limit: int = 100
) -> tuple[Disagreement, ...]:
    """The first `limit` collectives of a window whose ranks disagree, by (group, seq), each
    with the reference of its sibling groups (see the module docstring)."""
    window = np.flatnonzero(_in_window(cols, start_us, end_us))
    groups, gcode = factorize(cols.group[window])
    keep = ~_p2p_rows(gcode, groups)
    rows, gcode = window[keep], gcode[keep]
    seq, rank = cols.seq[rows], cols.rank[rows]
    order = np.lexsort((rank, seq, gcode))
    rows, gcode, seq = rows[order], gcode[order], seq[order]
    if rows.shape[0] == 0 or limit <= 0:
        return ()
    ops, opcode = factorize(cols.op[rows])
    dtypes, dtcode = factorize(cols.dtype[rows])
    nbytes = cols.nbytes[rows]
    starts, seg = _segments(gcode, seq)
    head = starts[seg]
    differs = (opcode != opcode[head]) | (dtcode != dtcode[head]) | (nbytes != nbytes[head])
    split = np.logical_or.reduceat(differs, starts)
    bad = np.flatnonzero(split)[:limit]
    if bad.shape[0] == 0:
        return ()
    ends = np.append(starts, rows.shape[0])
    members = np.diff(ends)
    peers = _sibling_votes(
        (seq[starts], members, opcode[starts], nbytes[starts], dtcode[starts]),
        agrees=~split, seqs=np.unique(seq[starts[bad]]),
    )
    out = []
    for k in bad:
        part = rows[starts[k]:ends[k + 1]]
        peer = peers.get((int(seq[starts[k]]), int(members[k])))
        out.append(Disagreement(
            group=str(groups[gcode[starts[k]]]),
            seq=int(seq[starts[k]]),
            ranks=tuple(int(r) for r in cols.rank[part]),
            ops=tuple(str(o) for o in cols.op[part]),
            nbytes=tuple(int(b) for b in cols.nbytes[part]),
            dtypes=tuple(str(d) for d in cols.dtype[part]),
            peer_op=str(ops[peer[0]]) if peer else "",
            peer_nbytes=peer[1] if peer else 0,
            peer_dtype=str(dtypes[peer[2]]) if peer else "",
            peer_groups=peer[3] if peer else 0,
        ))
    return tuple(out)


def _sibling_votes(
    segments: tuple[I64, I64, I64, I64, I64], *, agrees: npt.NDArray[np.bool_], seqs: I64
) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """Per (seq, members) with a seq in `seqs`: the (op code, nbytes, dtype code) most of the
    agreeing (group, seq) ran (the smallest on a tie) and how many ran it. `segments` holds
    (seq, members, op code, nbytes, dtype code) and `agrees` a flag per (group, seq); op and
    dtype codes sort like their strings."""
    voters = np.flatnonzero(agrees & np.isin(segments[0], seqs))
    if voters.shape[0] == 0:
        return {}
    keys = tuple(k[voters] for k in segments)
    order = np.lexsort(keys[::-1])
    keys = tuple(k[order] for k in keys)
    starts, _ = _segments(*keys)
    votes = np.diff(np.append(starts, voters.shape[0]))
    s, m, o, n, d = (k[starts] for k in keys)
    best = np.lexsort((d, n, o, -votes, m, s))
    firsts, _ = _segments(s[best], m[best])
    return {
        (int(s[i]), int(m[i])): (int(o[i]), int(n[i]), int(d[i]), int(votes[i]))
        for i in best[firsts]
    }


MAX_BUCKETS = 100_000
"""The most windows `node_windows` makes (its result is dense): more is a caller's mistake."""


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


def node_windows(
    cols: CollectiveColumns,
    node_of_rank: Mapping[int, str],
    start_us: int,
    end_us: int,
    window_us: int,
) -> NodeWindows:
    """Per-node features per window of `window_us` (see the module docstring). Raises
    ValueError for a counted row whose rank has no node in `node_of_rank`."""
    buckets = bucket_count(start_us, end_us, window_us)
    a = _arrivals(cols, start_us, end_us)
    ranks, rcode = np.unique(a.rank, return_inverse=True)
    missing = [int(r) for r in ranks if int(r) not in node_of_rank]
    if missing:
        raise ValueError(f"node_of_rank has no node for ranks {missing[:10]}")
    nodes, ncode_of_rank = np.unique(
        np.array([node_of_rank[int(r)] for r in ranks], dtype=np.str_), return_inverse=True
    )
    ncode = ncode_of_rank.reshape(-1)[rcode.reshape(-1)]
    bucket = (a.enqueue_us - start_us) // window_us
    cells = buckets * nodes.shape[0]
    cell = bucket * nodes.shape[0] + ncode
    n = np.bincount(cell, minlength=cells).astype(np.float64)
    features = np.full((cells, len(NodeWindows.FEATURES)), np.nan)
    seen = n > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        for j, values in enumerate((a.lateness_us, a.is_last, a.wait_us)):
            sums = np.bincount(cell, weights=values, minlength=cells)
            features[seen, j] = sums[seen] / n[seen]
    return NodeWindows(
        nodes=tuple(str(x) for x in nodes),
        window_start_us=start_us + np.arange(buckets, dtype=np.int64) * window_us,
        features=features.reshape(buckets, nodes.shape[0], len(NodeWindows.FEATURES)),
    )
