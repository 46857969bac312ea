"""Stopped ranks in sharded jobs: how soon `tracehound run` names a rank stopped where plain
torch.distributed wrappers do not reach, and whether the job recovers.

Runs the sharded example (`tracehound.agent.examples.train_sharded`) under `tracehound run` on a
fresh embedded store, --runs times each:

- FSDP2, 2 nodes x 2 gloo ranks: rank 1 stops itself with SIGSTOP inside an all-gather (attempt
  0), inside clip_grad_norm_ before its functional all_reduce (1), in the optimizer step (2) and
  before an all_reduce made through a process group's own method (3);
- tensor parallel, 2 nodes x 1 rank, the Flight Recorder off: rank 1 stops before its forward
  (attempt 0) and before the untraced all_reduce (1), which only the job's standstill shows;
- the same tensor-parallel job with rank 1's recorder muted in attempt 1 (`--mute 1`): nothing
  of it reaches its node agent, which knows its pid only from the launcher's note.

For every stop it prints the time from the stop (the rank's own clock, written just before it
stops) to the incident, the verdict's kind, culprit and basis, and whether the next attempt
resumed from a checkpoint and the job finished; then per stop point the worst time and whether
every run named the stopped rank.

    python bench/sharded_stops.py [--runs N] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

JOBS = {
    "fsdp": (["--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "4",
              "--max-restarts", "4"],
             ["--layout", "fsdp", "--steps", "55", "--untraced-group", "--stop", "all_gather@0",
              "--stop", "clip@1", "--stop", "optim@2", "--stop", "untraced@3"], {}),
    "tp": (["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "2"],
           ["--layout", "tp", "--steps", "40", "--untraced-group", "--stop", "forward@0",
            "--stop", "untraced@1"], {"TORCH_FR_BUFFER_SIZE": "0"}),
    "tp-muted": (["--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "2"],
                 ["--layout", "tp", "--steps", "40", "--untraced-group", "--stop", "forward@0",
                  "--stop", "untraced@1", "--mute", "1"], {"TORCH_FR_BUFFER_SIZE": "0"}),
}


def script() -> str:
    spec = importlib.util.find_spec("tracehound.agent.examples.train_sharded")
    if spec is None or spec.origin is None:
        raise SystemExit("tracehound.agent.examples.train_sharded is not installed")
    return spec.origin


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 900) -> str:
    done = subprocess.run([sys.executable, "-m", "tracehound.controller.cli", *args],
                          capture_output=True, text=True, timeout=timeout, check=False,
                          env=env)
    if not done.stdout:
        raise RuntimeError(f"tracehound {args[0]} printed nothing: {done.stderr[-2000:]}")
    return done.stdout


def one(layout: str, run: int, base: Path) -> list[dict[str, Any]]:
    launch, script_args, extra_env = JOBS[layout]
    work = base / f"{layout}-{run}"
    store = f"chdb://{work / 'store'}"
    job = f"{layout}-stops-{run}"
    env = {**os.environ, **extra_env}
    outcome = json.loads(cli(
        "run", "--job-id", job, "--store", store, "--workdir", str(work / "work"),
        "--timeout", "600", "--json", *launch, script(), "--checkpoint-every", "10",
        *script_args, "--stop-rank", "1", "--stop-log", str(work / "stops"), env=env))
    incidents = json.loads(cli("incidents", "--job", job, "--store", store, "--json"))
    stopped = {int(p.stem.split("-")[1]): json.loads(p.read_text())
               for p in (work / "stops").glob("stop-*.json")}
    rows = []
    for attempt, stop in sorted(stopped.items()):
        found = [i for i in incidents if i["attempt"] == attempt and i["kind"] != "straggler"]
        first = found[0] if found else None
        rows.append({
            "layout": layout, "run": run, "attempt": attempt, "point": stop["point"],
            "kind": first["kind"] if first else None,
            "culprit_ranks": first["culprit_ranks"] if first else [],
            "basis": first["verdict"]["basis"] if first else None,
            "detect_s": round(first["detected_at"] - stop["time"], 2) if first else None,
            "named": bool(first) and first["kind"] == "hang" and first["culprit_ranks"] == [1],
            "job_completed": bool(outcome.get("completed")),
        })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each job (default 3)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="tracehound-sharded-"))
    rows: list[dict[str, Any]] = []
    for run in range(args.runs):
        for layout in JOBS:
            print(f"run {run + 1}/{args.runs}: {layout}", file=sys.stderr, flush=True)
            for row in one(layout, run, base):
                rows.append(row)
                print(f"  {row['point']:<10} attempt {row['attempt']}: {row['kind']} "
                      f"{row['culprit_ranks']} ({row['basis']}) {row['detect_s']} s after the "
                      f"stop; job completed {row['job_completed']}", file=sys.stderr, flush=True)
    points: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(f"{r['layout']}:{r['point']}" for r in rows):
        mine = [r for r in rows if f"{r['layout']}:{r['point']}" == key]
        times = [r["detect_s"] for r in mine if r["detect_s"] is not None]
        points[key] = {
            "stops": len(mine), "named": sum(r["named"] for r in mine),
            "detect_s_median": round(statistics.median(times), 2) if times else None,
            "detect_s_max": max(times) if times else None,
            "bases": sorted({r["basis"] for r in mine if r["basis"]}),
        }
    result = {
        "stops": len(rows), "named": sum(r["named"] for r in rows),
        "detect_s_max": max((r["detect_s"] for r in rows if r["detect_s"] is not None),
                            default=None),
        "jobs_completed": all(r["job_completed"] for r in rows),
        "points": points, "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for key, p in points.items():
            print(f"{key:<16} named {p['named']}/{p['stops']}  detect median "
                  f"{p['detect_s_median']} s, max {p['detect_s_max']} s  {', '.join(p['bases'])}")
        print(f"all: named {result['named']}/{result['stops']}, worst {result['detect_s_max']} s, "
              f"jobs completed: {result['jobs_completed']}")
    return 0 if result["named"] == result["stops"] and result["jobs_completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
