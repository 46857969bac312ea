"""A plain torchrun DDP script (no Tracehound import) whose ranks do real work outside collectives.

    --scenario checkpoint   at --at-step, local rank 0 of node 0 writes a checkpoint for 12 s
                            (torch.save of its state, fsynced, again and again) while the others
                            wait in the next all-reduce
    --scenario eval         at --at-step, rank 0 runs a 12 s evaluation pass (no_grad forwards)
    --scenario first-step   rank --rank's first step is 10 s slower (CPU work, like compilation)
    --scenario dataload     at --at-step, rank --rank waits 12 s for its next batch
    --scenario deadlock     at --at-step, rank --rank deadlocks on a lock of its own, in attempt 0
                            only (a user-code bug outside collectives)
    --scenario pipeline     two stages with send/recv of a 16 MB activation; at --at-step the
                            last stage stops itself (SIGSTOP from a thread) inside its recv, in
                            attempt 0 only, while the first stage blocks in the matching send

    --stall NAME@RANK:STEP  (repeatable) one of the four stalls above, on that rank at that
                            step, several in one run
    --checkpoint-every N    rank 0 saves a checkpoint every N steps, taking --checkpoint-s
                            seconds (slow storage: a torch.save, then waiting on the disk), the
                            --long-checkpoint-th of them ten times as long: a job's rhythm

Each run ends with "done" on every rank. The stalls last 12 s: with the hang threshold at 5 s a
stall is one for its last 7 s only, and on two shared cores the heartbeats that show it reach
the controller a second or more late.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def busy_for(seconds: float, work: object) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        work()  # type: ignore[operator]


def save_checkpoint(path: Path, state: dict[str, object], seconds: float) -> None:
    """A checkpoint on slow storage: written, then `seconds` in all waiting on the disk."""
    end = time.monotonic() + seconds
    torch.save(state, path)
    time.sleep(max(0.0, end - time.monotonic()))


def train(args: argparse.Namespace, rank: int) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    # the optimizer first: its construction imports ~800 modules of torch (1 s on an idle core,
    # several under load), which would otherwise be the first thing the peers wait on, before
    # the scenario's own work
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = DistributedDataParallel(net)
    ckpt = Path(args.workdir) / f"rank{rank}.pt"
    stalls = list(args.stalls)
    if args.scenario in STALLS:
        rank_of = 0 if args.scenario in ("checkpoint", "eval") else args.rank
        at = 0 if args.scenario == "first-step" else args.at_step
        stalls.append((args.scenario, rank_of, at))
    mine = {(name, at) for name, who, at in stalls if who == rank}
    for step in range(args.steps):
        if ("first-step", step) in mine:
            a = torch.randn(256, 256)
            busy_for(10.0, lambda a=a: a @ a)
        if ("dataload", step) in mine:
            time.sleep(12.0)  # the loader waits on storage
        if args.scenario == "deadlock" and step == args.at_step and rank == args.rank and (
            attempt() == 0
        ):
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns
        x = torch.randn(32, 64)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(0.02)
        if ("checkpoint", step) in mine:
            state = {"model": model.state_dict(), "opt": opt.state_dict(),
                     "pad": torch.randn(2_000_000)}

            def write(state: dict[str, object] = state) -> None:
                with open(ckpt, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())

            busy_for(12.0, write)
        every = args.checkpoint_every
        if rank == 0 and every and (step + 1) % every == 0:
            n = (step + 1) // every
            save_checkpoint(ckpt, {"model": model.state_dict(), "step": step},
                            args.checkpoint_s * (10 if n == args.long_checkpoint else 1))
        if ("eval", step) in mine:
            with torch.no_grad():
                batch = torch.randn(512, 64)
                busy_for(12.0, lambda batch=batch: model.module(batch))


def pipeline(args: argparse.Namespace, rank: int) -> None:
    act = torch.zeros(4_000_000)
    for step in range(args.steps):
        if rank == 0:
            time.sleep(0.05 if step != args.at_step else 1.0)
            act.fill_(float(step))
            dist.send(act, dst=1)
            grad = torch.zeros(1)
            dist.recv(grad, src=1)
        else:
            if step == args.at_step and attempt() == 0:
                threading.Thread(target=lambda: (time.sleep(0.3),
                                                 os.kill(os.getpid(), signal.SIGSTOP)),
                                 daemon=True).start()
            dist.recv(act, src=0)
            dist.send(torch.ones(1) * act[0], dst=0)


STALLS = ("checkpoint", "eval", "first-step", "dataload")


def stall(spec: str) -> tuple[str, int, int]:
    """NAME@RANK:STEP -> (name, rank, step)."""
    name, _, where = spec.partition("@")
    rank, _, step = where.partition(":")
    if name not in STALLS or not rank.isdigit() or not step.isdigit():
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME@RANK:STEP, NAME one of "
                                         f"{', '.join(STALLS)}")
    return name, int(rank), int(step)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="stalls",
                        choices=[*STALLS, "deadlock", "pipeline", "stalls"])
    parser.add_argument("--stall", type=stall, action="append", default=[], dest="stalls",
                        metavar="NAME@RANK:STEP")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--at-step", type=int, default=30)
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--workdir", default=".")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N")
    parser.add_argument("--checkpoint-s", type=float, default=3.0)
    parser.add_argument("--long-checkpoint", type=int, default=0, metavar="K")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    if args.scenario == "pipeline":
        pipeline(args, rank)
    else:
        train(args, rank)
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
