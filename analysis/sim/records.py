"""What a simulated job's recorders, node agents and health sources would have reported.

`assemble` turns the engine's timelines into the records a store would hold at the moment the
analysis looks (`now_us`): the collective events of the window as columns, each rank's latest
heartbeat, the exits, the process groups, the latest stack samples (when the job stalled) and
the health samples, all on the nodes' slightly skewed clocks, plus the ground truth.
`SimulatedJob.observation()` summarizes them with the numpy reference of the window summaries.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracehound.analysis.observation import Observation
from tracehound.analysis.sim.engine import DTYPES, INF, OPS, Bools, Engine, Events
from tracehound.analysis.sim.faults import CRASH_CODES, FaultDraft, Truth, crash_cascade
from tracehound.analysis.sim.reference import disagreements, link_stats, node_windows, rank_stats
from tracehound.analysis.sim.topology import Topology
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


@dataclass(frozen=True, slots=True)
class _Clock:
    """From the engine's relative times to each rank's epoch microseconds: the window starts
    at `t0`, every node's clock is off by a few tens of microseconds (chrony-synced)."""

    t0: int
    rank_skew: F64

    def at(self, rel: F64 | float, ranks: I64 | int) -> I64:
        return np.rint(self.t0 + np.asarray(rel) + self.rank_skew[ranks]).astype(np.int64)


@dataclass(frozen=True, slots=True)
class _Job:
    """What every record of the job carries."""

    job: JobId
    attempt: int
    seed: int
    clock: _Clock


def assemble(eng: Engine, w: Workload, d: FaultDraft, *, seed: int, job: str | None,
             attempt: int, est_step_us: float) -> SimulatedJob:
    """The records of a played scenario, as of the moment the analysis looks."""
    topo, rng = eng.topo, eng.rng
    n = topo.ranks
    t0 = BASE_EPOCH_US + (seed % 100_000) * 3_600 * _US
    ev = eng.events()
    crashed = d.kind is IncidentKind.CRASH
    ends = [float(np.median(e[np.isfinite(e)])) for e in eng.step_end if np.isfinite(e).any()]
    fault = _fault_time(eng, d, ev, ends)
    now = _look_time(d, fault, ends, rng)
    skew = rng.normal(0.0, 30.0, topo.nodes)
    clock = _Clock(t0=t0, rank_skew=np.repeat(skew, topo.gpus_per_node))
    ctx = _Job(job=JobId(job or f"sim-{seed}"), attempt=attempt, seed=seed, clock=clock)
    slots = eng.layout.rank_slots()
    exit_t = np.full(n, INF)
    code = np.zeros(n, dtype=np.int64)
    if crashed:
        exit_t, code = crash_cascade(eng.layout, ev, d.culprits[0], t_fail=fault, slots=slots,
                                     rng=rng)
        code[d.culprits[0]] = CRASH_CODES[d.variant]
    exited = exit_t <= now

    # A pending op of a rank that failed ends as a failed event; the first to die recorded
    # nothing of the op it died in.
    failed = ~np.isfinite(ev.comp) & (code[ev.rank] == 1) & exited[ev.rank]
    if crashed:
        failed &= ev.rank != d.culprits[0]
    comp = np.where(failed, exit_t[ev.rank], ev.comp)
    hbt = _heartbeat_times(eng, d, now=now, exit_t=exit_t, exited=exited)
    keep = (ev.enq < now) & (comp <= now)
    heartbeats = _heartbeats(eng, w, ev, comp=comp, hbt=hbt, slots=slots, ctx=ctx)
    exits = _exits(topo, exit_t, code, exited, ctx)
    groups = _groups(eng, ctx, time_us=t0 - w.base_step * int(est_step_us) - 60 * _US)
    stacks: tuple[StackSample, ...] = ()
    if d.stalls:
        stacks = _stacks(eng, w, ev, comp=comp, exited=exited, d=d, now=now, ctx=ctx)
    health = _health(d, eng, job=ctx.job, t0=t0, now=now, fault=fault)
    return SimulatedJob(
        job=ctx.job, attempt=attempt, topology=topo,
        rank_nodes={r: topo.node_of(r) for r in range(n)}, groups=groups,
        heartbeats=heartbeats, exits=exits,
        columns=_columns(eng, ev, keep=keep, failed=failed, comp=comp, clock=clock),
        stacks=stacks, health=health,
        window_start_us=t0, window_end_us=t0 + round(now), now_us=t0 + round(now),
        truth=d.truth(t0 + round(fault) if fault else 0), step_us=est_step_us,
        info=_info(topo, w, est_step_us),
    )


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
               rng: np.random.Generator) -> float:
    """When the analysis looks (relative): 0.7..8 s after a crash, 8..25 s after a stall,
    otherwise somewhere in the last step."""
    if d.kind is IncidentKind.CRASH:
        return fault + float(rng.uniform(700_000.0, 8_000_000.0))
    if d.stalls:
        return fault + float(rng.uniform(8_000_000.0, 25_000_000.0))
    return ends[-2] + float(rng.uniform(0.3, 0.95)) * (ends[-1] - ends[-2])


def _heartbeat_times(eng: Engine, d: FaultDraft, *, now: float, exit_t: F64,
                     exited: Bools) -> F64:
    """When each rank last beat (relative): within 0.5 s before `now`, before it froze or
    before it exited."""
    rng, n = eng.rng, eng.topo.ranks
    hbt = now - rng.uniform(0.0, 500_000.0, n)
    frozen = np.array(d.plan.stop_all, dtype=np.int64)
    if frozen.size and math.isfinite(eng.stop_time):
        hbt[frozen] = np.minimum(hbt[frozen],
                                 eng.stop_time - rng.uniform(0.0, 500_000.0, frozen.size))
    return np.where(exited, np.minimum(hbt, exit_t - rng.uniform(0.0, 500_000.0, n)), hbt)


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
    """One record per process group, as its lowest rank created it when the job started."""
    layout = eng.layout
    return tuple(
        ProcessGroupInfo(job=ctx.job, attempt=ctx.attempt, rank=Rank(int(members.min())),
                         group=GroupId(name), ranks=tuple(members.tolist()),
                         backend="p2p" if ":p2p:" in name else "nccl", time_us=time_us)
        for name, members in zip(layout.names, layout.members, strict=True)
    )


def _info(topo: Topology, w: Workload, est_step_us: float) -> dict[str, Any]:
    """The scenario's drawn parameters, for reports."""
    return {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "microbatches": w.microbatches,
            "step_ms": round(est_step_us / 1000, 1), "fwd_ms": round(w.fwd_us / 1000, 2),
            "act_bytes": w.act_bytes, "tp_bytes": w.tp_bytes,
            "grad_bytes": list(w.grad_bytes),
            "base_step": w.base_step}


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
    it at `hbt` from the events entered and completed by then (`before` stands for the time
    of ops before the window)."""
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
    t0, rank_skew = clock.t0, clock.rank_skew
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
        last_enq = np.where(ef, ev.seq[er], base)
        last_comp = np.where(cf, ev.seq[cr], base)
        enq_us = np.where(ef, np.rint(t0 + ev.enq[er] + rank_skew),
                          np.where(base > 0, before, 0))
        comp_rel = np.where(cf, comp[cr], 0.0)
        comp_us = np.where(cf, np.rint(t0 + comp_rel + rank_skew),
                           np.where(base > 0, before, 0))
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
    ends = np.stack(eng.step_end) if eng.step_end else np.zeros((0, n))
    reached = ends <= hbt[None, :]
    steps = reached.sum(axis=0)
    step_rel = np.where(reached, ends, -INF).max(axis=0, initial=-INF)
    step_us = np.where(steps > 0,
                       np.rint(clock.t0 + np.where(steps > 0, step_rel, 0) + clock.rank_skew),
                       before).astype(np.int64).tolist()
    hb_us = np.rint(clock.t0 + hbt + clock.rank_skew).astype(np.int64).tolist()
    first_step = clock.t0 - int(w.base_step * 300_000)
    out: list[Heartbeat] = []
    for r in range(n):
        progress = tuple(
            GroupProgress(group=GroupId(slot_names[j][r]), last_enqueued=cols[j][0][r],
                          last_completed=cols[j][1][r], pending_op=cols[j][2][r],
                          last_enqueue_us=cols[j][3][r], last_complete_us=cols[j][4][r])
            for j in range(slots.shape[1]) if slot_names[j][r]
        )
        out.append(Heartbeat(
            job=ctx.job, attempt=ctx.attempt, node=NodeId(topo.node_of(r)), rank=Rank(r),
            time_us=hb_us[r], pid=_pid(r, ctx.seed), step=w.base_step + int(steps[r]),
            step_us=step_us[r], start_step=0, first_step_us=first_step, dropped=0,
            groups=progress,
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


def _stacks(eng: Engine, w: Workload, ev: Events, *, comp: F64, exited: Bools,
            d: FaultDraft, now: float, ctx: _Job) -> tuple[StackSample, ...]:
    """The latest stack of every live rank, sampled in the last second before `now`."""
    topo, rng, clock = eng.topo, eng.rng, ctx.clock
    n = topo.ranks
    ts = now - rng.uniform(0.0, 1_000_000.0, n)
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
                               rank=Rank(r), time_us=round(clock.t0 + ts[r] + clock.rank_skew[r]),
                               frames=frames))
    return tuple(out)


def _health(d: FaultDraft, eng: Engine, *, job: JobId, t0: int, now: float,
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
        dev = topo.device(r)
        out.append(HealthSample(job=job, node=node, device=dev, time_us=int(times[0, r]),
                                source="nvml", metric="temperature_c",
                                value=round(float(temp[r]), 1), severity=HealthSeverity.INFO))
        out.append(HealthSample(job=job, node=node, device=dev, time_us=int(times[1, r]),
                                source="nvml", metric="sm_clock_mhz",
                                value=round(float(clock[r])), severity=HealthSeverity.INFO))
    for r, metric, dev, value, severity, detail, when in d.health:
        rel = _health_time(d, eng, when, now=now, fault=fault)
        out.append(HealthSample(job=job, node=NodeId(topo.node_of(r)), device=dev,
                                time_us=t0 + round(min(rel, now - 1)), source="nvml",
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
