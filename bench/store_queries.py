"""How fast the trace store writes one 10k-rank detection window and computes its summaries.

Builds one window of collective rows that looks like a simulated data+tensor parallel job
(8 ranks per node, a tensor-parallel group per node, data-parallel groups across nodes, pipeline
send/recv pairs between neighbouring nodes, one slow rank, one dtype mismatch), writes it with
`insert_columns`, and times every summary query against the numpy reference in
`tracehound.analysis.sim.reference`, checking that both give the same numbers.

    .venv/bin/python bench/store_queries.py                       # chdb in a temp dir
    .venv/bin/python bench/store_queries.py --server clickhouse://default:@127.0.0.1:9000/bench
    .venv/bin/python bench/store_queries.py --json                # machine-readable figures

It prints figures and never fails on time (benchmarks do not gate anything). It does not use the
simulator (`tracehound.analysis.sim`): the window is generated here with numpy.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from tracehound.analysis.sim import reference as summaries
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.summaries import (
    ClockCorrection,
    CollectiveColumns,
    LinkStats,
    NodeWindows,
    RankStats,
)

T = TypeVar("T")

RANKS_PER_NODE = 8
T0_US = 1_700_000_000_000_000
STEP_US = 250_000
JOB = JobId("bench-job")


@dataclass(frozen=True, slots=True)
class Window:
    cols: CollectiveColumns
    node_of_rank: dict[int, str]
    start_us: int
    end_us: int


def make_window(ranks: int = 10_240, collectives: int = 40, seed: int = 0) -> Window:
    """One window of `collectives` collectives per rank (3 tensor-parallel all-reduces and one
    data-parallel all-reduce per step) plus pipeline send/recv pairs."""
    if ranks % RANKS_PER_NODE:
        raise ValueError(f"ranks must be a multiple of {RANKS_PER_NODE}")
    rng = np.random.default_rng(seed)
    nodes = ranks // RANKS_PER_NODE
    grid = np.arange(ranks, dtype=np.int64).reshape(nodes, RANKS_PER_NODE)
    slow_rank = int(rng.integers(ranks))
    parts: list[dict[str, np.ndarray[Any, Any]]] = []
    seq_of: dict[str, int] = {}
    steps = -(-collectives // 4)
    made = 0
    for step in range(steps):
        base = T0_US + step * STEP_US
        for k in range(4):
            if made == collectives:
                break
            made += 1
            tp = k < 3
            jitter = rng.exponential(300.0, size=ranks).astype(np.int64)
            enqueue = base + k * 20_000 + jitter
            enqueue[slow_rank] += 2_000
            # Tensor parallel: one group per node (rows of the grid); data parallel: one group
            # per local index (columns of the grid).
            by_group = enqueue.reshape(nodes, RANKS_PER_NODE)
            done = by_group.max(axis=1, keepdims=True) if tp else by_group.max(axis=0,
                                                                                keepdims=True)
            complete = (np.broadcast_to(done, by_group.shape) + 150).reshape(-1)
            names = (np.char.add("tp:", (grid // RANKS_PER_NODE).astype(np.str_)) if tp
                     else np.char.add("dp:", (grid % RANKS_PER_NODE).astype(np.str_)))
            key = "tp" if tp else "dp"
            seq_of[key] = seq_of.get(key, 0) + 1
            dtype = np.full(ranks, "float32" if not tp else "bfloat16")
            if step == steps // 2 and not tp:
                dtype[slow_rank] = "float16"  # one mismatching rank
            parts.append(dict(
                rank=grid.reshape(-1), group=names.reshape(-1),
                seq=np.full(ranks, seq_of[key], dtype=np.int64),
                op=np.full(ranks, "all_reduce"),
                nbytes=np.full(ranks, 4 << 20 if tp else 64 << 20, dtype=np.int64),
                dtype=dtype, peer=np.full(ranks, -1, dtype=np.int64),
                completed=np.ones(ranks, dtype=np.bool_), enqueue_us=enqueue,
                complete_us=complete.astype(np.int64),
            ))
        # Pipeline: local rank 0 of every even node sends an activation to the next node.
        src = grid[0:nodes - 1:2, 0]
        dst = src + RANKS_PER_NODE
        pairs = src.shape[0]
        group = np.char.add(np.char.add(np.char.add("0:p2p:", src.astype(np.str_)), "-"),
                            dst.astype(np.str_))
        send_at = base + 90_000 + np.asarray(rng.exponential(200.0, size=pairs)).astype(np.int64)
        recv_at = base + 90_000 + np.asarray(rng.exponential(200.0, size=pairs)).astype(np.int64)
        transfer = rng.integers(500, 900, size=pairs)
        finish = np.maximum(send_at, recv_at) + transfer
        parts.append(dict(
            rank=np.concatenate([src, dst]), group=np.concatenate([group, group]),
            seq=np.full(2 * pairs, step + 1, dtype=np.int64),
            op=np.concatenate([np.full(pairs, "send"), np.full(pairs, "recv")]),
            nbytes=np.full(2 * pairs, 1 << 20, dtype=np.int64),
            dtype=np.full(2 * pairs, "bfloat16"),
            peer=np.concatenate([dst, src]),
            completed=np.ones(2 * pairs, dtype=np.bool_),
            enqueue_us=np.concatenate([send_at, recv_at]),
            complete_us=np.concatenate([finish, finish]),
        ))
    columns = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
    cols = CollectiveColumns(**columns)
    node_of_rank = {r: f"node-{r // RANKS_PER_NODE:05d}" for r in range(ranks)}
    return Window(cols=cols, node_of_rank=node_of_rank, start_us=T0_US,
                  end_us=T0_US + steps * STEP_US)


def timed(run: Callable[[], T]) -> tuple[T, float]:
    began = time.perf_counter()
    out = run()
    return out, time.perf_counter() - began


def measure(store: TraceStore, window: Window, window_us: int) -> dict[str, float]:
    """Seconds per operation on `store`; checks every summary against the numpy reference."""
    w = window
    figures: dict[str, float] = {}
    _, figures["insert_columns"] = timed(lambda: store.insert_columns(
        JOB, 0, w.cols, w.node_of_rank, batch_id=f"bench-{uuid.uuid4().hex}"))
    ranks, figures["rank_stats"] = timed(lambda: store.rank_stats(JOB, 0, w.start_us, w.end_us))
    links, figures["link_stats"] = timed(lambda: store.link_stats(JOB, 0, w.start_us, w.end_us))
    bad, figures["disagreements"] = timed(
        lambda: store.disagreements(JOB, 0, w.start_us, w.end_us))
    nodes, figures["node_windows"] = timed(
        lambda: store.node_windows(JOB, 0, w.start_us, w.end_us, window_us))

    want_ranks = summaries.rank_stats(w.cols, w.start_us, w.end_us)
    want_links = summaries.link_stats(w.cols, w.start_us, w.end_us)
    want_nodes = summaries.node_windows(w.cols, w.node_of_rank, w.start_us, w.end_us, window_us)
    same = (
        equal(ranks, links, nodes, want_ranks, want_links, want_nodes)
        and tuple(bad) == summaries.disagreements(w.cols, w.start_us, w.end_us)
    )
    if not same:
        raise SystemExit("the store's summaries differ from the numpy reference")

    # the same summaries on node clocks corrected as the analysis does (offsets of tens of ms
    # and drift, one per node): the SQL then aligns every time it compares
    clock = bench_clock(w)
    ranks, figures["rank_stats_clocked"] = timed(
        lambda: store.rank_stats(JOB, 0, w.start_us, w.end_us, clock=clock))
    links, figures["link_stats_clocked"] = timed(
        lambda: store.link_stats(JOB, 0, w.start_us, w.end_us, clock=clock))
    nodes, figures["node_windows_clocked"] = timed(
        lambda: store.node_windows(JOB, 0, w.start_us, w.end_us, window_us, clock=clock))
    want_ranks = summaries.rank_stats(w.cols, w.start_us, w.end_us, clock=clock,
                                      node_of_rank=w.node_of_rank)
    want_links = summaries.link_stats(w.cols, w.start_us, w.end_us, clock=clock,
                                      node_of_rank=w.node_of_rank)
    want_nodes = summaries.node_windows(w.cols, w.node_of_rank, w.start_us, w.end_us, window_us,
                                        clock=clock)
    if not equal(ranks, links, nodes, want_ranks, want_links, want_nodes):
        raise SystemExit("the store's clock-corrected summaries differ from the numpy reference")
    return figures


def equal(ranks: RankStats, links: LinkStats, nodes: NodeWindows, want_ranks: RankStats,
          want_links: LinkStats, want_nodes: NodeWindows) -> bool:
    """Whether the store's rank, link and node summaries are the numpy reference's."""
    return (
        np.array_equal(ranks.rank, want_ranks.rank)
        and np.array_equal(ranks.last_count, want_ranks.last_count)
        and np.allclose(ranks.lateness_mean_us, want_ranks.lateness_mean_us)
        and np.array_equal(links.src, want_links.src)
        and np.allclose(links.transfer_mean_us, want_links.transfer_mean_us)
        and nodes.nodes == want_nodes.nodes
        and np.allclose(nodes.features, want_nodes.features, equal_nan=True)
    )


def bench_clock(w: Window) -> ClockCorrection:
    """Offsets N(0, 20 ms) and drifts N(0, 3 ppm), one per node of the window."""
    nodes = tuple(sorted(set(w.node_of_rank.values())))
    rng = np.random.default_rng(5)
    return ClockCorrection(
        ref_us=w.start_us, nodes=nodes,
        offset_us=tuple(float(x) for x in rng.normal(0.0, 20_000.0, len(nodes))),
        drift=tuple(float(x) for x in rng.normal(0.0, 3e-6, len(nodes))),
    )


def measure_numpy(window: Window, window_us: int) -> dict[str, float]:
    w = window
    return {
        "rank_stats": timed(lambda: summaries.rank_stats(w.cols, w.start_us, w.end_us))[1],
        "link_stats": timed(lambda: summaries.link_stats(w.cols, w.start_us, w.end_us))[1],
        "disagreements": timed(lambda: summaries.disagreements(w.cols, w.start_us, w.end_us))[1],
        "node_windows": timed(lambda: summaries.node_windows(
            w.cols, w.node_of_rank, w.start_us, w.end_us, window_us))[1],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--ranks", type=int, default=10_240)
    parser.add_argument("--collectives", type=int, default=40, help="per rank")
    parser.add_argument("--window-us", type=int, default=1_000_000,
                        help="node_windows bucket width")
    parser.add_argument("--server", metavar="URL",
                        help="also measure a ClickHouse server (clickhouse://...; the database "
                             "in the URL is created and dropped)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)

    window, built = timed(lambda: make_window(args.ranks, args.collectives))
    results: dict[str, Any] = {
        "ranks": args.ranks, "rows": len(window.cols), "build_s": built,
        "numpy": measure_numpy(window, args.window_us),
    }
    with tempfile.TemporaryDirectory(prefix="tracehound-bench-") as tmp:
        chdb_store = open_store(f"chdb://{tmp}/chdb")
        try:
            results["chdb"] = measure(chdb_store, window, args.window_us)
        finally:
            chdb_store.close()
    if args.server:
        from tracehound.tracing.store.server import ClickHouseServerStore

        server = ClickHouseServerStore(args.server, send_receive_timeout=120.0)
        try:
            server.ensure_schema()
            results["server"] = measure(server, window, args.window_us)
        finally:
            server.drop_database()
            server.close()

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"{results['rows']:,} collective rows of {args.ranks:,} ranks "
          f"(built in {built:.2f} s); summaries equal the numpy reference (\"clocked\": on "
          "node clocks corrected per node, as the analysis asks)")
    names = ["insert_columns", "rank_stats", "link_stats", "disagreements", "node_windows",
             "rank_stats_clocked", "link_stats_clocked", "node_windows_clocked"]
    where = [k for k in ("numpy", "chdb", "server") if k in results]
    print(f"{'seconds':<22}" + "".join(f"{k:>10}" for k in where))
    for name in names:
        cells = "".join(
            f"{results[k][name]:>10.3f}" if name in results[k] else f"{'-':>10}" for k in where
        )
        print(f"{name:<22}{cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
