"""What reading an embedded store through the process that holds it costs, against reading it
directly (`tracing.store.sharing`, `tracing.store.client`).

Fills a chdb store with a simulated job (a hang at `--ranks` ranks, its collectives, heartbeats,
stacks and health samples) and one diagnosed incident, then times the dashboard's and the
diagnosis' reads, and a write, several times each: first with this process holding the directory
itself, then with a child process holding and sharing it and this process a client. Prints the
fastest and the median time of each (on a shared machine the fastest is the steadier figure),
what the endpoint added to the fastest, and the size of the answer on the wire.

    .venv/bin/python bench/shared_store.py                  # 1,024 ranks
    .venv/bin/python bench/shared_store.py --ranks 4096 --repeat 20 --json

It prints figures and never fails on time; it exits non-zero only when the client's answer
differs from the direct one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tracehound.tracing.events import Batch, Heartbeat
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.store import calls as wire

JOB = JobId("bench-shared")


def fill(url: str, ranks: int) -> None:
    from tracehound.analysis.sim import simulate, write_to_store

    store = open_store(url)
    try:
        write_to_store(simulate(ranks=ranks, fault="hang", seed=3, job=JOB), store)
    finally:
        store.close()


def reads(store: TraceStore) -> dict[str, Callable[[], Any]]:
    """The calls timed, by name: what a dashboard view, `diagnose` and a watcher ask."""
    beats = store.latest_heartbeats(JOB, 0)
    end = max(h.time_us for h in beats) + 1
    start = end - 30_000_000
    batch = Batch(batch_id="bench-write", records=tuple(
        Heartbeat(job=JOB, attempt=1, node=h.node, rank=h.rank, time_us=h.time_us, pid=h.pid,
                  step=h.step, step_us=h.step_us, start_step=h.start_step,
                  first_step_us=h.first_step_us, dropped=0) for h in beats[:1000]))
    return {
        "jobs": store.jobs,
        "job_states": lambda: store.job_states(JOB),
        "latest_heartbeats": lambda: store.latest_heartbeats(JOB, 0),
        "progress_grid": lambda: store.progress_grid(JOB, 0, "0", last_seqs=64,
                                                     rank_buckets=128),
        "lateness_series": lambda: store.lateness_series(JOB, 0, start, end, 500_000),
        "rank_stats": lambda: store.rank_stats(JOB, 0, start, end),
        "insert 1k heartbeats (retry check)": lambda: store.insert(batch, maybe_duplicate=True),
    }


def timed(calls: dict[str, Callable[[], Any]], repeat: int
          ) -> dict[str, tuple[float, float, Any]]:
    """Per call: the fastest and the median of `repeat` timings, and the answer."""
    out = {}
    for name, call in calls.items():
        answer = call()  # warm
        took = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            answer = call()
            took.append(time.perf_counter() - t0)
        out[name] = (min(took), statistics.median(took), answer)
    return out


def same(a: Any, b: Any) -> bool:
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and all(
            same(getattr(a, f), getattr(b, f)) for f in a.__dataclass_fields__)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    return bool(a == b)


HOLD = """
import sys
from tracehound.tracing.store import open_store
from tracehound.tracing.store.sharing import Sharing
store = open_store(sys.argv[1])
sharing = Sharing(store)
sharing.start()
print("shared", flush=True)
sys.stdin.read()
sharing.stop()
store.close()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-shared-") as tmp:
        url = f"chdb://{Path(tmp) / 'store'}"
        fill(url, args.ranks)
        store = open_store(url)
        try:
            direct = timed(reads(store), args.repeat)
        finally:
            store.close()
        holder = subprocess.Popen([sys.executable, "-c", HOLD, url], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "shared"
            client = open_store(url)
            try:
                shared = timed(reads(client), args.repeat)
            finally:
                client.close()
        finally:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait()
    rows = []
    wrong = []
    for name, (direct_min, direct_median, answer) in direct.items():
        shared_min, shared_median, through = shared[name]
        if not name.startswith("insert") and not same(answer, through):
            wrong.append(name)
        rows.append({"call": name,
                     "direct_ms": [round(direct_min * 1e3, 2), round(direct_median * 1e3, 2)],
                     "shared_ms": [round(shared_min * 1e3, 2), round(shared_median * 1e3, 2)],
                     "added_ms": round((shared_min - direct_min) * 1e3, 2),
                     "answer_bytes": len(wire.encode(answer))})
    if args.json:
        print(json.dumps({"ranks": args.ranks, "repeat": args.repeat, "calls": rows,
                          "wrong": wrong}))
    else:
        print(f"{args.ranks} ranks, {args.repeat} timings each: fastest / median, in ms")
        print(f"{'call':<36}{'direct':>16}{'shared':>16}{'added':>8}{'answer B':>10}")
        for row in rows:
            direct_text = "{} / {}".format(*row["direct_ms"])
            shared_text = "{} / {}".format(*row["shared_ms"])
            print(f"{row['call']:<36}{direct_text:>16}{shared_text:>16}{row['added_ms']:>8}"
                  f"{row['answer_bytes']:>10}")
        if wrong:
            print(f"DIFFERENT through the endpoint: {', '.join(wrong)}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
