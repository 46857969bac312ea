"""Fault injection: one fault of a class drawn into the engine's `Plan`, with its ground truth.

`draw_fault` picks the culprit, the step it strikes in and the form of the fault (`Truth.variant`
says which was drawn), and writes the perturbation into the plan the engine plays: a rank's stop
time, a slower speed, a slower group, an overridden call or a collective that never completes.
Health events the fault would raise on its node are noted for the records. How large a
graded fault is and when it starts depend on the `Conditions` (`Truth.size` records the
factor drawn). `add_red_herrings` adds the lab's benign noise, `add_field_noise` the field's;
`crash_cascade` says who dies after a crash, and when.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tracehound.analysis.sim.conditions import LAB, Conditions
from tracehound.analysis.sim.engine import Events, Override, Plan
from tracehound.analysis.sim.topology import Family, GroupLayout, Topology, node_name
from tracehound.analysis.sim.workloads import Workload
from tracehound.tracing.events import HealthSeverity, IncidentKind
from tracehound.tracing.summaries import F64, I64

FAULT_KINDS: tuple[IncidentKind, ...] = (
    IncidentKind.HANG, IncidentKind.CRASH, IncidentKind.MISMATCH, IncidentKind.STRAGGLER,
    IncidentKind.SLOW_LINK, IncidentKind.HARDWARE, IncidentKind.SILENT_HANG,
)
"""The fault classes `simulate` can inject (None injects nothing)."""

CRASH_CODES = {"oom_kill": -9, "segfault": -11, "abort": -6, "exception": 1}
"""The exit code of the first rank to die, per crash variant."""
STALLED = frozenset({"compute_stuck", "sigstop", "op_hang", "skip", "xid_hang", "nvlink_hang",
                     "dataloader", "storage_read", "cuda_sync"})
"""The variants after which the job makes no progress."""

HealthNote = tuple[int, str, str, float, HealthSeverity, str, str]
"""(rank, metric, device, value, severity, detail, when) of a health event to report; when is
"stop" or "stall" (as the fault strikes), "onset" (as it starts to show; a state that persists,
so a window starting later sees it in the agent's periodic samples), "start" (early in the
window) or "any"."""


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
    size: float = 0.0
    """How large a graded fault is: the slowdown of a straggler or a thermal GPU, the factor
    by which a slow link, NIC or NVLink takes longer (0 for faults that are not graded)."""

    def accepts(self, rank: int, node: str) -> bool:
        """Whether naming `rank` (on `node`) first is right: a culprit rank, either end of the
        slow link, the rank of a slow NIC, any rank of a slow node or of the node with the
        hardware fault."""
        if self.kind is None:
            return False
        if self.kind is IncidentKind.SLOW_LINK and self.variant == "nic":
            return rank in self.culprit_ranks
        if self.kind is IncidentKind.HARDWARE or (
            self.kind is IncidentKind.SLOW_LINK and self.link is None
        ):
            return node in self.culprit_nodes
        if self.link is not None and rank in self.link:
            return True
        return rank in self.culprit_ranks


@dataclass(slots=True)
class FaultDraft:
    """A fault being planned: the plan for the engine and what to report about it."""

    plan: Plan
    kind: IncidentKind | None
    variant: str = ""
    culprits: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    link: tuple[int, int] | None = None
    health: list[HealthNote] = field(default_factory=list)
    onset_step: int = 0
    """The step a fault that builds up (straggler, thermal) starts to show in."""
    silent: tuple[int, ...] = ()
    """Ranks stuck outside any collective (a silent hang)."""
    size: float = 0.0

    @property
    def stalls(self) -> bool:
        """Whether the job stops making progress after the fault."""
        return self.variant in STALLED

    def truth(self, fault_us: int) -> Truth:
        return Truth(kind=self.kind, culprit_ranks=self.culprits, culprit_nodes=self.nodes,
                     link=self.link, variant=self.variant, fault_us=fault_us, size=self.size)


@dataclass(frozen=True, slots=True)
class _Draw:
    """What every fault class draws from: the job and the culprit picked first."""

    topo: Topology
    layout: GroupLayout
    workload: Workload
    steps: int
    rng: np.random.Generator
    culprit: int
    stage: int
    step: int
    """The step a sudden fault strikes in."""
    conditions: Conditions
    earliest: int = 2
    """The first step a fault may strike in."""
    mid_run: bool = False
    """A fault that builds up starts at `earliest` or later too (not at the first step)."""

    def size(self, lab: tuple[float, float], field: tuple[float, float]) -> float:
        """A fault's size, drawn uniformly from the lab's range or the field's."""
        lo, hi = field if self.conditions.grey_zone else lab
        return float(self.rng.uniform(lo, hi))

    def onset(self, lab_late_p: float) -> int:
        """The step a fault that builds up starts to show in: in the lab the first (or with
        chance `lab_late_p` the first or the second), in the field any step up to the middle one
        (the first with chance 0.3: `Conditions.onset_mid_window`)."""
        rng = self.rng
        if self.mid_run:
            return int(rng.integers(self.earliest, max(self.steps - 1, self.earliest + 1)))
        if self.conditions.onset_mid_window:
            return 0 if rng.random() < 0.3 or self.steps < 4 else int(
                rng.integers(1, self.steps // 2 + 1))
        return int(rng.integers(0, 2)) if rng.random() < lab_late_p else 0


def _pick(rng: np.random.Generator, options: Sequence[str], weights: Sequence[float]) -> str:
    w = np.asarray(weights, dtype=np.float64)
    return str(options[int(rng.choice(len(options), p=w / w.sum()))])


def draw_fault(kind: IncidentKind | None, variant: str | None, *, layout: GroupLayout,
               workload: Workload, plan: Plan, steps: int, rng: np.random.Generator,
               conditions: Conditions = LAB, earliest: int | None = None) -> FaultDraft:
    """Draws a fault of `kind` (None: a healthy run) into `plan`; `variant` forces its form.
    With `earliest`, any fault strikes or starts in step `earliest` .. `steps` - 1 (a fault
    in the middle of a long run); otherwise a sudden fault strikes in step 2 or later."""
    mid_run = earliest is not None
    earliest = 2 if earliest is None else earliest
    topo = layout.topo
    culprit = int(rng.integers(topo.ranks))
    f = int(rng.integers(earliest, steps)) if steps > earliest else steps - 1
    draw = _Draw(topo=topo, layout=layout, workload=workload, steps=steps, rng=rng,
                 culprit=culprit, stage=topo.coords(culprit)[0], step=f,
                 conditions=conditions, earliest=earliest, mid_run=mid_run)
    d = FaultDraft(plan=plan, kind=kind)
    if kind is None:
        d.variant = "healthy"
        return d
    inject = _INJECT.get(kind)
    if inject is None:
        raise ValueError(f"cannot simulate {kind}")
    inject(d, draw, variant)
    if not d.nodes:
        d.nodes = tuple(sorted({topo.node_of(r) for r in d.culprits}))
    return d


def _hang(d: FaultDraft, x: _Draw, variant: str | None) -> None:
    """One rank stuck in a GPU kernel (heartbeats go on) or frozen by SIGSTOP."""
    plan = d.plan
    d.variant = variant or _pick(x.rng, ("compute_stuck", "sigstop"), (0.5, 0.5))
    plan.stop_step, plan.stop_frac = x.step, float(x.rng.uniform(0.05, 0.95))
    if d.variant == "compute_stuck":
        plan.stop_compute = (x.culprit,)
    else:
        plan.stop_all = (x.culprit,)
    d.culprits = (x.culprit,)


def _crash(d: FaultDraft, x: _Draw, variant: str | None) -> None:
    """One rank dies (its peers follow: see `crash_cascade`)."""
    plan = d.plan
    d.variant = variant or _pick(x.rng, tuple(CRASH_CODES), (0.3, 0.15, 0.2, 0.35))
    plan.stop_step, plan.stop_frac = x.step, float(x.rng.uniform(0.05, 0.95))
    plan.stop_all = (x.culprit,)
    d.culprits = (x.culprit,)


def _mismatch(d: FaultDraft, x: _Draw, variant: str | None) -> None:
    """One rank calls a different op (the group hangs), size or dtype (the events disagree),
    or skips a DP bucket (the events disagree, then the job hangs)."""
    rng, w = x.rng, x.workload
    d.variant = variant or _pick(rng, ("op_hang", "size", "dtype", "skip"),
                                 (0.35, 0.2, 0.2, 0.25))
    use_tp = x.topo.tp > 1 and d.variant != "skip" and rng.random() < 0.5
    f = x.step
    if d.variant in ("size", "dtype"):
        f = int(rng.integers(max(1, x.earliest - 1), max(x.steps - 1, x.earliest)))
    op = "all_reduce"
    if use_tp:
        key = (int(Family.TP), x.stage)
        idx, nbytes = int(rng.integers(w.per_step()[Family.TP])), w.tp_bytes
    elif w.kind == "zero3":  # one of the forward parameter gathers
        key, op = w.dp_key(), "all_gather_into_tensor"
        idx = 0 if d.variant == "skip" else int(rng.integers(w.blocks))
        nbytes = w.block_bytes // x.topo.ranks // 2 * 2
    else:
        key = w.dp_key()
        idx = 0 if d.variant == "skip" else int(rng.integers(len(w.grad_bytes)))
        nbytes = w.grad_bytes[idx]
    o = Override(key=key, step=f, idx=idx, rank=x.culprit, op=op, nbytes=nbytes)
    if d.variant == "op_hang":
        others = [alt for alt in ("all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                                  "all_reduce") if alt != op]
        o.op = _pick(rng, tuple(others[:3]), (0.4, 0.3, 0.3))  # never the op it replaces
        o.hang = True
    elif d.variant == "size":
        o.nbytes = int(nbytes * float(rng.choice([0.5, 2.0]))) if rng.random() < 0.7 \
            else nbytes - 2 * int(rng.integers(1, 64))
    elif d.variant == "dtype":
        o.dtype, o.nbytes = "float32", 2 * nbytes
    else:
        o.nbytes = w.grad_bytes[1] if len(w.grad_bytes) > 1 else nbytes
        o.skip_next = True
    d.plan.override = o
    d.culprits = (x.culprit,)
    d.onset_step = f


def _straggler(d: FaultDraft, x: _Draw, variant: str | None) -> None:
    """One rank computes 20..100% slower (the field: 5..100%), from the start or from a later
    step."""
    plan = d.plan
    d.variant = variant or "slow_gpu"
    d.size = plan.speed[x.culprit] = x.size((1.2, 2.0), (1.05, 2.0))
    plan.slow_from_step = d.onset_step = x.onset(0.3)
    d.culprits = (x.culprit,)


def _slow_link(d: FaultDraft, x: _Draw, variant: str | None) -> None:
    """One pipeline pair transfers 1.6..4x slower (the field: 1.2..4x); or, in the lab, every
    link of one node 1.5..3x (its DP collectives 1.1..1.4x); or, in the field, the NIC of one
    GPU 1.2..3x: its transfers to other nodes and its DP collectives (the rest of its node is
    unaffected, every GPU has its own NIC)."""
    topo, layout, plan, rng = x.topo, x.layout, d.plan, x.rng
    if topo.pp < 2:
        raise ValueError("a slow link needs pipeline stages (pp >= 2)")
    field = x.conditions.field_layouts
    d.variant = variant or _pick(rng, ("pair", "nic" if field else "node"), (0.65, 0.35))
    plan.slow_from_step = d.onset_step = x.onset(0.0)
    if d.variant == "pair":
        b = int(rng.integers(topo.pp - 1))
        dd, t = int(rng.integers(topo.dp)), int(rng.integers(topo.tp))
        d.size = x.size((1.6, 4.0), (1.2, 4.0))
        plan.slow_groups[int(layout.p2p_gid[b, dd, t])] = d.size
        lo, hi = int(layout.grid[b, dd, t]), int(layout.grid[b + 1, dd, t])
        d.link, d.culprits = (lo, hi), (lo, hi)
        return
    if d.variant == "nic":
        d.size = x.size((1.5, 3.0), (1.2, 3.0))
        ranks: tuple[int, ...] = (x.culprit,)
        dp_factor = 1.0 + (d.size - 1.0) * float(rng.uniform(0.5, 1.0))
    elif d.variant == "node":
        d.size = x.size((1.5, 3.0), (1.2, 3.0))
        ranks = topo.node_ranks(x.culprit // topo.gpus_per_node)
        dp_factor = float(rng.uniform(1.1, 1.4))
    else:
        raise ValueError(f"unknown slow_link variant {d.variant!r}; choose from pair, nic, "
                         f"node")
    for gid in np.flatnonzero(layout.family == Family.P2P).tolist():
        if np.isin(layout.members[gid], ranks).any():
            plan.slow_groups[gid] = d.size
    for r in ranks:
        stage, _, t = topo.coords(r)
        plan.slow_groups[int(layout.dp_gid[stage, t])] = dp_factor
    d.culprits = ranks


def _hardware(d: FaultDraft, x: _Draw, variant: str | None) -> None:
    """A GPU fault with its health event on the node: thermal slowdown, an Xid 79/48 hang, or
    NVLink errors slowing or hanging the node's TP collectives."""
    nvlink = 1.0 if x.topo.tp > 1 else 0.0
    d.variant = variant or _pick(x.rng, ("thermal", "xid_hang", "nvlink_slow", "nvlink_hang"),
                                 (0.35, 0.35, 0.2 * nvlink, 0.1 * nvlink))
    if d.variant.startswith("nvlink") and x.topo.tp == 1:
        raise ValueError(f"{d.variant} needs tensor parallel groups (tp > 1)")
    inject = _HARDWARE.get(d.variant)
    if inject is None:
        raise ValueError(f"unknown hardware variant {d.variant!r}; choose from "
                         f"{', '.join(_HARDWARE)}")
    inject(d, x)
    d.nodes = (node_name(x.culprit // x.topo.gpus_per_node),)


def _thermal(d: FaultDraft, x: _Draw) -> None:
    plan, rng, culprit, dev = d.plan, x.rng, x.culprit, x.topo.device(x.culprit)
    d.size = plan.speed[culprit] = x.size((1.25, 1.8), (1.1, 1.8))
    plan.slow_from_step = d.onset_step = x.onset(1.0)
    temp = float(rng.uniform(89.0, 96.0))
    d.health += [
        (culprit, "throttle", dev, 1.0, HealthSeverity.WARNING,
         "HW thermal slowdown (clocks event reason 0x40)", "onset"),
        (culprit, "temperature_c", dev, temp, HealthSeverity.WARNING,
         f"GPU temperature {temp:.0f} C above the slowdown threshold", "onset"),
    ]
    d.culprits = (culprit,)


def _xid_hang(d: FaultDraft, x: _Draw) -> None:
    plan, rng, culprit, dev = d.plan, x.rng, x.culprit, x.topo.device(x.culprit)
    xid = int(rng.choice([79, 48]))
    plan.stop_step, plan.stop_frac = x.step, float(rng.uniform(0.05, 0.95))
    plan.stop_compute = (culprit,)
    detail = ("Xid 79: GPU has fallen off the bus" if xid == 79
              else "Xid 48: double bit ECC error")
    d.health.append((culprit, "xid", dev, float(xid), HealthSeverity.CRITICAL, detail, "stop"))
    if xid == 48:
        d.health.append((culprit, "ecc_uncorrectable", dev, 1.0, HealthSeverity.CRITICAL,
                         "volatile DBE count 1", "stop"))
    d.culprits = (culprit,)


def _nvlink_slow(d: FaultDraft, x: _Draw) -> None:
    """NVLink degraded: the TP traffic partly falls back to PCIe, 3..8x slower (the field:
    1.3..8x)."""
    topo, rng, culprit = x.topo, x.rng, x.culprit
    node_ranks = topo.node_ranks(culprit // topo.gpus_per_node)
    d.size = factor = x.size((3.0, 8.0), (1.3, 8.0))
    d.plan.slow_from_step = d.onset_step = x.onset(0.0)
    for r in node_ranks:
        p, dd, _ = topo.coords(r)
        d.plan.slow_groups[int(x.layout.tp_gid[p, dd])] = factor
    errors = float(rng.integers(40, 4000))
    d.health.append((culprit, "nvlink_errors", topo.device(culprit), errors,
                     HealthSeverity.WARNING, f"{errors:.0f} NVLink replay errors", "start"))
    d.culprits = (culprit, *[r for r in node_ranks if r != culprit])


def _nvlink_hang(d: FaultDraft, x: _Draw) -> None:
    culprit, w = x.culprit, x.workload
    tp_peers = tuple(int(r) for r in x.layout.grid[x.stage, x.topo.coords(culprit)[1]])
    idx = int(x.rng.integers(w.per_step()[Family.TP]))
    d.plan.stall = ((int(Family.TP), x.stage), x.step, idx, culprit)
    d.health.append((culprit, "xid", x.topo.device(culprit), 74.0, HealthSeverity.CRITICAL,
                     "Xid 74: NVLink error", "stall"))
    d.culprits = (culprit, *[r for r in tp_peers if r != culprit])


def _silent_hang(d: FaultDraft, x: _Draw, variant: str | None) -> None:
    """Every rank pending in the same world all_reduce, nobody silent or lagging: one to all
    ranks of a node stuck in a data loader, a storage read or a CUDA synchronize."""
    topo, rng, culprit = x.topo, x.rng, x.culprit
    d.variant = variant or _pick(rng, ("dataloader", "storage_read", "cuda_sync"),
                                 (0.45, 0.35, 0.2))
    others = [r for r in topo.node_ranks(culprit // topo.gpus_per_node) if r != culprit]
    u = rng.random()
    if u < 0.6:
        d.culprits = (culprit,)
    elif u < 0.8:
        extra = rng.choice(others, size=int(rng.integers(1, 3)), replace=False)
        d.culprits = (culprit, *sorted(int(r) for r in extra))
    else:
        d.culprits = (culprit, *others)
    d.plan.stall = ((int(Family.WORLD), 0), x.step, 0, culprit)
    d.silent = d.culprits


_INJECT: dict[IncidentKind, Callable[[FaultDraft, _Draw, str | None], None]] = {
    IncidentKind.HANG: _hang,
    IncidentKind.CRASH: _crash,
    IncidentKind.MISMATCH: _mismatch,
    IncidentKind.STRAGGLER: _straggler,
    IncidentKind.SLOW_LINK: _slow_link,
    IncidentKind.HARDWARE: _hardware,
    IncidentKind.SILENT_HANG: _silent_hang,
}
_HARDWARE: dict[str, Callable[[FaultDraft, _Draw], None]] = {
    "thermal": _thermal, "xid_hang": _xid_hang, "nvlink_slow": _nvlink_slow,
    "nvlink_hang": _nvlink_hang,
}


def add_red_herrings(d: FaultDraft, topo: Topology, steps: int,
                     rng: np.random.Generator) -> None:
    """Benign noise every job has some of, more of it in healthy runs: a GC or I/O pause of up
    to 400 ms, a GPU a few percent slower than its peers, a harmless health warning."""
    healthy = d.kind is None
    plan = d.plan
    n = topo.ranks
    if rng.random() < (0.6 if healthy else 0.3):
        plan.spike = (int(rng.integers(n)), int(rng.integers(steps)),
                      float(rng.uniform(100_000.0, 400_000.0)))
    if rng.random() < (0.4 if healthy else 0.15):
        rank = int(rng.integers(n))
        if rank not in plan.speed:
            plan.benign_speed[rank] = float(rng.uniform(1.02, 1.05))
    if rng.random() < (0.35 if healthy else 0.1):
        rank = int(rng.integers(n))
        if topo.node_of(rank) not in d.nodes:
            metric, value, detail = [
                ("pcie_replays", float(rng.integers(1, 20)), "PCIe replay counter increased"),
                ("ecc_correctable", float(rng.integers(1, 8)), "single bit ECC errors"),
                ("nic_errors", float(rng.integers(1, 30)), "link-level retransmissions"),
            ][int(rng.integers(3))]
            d.health.append((rank, metric, topo.device(rank), value,
                             HealthSeverity.WARNING, detail, "any"))


_WARNINGS = (("pcie_replays", "PCIe replay counter increased", 1, 20),
             ("ecc_correctable", "single bit ECC errors", 1, 8),
             ("nic_errors", "link-level retransmissions", 1, 30),
             ("clocks_event_reasons", "SW power cap (clocks event reason 0x4)", 4, 4))
"""Harmless health warnings: (metric, detail, lowest count, highest count). The power cap
one is a clock event healthy fleets report all the time, of the kind that explains slow
computation: it must not make a GPU running at full speed a hardware fault."""


def _warning(topo: Topology, rank: int, rng: np.random.Generator) -> HealthNote:
    metric, detail, lo, hi = _WARNINGS[int(rng.integers(len(_WARNINGS)))]
    device = topo.nic(rank) if metric == "nic_errors" else topo.device(rank)
    return (rank, metric, device, float(rng.integers(lo, hi + 1)), HealthSeverity.WARNING,
            detail, "any")


def add_field_noise(d: FaultDraft, layout: GroupLayout, steps: int, conditions: Conditions,
                    rng: np.random.Generator, *, windows: int = 1) -> None:
    """The harmless noise of a field job of `steps` steps holding `windows` windows (see
    `Conditions`): GPUs a little slower, health warnings anywhere (the culprit's node too),
    slow checkpoint writes and evaluations on rank 0 that their peers wait for in the next
    collective."""
    topo, plan, c = layout.topo, d.plan, conditions
    n = topo.ranks
    for rank in rng.integers(n, size=int(rng.poisson(c.slow_gpus))).tolist():
        if rank not in plan.speed:
            plan.benign_speed[rank] = float(rng.uniform(1.02, 1.06))
    for rank in rng.integers(n, size=int(rng.poisson(c.warnings_per_window * windows))).tolist():
        d.health.append(_warning(topo, rank, rng))
    if d.culprits and rng.random() < c.warning_on_culprit_p:
        node = topo.node_index(d.culprits[0])
        d.health.append(_warning(topo, int(rng.choice(topo.node_ranks(node))), rng))
    last = max(steps - 1, 1)
    for _ in range(int(rng.binomial(windows, c.checkpoint_p))):
        if topo.megatron:
            writers = layout.grid[:, 0, :].ravel()
        else:
            writers = np.sort(rng.choice(n, size=int(rng.integers(1, max(2, n // 16))),
                                         replace=False))
        _busy(plan, int(rng.integers(last)), writers.tolist(),
              rng.uniform(1e6, 4e6, writers.shape[0]).tolist(), "checkpoint")
    for _ in range(int(rng.binomial(windows, c.evaluation_p))):
        _busy(plan, int(rng.integers(last)), [0], [float(rng.uniform(0.5e6, 4e6))], "evaluate")


def _busy(plan: Plan, step: int, ranks: list[int], us: list[float], phase: str) -> None:
    """Adds ranks busy outside collectives after `step` (the longer time wins for a rank
    already busy then)."""
    before = plan.busy.get(step)
    if before is not None:
        have = dict(zip(before[0], before[1], strict=True))
        for r, t in zip(ranks, us, strict=True):
            have[r] = max(have.get(r, 0.0), t)
        ranks, us, phase = list(have), list(have.values()), before[2]
    plan.busy[step] = (tuple(ranks), tuple(us), phase)


_CASCADE_DELAY_US = {Family.TP: (20_000.0, 150_000.0), Family.P2P: (20_000.0, 200_000.0),
                     Family.DP: (50_000.0, 400_000.0), Family.WORLD: (500_000.0, 1_000_000.0),
                     Family.EP: (20_000.0, 200_000.0)}
"""Per family, (minimum, mean extra) time before a rank waiting on a dead peer fails."""


def crash_cascade(layout: GroupLayout, ev: Events, culprit: int, *, t_fail: float,
                  slots: I64, rng: np.random.Generator) -> tuple[F64, I64]:
    """Exit times and codes after `culprit` died at `t_fail`: whoever waits in a group with a
    dead rank fails a little later (connection reset, NCCL error), the launcher kills the rest
    2..6 s after the first death."""
    n = layout.topo.ranks
    pending = ~np.isfinite(ev.comp)
    pend_gid = np.full(n, -1, dtype=np.int64)
    pend_gid[ev.rank[pending]] = ev.gid[pending]
    waiting: dict[int, list[int]] = {}
    for r in np.flatnonzero(pend_gid >= 0).tolist():
        waiting.setdefault(int(pend_gid[r]), []).append(r)
    exit_t = np.full(n, math.inf)
    code = np.zeros(n, dtype=np.int64)
    exit_t[culprit] = t_fail
    heap = [(t_fail, culprit)]
    triggered: set[int] = set()
    while heap:
        when, rank = heapq.heappop(heap)
        if when > exit_t[rank]:
            continue
        for gid in slots[rank].tolist():
            if gid < 0 or gid in triggered or layout.family[gid] < 0:
                continue
            triggered.add(gid)
            low, mean = _CASCADE_DELAY_US[Family(int(layout.family[gid]))]
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
