"""Effective training time ratio (ETTR): Tracehound beside torchrun, same job and faults, one run.

ETTR is the share of wall time that ends as kept training progress: the steps the job holds at
the end of a fixed wall time, over the steps the same job makes in that time with no fault and
no checkpointing (its reference rate, measured in this invocation). Detection, restarts, steps
lost since the last checkpoint, checkpointing itself and the recorder all count against it.

The job is the demo's 4-rank gloo DDP script (agent/examples/train_ddp.py, 20 ms of extra time
per step). Each side runs it for --wall-s seconds from its first step, and the bench strikes a
fault every --fault-every-s seconds, cycling through --faults, at ranks 3, 2, 1, ...:

    crash    SIGKILL of the rank's process
    freeze   SIGSTOP of it (a machine that stops)
    idle     the rank sleeps forever in its own code, outside collectives (a dead data loader,
             a deadlock): written to the script's --fault-file, which it reads every step
    xid      its simulated GPU reports Xid 79 and the process freezes (SIGSTOP); torchrun has
             no GPU health, so for it this is a freeze

- Tracehound: `tracehound run`, 2 nodes x 2 ranks and spare nodes, its defaults (idle grace
  30 s), the script taking an in-memory snapshot every step (`checkpoint.snapshot`), persisted
  to disk in the background every 50 steps.
- torchrun: `torchrun --standalone --nproc-per-node 4 --max-restarts 20` with
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (its restarted gloo ranks never connect otherwise), the
  script's synchronous DCP checkpoint every 50 steps (`checkpoint.save`), and the process-group
  timeout --pg-timeout-s (60 s; torch's own default is 30 minutes): a rank that freezes or idles
  is only noticed when its peers time out.

Per side: ETTR, steps lost per fault (the step rank 0 had printed at the fault minus the step
the job resumed from), fault to training again (the fault to the last rank's first step after
the resume), and checkpoint overhead: 1 - the step rate with the side's checkpointing over the
rate without any, from short healthy runs under plain torchrun (recorder off) in this
invocation. Medians over --runs runs, with the spread (min-max).

    python bench/ettr.py [--quick] [--json] [--runs N] [--wall-s S] [--faults crash,idle]

--quick: one run each, 150 s of wall time, a fault every 50 s (crash, then idle), one healthy
run per configuration: within 10 minutes here. What it leaves out: one machine, so no network
between nodes and a "node" isolation only renames where ranks run; slow checkpoint storage is
not injected (the script's storage is this machine's disk); a small model, so snapshots and
checkpoints are cheap to copy and to load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from restart import MARKER, rank_pid, script

STEP = re.compile(r"rank 0/\d+: step (\d+) loss")
RESUMED = re.compile(r"rank 0/\d+: resumed from step (\d+)")
FIRST = re.compile(r"rank (\d+)/\d+: first step after resume at ([0-9.]+)")
RATE = re.compile(r"rank \d+/\d+: \d+ steps at ([0-9.]+) steps/s")
XID_LOST = 79


def spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


@dataclass
class Fault:
    kind: str
    rank: int
    at: float
    step: int
    resumed_step: int | None = None
    training_again_s: float | None = None


@dataclass
class Side:
    """One launcher running the job: how to start it and where its ranks' output is."""

    name: str
    workdir: Path
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    proc: subprocess.Popen[bytes] | None = None

    def output(self) -> str:
        if self.name == "torchrun":
            path = self.workdir / "torchrun.log"
            return path.read_text(errors="replace") if path.exists() else ""
        logs = sorted((self.workdir / "ettr" / "logs").glob("attempt-*/rank-*.log"),
                      key=lambda p: (int(p.parent.name.split("-")[1]), p.name))
        return "".join(p.read_text(errors="replace") for p in logs)

    def rank0_step(self) -> int:
        """The step rank 0 printed last, in its newest attempt."""
        if self.name == "torchrun":
            tail = self.output()[-20000:]
        else:
            logs = sorted((self.workdir / "ettr" / "logs").glob("attempt-*/rank-0.log"),
                          key=lambda p: int(p.parent.name.split("-")[1]))
            tail = logs[-1].read_text(errors="replace")[-20000:] if logs else ""
        steps = STEP.findall(tail)
        return int(steps[-1]) if steps else 0

    def checkpoints(self) -> Path:
        return self.workdir / ("checkpoints" if self.name == "torchrun" else "ettr/checkpoints")

    def node_of(self, rank: int) -> str:
        attempts = sorted((self.workdir / "ettr" / "attempts").glob("attempt-*.json"),
                          key=lambda p: int(p.stem.split("-")[1]))
        for entry in json.loads(attempts[-1].read_text())["ranks"] if attempts else []:
            if entry["rank"] == rank:
                return str(entry["node"])
        return f"node-{rank // 2}"


def job_args(args: argparse.Namespace, fault_file: Path) -> list[str]:
    return ["--steps", "100000000", "--print-every", "1", "--step-sleep-ms", "20",
            "--pg-timeout-s", str(args.pg_timeout_s), "--checkpoint-every", "50",
            "--fault-file", str(fault_file)]


def start(side: Side, args: argparse.Namespace) -> None:
    side.workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, MARKER: side.marker, "OMP_NUM_THREADS": "1"}
    fault_file = side.workdir / "fault"
    if side.name == "tracehound":
        env.update({"TRACEHOUND_GPU": "sim", "TRACEHOUND_SIM_GPUS": "2",
                    "TRACEHOUND_SIM_GPU_FAULTS": str(side.workdir / "gpu-faults.jsonl")})
        command = [sys.executable, "-m", "tracehound.controller.cli", "--log-level", "WARNING",
                   "run", "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "4",
                   "--job-id", "ettr", "--workdir", str(side.workdir),
                   "--store", f"chdb://{side.workdir / 'store'}", "--max-restarts", "20",
                   script(), *job_args(args, fault_file),
                   "--snapshot-every", str(args.snapshot_every)]
        out: Any = subprocess.DEVNULL
    else:
        env.update({"TRACEHOUND_DISABLE": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                    "TRACEHOUND_CHECKPOINT_DIR": str(side.workdir / "checkpoints")})
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", "4", "--max-restarts", "20", script(),
                   *job_args(args, fault_file)]
        out = open(side.workdir / "torchrun.log", "wb")  # noqa: SIM115 - closed below
    side.proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)
    if out is not subprocess.DEVNULL:
        out.close()


def stop(side: Side) -> None:
    proc = side.proc
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGINT if side.name == "tracehound" else signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in filter(None, (rank_pid(side.marker, r) for r in range(4))):
        os.kill(pid, signal.SIGKILL)  # a stopped rank of a torchrun that gave up


def strike(side: Side, kind: str, rank: int) -> bool:
    """Inject one fault; False when the rank's process was not found (the job restarting)."""
    if kind == "idle":
        (side.workdir / f"fault.{rank}").write_text("idle")
        return True
    pid = rank_pid(side.marker, rank)
    if pid is None:
        return False
    if kind == "xid" and side.name == "tracehound":
        with (side.workdir / "gpu-faults.jsonl").open("a") as faults:
            faults.write(json.dumps({"node": side.node_of(rank), "gpu": rank % 2, "kind": "xid",
                                     "code": XID_LOST, "at_us": int(time.time() * 1e6)}) + "\n")
    os.kill(pid, signal.SIGKILL if kind == "crash" else signal.SIGSTOP)
    return True


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.1)


def run_side(side: Side, args: argparse.Namespace, faults: list[str]) -> dict[str, Any]:
    start(side, args)
    struck: list[Fault] = []
    try:
        wait_for(lambda: side.rank0_step() >= 1, 180, f"{side.name}'s first step")
        t0 = time.time()
        for k, kind in enumerate(faults):
            time.sleep(max(0.0, t0 + args.fault_every_s * (k + 1) - time.time()))
            rank = 3 - k % 3
            step = side.rank0_step()
            while not strike(side, kind, rank) and time.time() < t0 + args.wall_s:
                time.sleep(0.2)  # between attempts: strike its next process
            struck.append(Fault(kind, rank, time.time(), step))
            if not args.json:
                print(f"  {side.name}: {kind} of rank {rank} at step {step}", file=sys.stderr)
        time.sleep(max(0.0, t0 + args.wall_s - time.time()))
        kept, how = side.rank0_step(), "training"
        last = struck[-1] if struck else None
        if last is not None and not any(t > last.at for _, t in resume_events(side.output())):
            # recovering at the end: what is kept is what the next attempt resumes from
            kept, how = kept_after(side, last, args.limit_s)
    finally:
        stop(side)
    resumes = resume_events(side.output())
    for fault in struck:
        after = next(((s, t) for s, t in resumes if t > fault.at), None)
        if after is not None:
            fault.resumed_step, done = after
            fault.training_again_s = round(done - fault.at, 3)
    return {"kept_steps": kept, "kept_as": how, "faults": [vars(f) for f in struck]}


def kept_after(side: Side, fault: Fault, limit_s: float) -> tuple[int, str]:
    """The step the attempt after `fault` resumes from (waiting up to `limit_s`), else the
    newest complete disk checkpoint, a lower bound of it."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        after = [s for s, t in resume_events(side.output()) if t > fault.at]
        if after:
            return after[0], "resumed after the end"
        time.sleep(0.5)
    steps = [int(p.parent.name.split("-")[1])
             for p in side.checkpoints().glob("step-*/COMPLETE")]
    return max([s for s in steps if s <= fault.step], default=0), "not resumed: disk checkpoint"


def resume_events(text: str) -> list[tuple[int, float]]:
    """(step resumed from, when the last rank made its first step) of every resume, in order:
    each resume's four "first step after resume" lines follow its "resumed from" line."""
    events: list[tuple[int, float]] = []
    step, firsts = None, []
    for line in text.splitlines():
        if (found := RESUMED.search(line)) is not None:
            step, firsts = int(found.group(1)), []
        elif (first := FIRST.search(line)) is not None and step is not None:
            firsts.append(float(first.group(2)))
            if len(firsts) == 4:
                events.append((step, max(firsts)))
                step = None
    return sorted(events, key=lambda e: e[1])


def start_keepers(workdir: Path) -> tuple[list[subprocess.Popen[bytes]], str]:
    """Two node keepers for the healthy snapshot runs: their processes and the keepers' list."""
    procs, entries = [], []
    workdir.mkdir(parents=True, exist_ok=True)
    for node in ("node-0", "node-1"):
        addr = workdir / f"{node}.addr"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tracehound.agent.node.keeper", "--node", node,
             "--port-file", str(addr)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_for(addr.exists, 30, f"the keeper of {node}")
        entries.append(f"{node}=http://{addr.read_text().strip()}")
    return procs, ",".join(entries)


def healthy_rate(config: str, steps: int, workdir: Path, keepers: str) -> float | None:
    """Steps per second of a healthy run under plain torchrun (recorder off), the median of
    its ranks' own figures: `plain` (no checkpoints), `snapshot` (every step, persisted every
    50, Tracehound's way) or `dcp` (a synchronous DCP checkpoint every 50, torchrun's)."""
    run = workdir / f"{config.replace(':', '-')}-{uuid.uuid4().hex[:6]}"
    run.mkdir(parents=True)
    env = {**os.environ, "TRACEHOUND_DISABLE": "1", "OMP_NUM_THREADS": "1",
           "TRACEHOUND_CHECKPOINT_DIR": str(run / "checkpoints"),
           "TRACEHOUND_SNAPSHOT_KEEPERS": keepers, "TRACEHOUND_NODE_ID": "node-0",
           "TRACEHOUND_JOB_ID": run.name}
    kind, _, every = config.partition(":")  # "snapshot:4": a snapshot every 4 steps
    extra = {"plain": ["--checkpoint-every", "0"],
             "snapshot": ["--snapshot-every", every or "1", "--checkpoint-every", "50"],
             "dcp": ["--checkpoint-every", "50"]}[kind]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
         script(), "--steps", str(steps), "--print-every", "0", "--step-sleep-ms", "20", *extra],
        env=env, capture_output=True, text=True, timeout=600, check=False)
    rates = [float(r) for r in RATE.findall(proc.stdout + proc.stderr)]
    return statistics.median(rates) if rates else None


def overheads(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """The reference step rate and each side's checkpointing cost, from alternating healthy
    runs of the three configurations."""
    procs, keepers = start_keepers(workdir)
    rates: dict[str, list[float]] = {"plain": [], "snapshot": [], "dcp": []}
    try:
        for _ in range(args.healthy_runs):
            for config, seen in rates.items():
                how = f"snapshot:{args.snapshot_every}" if config == "snapshot" else config
                rate = healthy_rate(how, args.healthy_steps, workdir, keepers)
                if rate is not None:
                    seen.append(rate)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait()
    plain = statistics.median(rates["plain"]) if rates["plain"] else None

    def cost(config: str) -> float | None:
        if not plain or not rates[config]:
            return None
        return round(1 - statistics.median(rates[config]) / plain, 4)

    return {"rate_steps_per_s": {k: spread(v) for k, v in rates.items()},
            "reference_rate": plain, "checkpoint_overhead": cost("snapshot"),
            "checkpoint_overhead_torchrun": cost("dcp")}


def summarize(runs: list[dict[str, Any]], wall_s: float, rate: float) -> dict[str, Any]:
    ettr = [r["kept_steps"] / (rate * wall_s) for r in runs]
    faults = [f for r in runs for f in r["faults"]]
    # the step rank 0 had printed when the fault struck; a snapshot of the step it was finishing
    # may be newer (an idle fault takes hold at the next step): lost is never below 0
    lost = [max(0, f["step"] - f["resumed_step"]) for f in faults
            if f["resumed_step"] is not None]
    again = [f["training_again_s"] for f in faults if f["training_again_s"] is not None]
    by_kind: dict[str, list[float]] = {}
    for f in faults:
        if f["training_again_s"] is not None:
            by_kind.setdefault(f["kind"], []).append(f["training_again_s"])
    return {"ettr": spread(ettr), "steps_lost_per_fault": spread(lost),
            "training_again_s": spread(again),
            "training_again_s_by_kind": {k: spread(v) for k, v in by_kind.items()},
            "faults_not_recovered": sum(f["resumed_step"] is None for f in faults),
            "runs": runs}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[1:]))
    parser.add_argument("--quick", action="store_true",
                        help="one run a side, 150 s, a fault every 50 s: within 10 minutes")
    parser.add_argument("--runs", type=int, default=3, help="runs per side (default 3)")
    parser.add_argument("--wall-s", type=float, default=480.0,
                        help="wall time of each run from its first step (default 480)")
    parser.add_argument("--fault-every-s", type=float, default=120.0,
                        help="a fault every this many seconds (default 120)")
    parser.add_argument("--faults", default="crash,freeze,idle,xid",
                        help="the fault kinds, in turn (default crash,freeze,idle,xid)")
    parser.add_argument("--pg-timeout-s", type=float, default=60.0,
                        help="the job's process-group timeout (default 60)")
    parser.add_argument("--limit-s", type=float, default=150.0,
                        help="how long past the wall time to wait for a resume (default 150)")
    parser.add_argument("--healthy-runs", type=int, default=3,
                        help="healthy runs per configuration for the reference rate and "
                             "checkpoint overhead (default 3)")
    parser.add_argument("--healthy-steps", type=int, default=600)
    parser.add_argument("--snapshot-every", type=int, default=1,
                        help="Tracehound's side snapshots every N steps (default 1)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.wall_s, args.fault_every_s = 1, 150.0, 50.0
        args.faults, args.healthy_runs, args.healthy_steps = "crash,idle", 1, 400
    kinds = [k for k in args.faults.split(",") if k]
    unknown = sorted(set(kinds) - {"crash", "freeze", "idle", "xid"})
    if unknown or not kinds:
        parser.error(f"--faults: {', '.join(unknown) or 'none given'}; expected some of "
                     "crash, freeze, idle, xid")
    return args


def main() -> int:
    args = parse_args()
    kinds = [k for k in args.faults.split(",") if k]
    count = max(0, int((args.wall_s - args.fault_every_s / 2) // args.fault_every_s))
    schedule = [kinds[k % len(kinds)] for k in range(count)]
    report: dict[str, Any] = {"ranks": 4, "wall_s": args.wall_s,
                              "snapshot_every": args.snapshot_every,
                              "fault_every_s": args.fault_every_s, "faults": schedule,
                              "pg_timeout_s": args.pg_timeout_s, "runs": args.runs}
    with tempfile.TemporaryDirectory(prefix="th-ettr-") as tmp:
        if not args.json:
            print("healthy runs (reference rate, checkpoint overhead) ...", file=sys.stderr)
        report.update(overheads(args, Path(tmp) / "healthy"))
        sides: dict[str, list[dict[str, Any]]] = {"tracehound": [], "torchrun": []}
        for i in range(args.runs):
            for name, done in sides.items():  # alternating: drift of the machine hits both
                if not args.json:
                    print(f"run {i + 1}/{args.runs}: {name} ...", file=sys.stderr)
                done.append(run_side(Side(name, Path(tmp) / f"{name}-{i}"), args, schedule))
    rate = report["reference_rate"]
    if not rate:
        raise SystemExit("no reference rate: the healthy runs printed none")
    ours, theirs = (summarize(sides[n], args.wall_s, rate) for n in ("tracehound", "torchrun"))
    report.update({"tracehound": ours, "torchrun": theirs})
    report["ettr"] = ours["ettr"]["median"] if ours["ettr"] else None
    report["ettr_torchrun"] = theirs["ettr"]["median"] if theirs["ettr"] else None
    lost = ours["steps_lost_per_fault"]
    report["steps_lost_per_fault"] = lost["median"] if lost else None
    a, b = ours["training_again_s"], theirs["training_again_s"]
    report["resume_ratio"] = round(a["median"] / b["median"], 3) if a and b else None
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


def print_table(report: dict[str, Any]) -> None:
    print(f"ETTR over {report['wall_s']:.0f} s, a fault every {report['fault_every_s']:.0f} s "
          f"({', '.join(report['faults'])}); reference rate {report['reference_rate']:.2f} "
          f"steps/s; torchrun's process-group timeout {report['pg_timeout_s']:.0f} s")
    for name in ("tracehound", "torchrun"):
        side = report[name]
        print(f"  {name:10s} ETTR {side['ettr']}  steps lost/fault "
              f"{side['steps_lost_per_fault']}  fault->training {side['training_again_s']} "
              f"(by kind {side['training_again_s_by_kind']}; not recovered "
              f"{side['faults_not_recovered']})")
    print(f"  checkpoint overhead: tracehound {report['checkpoint_overhead']}, torchrun "
          f"{report['checkpoint_overhead_torchrun']}; resume ratio {report['resume_ratio']}")


if __name__ == "__main__":
    sys.exit(main())
