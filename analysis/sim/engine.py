"""The timing engine: every rank's timeline at once, one numpy primitive at a time.

Times are float microseconds from the window start, `inf` meaning never. A rank computes for a
while (`compute`), then enters a collective with its group (`collective`) or a transfer with its
pipeline neighbour (`p2p`). A collective completes for every member when its last member has
entered, plus its transfer time; a rank that never enters (stuck, frozen, dead) leaves its peers
pending, which is how one stuck rank stops its TP group, the next pipeline stage and then every
DP replica. A `Plan` says how an injected fault perturbs these timelines; the workload decides
which primitives a training step runs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tracehound.analysis.sim.topology import Family, GroupLayout
from tracehound.tracing.summaries import F64, I64

INF = math.inf
Bools = npt.NDArray[np.bool_]

OPS = ("all_reduce", "send", "recv", "all_gather_into_tensor", "reduce_scatter_tensor",
       "broadcast")
"""The ops events are recorded with, by code."""
DTYPES = ("bfloat16", "float32")
"""The dtypes events are recorded with, by code."""
_OP = {name: i for i, name in enumerate(OPS)}
_DT = {name: i for i, name in enumerate(DTYPES)}


@dataclass(slots=True)
class Override:
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
class Plan:
    """How a fault perturbs the timeline; everything default is a healthy job."""

    speed: dict[int, float] = field(default_factory=dict)
    """Persistent compute multiplier per rank."""
    slow_from_step: int = 0
    slow_groups: dict[int, float] = field(default_factory=dict)
    """gid -> multiplier of the time its collectives or transfers take."""
    stop_step: int = -1
    """At the start of this step the stop times below are set (relative to the step start)."""
    stop_frac: float = 0.5
    stop_compute: tuple[int, ...] = ()
    """Ranks whose GPU work never finishes after the stop time (the process still runs)."""
    stop_all: tuple[int, ...] = ()
    """Ranks that do nothing at all after the stop time (frozen or dead)."""
    stall: tuple[tuple[int, int], int, int] | None = None
    """(family key, seq, rank): the collective of that rank's group never completes."""
    override: Override | None = None
    spike: tuple[int, int, float] | None = None
    """(rank, step, us): one long pause (GC, page cache) in one compute segment."""


@dataclass(frozen=True, slots=True, eq=False)
class Events:
    """Every event the ranks entered, as parallel columns (times relative, `comp` inf when the
    op never completes; `op` and `dtype` are codes into OPS and DTYPES)."""

    rank: I64
    gid: I64
    seq: I64
    op: I64
    nbytes: I64
    dtype: I64
    peer: I64
    enq: F64
    comp: F64


@dataclass(slots=True)
class _Chunks:
    """Events as recorded, one array per primitive call, concatenated at the end."""

    rank: list[I64] = field(default_factory=list)
    gid: list[I64] = field(default_factory=list)
    seq: list[I64] = field(default_factory=list)
    op: list[I64] = field(default_factory=list)
    nbytes: list[I64] = field(default_factory=list)
    dtype: list[I64] = field(default_factory=list)
    peer: list[I64] = field(default_factory=list)
    enq: list[F64] = field(default_factory=list)
    comp: list[F64] = field(default_factory=list)


class Engine:
    """The timelines of every rank of a layout under a plan (see the module docstring)."""

    def __init__(self, layout: GroupLayout, plan: Plan, rng: np.random.Generator, *,
                 base_seq: Mapping[Family, int], jitter: float, spike_p: float) -> None:
        topo = layout.topo
        n = topo.ranks
        self.layout, self.topo, self.plan, self.rng = layout, topo, plan, rng
        self.base_seq = dict(base_seq)
        """Per family, the last sequence number issued before the window."""
        self.jitter, self.spike_p = jitter, spike_p
        self.seq: dict[tuple[int, int], int] = {}
        self.t: F64 = 1_000.0 + rng.uniform(0.0, 2_000.0, n)
        self.stop_all: F64 = np.full(n, INF)
        self.stop_compute: F64 = np.full(n, INF)
        speed = rng.normal(1.0, 0.008, n).clip(0.97, 1.03)
        speed *= np.repeat(rng.normal(1.0, 0.004, topo.nodes).clip(0.99, 1.01),
                           topo.gpus_per_node)
        self.base_speed: F64 = speed
        self.fault_speed: F64 = np.ones(n)
        self.stuck_phase: dict[int, str] = {}
        """Rank -> the compute phase it got stuck in."""
        self.step = 0
        self.step_start: list[float] = []
        """Per step, the median time the ranks started it."""
        self.step_end: list[F64] = []
        """Per step, when each rank finished it."""
        self.stop_time = INF
        self.skipping: set[int] = set()
        self._chunks = _Chunks()

    # -- steps ----------------------------------------------------------------------------------

    def begin_step(self, est_step_us: float) -> None:
        """Start a step: the fault's speeds from the first step, its stop times from its stop
        step (`stop_frac` of an estimated step after the median rank started it)."""
        plan = self.plan
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
        self.step_start.append(float(np.median(finite)) if finite.size else INF)

    def end_step(self) -> None:
        self.step_end.append(self.t.copy())
        self.step += 1

    def events(self) -> Events:
        c = self._chunks
        return Events(
            rank=np.concatenate(c.rank), gid=np.concatenate(c.gid),
            seq=np.concatenate(c.seq), op=np.concatenate(c.op),
            nbytes=np.concatenate(c.nbytes), dtype=np.concatenate(c.dtype),
            peer=np.concatenate(c.peer), enq=np.concatenate(c.enq),
            comp=np.concatenate(c.comp),
        )

    # -- primitives -----------------------------------------------------------------------------

    def _next_seq(self, key: tuple[int, int]) -> int:
        seq = self.seq.get(key, self.base_seq[Family(key[0])]) + 1
        self.seq[key] = seq
        return seq

    def compute(self, ranks: I64, base_us: float, phase: str) -> None:
        """Each rank of `ranks` computes for about `base_us`."""
        k = ranks.shape[0]
        factor = self.base_speed[ranks]
        if self.step >= self.plan.slow_from_step:
            factor = factor * self.fault_speed[ranks]
        dur = base_us * factor * self.rng.lognormal(0.0, self.jitter, k)
        spikes = np.asarray(self.rng.random(k) < self.spike_p)
        if spikes.any():
            dur[spikes] += 5_000.0 + self.rng.exponential(15_000.0, int(spikes.sum()))
        self._planned_spike(ranks, dur)
        start = self.t[ranks]
        end = start + dur
        limit = np.minimum(self.stop_compute[ranks], self.stop_all[ranks])
        stuck = end > limit
        if stuck.any():
            for r in ranks[stuck & np.isfinite(start)]:
                self.stuck_phase.setdefault(int(r), phase)
            end[stuck] = INF
        self.t[ranks] = end

    def _planned_spike(self, ranks: I64, dur: F64) -> None:
        """Adds the plan's one long pause to `dur` if it falls in this compute segment."""
        if self.plan.spike is None:
            return
        rank, step, extra = self.plan.spike
        if step == self.step:
            hit = np.flatnonzero(ranks == rank)
            if hit.size:
                dur[hit] += extra
                self.plan.spike = None

    def _record(self, ranks: I64, gids: I64, seq: int | I64, *, op: I64, nbytes: I64,
                dtype: I64, peer: I64, enq: F64, comp: F64) -> None:
        keep = np.isfinite(enq)
        if not keep.all():
            ranks, gids, op, nbytes = ranks[keep], gids[keep], op[keep], nbytes[keep]
            dtype, peer, enq, comp = dtype[keep], peer[keep], enq[keep], comp[keep]
            if not isinstance(seq, int):
                seq = seq[keep]
        k = ranks.shape[0]
        c = self._chunks
        c.rank.append(ranks)
        c.gid.append(gids)
        c.seq.append(np.full(k, seq, dtype=np.int64) if isinstance(seq, int) else seq)
        c.op.append(op)
        c.nbytes.append(nbytes)
        c.dtype.append(dtype)
        c.peer.append(peer)
        c.enq.append(enq)
        c.comp.append(comp)

    def _group_factors(self, gids: I64) -> F64:
        """The plan's time multiplier of each group of `gids` (1 for a healthy group)."""
        slow = self.plan.slow_groups
        return np.array([slow.get(int(g), 1.0) for g in gids], dtype=np.float64)

    def collective(self, groups: I64, gids: I64, key: tuple[int, int], *, nbytes: int,
                   dtype: str, base_us: F64) -> None:
        """One collective in each of `groups` ([G, K] ranks): all_reduce unless overridden."""
        seq = self._next_seq(key)
        g, k = groups.shape
        enq = self.t[groups]
        enq = np.where(enq >= self.stop_all[groups], INF, enq)
        ops = np.full((g, k), _OP["all_reduce"], dtype=np.int64)
        sizes = np.full((g, k), nbytes, dtype=np.int64)
        dtypes = np.full((g, k), _DT[dtype], dtype=np.int64)
        absent = self._skipped(groups, key)
        never = self._override(groups, key, seq, ops=ops, sizes=sizes, dtypes=dtypes)
        if self.plan.stall is not None:
            skey, sseq, srank = self.plan.stall
            if skey == key and sseq == seq:
                never |= (groups == srank).any(axis=1)
        if self.plan.slow_groups:
            base_us = base_us * self._group_factors(gids)
        ready = np.where(absent, INF, enq).max(axis=1)
        dur = base_us * self.rng.lognormal(0.0, 0.05, g)
        hiccup = np.asarray(self.rng.random(g) < 0.002)
        dur[hiccup] *= self.rng.uniform(2.0, 5.0, int(hiccup.sum()))
        comp = ready[:, None] + dur[:, None] + self.rng.uniform(0.0, 8.0, (g, k))
        comp[never] = INF
        comp = np.where(comp > self.stop_all[groups], INF, comp)
        flat = groups.ravel()
        present = ~absent.ravel()
        self._record(
            flat[present], np.repeat(gids, k)[present], seq, op=ops.ravel()[present],
            nbytes=sizes.ravel()[present], dtype=dtypes.ravel()[present],
            peer=np.full(int(present.sum()), -1, dtype=np.int64), enq=enq.ravel()[present],
            comp=comp.ravel()[present],
        )
        new_t = np.where(np.isfinite(enq), comp, INF).ravel()
        self.t[flat[present]] = new_t[present]

    def _skipped(self, groups: I64, key: tuple[int, int]) -> Bools:
        """[G, K]: the members that skip this DP collective (a mismatch drawn earlier)."""
        absent = np.zeros(groups.shape, dtype=bool)
        if self.skipping and key[0] == Family.DP:
            for rank in list(self.skipping):
                hit = np.argwhere(groups == rank)
                if hit.size:
                    absent[hit[0, 0], hit[0, 1]] = True
                    self.skipping.discard(rank)
        return absent

    def _override(self, groups: I64, key: tuple[int, int], seq: int, *, ops: I64, sizes: I64,
                  dtypes: I64) -> Bools:
        """Applies the plan's override to this collective's calls; returns [G], the groups
        that never complete it."""
        never = np.zeros(groups.shape[0], dtype=bool)
        o = self.plan.override
        if o is None or o.key != key or o.seq != seq:
            return never
        hit = np.argwhere(groups == o.rank)
        if hit.size:
            gi, ki = int(hit[0, 0]), int(hit[0, 1])
            ops[gi, ki] = _OP[o.op]
            sizes[gi, ki] = o.nbytes
            dtypes[gi, ki] = _DT[o.dtype]
            never[gi] |= o.hang
            if o.skip_next:
                self.skipping.add(o.rank)
        return never

    def p2p(self, senders: I64, receivers: I64, gids: I64, key: tuple[int, int], *,
            nbytes: int, base_us: float) -> None:
        """One blocking transfer per (sender, receiver) pair."""
        seq = self._next_seq(key)
        k = senders.shape[0]
        es = self.t[senders]
        es = np.where(es >= self.stop_all[senders], INF, es)
        er = self.t[receivers]
        er = np.where(er >= self.stop_all[receivers], INF, er)
        factor = self._group_factors(gids) if self.plan.slow_groups else np.ones(k)
        dur = base_us * factor * self.rng.lognormal(0.0, 0.06, k)
        hiccup = np.asarray(self.rng.random(k) < 0.002)
        dur[hiccup] *= self.rng.uniform(2.0, 6.0, int(hiccup.sum()))
        done = np.maximum(es, er) + dur
        cs = np.where(done > self.stop_all[senders], INF, done + self.rng.uniform(0, 5.0, k))
        cr = np.where(done > self.stop_all[receivers], INF, done + self.rng.uniform(0, 5.0, k))
        sizes = np.full(k, nbytes, dtype=np.int64)
        bf16 = np.full(k, _DT["bfloat16"], dtype=np.int64)
        self._record(senders, gids, seq, op=np.full(k, _OP["send"], dtype=np.int64),
                     nbytes=sizes, dtype=bf16, peer=receivers, enq=es, comp=cs)
        self._record(receivers, gids, seq, op=np.full(k, _OP["recv"], dtype=np.int64),
                     nbytes=sizes, dtype=bf16, peer=senders, enq=er, comp=cr)
        self.t[senders] = np.where(np.isfinite(es), cs, INF)
        self.t[receivers] = np.where(np.isfinite(er), cr, INF)
