"""Simulated training jobs with injected faults: realistic traces for the analysis and its bench.

`simulate(ranks=..., fault=..., seed=...)` plays a detection window of a Megatron-style job (tensor
parallel within a node, pipeline stages across nodes, data parallel replicas) step by step, with
numpy over all ranks at once, and returns what the recorders, the node agents and the health
sources would have reported by `now_us`: the collective events of the window as columns, each
rank's latest heartbeat, the exits, the process groups, the latest stack samples and the health
samples, plus the ground truth of the injected fault. `SimulatedJob.observation()` feeds it to
the analysis through the numpy summaries of `tracing.summaries`; `write_to_store()` feeds it to a
trace store, from which `load_observation` reads the same window back.

How a step runs (GPipe schedule): per micro-batch and pipeline stage, `recv` from the previous
stage, compute, a TP `all_reduce`, compute, a TP `all_reduce` (forward), then the same backwards
with gradients flowing to the previous stage; then the DP gradient `all_reduce`s (one per bucket)
and a world `all_reduce` of the overflow flag before the optimizer step. A collective completes
for every member when its last member has entered, plus its transfer time; a rank that never
enters (stuck, frozen, dead) leaves its peers pending, which is how one stuck rank stops its TP
group, the next pipeline stage and then every DP replica.

Faults (`Truth.variant` says which form was drawn):

- hang: one rank stuck in a GPU kernel (heartbeats go on, no pending op) or frozen (SIGSTOP;
  heartbeats stop, possibly inside a collective);
- crash: one rank dies (OOM kill, segfault, abort, exception); the ranks waiting on it fail with
  connection errors 20 ms to a few seconds later, the launcher kills the rest after seconds;
- mismatch: one rank calls a different op (all hang at one sequence id, its pending op differs),
  a different size or dtype (the collective completes, the events disagree), or skips a DP
  bucket (events disagree, then the job hangs);
- straggler: one rank computes 20..100% slower;
- slow_link: one pipeline pair transfers 1.6..4x slower, or every link of one node 1.5..3x;
- hardware: a thermal slowdown, an Xid 79/48 hang, NVLink errors slowing or hanging one node's
  TP collectives, each with the health event on that node;
- silent_hang: every rank pending in the same world all_reduce, nobody silent or lagging, the
  culprits' stacks stuck in a data loader, a storage read or a CUDA synchronize.

Healthy runs carry the noise a naive detector trips over: per-segment jitter, rare GC and I/O
spikes of up to 400 ms, a GPU a few percent slower than its peers, network hiccups and benign
health warnings.

Bench and test side only: this module is never imported by agent code and never runs inside a
training process. Deterministic per seed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from tracehound.analysis.observation import Observation
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing.events import (
    Batch,
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    IncidentKind,
    ProcessGroupInfo,
    RankExit,
    Record,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore
from tracehound.tracing.summaries import (
    CollectiveColumns,
    disagreements,
    link_stats,
    node_windows,
    rank_stats,
)

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]

FAULT_KINDS: tuple[IncidentKind, ...] = (
    IncidentKind.HANG, IncidentKind.CRASH, IncidentKind.MISMATCH, IncidentKind.STRAGGLER,
    IncidentKind.SLOW_LINK, IncidentKind.HARDWARE, IncidentKind.SILENT_HANG,
)
"""The fault classes `simulate` can inject (None injects nothing)."""

BASE_EPOCH_US = 1_767_225_600_000_000
"""2026-01-01T00:00:00Z; every scenario starts at its own hour after it."""

_US = 1_000_000
_INF = math.inf
WORLD_GROUP = "0"


# -- topology -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Ranks laid out Megatron-style: tp fastest, then dp, then pp (rank = (p*dp + d)*tp + t)."""

    ranks: int
    tp: int
    pp: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.ranks < 16 or self.ranks % self.gpus_per_node:
            raise ValueError(f"ranks must be >= 16 and a multiple of {self.gpus_per_node}, "
                             f"got {self.ranks}")
        if self.gpus_per_node % self.tp or self.ranks % (self.tp * self.pp):
            raise ValueError(f"tp={self.tp} must divide {self.gpus_per_node} and tp*pp must "
                             f"divide ranks={self.ranks}")

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        return self.ranks // self.gpus_per_node

    def grid(self) -> I64:
        """Global ranks as [pp, dp, tp]."""
        return np.arange(self.ranks, dtype=np.int64).reshape(self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tp index) of a rank."""
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def node_of(self, rank: int) -> str:
        return node_name(rank // self.gpus_per_node)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return tuple(range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node))

    def tp_group(self, rank: int) -> str:
        return f"tp-{rank // self.tp}"

    def dp_group(self, rank: int) -> str:
        stage, _, t = self.coords(rank)
        return f"dp-{stage * self.tp + t}"

    def pp_group(self, rank: int) -> str:
        _, d, t = self.coords(rank)
        return f"pp-{d * self.tp + t}"

    def p2p_group(self, a: int, b: int) -> str:
        """The pair group the recorder names for a send/recv between a and b."""
        return f"{self.pp_group(a)}:p2p:{min(a, b)}-{max(a, b)}"


def node_name(index: int) -> str:
    return f"node-{index:04d}"


def default_topology(ranks: int, rng: np.random.Generator, *, need_pp: bool = False) -> Topology:
    """A plausible layout for `ranks`: TP 8 (sometimes 4) within a node, PP 1..4."""
    tp = 8 if rng.random() < 0.7 else 4
    stages = [p for p in (1, 2, 4) if ranks % (tp * p) == 0 and ranks // (tp * p) >= 2]
    if need_pp:
        stages = [p for p in stages if p >= 2] or stages
    return Topology(ranks=ranks, tp=tp, pp=int(rng.choice(stages)))


# -- results --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Truth:
    """What was injected. `culprit_ranks[0]` is the primary culprit."""

    kind: IncidentKind | None
    """None for a healthy run."""
    culprit_ranks: tuple[int, ...] = ()
    culprit_nodes: tuple[str, ...] = ()
    link: tuple[int, int] | None = None
    """For a slow pipeline pair: (sender of activations, receiver)."""
    variant: str = ""
    """The form of the fault (`compute_stuck`, `sigstop`, `thermal`, ...)."""
    fault_us: int = 0
    """When it struck (0 for healthy runs and faults present throughout the window)."""

    def accepts(self, rank: int, node: str) -> bool:
        """Whether naming `rank` (on `node`) first is right: a culprit rank, either end of the
        slow link, any rank of a slow node or of the node with the hardware fault."""
        if self.kind is None:
            return False
        if self.kind is IncidentKind.HARDWARE or (
            self.kind is IncidentKind.SLOW_LINK and self.link is None
        ):
            return node in self.culprit_nodes
        if self.link is not None and rank in self.link:
            return True
        return rank in self.culprit_ranks


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SimulatedJob:
    """One attempt of a simulated job as the store would hold it at `now_us`."""

    job: JobId
    attempt: int
    topology: Topology
    rank_nodes: Mapping[int, str]
    groups: tuple[ProcessGroupInfo, ...]
    """One record per process group (as its lowest rank created it)."""
    heartbeats: tuple[Heartbeat, ...]
    """The latest heartbeat of every rank."""
    exits: tuple[RankExit, ...]
    columns: CollectiveColumns
    """Every event recorded in [window_start_us, window_end_us), completed or failed."""
    stacks: tuple[StackSample, ...]
    health: tuple[HealthSample, ...]
    window_start_us: int
    window_end_us: int
    now_us: int
    truth: Truth
    step_us: float = 0.0
    """Median duration of a healthy step of this job."""
    info: Mapping[str, Any] = field(default_factory=dict)
    """Parameters drawn for the scenario (for reports)."""

    def node_of_rank(self) -> dict[int, str]:
        return dict(self.rank_nodes)

    def snapshot(self) -> JobSnapshot:
        return JobSnapshot(
            job=self.job, attempt=self.attempt, now_us=self.now_us, heartbeats=self.heartbeats,
            exits=self.exits, groups=self.groups, expected_ranks=self.rank_nodes,
        )

    def observation(
        self, *, window_us: int | None = None, node_window_us: int | None = None
    ) -> Observation:
        """The analysis' view of the window ending at `now_us`, summarized with numpy.

        `window_us`: the detection window (default: the whole simulated window);
        `node_window_us`: the width of the per-node windows over the whole simulated window
        (default: a quarter of it)."""
        end = self.window_end_us
        start = max(self.window_start_us, end - window_us) if window_us else self.window_start_us
        width = node_window_us or max(1, -(-(end - self.window_start_us) // 4))
        cols = self.columns
        return Observation(
            snapshot=self.snapshot(),
            window_start_us=start,
            window_end_us=end,
            ranks=rank_stats(cols, start, end),
            links=link_stats(cols, start, end),
            disagreements=tuple(disagreements(cols, start, end)),
            stacks=tuple(s for s in self.stacks if s.time_us >= start),
            health=tuple(h for h in self.health if start <= h.time_us < end),
            node_windows=node_windows(cols, self.rank_nodes, self.window_start_us, end, width),
        )


# -- the timeline engine --------------------------------------------------------------------------


class _Fam(enum.IntEnum):
    TP = 0
    DP = 1
    P2P = 2
    WORLD = 3


OPS = ("all_reduce", "send", "recv", "all_gather_into_tensor", "reduce_scatter_tensor",
       "broadcast")
DTYPES = ("bfloat16", "float32")
_OP = {name: i for i, name in enumerate(OPS)}
_DT = {name: i for i, name in enumerate(DTYPES)}


@dataclass(slots=True)
class _Override:
    """One rank's different call at (family key, seq): op, size, dtype; or a skipped bucket."""

    key: tuple[int, int]
    seq: int
    rank: int
    op: str = "all_reduce"
    nbytes: int = 0
    dtype: str = "bfloat16"
    hang: bool = False
    """The group never completes the collective."""
    skip_next: bool = False
    """The rank's next call in the family is skipped (a sequence mismatch)."""


@dataclass(slots=True)
class _Plan:
    """How a fault perturbs the timeline; everything default is a healthy job."""

    speed: dict[int, float] = field(default_factory=dict)
    """Persistent compute multiplier per rank."""
    slow_from_step: int = 0
    link_factor: dict[int, float] = field(default_factory=dict)
    """p2p pair group index -> transfer time multiplier."""
    tp_factor: dict[int, float] = field(default_factory=dict)
    """TP group index -> collective time multiplier."""
    dp_factor: float = 1.0
    dp_slow_groups: frozenset[int] = frozenset()
    stop_step: int = -1
    """At the start of this step the stop times below are set (relative to the step start)."""
    stop_frac: float = 0.5
    stop_compute: tuple[int, ...] = ()
    """Ranks whose GPU work never finishes after the stop time (the process still runs)."""
    stop_all: tuple[int, ...] = ()
    """Ranks that do nothing at all after the stop time (frozen or dead)."""
    stall: tuple[tuple[int, int], int, int] | None = None
    """(family key, seq, rank): the collective of that rank's group never completes."""
    override: _Override | None = None
    spike: tuple[int, int, float] | None = None
    """(rank, step, us): one long pause (GC, page cache) in one compute segment."""


@dataclass(slots=True)
class _Params:
    fwd_us: float
    act_bytes: int
    """Activations one stage sends the next per micro-batch."""
    tp_bytes: int
    """Bytes of one TP all_reduce event: it stands for the all-reduces of half a stage's layers
    (one event per block of layers keeps the event count down, the total TP time right)."""
    grad_bytes: tuple[int, ...]
    microbatches: int
    base_step: int
    jitter: float
    spike_p: float


class _Engine:
    """Times as float microseconds relative to the window start; inf = never."""

    def __init__(self, topo: Topology, params: _Params, plan: _Plan,
                 rng: np.random.Generator) -> None:
        self.topo, self.params, self.plan, self.rng = topo, params, plan, rng
        n = topo.ranks
        grid = topo.grid()
        self.grid = grid
        # Group registry: ids, names, members.
        names: list[str] = []
        members: list[I64] = []

        def add(name: str, ranks: I64) -> int:
            names.append(name)
            members.append(ranks)
            return len(names) - 1

        self.world_gid = add(WORLD_GROUP, np.arange(n, dtype=np.int64))
        self.tp_gid = np.full((topo.pp, topo.dp), -1, dtype=np.int64)
        if topo.tp > 1:
            for p in range(topo.pp):
                for d in range(topo.dp):
                    self.tp_gid[p, d] = add(topo.tp_group(int(grid[p, d, 0])), grid[p, d])
        self.dp_gid = np.full((topo.pp, topo.tp), -1, dtype=np.int64)
        for p in range(topo.pp):
            for t in range(topo.tp):
                self.dp_gid[p, t] = add(topo.dp_group(int(grid[p, 0, t])), grid[p, :, t])
        self.pp_gid = np.full((topo.dp, topo.tp), -1, dtype=np.int64)
        self.p2p_gid = np.full((max(topo.pp - 1, 0), topo.dp, topo.tp), -1, dtype=np.int64)
        if topo.pp > 1:
            for d in range(topo.dp):
                for t in range(topo.tp):
                    self.pp_gid[d, t] = add(topo.pp_group(int(grid[0, d, t])), grid[:, d, t])
            for b in range(topo.pp - 1):
                for d in range(topo.dp):
                    for t in range(topo.tp):
                        lo, hi = int(grid[b, d, t]), int(grid[b + 1, d, t])
                        self.p2p_gid[b, d, t] = add(topo.p2p_group(lo, hi),
                                                    np.array([lo, hi], dtype=np.int64))
        self.names = names
        self.members = members
        self.family = np.empty(len(names), dtype=np.int64)
        self.family[self.world_gid] = _Fam.WORLD
        self.family[self.tp_gid[self.tp_gid >= 0]] = _Fam.TP
        self.family[self.dp_gid.ravel()] = _Fam.DP
        self.family[self.pp_gid[self.pp_gid >= 0]] = -1
        self.family[self.p2p_gid.ravel()] = _Fam.P2P

        m = params.microbatches
        self.per_step = {_Fam.TP: 4 * m, _Fam.DP: len(params.grad_bytes), _Fam.P2P: 2 * m,
                         _Fam.WORLD: 1}
        self.base_seq = {fam: params.base_step * k for fam, k in self.per_step.items()}
        self.seq: dict[tuple[int, int], int] = {}

        self.t: F64 = 1_000.0 + rng.uniform(0.0, 2_000.0, n)
        self.stop_all: F64 = np.full(n, _INF)
        self.stop_compute: F64 = np.full(n, _INF)
        speed = rng.normal(1.0, 0.008, n).clip(0.97, 1.03)
        speed *= np.repeat(rng.normal(1.0, 0.004, topo.nodes).clip(0.99, 1.01),
                           topo.gpus_per_node)
        self.base_speed: F64 = speed
        self.fault_speed: F64 = np.ones(n)
        self.stuck_phase: dict[int, str] = {}
        self.step = 0
        self.step_start: list[float] = []
        self.step_end: list[F64] = []
        self.stop_time = _INF
        self.skipping: set[int] = set()
        # Event chunks.
        self._rank: list[I64] = []
        self._gid: list[I64] = []
        self._seq: list[I64] = []
        self._op: list[I64] = []
        self._nbytes: list[I64] = []
        self._dtype: list[I64] = []
        self._peer: list[I64] = []
        self._enq: list[F64] = []
        self._comp: list[F64] = []

    # -- primitives ---------------------------------------------------------------------------

    def _next_seq(self, key: tuple[int, int]) -> int:
        seq = self.seq.get(key, self.base_seq[_Fam(key[0])]) + 1
        self.seq[key] = seq
        return seq

    def compute(self, ranks: I64, base_us: float, phase: str) -> None:
        """Each rank of `ranks` computes for about `base_us`."""
        p = self.params
        k = ranks.shape[0]
        factor = self.base_speed[ranks]
        if self.step >= self.plan.slow_from_step:
            factor = factor * self.fault_speed[ranks]
        dur = base_us * factor * self.rng.lognormal(0.0, p.jitter, k)
        spikes = np.asarray(self.rng.random(k) < p.spike_p)
        if spikes.any():
            dur[spikes] += 5_000.0 + self.rng.exponential(15_000.0, int(spikes.sum()))
        if self.plan.spike is not None:
            rank, step, extra = self.plan.spike
            if step == self.step:
                hit = np.flatnonzero(ranks == rank)
                if hit.size:
                    dur[hit] += extra
                    self.plan.spike = None
        start = self.t[ranks]
        end = start + dur
        limit = np.minimum(self.stop_compute[ranks], self.stop_all[ranks])
        stuck = end > limit
        if stuck.any():
            for r in ranks[stuck & np.isfinite(start)]:
                self.stuck_phase.setdefault(int(r), phase)
            end[stuck] = _INF
        self.t[ranks] = end

    def _record(self, ranks: I64, gids: I64, seq: int | I64, *, op: I64, nbytes: I64,
                dtype: I64, peer: I64, enq: F64, comp: F64) -> None:
        keep = np.isfinite(enq)
        if not keep.all():
            ranks, gids, op, nbytes = ranks[keep], gids[keep], op[keep], nbytes[keep]
            dtype, peer, enq, comp = dtype[keep], peer[keep], enq[keep], comp[keep]
            if not isinstance(seq, int):
                seq = seq[keep]
        k = ranks.shape[0]
        self._rank.append(ranks)
        self._gid.append(gids)
        self._seq.append(np.full(k, seq, dtype=np.int64) if isinstance(seq, int) else seq)
        self._op.append(op)
        self._nbytes.append(nbytes)
        self._dtype.append(dtype)
        self._peer.append(peer)
        self._enq.append(enq)
        self._comp.append(comp)

    def collective(self, groups: I64, gids: I64, key: tuple[int, int], *, nbytes: int,
                   dtype: str, base_us: F64) -> None:
        """One collective in each of `groups` ([G, K] ranks): all_reduce unless overridden."""
        seq = self._next_seq(key)
        g, k = groups.shape
        enq = self.t[groups]
        enq = np.where(enq >= self.stop_all[groups], _INF, enq)
        ops = np.full((g, k), _OP["all_reduce"], dtype=np.int64)
        sizes = np.full((g, k), nbytes, dtype=np.int64)
        dtypes = np.full((g, k), _DT[dtype], dtype=np.int64)
        absent = np.zeros((g, k), dtype=bool)
        never = np.zeros(g, dtype=bool)
        if self.skipping and key[0] == _Fam.DP:
            for rank in list(self.skipping):
                hit = np.argwhere(groups == rank)
                if hit.size:
                    absent[hit[0, 0], hit[0, 1]] = True
                    self.skipping.discard(rank)
        o = self.plan.override
        if o is not None and o.key == key and o.seq == seq:
            hit = np.argwhere(groups == o.rank)
            if hit.size:
                gi, ki = int(hit[0, 0]), int(hit[0, 1])
                ops[gi, ki] = _OP[o.op]
                sizes[gi, ki] = o.nbytes
                dtypes[gi, ki] = _DT[o.dtype]
                never[gi] |= o.hang
                if o.skip_next:
                    self.skipping.add(o.rank)
        if self.plan.stall is not None:
            skey, sseq, srank = self.plan.stall
            if skey == key and sseq == seq:
                never |= (groups == srank).any(axis=1)
        ready = np.where(absent, _INF, enq).max(axis=1)
        dur = base_us * self.rng.lognormal(0.0, 0.05, g)
        hiccup = np.asarray(self.rng.random(g) < 0.002)
        dur[hiccup] *= self.rng.uniform(2.0, 5.0, int(hiccup.sum()))
        comp = ready[:, None] + dur[:, None] + self.rng.uniform(0.0, 8.0, (g, k))
        comp[never] = _INF
        comp = np.where(comp > self.stop_all[groups], _INF, comp)
        flat = groups.ravel()
        present = ~absent.ravel()
        self._record(
            flat[present], np.repeat(gids, k)[present], seq, op=ops.ravel()[present],
            nbytes=sizes.ravel()[present], dtype=dtypes.ravel()[present],
            peer=np.full(int(present.sum()), -1, dtype=np.int64), enq=enq.ravel()[present],
            comp=comp.ravel()[present],
        )
        new_t = np.where(np.isfinite(enq), comp, _INF).ravel()
        self.t[flat[present]] = new_t[present]

    def p2p(self, senders: I64, receivers: I64, gids: I64, key: tuple[int, int], *,
            nbytes: int, base_us: float) -> None:
        """One blocking transfer per (sender, receiver) pair."""
        seq = self._next_seq(key)
        k = senders.shape[0]
        es = self.t[senders]
        es = np.where(es >= self.stop_all[senders], _INF, es)
        er = self.t[receivers]
        er = np.where(er >= self.stop_all[receivers], _INF, er)
        factor = np.ones(k)
        if self.plan.link_factor:
            for i, gid in enumerate(gids.tolist()):
                factor[i] = self.plan.link_factor.get(gid, 1.0)
        dur = base_us * factor * self.rng.lognormal(0.0, 0.06, k)
        hiccup = np.asarray(self.rng.random(k) < 0.002)
        dur[hiccup] *= self.rng.uniform(2.0, 6.0, int(hiccup.sum()))
        done = np.maximum(es, er) + dur
        cs = np.where(done > self.stop_all[senders], _INF, done + self.rng.uniform(0, 5.0, k))
        cr = np.where(done > self.stop_all[receivers], _INF, done + self.rng.uniform(0, 5.0, k))
        sizes = np.full(k, nbytes, dtype=np.int64)
        bf16 = np.full(k, _DT["bfloat16"], dtype=np.int64)
        self._record(senders, gids, seq, op=np.full(k, _OP["send"], dtype=np.int64),
                     nbytes=sizes, dtype=bf16, peer=receivers, enq=es, comp=cs)
        self._record(receivers, gids, seq, op=np.full(k, _OP["recv"], dtype=np.int64),
                     nbytes=sizes, dtype=bf16, peer=senders, enq=er, comp=cr)
        self.t[senders] = np.where(np.isfinite(es), cs, _INF)
        self.t[receivers] = np.where(np.isfinite(er), cr, _INF)

    # -- one training step ----------------------------------------------------------------------

    def run_step(self, est_step_us: float) -> None:
        topo, p, plan = self.topo, self.params, self.plan
        grid = self.grid
        if self.step == 0:
            for rank, factor in plan.speed.items():
                self.fault_speed[rank] = factor
        if self.step == plan.stop_step:
            finite = self.t[np.isfinite(self.t)]
            self.stop_time = float(np.median(finite)) + plan.stop_frac * est_step_us
            for r in plan.stop_compute:
                self.stop_compute[r] = self.stop_time
            for r in plan.stop_all:
                self.stop_all[r] = self.stop_time
        finite = self.t[np.isfinite(self.t)]
        self.step_start.append(float(np.median(finite)) if finite.size else _INF)
        tp, pp, dp = topo.tp, topo.pp, topo.dp
        act = p.act_bytes
        tp_us = 2 * (tp - 1) / tp * p.tp_bytes / 200e3 + 15.0  # 200 GB/s NVLink bus bandwidth
        p2p_us = act / 22e3 + 10.0  # 22 GB/s per InfiniBand link
        stage_factor = np.linspace(1.0, 1.08, pp) if pp > 1 else np.ones(1)

        def tp_reduce(stage: int) -> None:
            if tp == 1:
                return
            gids = self.tp_gid[stage]
            base = np.full(dp, tp_us)
            if plan.tp_factor:
                base = base * np.array([plan.tp_factor.get(int(g), 1.0) for g in gids])
            self.collective(grid[stage], gids, (_Fam.TP, stage), nbytes=p.tp_bytes,
                            dtype="bfloat16", base_us=base)

        fwd = p.fwd_us
        for _ in range(p.microbatches):
            for s in range(pp):
                ranks = grid[s].ravel()
                if s > 0:
                    self.p2p(grid[s - 1].ravel(), ranks, self.p2p_gid[s - 1].ravel(),
                             (_Fam.P2P, s - 1), nbytes=act, base_us=p2p_us)
                for half in range(2):
                    self.compute(ranks, fwd / 2 * stage_factor[s], f"forward{half}")
                    tp_reduce(s)
        for _ in range(p.microbatches):
            for s in reversed(range(pp)):
                ranks = grid[s].ravel()
                if s < pp - 1:
                    self.p2p(grid[s + 1].ravel(), ranks, self.p2p_gid[s].ravel(),
                             (_Fam.P2P, s), nbytes=act, base_us=p2p_us)
                for half in range(2):
                    self.compute(ranks, fwd * stage_factor[s], f"backward{half}")
                    tp_reduce(s)
        dp_groups = grid.transpose(0, 2, 1).reshape(pp * tp, dp)
        dp_gids = self.dp_gid.ravel()
        for nbytes in p.grad_bytes:
            ring = 2 * (dp - 1) / dp * nbytes / 20e3 + 12.0 * math.log2(dp)
            base = np.full(pp * tp, ring)
            if plan.dp_slow_groups:
                slow = np.isin(dp_gids, np.fromiter(plan.dp_slow_groups, dtype=np.int64))
                base[slow] *= plan.dp_factor
            self.collective(dp_groups, dp_gids, (_Fam.DP, 0), nbytes=nbytes, dtype="bfloat16",
                            base_us=base)
        world = np.arange(topo.ranks, dtype=np.int64)[None, :]
        self.collective(world, np.array([self.world_gid]), (_Fam.WORLD, 0), nbytes=4,
                        dtype="float32",
                        base_us=np.array([30.0 + 8.0 * math.log2(topo.ranks)]))
        self.compute(np.arange(topo.ranks, dtype=np.int64), 0.04 * fwd, "optimizer")
        self.step_end.append(self.t.copy())
        self.step += 1

    def events(self) -> dict[str, Any]:
        return {
            "rank": np.concatenate(self._rank), "gid": np.concatenate(self._gid),
            "seq": np.concatenate(self._seq), "op": np.concatenate(self._op),
            "nbytes": np.concatenate(self._nbytes), "dtype": np.concatenate(self._dtype),
            "peer": np.concatenate(self._peer), "enq": np.concatenate(self._enq),
            "comp": np.concatenate(self._comp),
        }


# -- stacks ---------------------------------------------------------------------------------------

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


def _frames(where: str, sampled_late: bool) -> tuple[str, ...]:
    inner = _FRAMES[where]
    if sampled_late and inner[-1] == _ALL_REDUCE[-1]:
        # py-spy caught the rank in the wrapper around the call: a benign variant.
        inner = inner[:-1]
    return (*_TRAIN, *inner)


# -- scenario drawing -----------------------------------------------------------------------------


_CRASH_CODES = {"oom_kill": -9, "segfault": -11, "abort": -6, "exception": 1}
_STALLED = {"compute_stuck", "sigstop", "op_hang", "skip", "xid_hang", "nvlink_hang",
            "dataloader", "storage_read", "cuda_sync"}


def _pick(rng: np.random.Generator, options: Sequence[str], weights: Sequence[float]) -> str:
    w = np.asarray(weights, dtype=np.float64)
    return str(options[int(rng.choice(len(options), p=w / w.sum()))])


@dataclass(slots=True)
class _Draft:
    """A fault being planned: the plan for the engine and what to report about it."""

    plan: _Plan
    kind: IncidentKind | None
    variant: str = ""
    culprits: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    link: tuple[int, int] | None = None
    health: list[tuple[int, str, str, float, HealthSeverity, str, str]] = field(
        default_factory=list)
    """(rank, metric, device, value, severity, detail, when): when is "stop", "start" or
    "onset"."""
    onset_step: int = 0
    silent: tuple[int, ...] = ()


def _draft(kind: IncidentKind | None, variant: str | None, *, topo: Topology, eng: _Engine,
           params: _Params, steps: int, rng: np.random.Generator) -> _Draft:
    plan = eng.plan
    n = topo.ranks
    culprit = int(rng.integers(n))
    stage = topo.coords(culprit)[0]
    f = int(rng.integers(2, steps)) if steps > 2 else steps - 1
    d = _Draft(plan=plan, kind=kind)

    def device(rank: int) -> str:
        return f"gpu{rank % topo.gpus_per_node}"

    def seq_at(fam: _Fam, step: int, idx: int) -> int:
        return eng.base_seq[fam] + step * eng.per_step[fam] + idx + 1

    if kind is None:
        d.variant = "healthy"
        return d
    if kind is IncidentKind.HANG:
        d.variant = variant or _pick(rng, ("compute_stuck", "sigstop"), (0.5, 0.5))
        plan.stop_step, plan.stop_frac = f, float(rng.uniform(0.05, 0.95))
        if d.variant == "compute_stuck":
            plan.stop_compute = (culprit,)
        else:
            plan.stop_all = (culprit,)
        d.culprits = (culprit,)
    elif kind is IncidentKind.CRASH:
        d.variant = variant or _pick(rng, tuple(_CRASH_CODES), (0.3, 0.15, 0.2, 0.35))
        plan.stop_step, plan.stop_frac = f, float(rng.uniform(0.05, 0.95))
        plan.stop_all = (culprit,)
        d.culprits = (culprit,)
    elif kind is IncidentKind.MISMATCH:
        d.variant = variant or _pick(rng, ("op_hang", "size", "dtype", "skip"),
                                     (0.35, 0.2, 0.2, 0.25))
        use_tp = topo.tp > 1 and d.variant != "skip" and rng.random() < 0.5
        fam = _Fam.TP if use_tp else _Fam.DP
        key = (int(fam), stage if use_tp else 0)
        if d.variant in ("size", "dtype"):
            f = int(rng.integers(1, max(steps - 1, 2)))
        idx = 0 if d.variant == "skip" else int(rng.integers(eng.per_step[fam]))
        nbytes = params.tp_bytes if use_tp else params.grad_bytes[idx]
        o = _Override(key=key, seq=seq_at(fam, f, idx), rank=culprit, nbytes=nbytes)
        if d.variant == "op_hang":
            o.op = _pick(rng, ("all_gather_into_tensor", "reduce_scatter_tensor", "broadcast"),
                         (0.4, 0.3, 0.3))
            o.hang = True
        elif d.variant == "size":
            o.nbytes = int(nbytes * float(rng.choice([0.5, 2.0]))) if rng.random() < 0.7 \
                else nbytes - 2 * int(rng.integers(1, 64))
        elif d.variant == "dtype":
            o.dtype, o.nbytes = "float32", 2 * nbytes
        else:
            o.nbytes = params.grad_bytes[1]
            o.skip_next = True
        plan.override = o
        d.culprits = (culprit,)
        d.onset_step = f
    elif kind is IncidentKind.STRAGGLER:
        d.variant = variant or "slow_gpu"
        plan.speed[culprit] = float(rng.uniform(1.2, 2.0))
        plan.slow_from_step = int(rng.integers(0, 2)) if rng.random() < 0.3 else 0
        d.onset_step = plan.slow_from_step
        d.culprits = (culprit,)
    elif kind is IncidentKind.SLOW_LINK:
        if topo.pp < 2:
            raise ValueError("a slow link needs pipeline stages (pp >= 2)")
        d.variant = variant or _pick(rng, ("pair", "node"), (0.65, 0.35))
        if d.variant == "pair":
            b = int(rng.integers(topo.pp - 1))
            dd, t = int(rng.integers(topo.dp)), int(rng.integers(topo.tp))
            plan.link_factor[int(eng.p2p_gid[b, dd, t])] = float(rng.uniform(1.6, 4.0))
            lo, hi = int(eng.grid[b, dd, t]), int(eng.grid[b + 1, dd, t])
            d.link, d.culprits = (lo, hi), (lo, hi)
        else:
            node = culprit // topo.gpus_per_node
            ranks = topo.node_ranks(node)
            factor = float(rng.uniform(1.5, 3.0))
            for gid in range(len(eng.names)):
                if eng.family[gid] == _Fam.P2P and np.isin(eng.members[gid], ranks).any():
                    plan.link_factor[gid] = factor
            plan.dp_factor = float(rng.uniform(1.1, 1.4))
            plan.dp_slow_groups = frozenset(
                int(eng.dp_gid[topo.coords(r)[0], topo.coords(r)[2]]) for r in ranks)
            d.culprits = ranks
    elif kind is IncidentKind.HARDWARE:
        d.variant = variant or _pick(rng, ("thermal", "xid_hang", "nvlink_slow", "nvlink_hang"),
                                     (0.35, 0.35, 0.2, 0.1))
        node = culprit // topo.gpus_per_node
        tp_peers = tuple(int(r) for r in eng.grid[stage, topo.coords(culprit)[1]])
        if d.variant == "thermal":
            plan.speed[culprit] = float(rng.uniform(1.25, 1.8))
            plan.slow_from_step = int(rng.integers(0, 2))
            d.onset_step = plan.slow_from_step
            temp = float(rng.uniform(89.0, 96.0))
            d.health += [
                (culprit, "throttle", device(culprit), 1.0, HealthSeverity.WARNING,
                 "HW thermal slowdown (clocks event reason 0x40)", "onset"),
                (culprit, "temperature_c", device(culprit), temp, HealthSeverity.WARNING,
                 f"GPU temperature {temp:.0f} C above the slowdown threshold", "onset"),
            ]
            d.culprits = (culprit,)
        elif d.variant == "xid_hang":
            xid = int(rng.choice([79, 48]))
            plan.stop_step, plan.stop_frac = f, float(rng.uniform(0.05, 0.95))
            plan.stop_compute = (culprit,)
            detail = ("Xid 79: GPU has fallen off the bus" if xid == 79
                      else "Xid 48: double bit ECC error")
            d.health.append((culprit, "xid", device(culprit), float(xid),
                             HealthSeverity.CRITICAL, detail, "stop"))
            if xid == 48:
                d.health.append((culprit, "ecc_uncorrectable", device(culprit), 1.0,
                                 HealthSeverity.CRITICAL, "volatile DBE count 1", "stop"))
            d.culprits = (culprit,)
        elif d.variant == "nvlink_slow":
            # NVLink degraded: the TP traffic partly falls back to PCIe, 3..8x slower.
            factor = float(rng.uniform(3.0, 8.0))
            for r in topo.node_ranks(node):
                p, dd, _ = topo.coords(r)
                plan.tp_factor[int(eng.tp_gid[p, dd])] = factor
            errors = float(rng.integers(40, 4000))
            d.health.append((culprit, "nvlink_errors", device(culprit), errors,
                             HealthSeverity.WARNING, f"{errors:.0f} NVLink replay errors",
                             "start"))
            d.culprits = (culprit, *[r for r in topo.node_ranks(node) if r != culprit])
        else:
            per = eng.per_step[_Fam.TP]
            plan.stall = ((int(_Fam.TP), stage), seq_at(_Fam.TP, f, int(rng.integers(per))),
                          culprit)
            d.health.append((culprit, "xid", device(culprit), 74.0, HealthSeverity.CRITICAL,
                             "Xid 74: NVLink error", "stall"))
            d.culprits = (culprit, *[r for r in tp_peers if r != culprit])
        d.nodes = (node_name(node),)
    elif kind is IncidentKind.SILENT_HANG:
        d.variant = variant or _pick(rng, ("dataloader", "storage_read", "cuda_sync"),
                                     (0.45, 0.35, 0.2))
        node = culprit // topo.gpus_per_node
        u = rng.random()
        if u < 0.6:
            d.culprits = (culprit,)
        elif u < 0.8:
            others = [r for r in topo.node_ranks(node) if r != culprit]
            extra = rng.choice(others, size=int(rng.integers(1, 3)), replace=False)
            d.culprits = (culprit, *sorted(int(r) for r in extra))
        else:
            d.culprits = (culprit, *[r for r in topo.node_ranks(node) if r != culprit])
        plan.stall = ((int(_Fam.WORLD), 0), seq_at(_Fam.WORLD, f, 0), culprit)
        d.silent = d.culprits
    else:
        raise ValueError(f"cannot simulate {kind}")
    if not d.nodes:
        d.nodes = tuple(sorted({topo.node_of(r) for r in d.culprits}))
    return d


def _red_herrings(d: _Draft, topo: Topology, steps: int, rng: np.random.Generator) -> None:
    """Benign noise every job has some of; more of it in healthy runs."""
    healthy = d.kind is None
    plan = d.plan
    n = topo.ranks
    if rng.random() < (0.6 if healthy else 0.3):
        plan.spike = (int(rng.integers(n)), int(rng.integers(steps)),
                      float(rng.uniform(100_000.0, 400_000.0)))
    if rng.random() < (0.4 if healthy else 0.15):
        rank = int(rng.integers(n))
        plan.speed.setdefault(rank, float(rng.uniform(1.02, 1.05)))
    if rng.random() < (0.35 if healthy else 0.1):
        rank = int(rng.integers(n))
        if topo.node_of(rank) not in d.nodes:
            metric, value, detail = [
                ("pcie_replays", float(rng.integers(1, 20)), "PCIe replay counter increased"),
                ("ecc_correctable", float(rng.integers(1, 8)), "single bit ECC errors"),
                ("nic_errors", float(rng.integers(1, 30)), "link-level retransmissions"),
            ][int(rng.integers(3))]
            d.health.append((rank, metric, f"gpu{rank % topo.gpus_per_node}", value,
                             HealthSeverity.WARNING, detail, "any"))


# -- the simulation -------------------------------------------------------------------------------


def simulate(
    *,
    ranks: int,
    fault: IncidentKind | str | None,
    seed: int,
    variant: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    steps: int = 6,
    microbatches: int | None = None,
    job: str | None = None,
    attempt: int = 0,
) -> SimulatedJob:
    """Simulate one detection window of a job of `ranks` ranks with `fault` injected.

    `fault`: an `IncidentKind` (or its value) from `FAULT_KINDS`, or None / "healthy".
    `variant`: force one form of the fault (see the module docstring); drawn when None.
    `tp`, `pp`: the layout (drawn when None); `steps`: training steps in the window (>= 3)."""
    kind = None if fault in (None, "healthy") else IncidentKind(fault)
    if kind is not None and kind not in FAULT_KINDS:
        raise ValueError(f"cannot simulate {kind.value}; choose from "
                         f"{', '.join(k.value for k in FAULT_KINDS)} or healthy")
    if steps < 3:
        raise ValueError(f"steps must be >= 3, got {steps}")
    rng = np.random.default_rng([seed, ranks, FAULT_KINDS.index(kind) + 1 if kind else 0])
    if tp is None or pp is None:
        drawn = default_topology(ranks, rng, need_pp=kind is IncidentKind.SLOW_LINK)
        tp, pp = tp or drawn.tp, pp or drawn.pp
    topo = Topology(ranks=ranks, tp=tp, pp=pp)
    m = microbatches or (4 if ranks <= 256 else 2)
    step_target_us = float(rng.uniform(100_000.0, 450_000.0))
    act = int(rng.choice([2048, 4096])) * int(rng.choice([4096, 5120, 8192])) * 2
    params_per_rank = float(rng.uniform(100e6, 400e6))
    split = rng.dirichlet([4.0, 3.0, 1.5])
    grad = tuple(int(params_per_rank * 2 * x) // 2 * 2 for x in split)
    dp_us = sum(2 * (topo.dp - 1) / topo.dp * g / 20e3 for g in grad)
    fwd = max(2_000.0, (step_target_us - dp_us) / ((m + pp - 1) * 4.0))
    # TP traffic takes 6..15% of the compute it interleaves with (8 ranks on NVLink).
    tp_bytes = int(rng.uniform(0.06, 0.15) * fwd / 2 * 200e3 / (2 * (tp - 1) / tp)) if tp > 1 \
        else 0
    tp_bytes -= tp_bytes % 1024
    params = _Params(fwd_us=fwd, act_bytes=act, tp_bytes=tp_bytes, grad_bytes=grad,
                     microbatches=m,
                     base_step=int(rng.integers(200, 20_000)),
                     jitter=float(rng.uniform(0.015, 0.035)), spike_p=2e-4)
    eng = _Engine(topo, params, _Plan(), rng)
    draft = _draft(kind, variant, topo=topo, eng=eng, params=params, steps=steps, rng=rng)
    _red_herrings(draft, topo, steps, rng)

    est = (m + pp - 1) * 3.1 * fwd + dp_us
    stops = draft.variant in _STALLED or kind is IncidentKind.CRASH
    durations: list[float] = []
    # A stopping fault runs on until every rank is blocked (a step or two after the fault).
    for i in range(steps + 3 if stops else steps):
        eng.run_step(est)
        ends = eng.step_end[-1]
        if not np.isfinite(ends).any() or (i + 1 >= steps and not stops):
            break
        if eng.plan.stop_step < 0 or i < eng.plan.stop_step:
            durations.append(float(np.median(ends)) - eng.step_start[-1])
            est = float(np.median(durations))
    return _finish(eng, draft, seed=seed, job=job, attempt=attempt, est_step_us=est)


def _rank_slots(eng: _Engine) -> I64:
    """Per rank, the groups it belongs to: world, tp, dp, pp, p2p to the previous and to the
    next stage (-1 where there is none)."""
    topo = eng.topo
    r = np.arange(topo.ranks, dtype=np.int64)
    stage, d, t = r // (topo.tp * topo.dp), (r // topo.tp) % topo.dp, r % topo.tp
    slots = np.full((topo.ranks, 6), -1, dtype=np.int64)
    slots[:, 0] = eng.world_gid
    slots[:, 1] = eng.tp_gid[stage, d]
    slots[:, 2] = eng.dp_gid[stage, t]
    if topo.pp > 1:
        slots[:, 3] = eng.pp_gid[d, t]
        prev, nxt = stage > 0, stage < topo.pp - 1
        slots[prev, 4] = eng.p2p_gid[stage[prev] - 1, d[prev], t[prev]]
        slots[nxt, 5] = eng.p2p_gid[stage[nxt], d[nxt], t[nxt]]
    return slots


def _last_by_key(keys: I64, seqs: I64) -> tuple[I64, I64]:
    """Sorted distinct keys and, per key, the index of its row with the highest seq."""
    if keys.size == 0:
        return keys, keys
    order = np.lexsort((seqs, keys))
    ks = keys[order]
    last = np.ones(ks.shape[0], dtype=bool)
    last[:-1] = ks[1:] != ks[:-1]
    return ks[last], order[last]


def _lookup(uniq: I64, query: I64) -> tuple[I64, Bools]:
    if uniq.size == 0:
        return np.zeros_like(query), np.zeros(query.shape, dtype=bool)
    idx = np.searchsorted(uniq, query).clip(0, uniq.shape[0] - 1)
    return idx, uniq[idx] == query


def _cascade(eng: _Engine, ev: Mapping[str, Any], culprit: int, *, t_fail: float,
             slots: I64, rng: np.random.Generator) -> tuple[F64, I64]:
    """Exit times and codes after `culprit` died at `t_fail`: whoever waits in a group with a
    dead rank fails a little later (connection reset, NCCL error), the launcher kills the rest."""
    import heapq

    n = eng.topo.ranks
    pending = ~np.isfinite(ev["comp"])
    pend_gid = np.full(n, -1, dtype=np.int64)
    pend_gid[ev["rank"][pending]] = ev["gid"][pending]
    waiting: dict[int, list[int]] = {}
    for r in np.flatnonzero(pend_gid >= 0).tolist():
        waiting.setdefault(int(pend_gid[r]), []).append(r)
    delay = {_Fam.TP: (20_000.0, 150_000.0), _Fam.P2P: (20_000.0, 200_000.0),
             _Fam.DP: (50_000.0, 400_000.0), _Fam.WORLD: (500_000.0, 1_000_000.0)}
    exit_t = np.full(n, _INF)
    code = np.zeros(n, dtype=np.int64)
    exit_t[culprit] = t_fail
    heap = [(t_fail, culprit)]
    triggered: set[int] = set()
    while heap:
        when, rank = heapq.heappop(heap)
        if when > exit_t[rank]:
            continue
        for gid in slots[rank].tolist():
            if gid < 0 or gid in triggered or eng.family[gid] < 0:
                continue
            triggered.add(gid)
            low, mean = delay[_Fam(int(eng.family[gid]))]
            for peer in waiting.get(gid, ()):
                if peer == rank:
                    continue
                at = when + low + float(rng.exponential(mean))
                if at < exit_t[peer]:
                    exit_t[peer] = at
                    code[peer] = 1
                    heapq.heappush(heap, (at, peer))
    kill = t_fail + float(rng.uniform(2_000_000.0, 6_000_000.0))
    late = exit_t > kill
    exit_t[late] = kill + rng.uniform(0.0, 300_000.0, int(late.sum()))
    code[late] = -15
    return exit_t, code


def _finish(eng: _Engine, d: _Draft, *, seed: int, job: str | None, attempt: int,
            est_step_us: float) -> SimulatedJob:
    topo, rng, plan, params = eng.topo, eng.rng, d.plan, eng.params
    n = topo.ranks
    job_id = JobId(job or f"sim-{seed}")
    t0 = BASE_EPOCH_US + (seed % 100_000) * 3_600 * _US
    ev = eng.events()
    rank, gid, seq, enq, comp = ev["rank"], ev["gid"], ev["seq"], ev["enq"], ev["comp"]
    stalled = d.variant in _STALLED
    crashed = d.kind is IncidentKind.CRASH
    ends = [float(np.median(e[np.isfinite(e)])) for e in eng.step_end if np.isfinite(e).any()]

    # When the fault struck and when the analysis looks.
    if math.isfinite(eng.stop_time) and (stalled or crashed):
        fault = eng.stop_time
    elif stalled:
        stuck = ~np.isfinite(comp)
        fault = float(enq[stuck].min()) if stuck.any() else ends[-1]
    elif d.onset_step and d.onset_step < len(eng.step_start):
        fault = eng.step_start[d.onset_step]
    else:
        fault = 0.0
    if crashed:
        now = fault + float(rng.uniform(700_000.0, 8_000_000.0))
    elif stalled:
        now = fault + float(rng.uniform(8_000_000.0, 25_000_000.0))
    else:
        now = ends[-2] + float(rng.uniform(0.3, 0.95)) * (ends[-1] - ends[-2])
    skew = rng.normal(0.0, 30.0, topo.nodes)  # chrony-synced clocks
    rank_skew = np.repeat(skew, topo.gpus_per_node)

    def at(rel: F64 | float, ranks: I64 | int) -> I64:
        return np.rint(t0 + np.asarray(rel) + rank_skew[ranks]).astype(np.int64)

    slots = _rank_slots(eng)
    exit_t = np.full(n, _INF)
    code = np.zeros(n, dtype=np.int64)
    if crashed:
        exit_t, code = _cascade(eng, ev, d.culprits[0], t_fail=fault, slots=slots, rng=rng)
        code[d.culprits[0]] = _CRASH_CODES[d.variant]
    exited = exit_t <= now

    # Events: those entered by now; a pending op of a rank that failed ends as a failed event.
    failed = ~np.isfinite(comp) & (code[rank] == 1) & exited[rank]
    if crashed:  # the first to die recorded nothing of the op it died in
        failed &= rank != d.culprits[0]
    comp = np.where(failed, exit_t[rank], comp)
    hbt = now - rng.uniform(0.0, 500_000.0, n)
    frozen = np.array(plan.stop_all, dtype=np.int64)
    if frozen.size and math.isfinite(eng.stop_time):
        hbt[frozen] = np.minimum(hbt[frozen],
                                 eng.stop_time - rng.uniform(0.0, 500_000.0, frozen.size))
    hbt = np.where(exited, np.minimum(hbt, exit_t - rng.uniform(0.0, 500_000.0, n)), hbt)
    done = comp <= now
    keep = (enq < now) & done
    columns = CollectiveColumns(
        rank=rank[keep].copy(),
        group=np.asarray(eng.names)[gid[keep]],
        seq=seq[keep].copy(),
        op=np.asarray(OPS)[ev["op"][keep]],
        nbytes=ev["nbytes"][keep].copy(),
        dtype=np.asarray(DTYPES)[ev["dtype"][keep]],
        peer=ev["peer"][keep].copy(),
        completed=~failed[keep],
        enqueue_us=at(enq[keep], rank[keep]),
        complete_us=at(comp[keep], rank[keep]),
    )

    heartbeats = _heartbeats(eng, ev, comp=comp, hbt=hbt, slots=slots, job=job_id,
                             attempt=attempt, t0=t0, rank_skew=rank_skew, seed=seed)
    exits = tuple(sorted(
        (RankExit(job=job_id, attempt=attempt, node=NodeId(topo.node_of(r)), rank=Rank(r),
                  pid=_pid(r, seed), exit_code=int(code[r]), time_us=int(at(exit_t[r], r)))
         for r in np.flatnonzero(exited).tolist()),
        key=lambda e: (e.time_us, e.rank),
    ))
    groups = tuple(
        ProcessGroupInfo(job=job_id, attempt=attempt, rank=Rank(int(members.min())),
                         group=GroupId(name), ranks=tuple(members.tolist()),
                         backend="p2p" if ":p2p:" in name else "nccl",
                         time_us=t0 - params.base_step * int(est_step_us) - 60 * _US)
        for name, members in zip(eng.names, eng.members, strict=True)
    )
    stacks: tuple[StackSample, ...] = ()
    if stalled:
        stacks = _stacks(eng, ev, comp=comp, exited=exited, d=d, now=now, job=job_id,
                         attempt=attempt, t0=t0, rank_skew=rank_skew)
    health = _health(d, eng, job=job_id, t0=t0, now=now, fault=fault)
    truth = Truth(
        kind=d.kind, culprit_ranks=d.culprits, culprit_nodes=d.nodes, link=d.link,
        variant=d.variant, fault_us=t0 + round(fault) if fault else 0,
    )
    info = {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "microbatches": params.microbatches,
            "step_ms": round(est_step_us / 1000, 1), "fwd_ms": round(params.fwd_us / 1000, 2),
            "act_bytes": params.act_bytes, "tp_bytes": params.tp_bytes,
            "grad_bytes": list(params.grad_bytes),
            "base_step": params.base_step}
    return SimulatedJob(
        job=job_id, attempt=attempt, topology=topo,
        rank_nodes={r: topo.node_of(r) for r in range(n)}, groups=groups,
        heartbeats=heartbeats, exits=exits, columns=columns, stacks=stacks, health=health,
        window_start_us=t0, window_end_us=t0 + round(now), now_us=t0 + round(now),
        truth=truth, step_us=est_step_us, info=info,
    )


def _pid(rank: int, seed: int) -> int:
    return 10_000 + 37 * (rank % 8) + seed % 997


def _heartbeats(eng: _Engine, ev: Mapping[str, Any], *, comp: F64, hbt: F64, slots: I64,
                job: JobId, attempt: int, t0: int, rank_skew: F64,
                seed: int) -> tuple[Heartbeat, ...]:
    """Each rank's latest heartbeat at its own time `hbt`: progress per group as the recorder
    counts it from the events entered and completed by then."""
    topo = eng.topo
    n = topo.ranks
    ng = len(eng.names)
    rank, gid, seq, enq = ev["rank"], ev["gid"], ev["seq"], ev["enq"]
    key = rank * ng + gid
    entered = enq <= hbt[rank]
    ek, erow = _last_by_key(key[entered], seq[entered])
    erow = np.flatnonzero(entered)[erow]
    finished = comp <= hbt[rank]
    ck, crow = _last_by_key(key[finished], seq[finished])
    crow = np.flatnonzero(finished)[crow]
    ranks = np.arange(n, dtype=np.int64)
    before = t0 - 50_000  # the window starts a moment after the previous step ended
    cols: list[tuple[list[int], list[int], list[str], list[int], list[int]]] = []
    names = np.asarray(eng.names)
    for j in range(slots.shape[1]):
        g = slots[:, j]
        fam = np.where(g >= 0, eng.family[g.clip(0)], -1)
        base = np.zeros(n, dtype=np.int64)
        for f, b in eng.base_seq.items():
            base[fam == f] = b
        q = ranks * ng + g
        ei, ef = _lookup(ek, q)
        ci, cf = _lookup(ck, q)
        er, cr = erow[ei], crow[ci]
        last_enq = np.where(ef, seq[er], base)
        last_comp = np.where(cf, seq[cr], base)
        enq_us = np.where(ef, np.rint(t0 + enq[er] + rank_skew), np.where(base > 0, before, 0))
        comp_rel = np.where(cf, comp[cr], 0.0)
        comp_us = np.where(cf, np.rint(t0 + comp_rel + rank_skew),
                           np.where(base > 0, before, 0))
        pending = ef & (last_enq > last_comp)
        op = np.where(pending, np.asarray(OPS)[ev["op"][er]], "")
        cols.append((last_enq.tolist(), last_comp.tolist(), op.tolist(),
                     enq_us.astype(np.int64).tolist(), comp_us.astype(np.int64).tolist()))
    slot_names = [np.where(slots[:, j] >= 0, names[slots[:, j].clip(0)], "").tolist()
                  for j in range(slots.shape[1])]
    ends = np.stack(eng.step_end) if eng.step_end else np.zeros((0, n))
    reached = ends <= hbt[None, :]
    steps = reached.sum(axis=0)
    step_rel = np.where(reached, ends, -_INF).max(axis=0, initial=-_INF)
    step_us = np.where(steps > 0, np.rint(t0 + np.where(steps > 0, step_rel, 0) + rank_skew),
                       before).astype(np.int64).tolist()
    hb_us = np.rint(t0 + hbt + rank_skew).astype(np.int64).tolist()
    base_step = eng.params.base_step
    first_step = t0 - int(base_step * 300_000)
    out: list[Heartbeat] = []
    for r in range(n):
        progress = tuple(
            GroupProgress(group=GroupId(slot_names[j][r]), last_enqueued=cols[j][0][r],
                          last_completed=cols[j][1][r], pending_op=cols[j][2][r],
                          last_enqueue_us=cols[j][3][r], last_complete_us=cols[j][4][r])
            for j in range(slots.shape[1]) if slot_names[j][r]
        )
        out.append(Heartbeat(
            job=job, attempt=attempt, node=NodeId(topo.node_of(r)), rank=Rank(r),
            time_us=hb_us[r], pid=_pid(r, seed), step=base_step + int(steps[r]),
            step_us=step_us[r], start_step=0, first_step_us=first_step, dropped=0,
            groups=progress,
        ))
    return tuple(out)


def _stacks(eng: _Engine, ev: Mapping[str, Any], *, comp: F64, exited: Bools, d: _Draft,
            now: float, job: JobId, attempt: int, t0: int,
            rank_skew: F64) -> tuple[StackSample, ...]:
    """The latest stack of every live rank, sampled in the last second before `now`."""
    topo, rng = eng.topo, eng.rng
    n = topo.ranks
    ts = now - rng.uniform(0.0, 1_000_000.0, n)
    rank, enq = ev["rank"], ev["enq"]
    waiting = (enq <= ts[rank]) & (comp > ts[rank])
    where: list[str] = ["compute"] * n
    alt_op: dict[int, str] = {}
    m2 = 2 * eng.params.microbatches
    for row in np.flatnonzero(waiting).tolist():
        r = int(rank[row])
        fam = int(eng.family[int(ev["gid"][row])])
        op = OPS[int(ev["op"][row])]
        if fam == _Fam.TP:
            idx = (int(ev["seq"][row]) - eng.base_seq[_Fam.TP] - 1) % eng.per_step[_Fam.TP]
            where[r] = "tp_forward" if idx < m2 else "tp_backward"
        elif fam == _Fam.P2P:
            where[r] = op
        else:
            where[r] = "dp" if fam == _Fam.DP else "world"
        if op not in ("all_reduce", "send", "recv"):
            alt_op[r] = op
    for r, phase in eng.stuck_phase.items():
        if where[r] == "compute":
            where[r] = ("compute_backward" if phase.startswith("backward") else
                        "optimizer" if phase == "optimizer" else "compute")
    for r in d.silent:
        where[r] = d.variant
    late = rng.random(n) < 0.04
    out: list[StackSample] = []
    for r in range(n):
        if exited[r]:
            continue
        frames = _frames(where[r], bool(late[r]) and r not in d.silent)
        if r in alt_op:
            frames = (*frames[:-1], f"torch/distributed/distributed_c10d.py:3290 {alt_op[r]}")
        out.append(StackSample(job=job, attempt=attempt, node=NodeId(topo.node_of(r)),
                               rank=Rank(r), time_us=round(t0 + ts[r] + rank_skew[r]),
                               frames=frames))
    return tuple(out)


def _health(d: _Draft, eng: _Engine, *, job: JobId, t0: int, now: float,
            fault: float) -> tuple[HealthSample, ...]:
    """Benign INFO metrics of every GPU, plus the fault's and the red herrings' events."""
    topo, rng = eng.topo, eng.rng
    n = topo.ranks
    times = t0 + np.rint(rng.uniform(0.0, now, (2, n))).astype(np.int64)
    temp = rng.normal(62.0, 5.0, n).clip(35.0, 83.0)
    clock = 1980.0 - rng.exponential(25.0, n)
    hot = {r for r, metric, *_ in d.health if metric == "throttle"}
    for r in hot:
        temp[r] = float(rng.uniform(88.0, 95.0))
        clock[r] = float(rng.uniform(1100.0, 1500.0))
    out: list[HealthSample] = []
    for r in range(n):
        node = NodeId(topo.node_of(r))
        dev = f"gpu{r % topo.gpus_per_node}"
        out.append(HealthSample(job=job, node=node, device=dev, time_us=int(times[0, r]),
                                source="nvml", metric="temperature_c",
                                value=round(float(temp[r]), 1), severity=HealthSeverity.INFO))
        out.append(HealthSample(job=job, node=node, device=dev, time_us=int(times[1, r]),
                                source="nvml", metric="sm_clock_mhz",
                                value=round(float(clock[r])), severity=HealthSeverity.INFO))
    for r, metric, dev, value, severity, detail, when in d.health:
        if when in ("stop", "stall"):
            rel = fault + float(rng.uniform(0.0, 300_000.0))
        elif when == "onset":
            start = eng.step_start[d.onset_step] if d.onset_step < len(eng.step_start) else 0.0
            rel = max(0.0, start - float(rng.uniform(0.0, 200_000.0)))
        elif when == "start":
            rel = float(rng.uniform(0.0, 0.1)) * now
        else:
            rel = float(rng.uniform(0.0, now))
        out.append(HealthSample(job=job, node=NodeId(topo.node_of(r)), device=dev,
                                time_us=t0 + round(min(rel, now - 1)), source="nvml",
                                metric=metric, value=value, severity=severity, detail=detail))
    return tuple(out)


# -- into the store -------------------------------------------------------------------------------


def write_to_store(sim: SimulatedJob, store: TraceStore, *, chunk: int = 20_000) -> None:
    """Everything the job reported, into a trace store: the collective columns in one insert,
    the other records in batches of `chunk` (batch ids unique per job and attempt)."""
    prefix = f"sim-{sim.job}-{sim.attempt}"
    store.insert_columns(sim.job, sim.attempt, sim.columns, sim.node_of_rank(),
                         batch_id=f"{prefix}-collectives")
    records: list[Record] = [*sim.groups, *sim.heartbeats, *sim.exits, *sim.stacks, *sim.health]
    for i in range(0, len(records), chunk):
        store.insert(Batch(batch_id=f"{prefix}-records-{i // chunk}",
                           records=tuple(records[i:i + chunk])))
