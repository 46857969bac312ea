"""Detection benchmark: how fast Tracehound names a hung or crashed rank, against torch's timeout.

Runs the real demo job (2 nodes x 2 gloo ranks + 1 spare) several times per fault, each time
injecting the fault from outside, and prints the median and worst time from the fault to the
verdict, whether the verdict named the injected rank, and the time to resume. In the same run it
measures the baseline: the same SIGSTOP hang in the same job with Tracehound's hang detection
off, surfacing only through torch's process-group timeout set to the value given (default 600 s,
torch's default for NCCL and a common explicit setting); the baseline job runs in a thread beside
the Tracehound runs (its ranks sit idle while they wait, so it does not slow the others).

    python bench/detection.py [--runs N] [--torch-timeout-s S] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tracehound.analysis.settings import DetectionSettings, HangSettings
from tracehound.controller.cli.demo import FaultInjector, run_demo_in_session, training_script
from tracehound.controller.cli.session import store_session
from tracehound.controller.orchestrators.local import LocalOrchestrator
from tracehound.controller.policy.recovery import PolicySettings
from tracehound.controller.supervision.supervisor import JobSpec, Supervisor, SupervisorSettings
from tracehound.tracing.ids import JobId


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per fault (default 5)")
    parser.add_argument("--torch-timeout-s", type=float, default=600.0,
                        help="process-group timeout of the baseline (default 600)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch baseline")
    parser.add_argument("--store", help="ClickHouse server URL (default: a temporary chdb store)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    store_dir = tempfile.mkdtemp(prefix="tracehound-bench-store-")
    store_url = args.store or f"chdb://{store_dir}"

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.store is None:
        # One process may open an embedded store once: every run shares one session.
        say("note: the embedded store is shared by all runs through one session")
    results: dict[str, Any] = {"runs_per_fault": args.runs,
                               "torch_timeout_s": args.torch_timeout_s}
    baseline: dict[str, Any] = {}
    started = time.monotonic()
    with store_session(store_url) as session:
        shared = session.url
        thread = None
        if not args.no_baseline:
            thread = threading.Thread(
                target=_shared_baseline, args=(session, args.torch_timeout_s, baseline),
                daemon=True)
            thread.start()
        for fault in ("hang", "crash"):
            detect, resume, lost, correct = [], [], [], 0
            for i in range(args.runs):
                rank = (3, 1, 2, 0)[i % 4]
                report = _run(session, fault, rank, i)
                ok = report["culprit_ranks"] == [rank] and report["completed"]
                correct += ok
                if report["detect_s"] is not None:
                    detect.append(report["detect_s"])
                if report["resume_s"] is not None:
                    resume.append(report["resume_s"])
                if report["steps_lost"] is not None:
                    lost.append(report["steps_lost"])
                say(f"{fault} run {i + 1}/{args.runs}: rank {rank} -> {report['culprit_ranks']} "
                    f"detect {report['detect_s']} s resume {report['resume_s']} s "
                    f"{'ok' if ok else 'WRONG/UNFINISHED'}")
            results[f"{fault}_detect_median_s"] = _median(detect)
            results[f"{fault}_detect_worst_s"] = max(detect) if detect else None
            results[f"{fault}_resume_median_s"] = _median(resume)
            results[f"{fault}_steps_lost_median"] = _median(lost)
            results[f"{fault}_correct"] = f"{correct}/{args.runs}"
        if thread is not None:
            say(f"waiting for the torch-timeout baseline ({args.torch_timeout_s:.0f} s timeout)")
            thread.join()
    results.update(baseline)
    results["store"] = shared.split("@")[-1]
    results["bench_s"] = round(time.monotonic() - started, 1)
    if args.json:
        print(json.dumps(results))
    else:
        for key, value in results.items():
            print(f"{key:28s} {value}")
    return 0


def _shared_baseline(session: Any, timeout_s: float, out: dict[str, Any]) -> None:
    job = JobId(f"bench-torch-timeout-{int(time.time())}")
    workdir = Path(tempfile.mkdtemp(prefix="tracehound-bench-"))
    command = (sys.executable, training_script(), "--steps", "200", "--checkpoint-every", "25",
               "--pg-timeout-s", str(timeout_s))
    injector = FaultInjector(fault="hang", rank=3, at_step=60)
    settings = SupervisorSettings(
        poll_s=0.5, timeout_s=timeout_s + 300,
        detection=DetectionSettings(hang=HangSettings(after_s=10 * timeout_s + 3600)),
        policy=PolicySettings(max_restarts=0),
    )
    orch = LocalOrchestrator(workdir=workdir, sink=session.sink)
    Supervisor(spec=JobSpec(job=job, command=command, nnodes=2, nproc_per_node=2),
               store=session.store, orchestrator=orch, settings=settings,
               observer=injector).run()
    exits = [e for e in session.store.exits(job, 0) if e.exit_code != 0 and e.rank != 3]
    out["torch_timeout_detect_s"] = (
        round((min(e.time_us for e in exits) - injector.injected_us) / 1e6, 3)
        if injector.injected_us and exits else None
    )
    out["torch_timeout_job"] = job


def _run(session: Any, fault: str, rank: int, i: int) -> dict[str, Any]:
    return run_demo_in_session(session, fault=fault, rank=rank,
                               job=f"bench-{fault}-{i}-{int(time.time())}")


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


if __name__ == "__main__":
    sys.exit(main())
