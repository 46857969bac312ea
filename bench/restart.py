"""Fault -> training resumed: Tracehound's restart against torchrun's, on the same job, same run.

The job is the demo's 4-rank gloo DDP script (agent/examples/train_ddp.py; checkpoint every 25
steps). Each case runs it twice, once under `tracehound run` (2 nodes x 2 ranks and a spare node,
warm spares on by default) and once under `torchrun --standalone --nproc-per-node 4
--max-restarts 1` (its defaults otherwise: workers watched every 0.1 s; and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which its restarted gloo ranks never connect), and
injects the same fault from outside at the same point: once the first checkpoint is complete
and `--fault-after-s` more have passed (10 s: a job in training, its warm spares ready; a fault
in the first seconds of a job, `--fault-after-s 1`, finds them still importing), rank 1's
process gets

- crash: SIGKILL. Both launchers see the exit and restart every rank from the checkpoint.
- hang: SIGSTOP. Tracehound sees the frozen rank within seconds and restarts without it;
  torchrun can only restart once the process group's timeout (`--pg-timeout-s`) makes the other
  ranks fail, and then must wait out its own stop of the frozen rank.

The resume time is from the signal (this script's clock) to the moment the last rank of the
new attempt finished its first step (each rank prints that time). Tracehound's phase split is
its own (`tracehound run --json`: detect, decide, tear down, relaunch, rendezvous, checkpoint
load, first step; its detect phase starts at the fault as the controller saw it).

    python bench/restart.py [--json] [--cases crash,hang] [--no-warm-spares]

What it leaves out: one machine, so no network between nodes, and "node" isolation here only
renames where ranks run; a job whose import and setup take longer than this small script's gain
more from warm spares, one whose checkpoint is bigger gains less (its load is paid either way).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

RESUMED = re.compile(r"rank (\d+)/\d+: first step after resume at ([0-9.]+)")
MARKER = "TRACEHOUND_BENCH_RUN"
"""Environment variable that tags the bench's own rank processes (to find rank 1's pid)."""


def script() -> str:
    from tracehound.controller.cli.demo import training_script

    return str(training_script())


def job_args(args: argparse.Namespace, *, pg_timeout_s: float) -> list[str]:
    return ["--steps", str(args.steps), "--checkpoint-every", "25", "--print-every", "0",
            "--step-sleep-ms", str(args.step_sleep_ms), "--pg-timeout-s", str(pg_timeout_s)]


def rank_pid(marker: str, rank: int) -> int | None:
    """The pid of the training process of `rank` started under this bench run's marker."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if (f"{MARKER}={marker}".encode() in env and f"RANK={rank}".encode() in env
                and b"train_ddp.py" in cmdline and b"torch.distributed.run" not in cmdline):
            return int(entry.name)
    return None


def inject(fault: str, *, marker: str, checkpoints: Path, deadline_s: float,
           after_s: float) -> float:
    """Wait for the first complete checkpoint and `after_s` more seconds, then signal rank 1;
    the time of the signal (time.time())."""
    end = time.monotonic() + deadline_s
    while not any(checkpoints.glob("step-*/COMPLETE")):
        if time.monotonic() > end:
            raise RuntimeError(f"no checkpoint appeared in {checkpoints} in {deadline_s:.0f} s")
        time.sleep(0.05)
    time.sleep(after_s)
    pid = rank_pid(marker, 1)
    if pid is None:
        raise RuntimeError("rank 1's process was not found")
    at = time.time()
    os.kill(pid, signal.SIGKILL if fault == "crash" else signal.SIGSTOP)
    return at


def resumed_at(text: str, ranks: int) -> float | None:
    """When the last rank finished its first step after the resume; None if not all did."""
    seen = {int(r): float(t) for r, t in RESUMED.findall(text)}
    return max(seen.values()) if len(seen) >= ranks else None


def run_tracehound(args: argparse.Namespace, fault: str, workdir: Path) -> dict[str, Any]:
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER: marker, "OMP_NUM_THREADS": "1"}
    job = f"restart-{fault}"
    command = [
        sys.executable, "-m", "tracehound.controller.cli", "--log-level", "WARNING", "run",
        "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "--job-id", job,
        "--workdir", str(workdir), "--store", f"chdb://{workdir / 'store'}", "--json",
        "--timeout", str(args.limit_s), *([] if args.warm_spares else ["--no-warm-spares"]),
        script(), *job_args(args, pg_timeout_s=args.pg_timeout_s),
    ]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        fault_at = inject(fault, marker=marker, checkpoints=workdir / job / "checkpoints",
                          deadline_s=120, after_s=args.fault_after_s)
        out, err = proc.communicate(timeout=args.limit_s + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    result = json.loads(out) if out.strip().startswith("{") else {}
    logs = "".join(p.read_text(errors="replace")
                   for p in (workdir / job / "logs").glob("attempt-*/rank-*.log"))
    done = resumed_at(logs, 4)
    restarts = result.get("restarts") or [{}]
    return {
        "resume_s": round(done - fault_at, 3) if done else None,
        "phases": restarts[0].get("phases"), "warm_ranks": restarts[0].get("warm_ranks"),
        "completed": result.get("completed"), "attempts": result.get("attempts"),
        **({} if done else {"error": (err or out)[-1500:]}),
    }


def run_torchrun(args: argparse.Namespace, fault: str, workdir: Path) -> dict[str, Any]:
    marker = uuid.uuid4().hex
    checkpoints = workdir / "torchrun-checkpoints"
    env = {**os.environ, MARKER: marker, "OMP_NUM_THREADS": "1",
           "TRACEHOUND_CHECKPOINT_DIR": str(checkpoints), "TRACEHOUND_DISABLE": "1",
           # without it, torch 2.13's restarted gloo ranks read the previous attempt's
           # addresses from the rendezvous store and never connect (pytorch#135712)
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "4", "--max-restarts", "1", script(),
               *job_args(args, pg_timeout_s=args.pg_timeout_s)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        fault_at = inject(fault, marker=marker, checkpoints=checkpoints, deadline_s=120,
                          after_s=args.fault_after_s)
        try:
            out, _ = proc.communicate(timeout=args.limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    done = resumed_at(out, 4)
    return {"resume_s": round(done - fault_at, 3) if done else None,
            "completed": proc.returncode == 0,
            **({} if done else {"note": f"training had not resumed {args.limit_s:.0f} s after "
                                        "the fault"})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--cases", default="crash,hang", help="crash, hang or both (default)")
    parser.add_argument("--steps", type=int, default=1000,
                        help="training steps (default 1000)")
    parser.add_argument("--fault-after-s", type=float, default=10.0,
                        help="seconds from the first complete checkpoint to the fault "
                             "(default 10)")
    parser.add_argument("--step-sleep-ms", type=float, default=20.0,
                        help="extra time per step, so the job is still training at the fault "
                             "(default 20)")
    parser.add_argument("--pg-timeout-s", type=float, default=30.0,
                        help="the job's process-group timeout: what torchrun waits for on a "
                             "hang (default 30)")
    parser.add_argument("--limit-s", type=float, default=150.0,
                        help="give up on a launcher this long after the fault (default 150)")
    parser.add_argument("--warm-spares", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    cases = [c for c in args.cases.split(",") if c]
    for case in cases:
        if case not in ("crash", "hang"):
            parser.error(f"--cases: unknown case {case!r}; expected crash and/or hang")
    report: dict[str, Any] = {"ranks": 4, "warm_spares": args.warm_spares,
                              "pg_timeout_s": args.pg_timeout_s,
                              "fault_after_s": args.fault_after_s}
    for case in cases:
        with tempfile.TemporaryDirectory(prefix=f"th-restart-{case}-") as tmp:
            if not args.json:
                print(f"{case}: tracehound run ...", file=sys.stderr, flush=True)
            ours = run_tracehound(args, case, Path(tmp) / "tracehound")
            if not args.json:
                print(f"{case}: torchrun --max-restarts 1 ...", file=sys.stderr, flush=True)
            theirs = run_torchrun(args, case, Path(tmp))
        entry = {"tracehound": ours, "torchrun": theirs}
        if ours["resume_s"] and theirs["resume_s"]:
            entry["ratio"] = round(ours["resume_s"] / theirs["resume_s"], 3)
        report[case] = entry
    if "crash" in report:
        crash = report["crash"]
        report["tracehound_resume_s"] = crash["tracehound"]["resume_s"]
        report["torchrun_resume_s"] = crash["torchrun"]["resume_s"]
        report["phases"] = crash["tracehound"]["phases"]
        report["ratio"] = crash.get("ratio")
    if args.json:
        print(json.dumps(report))
    else:
        for case in cases:
            entry = report[case]
            print(f"{case}: tracehound {entry['tracehound']['resume_s']} s "
                  f"(phases {entry['tracehound'].get('phases')}), torchrun "
                  f"{entry['torchrun']['resume_s']} s"
                  + (f", ratio {entry['ratio']}" if "ratio" in entry else
                     f" ({entry['torchrun'].get('note', '')})"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
