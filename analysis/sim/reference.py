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

from tracehound.tracing.summaries import (
    I64,
    P2P_MARK,
    RECV_OPS,
    SEND_OPS,
    CollectiveColumns,
    Disagreement,
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
    """Per-rank arrival statistics of a window (see tracing.summaries)."""
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
    """Per-link transfer statistics of a window (see tracing.summaries)."""
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
    with the reference of its sibling groups (see tracing.summaries)."""
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


def node_windows(
    cols: CollectiveColumns,
    node_of_rank: Mapping[int, str],
    start_us: int,
    end_us: int,
    window_us: int,
) -> NodeWindows:
    """Per-node features per window of `window_us` (see tracing.summaries). Raises
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
