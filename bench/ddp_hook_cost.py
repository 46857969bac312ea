"""What a Python comm hook costs DDP by itself, without Tracehound: one torchrun job, no recorder.

Every rank builds identical DDP models that differ only in how their gradient bucket is
all-reduced, and trains them in alternating blocks of 100 steps, timing forward, backward (which
includes waiting for the all-reduce) and the optimizer step:

- builtin: DDP's own C++ all-reduce (no hook);
- python_hook: torch's `default_hooks.allreduce_hook`;
- sync_hook: a Python hook that all-reduces synchronously and returns a completed future (no
  callback on gloo's thread);
- direct_hook: a Python hook that calls the process group's `allreduce` directly (no c10d Python
  layer), with the one `then` callback DDP needs.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        bench/ddp_hook_cost.py [--width 64] [--pairs 20]

Rank 0 prints each variant's median step time and its parts (ms per step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

STEPS = 100


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=20, help="rounds of blocks (default 20)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group: Any = dist.group.WORLD
    sum_op = dist.AllreduceOptions()
    sum_op.reduceOp = dist.ReduceOp.SUM

    def first(fut):  # type: ignore[no-untyped-def]
        return fut.value()[0]

    # DDP checks a hook's annotations against its own types: these carry none
    def sync_hook(state, bucket):  # type: ignore[no-untyped-def]
        tensor = bucket.buffer()
        tensor.div_(world)
        dist.all_reduce(tensor)
        done: Any = torch.futures.Future()
        done.set_result(tensor)
        return done

    def direct_hook(state, bucket):  # type: ignore[no-untyped-def]
        tensor = bucket.buffer()
        tensor.div_(world)
        return group.allreduce([tensor], sum_op).get_future().then(first)

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(),
                             nn.Linear(args.width, 1))

    hooks = {"builtin": None, "python_hook": default_hooks.allreduce_hook,
             "sync_hook": sync_hook, "direct_hook": direct_hook}
    models: dict[str, Any] = {}
    for name, hook in hooks.items():
        models[name] = DistributedDataParallel(net())
        if hook is not None:
            models[name].register_comm_hook(None, hook)
    optimizers = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    x = torch.randn(32, args.width)
    y = x.sum(dim=1, keepdim=True).sin()
    loss_fn = nn.MSELoss()

    def block(name: str, steps: int) -> tuple[float, float, float]:
        model, optimizer = models[name], optimizers[name]
        forward = backward = step = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            t1 = time.perf_counter()
            optimizer.zero_grad()
            loss.backward()
            t2 = time.perf_counter()
            optimizer.step()
            t3 = time.perf_counter()
            forward, backward, step = forward + t1 - t0, backward + t2 - t1, step + t3 - t2
        return forward, backward, step

    names = list(models)
    for name in names:
        block(name, STEPS // 2)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for i in range(args.pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(block(name, STEPS))
    if rank == 0:
        per_step = 1000.0 / STEPS
        base = statistics.median(sum(b) for b in times["builtin"])
        for name, blocks in times.items():
            total = statistics.median(sum(b) for b in blocks)
            parts = [statistics.median(b[j] for b in blocks) * per_step for j in range(3)]
            print(f"{name:12s} {total * per_step:.3f} ms/step ({total / base:.3f} x builtin): "
                  f"forward {parts[0]:.3f}, backward {parts[1]:.3f}, step {parts[2]:.3f}",
                  flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
