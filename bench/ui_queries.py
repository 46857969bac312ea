"""How fast the trace store answers the dashboard's views of a 10k-rank job.

Builds one attempt of a 10,240-rank job (8 ranks per node): the tensor-parallel, data-parallel
and pipeline rows of `store_queries.make_window` (1,280 tensor-parallel groups), plus a world
group "0" of every rank with `--seqs` all-reduces in which one rank arrives late and, at the
last seq, the upper half of the ranks hangs (their rows are missing: rows are stored when an op
ends), and heartbeats for every rank reporting its progress in all three of its groups. Then it
times `progress_grid` (the world group, last 64 seqs, 256 rank buckets) and `lateness_series`
(the whole window, 250 ms buckets, top 8) several times each and prints the median and max.

    .venv/bin/python bench/ui_queries.py                       # chdb in a temp dir
    .venv/bin/python bench/ui_queries.py --server clickhouse://default:@127.0.0.1:9000/bench
    .venv/bin/python bench/ui_queries.py --json                # machine-readable figures

The target: a progress view in at most 1 s (it is redrawn while someone watches a hang). The
benchmark prints figures and never fails on time; it exits non-zero only when a view's content
is wrong (the slow rank not first, the hang not in the buckets).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from store_queries import JOB, RANKS_PER_NODE, STEP_US, T0_US, Window, make_window

from tracehound.tracing.events import Batch, GroupProgress, Heartbeat
from tracehound.tracing.ids import GroupId, NodeId, Rank
from tracehound.tracing.store import TraceStore, bulk, open_store
from tracehound.tracing.summaries import CollectiveColumns

WORLD = "0"
TARGET_S = 1.0
HEARTBEATS_PER_RANK = 3


def slow_rank(ranks: int) -> int:
    """The rank that arrives late in the world group (4,320 of 10,240)."""
    return ranks * 27 // 64


def world_columns(ranks: int, seqs: int, span_us: int, seed: int = 1) -> CollectiveColumns:
    """`seqs` all-reduces of every rank in the world group spread over `span_us`; `slow_rank`
    arrives 3 ms late, and the last seq was completed by the lower half of the ranks only."""
    rng = np.random.default_rng(seed)
    gap = span_us // seqs
    seq = np.repeat(np.arange(1, seqs + 1, dtype=np.int64), ranks)
    rank = np.tile(np.arange(ranks, dtype=np.int64), seqs)
    enqueue = T0_US + (seq - 1) * gap + rng.exponential(200.0, size=seq.shape).astype(np.int64)
    enqueue[rank == slow_rank(ranks)] += 3_000
    keep = (seq < seqs) | (rank < ranks // 2)
    seq, rank, enqueue = seq[keep], rank[keep], enqueue[keep]
    n = seq.shape[0]
    return CollectiveColumns(
        rank=rank, group=np.full(n, WORLD), seq=seq, op=np.full(n, "all_reduce"),
        nbytes=np.full(n, 1 << 20, dtype=np.int64), dtype=np.full(n, "bfloat16"),
        peer=np.full(n, -1, dtype=np.int64), completed=np.ones(n, dtype=np.bool_),
        enqueue_us=enqueue, complete_us=enqueue + 5_000,
    )


def heartbeats(window: Window, ranks: int, seqs: int) -> list[Heartbeat]:
    """HEARTBEATS_PER_RANK heartbeats per rank, 1 s apart, the last at the window's end: each
    reports the world group (the upper half of the ranks waiting in the last seq) and the
    rank's tensor- and data-parallel groups, idle at their last seq."""
    cols = window.cols
    last: dict[str, int] = {}
    for group in np.unique(cols.group):
        if ":p2p:" not in str(group):
            last[str(group)] = int(cols.seq[cols.group == group].max())
    beats = []
    for rank in range(ranks):
        tp = f"tp:{rank // RANKS_PER_NODE}"
        dp = f"dp:{rank % RANKS_PER_NODE}"
        for k in range(HEARTBEATS_PER_RANK):
            time_us = window.end_us - (HEARTBEATS_PER_RANK - 1 - k) * 1_000_000
            done = seqs - 1 if rank >= ranks // 2 else seqs
            groups = (
                GroupProgress(group=GroupId(WORLD), last_enqueued=seqs, last_completed=done,
                              pending_op="all_reduce" if done < seqs else "",
                              last_enqueue_us=time_us, last_complete_us=time_us),
                *(GroupProgress(group=GroupId(g), last_enqueued=last[g], last_completed=last[g],
                                pending_op="", last_enqueue_us=time_us,
                                last_complete_us=time_us) for g in (tp, dp)),
            )
            beats.append(Heartbeat(
                job=JOB, attempt=0, node=NodeId(window.node_of_rank[rank]), rank=Rank(rank),
                time_us=time_us, pid=1000 + rank % RANKS_PER_NODE, step=10 + k, step_us=time_us,
                start_step=0, first_step_us=T0_US, dropped=0, groups=groups))
    return beats


def fill(store: TraceStore, window: Window, world: CollectiveColumns,
         beats: list[Heartbeat]) -> dict[str, float]:
    began = time.perf_counter()
    writer = bulk(store)
    for cols in (window.cols, world):
        writer.insert_columns(JOB, 0, cols, window.node_of_rank,
                              batch_id=f"bench-{uuid.uuid4().hex}")
    collectives_s = time.perf_counter() - began
    began = time.perf_counter()
    store.insert(Batch(batch_id=f"bench-{uuid.uuid4().hex}", records=tuple(beats)))
    return {"insert_collectives_s": collectives_s,
            "insert_heartbeats_s": time.perf_counter() - began}


def repeat(run: Callable[[], Any], times: int) -> tuple[Any, list[float]]:
    seconds = []
    out = None
    for _ in range(times):
        began = time.perf_counter()
        out = run()
        seconds.append(time.perf_counter() - began)
    return out, seconds


def measure(store: TraceStore, window: Window, world: CollectiveColumns,
            beats: list[Heartbeat], *, ranks: int, seqs: int, times: int,
            width_us: int) -> dict[str, Any]:
    figures: dict[str, Any] = fill(store, window, world, beats)
    grid, grid_s = repeat(lambda: store.progress_grid(JOB, 0, WORLD, last_seqs=64,
                                                      rank_buckets=256), times)
    late, late_s = repeat(lambda: store.lateness_series(
        JOB, 0, window.start_us, window.end_us, width_us, top=8), times)
    # the views must say what the job did, or the figures mean nothing
    pending = sum(b.pending for b in grid.buckets)
    problems = []
    if (grid.seq_lo, grid.seq_hi, grid.width) != (max(seqs - 63, 1), seqs, -(-ranks // 256)):
        problems.append(f"grid window {grid.seq_lo}..{grid.seq_hi} width {grid.width}")
    if pending != ranks - ranks // 2:
        problems.append(f"{pending} ranks pending in the world group, not {ranks - ranks // 2}")
    if not late.top_rank.size or int(late.top_rank[0]) != slow_rank(ranks):
        problems.append(f"top late ranks {late.top_rank.tolist()}, expected "
                        f"{slow_rank(ranks)} first")
    if problems:
        raise SystemExit("wrong view content: " + "; ".join(problems))
    figures.update(
        progress_grid_median_s=statistics.median(grid_s), progress_grid_max_s=max(grid_s),
        lateness_series_median_s=statistics.median(late_s), lateness_series_max_s=max(late_s),
        grid_cells=len(grid.cells), grid_buckets=len(grid.buckets),
        lateness_points=int(late.bucket_us.size),
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=10_240)
    parser.add_argument("--seqs", type=int, default=80, help="world-group all-reduces")
    parser.add_argument("--times", type=int, default=7, help="repetitions of each view")
    parser.add_argument("--width-us", type=int, default=STEP_US,
                        help="lateness_series bucket width")
    parser.add_argument("--server", metavar="URL",
                        help="also measure a ClickHouse server (clickhouse://...; the database "
                             "in the URL is created and dropped)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    began = time.perf_counter()
    window = make_window(args.ranks)
    world = world_columns(args.ranks, args.seqs, window.end_us - window.start_us)
    beats = heartbeats(window, args.ranks, args.seqs)
    results: dict[str, Any] = {
        "ranks": args.ranks, "collective_rows": len(window.cols) + len(world),
        "world_rows": len(world), "heartbeats": len(beats), "seqs": args.seqs,
        "times": args.times, "target_progress_s": TARGET_S,
        "build_s": time.perf_counter() - began,
    }
    options = dict(ranks=args.ranks, seqs=args.seqs, times=args.times, width_us=args.width_us)
    with tempfile.TemporaryDirectory(prefix="tracehound-bench-") as tmp:
        chdb_store = open_store(f"chdb://{tmp}/chdb")
        try:
            results["chdb"] = measure(chdb_store, window, world, beats, **options)
        finally:
            chdb_store.close()
    if args.server:
        from tracehound.tracing.store.server import ClickHouseServerStore

        server = ClickHouseServerStore(args.server, send_receive_timeout=120.0)
        try:
            server.ensure_schema()
            results["server"] = measure(server, window, world, beats, **options)
        finally:
            server.drop_database()
            server.close()

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{args.ranks:,} ranks: {results['collective_rows']:,} collective rows "
          f"({results['world_rows']:,} in the world group, {args.seqs} seqs), "
          f"{results['heartbeats']:,} heartbeats; each view run {args.times} times")
    where = [k for k in ("chdb", "server") if k in results]
    print(f"{'seconds':<32}" + "".join(f"{k:>10}" for k in where))
    rows = [("insert collectives", "insert_collectives_s"),
            ("insert heartbeats", "insert_heartbeats_s"),
            ("progress_grid median", "progress_grid_median_s"),
            ("progress_grid max", "progress_grid_max_s"),
            ("lateness_series median", "lateness_series_median_s"),
            ("lateness_series max", "lateness_series_max_s")]
    for label, key in rows:
        print(f"{label:<32}" + "".join(f"{results[k][key]:>10.3f}" for k in where))
    for k in where:
        verdict = "within" if results[k]["progress_grid_max_s"] <= TARGET_S else "OVER"
        print(f"{k}: progress view {verdict} the {TARGET_S:.0f} s target "
              f"({results[k]['grid_cells']:,} cells, {results[k]['grid_buckets']} buckets; "
              f"lateness {results[k]['lateness_points']} points)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
