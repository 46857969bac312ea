"""One scenario end to end: draw the layout, the workload and the fault from the seed, play the
steps of the window and assemble what the job reported."""

from __future__ import annotations

import numpy as np

from tracehound.analysis.sim.engine import Engine, Plan
from tracehound.analysis.sim.faults import (
    FAULT_KINDS,
    FaultDraft,
    add_red_herrings,
    draw_fault,
)
from tracehound.analysis.sim.records import SimulatedJob, assemble
from tracehound.analysis.sim.topology import GroupLayout, Topology, default_topology
from tracehound.analysis.sim.workloads import Workload, draw_workload, run_step
from tracehound.tracing.events import IncidentKind


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
    `variant`: force one form of the fault (see the package docstring); drawn when None.
    `tp`, `pp`: the layout (drawn when None); `steps`: training steps in the window (>= 3).
    Deterministic per (seed, ranks, fault)."""
    kind = _fault_kind(fault)
    if steps < 3:
        raise ValueError(f"steps must be >= 3, got {steps}")
    rng = np.random.default_rng([seed, ranks, FAULT_KINDS.index(kind) + 1 if kind else 0])
    topo = _topology(ranks, tp, pp, need_pp=kind is IncidentKind.SLOW_LINK, rng=rng)
    workload = draw_workload(topo, rng, microbatches)
    layout = GroupLayout(topo)
    plan = Plan()
    eng = Engine(layout, plan, rng, base_seq=workload.base_seq(), jitter=workload.jitter,
                 spike_p=workload.spike_p)
    draft = draw_fault(kind, variant, layout=layout, workload=workload, plan=plan, steps=steps,
                       rng=rng)
    add_red_herrings(draft, topo, steps, rng)
    est = _play(eng, workload, draft, steps)
    return assemble(eng, workload, draft, seed=seed, job=job, attempt=attempt, est_step_us=est)


def _fault_kind(fault: IncidentKind | str | None) -> IncidentKind | None:
    """The fault class asked for; ValueError for one the simulator cannot inject."""
    kind = None if fault in (None, "healthy") else IncidentKind(fault)
    if kind is not None and kind not in FAULT_KINDS:
        raise ValueError(f"cannot simulate {kind.value}; choose from "
                         f"{', '.join(k.value for k in FAULT_KINDS)} or healthy")
    return kind


def _topology(ranks: int, tp: int | None, pp: int | None, *, need_pp: bool,
              rng: np.random.Generator) -> Topology:
    """The layout asked for, its missing sizes drawn."""
    if tp is None or pp is None:
        drawn = default_topology(ranks, rng, need_pp=need_pp)
        tp, pp = tp or drawn.tp, pp or drawn.pp
    return Topology(ranks=ranks, tp=tp, pp=pp)


def _play(eng: Engine, w: Workload, d: FaultDraft, steps: int) -> float:
    """Plays `steps` training steps; a stopping fault runs on until every rank is blocked (a
    step or two after the fault). Returns the median healthy step duration."""
    est = w.estimated_step_us(eng.topo)
    stops = d.stalls or d.kind is IncidentKind.CRASH
    durations: list[float] = []
    for i in range(steps + 3 if stops else steps):
        run_step(eng, w, est)
        ends = eng.step_end[-1]
        if not np.isfinite(ends).any() or (i + 1 >= steps and not stops):
            break
        if eng.plan.stop_step < 0 or i < eng.plan.stop_step:
            durations.append(float(np.median(ends)) - eng.step_start[-1])
            est = float(np.median(durations))
    return est
