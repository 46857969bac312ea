"""Demo training job: a small MLP on synthetic data, DDP over gloo, checkpoints, injected faults.

Launched once per rank with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...). It knows
nothing about Tracehound's recorder (that is auto-installed); the only Tracehound import is the
checkpoint helper. Faults are injected from inside for tests and demos:

    --fault crash --fault-rank 1 --fault-step 30   rank 1 exits with status 1 before step 30
    --fault hang  ...                              it sleeps forever instead
    --fault slow  ...                              it sleeps --slow-ms extra per step from then on
    --fault mismatch ...                           at that step it broadcasts where the others
                                                   all-reduce the loss (they all hang)
    --fault-in ckpt:0:40@0                         rank 0's checkpoint of step 40 takes
                                                   --slow-checkpoint-s more (slow storage): a
                                                   healthy job's pause, no fault

    --fault-file PREFIX                            a rank that finds PREFIX.<its rank> takes it
                                                   and does what it says: `idle` sleeps forever
                                                   (a stuck loader or lock), from outside

A fault fires only in attempt --fault-attempt (default 0; -1: every attempt), so a restarted job
that resumed from a checkpoint runs on healthy. `--fault-in KIND:RANK:STEP@ATTEMPT` (repeatable)
adds one fault per attempt, e.g. a hang in attempt 0, a crash in attempt 1 and a mismatch in
attempt 2 of one job.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel

from tracehound.agent import checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="train until this step")
    parser.add_argument("--checkpoint-every", type=int, default=25, help="0: never")
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="in-memory snapshots every N steps, persisted to disk in the "
                             "background at --checkpoint-every instead of a synchronous save "
                             "(0: off)")
    parser.add_argument("--pg-timeout-s", type=float, default=60.0)
    parser.add_argument("--step-sleep-ms", type=float, default=0.0)
    parser.add_argument("--print-every", type=int, default=10)
    parser.add_argument(
        "--fault", choices=["none", "crash", "hang", "slow", "mismatch"], default="none"
    )
    parser.add_argument("--sync-loss-every", type=int, default=10,
                        help="all-reduce the loss for logging every N steps (0: never)")
    parser.add_argument("--fault-rank", type=int, default=0)
    parser.add_argument("--fault-step", type=int, default=0)
    parser.add_argument("--fault-attempt", type=int, default=0, help="-1: every attempt")
    parser.add_argument("--fault-in", type=fault_spec, action="append", default=[],
                        metavar="KIND:RANK:STEP@ATTEMPT", help="one more fault (repeatable)")
    parser.add_argument("--fault-file", default="", metavar="PREFIX",
                        help="a rank that finds PREFIX.<rank> removes it and does what it says "
                             "(idle: sleep forever); for faults injected at a time, from outside")
    parser.add_argument("--slow-ms", type=float, default=50.0)
    parser.add_argument("--slow-checkpoint-s", type=float, default=12.0,
                        help="how much longer a ckpt fault's checkpoint takes")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    return parser.parse_args(argv)


def attempt() -> int:
    raw = os.environ.get("TRACEHOUND_ATTEMPT") or os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(raw) if raw else 0


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    attempt: int
    """-1: every attempt."""

    def in_this_attempt(self) -> bool:
        return self.attempt < 0 or attempt() == self.attempt


FAULT_KINDS = ("crash", "hang", "slow", "mismatch", "ckpt")


def fault_spec(text: str) -> Fault:
    """KIND:RANK:STEP@ATTEMPT -> a Fault."""
    where, _, at = text.partition("@")
    parts = where.split(":")
    try:
        kind, rank, step = parts[0], int(parts[1]), int(parts[2])
        number = int(at or 0)
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected KIND:RANK:STEP@ATTEMPT, e.g. crash:2:60@1") from None
    if kind not in FAULT_KINDS or len(parts) != 3:
        raise argparse.ArgumentTypeError(f"{text!r}: KIND is one of {', '.join(FAULT_KINDS)}")
    return Fault(kind, rank, step, number)


def faults(args: argparse.Namespace) -> list[Fault]:
    listed = list(args.fault_in)
    if args.fault != "none":
        listed.append(Fault(args.fault, args.fault_rank, args.fault_step, args.fault_attempt))
    return listed


def faulty(args: argparse.Namespace, rank: int, step: int) -> Fault | None:
    """The configured fault that applies to this rank, at this step, in this attempt."""
    for fault in faults(args):
        if (rank == fault.rank and step >= fault.step and fault.kind != "ckpt"
                and fault.in_this_attempt()):
            return fault
    return None


def sync_loss(args: argparse.Namespace, rank: int, step: int, loss: torch.Tensor) -> float:
    """The loss averaged over ranks, as scripts do for logging; the mismatch fault makes the
    faulty rank call broadcast here while every other rank calls all_reduce."""
    value = loss.detach().clone()
    fault = faulty(args, rank, step)
    if fault is not None and fault.kind == "mismatch" and step == fault.step:
        print(f"rank {rank}: injected mismatch at step {step} (broadcast vs all_reduce)",
              flush=True)
        dist.broadcast(value, src=0)
    else:
        dist.all_reduce(value)
    return float(value.item()) / dist.get_world_size()


def mismatch_at(args: argparse.Namespace, step: int) -> bool:
    """Whether a mismatch fault of this attempt falls on this step (every rank syncs its loss
    there, so that the faulty one's broadcast meets its peers' all_reduce)."""
    return any(f.kind == "mismatch" and f.step == step and f.in_this_attempt()
               for f in faults(args))


def inject(args: argparse.Namespace, rank: int, step: int) -> None:
    """Apply the configured fault if this rank, step and attempt are the chosen ones."""
    fault = faulty(args, rank, step)
    if fault is None:
        return
    if fault.kind == "crash" and step == fault.step:
        print(f"rank {rank}: injected crash at step {step}", flush=True)
        os._exit(1)
    if fault.kind == "hang" and step == fault.step:
        print(f"rank {rank}: injected hang at step {step}", flush=True)
        while True:
            time.sleep(3600)
    if fault.kind == "slow":
        time.sleep(args.slow_ms / 1000.0)


def take_fault_file(prefix: str, rank: int) -> None:
    """Do what a fault file left for this rank says (one stat a step while there is none)."""
    path = f"{prefix}.{rank}"
    if not prefix or not os.path.exists(path):
        return
    try:
        with open(path) as handle:
            kind = handle.read().strip()
        os.unlink(path)
    except OSError:
        return  # taken meanwhile, or not readable: nothing to do
    if kind == "idle":
        print(f"rank {rank}: injected idle (sleeping forever)", flush=True)
        while True:
            time.sleep(3600)
    print(f"rank {rank}: unknown fault {kind!r} in {path}; ignored", flush=True)


def slow_checkpoint(args: argparse.Namespace, rank: int, step: int) -> None:
    """A checkpoint on slow storage: this rank waits on the disk while its peers wait for it in
    the next step's collectives (a `ckpt` fault of this rank, step and attempt)."""
    if any(f.kind == "ckpt" and f.rank == rank and f.step == step and f.in_this_attempt()
           for f in faults(args)):
        print(f"rank {rank}: slow checkpoint at step {step} ({args.slow_checkpoint_s:g} s)",
              flush=True)
        time.sleep(args.slow_checkpoint_s)


def batch_for(step: int, rank: int, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, a function of (step, rank) so a resumed run sees the same."""
    generator = torch.Generator().manual_seed(step * 1009 + rank)
    x = torch.randn(size, width, generator=generator)
    y = x.sum(dim=1, keepdim=True).sin()
    return x, y


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.MSELoss()

    def state() -> dict[str, Any]:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    def snapshot_state() -> dict[str, Any]:
        """The plain state dicts: what a snapshot every step copies (get_state_dict costs
        about 0.2 ms more a step, for what only DCP's resharding needs)."""
        return {"model": model.module.state_dict(), "optim": optimizer.state_dict()}

    start = 0
    checkpoints = os.environ.get("TRACEHOUND_CHECKPOINT_DIR")
    if (args.checkpoint_every > 0 or args.snapshot_every > 0) and checkpoints:
        loaded_state = snapshot_state() if args.snapshot_every > 0 else state()
        resumed = checkpoint.load_from(loaded_state)
        if resumed is not None and args.snapshot_every > 0:
            model.module.load_state_dict(loaded_state["model"])
            optimizer.load_state_dict(loaded_state["optim"])
        elif resumed is not None:
            set_state_dict(
                model, optimizer,
                model_state_dict=loaded_state["model"], optim_state_dict=loaded_state["optim"],
            )
        if resumed is not None:
            start = resumed.step
            print(f"rank {rank}/{world}: resumed from step {start} "
                  f"({resumed.describe()})", flush=True)

    timed_from, timed_at = 0.0, start
    for step in range(start, args.steps):
        if step == start + 1:  # time steady-state steps: the first one warms up
            timed_from, timed_at = time.perf_counter(), step
        inject(args, rank, step)
        take_fault_file(args.fault_file, rank)
        x, y = batch_for(step, rank, args.batch, args.width)
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        done = step + 1
        if args.step_sleep_ms > 0:
            time.sleep(args.step_sleep_ms / 1000.0)
        mismatch_step = mismatch_at(args, step)
        if (args.sync_loss_every > 0 and done % args.sync_loss_every == 0) or mismatch_step:
            mean_loss = sync_loss(args, rank, step, loss)
        else:
            mean_loss = float(loss.item())
        if args.print_every > 0 and done % args.print_every == 0:
            print(f"rank {rank}/{world}: step {done} loss {mean_loss:.4f}", flush=True)
        if start and step == start:  # what a restart benchmark times: training resumed here
            print(f"rank {rank}/{world}: first step after resume at {time.time():.6f}",
                  flush=True)
        persist = args.checkpoint_every > 0 and done % args.checkpoint_every == 0
        if args.snapshot_every > 0 and done % args.snapshot_every == 0 and checkpoints:
            checkpoint.snapshot(snapshot_state(), done, persist=persist)
        elif persist and checkpoints:
            checkpoint.save(state(), done)
        if persist and checkpoints:
            slow_checkpoint(args, rank, done)

    timed = args.steps - timed_at
    if timed_from and timed > 0:
        rate = timed / (time.perf_counter() - timed_from)
        print(f"rank {rank}/{world}: {timed} steps at {rate:.2f} steps/s", flush=True)
    # The final barrier's work stays referenced until the interpreter exits. When the last
    # reference to a gloo work is dropped on gloo's own thread, its destructor there needs the
    # GIL; if this thread meanwhile frees the model (DDP's reducer holds the process group) and
    # so joins gloo's threads while holding the GIL, the process never exits (seen in about 1
    # of 10 short runs, recorder on or off).
    final = dist.barrier(async_op=True)
    final.wait()
    _KEPT_WORKS.append(final)
    dist.destroy_process_group()
    print(f"rank {rank}/{world}: finished at step {args.steps}", flush=True)
    return 0


_KEPT_WORKS: list[Any] = []


if __name__ == "__main__":
    sys.exit(main())
