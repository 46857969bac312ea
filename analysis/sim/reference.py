"""The numpy reference of the window summaries: the same numbers the store computes in SQL.

The summaries (RankStats, LinkStats, Disagreement, NodeWindows) and their definitions live in
`tracehound.tracing.summaries`; the functions here compute them from `CollectiveColumns` with
numpy, row for row as defined there. The simulator summarizes its jobs with them without a
store, and the store's SQL is tested against them. Pure numpy; no store, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tracehound.tracing.shapes import ROOT_SIDE, comparable
from tracehound.tracing.summaries import (
    COUNTED_SUFFIX,
    F64,
    I64,
    P2P_MARK,
    RECV_OPS,
    SEND_OPS,
    SYMMETRIC_OPS,
    ClockCorrection,
    ClockSamples,
    CollectiveColumns,
    Disagreement,
    Disagreements,
    LinkStats,
    NodeWindows,
    RankStats,
    bucket_count,
    factorize,
)


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


def _row_nodes(rank: I64,
               node_of_rank: Mapping[int, str]) -> tuple[npt.NDArray[np.str_], I64]:
    """(sorted distinct nodes, the node code of every row) for rows of ranks `rank`. Raises
    ValueError for a rank without a node in `node_of_rank`."""
    ranks, rcode = np.unique(rank, return_inverse=True)
    missing = [int(r) for r in ranks if int(r) not in node_of_rank]
    if missing:
        raise ValueError(f"node_of_rank has no node for ranks {missing[:10]}")
    nodes, ncode = np.unique(
        np.array([node_of_rank[int(r)] for r in ranks], dtype=np.str_), return_inverse=True
    )
    return nodes, ncode.reshape(-1)[rcode.reshape(-1)].astype(np.int64)


def _times(cols: CollectiveColumns, clock: ClockCorrection | None,
           node_of_rank: Mapping[int, str] | None) -> tuple[I64, I64]:
    """Every row's enqueue and completion time, on the common clock when `clock` is given
    (then `node_of_rank` must name every rank's node)."""
    if clock is None or not clock.nodes:
        return cols.enqueue_us, cols.complete_us
    if node_of_rank is None:
        raise ValueError("a clock correction needs node_of_rank")
    nodes, code = _row_nodes(cols.rank, node_of_rank)
    return (clock.align(cols.enqueue_us, code, nodes),
            clock.align(cols.complete_us, code, nodes))


@dataclass(frozen=True, slots=True, eq=False)
class _Arrivals:
    """The collective rows RankStats and NodeWindows count, with their per-row measures."""

    rank: I64
    enqueue_us: I64
    lateness_us: I64
    is_last: npt.NDArray[np.bool_]
    blame_us: I64
    wait_us: I64


def _arrivals(cols: CollectiveColumns, start_us: int, end_us: int, *,
              clock: ClockCorrection | None = None,
              node_of_rank: Mapping[int, str] | None = None) -> _Arrivals:
    all_enqueue, all_complete = _times(cols, clock, node_of_rank)
    window = np.flatnonzero(_in_window(cols, start_us, end_us) & cols.completed)
    groups, gcode = factorize(cols.group[window])
    keep = ~_p2p_rows(gcode, groups)
    rows, gcode = window[keep], gcode[keep]
    seq = cols.seq[rows]
    enqueue = all_enqueue[rows]
    order = np.lexsort((enqueue, seq, gcode))
    rows, gcode, seq, enqueue = rows[order], gcode[order], seq[order], enqueue[order]
    starts, seg = _segments(gcode, seq)
    members = np.diff(np.append(starts, rows.shape[0]))
    if rows.shape[0]:
        first = enqueue[starts]
        ends = np.append(starts, rows.shape[0])[1:]
        last = enqueue[ends - 1]
        second = enqueue[np.maximum(ends - 2, starts)]
    else:
        first = last = second = np.zeros(0, np.int64)
    counted = members[seg] >= 2
    rows, seg, enqueue = rows[counted], seg[counted], enqueue[counted]
    is_last = enqueue == last[seg]
    unique_last = is_last & (second[seg] < last[seg])
    return _Arrivals(
        rank=cols.rank[rows],
        enqueue_us=enqueue,
        lateness_us=enqueue - first[seg],
        is_last=is_last,
        blame_us=np.where(unique_last, enqueue - second[seg], 0),
        wait_us=all_complete[rows] - enqueue,
    )


def _own_time(cols: CollectiveColumns, start_us: int, end_us: int,
              ranks: I64) -> tuple[F64, F64, F64]:
    """busy_us, busy_max_us and active_us of each of `ranks` (see tracing.summaries), from
    all its completed rows in the window."""
    rows = np.flatnonzero(_in_window(cols, start_us, end_us) & cols.completed)
    rank, enq, comp = cols.rank[rows], cols.enqueue_us[rows], cols.complete_us[rows]
    order = np.lexsort((comp, enq, rank))
    rank, enq, comp = rank[order], enq[order], comp[order]
    busy = np.zeros(ranks.shape[0])
    most = np.zeros(ranks.shape[0])
    active = np.zeros(ranks.shape[0])
    if rank.shape[0] == 0:
        return busy, most, active
    same = rank[1:] == rank[:-1]
    gaps = np.where(same, np.maximum(enq[1:] - comp[:-1], 0), 0).astype(np.float64)
    owners = rank[1:]
    starts, _ = _segments(rank)
    who = rank[starts]
    first_enq = np.minimum.reduceat(enq, starts)
    last_comp = np.maximum.reduceat(comp, starts)
    pos = np.searchsorted(who, ranks)
    found = (pos < who.shape[0]) & (who[np.minimum(pos, who.shape[0] - 1)] == ranks)
    place = {int(r): i for i, r in enumerate(ranks)}
    idx = np.array([place.get(int(r), -1) for r in owners], dtype=np.int64)
    ok = idx >= 0
    np.add.at(busy, idx[ok], gaps[ok])
    np.maximum.at(most, idx[ok], gaps[ok])
    active[found] = (last_comp[pos[found]] - first_enq[pos[found]]).astype(np.float64)
    return busy, most, active


def rank_stats(cols: CollectiveColumns, start_us: int, end_us: int, *,
               clock: ClockCorrection | None = None,
               node_of_rank: Mapping[int, str] | None = None) -> RankStats:
    """Per-rank arrival statistics of a window (see tracing.summaries); `clock` corrects the
    nodes' clocks (`node_of_rank` then names every rank's node)."""
    a = _arrivals(cols, start_us, end_us, clock=clock, node_of_rank=node_of_rank)
    ranks, code = np.unique(a.rank, return_inverse=True)
    code = code.reshape(-1)
    n = np.bincount(code, minlength=ranks.shape[0]).astype(np.int64)
    busy, busy_max, active = _own_time(cols, start_us, end_us, ranks.astype(np.int64))
    return RankStats(
        rank=ranks.astype(np.int64),
        n=n,
        lateness_mean_us=np.bincount(code, weights=a.lateness_us, minlength=ranks.shape[0]) / n,
        last_count=np.bincount(code, weights=a.is_last, minlength=ranks.shape[0]).astype(
            np.int64
        ),
        wait_mean_us=np.bincount(code, weights=a.wait_us, minlength=ranks.shape[0]) / n,
        span_us=_span(code, a.enqueue_us, ranks.shape[0]),
        blame_us=np.bincount(code, weights=a.blame_us, minlength=ranks.shape[0]).astype(
            np.float64),
        busy_us=busy,
        busy_max_us=busy_max,
        active_us=active,
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


def link_stats(cols: CollectiveColumns, start_us: int, end_us: int, *,
               clock: ClockCorrection | None = None,
               node_of_rank: Mapping[int, str] | None = None) -> LinkStats:
    """Per-link transfer statistics of a window (see tracing.summaries); `clock` as for
    `rank_stats`."""
    all_enqueue, all_complete = _times(cols, clock, node_of_rank)
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
    transfer = np.maximum(
        np.minimum.reduceat(all_complete[rows], starts)
        - np.maximum.reduceat(all_enqueue[rows], starts), 0,
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
    cols: CollectiveColumns, start_us: int, end_us: int, limit: int = 100, *,
    uneven_ops: tuple[str, ...] = (),
) -> Disagreements:
    """The first `limit` collectives of a window whose ranks disagree (ops of `uneven_ops` may
    differ in size), in group order, then by seq, each with the reference of its sibling groups,
    and how many more the limit dropped (see tracing.summaries). ValueError for a limit below 1."""
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    window = np.flatnonzero(_in_window(cols, start_us, end_us))
    groups, gcode = factorize(cols.group[window])
    counted = np.char.endswith(groups, COUNTED_SUFFIX)[gcode]
    keep = ~_p2p_rows(gcode, groups) & ~counted
    rows, gcode = window[keep], gcode[keep]
    # Group order: (length, code point); `groups` is sorted by code point already.
    by_length = np.lexsort((np.arange(groups.shape[0]), np.char.str_len(groups)))
    position = np.empty_like(by_length)
    position[by_length] = np.arange(by_length.shape[0])
    groups, gcode = groups[by_length], position[gcode]
    seq, rank = cols.seq[rows], cols.rank[rows]
    order = np.lexsort((rank, seq, gcode))
    rows, gcode, seq = rows[order], gcode[order], seq[order]
    if rows.shape[0] == 0:
        return Disagreements()
    ops, opcode = factorize(cols.op[rows])
    dtypes, dtcode = factorize(cols.dtype[rows])
    nbytes = cols.nbytes[rows]
    starts, seg = _segments(gcode, seq)
    head = starts[seg]
    kind_split = np.logical_or.reduceat(
        (opcode != opcode[head]) | (dtcode != dtcode[head]), starts)
    size_split = np.logical_or.reduceat(nbytes != nbytes[head], starts)
    uneven = np.isin(ops, np.asarray(uneven_ops, dtype=np.str_))[opcode[starts]]
    split = kind_split | size_split
    shape_split = np.zeros_like(split)
    if cols.shape is not None:
        # compared where every row of the (group, seq) has one, as `shapes.comparable` says
        shape = cols.shape[rows]
        _, rawcode = factorize(shape)
        split |= np.logical_or.reduceat(rawcode != rawcode[head], starts)
        compared = shape.copy()
        row_ops = cols.op[rows]
        special = np.isin(row_ops, np.asarray([*uneven_ops, *ROOT_SIDE], np.str_))
        for i in np.flatnonzero(special):
            compared[i] = comparable(str(shape[i]), str(row_ops[i]), uneven_ops)
        _, code = factorize(compared)
        known = np.logical_and.reduceat(np.char.str_len(shape) > 0, starts)
        shape_split = np.logical_or.reduceat(code != code[head], starts) & known
    disagreeing = np.flatnonzero(kind_split | (size_split & ~uneven) | shape_split)
    bad = disagreeing[:limit]
    if bad.shape[0] == 0:
        return Disagreements()
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
            shapes=tuple(str(t) for t in cols.shapes()[part]),
            peer_op=str(ops[peer[0]]) if peer else "",
            peer_nbytes=peer[1] if peer else 0,
            peer_dtype=str(dtypes[peer[2]]) if peer else "",
            peer_groups=peer[3] if peer else 0,
        ))
    return Disagreements(out, dropped=int(disagreeing.shape[0] - bad.shape[0]))


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


def node_windows(
    cols: CollectiveColumns,
    node_of_rank: Mapping[int, str],
    start_us: int,
    end_us: int,
    window_us: int,
    *,
    clock: ClockCorrection | None = None,
) -> NodeWindows:
    """Per-node features per window of `window_us` (see tracing.summaries), on clocks
    corrected by `clock` when given. Raises ValueError for a counted row whose rank has no
    node in `node_of_rank`."""
    buckets = bucket_count(start_us, end_us, window_us)
    a = _arrivals(cols, start_us, end_us, clock=clock, node_of_rank=node_of_rank)
    nodes, ncode = _row_nodes(a.rank, node_of_rank)
    bucket = np.clip((a.enqueue_us - start_us) // window_us, 0, max(buckets - 1, 0))
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


def clock_samples(cols: CollectiveColumns, node_of_rank: Mapping[int, str], start_us: int,
                  end_us: int, width_us: int) -> ClockSamples:
    """Per (group, node, bucket) the upper median distance of the node's completions from its
    collectives' centers (see tracing.summaries ClockSamples)."""
    bucket_count(start_us, end_us, width_us)
    window = np.flatnonzero(_in_window(cols, start_us, end_us) & cols.completed)
    groups, gcode = factorize(cols.group[window])
    ops, opcode = factorize(cols.op[window])
    p2p = _p2p_rows(gcode, groups)
    symmetric = np.isin(ops, SYMMETRIC_OPS)[opcode]
    pair = np.isin(ops, SEND_OPS + RECV_OPS)[opcode]
    keep = np.where(p2p, pair, symmetric)
    rows, gcode = window[keep], gcode[keep]
    empty = ClockSamples(group=np.zeros(0, np.str_), node=np.zeros(0, np.str_),
                         bucket=np.zeros(0, np.int64), offset_us=np.zeros(0, np.float64),
                         n=np.zeros(0, np.int64), start_us=start_us, width_us=width_us)
    if rows.shape[0] == 0:
        return empty
    sub = CollectiveColumns(
        rank=cols.rank[rows], group=cols.group[rows], seq=cols.seq[rows], op=cols.op[rows],
        nbytes=cols.nbytes[rows], dtype=cols.dtype[rows], peer=cols.peer[rows],
        completed=cols.completed[rows], enqueue_us=cols.enqueue_us[rows],
        complete_us=cols.complete_us[rows])
    nodes, ncode = _row_nodes(sub.rank, node_of_rank)
    seq, comp = sub.seq, sub.complete_us
    order = np.lexsort((comp, seq, gcode))
    gcode, seq, comp, ncode = gcode[order], seq[order], comp[order], ncode[order]
    starts, seg = _segments(gcode, seq)
    ends = np.append(starts, gcode.shape[0])
    size = np.diff(ends)
    center = comp[starts + size // 2]
    distinct = np.zeros(starts.shape[0], np.int64)
    node_sorted = np.lexsort((ncode, seg))
    firsts, _ = _segments(seg[node_sorted], ncode[node_sorted])
    np.add.at(distinct, seg[node_sorted][firsts], 1)
    ok = (distinct[seg] >= 2) & (center[seg] >= start_us) & (center[seg] < end_us)
    diff = (comp - center[seg])[ok]
    bucket = ((center[seg] - start_us) // width_us)[ok]
    g, nd = gcode[ok], ncode[ok]
    if diff.shape[0] == 0:
        return empty
    # per (group, node, bucket): the upper median of diff; groups and nodes sort by name
    order = np.lexsort((diff, bucket, nd, g))
    g, nd, bucket, diff = g[order], nd[order], bucket[order], diff[order]
    cell_starts, _ = _segments(g, nd, bucket)
    counts = np.diff(np.append(cell_starts, g.shape[0]))
    return ClockSamples(
        group=groups[g[cell_starts]].astype(np.str_), node=nodes[nd[cell_starts]].astype(np.str_),
        bucket=bucket[cell_starts].astype(np.int64),
        offset_us=diff[cell_starts + counts // 2].astype(np.float64),
        n=counts.astype(np.int64), start_us=start_us, width_us=width_us,
    )
