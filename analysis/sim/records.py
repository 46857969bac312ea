"""What a simulated job's recorders, node agents and health sources would have reported.

`assemble` turns the engine's timelines into the records a store would hold at the moment the
analysis looks (`now_us`): the collective events of the window as columns, each rank's latest
heartbeat, the exits, the process groups, the latest stack samples (when the job stalled) and
the health samples, plus the ground truth. Every time a node writes is on its own clock: off by
an offset drawn per node (`Conditions.skew_ms`) and drifting (`Conditions.drift_ppm`), the
same for all ranks of the node; `SimulatedJob.clock_offsets_us` and `clock_drift_ppm` keep the
truth. The played scenario (`Timeline`) stays with the job, so `SimulatedJob.at(end_us)` gives
the records as of any earlier moment. `SimulatedJob.observation()` summarizes them with the
numpy reference of the window summaries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tracehound.analysis.clocks import clock_bucket_us, estimate_clocks
from tracehound.analysis.observation import HEALTH_LOOKBACK_S, Observation, window_health
from tracehound.analysis.settings import UNEVEN_OPS
from tracehound.analysis.sim.conditions import LAB, Conditions
from tracehound.analysis.sim.engine import DTYPES, INF, OPS, Bools, Engine, Events
from tracehound.analysis.sim.faults import (
    CRASH_CODES,
    FaultDraft,
    HealthNote,
    Truth,
    crash_cascade,
)
from tracehound.analysis.sim.reference import (
    clock_samples,
    disagreements,
    link_stats,
    node_windows,
    rank_stats,
)
from tracehound.analysis.sim.topology import Topology, node_name
from tracehound.analysis.sim.workloads import (
    Workload,
    compute_site,
    stack_frames,
    waiting_site,
)
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing.events import (
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    IncidentKind,
    ProcessGroupInfo,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.summaries import F64, I64, CollectiveColumns

BASE_EPOCH_US = 1_767_225_600_000_000
"""2026-01-01T00:00:00Z; every scenario starts at its own hour after it."""

_US = 1_000_000
_LOOKBACK_US = HEALTH_LOOKBACK_S * _US
"""Events reported this long before a window are in its records (`Observation.health`)."""


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
    clock_offsets_us: Mapping[str, float] = field(default_factory=dict)
    """The truth of each node's clock: how far ahead of true time it is at the window start."""
    clock_drift_ppm: Mapping[str, float] = field(default_factory=dict)
    """The truth of each node's clock drift (us gained per second of true time)."""
    group_roles: Mapping[str, str] = field(default_factory=dict)
    """Group id -> what the group is for ("world", "tp", "dp", "pp", "p2p", "ep", or an idle
    kind such as "dp-gloo", "embedding", "mp"; see `topology.GroupLayout`)."""
    conditions: Conditions = LAB
    timeline: Timeline | None = None
    """The played scenario the records were taken from (None: records only)."""

    def node_of_rank(self) -> dict[int, str]:
        return dict(self.rank_nodes)

    def at(self, end_us: int) -> SimulatedJob:
        """The same job as the store would hold it at `end_us` (true time, within the played
        window): events completed by then, the heartbeats and exits of that moment."""
        if end_us == self.now_us:
            return self
        if self.timeline is None:
            raise ValueError("this job keeps no timeline to look back into")
        if not self.window_start_us < end_us <= self.window_end_us:
            raise ValueError(f"end_us must be in ({self.window_start_us}, "
                             f"{self.window_end_us}], got {end_us}")
        return self.timeline.job_at(self, end_us - self.window_start_us)

    def snapshot(self) -> JobSnapshot:
        return JobSnapshot(
            job=self.job, attempt=self.attempt, now_us=self.now_us, heartbeats=self.heartbeats,
            exits=self.exits, groups=self.groups, expected_ranks=self.rank_nodes,
        )

    def observation(
        self, *, window_us: int | None = None, node_window_us: int | None = None,
        end_us: int | None = None,
    ) -> Observation:
        """The analysis' view of the window ending at `now_us`, summarized with numpy.

        `window_us`: the detection window (default: the whole simulated window);
        `node_window_us`: the width of the per-node windows over the whole simulated window
        (default: a quarter of it); `end_us`: look at that moment instead (see `at`)."""
        if end_us is not None and end_us != self.now_us:
            return self.at(end_us).observation(window_us=window_us,
                                               node_window_us=node_window_us)
        end = self.window_end_us
        start = max(self.window_start_us, end - window_us) if window_us else self.window_start_us
        width = node_window_us or max(1, -(-(end - self.window_start_us) // 4))
        cols = self.columns
        clocks = estimate_clocks(clock_samples(
            cols, self.rank_nodes, self.window_start_us, end,
            clock_bucket_us(self.window_start_us, end)))
        clock = clocks.correction() if clocks.nodes else None
        found = disagreements(cols, start, end, uneven_ops=UNEVEN_OPS)
        return Observation(
            snapshot=self.snapshot(),
            window_start_us=start,
            window_end_us=end,
            clocks=clocks,
            ranks=rank_stats(cols, start, end, clock=clock, node_of_rank=self.rank_nodes),
            links=link_stats(cols, start, end, clock=clock, node_of_rank=self.rank_nodes),
            disagreements=tuple(found),
            disagreements_dropped=found.dropped,
            stacks=tuple(s for s in self.stacks if s.time_us >= start),
            health=window_health(self.health, start, end),
            node_windows=node_windows(cols, self.rank_nodes, self.window_start_us, end, width,
                                      clock=clock),
        )


@dataclass(frozen=True, slots=True)
class _Clock:
    """From the engine's relative times to each rank's epoch microseconds: the window starts
    at `t0`, every node's clock is `offset_us` ahead at t0 and gains `drift_ppm` us per second
    after."""

    t0: int
    offset_us: F64
    """Per node."""
    drift_ppm: F64
    """Per node."""
    gpus_per_node: int

    def at(self, rel: F64 | float, ranks: I64 | int) -> I64:
        """The time a rank's node writes for relative true time `rel`."""
        node = np.asarray(ranks) // self.gpus_per_node
        return self.node_at(rel, node)

    def node_at(self, rel: F64 | float, nodes: I64 | int) -> I64:
        """The time a node writes for relative true time `rel`."""
        t = np.asarray(rel, dtype=np.float64)
        local = t + self.offset_us[nodes] + self.drift_ppm[nodes] * 1e-6 * t
        return self.t0 + np.rint(local).astype(np.int64)


def draw_clock(topo: Topology, t0: int, conditions: Conditions, seed: int) -> _Clock:
    """Every node's clock: offset N(0, skew_ms) and drift N(0, drift_ppm), from a stream of
    their own (the same job under another skew differs only in its clocks)."""
    rng = np.random.default_rng([seed, topo.ranks, 0xC10C])
    z = rng.standard_normal((2, topo.nodes))
    return _Clock(t0=t0, offset_us=z[0] * conditions.skew_ms * 1_000.0,
                  drift_ppm=z[1] * conditions.drift_ppm, gpus_per_node=topo.gpus_per_node)


@dataclass(frozen=True, slots=True)
class _Job:
    """What every record of the job carries."""

    job: JobId
    attempt: int
    seed: int
    clock: _Clock


@dataclass(frozen=True, slots=True, eq=False)
class Timeline:
    """A played scenario in true time relative to the window start: what every record is made
    from, at whatever moment the analysis looks."""

    eng: Engine
    workload: Workload
    draft: FaultDraft
    ctx: _Job
    ev: Events
    exit_t: F64
    """When each rank exits (inf: never)."""
    code: I64
    fault: float
    """When the fault struck (0: healthy, or present throughout)."""
    notes: tuple[tuple[HealthNote, float], ...]
    """The fault's and the noise's health events and when they are reported."""
    est_step_us: float
    steps_before: int = 0
    """Steps played before the engine's oldest kept step (a long run forgets old steps)."""
    pad_us: float = INF
    """How far before a window's start events are kept for its columns (inf: all)."""

    def records(self, now: float, *, start: float = 0.0) -> _Records:
        """What the store holds at relative time `now` (events kept from `start - pad_us`;
        health metrics from `start`, events from `HEALTH_LOOKBACK_S` before it)."""
        eng, d, ev, ctx = self.eng, self.draft, self.ev, self.ctx
        topo = eng.topo
        rng = np.random.default_rng([ctx.seed, topo.ranks, int(now), 5])
        exited = self.exit_t <= now
        crashed = d.kind is IncidentKind.CRASH
        # A pending op of a rank that failed ends as a failed event; the first to die
        # recorded nothing of the op it died in.
        failed = ~np.isfinite(ev.comp) & (self.code[ev.rank] == 1) & exited[ev.rank]
        if crashed:
            failed &= ev.rank != d.culprits[0]
        comp = np.where(failed, self.exit_t[ev.rank], ev.comp)
        hbt = _heartbeat_times(eng, d, ctx.seed, now=now, exit_t=self.exit_t, exited=exited)
        keep = (ev.enq < now) & (comp <= now) & (ev.enq >= start - self.pad_us)
        w = self.workload
        if self.steps_before:
            w = replace(w, base_step=w.base_step + self.steps_before)
        heartbeats = _heartbeats(eng, w, ev, comp=comp, hbt=hbt, slots=eng.layout.rank_slots(),
                                 ctx=ctx)
        stacks: tuple[StackSample, ...] = ()
        if d.stalls and now > self.fault:
            stacks = _stacks(eng, w, ev, rng, comp=comp, exited=exited, d=d, now=now, ctx=ctx)
        return _Records(
            heartbeats=heartbeats, exits=_exits(topo, self.exit_t, self.code, exited, ctx),
            columns=_columns(eng, ev, keep=keep, failed=failed, comp=comp, clock=ctx.clock),
            stacks=stacks, health=_health(self, rng, start=start, now=now),
        )

    def job_at(self, job: SimulatedJob, now: float) -> SimulatedJob:
        """`job` as of relative time `now` (its window start unchanged)."""
        r = self.records(now)
        t0 = self.ctx.clock.t0
        fault_us = t0 + round(self.fault) if self.fault else 0
        truth = job.truth if not fault_us or fault_us <= t0 + now else Truth(kind=None,
                                                                           variant="healthy")
        return replace(job, heartbeats=r.heartbeats, exits=r.exits, columns=r.columns,
                       stacks=r.stacks, health=r.health, window_end_us=t0 + round(now),
                       now_us=t0 + round(now), truth=truth)


@dataclass(frozen=True, slots=True, eq=False)
class _Records:
    heartbeats: tuple[Heartbeat, ...]
    exits: tuple[RankExit, ...]
    columns: CollectiveColumns
    stacks: tuple[StackSample, ...]
    health: tuple[HealthSample, ...]


def assemble(eng: Engine, w: Workload, d: FaultDraft, *, seed: int, job: str | None,
             attempt: int, est_step_us: float, conditions: Conditions = LAB) -> SimulatedJob:
    """The records of a played scenario, as of the moment the analysis looks."""
    topo, rng = eng.topo, eng.rng
    t0 = BASE_EPOCH_US + (seed % 100_000) * 3_600 * _US
    ev = eng.events()
    ends = [float(np.median(e[np.isfinite(e)])) for e in eng.step_end if np.isfinite(e).any()]
    fault = _fault_time(eng, d, ev, ends)
    now = _look_time(d, fault, ends, rng, est_step_us if conditions.field_layouts else 0.0)
    clock = draw_clock(topo, t0, conditions, seed)
    ctx = _Job(job=JobId(job or f"sim-{seed}"), attempt=attempt, seed=seed, clock=clock)
    exit_t, code = _exit_times(eng, d, ev, fault, rng)
    offsets, drifts = clock_truth(topo, clock)
    notes = tuple((note, _health_time(d, eng, note[6], now=now, fault=fault))
                  for note in d.health)
    timeline = Timeline(eng=eng, workload=w, draft=d, ctx=ctx, ev=ev, exit_t=exit_t,
                        code=code, fault=fault, notes=notes, est_step_us=est_step_us)
    r = timeline.records(now)
    return SimulatedJob(
        job=ctx.job, attempt=attempt, topology=topo,
        rank_nodes={r: topo.node_of(r) for r in range(topo.ranks)},
        groups=_groups(eng, ctx, time_us=t0 - w.base_step * int(est_step_us) - 60 * _US),
        heartbeats=r.heartbeats, exits=r.exits, columns=r.columns, stacks=r.stacks,
        health=r.health,
        window_start_us=t0, window_end_us=t0 + round(now), now_us=t0 + round(now),
        truth=d.truth(t0 + round(fault) if fault else 0), step_us=est_step_us,
        info=_info(topo, w, est_step_us, conditions), clock_offsets_us=offsets,
        clock_drift_ppm=drifts,
        group_roles=dict(zip(eng.layout.names, eng.layout.roles, strict=True)),
        conditions=conditions, timeline=timeline,
    )


def clock_truth(topo: Topology, clock: _Clock) -> tuple[dict[str, float], dict[str, float]]:
    """The `clock_offsets_us` and `clock_drift_ppm` of a job."""
    names = [node_name(i) for i in range(topo.nodes)]
    return (dict(zip(names, clock.offset_us.tolist(), strict=True)),
            dict(zip(names, clock.drift_ppm.tolist(), strict=True)))


def _exit_times(eng: Engine, d: FaultDraft, ev: Events, fault: float,
                rng: np.random.Generator) -> tuple[F64, I64]:
    """When each rank exits (inf: never) and its exit code."""
    n = eng.topo.ranks
    if d.kind is not IncidentKind.CRASH:
        return np.full(n, INF), np.zeros(n, dtype=np.int64)
    exit_t, code = crash_cascade(eng.layout, ev, d.culprits[0], t_fail=fault,
                                 slots=eng.layout.rank_slots(), rng=rng)
    code[d.culprits[0]] = CRASH_CODES[d.variant]
    return exit_t, code


def _fault_time(eng: Engine, d: FaultDraft, ev: Events, ends: list[float]) -> float:
    """When the fault struck (relative): its stop time, the first op that never completed, the
    start of its onset step, or 0 for faults present throughout and healthy runs."""
    crashed = d.kind is IncidentKind.CRASH
    if math.isfinite(eng.stop_time) and (d.stalls or crashed):
        return eng.stop_time
    if d.stalls:
        stuck = ~np.isfinite(ev.comp)
        return float(ev.enq[stuck].min()) if stuck.any() else ends[-1]
    if d.onset_step and d.onset_step < len(eng.step_start):
        return eng.step_start[d.onset_step]
    return 0.0


def _look_time(d: FaultDraft, fault: float, ends: list[float],
               rng: np.random.Generator, step_us: float = 0.0) -> float:
    """When the analysis looks (relative): 0.7..8 s after a crash, 8..25 s (and one or two
    steps of `step_us`) after a stall, otherwise somewhere in the last step."""
    if d.kind is IncidentKind.CRASH:
        return fault + float(rng.uniform(700_000.0, 8_000_000.0))
    if d.stalls:
        return fault + float(rng.uniform(8_000_000.0, 25_000_000.0)) + float(
            rng.uniform(1.0, 2.0)) * step_us
    return ends[-2] + float(rng.uniform(0.3, 0.95)) * (ends[-1] - ends[-2])


_BEAT_US = 500_000.0
"""How often a rank's recorder beats."""


def _heartbeat_times(eng: Engine, d: FaultDraft, seed: int, *, now: float, exit_t: F64,
                     exited: Bools) -> F64:
    """When each rank last beat (relative): every 0.5 s at a phase of its own, the last beat
    before `now`, before it froze or before it exited."""
    n = eng.topo.ranks
    phase = np.random.default_rng([seed, n, 0xBEA7]).uniform(0.0, _BEAT_US, n)

    def last_beat(t: F64) -> F64:
        return t - np.mod(t - phase, _BEAT_US)

    hbt = last_beat(np.full(n, now))
    frozen = np.array(d.plan.stop_all, dtype=np.int64)
    if frozen.size and math.isfinite(eng.stop_time):
        hbt[frozen] = np.minimum(hbt[frozen], last_beat(np.full(n, eng.stop_time))[frozen])
    return np.where(exited, np.minimum(hbt, last_beat(np.where(exited, exit_t, now))), hbt)


def _columns(eng: Engine, ev: Events, *, keep: Bools, failed: Bools, comp: F64,
             clock: _Clock) -> CollectiveColumns:
    """The events of rows `keep`, as the recorders stamped them."""
    rank = ev.rank[keep]
    return CollectiveColumns(
        rank=rank.copy(),
        group=np.asarray(eng.layout.names)[ev.gid[keep]],
        seq=ev.seq[keep].copy(),
        op=np.asarray(OPS)[ev.op[keep]],
        nbytes=ev.nbytes[keep].copy(),
        dtype=np.asarray(DTYPES)[ev.dtype[keep]],
        peer=ev.peer[keep].copy(),
        completed=~failed[keep],
        enqueue_us=clock.at(ev.enq[keep], rank),
        complete_us=clock.at(comp[keep], rank),
    )


def _exits(topo: Topology, exit_t: F64, code: I64, exited: Bools,
           ctx: _Job) -> tuple[RankExit, ...]:
    """One exit per rank that exited by now, in the order they exited."""
    return tuple(sorted(
        (RankExit(job=ctx.job, attempt=ctx.attempt, node=NodeId(topo.node_of(r)), rank=Rank(r),
                  pid=_pid(r, ctx.seed), exit_code=int(code[r]),
                  time_us=int(ctx.clock.at(exit_t[r], r)))
         for r in np.flatnonzero(exited).tolist()),
        key=lambda e: (e.time_us, e.rank),
    ))


def _groups(eng: Engine, ctx: _Job, *, time_us: int) -> tuple[ProcessGroupInfo, ...]:
    """One record per process group, as its lowest rank created it when the job started
    (pair groups when first used, which the window does not tell apart)."""
    layout, clock = eng.layout, ctx.clock
    lowest = np.array([int(m.min()) for m in layout.members], dtype=np.int64)
    stamped = clock.at(np.full(lowest.shape[0], float(time_us - clock.t0)), lowest).tolist()
    return tuple(
        ProcessGroupInfo(job=ctx.job, attempt=ctx.attempt, rank=Rank(int(low)),
                         group=GroupId(name), ranks=tuple(members.tolist()),
                         backend=backend, time_us=at)
        for name, members, backend, low, at in zip(layout.names, layout.members,
                                                   layout.backends, lowest.tolist(), stamped,
                                                   strict=True)
    )


def _info(topo: Topology, w: Workload, est_step_us: float,
          conditions: Conditions = LAB) -> dict[str, Any]:
    """The scenario's drawn parameters, for reports."""
    return {"conditions": conditions.name, "workload": w.kind,
            "gpus_per_node": topo.gpus_per_node, "ep": topo.ep, "vp": topo.vp,
            "tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "microbatches": w.microbatches,
            "step_ms": round(est_step_us / 1000, 1), "fwd_ms": round(w.fwd_us / 1000, 2),
            "act_bytes": w.act_bytes, "tp_bytes": w.tp_bytes,
            "grad_bytes": list(w.grad_bytes),
            "base_step": w.base_step, "combined_p2p": w.combined_p2p}


def _pid(rank: int, seed: int) -> int:
    return 10_000 + 37 * (rank % 8) + seed % 997


# -- heartbeats -----------------------------------------------------------------------------------


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
    """Per query, its index in the sorted `uniq` and whether it is there."""
    if uniq.size == 0:
        return np.zeros_like(query), np.zeros(query.shape, dtype=bool)
    idx = np.searchsorted(uniq, query).clip(0, uniq.shape[0] - 1)
    return idx, uniq[idx] == query


_Progress = tuple[list[int], list[int], list[str], list[int], list[int]]
"""Per rank: last enqueued seq, last completed seq, pending op, their times."""


def _slot_progress(eng: Engine, ev: Events, *, comp: F64, hbt: F64, slots: I64,
                   clock: _Clock, before: int) -> list[_Progress]:
    """Per group slot of `slots`, each rank's progress in that group as the recorder counts
    it at `hbt` from the events entered and completed by then, or else from the events the
    engine forgot (`Engine.floor`), or else from the steps before the window (`before` stands
    for their time)."""
    layout = eng.layout
    n = eng.topo.ranks
    ng = len(layout.names)
    key = ev.rank * ng + ev.gid
    entered = ev.enq <= hbt[ev.rank]
    ek, erow = _last_by_key(key[entered], ev.seq[entered])
    erow = np.flatnonzero(entered)[erow]
    finished = comp <= hbt[ev.rank]
    ck, crow = _last_by_key(key[finished], ev.seq[finished])
    crow = np.flatnonzero(finished)[crow]
    ranks = np.arange(n, dtype=np.int64)
    floor = eng.floor
    out: list[_Progress] = []
    for j in range(slots.shape[1]):
        g = slots[:, j]
        fam = np.where(g >= 0, layout.family[g.clip(0)], -1)
        base = np.zeros(n, dtype=np.int64)
        for f, b in eng.base_seq.items():
            base[fam == f] = b
        q = ranks * ng + g
        ei, ef = _lookup(ek, q)
        ci, cf = _lookup(ck, q)
        er, cr = erow[ei], crow[ci]
        base_us = np.where(base > 0, before, 0)
        base_enq_seq, base_comp_seq = base, base
        base_enq_us = base_comp_us = base_us
        if floor is not None:
            fi, ff = _lookup(floor.key, q)
            base_enq_seq = np.where(ff, floor.enq_seq[fi], base)
            base_comp_seq = np.where(ff, floor.comp_seq[fi], base)
            base_enq_us = np.where(ff, clock.at(floor.enq[fi], ranks), base_us)
            base_comp_us = np.where(ff, clock.at(floor.comp[fi], ranks), base_us)
        last_enq = np.where(ef, ev.seq[er], base_enq_seq)
        last_comp = np.where(cf, ev.seq[cr], base_comp_seq)
        enq_us = np.where(ef, clock.at(np.where(ef, ev.enq[er], 0.0), ranks), base_enq_us)
        comp_us = np.where(cf, clock.at(np.where(cf, comp[cr], 0.0), ranks), base_comp_us)
        pending = ef & (last_enq > last_comp)
        op = np.where(pending, np.asarray(OPS)[ev.op[er]], "")
        out.append((last_enq.tolist(), last_comp.tolist(), op.tolist(),
                    enq_us.astype(np.int64).tolist(), comp_us.astype(np.int64).tolist()))
    return out


def _heartbeats(eng: Engine, w: Workload, ev: Events, *, comp: F64, hbt: F64, slots: I64,
                ctx: _Job) -> tuple[Heartbeat, ...]:
    """Each rank's latest heartbeat at its own time `hbt`: progress per group as the recorder
    counts it from the events entered and completed by then, and the steps it finished."""
    topo, clock = eng.topo, ctx.clock
    n = topo.ranks
    before = clock.t0 - 50_000  # the window starts a moment after the previous step ended
    cols = _slot_progress(eng, ev, comp=comp, hbt=hbt, slots=slots, clock=clock, before=before)
    names = np.asarray(eng.layout.names)
    slot_names = [np.where(slots[:, j] >= 0, names[slots[:, j].clip(0)], "").tolist()
                  for j in range(slots.shape[1])]
    # The size and dtype of each pending op: its rank's entered, unfinished event of the group
    # with the group's last entered seq (a rank with nothing pending has none).
    unfinished = np.flatnonzero((ev.enq <= hbt[ev.rank]) & (comp > hbt[ev.rank])).tolist()
    pending_of = {
        (int(ev.rank[i]), int(ev.gid[i]), int(ev.seq[i])): (int(ev.nbytes[i]),
                                                            DTYPES[int(ev.dtype[i])])
        for i in unfinished
    }
    # ...and with several in flight, the oldest of them (the call the group is blocked on)
    in_flight: dict[tuple[int, int], list[int]] = {}
    for i in unfinished:
        in_flight.setdefault((int(ev.rank[i]), int(ev.gid[i])), []).append(i)
    ends = np.stack(eng.step_end) if eng.step_end else np.zeros((0, n))
    reached = ends <= hbt[None, :]
    steps = reached.sum(axis=0)
    step_rel = np.where(reached, ends, -INF).max(axis=0, initial=-INF)
    all_ranks = np.arange(n, dtype=np.int64)
    step_us = np.where(steps > 0, clock.at(np.where(steps > 0, step_rel, 0), all_ranks),
                       before).astype(np.int64).tolist()
    hb_us = clock.at(hbt, all_ranks).tolist()
    # the steps before the window took about as long as a healthy step does
    first_step = clock.t0 - int(w.base_step * w.estimated_step_us(topo))
    out: list[Heartbeat] = []
    for r in range(n):
        progress: list[GroupProgress] = []
        for j in range(slots.shape[1]):
            if not slot_names[j][r]:
                continue
            nbytes, dtype = pending_of.get((r, int(slots[r, j]), cols[j][0][r]), (0, ""))
            later = [i for i in in_flight.get((r, int(slots[r, j])), ())
                     if int(ev.seq[i]) > cols[j][1][r]]
            first = min(later, key=lambda i: int(ev.seq[i])) if len(later) > 1 else -1
            progress.append(GroupProgress(
                group=GroupId(slot_names[j][r]), last_enqueued=cols[j][0][r],
                last_completed=cols[j][1][r], pending_op=cols[j][2][r],
                last_enqueue_us=cols[j][3][r], last_complete_us=cols[j][4][r],
                pending_nbytes=nbytes, pending_dtype=dtype,
                oldest_seq=int(ev.seq[first]) if first >= 0 else 0,
                oldest_op=OPS[int(ev.op[first])] if first >= 0 else "",
                oldest_nbytes=int(ev.nbytes[first]) if first >= 0 else 0,
                oldest_dtype=DTYPES[int(ev.dtype[first])] if first >= 0 else "",
            ))
        out.append(Heartbeat(
            job=ctx.job, attempt=ctx.attempt, node=NodeId(topo.node_of(r)), rank=Rank(r),
            time_us=hb_us[r], pid=_pid(r, ctx.seed), step=w.base_step + int(steps[r]),
            step_us=step_us[r], start_step=0, first_step_us=first_step, dropped=0,
            groups=tuple(progress),
        ))
    return tuple(out)


# -- stacks and health ----------------------------------------------------------------------------


def _stack_sites(eng: Engine, w: Workload, ev: Events, *, comp: F64, ts: F64,
                 d: FaultDraft) -> tuple[list[str], dict[int, str]]:
    """Where each rank is at its sample time `ts`, and the op of ranks waiting in a collective
    other than all_reduce, send or recv."""
    n = eng.topo.ranks
    waiting = (ev.enq <= ts[ev.rank]) & (comp > ts[ev.rank])
    where: list[str] = ["compute"] * n
    alt_op: dict[int, str] = {}
    for row in np.flatnonzero(waiting).tolist():
        r = int(ev.rank[row])
        op = OPS[int(ev.op[row])]
        where[r] = waiting_site(w, int(eng.layout.family[int(ev.gid[row])]),
                                int(ev.seq[row]), op)
        if op not in ("all_reduce", "send", "recv"):
            alt_op[r] = op
    for r, phase in eng.stuck_phase.items():
        if where[r] == "compute":
            where[r] = compute_site(phase)
    for r in d.silent:
        where[r] = d.variant
    return where, alt_op


def _stacks(eng: Engine, w: Workload, ev: Events, rng: np.random.Generator, *, comp: F64,
            exited: Bools, d: FaultDraft, now: float, ctx: _Job) -> tuple[StackSample, ...]:
    """The latest stack of every live rank, sampled in the last second before `now`."""
    topo, clock = eng.topo, ctx.clock
    n = topo.ranks
    ts = now - rng.uniform(0.0, 1_000_000.0, n)
    stamped = clock.at(ts, np.arange(n, dtype=np.int64)).tolist()
    where, alt_op = _stack_sites(eng, w, ev, comp=comp, ts=ts, d=d)
    late = rng.random(n) < 0.04
    out: list[StackSample] = []
    for r in range(n):
        if exited[r]:
            continue
        frames = stack_frames(where[r], bool(late[r]) and r not in d.silent)
        if r in alt_op:
            frames = (*frames[:-1], f"torch/distributed/distributed_c10d.py:3290 {alt_op[r]}")
        out.append(StackSample(job=ctx.job, attempt=ctx.attempt, node=NodeId(topo.node_of(r)),
                               rank=Rank(r), time_us=stamped[r], frames=frames))
    return tuple(out)


def _health(tl: Timeline, rng: np.random.Generator, *, start: float,
            now: float) -> tuple[HealthSample, ...]:
    """Benign INFO metrics of every GPU sampled in [start, now), plus the fault's and the
    noise's events reported by then (from `HEALTH_LOOKBACK_S` before `start` on), on their
    nodes' clocks."""
    d, topo, job, clock = tl.draft, tl.eng.topo, tl.ctx.job, tl.ctx.clock
    n = topo.ranks
    rel = rng.uniform(max(start, 0.0), now, (2, n))
    times = np.stack([clock.at(rel[0], np.arange(n)), clock.at(rel[1], np.arange(n))])
    temp = rng.normal(62.0, 5.0, n).clip(35.0, 83.0)
    sm_clock = 1980.0 - rng.exponential(25.0, n)
    hot = {r for r, metric, *_ in d.health if metric == "throttle"}
    for r in hot:
        temp[r] = float(rng.uniform(88.0, 95.0))
        sm_clock[r] = float(rng.uniform(1100.0, 1500.0))
    out: list[HealthSample] = []
    for r in range(n):
        node = NodeId(topo.node_of(r))
        dev = topo.device(r)
        out.append(HealthSample(job=job, node=node, device=dev, time_us=int(times[0, r]),
                                source="nvml", metric="temperature_c",
                                value=round(float(temp[r]), 1), severity=HealthSeverity.INFO))
        out.append(HealthSample(job=job, node=node, device=dev, time_us=int(times[1, r]),
                                source="nvml", metric="sm_clock_mhz",
                                value=round(float(sm_clock[r])), severity=HealthSeverity.INFO))
    for (r, metric, dev, value, severity, detail, when), noted in tl.notes:
        # a state that began before the window and persists (a throttled GPU stays throttled):
        # the agent's periodic samples report it again inside the window
        at = float(rel[0, r]) if when == "onset" and noted <= start else noted
        if not start - _LOOKBACK_US <= at < now:
            continue
        out.append(HealthSample(job=job, node=NodeId(topo.node_of(r)), device=dev,
                                time_us=int(clock.at(min(at, now - 1), r)),
                                source="nic" if metric == "nic_errors" else "nvml",
                                metric=metric, value=value, severity=severity, detail=detail))
    return tuple(out)


def _health_time(d: FaultDraft, eng: Engine, when: str, *, now: float, fault: float) -> float:
    """When (relative) a noted health event is reported (see `HealthNote`)."""
    rng = eng.rng
    if when in ("stop", "stall"):
        return fault + float(rng.uniform(0.0, 300_000.0))
    if when == "onset":
        start = eng.step_start[d.onset_step] if d.onset_step < len(eng.step_start) else 0.0
        return max(0.0, start - float(rng.uniform(0.0, 200_000.0)))
    if when == "start":
        return float(rng.uniform(0.0, 0.1)) * now
    return float(rng.uniform(0.0, now))
