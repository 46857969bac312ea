"""The job bench/overhead.py times: tracing on and off, interleaved, inside one DDP job.

Run once per rank by torchrun under `tracehound instrument` (the recorder auto-installed in every
rank, a node agent shipping to the store). Every rank builds two identical models (same seed,
same layers, same data): `traced`, whose gradient all-reduce goes through the recorder's comm
hook and whose every bucket is recorded and shipped, and `plain`, built inside
`hooks.untraced_ddp()`, which keeps DDP's own C++ all-reduce and records nothing. It then trains
them in alternating blocks of --block-steps steps, pair by pair (traced then plain, plain then
traced, ...), so the machine's drift hits both alike, and times every block. Rank 0 prints one
line, `overhead-blocks {json}`, with every rank's block times.

What this leaves out, by construction: the node agent and the store keep running in both
blocks (they are the same processes), so their work on a traced block's records that spills
into the next plain block counts against the plain one; the heartbeats and the optimizer-step
hook run in both. `bench/overhead.py --separate-jobs N` measures the whole cost instead, with
separate traced and untraced jobs.

With --control both models are plain: the ratio it gives is the noise floor of the comparison.
With --control --python-hook the first one is untraced but runs torch's own Python
`allreduce_hook`: what any Python comm hook costs by itself (DDP holds the GIL three times per
bucket for one: to call it, for its completion callback on gloo's thread, and to read its result).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_KEPT_WORKS: list[Any] = []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=15, help="traced/plain block pairs")
    parser.add_argument("--block-steps", type=int, default=120, help="steps per block")
    parser.add_argument("--warmup-steps", type=int, default=60, help="per model, not timed")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--control", action="store_true", help="both models untraced")
    parser.add_argument("--python-hook", action="store_true",
                        help="with --control: the first model untraced but with torch's own "
                             "Python allreduce_hook (what a Python comm hook costs by itself)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tracehound.agent import autoinstall, hooks

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if autoinstall.recorder() is None:
        print("overhead_job: the tracehound recorder is not installed in this rank "
              "(run it under `tracehound instrument`)", file=sys.stderr, flush=True)
        return 2

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                             nn.Linear(args.width, 1))

    if args.control:
        with hooks.untraced_ddp():
            traced = DistributedDataParallel(net())
        if args.python_hook:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            traced.register_comm_hook(None, default_hooks.allreduce_hook)
    else:
        traced = DistributedDataParallel(net())
    with hooks.untraced_ddp():
        plain = DistributedDataParallel(net())
    if (getattr(traced, "_tracehound_trampoline", None) is None) != args.control:
        print("overhead_job: the traced model did not get the recorder's comm hook",
              file=sys.stderr, flush=True)
        return 2
    if getattr(plain, "_tracehound_trampoline", None) is not None:
        print("overhead_job: the plain model got the recorder's comm hook", file=sys.stderr,
              flush=True)
        return 2
    models = {True: traced, False: plain}
    optimizers = {on: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
                  for on, m in models.items()}
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    loss_fn = nn.MSELoss()

    def block(on: bool, steps: int) -> float:
        model, optimizer = models[on], optimizers[on]
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
        return time.perf_counter() - start

    block(True, args.warmup_steps)
    block(False, args.warmup_steps)
    pairs: list[tuple[float, float]] = []
    for i in range(args.pairs):
        seconds: dict[bool, float] = {}
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            seconds[on] = block(on, args.block_steps)
        pairs.append((seconds[True], seconds[False]))
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, pairs)
    if rank == 0:
        print("overhead-blocks " + json.dumps({
            "ranks": gathered, "block_steps": args.block_steps, "control": args.control,
        }), flush=True)
    # keep the last work until exit: see the teardown note in agent/examples/train_ddp.py
    final = dist.barrier(async_op=True)
    final.wait()
    _KEPT_WORKS.append(final)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
