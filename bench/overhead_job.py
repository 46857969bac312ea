"""The job bench/overhead.py times: tracing on and off, interleaved, inside one DDP job.

Run once per rank by torchrun under `tracehound instrument` (the recorder auto-installed in every
rank, a node agent shipping to the store). Every rank builds three identical models (same seed,
same layers, same data) that differ only in how their gradient buckets are all-reduced:

- `traced`: DDP's reducer all-reduces through the recorder's process group (a Python subclass of
  c10d's ProcessGroup forwarding to the real one), every bucket recorded and shipped;
- `hook`: built inside `hooks.untraced_ddp()` with torch's own Python `allreduce_hook`, whose
  `dist.all_reduce` is the recorder's wrapped one: every bucket recorded, the way Tracehound
  traced DDP through a Python comm hook before (DDP divides the bucket in a pass of its own and
  holds the GIL to call the hook and read its result);
- `plain`: built inside `hooks.untraced_ddp()`, DDP's own C++ all-reduce, nothing recorded.

It trains them in blocks of --block-steps steps, round by round, each round in one of the six
orders of the three (so the machine's drift and the order hit all alike), and times every block
(wall and this process's CPU). Rank 0 prints one line, `overhead-blocks {json}`, with every
rank's block times.

What this leaves out, by construction: the node agent and the store keep running through every
block (they are the same processes), so their work on a traced block's records that spills
into the next block counts against that one; the heartbeats and the optimizer-step hook run in
all. `bench/overhead.py --separate-jobs N` measures the whole cost instead, with separate traced
and untraced jobs.

With --control the `traced` model is plain too: its ratio to `plain` is the noise floor.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

_KEPT_WORKS: list[Any] = []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15,
                        help="rounds (one block of each model per round)")
    parser.add_argument("--block-steps", type=int, default=120, help="steps per block")
    parser.add_argument("--warmup-steps", type=int, default=60, help="per model, not timed")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--layers", type=int, default=1,
                        help="hidden Linear+ReLU layers of width --width before the output one")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP's bucket_cap_mb (25 is DDP's own default)")
    parser.add_argument("--step-times", action="store_true",
                        help="also report each step's wall time")
    parser.add_argument("--control", action="store_true",
                        help="the `traced` model untraced too (the noise floor)")
    return parser.parse_args(argv)


def start(script: str) -> tuple[int, int] | None:
    """Join the job's gloo group; (rank, world size), or None (said on stderr) when the recorder
    is not installed in this rank. `script` names the caller in the message."""
    from tracehound.agent.rank import autoinstall

    dist.init_process_group("gloo")
    if autoinstall.recorder() is None:
        print(f"{script}: the tracehound recorder is not installed in this rank "
              "(run it under `tracehound instrument`)", file=sys.stderr, flush=True)
        return None
    return dist.get_rank(), dist.get_world_size()


def net(width: int, layers: int = 1) -> nn.Module:
    """The timed model, the same weights every time: `layers` hidden Linear+ReLU of `width`,
    then one output."""
    torch.manual_seed(0)
    hidden = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
    return nn.Sequential(*hidden, nn.Linear(width, 1))


def optimizers(models: Mapping[str, nn.Module]) -> dict[str, torch.optim.Optimizer]:
    return {kind: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
            for kind, m in models.items()}


def batch(rank: int, width: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's one batch (inputs, targets), trained on at every step."""
    x = torch.randn(size, width, generator=torch.Generator().manual_seed(rank))
    return x, x.sum(dim=1, keepdim=True).sin()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from tracehound.agent.rank import hooks

    started = start("overhead_job")
    if started is None:
        return 2
    rank, world = started

    def ddp(module: nn.Module, group: Any = None) -> DistributedDataParallel:
        return DistributedDataParallel(module, bucket_cap_mb=args.bucket_cap_mb,
                                       process_group=group)

    # the models all-reduce on process groups of their own (same ranks): where DDP's traffic
    # is counted rather than recorded (TRACEHOUND_DDP_TRACE_EVERY), the traced model's group
    # then counts its own steps only, as in a job with one model
    everyone = list(range(world))
    hook_group, plain_group = dist.new_group(everyone), dist.new_group(everyone)

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if args.control:
        with hooks.untraced_ddp():
            traced = ddp(net(args.width, args.layers))
    else:
        traced = ddp(net(args.width, args.layers))
    with hooks.untraced_ddp():
        hooked = ddp(net(args.width, args.layers), hook_group)
        hooked.register_comm_hook(hook_group, default_hooks.allreduce_hook)
        plain = ddp(net(args.width, args.layers), plain_group)
    if (getattr(traced, "_tracehound_reducer", None) is None) != args.control:
        print("overhead_job: the traced model's all-reduces are not traced",
              file=sys.stderr, flush=True)
        return 2
    if any(getattr(m, "_tracehound_reducer", None) is not None for m in (hooked, plain)):
        print("overhead_job: an untraced model's all-reduces are traced", file=sys.stderr,
              flush=True)
        return 2
    models = {"traced": traced, "hook": hooked, "plain": plain}
    optimizer_of = optimizers(models)
    x, y = batch(rank, args.width, args.batch)
    loss_fn = nn.MSELoss()

    def block(kind: str, steps: int) -> tuple[Any, ...]:
        """(wall s, CPU s of this process) of `steps` steps of model `kind`, and with
        --step-times each step's wall time in us."""
        model, optimizer = models[kind], optimizer_of[kind]
        start, cpu = time.perf_counter(), time.process_time()
        marks = [start] if args.step_times else None
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            optimizer.step()
            if marks is not None:
                marks.append(time.perf_counter())
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        if marks is None:
            return wall, cpu
        return wall, cpu, [round((b - a) * 1e6) for a, b in itertools.pairwise(marks)]

    for kind in models:
        block(kind, args.warmup_steps)
    orders = list(itertools.permutations(models))
    rounds: list[dict[str, tuple[Any, ...]]] = []
    for i in range(args.rounds):
        rounds.append({kind: block(kind, args.block_steps) for kind in orders[i % len(orders)]})
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, rounds)
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
