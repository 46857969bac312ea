"""`tracehound demo`: a real DDP job that gets a fault from outside and recovers from it.

Two nodes of two gloo ranks and one spare node train a small model with checkpoints; each node's
agent samples two simulated GPUs. When the job reaches `fault_step`, one rank is stopped
(SIGSTOP, a hang) or killed (SIGKILL, a crash) from outside, as a broken GPU or a kernel would,
or its GPU reports Xid 79 (fallen off the bus) and the rank freezes (`xid`). Tracehound has to
name that rank and its node, isolate the node, restart on the spare from the latest complete
checkpoint, and finish training.
The report compares what was injected with what was found, and times each phase.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracehound.agent.checkpoint import latest_complete
from tracehound.controller.cli.options import (
    detection_args,
    own_ingest_token,
    print_json,
    store_arg,
    supervisor_settings,
)
from tracehound.controller.cli.session import StoreSession, store_session
from tracehound.controller.orchestrators.local import LocalOrchestrator
from tracehound.controller.supervision.supervisor import (
    JobSpec,
    PollView,
    RunResult,
    Supervisor,
    SupervisorSettings,
)
from tracehound.tracing import settings as env
from tracehound.tracing.events import now_us
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore

FAULT_SIGNALS = {"hang": signal.SIGSTOP, "crash": signal.SIGKILL, "xid": signal.SIGSTOP}
"""How each demo fault strikes its rank; `xid` also makes the rank's simulated GPU report Xid 79
(fallen off the bus), as a GPU that is lost freezes the process that drives it."""

XID_LOST = 79


def training_script() -> str:
    spec = importlib.util.find_spec("tracehound.agent.examples.train_ddp")
    if spec is None or spec.origin is None:
        raise RuntimeError("the demo training script tracehound.agent.examples is not installed")
    return spec.origin


@dataclass
class FaultInjector:
    """Observes the supervisor's polls and strikes once attempt 0 reaches `at_step`."""

    fault: str
    rank: int
    at_step: int
    gpu_faults: Path | None = None
    """The simulated GPUs' fault file (the `xid` fault writes its Xid there)."""
    nproc_per_node: int = 2
    checkpoints: Path | None = None
    """The job's checkpoint directory (`tracehound.agent.checkpoint`)."""
    injected_us: int = 0
    injected_step: int = 0
    pid: int = 0
    log: list[str] = field(default_factory=list)

    def __call__(self, view: PollView) -> None:
        if self.injected_us or view.attempt != 0:
            return
        # the step the job reached: by the stored heartbeats, or by its newest complete
        # checkpoint when those lag (a loaded machine's node agents ship late, and a job of
        # 30 ms steps could finish before the store showed step `at_step`)
        stored = max((hb.step for hb in view.snapshot.heartbeats), default=0)
        saved = latest_complete(self.checkpoints) if self.checkpoints is not None else None
        reached = max(stored, saved[0] if saved else 0)
        if reached < self.at_step:
            return
        pid = view.orchestrator.pid_of(self.rank)
        if pid is None:
            return
        if self.fault == "xid" and self.gpu_faults is not None:
            node = next((hb.node for hb in view.snapshot.heartbeats if hb.rank == self.rank),
                        f"node-{self.rank // self.nproc_per_node}")
            gpu = self.rank % self.nproc_per_node
            with self.gpu_faults.open("a") as faults:
                faults.write(json.dumps({"node": node, "gpu": gpu, "kind": "xid",
                                         "code": XID_LOST, "at_us": now_us()}) + "\n")
            self.log.append(f"simulated Xid {XID_LOST} on {node} gpu{gpu}")
        os.kill(pid, FAULT_SIGNALS[self.fault])
        self.injected_us = now_us()
        self.injected_step = reached
        self.pid = pid
        self.log.append(
            f"injected {self.fault}: {FAULT_SIGNALS[self.fault].name} to rank {self.rank} "
            f"(pid {pid}) at step {reached}"
        )


def _measure(
    store: TraceStore, result: RunResult, injector: FaultInjector, total_steps: int
) -> dict[str, Any]:
    job = result.job
    first = next((i for i in result.incidents if i.attempt == 0), None)
    detect_s = resume_s = steps_lost = None
    if first is not None and injector.injected_us:
        detect_s = round((first.detected_at_us - injector.injected_us) / 1e6, 3)
    before = store.latest_heartbeats(job, 0)
    after = store.latest_heartbeats(job, 1) if result.attempts > 1 else []
    if after and injector.injected_us:
        firsts = [hb.first_step_us for hb in after if hb.first_step_us]
        if firsts:
            resume_s = round((min(firsts) - injector.injected_us) / 1e6, 3)
        if before:
            steps_lost = max(hb.step for hb in before) - min(hb.start_step for hb in after)
    last = store.latest_heartbeats(job, result.attempts - 1) if result.attempts else []
    final_step = max((hb.step for hb in last), default=0)
    return {
        "detect_s": detect_s,
        "resume_s": resume_s,
        "steps_lost": steps_lost,
        "final_step": final_step,
        "completed": bool(result.completed and final_step >= total_steps),
    }


def run_demo(
    *,
    store_url: str | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run the demo in a store session of its own and return its report (the `--json` object)."""
    with store_session(store_url) as session:
        return run_demo_in_session(session, **kwargs)


def run_demo_in_session(
    session: StoreSession,
    *,
    fault: str = "hang",
    rank: int = 3,
    fault_step: int = 60,
    steps: int = 200,
    checkpoint_every: int = 25,
    step_sleep_ms: float = 30.0,
    workdir: Path | None = None,
    settings: SupervisorSettings | None = None,
    job: str | None = None,
) -> dict[str, Any]:
    """Run the demo against an open store session (benchmarks run many demos in one)."""
    if fault not in FAULT_SIGNALS:
        raise ValueError(f"--fault {fault!r}: expected one of {', '.join(FAULT_SIGNALS)}")
    nnodes, nproc, spares = 2, 2, 1
    if not 0 <= rank < nnodes * nproc:
        raise ValueError(f"--rank {rank}: expected a rank from 0 to {nnodes * nproc - 1}")
    if not 0 < fault_step < steps:
        raise ValueError(f"--fault-step {fault_step}: expected a step between 1 and {steps - 1}")
    job_id = JobId(job or f"demo-{fault}-{time.strftime('%Y%m%d-%H%M%S')}")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="tracehound-demo-"))
    command = (
        sys.executable, training_script(), "--steps", str(steps),
        "--checkpoint-every", str(checkpoint_every), "--pg-timeout-s", "120",
        "--step-sleep-ms", str(step_sleep_ms),
    )
    spec = JobSpec(job=job_id, command=command, nnodes=nnodes, nproc_per_node=nproc,
                   spare_nodes=spares)
    gpu_faults = workdir / "gpu-faults.jsonl"
    injector = FaultInjector(fault=fault, rank=rank, at_step=fault_step, gpu_faults=gpu_faults,
                             nproc_per_node=nproc, checkpoints=workdir / "checkpoints")
    settings = settings or SupervisorSettings(poll_s=0.25, timeout_s=600)
    started = time.monotonic()
    # this machine has no GPU: every demo node gets simulated ones, healthy until a fault
    agent_env = {env.TRACEHOUND_GPU: "sim", env.TRACEHOUND_SIM_GPUS: str(nproc),
                 env.TRACEHOUND_SIM_GPU_FAULTS: str(gpu_faults),
                 env.TRACEHOUND_HEALTH_INTERVAL_S: "1"}
    orch = LocalOrchestrator(workdir=workdir, sink=session.sink, agent_env=agent_env,
                             checkpoint_dir=injector.checkpoints)
    supervisor = Supervisor(spec=spec, store=session.store, orchestrator=orch,
                            settings=settings, observer=injector,
                            evidence_dir=workdir / "incidents")
    result = supervisor.run()
    figures = _measure(session.store, result, injector, steps)
    first = next((i for i in result.incidents if i.attempt == 0), None)
    return {
        "job": job_id,
        "store": session.store.url,
        "workdir": str(workdir),
        "fault": fault,
        "injected_rank": rank,
        "injected_node": f"node-{rank // nproc}",
        "injected": injector.injected_us > 0,
        "injected_at_step": injector.injected_step,
        "culprit_ranks": list(first.culprit_ranks) if first else [],
        "culprit_nodes": list(first.culprit_nodes) if first else [],
        "kind": first.kind if first else None,
        "confidence": first.confidence if first else None,
        "summary": first.summary if first else None,
        "actions": [f"{a.kind.value} {a.target}" for a in first.actions] if first else [],
        **figures,
        "attempts": result.attempts,
        "reason": result.reason,
        "total_s": round(time.monotonic() - started, 1),
    }


def demo_ok(report: dict[str, Any]) -> bool:
    """The demo succeeds when the injected rank alone was blamed and training finished."""
    return bool(report["completed"]) and report["culprit_ranks"] == [report["injected_rank"]]


def format_report(report: dict[str, Any]) -> str:
    def num(value: Any, unit: str = "") -> str:
        return "-" if value is None else f"{value}{unit}"

    verdict = "CORRECT" if report["culprit_ranks"] == [report["injected_rank"]] else "WRONG"
    lines = [
        f"Tracehound demo: job {report['job']}",
        f"  fault           {report['fault']} of rank {report['injected_rank']} "
        f"({report['injected_node']}) at step {report['injected_at_step']}",
        f"  found           ranks {report['culprit_ranks']} on {report['culprit_nodes']} "
        f"[{verdict}] confidence {num(report['confidence'])}",
        f"  why             {report['summary'] or '-'}",
        f"  actions         {'; '.join(report['actions']) or '-'}",
        f"  time to detect  {num(report['detect_s'], ' s')}",
        f"  time to resume  {num(report['resume_s'], ' s')}",
        f"  steps lost      {num(report['steps_lost'])}",
        f"  training        {'finished' if report['completed'] else 'NOT finished'} at step "
        f"{report['final_step']} after {report['attempts']} attempt(s) ({report['reason']})",
        f"  store           {report['store']}  (tracehound incidents --job {report['job']})",
        f"  dashboard       tracehound ui --store {report['store']}  (then open "
        f"http://127.0.0.1:8501/?view=incident&job={report['job']})",
        f"  logs            {report['workdir']}/logs",
    ]
    return "\n".join(lines)


EPILOG_DEMO = """\
examples:
  tracehound demo                        # SIGSTOP rank 3 mid-training, recover, report
  tracehound demo --fault crash --rank 1 # SIGKILL rank 1 instead
  tracehound demo --fault xid            # rank 3's (simulated) GPU falls off the bus
  tracehound demo --json                 # one JSON object for scripts
"""


def add_parser(sub: Any) -> None:
    demo = sub.add_parser(
        "demo", help="inject a fault into a real 2x2-rank DDP job and recover it",
        description="Run a real DDP job (2 nodes x 2 gloo ranks + 1 spare node), inject a fault "
                    "from outside, and report what Tracehound found and how fast it recovered.",
        epilog=EPILOG_DEMO, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--fault", choices=["hang", "crash", "xid"], default="hang",
                      help="hang = SIGSTOP the rank, crash = SIGKILL it, xid = its simulated GPU "
                           "reports Xid 79 (fallen off the bus) and the rank freezes "
                           "(default: hang)")
    demo.add_argument("--rank", type=int, default=3, help="rank to fault, 0-3 (default: 3)")
    demo.add_argument("--fault-step", type=int, default=60,
                      help="training step at which to inject (default: 60)")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    demo.add_argument("--job-id", help="job id (default: demo-<fault>-<time>)")
    demo.add_argument("--workdir", type=Path, help="checkpoints, spools and logs (default: temp)")
    detection_args(demo)
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    store_arg(demo)
    demo.set_defaults(handler=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    with own_ingest_token():
        return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.demo import demo_ok, format_report, run_demo

    settings = supervisor_settings(args, poll_s=0.25, timeout_s=600)
    if not args.json:
        print(f"tracehound demo: 2 nodes x 2 ranks + 1 spare; {args.fault} of rank {args.rank} "
              f"at step {args.fault_step} of {args.steps} ...", file=sys.stderr)
    report = run_demo(
        fault=args.fault, rank=args.rank, fault_step=args.fault_step, steps=args.steps,
        store_url=args.store, workdir=args.workdir, settings=settings, job=args.job_id,
    )
    if args.json:
        print_json(report)
    else:
        print(format_report(report))
    return 0 if demo_ok(report) else 1
