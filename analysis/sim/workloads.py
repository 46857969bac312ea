"""What the simulated job runs: a Megatron-style GPT training step under a GPipe schedule.

Per micro-batch and pipeline stage: `recv` from the previous stage, compute, a TP `all_reduce`,
compute, a TP `all_reduce` (forward), then the same backwards with gradients flowing to the
previous stage; then the DP gradient `all_reduce`s (one per bucket) and a world `all_reduce` of
the overflow flag before the optimizer step. Sizes and compute times are drawn per scenario
(`draw_workload`); the stack frames say where in Megatron's code py-spy finds a rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracehound.analysis.sim.engine import Engine
from tracehound.analysis.sim.topology import Family, Topology
from tracehound.tracing.summaries import F64


@dataclass(frozen=True, slots=True)
class Workload:
    """The sizes and times one scenario's training step is built from."""

    fwd_us: float
    """Forward compute of one micro-batch on one stage (backward takes twice as long)."""
    act_bytes: int
    """Activations one stage sends the next per micro-batch."""
    tp_bytes: int
    """Bytes of one TP all_reduce event: it stands for the all-reduces of half a stage's layers
    (one event per block of layers keeps the event count down, the total TP time right)."""
    grad_bytes: tuple[int, ...]
    """Bytes of each DP gradient bucket."""
    microbatches: int
    base_step: int
    """The training step the window starts at."""
    jitter: float
    """Sigma of the lognormal noise on every compute segment."""
    spike_p: float
    """Chance of a short pause (a few ms) in any compute segment."""

    def per_step(self) -> dict[Family, int]:
        """How many collectives one step issues in each group of a family."""
        m = self.microbatches
        return {Family.TP: 4 * m, Family.DP: len(self.grad_bytes), Family.P2P: 2 * m,
                Family.WORLD: 1}

    def base_seq(self) -> dict[Family, int]:
        """Per family, the last sequence number issued before the window."""
        return {fam: self.base_step * k for fam, k in self.per_step().items()}

    def seq_at(self, fam: Family, step: int, idx: int) -> int:
        """The sequence number of the `idx`-th collective of `fam` in window step `step`."""
        return self.base_seq()[fam] + step * self.per_step()[fam] + idx + 1

    def estimated_step_us(self, topo: Topology) -> float:
        """A healthy step's duration, before any step has been played."""
        m, pp = self.microbatches, topo.pp
        return (m + pp - 1) * 3.1 * self.fwd_us + _gradient_sync_us(topo, self.grad_bytes)


def _gradient_sync_us(topo: Topology, grad_bytes: tuple[int, ...]) -> float:
    """Ring all_reduce bandwidth time of every gradient bucket at 20 GB/s."""
    return sum(2 * (topo.dp - 1) / topo.dp * g / 20e3 for g in grad_bytes)


def draw_workload(topo: Topology, rng: np.random.Generator,
                  microbatches: int | None = None) -> Workload:
    """A plausible workload for `topo`: a 100..450 ms step, 100..400 M parameters per rank in
    three gradient buckets, TP traffic 6..15% of the compute it interleaves with."""
    tp, pp = topo.tp, topo.pp
    m = microbatches or (4 if topo.ranks <= 256 else 2)
    step_target_us = float(rng.uniform(100_000.0, 450_000.0))
    act = int(rng.choice([2048, 4096])) * int(rng.choice([4096, 5120, 8192])) * 2
    params_per_rank = float(rng.uniform(100e6, 400e6))
    split = rng.dirichlet([4.0, 3.0, 1.5])
    grad = tuple(int(params_per_rank * 2 * x) // 2 * 2 for x in split)
    dp_us = _gradient_sync_us(topo, grad)
    fwd = max(2_000.0, (step_target_us - dp_us) / ((m + pp - 1) * 4.0))
    # 8 ranks on NVLink at 200 GB/s bus bandwidth.
    tp_bytes = int(rng.uniform(0.06, 0.15) * fwd / 2 * 200e3 / (2 * (tp - 1) / tp)) if tp > 1 \
        else 0
    tp_bytes -= tp_bytes % 1024
    return Workload(fwd_us=fwd, act_bytes=act, tp_bytes=tp_bytes, grad_bytes=grad,
                    microbatches=m,
                    base_step=int(rng.integers(200, 20_000)),
                    jitter=float(rng.uniform(0.015, 0.035)), spike_p=2e-4)


# -- one training step ----------------------------------------------------------------------------


def run_step(eng: Engine, w: Workload, est_step_us: float) -> None:
    """One training step of every rank (see the module docstring)."""
    eng.begin_step(est_step_us)
    _forward(eng, w)
    _backward(eng, w)
    _gradient_sync(eng, w)
    _optimizer(eng, w)
    eng.end_step()


def _stage_factor(pp: int) -> F64:
    """Compute multiplier per stage: the last stage holds the loss, a little more work."""
    return np.linspace(1.0, 1.08, pp) if pp > 1 else np.ones(1)


def _tp_reduce(eng: Engine, w: Workload, stage: int) -> None:
    """The TP all_reduce of every replica of `stage` (200 GB/s NVLink bus bandwidth)."""
    tp = eng.topo.tp
    if tp == 1:
        return
    tp_us = 2 * (tp - 1) / tp * w.tp_bytes / 200e3 + 15.0
    layout = eng.layout
    eng.collective(layout.grid[stage], layout.tp_gid[stage], (Family.TP, stage),
                   nbytes=w.tp_bytes, dtype="bfloat16", base_us=np.full(eng.topo.dp, tp_us))


def _p2p_us(w: Workload) -> float:
    """One activation transfer on a 22 GB/s InfiniBand link."""
    return w.act_bytes / 22e3 + 10.0


def _forward(eng: Engine, w: Workload) -> None:
    grid, pp = eng.layout.grid, eng.topo.pp
    stage_factor = _stage_factor(pp)
    for _ in range(w.microbatches):
        for s in range(pp):
            ranks = grid[s].ravel()
            if s > 0:
                eng.p2p(grid[s - 1].ravel(), ranks, eng.layout.p2p_gid[s - 1].ravel(),
                        (Family.P2P, s - 1), nbytes=w.act_bytes, base_us=_p2p_us(w))
            for half in range(2):
                eng.compute(ranks, w.fwd_us / 2 * stage_factor[s], f"forward{half}")
                _tp_reduce(eng, w, s)


def _backward(eng: Engine, w: Workload) -> None:
    grid, pp = eng.layout.grid, eng.topo.pp
    stage_factor = _stage_factor(pp)
    for _ in range(w.microbatches):
        for s in reversed(range(pp)):
            ranks = grid[s].ravel()
            if s < pp - 1:
                eng.p2p(grid[s + 1].ravel(), ranks, eng.layout.p2p_gid[s].ravel(),
                        (Family.P2P, s), nbytes=w.act_bytes, base_us=_p2p_us(w))
            for half in range(2):
                eng.compute(ranks, w.fwd_us * stage_factor[s], f"backward{half}")
                _tp_reduce(eng, w, s)


def _gradient_sync(eng: Engine, w: Workload) -> None:
    """One DP all_reduce per gradient bucket (ring at 20 GB/s plus latency per hop)."""
    topo, layout = eng.topo, eng.layout
    pp, tp, dp = topo.pp, topo.tp, topo.dp
    dp_groups = layout.grid.transpose(0, 2, 1).reshape(pp * tp, dp)
    dp_gids = layout.dp_gid.ravel()
    for nbytes in w.grad_bytes:
        ring = 2 * (dp - 1) / dp * nbytes / 20e3 + 12.0 * math.log2(dp)
        eng.collective(dp_groups, dp_gids, (Family.DP, 0), nbytes=nbytes, dtype="bfloat16",
                       base_us=np.full(pp * tp, ring))


def _optimizer(eng: Engine, w: Workload) -> None:
    """The world all_reduce of the overflow flag, then the optimizer step."""
    ranks = eng.topo.ranks
    world = np.arange(ranks, dtype=np.int64)[None, :]
    eng.collective(world, np.array([eng.layout.world_gid]), (Family.WORLD, 0), nbytes=4,
                   dtype="float32", base_us=np.array([30.0 + 8.0 * math.log2(ranks)]))
    eng.compute(np.arange(ranks, dtype=np.int64), 0.04 * w.fwd_us, "optimizer")


# -- where py-spy finds a rank --------------------------------------------------------------------

_TRAIN = ("train.py:642 <module>", "train.py:598 main",
          "megatron/training/training.py:1177 train",
          "megatron/training/training.py:742 train_step")
_SCHEDULE = "megatron/core/pipeline_parallel/schedules.py:1402 " \
            "forward_backward_pipelining_without_interleaving"
_ALL_REDUCE = ("torch/distributed/c10d_logger.py:81 wrapper",
               "torch/distributed/distributed_c10d.py:2805 all_reduce")
_FRAMES: dict[str, tuple[str, ...]] = {
    "tp_forward": (_SCHEDULE, "megatron/core/pipeline_parallel/schedules.py:275 forward_step",
                   "megatron/core/transformer/transformer_block.py:520 forward",
                   "megatron/core/tensor_parallel/layers.py:1010 forward",
                   "megatron/core/tensor_parallel/mappings.py:36 _reduce", *_ALL_REDUCE),
    "tp_backward": (_SCHEDULE, "megatron/core/pipeline_parallel/schedules.py:381 backward_step",
                    "torch/_tensor.py:626 backward",
                    "torch/autograd/graph.py:823 _engine_run_backward",
                    "megatron/core/tensor_parallel/mappings.py:36 _reduce", *_ALL_REDUCE),
    "recv": (_SCHEDULE, "megatron/core/pipeline_parallel/schedules.py:1289 recv_forward",
             "megatron/core/pipeline_parallel/p2p_communication.py:452 _communicate",
             "megatron/core/pipeline_parallel/p2p_communication.py:289 _p2p_ops",
             "torch/distributed/distributed_c10d.py:2271 recv"),
    "send": (_SCHEDULE, "megatron/core/pipeline_parallel/schedules.py:1301 send_forward",
             "megatron/core/pipeline_parallel/p2p_communication.py:452 _communicate",
             "megatron/core/pipeline_parallel/p2p_communication.py:289 _p2p_ops",
             "torch/distributed/distributed_c10d.py:2226 send"),
    "dp": ("megatron/core/distributed/distributed_data_parallel.py:371 finish_grad_sync",
           "megatron/core/distributed/param_and_grad_buffer.py:512 finish_grad_sync",
           *_ALL_REDUCE),
    "world": ("megatron/core/optimizer/optimizer.py:486 step",
              "megatron/core/optimizer/optimizer.py:431 _unscale_main_grads_and_check_for_nan",
              *_ALL_REDUCE),
    "compute": (_SCHEDULE, "megatron/core/pipeline_parallel/schedules.py:275 forward_step",
                "megatron/core/transformer/transformer_layer.py:398 forward",
                "torch/nn/modules/module.py:1747 _call_impl",
                "megatron/core/transformer/attention.py:619 forward",
                "megatron/core/fusions/fused_softmax.py:191 forward_fused_softmax"),
    "compute_backward": (_SCHEDULE,
                         "megatron/core/pipeline_parallel/schedules.py:381 backward_step",
                         "torch/_tensor.py:626 backward",
                         "torch/autograd/graph.py:823 _engine_run_backward"),
    "optimizer": ("megatron/core/optimizer/optimizer.py:490 step",
                  "megatron/core/optimizer/distrib_optimizer.py:1702 step_with_ready_grads",
                  "torch/optim/adam.py:226 step"),
    "dataloader": ("megatron/training/training.py:702 get_batch",
                   "torch/utils/data/dataloader.py:708 __next__",
                   "torch/utils/data/dataloader.py:1458 _next_data",
                   "torch/utils/data/dataloader.py:1420 _get_data",
                   "torch/utils/data/dataloader.py:1251 _try_get_data",
                   "multiprocessing/queues.py:113 get", "threading.py:359 wait"),
    "storage_read": ("megatron/training/training.py:702 get_batch",
                     "megatron/core/datasets/gpt_dataset.py:216 __getitem__",
                     "megatron/core/datasets/indexed_dataset.py:481 __getitem__",
                     "megatron/core/datasets/indexed_dataset.py:330 read",
                     "fsspec/spec.py:1941 read", "socket.py:720 readinto"),
    "cuda_sync": ("megatron/core/optimizer/optimizer.py:486 step",
                  "megatron/core/optimizer/clip_grads.py:138 get_grad_norm_fp32",
                  "torch/cuda/__init__.py:985 synchronize"),
}
"""The innermost frames at each site of the step (the silent-hang variants are sites too)."""


def stack_frames(site: str, sampled_late: bool) -> tuple[str, ...]:
    """A rank's stack at `site`, outermost first. `sampled_late`: py-spy caught the rank in the
    wrapper around an all_reduce rather than in the call (a benign variant)."""
    inner = _FRAMES[site]
    if sampled_late and inner[-1] == _ALL_REDUCE[-1]:
        inner = inner[:-1]
    return (*_TRAIN, *inner)


def waiting_site(w: Workload, family: int, seq: int, op: str) -> str:
    """The site of a rank waiting in a collective of `family` at sequence number `seq`."""
    if family == Family.TP:
        per_step = w.per_step()[Family.TP]
        idx = (seq - w.base_seq()[Family.TP] - 1) % per_step
        return "tp_forward" if idx < 2 * w.microbatches else "tp_backward"
    if family == Family.P2P:
        return op
    return "dp" if family == Family.DP else "world"


def compute_site(phase: str) -> str:
    """The site of a rank stuck in the compute phase `phase` (as the engine names phases)."""
    if phase.startswith("backward"):
        return "compute_backward"
    return "optimizer" if phase == "optimizer" else "compute"
