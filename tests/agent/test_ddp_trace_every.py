"""DDP's gradient all-reduces recorded one training step in N (TRACEHOUND_DDP_TRACE_EVERY): a real
one-rank gloo DDP model in a child process (a process group of its own, kept out of pytest's
process), the recorder's own hooks, an in-memory sink."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tracehound.agent.rank import autoinstall
from tracehound.tracing.settings import SettingError

CHILD = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch, torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from tracehound.agent.rank import hooks
    from tracehound.agent.rank.recorder import Recorder

    class Sink:
        def __init__(self):
            self.items = []
        def offer(self, item):
            self.items.append(item)
            return True
        def flush(self, timeout):
            return True

    def buckets(sink):
        return [i for i in sink.items if isinstance(i, tuple) and not i[1].endswith(":ddp")]

    every = int(sys.argv[1])
    sink = Sink()
    rec = Recorder(job="j", attempt=0, node="n0", rank=0, sink=sink)
    hooks.install_ddp(rec, every=every)
    handle = hooks.install_optimizer(rec)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                        nn.Linear(256, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = DistributedDataParallel(net, bucket_cap_mb=0.25)
    x = torch.randn(8, 256)
    per_step, losses = [], []
    for step in range(int(sys.argv[2])):
        before = len(buckets(sink))
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        rec.settle()
        per_step.append(len(buckets(sink)) - before)
        losses.append(loss.item())
    seqs = [i[2] for i in buckets(sink)]
    counted = [i[2] for i in sink.items if isinstance(i, tuple) and i[1].endswith(":ddp")]
    print(json.dumps({"per_step": per_step, "seqs": seqs, "losses": losses, "counted": counted,
                      "errors": rec.errors}), flush=True)
    os._exit(0)
""")


def run_child(every: int, steps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(every), str(steps)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_buckets_are_recorded_one_step_in_n_and_training_is_unchanged() -> None:
    every_step = run_child(1, 8)
    one_in_three = run_child(3, 8)
    assert every_step["errors"] == 0 and one_in_three["errors"] == 0
    # every step records its buckets (more than one: 0.25 MB buckets of a 0.5 MB model)
    assert all(n >= 2 for n in every_step["per_step"][2:]), every_step
    # steps 0, 3 and 6 only, as many buckets as when every step is recorded
    counts = one_in_three["per_step"]
    assert [i for i, n in enumerate(counts) if n] == [0, 3, 6], counts
    assert counts[3] == every_step["per_step"][3] and counts[6] == every_step["per_step"][6]
    # the recorded ones take consecutive sequence ids of the group
    assert one_in_three["seqs"] == list(range(1, len(one_in_three["seqs"]) + 1))
    # when not all are recorded every step is also one `ddp_comm` of `0:ddp`, its id the count
    # of DDP's ops so far (rising by the step's buckets)
    assert every_step["counted"] == []
    assert len(one_in_three["counted"]) == 8
    assert one_in_three["counted"] == sorted(set(one_in_three["counted"]))
    # switching groups between steps changes nothing the model computes (one rank: the
    # all-reduce is the identity, so this checks the switch, not the sums)
    assert one_in_three["losses"] == pytest.approx(every_step["losses"], rel=1e-6)


def test_with_zero_no_bucket_is_recorded_and_every_step_is_counted() -> None:
    every_step = run_child(1, 6)
    never = run_child(0, 6)
    assert never["errors"] == 0
    # DDP's C++ path on every step, the first too: nothing recorded bucket by bucket
    assert never["per_step"] == [0] * 6 and never["seqs"] == []
    # each step one `ddp_comm` of `0:ddp`, its id rising by the step's buckets
    assert len(never["counted"]) == 6
    # (from the third step on: DDP rebuilds its buckets after the first)
    steps = [b - a for a, b in zip(never["counted"][1:], never["counted"][2:], strict=False)]
    assert steps == [every_step["per_step"][3]] * 4, (never, every_step)
    assert never["losses"] == pytest.approx(every_step["losses"], rel=1e-6)


def test_a_bad_trace_every_is_refused_naming_the_variable(tmp_path: Path) -> None:
    for bad in ("-1", "often"):
        with pytest.raises(SettingError, match="TRACEHOUND_DDP_TRACE_EVERY"):
            autoinstall._ddp_trace_every({"TRACEHOUND_DDP_TRACE_EVERY": bad})
    assert autoinstall._ddp_trace_every({}) == 0
    assert autoinstall._ddp_trace_every({"TRACEHOUND_DDP_TRACE_EVERY": "16"}) == 16
    assert autoinstall._ddp_trace_every({"TRACEHOUND_DDP_TRACE_EVERY": "0"}) == 0
