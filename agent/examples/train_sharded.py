"""Sharded training job: an MLP sharded with FSDP2 (`fully_shard`) or tensor parallelism, on gloo.

Launched once per rank with torchrun's environment. It trains the way such jobs do: FSDP2 layouts
all-gather each layer's parameters and reduce-scatter its gradients (torch.distributed
collectives), clip the gradient norm every step (`clip_grad_norm_` over DTensor gradients: a
functional all_reduce), and checkpoint with torch.distributed.checkpoint through the Tracehound
helper; the tensor-parallel layout (`parallelize_module` with ColwiseParallel / RowwiseParallel)
communicates through functional collectives only. Its only Tracehound import is the checkpoint
helper (the recorder is auto-installed).

    --layout fsdp   every linear layer and the whole model `fully_shard`ed over all ranks
    --layout tp     one tensor-parallel group of all ranks

Faults for tests and demos: `--stop POINT` stops rank --stop-rank with SIGSTOP (as an operator's
`kill -STOP`, or a machine that freezes) in the attempt the point is given
for (`POINT` or `POINT@ATTEMPT`, repeatable), at one of:

    forward      before the forward pass
    all_gather   inside an FSDP all-gather: issued, not yet waited for
    clip         inside clip_grad_norm_, before its all_reduce
    optim        in the optimizer step
    untraced     before an all_reduce that every step also makes through a process group's own
                 method (`--untraced-group`): no recorder hook sees that group's collectives

Before it stops, the rank writes the time to --stop-log DIR/stop-<attempt>.json.
`--mute ATTEMPT` turns rank --stop-rank's recorder off before its process group exists in that
attempt: nothing of it reaches its node agent (a recorder that never reached the agent, as a
rank handed to a new process once did), so only what the agent sees from outside is known.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tracehound.agent import checkpoint

POINTS = ("forward", "all_gather", "clip", "optim", "untraced")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["fsdp", "tp"], default="fsdp")
    parser.add_argument("--steps", type=int, default=200, help="train until this step")
    parser.add_argument("--checkpoint-every", type=int, default=20, help="0: never")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--step-sleep-ms", type=float, default=0.0)
    parser.add_argument("--pg-timeout-s", type=float, default=300.0)
    parser.add_argument("--print-every", type=int, default=20)
    parser.add_argument("--untraced-group", action="store_true",
                        help="also all-reduce every step through a process group's own method")
    parser.add_argument("--stop", action="append", default=[], metavar="POINT[@ATTEMPT]",
                        help=f"stop a rank with SIGSTOP at one of {', '.join(POINTS)}")
    parser.add_argument("--stop-rank", type=int, default=1)
    parser.add_argument("--stop-step", type=int, default=10,
                        help="steps after the attempt's first one (default 10)")
    parser.add_argument("--stop-log", type=Path, default=None)
    parser.add_argument("--mute", type=int, action="append", default=[], metavar="ATTEMPT",
                        help="rank --stop-rank records nothing in this attempt (repeatable)")
    args = parser.parse_args(argv)
    args.stops = {}
    for spec in args.stop:
        point, _, at = spec.partition("@")
        if point not in POINTS:
            parser.error(f"--stop {spec!r}: the point must be one of {', '.join(POINTS)}")
        try:
            args.stops[int(at or 0)] = point
        except ValueError:
            parser.error(f"--stop {spec!r}: the attempt after @ must be a number")
    return args


def attempt() -> int:
    raw = os.environ.get("TRACEHOUND_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(raw) if raw else 0


class Stopper:
    """Stops this rank at its point of its attempt, once."""

    def __init__(self, args: argparse.Namespace, rank: int) -> None:
        self.point = args.stops.get(attempt(), "") if rank == args.stop_rank else ""
        self.step = args.stop_step
        self.log: Path | None = args.stop_log
        self.now = -1

    def at(self, point: str) -> None:
        if point != self.point or self.now != self.step:
            return
        self.point = ""
        if self.log is not None:
            self.log.mkdir(parents=True, exist_ok=True)
            (self.log / f"stop-{attempt()}.json").write_text(json.dumps(
                {"point": point, "step": self.step, "attempt": attempt(), "time": time.time()}))
        print(f"rank {dist.get_rank()}: stopping itself (SIGSTOP) at {point}, step {self.step}",
              flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def mute_recorder() -> None:
    """Turn this process's recorder off for good (before its process group exists, it has sent
    nothing yet)."""
    from tracehound.agent.rank import autoinstall

    recorder = autoinstall.recorder()
    if recorder is not None:
        recorder.disable()
    print(f"rank {os.environ.get('RANK')}: recorder muted in attempt {attempt()}", flush=True)


def hook_points(stopper: Stopper, optimizer: torch.optim.Optimizer) -> None:
    """Where the stops can land: around FSDP's all-gather (looked up on torch.distributed at
    every call), DTensor's norm reduction inside clip_grad_norm_, and the optimizer step."""
    gather: Callable[..., Any] = dist.all_gather_single

    def all_gather_single(*args: Any, **kwargs: Any) -> Any:
        work = gather(*args, **kwargs)
        stopper.at("all_gather")
        return work

    dist.all_gather_single = all_gather_single
    norm: Any
    try:  # the placement of a norm's partial sums (torch 2.13); else any partial's reduction
        from torch.distributed.tensor._ops._math_ops import _NormPartial as norm
    except ImportError:
        from torch.distributed.tensor.placement_types import Partial as norm
    reduce_value = norm._reduce_value

    def _reduce_value(self: Any, *args: Any, **kwargs: Any) -> Any:
        stopper.at("clip")
        return reduce_value(self, *args, **kwargs)

    norm._reduce_value = _reduce_value
    optimizer.register_step_pre_hook(lambda *_: stopper.at("optim"))


def build(args: argparse.Namespace, world: int) -> nn.Module:
    torch.manual_seed(0)
    width = args.width
    if args.layout == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        model = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    from torch.distributed.fsdp import fully_shard

    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def batch_for(step: int, rank: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic data, a function of (step, rank) so that a resumed run sees the same; every
    rank of a tensor-parallel group takes the same batch."""
    seed = step * 1009 + (0 if args.layout == "tp" else rank)
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(seed))
    out = args.width if args.layout == "tp" else 1
    return x, x[:, :out].sin()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if attempt() in args.mute and int(os.environ.get("RANK", "0")) == args.stop_rank:
        mute_recorder()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args, world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    stopper = Stopper(args, rank)
    hook_points(stopper, optimizer)
    side = dist.new_group(list(range(world))) if args.untraced_group else None
    loss_fn = nn.MSELoss()

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    start = 0
    if args.checkpoint_every > 0 and os.environ.get("TRACEHOUND_CHECKPOINT_DIR"):
        loaded = state()
        resumed = checkpoint.load(loaded)
        if resumed is not None:
            set_state_dict(model, optimizer, model_state_dict=loaded["model"],
                           optim_state_dict=loaded["optim"])
            start = resumed
            print(f"rank {rank}/{world}: resumed from step {start}", flush=True)
    stopper.step += start

    for step in range(start, args.steps):
        stopper.now = step
        x, y = batch_for(step, rank, args)
        optimizer.zero_grad()
        stopper.at("forward")
        loss = loss_fn(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm)
        optimizer.step()
        if side is not None:
            stopper.at("untraced")
            side.allreduce([torch.ones(4)]).wait()  # the group's own method: no hook sees it
        if args.step_sleep_ms > 0:
            time.sleep(args.step_sleep_ms / 1000.0)
        done = step + 1
        if args.print_every > 0 and done % args.print_every == 0:
            total = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            print(f"rank {rank}/{world}: step {done} loss {float(loss.item()):.4f} "
                  f"grad norm {float(total):.4f}", flush=True)
        if (args.checkpoint_every > 0 and done % args.checkpoint_every == 0
                and os.environ.get("TRACEHOUND_CHECKPOINT_DIR")):
            checkpoint.save(state(), done)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}/{world}: finished at step {args.steps}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
