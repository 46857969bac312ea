"""Recorder overhead: the same real DDP job with Tracehound's recorder on and off, side by side.

Runs the demo training script (2 nodes x 2 gloo ranks, no checkpoints) through `tracehound run`,
alternating recorder on / off (TRACEHOUND_DISABLE=1) so that machine noise hits both alike, and
reads each rank's steady-state step rate (it prints it, first step excluded). Prints the median
rate of each mode and the overhead = 1 - on/off.

    python bench/overhead.py [--pairs N] [--steps S] [--step-sleep-ms MS] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tracehound.controller.demo import training_script

RATE = re.compile(r"rank \d+/\d+: \d+ steps at ([0-9.]+) steps/s")


def one_run(recorder: bool, steps: int, sleep_ms: float, workdir: Path) -> float:
    env = dict(os.environ)
    if not recorder:
        env["TRACEHOUND_DISABLE"] = "1"
    job = "on" if recorder else "off"
    subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "--log-level", "WARNING", "run",
         "--nnodes", "2", "--nproc-per-node", "2", "--job-id", job,
         "--store", f"chdb://{workdir / 'store'}", "--workdir", str(workdir),
         training_script(), "--steps", str(steps), "--checkpoint-every", "0",
         "--print-every", "0", "--sync-loss-every", "0", "--step-sleep-ms", str(sleep_ms)],
        env=env, check=True, capture_output=True, timeout=900,
    )
    rates = []
    for log in sorted((workdir / job / "logs" / "attempt-0").glob("rank-*.log")):
        found = RATE.findall(log.read_text())
        if not found:
            raise RuntimeError(f"no step rate in {log}")
        rates.append(float(found[-1]))
    return statistics.mean(rates)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=5, help="on/off pairs (default 5)")
    parser.add_argument("--steps", type=int, default=400, help="steps per run (default 400)")
    parser.add_argument("--step-sleep-ms", type=float, default=0.0,
                        help="extra time per step, as a stand-in for a heavier model")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(args.pairs):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            with tempfile.TemporaryDirectory(prefix="tracehound-overhead-") as tmp:
                rate = one_run(mode == "on", args.steps, args.step_sleep_ms, Path(tmp))
            rates[mode].append(rate)
            print(f"pair {i + 1}/{args.pairs} recorder {mode}: {rate:.2f} steps/s",
                  file=sys.stderr, flush=True)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    result = {
        "steps_per_s_recorder_on": round(on, 2),
        "steps_per_s_recorder_off": round(off, 2),
        "overhead": round(1.0 - on / off, 4),
        "step_ms_on": round(1000 / on, 2),
        "step_ms_off": round(1000 / off, 2),
        "pairs": args.pairs,
        "runs_on": [round(r, 2) for r in rates["on"]],
        "runs_off": [round(r, 2) for r in rates["off"]],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
