"""The timing engine: every rank's timeline at once, one numpy primitive at a time.

Times are float microseconds from the window start, `inf` meaning never. A rank computes for a
while (`compute`), then enters a collective with its group (`collective`) or a transfer with its
pipeline neighbour (`p2p`). A collective completes for every member when its last member has
entered, plus its transfer time; a rank that never enters (stuck, frozen, dead) leaves its peers
pending, which is how one stuck rank stops its TP group, the next pipeline stage and then every
DP replica. A collective issued without blocking (a DDP bucket, a prefetched ZeRO-3 gather) runs
on the rank's communication stream, one after the other, while the rank computes on until it
`wait`s. A send can be posted without blocking (`post`) and received later (`deliver`), which
is how the 1F1B and interleaved pipeline schedules exchange activations. A `Plan` says how an
injected fault perturbs these timelines, `Noise` what a healthy GPU's compute times look like;
the workload decides which primitives a training step runs.
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
       "broadcast", "all_to_all_single")
"""The ops events are recorded with, by code."""
DTYPES = ("bfloat16", "float32")
"""The dtypes events are recorded with, by code."""
_OP = {name: i for i, name in enumerate(OPS)}
_DT = {name: i for i, name in enumerate(DTYPES)}


@dataclass(slots=True)
class Override:
    """One rank's different call at the `idx`-th collective of a family key in window step
    `step`: op, size, dtype; or a skipped bucket."""

    key: tuple[int, int]
    step: int
    idx: int
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
    """Persistent compute multiplier per rank, from `slow_from_step` on."""
    slow_from_step: int = 0
    slow_groups: dict[int, float] = field(default_factory=dict)
    """gid -> multiplier of the time its collectives or transfers take, from `slow_from_step`
    on."""
    benign_speed: dict[int, float] = field(default_factory=dict)
    """Compute multiplier per rank of a GPU a little slower than its peers (from the start)."""
    stop_step: int = -1
    """At the start of this step the stop times below are set (relative to the step start)."""
    stop_frac: float = 0.5
    stop_compute: tuple[int, ...] = ()
    """Ranks whose GPU work never finishes after the stop time (the process still runs)."""
    stop_all: tuple[int, ...] = ()
    """Ranks that do nothing at all after the stop time (frozen or dead)."""
    stall: tuple[tuple[int, int], int, int, int] | None = None
    """(family key, step, idx, rank): the `idx`-th collective of that key in window step
    `step` never completes in that rank's group."""
    override: Override | None = None
    spike: tuple[int, int, float] | None = None
    """(rank, step, us): one long pause (GC, page cache) in one compute segment."""
    busy: dict[int, tuple[tuple[int, ...], tuple[float, ...], str]] = field(default_factory=dict)
    """step -> (ranks, us, phase): ranks busy outside any collective after that step (a slow
    checkpoint write, an evaluation on rank 0) while their peers wait in the next one."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Noise:
    """How much a healthy GPU's compute segments vary."""

    jitter: float
    """Sigma of the lognormal core on every segment."""
    spike_p: float
    """Chance of a short pause (5 ms and more) in any segment."""
    tail_p: float = 0.0
    """Chance of a heavy-tailed slowdown of a segment (Pareto, up to 3x)."""
    pause_per_us: float = 0.0
    """Rate of 50..200 ms pauses (GC, page cache, a noisy neighbour) per rank and us."""


Message = tuple[F64, int, int]
"""A posted send: the senders' enqueue times, its sequence number and its family key index."""


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


@dataclass(frozen=True, slots=True, eq=False)
class Floor:
    """What forgotten events leave behind: per (rank * groups + gid), sorted, the last seq a
    rank entered and completed in the group and when (relative)."""

    key: I64
    enq_seq: I64
    enq: F64
    comp_seq: I64
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
                 base_seq: Mapping[Family, int], noise: Noise,
                 dp_key: tuple[int, int] = (int(Family.DP), 0)) -> None:
        topo = layout.topo
        n = topo.ranks
        self.layout, self.topo, self.plan, self.rng = layout, topo, plan, rng
        self.base_seq = dict(base_seq)
        """Per family, the last sequence number issued before the window."""
        self.noise = noise
        self.dp_key = dp_key
        """The family key of the gradient collectives (where a skipped bucket shows)."""
        self.seq: dict[tuple[int, int], int] = {}
        self._step_seq: dict[tuple[int, int], int] = {}
        self.t: F64 = 1_000.0 + rng.uniform(0.0, 2_000.0, n)
        self.comm_free: F64 = np.zeros(n)
        """When each rank's communication stream is free."""
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
        self.floor: Floor | None = None
        """The last of the events forgotten by `forget` (None: nothing forgotten)."""
        self.steps_forgotten = 0
        """Steps whose `step_end` was forgotten."""
        self._chunks = _Chunks()

    # -- steps ----------------------------------------------------------------------------------

    def begin_step(self, est_step_us: float) -> None:
        """Start a step: the fault's speeds from its onset step, its stop times from its stop
        step (`stop_frac` of an estimated step after the median rank started it)."""
        plan = self.plan
        if self.step == 0:
            for rank, factor in plan.benign_speed.items():
                self.base_speed[rank] *= factor
        if self.step == plan.slow_from_step:
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
        self._step_seq = dict(self.seq)

    def end_step(self) -> None:
        """End a step: wait for the communication stream, then whoever is busy after this
        step (a checkpoint, an evaluation) is busy."""
        self.t = np.maximum(self.t, self.comm_free)
        busy = self.plan.busy.get(self.step)
        if busy is not None:
            ranks, us, phase = busy
            idx = np.array(ranks, dtype=np.int64)
            self._advance(idx, self.t[idx] + np.array(us), phase)
        self.step_end.append(self.t.copy())
        self.step += 1

    def events(self) -> Events:
        c = self._chunks
        if not c.rank:
            empty_i, empty_f = np.zeros(0, dtype=np.int64), np.zeros(0)
            return Events(rank=empty_i, gid=empty_i, seq=empty_i, op=empty_i, nbytes=empty_i,
                          dtype=empty_i, peer=empty_i, enq=empty_f, comp=empty_f)
        ev = Events(
            rank=np.concatenate(c.rank), gid=np.concatenate(c.gid),
            seq=np.concatenate(c.seq), op=np.concatenate(c.op),
            nbytes=np.concatenate(c.nbytes), dtype=np.concatenate(c.dtype),
            peer=np.concatenate(c.peer), enq=np.concatenate(c.enq),
            comp=np.concatenate(c.comp),
        )
        self._chunks = _Chunks(*([getattr(ev, name)] for name in _Chunks.__slots__))
        return ev

    def forget(self, before: float) -> None:
        """Forget the events entered and completed before `before` (keeping the last seq of
        each rank in each group in `floor`) and the steps every rank ended before it."""
        ev = self.events()
        old = (ev.enq < before) & (ev.comp < before)
        if old.any():
            ng = len(self.layout.names)
            keys = ev.rank[old] * ng + ev.gid[old]
            rows = np.flatnonzero(old)
            if self.floor is not None:  # older floors lose to newer events of the same key
                keys = np.concatenate([self.floor.key, keys])
            order = np.lexsort((np.concatenate([self.floor.enq_seq, ev.seq[old]])
                                if self.floor is not None else ev.seq[old], keys))
            sk = keys[order]
            last = np.ones(sk.shape[0], dtype=bool)
            last[:-1] = sk[1:] != sk[:-1]
            pick = order[last]

            def take(f_old: npt.NDArray[np.generic] | None,
                     new: npt.NDArray[np.generic]) -> npt.NDArray[np.generic]:
                both = new if f_old is None else np.concatenate([f_old, new])
                return both[pick]

            fl = self.floor
            seq = ev.seq[rows]
            self.floor = Floor(
                key=sk[last],
                enq_seq=take(fl.enq_seq if fl else None, seq).astype(np.int64),
                enq=take(fl.enq if fl else None, ev.enq[rows]).astype(np.float64),
                comp_seq=take(fl.comp_seq if fl else None, seq).astype(np.int64),
                comp=take(fl.comp if fl else None, ev.comp[rows]).astype(np.float64),
            )
            keep = ~old
            self._chunks = _Chunks(*([getattr(ev, name)[keep]] for name in _Chunks.__slots__))
        while len(self.step_end) > 2 and float(self.step_end[0].max()) < before:
            self.step_end.pop(0)
            self.steps_forgotten += 1

    # -- primitives -----------------------------------------------------------------------------

    def _next_seq(self, key: tuple[int, int]) -> int:
        seq = self.seq.get(key, self.base_seq[Family(key[0])]) + 1
        self.seq[key] = seq
        return seq

    def _index_in_step(self, key: tuple[int, int], seq: int) -> int:
        """Which collective of `key` in the current step `seq` is (0 for the first)."""
        return seq - self._step_seq.get(key, self.base_seq[Family(key[0])]) - 1

    def compute(self, ranks: I64, base_us: float | F64, phase: str) -> None:
        """Each rank of `ranks` computes for about `base_us`."""
        k = ranks.shape[0]
        noise, rng = self.noise, self.rng
        factor = self.base_speed[ranks] * self.fault_speed[ranks]
        dur = base_us * factor * rng.lognormal(0.0, noise.jitter, k)
        spikes = np.asarray(rng.random(k) < noise.spike_p)
        if spikes.any():
            dur[spikes] += 5_000.0 + rng.exponential(15_000.0, int(spikes.sum()))
        if noise.tail_p > 0:
            tail = np.flatnonzero(rng.random(k) < noise.tail_p)
            if tail.size:
                dur[tail] *= 1.0 + np.minimum(2.0, 0.04 * (rng.pareto(1.6, tail.size) + 1.0))
        if noise.pause_per_us > 0:
            paused = np.flatnonzero(rng.random(k) < np.minimum(0.9, dur * noise.pause_per_us))
            if paused.size:
                dur[paused] += rng.uniform(50_000.0, 200_000.0, paused.size)
        self._planned_spike(ranks, dur)
        self._advance(ranks, self.t[ranks] + dur, phase)

    def _advance(self, ranks: I64, end: F64, phase: str) -> None:
        """Ranks compute until `end`, unless their GPU work stops before."""
        start = self.t[ranks]
        limit = np.minimum(self.stop_compute[ranks], self.stop_all[ranks])
        stuck = end > limit
        if stuck.any():
            for r in ranks[stuck & np.isfinite(start)]:
                self.stuck_phase.setdefault(int(r), phase)
            end = np.where(stuck, INF, end)
        self.t[ranks] = end

    def wait(self, ranks: I64) -> None:
        """Ranks wait for their communication stream (every collective they issued)."""
        self.t[ranks] = np.maximum(self.t[ranks], self.comm_free[ranks])

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
        if not slow or self.step < self.plan.slow_from_step:
            return np.ones(gids.shape[0])
        return np.array([slow.get(int(g), 1.0) for g in gids], dtype=np.float64)

    def collective(self, groups: I64, gids: I64, key: tuple[int, int], *, nbytes: int,
                   dtype: str, base_us: F64, op: str = "all_reduce",
                   sizes: I64 | None = None, block: bool = True) -> F64:
        """One collective in each of `groups` ([G, K] ranks): `op` (all_reduce) unless
        overridden, each member passing `nbytes` (or its own size in `sizes`, [G, K]). A
        blocking call holds its ranks until it completes; otherwise it runs on their
        communication streams after what they issued before. Returns when it completes for
        each member ([G * K], inf: never)."""
        seq = self._next_seq(key)
        g, k = groups.shape
        enq = self.t[groups]
        enq = np.where(enq >= self.stop_all[groups], INF, enq)
        ops = np.full((g, k), _OP[op], dtype=np.int64)
        sizes = np.full((g, k), nbytes, dtype=np.int64) if sizes is None else sizes.copy()
        dtypes = np.full((g, k), _DT[dtype], dtype=np.int64)
        absent = self._skipped(groups, key)
        idx = self._index_in_step(key, seq)
        never = self._override(groups, key, idx, ops=ops, sizes=sizes, dtypes=dtypes)
        if self.plan.stall is not None:
            skey, sstep, sidx, srank = self.plan.stall
            if skey == key and sstep == self.step and sidx == idx:
                never |= (groups == srank).any(axis=1)
        base_us = base_us * self._group_factors(gids)
        start = np.maximum(enq, self.comm_free[groups])
        ready = np.where(absent, INF, start).max(axis=1)
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
        if block:
            self.t[flat[present]] = new_t[present]
        else:
            self.comm_free[flat[present]] = new_t[present]
            self.t[flat[present]] = np.where(np.isfinite(enq.ravel()[present]),
                                             self.t[flat[present]], INF)
        return new_t

    def _skipped(self, groups: I64, key: tuple[int, int]) -> Bools:
        """[G, K]: the members that skip this gradient collective (a mismatch drawn earlier)."""
        absent = np.zeros(groups.shape, dtype=bool)
        if self.skipping and key == self.dp_key:
            for rank in list(self.skipping):
                hit = np.argwhere(groups == rank)
                if hit.size:
                    absent[hit[0, 0], hit[0, 1]] = True
                    self.skipping.discard(rank)
        return absent

    def _override(self, groups: I64, key: tuple[int, int], idx: int, *, ops: I64,
                  sizes: I64, dtypes: I64) -> Bools:
        """Applies the plan's override to this collective's calls; returns [G], the groups
        that never complete it."""
        never = np.zeros(groups.shape[0], dtype=bool)
        o = self.plan.override
        if o is None or o.key != key or o.step != self.step or o.idx != idx:
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
        msg = self.post(senders, key)
        self.deliver(msg, senders, receivers, gids, nbytes=nbytes, base_us=base_us,
                     block_sender=True)

    def post(self, senders: I64, key: tuple[int, int]) -> Message:
        """Senders post a send without waiting for it (its receiver takes it in `deliver`)."""
        es = self.t[senders]
        return np.where(es >= self.stop_all[senders], INF, es), self._next_seq(key), key[1]

    def deliver(self, msg: Message, senders: I64, receivers: I64, gids: I64, *, nbytes: int,
                base_us: float, block_sender: bool = False) -> tuple[int, int]:
        """Receivers take the posted `msg`: the transfer starts once both ends are there.
        Returns where the send and the receive were recorded (for `complete_together`)."""
        es, seq, _ = msg
        k = senders.shape[0]
        er = self.t[receivers]
        er = np.where(er >= self.stop_all[receivers], INF, er)
        factor = self._group_factors(gids)
        dur = base_us * factor * self.rng.lognormal(0.0, 0.06, k)
        hiccup = np.asarray(self.rng.random(k) < 0.002)
        dur[hiccup] *= self.rng.uniform(2.0, 6.0, int(hiccup.sum()))
        done = np.maximum(es, er) + dur
        cs = np.where(done > self.stop_all[senders], INF, done + self.rng.uniform(0, 5.0, k))
        cr = np.where(done > self.stop_all[receivers], INF, done + self.rng.uniform(0, 5.0, k))
        sizes = np.full(k, nbytes, dtype=np.int64)
        bf16 = np.full(k, _DT["bfloat16"], dtype=np.int64)
        sent_at = len(self._chunks.rank)
        self._record(senders, gids, seq, op=np.full(k, _OP["send"], dtype=np.int64),
                     nbytes=sizes, dtype=bf16, peer=receivers, enq=es, comp=cs)
        self._record(receivers, gids, seq, op=np.full(k, _OP["recv"], dtype=np.int64),
                     nbytes=sizes, dtype=bf16, peer=senders, enq=er, comp=cr)
        if block_sender:
            self.t[senders] = np.where(np.isfinite(es), cs, INF)
        else:
            self.comm_free[senders] = np.maximum(self.comm_free[senders],
                                                 np.where(np.isfinite(es), cs, INF))
        self.t[receivers] = np.where(np.isfinite(er), cr, INF)
        return sent_at, sent_at + 1

    def complete_together(self, a: int, b: int) -> None:
        """Records `a` and `b` (where `deliver` put them) were issued in one call that waits for
        both (Megatron's non-batched p2p): each rank's completion in both is the later of its
        two."""
        c = self._chunks
        _, ia, ib = np.intersect1d(c.rank[a], c.rank[b], return_indices=True)
        both = np.maximum(c.comp[a][ia], c.comp[b][ib])
        c.comp[a][ia] = both
        c.comp[b][ib] = both
