"""What tracing a DDP model costs its training process, by part: CPU time per step.

One process, a one-rank gloo group, three identical DDP models trained in alternating blocks of
steps (so the machine's drift hits all alike), timed by this process's CPU time:

- `plain`: DDP's own C++ all-reduce, nothing recorded;
- `forwarding`: the reducer all-reduces through Tracehound's Python subclass of c10d's
  ProcessGroup (`hooks.ddp._reducer_group`) around a stand-in reducer that only forwards to the real
  group: what the route through Python costs by itself (pybind's
  override lookup, the tensors and options handed to Python and back, the GIL taken in the
  backward pass);
- `traced`: Tracehound's own group (`hooks.ddp._trace_ddp`): the same route, plus recording each
  bucket and ending it at the next bucket or optimizer step, shipped by a real transport to a
  real node agent process;
- `counted`: Tracehound's group one step in --every (`TRACEHOUND_DDP_TRACE_EVERY`), the other
  steps on DDP's C++ path and counted (`hooks.ddp._DdpCount`: the forward's start and end, one
  `ddp_comm` event a step). Its optimizer is the lead one, so its steps are the training steps.

A one-rank all-reduce has no peer to wait for, so this measures the work of the training
process (its training thread and the transport's sender thread: CPU time of the process), which
a multi-rank job pays on every rank whatever its network; what it leaves out is the node
agent's own CPU (bench/overhead.py times a 4-rank job whole).

    python bench/ddp_trace_cost.py [--rounds N] [--block-steps S] [--width W] [--layers L]
                                   [--bucket-cap-mb MB] [--every N] [--json]

Prints the median over rounds of each model's CPU per step minus `plain`'s in the same round,
with the rounds' quartiles, and the buckets the traced model recorded per step (a benchmark,
never a test: nothing here gates on time; `buckets_per_step` counts the counted model's
recorded buckets too, on 1/--every of its steps). The cost is per bucket, not per byte:
`--width 512 --layers 4 --bucket-cap-mb 1` (four 1 MB buckets a step) against
`--bucket-cap-mb 25` (one 4 MB bucket) shows it.
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
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from overhead import start_agent, stop_agent


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from tracehound.agent.rank import hooks
    from tracehound.agent.rank.recorder import Recorder
    from tracehound.agent.rank.transport import SocketTransport

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="tracehound-ddpcost-"))
    agent, path = start_agent(tmp)
    try:
        transport = SocketTransport(str(path), bound=1 << 20)
        recorder = Recorder(job="bench", attempt=0, node="n0", rank=0, sink=transport)

        def activate() -> None:
            transport.start()
            recorder.start()

        hooks.install_distributed(recorder, on_group=activate)
        hooks.install_optimizer(recorder)
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0,
                                world_size=1)
        inner = dist.distributed_c10d._get_default_group()

        def net() -> nn.Module:
            torch.manual_seed(0)
            hidden = [m for _ in range(args.layers)
                      for m in (nn.Linear(args.width, args.width), nn.ReLU())]
            return nn.Sequential(*hidden, nn.Linear(args.width, 1))

        models = {kind: DistributedDataParallel(net(), bucket_cap_mb=args.bucket_cap_mb)
                  for kind in KINDS}
        # Tracehound's own group around a stand-in reducer that forwards and records nothing;
        # held: the C++ reducer holds the C++ side only
        forwarding = hooks.ddp._reducer_group(
            dist, SimpleNamespace(inner=inner, allreduce=inner.allreduce))
        models["forwarding"].reducer._update_process_group(forwarding)
        traced = hooks.ddp._trace_ddp(models["traced"], recorder)  # held, as install_ddp does
        models["counted"]._tracehound_reducer = hooks.ddp._trace_ddp(models["counted"], recorder,
                                                                 every=args.every)
        optimizers = {kind: torch.optim.SGD(m.parameters(), lr=0.01)
                      for kind, m in models.items()}
        x = torch.randn(args.batch, args.width)
        y = x.sum(dim=1, keepdim=True).sin()
        loss_fn = nn.MSELoss()

        def block(kind: str, steps: int) -> float:
            model, optimizer = models[kind], optimizers[kind]
            cpu = time.process_time()
            for _ in range(steps):
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(x), y).backward()
                optimizer.step()
            return (time.process_time() - cpu) / steps * 1e6

        group = recorder._group(str(traced.name))
        # the counted model's optimizer steps first: it is the lead one, whose steps are the
        # training steps that switch its buckets between the traced group and the C++ path
        block("counted", 1)
        for kind in KINDS:
            before = group.last_enqueued
            block(kind, args.warmup_steps)
            recorded = group.last_enqueued - before
            if (recorded > 0) != (kind in ("traced", "counted")):
                raise RuntimeError(f"the {kind} model recorded {recorded} all-reduces in "
                                   f"{args.warmup_steps} steps")
        rounds: dict[str, list[float]] = {kind: [] for kind in KINDS}
        before = group.last_enqueued
        for i in range(args.rounds):
            for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
                rounds[kind].append(block(kind, args.block_steps))
        recorded_per_step = (group.last_enqueued - before) / (args.rounds * args.block_steps)
        result: dict[str, Any] = {
            "plain_cpu_us_per_step": round(statistics.median(rounds["plain"]), 2),
            "rounds": args.rounds, "block_steps": args.block_steps, "width": args.width,
            "layers": args.layers, "bucket_cap_mb": args.bucket_cap_mb,
            "buckets_per_step": recorded_per_step,
        }
        for kind in KINDS[1:]:
            diffs = [a - b for a, b in zip(rounds[kind], rounds["plain"], strict=True)]
            q1, _, q3 = statistics.quantiles(diffs, n=4)
            result[f"{kind}_extra_cpu_us_per_step"] = round(statistics.median(diffs), 2)
            result[f"{kind}_extra_iqr"] = [round(q1, 2), round(q3, 2)]
        transport.flush(30.0)
        result["records_sent"] = transport.sent
        result["records_dropped"] = transport.dropped
        return result
    finally:
        stop_agent(agent)


KINDS = ("plain", "forwarding", "traced", "counted")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40,
                        help="rounds, one block of each model per round (default 40)")
    parser.add_argument("--block-steps", type=int, default=200,
                        help="steps per block (default 200)")
    parser.add_argument("--warmup-steps", type=int, default=300,
                        help="per model, not timed (default 300)")
    parser.add_argument("--width", type=int, default=64,
                        help="hidden width (default 64, the model of bench/overhead.py)")
    parser.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    parser.add_argument("--layers", type=int, default=1, help="hidden layers (default 1)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0,
                        help="DDP's bucket_cap_mb (default 25, DDP's own)")
    parser.add_argument("--every", type=int, default=16,
                        help="the counted model's TRACEHOUND_DDP_TRACE_EVERY (default 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:36s} {value}")
    sys.stdout.flush()
    # torch's gloo teardown at exit can hang on a GIL deadlock (see bench/overhead.py); the
    # figures are out
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
