"""Long runs: one job played for many consecutive windows, for false-positive rates per window.

`consecutive_windows` draws one scenario like `simulate` (healthy, or with a fault that strikes
somewhere in the run), plays it a chunk of steps at a time and yields, for every window of a
given width (in steps or in seconds), the job as the store would hold it at the window's end:
the window's events, the latest heartbeats and the exits as of then, the health samples of the
window. Played events older than the next window are forgotten (the heartbeats keep what they
need of them), so memory stays bounded however long the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from tracehound.analysis.sim.conditions import FIELD, Conditions
from tracehound.analysis.sim.engine import INF, Engine, Events
from tracehound.analysis.sim.faults import CRASH_CODES, FaultDraft, HealthNote, Truth, crash_cascade
from tracehound.analysis.sim.records import (
    BASE_EPOCH_US,
    SimulatedJob,
    Timeline,
    _groups,
    _info,
    _Job,
    clock_truth,
    draw_clock,
)
from tracehound.analysis.sim.scenario import _fault_kind, setup
from tracehound.analysis.sim.workloads import Workload, run_step
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.ids import JobId
from tracehound.tracing.summaries import F64, I64

_ROWS_PER_CHUNK = 2_000_000
"""About how many events one chunk of steps may record."""
NOISE_WINDOW_US = 60e6
"""A long run has the checkpoints, evaluations and health warnings of one window
(`Conditions`) per minute of run time (its pauses and GPU noise stay per step)."""


def consecutive_windows(
    *,
    ranks: int,
    seed: int,
    count: int,
    window_steps: int | None = None,
    window_s: float | None = None,
    fault: IncidentKind | str | None = None,
    variant: str | None = None,
    conditions: Conditions = FIELD,
    skew_ms: float | None = None,
    drift_ppm: float | None = None,
    workload: str | None = None,
    tp: int | None = None,
    pp: int | None = None,
    gpus_per_node: int | None = None,
    step_s: float | None = None,
    microbatches: int | None = None,
    job: str | None = None,
    attempt: int = 0,
    combined_p2p: bool | None = None,
) -> Iterator[SimulatedJob]:
    """`count` consecutive windows of one job, each `window_steps` healthy steps or `window_s`
    seconds wide, as `SimulatedJob`s whose `window_start_us` .. `now_us` is the window.

    A window's `truth` is the fault's once the fault has struck by the window's end, healthy
    before. The other arguments are those of `simulate`; a fault strikes or starts between a
    tenth and a half of the run; the checkpoints, evaluations and health warnings of
    `Conditions` come once per `NOISE_WINDOW_US` of run time. Deterministic per arguments."""
    if (window_steps is None) == (window_s is None):
        raise ValueError("give exactly one of window_steps and window_s")
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    kind = _fault_kind(fault)
    probe = setup(ranks=ranks, kind=kind, seed=seed, variant=variant, tp=tp, pp=pp, steps=6,
                  microbatches=microbatches, conditions=conditions, skew_ms=skew_ms,
                  drift_ppm=drift_ppm, workload=workload, gpus_per_node=gpus_per_node,
                  step_s=step_s, combined_p2p=combined_p2p)
    est = probe.workload.estimated_step_us(probe.eng.topo)
    width = window_steps * est if window_steps is not None else float(window_s or 0) * 1e6
    if width <= 0:
        raise ValueError("the window must be wider than 0")
    total_steps = max(6, math.ceil(count * width / est) + 2)
    s = setup(ranks=ranks, kind=kind, seed=seed, variant=variant, tp=tp, pp=pp,
              steps=total_steps, microbatches=microbatches, conditions=conditions,
              skew_ms=skew_ms, drift_ppm=drift_ppm, workload=workload,
              gpus_per_node=gpus_per_node, step_s=step_s, combined_p2p=combined_p2p,
              windows=max(1, round(count * width / NOISE_WINDOW_US)),
              fault_steps=(max(1, total_steps // 10), max(3, total_steps // 2)))
    run = _Run(s.eng, s.workload, s.draft, s.conditions, seed=seed, job=job, attempt=attempt,
               est=est, horizon=count * width + 2 * est)
    yield from run.windows(count, width, total_steps)


class _Run:
    """A scenario being played chunk by chunk."""

    def __init__(self, eng: Engine, w: Workload, d: FaultDraft, conditions: Conditions, *,
                 seed: int, job: str | None, attempt: int, est: float,
                 horizon: float) -> None:
        self.eng, self.w, self.d, self.conditions = eng, w, d, conditions
        self.seed, self.est, self.horizon = seed, est, horizon
        topo = eng.topo
        self.t0 = BASE_EPOCH_US + (seed % 100_000) * 3_600 * 1_000_000
        self.clock = draw_clock(topo, self.t0, conditions, seed)
        self.ctx = _Job(job=JobId(job or f"sim-{seed}"), attempt=attempt, seed=seed,
                        clock=self.clock)
        self.attempt = attempt
        self.groups = _groups(eng, self.ctx, time_us=self.t0 - w.base_step * int(est)
                              - 60_000_000)
        self.rank_nodes = {r: topo.node_of(r) for r in range(topo.ranks)}
        self.roles = dict(zip(eng.layout.names, eng.layout.roles, strict=True))
        self.offsets, self.drifts = clock_truth(topo, self.clock)
        self.pad = 1e5 + 6_000.0 * conditions.skew_ms + 6e-6 * conditions.drift_ppm * horizon
        """How far before its start a window's columns reach (its nodes' clocks may be
        that far ahead)."""
        notes_rng = np.random.default_rng([seed, topo.ranks, 0x4E07])
        self.note_draw = [(note, float(notes_rng.uniform(0.0, 1.0))) for note in d.health]
        self.exit_t: F64 = np.full(topo.ranks, INF)
        self.code: I64 = np.zeros(topo.ranks, dtype=np.int64)

    def windows(self, count: int, width: float, total_steps: int) -> Iterator[SimulatedJob]:
        """Plays on a chunk of steps at a time until the next window is complete (every rank
        is past its end, or the job stopped), and yields it."""
        eng, w = self.eng, self.w
        rows_per_step = max(1, eng.topo.ranks * sum(w.per_step().values()))
        chunk = max(3, min(math.ceil(2 * width / self.est) + 1,
                           _ROWS_PER_CHUNK // rows_per_step))
        cap = 20 * total_steps + 10 * chunk  # however slow the steps, a run ends
        played, done = 0, 0
        start = self.est
        while done < count:
            finite = eng.t[np.isfinite(eng.t)]
            running = finite.size > 0 and played < cap
            need = start + (done + 1) * width
            if running and min(float(finite.min()), eng.stop_time) < need:
                for _ in range(chunk):
                    run_step(eng, w, self.est)
                    played += 1
                if played == chunk:
                    start = float(np.median(eng.step_end[0]))
                finite = eng.t[np.isfinite(eng.t)]
                running = finite.size > 0 and played < cap
            ev = eng.events()
            fault = self._fault_time(ev)
            ready = float(finite.min()) if running else INF
            if math.isfinite(eng.stop_time) and running:
                ready = min(ready, eng.stop_time)  # its aftermath is not played out yet
            if not running and self.d.kind is IncidentKind.CRASH and math.isfinite(fault):
                self._crash(ev, fault)
            while done < count and start + (done + 1) * width <= ready:
                a = start + done * width
                yield self._window(ev, fault, a, a + width)
                done += 1
            eng.forget(start + done * width - self.pad - 1e6)

    def _fault_time(self, ev: Events) -> float:
        """When the fault struck so far (relative; inf: not yet, or healthy)."""
        eng, d = self.eng, self.d
        if d.kind is None:
            return INF
        sudden = d.stalls or d.kind is IncidentKind.CRASH
        if math.isfinite(eng.stop_time) and sudden:
            return eng.stop_time
        if d.stalls:
            stuck = ~np.isfinite(ev.comp)
            return float(ev.enq[stuck].min()) if stuck.any() else INF
        if d.onset_step:
            return eng.step_start[d.onset_step] if d.onset_step < len(eng.step_start) else INF
        return INF if sudden else 0.0  # a sudden fault not yet, or one there from the start

    def _crash(self, ev: Events, fault: float) -> None:
        if np.isfinite(self.exit_t).any():
            return
        eng, d = self.eng, self.d
        rng = np.random.default_rng([self.seed, eng.topo.ranks, 0xDEAD])
        self.exit_t, self.code = crash_cascade(eng.layout, ev, d.culprits[0], t_fail=fault,
                                               slots=eng.layout.rank_slots(), rng=rng)
        self.code[d.culprits[0]] = CRASH_CODES[d.variant]

    def _notes(self, fault: float) -> tuple[tuple[HealthNote, float], ...]:
        """The health notes and when they are reported (inf: not yet known)."""
        eng, d = self.eng, self.d
        out = []
        for note, u in self.note_draw:
            when = note[6]
            if when in ("stop", "stall"):
                at = fault + 300_000.0 * u
            elif when in ("onset", "start"):
                onset = d.onset_step
                at = (max(0.0, eng.step_start[onset] - 200_000.0 * u)
                      if onset < len(eng.step_start) else INF)
            else:
                at = u * self.horizon
            out.append((note, at))
        return tuple(out)

    def _window(self, ev: Events, fault: float, a: float, b: float) -> SimulatedJob:
        eng, d, t0 = self.eng, self.d, self.t0
        tl = Timeline(eng=eng, workload=self.w, draft=d, ctx=self.ctx, ev=ev,
                      exit_t=self.exit_t, code=self.code,
                      fault=fault, notes=self._notes(fault),
                      est_step_us=self.est, steps_before=eng.steps_forgotten, pad_us=self.pad)
        r = tl.records(b, start=a)
        struck = d.kind is not None and fault <= b
        truth = d.truth(t0 + round(fault) if fault else 0) if struck else Truth(
            kind=None, variant="healthy")
        return SimulatedJob(
            job=self.ctx.job, attempt=self.attempt, topology=eng.topo,
            rank_nodes=self.rank_nodes, groups=self.groups, heartbeats=r.heartbeats,
            exits=r.exits, columns=r.columns, stacks=r.stacks, health=r.health,
            window_start_us=t0 + round(a), window_end_us=t0 + round(b), now_us=t0 + round(b),
            truth=truth, step_us=self.est, info=_info(eng.topo, self.w, self.est,
                                                      self.conditions),
            clock_offsets_us=self.offsets, clock_drift_ppm=self.drifts, group_roles=self.roles,
            conditions=self.conditions,
        )
