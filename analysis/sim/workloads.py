"""What the simulated job runs: one training step of a Megatron, DDP, ZeRO-3 or MoE job.

The kinds (`WORKLOADS`):

- gpipe: Megatron GPT under a GPipe schedule. Per micro-batch and pipeline stage: `recv` from
  the previous stage, compute, a TP `all_reduce`, compute, a TP `all_reduce` (forward), then the
  same backwards with gradients flowing to the previous stage; then the DP gradient
  `all_reduce`s (one per bucket) and a world `all_reduce` before the optimizer step.
- 1f1b, interleaved: the same blocks under Megatron's one-forward-one-backward schedule, plain
  or with `vp` model chunks per rank (activations also wrap from the last stage to the first);
  sends are posted without waiting, a receive waits for its send. Asked for
  (`simulate(combined_p2p=True)`), Megatron's non-batched p2p (`Workload.combined_p2p`): a send
  and the stage's next receive are one call, both recorded complete when it ends.
- moe: 1F1B with an expert parallel `all_to_all_single` before and after the experts of every
  block; every member sends as many bytes as its tokens routed (legitimately uneven sizes), and
  its experts compute as long as the tokens they got.
- ddp: plain data parallel without Megatron groups: forward, then backward with one gradient
  bucket `all_reduce` in the world group issued as each bucket is ready (overlapping the rest
  of the backward), a wait for them all, a loss `all_reduce` and the optimizer.
- zero3: fully sharded data parallel: per block of layers an `all_gather_into_tensor` of its
  parameters before its forward and before its backward, a `reduce_scatter_tensor` of its
  gradients after the backward (not waited for until the step ends), all in the world group.

Sizes and compute times are drawn per scenario (`draw_workload` for the lab's Megatron jobs,
`draw_field_workload` for every kind, steps from 50 ms to 30 s; a long step has longer compute
segments, not more of them). The stack frames say where in the code py-spy finds a rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracehound.analysis.sim.engine import Engine, Message
from tracehound.analysis.sim.topology import Family, Topology
from tracehound.tracing.summaries import F64, I64

WORKLOADS = ("gpipe", "1f1b", "interleaved", "moe", "ddp", "zero3")
"""The kinds of training step the simulator runs."""
PIPELINED = frozenset({"gpipe", "1f1b", "interleaved", "moe"})
"""The kinds with Megatron groups (tensor, pipeline, data parallel)."""

_NVLINK_BUS = 200e3
"""Bytes per us of a TP all_reduce's bus bandwidth within a node."""
_NET = 20e3
"""Bytes per us of one GPU's NIC."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """The sizes and times one scenario's training step is built from."""

    kind: str = "gpipe"
    fwd_us: float
    """Forward compute of one micro-batch on one stage, all its chunks (backward takes twice as
    long); for ddp and zero3 the forward of the whole step."""
    act_bytes: int
    """Activations one stage sends the next per micro-batch and chunk."""
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
    step_us: float = 0.0
    """The healthy step duration the sizes were drawn for (0: estimated from them)."""
    blocks: int = 0
    """zero3: the blocks of layers gathered one at a time."""
    block_bytes: int = 0
    """zero3: the parameter bytes of one block."""
    a2a_bytes: int = 0
    """moe: the bytes a member sends in one all_to_all on average."""
    a2a_spread: float = 0.0
    """moe: sigma of the lognormal spread of the tokens each member routes."""
    combined_p2p: bool = False
    """Pipelines: Megatron's non-batched p2p (`batch_p2p_comm=False`): in the 1F1B steady state
    a stage sends its output and receives the input of its next block, of the other direction,
    in one call that waits for both (even stages send first, odd ones receive first), so both
    are recorded complete when the call ends: a send's completion then includes the wait for
    the neighbour's next block, which the schedule decides."""

    def per_step(self) -> dict[Family, int]:
        """How many collectives one step issues in each group of a family (pipeline pairs:
        between two neighbouring stages)."""
        m = self.microbatches
        if self.kind == "ddp":
            return {Family.WORLD: len(self.grad_bytes) + 1}
        if self.kind == "zero3":
            return {Family.WORLD: 3 * self.blocks + 1}
        v = self.chunks
        out = {Family.TP: 4 * m * v, Family.DP: len(self.grad_bytes), Family.P2P: 2 * m,
               Family.WORLD: 1}
        if self.kind == "moe":
            out[Family.EP] = 4 * m * v
        return out

    @property
    def chunks(self) -> int:
        return int(self.kind == "interleaved") + 1

    def base_seq(self) -> dict[Family, int]:
        """Per family, the last sequence number issued before the window."""
        per_step = self.per_step()
        return {fam: self.base_step * per_step.get(fam, 0) for fam in Family}

    def dp_key(self) -> tuple[int, int]:
        """The family key of the gradient collectives."""
        return (int(Family.WORLD), 0) if self.kind in ("ddp", "zero3") else (int(Family.DP), 0)

    def estimated_step_us(self, topo: Topology) -> float:
        """A healthy step's duration, before any step has been played."""
        if self.step_us:
            return self.step_us
        m, pp = self.microbatches, topo.pp
        return (m + pp - 1) * 3.1 * self.fwd_us + _gradient_sync_us(topo, self.grad_bytes)


def _gradient_sync_us(topo: Topology, grad_bytes: tuple[int, ...]) -> float:
    """Ring all_reduce bandwidth time of every gradient bucket at 20 GB/s."""
    return sum(2 * (topo.dp - 1) / topo.dp * g / _NET for g in grad_bytes)


def draw_workload(topo: Topology, rng: np.random.Generator,
                  microbatches: int | None = None) -> Workload:
    """A lab Megatron job for `topo` under GPipe: a 100..450 ms step, 100..400 M parameters per
    rank in three gradient buckets, TP traffic 6..15% of the compute it interleaves with."""
    pp = topo.pp
    m = microbatches or (4 if topo.ranks <= 256 else 2)
    step_target_us = float(rng.uniform(100_000.0, 450_000.0))
    act = int(rng.choice([2048, 4096])) * int(rng.choice([4096, 5120, 8192])) * 2
    params_per_rank = float(rng.uniform(100e6, 400e6))
    split = rng.dirichlet([4.0, 3.0, 1.5])
    grad = tuple(int(params_per_rank * 2 * x) // 2 * 2 for x in split)
    dp_us = _gradient_sync_us(topo, grad)
    fwd = max(2_000.0, (step_target_us - dp_us) / ((m + pp - 1) * 4.0))
    return Workload(fwd_us=fwd, act_bytes=act, tp_bytes=_tp_bytes(topo, fwd / 2, rng),
                    grad_bytes=grad, microbatches=m,
                    base_step=int(rng.integers(200, 20_000)),
                    jitter=float(rng.uniform(0.015, 0.035)), spike_p=2e-4)


def _tp_bytes(topo: Topology, segment_us: float, rng: np.random.Generator) -> int:
    """TP all_reduce bytes that take 6..15% of the compute segment they follow."""
    tp = topo.tp
    if tp == 1:
        return 0
    nbytes = int(rng.uniform(0.06, 0.15) * segment_us * _NVLINK_BUS / (2 * (tp - 1) / tp))
    return nbytes - nbytes % 1024


STEP_RANGE_US = {"gpipe": (500_000.0, 30e6), "1f1b": (500_000.0, 30e6),
                 "interleaved": (500_000.0, 30e6), "moe": (500_000.0, 30e6),
                 "ddp": (50_000.0, 2e6), "zero3": (300_000.0, 8e6)}
"""Per kind, the range field step durations are drawn from (log-uniform)."""


def draw_field_workload(topo: Topology, kind: str, rng: np.random.Generator, *,
                        microbatches: int | None = None,
                        step_us: float | None = None) -> Workload:
    """A field job of `kind` for `topo`, its step `step_us` long (drawn log-uniform from
    `STEP_RANGE_US` when None)."""
    lo, hi = STEP_RANGE_US[kind]
    step = step_us or float(np.exp(rng.uniform(math.log(lo), math.log(hi))))
    base_step = int(rng.integers(50, 200_000))
    jitter = float(rng.uniform(0.02, 0.05))
    if kind in ("ddp", "zero3"):
        backward = step * 2 / 3.2
        total = float(rng.uniform(0.3, 0.8)) * backward * _NET / 2
        if kind == "ddp":
            buckets = int(rng.integers(8, 33))
            split = rng.dirichlet(np.full(buckets, 4.0))
            return Workload(kind=kind, fwd_us=step / 3.2, act_bytes=0, tp_bytes=0,
                            grad_bytes=tuple(max(1024, int(total * x) // 4 * 4) for x in split),
                            microbatches=1, base_step=base_step, jitter=jitter,
                            spike_p=_FIELD_SPIKE_P, step_us=step)
        blocks = int(rng.integers(4, 13))
        block = int(total / blocks) // 2 * 2
        return Workload(kind=kind, fwd_us=step / 3.4, act_bytes=0, tp_bytes=0,
                        grad_bytes=(block,), microbatches=1, base_step=base_step,
                        jitter=jitter, spike_p=_FIELD_SPIKE_P, step_us=step, blocks=blocks,
                        block_bytes=block)
    pp = topo.pp
    v = 2 if kind == "interleaved" else 1
    if microbatches is None:
        m = int(rng.choice([1, 2, 4])) * pp if pp > 1 else int(rng.choice([1, 2, 4]))
        m = min(m, 16 - 16 % pp)
    else:
        m = microbatches
    if kind == "interleaved" and m % pp:
        raise ValueError(f"an interleaved schedule needs microbatches divisible by pp={pp}, "
                         f"got {m}")
    act = int(rng.choice([2048, 4096, 8192])) * int(rng.choice([4096, 5120, 8192])) * 2
    params_per_rank = float(rng.uniform(100e6, 800e6))
    split = rng.dirichlet(np.full(int(rng.integers(3, 7)), 3.0))
    grad = tuple(int(params_per_rank * 2 * x) // 2 * 2 for x in split)
    dp_us = _gradient_sync_us(topo, grad)
    fwd = max(1_000.0, (0.95 * step - dp_us) / ((m + (pp - 1) / v) * 3.1))
    a2a_bytes, a2a_spread = 0, 0.0
    if kind == "moe":
        a2a_bytes = int(act * float(rng.uniform(0.5, 2.0))) // 2 * 2
        a2a_spread = float(rng.uniform(0.15, 0.5))
    return Workload(kind=kind, fwd_us=fwd, act_bytes=act,
                    tp_bytes=_tp_bytes(topo, fwd / v / 2, rng), grad_bytes=grad,
                    microbatches=m, base_step=base_step, jitter=jitter, spike_p=_FIELD_SPIKE_P,
                    step_us=step, a2a_bytes=a2a_bytes, a2a_spread=a2a_spread)


_FIELD_SPIKE_P = 5e-4
"""Chance of a short pause in a field job's compute segment (the lab's: 2e-4)."""


# -- one training step ----------------------------------------------------------------------------


def run_step(eng: Engine, w: Workload, est_step_us: float) -> None:
    """One training step of every rank (see the module docstring)."""
    eng.begin_step(est_step_us)
    if w.kind == "gpipe":
        _forward(eng, w)
        _backward(eng, w)
    elif w.kind == "ddp":
        _ddp(eng, w)
    elif w.kind == "zero3":
        _zero3(eng, w)
    else:
        _pipelined(eng, w)
    if w.kind in PIPELINED:
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
    tp_us = 2 * (tp - 1) / tp * w.tp_bytes / _NVLINK_BUS + 15.0
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


def schedule(stage: int, pp: int, chunks: int, m: int) -> list[tuple[bool, int, int]]:
    """Megatron's order of (forward?, micro-batch, model chunk) on `stage`: warm-up forwards,
    then one forward and one backward at a time, then the remaining backwards."""
    total = m * chunks

    def forward_id(k: int) -> tuple[int, int]:
        return (k // (pp * chunks)) * pp + k % pp, (k // pp) % chunks

    if chunks == 1:
        warm = min(pp - stage - 1, m)
    else:
        warm = min((pp - stage - 1) * 2 + (chunks - 1) * pp, total)
    out = [(True, *forward_id(k)) for k in range(warm)]
    for i in range(total):
        if warm + i < total:
            out.append((True, *forward_id(warm + i)))
        mb, chunk = forward_id(i)
        out.append((False, mb, chunks - 1 - chunk))
    return out


def _pipelined(eng: Engine, w: Workload) -> None:
    """A 1F1B (or interleaved) step: every stage runs its schedule until it waits for a
    transfer that its neighbour has not posted yet."""
    topo, layout = eng.topo, eng.layout
    pp, v = topo.pp, topo.vp
    last = pp * v - 1
    programs = [schedule(s, pp, v, w.microbatches) for s in range(pp)]
    pcs = [0] * pp
    mailbox: dict[tuple[bool, int, int], Message] = {}
    # combined calls (`Workload.combined_p2p`): the message a stage sent last, waiting to be
    # paired with the stage's next receive; and where each message's send was recorded
    unpaired: list[tuple[bool, int, int] | None] = [None] * pp
    pairs: list[tuple[tuple[bool, int, int], int]] = []
    sent_at: dict[tuple[bool, int, int], int] = {}
    while True:
        moved = False
        for s in range(pp):
            while pcs[s] < len(programs[s]):
                fwd, mb, chunk = programs[s][pcs[s]]
                vs = chunk * pp + s
                need = ((fwd, mb, vs - 1) if fwd and vs > 0 else
                        (fwd, mb, vs + 1) if not fwd and vs < last else None)
                if need is not None and need not in mailbox:
                    break
                if need is not None:
                    src = (s - 1) % pp if fwd else (s + 1) % pp
                    send, recv = _deliver(eng, w, mailbox.pop(need), src, s)
                    sent_at[need] = send
                    mine = unpaired[s]
                    if w.combined_p2p and mine is not None and mine[0] != fwd:
                        # the steady state's send_forward_recv_backward and
                        # send_backward_recv_forward; warm-up and cool-down calls are single
                        pairs.append((mine, recv))
                    unpaired[s] = None
                _block(eng, w, s, fwd)
                dst = _sends_to(s, vs, pp, last, forward=fwd)
                if dst >= 0:
                    mailbox[(fwd, mb, vs)] = eng.post(layout.grid[s].ravel(),
                                                      _p2p_key(topo, s, dst))
                    unpaired[s] = (fwd, mb, vs)
                pcs[s] += 1
                moved = True
        if all(pc == len(p) for pc, p in zip(pcs, programs, strict=True)):
            break
        if not moved:
            raise RuntimeError("the pipeline schedule waits for a transfer never posted")
    for message, recv in pairs:
        if message in sent_at:
            eng.complete_together(sent_at[message], recv)


def _sends_to(stage: int, vs: int, pp: int, last: int, *, forward: bool) -> int:
    """Where a block of virtual stage `vs` on `stage` sends its output (-1: nowhere)."""
    if forward:
        return (stage + 1) % pp if vs < last else -1
    return (stage - 1) % pp if vs > 0 else -1


def _p2p_key(topo: Topology, a: int, b: int) -> tuple[int, int]:
    """The family key of the pairs between stages a and b (neighbours or last and first)."""
    boundary = min(a, b) if abs(a - b) == 1 else topo.pp - 1
    if topo.pp == 2:
        boundary = 0
    return int(Family.P2P), boundary


def _deliver(eng: Engine, w: Workload, msg: Message, src: int, dst: int) -> tuple[int, int]:
    layout = eng.layout
    boundary = msg[2]
    return eng.deliver(msg, layout.grid[src].ravel(), layout.grid[dst].ravel(),
                       layout.p2p_gid[boundary].ravel(), nbytes=w.act_bytes,
                       base_us=_p2p_us(w))


def _block(eng: Engine, w: Workload, stage: int, forward: bool) -> None:
    """The forward or backward of one micro-batch chunk on every replica of `stage`."""
    ranks = eng.layout.grid[stage].ravel()
    us = w.fwd_us / w.chunks / 2 * _stage_factor(eng.topo.pp)[stage] * (1 if forward else 2)
    name = "forward" if forward else "backward"
    if w.kind != "moe":
        for half in range(2):
            eng.compute(ranks, us, f"{name}{half}")
            _tp_reduce(eng, w, stage)
        return
    eng.compute(ranks, us, f"{name}0")
    _tp_reduce(eng, w, stage)
    load = _all_to_all(eng, w, stage)
    eng.compute(ranks, us * load, f"{name}1")
    _all_to_all(eng, w, stage, load)
    _tp_reduce(eng, w, stage)


def _all_to_all(eng: Engine, w: Workload, stage: int, load: F64 | None = None) -> F64:
    """One expert parallel all_to_all of every EP group of `stage`: each member sends the
    tokens it routes (`load`, drawn when None, mean 1 per group). Returns the load per rank of
    the stage (in `grid[stage].ravel()` order)."""
    layout, topo = eng.layout, eng.topo
    groups, gids = layout.ep_groups(stage)
    if load is None:
        share = eng.rng.lognormal(0.0, w.a2a_spread, groups.shape)
        share /= share.mean(axis=1, keepdims=True)
    else:
        share = load[groups - int(layout.grid[stage].min())]
    sizes: I64 = (np.rint(share * w.a2a_bytes / 4096) * 4096).astype(np.int64).clip(4096)
    ep = topo.ep
    base = (ep - 1) / ep * sizes.max(axis=1) / _NET + 20.0
    eng.collective(groups, gids, (int(Family.EP), stage), nbytes=w.a2a_bytes,
                   dtype="bfloat16", base_us=base, op="all_to_all_single", sizes=sizes)
    out = np.empty(groups.size)
    out[groups.ravel() - int(layout.grid[stage].min())] = share.ravel()
    return out


def _gradient_sync(eng: Engine, w: Workload) -> None:
    """One DP all_reduce per gradient bucket (ring at 20 GB/s plus latency per hop)."""
    dp = eng.topo.dp
    groups, gids = eng.layout.dp_groups()
    for nbytes in w.grad_bytes:
        ring = 2 * (dp - 1) / dp * nbytes / _NET + 12.0 * math.log2(dp)
        eng.collective(groups, gids, (Family.DP, 0), nbytes=nbytes, dtype="bfloat16",
                       base_us=np.full(gids.shape[0], ring))


def _ddp(eng: Engine, w: Workload) -> None:
    """Forward, then the backward with one bucket all_reduce issued as each bucket is ready."""
    n = eng.topo.ranks
    ranks = np.arange(n, dtype=np.int64)
    groups, gids = eng.layout.dp_groups()
    eng.compute(ranks, w.fwd_us, "forward0")
    total = sum(w.grad_bytes)
    for nbytes in w.grad_bytes:
        eng.compute(ranks, 2 * w.fwd_us * nbytes / total, "backward0")
        ring = 2 * (n - 1) / n * nbytes / _NET + 12.0 * math.log2(n)
        eng.collective(groups, gids, w.dp_key(), nbytes=nbytes, dtype="float32",
                       base_us=np.full(1, ring), block=False)
    eng.wait(ranks)


def _zero3(eng: Engine, w: Workload) -> None:
    """Per block: gather its parameters, compute; backwards the same, then scatter its
    gradients (waited for at the end of the step)."""
    n = eng.topo.ranks
    ranks = np.arange(n, dtype=np.int64)
    groups, gids = eng.layout.dp_groups()
    shard = w.block_bytes // n // 2 * 2
    gather = np.full(1, (n - 1) / n * w.block_bytes / _NET + 10.0 * math.log2(n))
    for _ in range(w.blocks):
        eng.collective(groups, gids, w.dp_key(), nbytes=shard, dtype="bfloat16",
                       base_us=gather, op="all_gather_into_tensor")
        eng.compute(ranks, w.fwd_us / w.blocks, "forward0")
    for _ in range(w.blocks):
        eng.collective(groups, gids, w.dp_key(), nbytes=shard, dtype="bfloat16",
                       base_us=gather, op="all_gather_into_tensor")
        eng.compute(ranks, 2 * w.fwd_us / w.blocks, "backward0")
        eng.collective(groups, gids, w.dp_key(), nbytes=w.block_bytes, dtype="float32",
                       base_us=gather, op="reduce_scatter_tensor", block=False)
    eng.wait(ranks)


def _optimizer(eng: Engine, w: Workload) -> None:
    """The world all_reduce (overflow flag, loss), then the optimizer step."""
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
    "ep": (_SCHEDULE, "megatron/core/pipeline_parallel/schedules.py:275 forward_step",
           "megatron/core/transformer/moe/moe_layer.py:144 forward",
           "megatron/core/transformer/moe/token_dispatcher.py:563 token_permutation",
           "megatron/core/tensor_parallel/mappings.py:463 all_to_all",
           "torch/distributed/c10d_logger.py:81 wrapper",
           "torch/distributed/distributed_c10d.py:4098 all_to_all_single"),
    "checkpoint": ("megatron/training/training.py:1290 save_checkpoint_and_time",
                   "megatron/training/checkpointing.py:402 save_checkpoint",
                   "megatron/core/dist_checkpointing/serialization.py:392 save",
                   "torch/serialization.py:652 save", "torch/serialization.py:884 _save"),
    "evaluate": ("megatron/training/training.py:1335 train",
                 "megatron/training/training.py:1498 evaluate_and_print_results",
                 "megatron/training/training.py:1412 evaluate",
                 "megatron/core/pipeline_parallel/schedules.py:460 "
                 "forward_backward_no_pipelining",
                 "megatron/core/pipeline_parallel/schedules.py:275 forward_step"),
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
    if family == Family.EP:
        return "ep"
    return "dp" if family == Family.DP or w.kind in ("ddp", "zero3") else "world"


def compute_site(phase: str) -> str:
    """The site of a rank stuck in the compute phase `phase` (as the engine names phases)."""
    if phase.startswith("backward"):
        return "compute_backward"
    return phase if phase in ("optimizer", "checkpoint", "evaluate") else "compute"
