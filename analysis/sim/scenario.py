"""One scenario end to end: draw the layout, the workload and the fault from the seed, play the
steps of the window and assemble what the job reported."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from tracehound.analysis.sim.conditions import FIELD, WINDOW_STEPS, Conditions
from tracehound.analysis.sim.engine import Engine, Noise, Plan
from tracehound.analysis.sim.faults import (
    FAULT_KINDS,
    FaultDraft,
    add_field_noise,
    add_red_herrings,
    draw_fault,
)
from tracehound.analysis.sim.records import SimulatedJob, assemble
from tracehound.analysis.sim.topology import GroupLayout, Topology, default_topology
from tracehound.analysis.sim.workloads import (
    WORKLOADS,
    Workload,
    draw_field_workload,
    draw_workload,
    run_step,
)
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
    conditions: Conditions = FIELD,
    skew_ms: float | None = None,
    drift_ppm: float | None = None,
    workload: str | None = None,
    gpus_per_node: int | None = None,
    step_s: float | None = None,
    combined_p2p: bool | None = None,
) -> SimulatedJob:
    """Simulate one detection window of a job of `ranks` ranks with `fault` injected.

    `fault`: an `IncidentKind` (or its value) from `FAULT_KINDS`, or None / "healthy".
    `variant`: force one form of the fault (see the package docstring); drawn when None.
    `conditions`: how hard the job is (`FIELD` or `LAB`); `skew_ms`, `drift_ppm` override its
    clocks. `workload` (one of `WORKLOADS`), `tp`, `pp`, `gpus_per_node`, `step_s` (the healthy
    step duration) and `microbatches`: the layout and the step, drawn when None;
    `combined_p2p`: a pipeline's p2p as Megatron issues it without batching
    (`Workload.combined_p2p`; off unless asked for). `steps`:
    training steps in the window (>= 3). Deterministic per (seed, ranks, fault) and the
    arguments; the clocks come from a stream of their own, so the same job under another skew
    differs only in its timestamps."""
    kind = _fault_kind(fault)
    if steps < 3:
        raise ValueError(f"steps must be >= 3, got {steps}")
    s = setup(ranks=ranks, kind=kind, seed=seed, variant=variant, tp=tp, pp=pp, steps=steps,
              microbatches=microbatches, conditions=conditions, skew_ms=skew_ms,
              drift_ppm=drift_ppm, workload=workload, gpus_per_node=gpus_per_node,
              step_s=step_s, combined_p2p=combined_p2p)
    est = _play(s.eng, s.workload, s.draft, steps)
    return assemble(s.eng, s.workload, s.draft, seed=seed, job=job, attempt=attempt,
                    est_step_us=est, conditions=s.conditions)


@dataclass(frozen=True, slots=True, eq=False)
class Scenario:
    """A drawn scenario before it is played."""

    eng: Engine
    workload: Workload
    draft: FaultDraft
    conditions: Conditions


def setup(*, ranks: int, kind: IncidentKind | None, seed: int, variant: str | None,
          tp: int | None, pp: int | None, steps: int, microbatches: int | None,
          conditions: Conditions, skew_ms: float | None, drift_ppm: float | None,
          workload: str | None, gpus_per_node: int | None, step_s: float | None,
          combined_p2p: bool | None = None, windows: int = 1,
          fault_steps: tuple[int | None, int] | None = None) -> Scenario:
    """Draws the layout, the workload, the fault and the noise of a scenario of `steps` steps
    (`windows`: how many windows' worth of noise it carries; `fault_steps`: the steps the
    fault strikes or starts between, default any but the first two)."""
    if skew_ms is not None or drift_ppm is not None:
        conditions = replace(conditions,
                             skew_ms=conditions.skew_ms if skew_ms is None else skew_ms,
                             drift_ppm=conditions.drift_ppm if drift_ppm is None else drift_ppm)
    if workload is not None and workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    rng = np.random.default_rng([seed, ranks, FAULT_KINDS.index(kind) + 1 if kind else 0])
    need_pp = kind is IncidentKind.SLOW_LINK
    if conditions.field_layouts or workload not in (None, "gpipe") or gpus_per_node:
        topo, wkind = field_layout(ranks, rng, tp=tp, pp=pp, workload=workload,
                                   gpus_per_node=gpus_per_node, need_pp=need_pp)
    else:
        topo, wkind = _topology(ranks, tp, pp, need_pp=need_pp, rng=rng), "gpipe"
    step_us = step_s * 1e6 if step_s else None
    if wkind == "gpipe" and step_us is None and not conditions.field_layouts:
        w = draw_workload(topo, rng, microbatches)
    else:
        w = draw_field_workload(topo, wkind, rng, microbatches=microbatches, step_us=step_us)
    if combined_p2p is not None:
        w = replace(w, combined_p2p=combined_p2p and topo.pp > 1)
    layout = GroupLayout(topo)
    plan = Plan()
    est = w.estimated_step_us(topo)
    noise = Noise(jitter=w.jitter, spike_p=w.spike_p, tail_p=conditions.tail_p,
                  pause_per_us=conditions.pauses_per_window / (ranks * WINDOW_STEPS * est))
    eng = Engine(layout, plan, rng, base_seq=w.base_seq(), noise=noise, dp_key=w.dp_key())
    earliest, latest = fault_steps or (None, steps)
    draft = draw_fault(kind, variant, layout=layout, workload=w, plan=plan, steps=latest,
                       rng=rng, conditions=conditions, earliest=earliest)
    add_red_herrings(draft, topo, steps, rng)
    if conditions.noisy:
        add_field_noise(draft, layout, steps, conditions, rng, windows=windows)
    return Scenario(eng=eng, workload=w, draft=draft, conditions=conditions)


def _fault_kind(fault: IncidentKind | str | None) -> IncidentKind | None:
    """The fault class asked for; ValueError for one the simulator cannot inject."""
    kind = None if fault in (None, "healthy") else IncidentKind(fault)
    if kind is not None and kind not in FAULT_KINDS:
        raise ValueError(f"cannot simulate {kind.value}; choose from "
                         f"{', '.join(k.value for k in FAULT_KINDS)} or healthy")
    return kind


def _topology(ranks: int, tp: int | None, pp: int | None, *, need_pp: bool,
              rng: np.random.Generator) -> Topology:
    """The lab layout asked for, its missing sizes drawn."""
    if tp is None or pp is None:
        drawn = default_topology(ranks, rng, need_pp=need_pp)
        tp, pp = tp or drawn.tp, pp or drawn.pp
    return Topology(ranks=ranks, tp=tp, pp=pp)


_KIND_WEIGHTS = {"ddp": 0.3, "1f1b": 0.25, "interleaved": 0.1, "gpipe": 0.05, "zero3": 0.15,
                 "moe": 0.15}
"""How often each workload is drawn for a field job (plain DDP the most common)."""
_TP_WEIGHTS = {1: 0.2, 2: 0.25, 4: 0.3, 8: 0.25}
_PP_WEIGHTS = {1: 0.35, 2: 0.3, 4: 0.25, 8: 0.1}


def _weighted(rng: np.random.Generator, weights: dict[int, float] | dict[str, float],
              allowed: list[int] | list[str]) -> int | str:
    if not allowed:
        raise ValueError("no layout fits the sizes asked for")
    p = np.array([weights[a] for a in allowed])  # type: ignore[index]
    return allowed[int(rng.choice(len(allowed), p=p / p.sum()))]


def field_layout(ranks: int, rng: np.random.Generator, *, tp: int | None, pp: int | None,
                 workload: str | None, gpus_per_node: int | None,
                 need_pp: bool) -> tuple[Topology, str]:
    """A field layout for `ranks` and its workload kind, the sizes not given drawn: plain DDP
    and ZeRO-3 without Megatron groups, Megatron jobs with TP 1..8 within a node, PP 1..8 (at
    least 2 for a slow link or an interleaved pipeline), MoE with EP 2..8 among the replicas;
    4 or 8 GPUs per node."""
    gpn = gpus_per_node or (8 if rng.random() < 0.7 else 4)
    if workload is None:
        kinds = [k for k in _KIND_WEIGHTS
                 if not (k in ("ddp", "zero3") and (need_pp or (tp or 1) > 1 or (pp or 1) > 1))
                 and not (k == "interleaved" and pp == 1)]
        workload = str(_weighted(rng, _KIND_WEIGHTS, kinds))
    if workload in ("ddp", "zero3"):
        if (tp or 1) > 1 or (pp or 1) > 1 or need_pp:
            raise ValueError(f"a {workload} job has tp = pp = 1 (a slow link needs pp >= 2)")
        return Topology(ranks=ranks, tp=1, pp=1, gpus_per_node=gpn, megatron=False), workload
    low = 2 if need_pp or workload == "interleaved" else 1

    def stages(t: int) -> list[int]:
        return [p for p in _PP_WEIGHTS if p >= low and (pp is None or p == pp)
                and ranks % (t * p) == 0 and ranks // (t * p) >= 2]

    if tp is None:
        tp = int(_weighted(rng, _TP_WEIGHTS, [t for t in _TP_WEIGHTS
                                              if gpn % t == 0 and stages(t)]))
    if pp is None:
        pp = int(_weighted(rng, _PP_WEIGHTS, stages(tp)))
    dp = ranks // (tp * pp)
    ep = 1
    if workload == "moe":
        options = [e for e in (2, 4, 8) if dp % e == 0]
        if options:
            ep = int(rng.choice(options))
        else:
            workload = "1f1b"
    vp = 2 if workload == "interleaved" else 1
    return Topology(ranks=ranks, tp=tp, pp=pp, gpus_per_node=gpn, ep=ep, vp=vp), workload


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
    return est if math.isfinite(est) else w.estimated_step_us(eng.topo)
