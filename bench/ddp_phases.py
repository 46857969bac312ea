"""Where tracing a DDP model costs a multi-rank job its step time: by phase, and by entry point.

bench/overhead.py says how much a traced step costs in a 4-rank job; bench/ddp_trace_cost.py
says what the recorder's work costs one rank that has no peer to wait for. This one says where
the difference goes in a real multi-rank job: torchrun ranks under `tracehound instrument` (the
recorder in every rank, a node agent shipping to an embedded store), two identical DDP models
trained in alternating blocks of steps:

- `traced`: as the recorder's settings in force make it (TRACEHOUND_DDP_TRACE_EVERY: 0, the
  default, every step counted; 1, every bucket through the recorder's process group; N, one
  step in N and the others counted);
- `plain`: built inside `hooks.untraced_ddp()`: DDP's own C++ all-reduce, nothing recorded.

Each step is timed in three phases on the wall clock: `forward` (zero_grad and the forward),
`backward` (the loss and its backward pass, DDP's all-reduces and its wait for them), `step`
(the optimizer step, with the recorder's optimizer hook and step hooks). The figures are the
median over rounds of each phase's mean per step, for each model, and `traced` minus `plain`.

`entry_us` is the wall time per call of each recorder entry point on the training thread, in
this job (timed by wrapping the class's method: each call also carries the wrapper's two clock
reads), with its calls per step of each model (the optimizer hook runs at the steps of both,
the heartbeat thread's calls count too). In a job these run once a step amid the step's own
work, cold, and cost several times what the same calls cost in a loop that times them alone.

    python bench/ddp_phases.py [--ranks 2] [--rounds 16] [--block-steps 120] [--json]

Run with TRACEHOUND_DDP_TRACE_EVERY=N to see the counted route. A benchmark, never a test:
nothing here gates on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tracehound.tracing.settings import DEFAULT_DDP_TRACE_EVERY

sys.path.insert(0, str(Path(__file__).resolve().parent))

PHASES = ("forward", "backward", "step")
ENTRY_POINTS = (
    ("_Reducer", "allreduce"), ("_Reducer", "settle"), ("_Reducer", "stepped"),
    ("_DdpCount", "started"), ("_DdpCount", "forwarded"), ("_DdpCount", "done"),
    ("Recorder", "optimizer_stepped"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="torchrun ranks (default 2)")
    parser.add_argument("--rounds", type=int, default=16,
                        help="rounds (one block of each model per round, default 16)")
    parser.add_argument("--block-steps", type=int, default=120, help="steps per block")
    parser.add_argument("--warmup-steps", type=int, default=60, help="per model, not timed")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _timed_entry_points(counts: dict[str, list[float]]) -> None:
    """Wrap each recorder entry point so that its calls and wall time add up in `counts`."""
    from tracehound.agent.rank import hooks, recorder

    owners = {"_Reducer": hooks.ddp._Reducer, "_DdpCount": hooks.ddp._DdpCount,
              "Recorder": recorder.Recorder}
    clock = time.perf_counter
    for owner, name in ENTRY_POINTS:
        cls = owners[owner]
        original = getattr(cls, name)
        tally = counts.setdefault(f"{owner}.{name}", [0.0, 0.0])

        def timed(self: Any, *args: Any, _original: Any = original,
                  _tally: list[float] = tally) -> Any:
            start = clock()
            try:
                return _original(self, *args)
            finally:
                _tally[0] += 1
                _tally[1] += clock() - start

        setattr(cls, name, timed)


def worker(args: argparse.Namespace) -> int:
    """One rank: train both models, print rank 0's figures as `ddp-phases {json}`."""
    counts: dict[str, list[float]] = {}
    _timed_entry_points(counts)  # before any model: DDP's step hooks are bound methods
    import torch.distributed as dist
    from overhead_job import batch, net, optimizers, start
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from tracehound.agent.rank import hooks

    started = start("ddp_phases")
    if started is None:
        return 2
    rank, _ = started
    traced = DistributedDataParallel(net(args.width))
    with hooks.untraced_ddp():
        plain = DistributedDataParallel(net(args.width))
    models = {"traced": traced, "plain": plain}
    optimizer_of = optimizers(models)
    x, y = batch(rank, args.width, args.batch)
    loss_fn = nn.MSELoss()
    clock = time.perf_counter

    def block(kind: str, steps: int) -> list[float]:
        model, optimizer = models[kind], optimizer_of[kind]
        spent = [0.0, 0.0, 0.0]
        for _ in range(steps):
            a = clock()
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            b = clock()
            loss_fn(out, y).backward()
            c = clock()
            optimizer.step()
            d = clock()
            spent[0] += b - a
            spent[1] += c - b
            spent[2] += d - c
        return [s / steps * 1e6 for s in spent]

    for kind in models:  # `traced` first: its optimizer is the lead one (the training steps)
        block(kind, args.warmup_steps)
    for tally in counts.values():
        tally[0] = tally[1] = 0.0
    rounds: list[dict[str, list[float]]] = []
    for i in range(args.rounds):
        order = list(models) if i % 2 == 0 else list(models)[::-1]
        rounds.append({kind: block(kind, args.block_steps) for kind in order})
    timed_steps = args.rounds * args.block_steps
    figures = {
        "rounds": rounds,
        "entry": {name: [calls / timed_steps, spent / calls * 1e6 if calls else 0.0]
                  for name, (calls, spent) in counts.items()},
    }
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        print("ddp-phases " + json.dumps(gathered), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def summarize(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Medians over rounds of the ranks' mean phase times; entry points averaged over ranks."""
    out: dict[str, Any] = {"ranks": len(ranks), "rounds": args.rounds,
                           "block_steps": args.block_steps,
                           "trace_every": os.environ.get("TRACEHOUND_DDP_TRACE_EVERY",
                                                         str(DEFAULT_DDP_TRACE_EVERY))}
    per_model: dict[str, dict[str, float]] = {}
    for kind in ("traced", "plain"):
        per_model[kind] = {
            phase: statistics.median(
                statistics.fmean(r["rounds"][i][kind][j] for r in ranks)
                for i in range(args.rounds)
            )
            for j, phase in enumerate(PHASES)
        }
    out["phase_us"] = {k: {p: round(v, 1) for p, v in d.items()} for k, d in per_model.items()}
    diffs = [
        {phase: statistics.fmean(r["rounds"][i]["traced"][j] - r["rounds"][i]["plain"][j]
                                 for r in ranks)
         for j, phase in enumerate(PHASES)}
        for i in range(args.rounds)
    ]
    out["traced_minus_plain_us"] = {
        phase: round(statistics.median(d[phase] for d in diffs), 1) for phase in PHASES
    }
    out["traced_minus_plain_step_us"] = round(
        statistics.median(sum(d.values()) for d in diffs), 1)
    names = ranks[0]["entry"].keys()
    out["entry_us"] = {
        name: {"calls_per_step": round(statistics.fmean(r["entry"][name][0] for r in ranks), 3),
               "us_per_call": round(statistics.fmean(r["entry"][name][1] for r in ranks), 1)}
        for name in names
    }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    from overhead import instrumented, job_env

    script = [str(Path(__file__).resolve()), "--worker", "--rounds", str(args.rounds),
              "--block-steps", str(args.block_steps), "--warmup-steps", str(args.warmup_steps),
              "--width", str(args.width), "--batch", str(args.batch)]
    print(f"ddp_phases: {args.ranks} ranks, {args.rounds} rounds of {args.block_steps} steps "
          "per model...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="th-phases-") as tmp:
        out, err = instrumented(script, job="ddp-phases", ranks=args.ranks, workdir=Path(tmp),
                                env=job_env(), timeout_s=1800)
    line = next((ln for ln in out.splitlines() if ln.startswith("ddp-phases ")), None)
    if line is None:
        print(f"ddp_phases: the job printed no figures\n{err[-3000:]}", file=sys.stderr)
        return 1
    result = summarize(json.loads(line.removeprefix("ddp-phases ")), args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['ranks']} ranks, TRACEHOUND_DDP_TRACE_EVERY={result['trace_every']}, "
          f"median of {args.rounds} rounds of {args.block_steps} steps")
    for kind, phases in result["phase_us"].items():
        print(f"  {kind:7s} " + "  ".join(f"{p} {v:8.1f} us" for p, v in phases.items()))
    print("  traced - plain: " + "  ".join(
        f"{p} {v:+.1f} us" for p, v in result["traced_minus_plain_us"].items())
        + f"  (a step {result['traced_minus_plain_step_us']:+.1f} us)")
    print("  recorder entry points on the training thread (wall time per call, calls a step):")
    for name, e in result["entry_us"].items():
        print(f"    {name:28s} {e['us_per_call']:7.1f} us x {e['calls_per_step']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
