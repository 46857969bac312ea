"""Write real PyTorch Flight Recorder dumps of a small faulty gloo job (CPU, this machine).

    python tests/golden/fr/make_dumps.py SCENARIO OUTDIR [--world 3] [--culprit 1]
                                         [--format json|pickle] [--prefix NAME]

Scenarios (every rank runs three all_reduces on the default group, and ranks 0 and 1 one on a
group of their own, before the fault):

- hang: the culprit stops itself (SIGSTOP) before the fourth all_reduce; the others block in it
  and dump from a thread after DUMP_AFTER_S. The stopped culprit writes nothing and is killed.
- mismatch: the culprit calls broadcast where the others call all_reduce; everybody blocks and
  dumps from a thread after DUMP_AFTER_S.
- crash: the culprit exits with code 3 before the fourth all_reduce; the others' all_reduce
  fails (connection reset) and they dump in the exception handler, then exit 1.

Dumps are named PREFIX<rank> in OUTDIR (as torch's TORCH_FR_DUMP_TEMP_FILE names them). Prints
one JSON line: the scenario, the ranks' exit codes and each dump file's modification time (git
does not keep file times; the golden tests restore them, because a dump's time is its file's).
Never used by the package itself; tests and the golden files only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

DUMP_AFTER_S = 6.0
"""Longer than `tracehound diagnose`'s default hang threshold (5 s)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = args.rank, args.world
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    out = Path(args.outdir) / f"{args.prefix}{rank}"
    c10d = torch._C._distributed_c10d

    def dump() -> None:
        if args.format == "pickle":
            data = c10d._dump_fr_trace(True, False, False)
        else:
            data = c10d._dump_fr_trace_json(True, False)
        tmp = out.with_name(out.name + ".partial")
        tmp.write_bytes(data)
        tmp.replace(out)

    def dump_and_leave() -> None:
        dump()
        os._exit(0)

    t = torch.ones(256)
    for _ in range(3):
        dist.all_reduce(t)
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.all_reduce(t, group=pair)
    culprit = rank == args.culprit
    if args.scenario == "hang":
        if culprit:
            os.kill(os.getpid(), signal.SIGSTOP)
        threading.Timer(DUMP_AFTER_S, dump_and_leave).start()
        dist.all_reduce(t)
    elif args.scenario == "mismatch":
        threading.Timer(DUMP_AFTER_S, dump_and_leave).start()
        if culprit:
            dist.broadcast(t, src=args.culprit)
        else:
            dist.all_reduce(t)
    elif args.scenario == "crash":
        if culprit:
            os._exit(3)
        try:
            dist.all_reduce(t)
        except RuntimeError:
            dump()
            os._exit(1)
    time.sleep(60)  # the fault keeps everybody here until the dump thread ends the process
    os._exit(2)


def run(scenario: str, outdir: Path, *, world: int = 3, culprit: int = 1, fmt: str = "json",
        prefix: str = "nccl_trace_rank_") -> dict[str, object]:
    """Run one scenario; its exit codes and the dumps' modification times (ns)."""
    outdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, scenario, str(outdir), "--world", str(world), "--culprit",
             str(culprit), "--format", fmt, "--prefix", prefix, "--rank", str(r),
             "--port", str(port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for r in range(world)
    ]
    codes: dict[int, int] = {}
    try:
        for r, p in enumerate(procs):
            if r == culprit and scenario == "hang":
                continue
            codes[r] = p.wait(timeout=120)
    finally:
        for r, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                codes[r] = p.wait()
    files = {f.name: f.stat().st_mtime_ns for f in sorted(outdir.iterdir())
             if f.name.startswith(prefix) and not f.name.endswith(".partial")}
    return {"scenario": scenario, "world": world, "culprit": culprit, "format": fmt,
            "exit_codes": {str(r): c for r, c in sorted(codes.items())}, "files": files}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=["hang", "mismatch", "crash"])
    ap.add_argument("outdir")
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--culprit", type=int, default=1)
    ap.add_argument("--format", choices=["json", "pickle"], default="json")
    ap.add_argument("--prefix", default="nccl_trace_rank_")
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        _rank_main(args)
        return
    print(json.dumps(run(args.scenario, Path(args.outdir), world=args.world,
                         culprit=args.culprit, fmt=args.format, prefix=args.prefix)))


if __name__ == "__main__":
    main()
