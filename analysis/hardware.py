"""Hardware: a device health event that explains an anomaly of its device, its node, at its time.

An anomaly verdict (hang, stall, silent hang, straggler, slow link, node outlier) becomes a
hardware verdict only when a health sample on a culprit node is *relevant* to the symptom: of a
kind that can cause it, on the device the culprit drives, at the time the symptom began. Every
node reports warnings that explain nothing (corrected ECC errors, PCIe replays, link-level
retransmissions): were any warning on the culprit's node enough, every straggler, slow link and
hang on that node would turn into a hardware fault and be acted on at once, skipping the recovery
policy's observation of soft faults. An irrelevant sample keeps the verdict as it is and is added
to it as context evidence, worded as such ("context, does not change the verdict: ... ; why").

Kinds of samples (`health_kind`, by metric; INFO samples are plain readings and never count):

    kind          metrics
    gpu_fault     gpu_lost, ecc_uncorrectable, remapped_rows when CRITICAL (row remapping
                  failed), xid 48, 62, 64, 79, 94, 95, 119, 120, 140, and any other xid a
                  source marks CRITICAL
    nvlink_down   xid 74, nvlink_down
    slowdown      throttle, temperature_c, power_w, power_cap, power_brake, sm_clock_mhz,
                  clocks_event_reasons with a slowdown bit (NVML: 0x8 hardware slowdown, 0x20
                  software thermal, 0x40 hardware thermal, 0x80 power brake); ecc_correctable
                  and pcie_replays when CRITICAL
    nvlink        nvlink_errors
    network       nic_errors, ib_errors, ib_symbol_errors, link_flaps (NIC or InfiniBand)
    network_down  nic_link_down, ib_link_down, link_down
    low_grade     ecc_correctable, pcie_replays, remapped_rows (a WARNING: a row remapped or
                  pending), xid 63 and 92, any other xid at WARNING, clocks_event_reasons
                  without a slowdown bit (idle, application clocks, software power cap, sync
                  boost: what every busy GPU at its power limit reports)
    application   xid 13, 31, 43, 45: raised by the application's own kernels (an illegal
                  address, an exception, a preempted context) much more often than by the GPU
    unknown       every other metric

Symptoms (`symptom_of`): `stopped` (hang, stall, silent hang; a crash, for its evidence only),
`compute` (straggler: slow between collectives), `intra_link` (slow link with both ends on one
node: NVLink), `inter_link` (slow link between nodes, or a node's network), `slow_node` (node
outlier, and the slow node below).

Relevance, per kind and symptom: `device` = on the GPU of a culprit rank; `node` = anywhere on
a culprit node; `-` = never (context); `*` = corroborates only (`CORROBORATE_ONLY`):

    kind           stopped   compute   intra_link   inter_link   slow_node
    gpu_fault      device    device    device       device       node
    nvlink_down    node      -         node         -            node
    slowdown       -         device    -            -            node
    nvlink         -         -         node         -            node
    network        -         -         -            node*        node*
    network_down   node      -         -            node*        node*
    low_grade      -         -         -            -            -
    application    -         -         -            -            -
    unknown        -         -         -            -            -

A slow link is measured from the later of its two ends' arrivals, so a throttled GPU does not
slow it; NVLink and NIC samples name one end of a link (or a NIC no rank is mapped to), hence
their node scope. A NIC is the network: a slow link or a slow node already blames it, and a
few link-level retransmissions are what every NIC reports now and then, so network samples
corroborate such a verdict (kind kept, one notch more confidence, `confidence.STEP`) and never
make it a hardware fault; GPU-side faults (NVLink included) do.

Rates: a corrected-error counter is judged by its source, not here: one sample's count since
the previous reading has no baseline in a detection window. A source that finds the rate
dangerous (a DCGM health watch on the single-bit ECC or PCIe replay rate) marks the sample
CRITICAL, and it then counts as a slowdown of its device (a degrading GPU or PCIe link costs
throughput), never as the cause of a hang.

Where: a sample names a device (`gpu3`, `nic1`, `host`); a verdict names ranks. A rank drives
the GPU of its index among its node's ranks (torchrun's LOCAL_RANK, `cuda:LOCAL_RANK`); that
mapping is taken as known for a node whose ranks are `first .. first + n - 1` with `first` a
multiple of `n`, `n` the usual number of ranks per node (`health_gpu_by_local_rank`). A
`device` rule then wants the sample's GPU to be a culprit rank's: a throttled gpu5 explains no
straggler on gpu1. Where the mapping or the sample's GPU is unknown (`host`, a UUID), the node
must match, and the hardware verdict gets one notch less confidence (`confidence.STEP`).
A WARNING counts only on the verdict's most likely node (or either end of a slow link); a
CRITICAL sample on any culprit node.

When: a symptom that persists (straggler, slow link, slow node) began at or before the window:
a sample counts from `health_slack_s` before the window to `health_slack_s` after it. A stop
began between the culprits' last activity (their last collective entered or completed) and the
moment their peers started waiting (the first failed exit of a crash): a sample counts from
`health_slack_s` before the former to `health_slack_s` after the latter. A GPU that fell off
the bus 10 minutes into a stall that began an hour ago did not cause it; nor did a thermal
event that ended before the window.

A relevant sample makes the hardware verdict: the culprit nodes with one, the ranks whose GPU
the sample names first, then the anomaly's other ranks on those nodes, the anomaly's evidence
kept. CERTAIN for a CRITICAL sample, STRONG for a WARNING (one notch less for a node-level
match), never below the anomaly's own confidence; a hang that no rank explains gets LIKELY or
WEAK (the sample alone localizes it). A stall (a busy rank, alive) changes only for a CRITICAL
relevant sample. A health event alone, with no anomaly on its node, is never a verdict: the job
runs at full speed there (the hardware monitor's own policy handles such nodes). A crash and a
mismatch keep their kind; a crash gains the samples of its nodes as evidence.

A slow node (`detect_slow_node`) is the one anomaly too spread out for the other detectors: a
fault that slows every GPU of a node alike (degraded NVLink slowing its tensor-parallel
collectives, a node-wide power cap) leaves no rank last within its node, no link slow, and only
one node of many late. Its ranks then arrive late at the collectives they share with other
nodes (data parallel), window after window. With a relevant health event on that node (the
`slow_node` column, network samples excepted), this is a hardware verdict; without one it is no
verdict (the machine-level outlier model judges nodes on their own). Per node and window
(`Observation.node_windows`) its mean lateness is compared with the median of the nodes it
shares a collective group with (groups spanning more than half the job left out: they mix every
pipeline stage, as do groups that carried no collective); it must exceed it by
`straggler_min_lateness_us` and `straggler_min_slowdown` of the median rank's time between
collectives in every one of the last `outlier_windows` windows (at least `outlier_min_flagged`
of them with rows), so a one-off pause (GC, I/O) never counts. The nodes that share a pipeline
with the slow node wait for it and are late too: the health event tells them apart, which is
why this check only runs when no sharper anomaly fired.

A throttled GPU (`detect_throttled_gpu`) is the one health event that may lead: a thermal or
power throttle of 10-30% is below what the straggler rule names from timing alone, so a SLOWDOWN
sample on one GPU whose rank measurably computes longer than its role peers (and than the rest
of its node) is a hardware verdict on that rank. A throttle sample of one GPU never explains a
slow node: that takes half the node's GPUs or a host-wide sample.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Final

import numpy as np

from tracehound.analysis.common import (
    US_PER_S,
    collective_groups,
    collective_interval,
    group_members,
    judged_on_compute,
    ms,
    node_ranks,
    own_time,
    pct,
    rank_nodes,
    role_groups,
    typical_step_us,
    who,
)
from tracehound.analysis.confidence import CERTAIN, LIKELY, STRONG, WEAK, nudged
from tracehound.analysis.liveness import last_activity_us
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import HealthSample, HealthSeverity, IncidentKind

UPGRADABLE = frozenset({
    IncidentKind.HANG, IncidentKind.SILENT_HANG, IncidentKind.STRAGGLER, IncidentKind.SLOW_LINK,
    IncidentKind.NODE_OUTLIER,
})
_SEVERITY = {HealthSeverity.CRITICAL: 2, HealthSeverity.WARNING: 1}
_EVENTS_PER_NODE = 4
"""Health samples quoted per node in a verdict's evidence."""


class HealthKind(enum.StrEnum):
    """What a health sample says about its device (the module docstring lists the metrics)."""

    GPU_FAULT = "gpu_fault"
    NVLINK_DOWN = "nvlink_down"
    SLOWDOWN = "slowdown"
    NVLINK = "nvlink"
    NETWORK = "network"
    NETWORK_DOWN = "network_down"
    LOW_GRADE = "low_grade"
    APPLICATION = "application"
    UNKNOWN = "unknown"


class Symptom(enum.StrEnum):
    """What an anomaly verdict shows of its culprits (see `symptom_of`)."""

    STOPPED = "stopped"
    COMPUTE = "compute"
    INTRA_LINK = "intra_link"
    INTER_LINK = "inter_link"
    SLOW_NODE = "slow_node"


class Scope(enum.StrEnum):
    """Where a relevant sample must be: on a culprit rank's GPU, or anywhere on its node."""

    DEVICE = "device"
    NODE = "node"


_K, _S, _D, _N = HealthKind, Symptom, Scope.DEVICE, Scope.NODE
RELEVANCE: Final[Mapping[HealthKind, Mapping[Symptom, Scope]]] = MappingProxyType({
    _K.GPU_FAULT: {_S.STOPPED: _D, _S.COMPUTE: _D, _S.INTRA_LINK: _D, _S.INTER_LINK: _D,
                   _S.SLOW_NODE: _N},
    _K.NVLINK_DOWN: {_S.STOPPED: _N, _S.INTRA_LINK: _N, _S.SLOW_NODE: _N},
    _K.SLOWDOWN: {_S.COMPUTE: _D, _S.SLOW_NODE: _N},
    _K.NVLINK: {_S.INTRA_LINK: _N, _S.SLOW_NODE: _N},
    _K.NETWORK: {_S.INTER_LINK: _N, _S.SLOW_NODE: _N},
    _K.NETWORK_DOWN: {_S.STOPPED: _N, _S.INTER_LINK: _N, _S.SLOW_NODE: _N},
    _K.LOW_GRADE: {},
    _K.APPLICATION: {},
    _K.UNKNOWN: {},
})
"""The relevance table of the module docstring: kind -> symptom -> where (absent: never)."""
CORROBORATE_ONLY: Final = frozenset({
    (_K.NETWORK, _S.INTER_LINK), (_K.NETWORK, _S.SLOW_NODE),
    (_K.NETWORK_DOWN, _S.INTER_LINK), (_K.NETWORK_DOWN, _S.SLOW_NODE),
})
"""The relevant (kind, symptom) pairs that keep the verdict's kind and add one notch of
confidence instead of making it a hardware verdict (the starred cells of the table)."""

_METRICS: Final[Mapping[str, tuple[HealthKind, HealthKind]]] = MappingProxyType({
    # metric: (kind of a WARNING, kind of a CRITICAL sample)
    "gpu_lost": (_K.GPU_FAULT, _K.GPU_FAULT),
    "ecc_uncorrectable": (_K.GPU_FAULT, _K.GPU_FAULT),
    "remapped_rows": (_K.LOW_GRADE, _K.GPU_FAULT),
    "nvlink_down": (_K.NVLINK_DOWN, _K.NVLINK_DOWN),
    "nvlink_errors": (_K.NVLINK, _K.NVLINK),
    **dict.fromkeys(
        ("throttle", "temperature_c", "power_w", "power_cap", "power_brake", "sm_clock_mhz",
         "clocks_event_reasons"),
        (_K.SLOWDOWN, _K.SLOWDOWN)),
    **dict.fromkeys(("nic_errors", "ib_errors", "ib_symbol_errors", "link_flaps"),
                    (_K.NETWORK, _K.NETWORK)),
    **dict.fromkeys(("nic_link_down", "ib_link_down", "link_down"),
                    (_K.NETWORK_DOWN, _K.NETWORK_DOWN)),
    "ecc_correctable": (_K.LOW_GRADE, _K.SLOWDOWN),
    "pcie_replays": (_K.LOW_GRADE, _K.SLOWDOWN),
})
_XID_FATAL = frozenset({48, 62, 64, 79, 94, 95, 119, 120, 140})
"""Xids of a GPU that lost its memory contents or itself: double-bit ECC, a crashed internal
micro-controller, a failed row remapping, fallen off the bus, (un)contained ECC, GSP errors."""
_CLOCK_SLOWDOWN_BITS: Final = 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock event reasons that slow a GPU below what its peers run at: hardware slowdown,
software and hardware thermal slowdown, power brake. The others (0x1 idle, 0x2 application
clocks, 0x4 software power cap, 0x10 sync boost, 0x100 display clocks) are what a healthy GPU
under load reports all the time."""
_XID_NVLINK = frozenset({74})
_XID_LOW_GRADE = frozenset({63, 92})
"""A row remapping recorded; a high single-bit ECC rate."""
_XID_APPLICATION = frozenset({13, 31, 43, 45})
"""Graphics engine exception, MMU fault, GPU stopped processing, preemptive cleanup."""

_KIND_WORDS = {
    _K.GPU_FAULT: "a GPU fault", _K.NVLINK_DOWN: "an NVLink failure",
    _K.SLOWDOWN: "throttling or slowed clocks", _K.NVLINK: "NVLink errors",
    _K.NETWORK: "NIC or InfiniBand errors", _K.NETWORK_DOWN: "a network link down",
    _K.LOW_GRADE: "a low-grade warning",
    _K.APPLICATION: "an Xid the application's own kernels usually raise",
    _K.UNKNOWN: "a metric the analysis does not interpret",
}
_SYMPTOM_WORDS = {
    _S.STOPPED: "a rank that stopped", _S.COMPUTE: "slow computation",
    _S.INTRA_LINK: "a slow link within a node", _S.INTER_LINK: "a slow link between nodes",
    _S.SLOW_NODE: "a slow node",
}
_GPU = re.compile(r"(?:gpu|cuda:?)(\d+)", re.IGNORECASE)


def health_kind(s: HealthSample) -> HealthKind:
    """The kind of a health sample (the module docstring's first table)."""
    metric = s.metric.lower()
    critical = s.severity is HealthSeverity.CRITICAL
    if metric == "xid":
        code = int(s.value)
        if code in _XID_APPLICATION:
            return _K.APPLICATION
        if code in _XID_NVLINK:
            return _K.NVLINK_DOWN
        if code in _XID_FATAL or (critical and code not in _XID_LOW_GRADE):
            return _K.GPU_FAULT
        return _K.LOW_GRADE
    if metric == "clocks_event_reasons" and not int(s.value) & _CLOCK_SLOWDOWN_BITS:
        return _K.LOW_GRADE
    kinds = _METRICS.get(metric)
    if kinds is None:
        return _K.UNKNOWN
    return kinds[1] if critical else kinds[0]


def symptom_of(verdict: Verdict, nodes: Mapping[int, str]) -> Symptom | None:
    """What the verdict shows of its culprits, or None for a kind health never explains."""
    kind = verdict.kind
    if kind in (IncidentKind.HANG, IncidentKind.STALL, IncidentKind.SILENT_HANG,
                IncidentKind.CRASH):
        return _S.STOPPED
    if kind is IncidentKind.STRAGGLER:
        return _S.COMPUTE
    if kind is IncidentKind.NODE_OUTLIER:
        return _S.SLOW_NODE
    if kind is IncidentKind.SLOW_LINK:
        link = verdict.culprit_link
        if link is not None and nodes.get(link[0], "?a") == nodes.get(link[1], "?b"):
            return _S.INTRA_LINK
        return _S.INTER_LINK
    return None


def rank_gpus(snap: JobSnapshot, settings: DetectionSettings) -> dict[int, int]:
    """Rank -> the index of the GPU it drives, for the nodes where that mapping is known (see
    the module docstring); empty when `health_gpu_by_local_rank` is off."""
    if not settings.hardware.health_gpu_by_local_rank:
        return {}
    per_node = node_ranks(rank_nodes(snap))
    if not per_node:
        return {}
    width = Counter(len(ranks) for ranks in per_node.values()).most_common(1)[0][0]
    out: dict[int, int] = {}
    for ranks in per_node.values():
        first = ranks[0]
        if len(ranks) == width and first % width == 0 and ranks[-1] - first == width - 1:
            out.update((r, r - first) for r in ranks)
    return out


def _gpu_index(device: str) -> int | None:
    found = _GPU.fullmatch(device.strip())
    return int(found.group(1)) if found else None


def _stop_onset_us(verdict: Verdict, obs: Observation) -> int | None:
    """When the culprits' peers started waiting (or the first culprit failed), if known."""
    snap = obs.snapshot
    if verdict.kind is IncidentKind.CRASH:
        failed = [e.time_us for e in snap.exits
                  if e.exit_code != 0 and e.rank in verdict.culprit_ranks]
        return min(failed) if failed else None
    waited = [e.value for e in verdict.evidence if e.fact is Fact.WAITING]
    if waited:
        return verdict.observed_at_us - round(max(waited) * US_PER_S)
    pending = [g.last_enqueue_us for hb in snap.heartbeats for g in hb.groups
               if g.pending_op and g.last_enqueue_us > 0]
    return min(pending) if pending else None


def symptom_span(verdict: Verdict, symptom: Symptom, obs: Observation) -> tuple[int, int]:
    """The earliest and the latest time the symptom can have begun (see the module docstring:
    "When"); health samples count within `health_slack_s` of it."""
    if symptom is _S.STOPPED:
        onset = _stop_onset_us(verdict, obs)
        if onset is not None:
            culprits = set(verdict.culprit_ranks)
            active = [last_activity_us(hb) for hb in obs.snapshot.heartbeats
                      if hb.rank in culprits]
            return min([*(t for t in active if t > 0), onset]), onset
    return obs.window_start_us, obs.window_end_us


@dataclass(frozen=True, slots=True)
class Judged:
    """One health sample on a culprit node, judged against the verdict's symptom."""

    sample: HealthSample
    kind: HealthKind
    ranks: tuple[int, ...]
    """The culprit ranks it bears on: those whose GPU it names, else all on its node."""
    exact: bool
    """Matched where its rule wants it (False: a device rule met at node level only)."""
    why_not: str = ""
    """Why it does not bear on the symptom; empty when it does."""
    hardware: bool = True
    """Whether, relevant, it makes a hardware verdict (False: it corroborates the verdict)."""

    @property
    def relevant(self) -> bool:
        return not self.why_not

    @property
    def converts(self) -> bool:
        """Relevant, and of a kind that makes the verdict a hardware verdict."""
        return self.relevant and self.hardware

    @property
    def corroborates(self) -> bool:
        """Relevant, and of a kind that only corroborates the verdict."""
        return self.relevant and not self.hardware


def _timing(t: int, span: tuple[int, int], slack: int, symptom: Symptom) -> str:
    """Why a sample's time rules it out, or "" when it is near enough the symptom's onset."""
    lo, hi = span
    stopped = symptom is _S.STOPPED
    beyond = f"more than the {slack / US_PER_S:g} s slack"
    if t < lo - slack:
        began = "the ranks stopped" if stopped else "the window began"
        return f"reported {(lo - t) / US_PER_S:.0f} s before {began}, {beyond}"
    if t > hi + slack:
        ended = "the ranks stopped" if stopped else "the window ended"
        return f"reported {(t - hi) / US_PER_S:.0f} s after {ended}, {beyond}"
    return ""


def judge_health(verdict: Verdict, obs: Observation,
                 settings: DetectionSettings) -> list[Judged]:
    """The warning and critical samples on the verdict's culprit nodes, each judged relevant
    to its symptom or not (the module docstring's rules); relevant first, then the most
    severe, the exact matches and the earliest."""
    culprit_nodes = set(verdict.culprit_nodes)
    samples = [s for s in obs.health
               if s.severity in _SEVERITY and str(s.node) in culprit_nodes]
    if not samples:
        return []
    nodes = rank_nodes(obs.snapshot)
    symptom = symptom_of(verdict, nodes)
    if symptom is None:
        return []
    if verdict.culprit_link is not None:
        primary = {nodes.get(r, "unknown") for r in verdict.culprit_link}
    else:
        primary = set(verdict.culprit_nodes[:1])
    on_node: dict[str, list[int]] = {}
    for r in verdict.culprit_ranks:
        on_node.setdefault(nodes.get(r, "unknown"), []).append(r)
    gpus = rank_gpus(obs.snapshot, settings)
    span = symptom_span(verdict, symptom, obs)
    slack = round(settings.hardware.health_slack_s * US_PER_S)
    # The events of the minutes before the window (`Observation.health`) are judged for a
    # stop, which may have begun then; a symptom of the window is judged by the window's own.
    oldest = -1 if symptom is _S.STOPPED else obs.window_start_us - slack
    out = []
    for s in (s for s in samples if s.time_us >= oldest):
        node = str(s.node)
        ranks = tuple(on_node.get(node, ()))
        kind = health_kind(s)
        scope = RELEVANCE[kind].get(symptom)
        exact = True
        if scope is None:
            why = f"{_KIND_WORDS[kind]} does not explain {_SYMPTOM_WORDS[symptom]}"
        elif s.severity is HealthSeverity.WARNING and node not in primary:
            why = "a warning on a node other than the verdict's most likely one"
        else:
            why = _timing(s.time_us, span, slack, symptom)
        if not why and scope is Scope.DEVICE:
            gpu = _gpu_index(s.device)
            mapped = [r for r in ranks if r in gpus]
            if gpu is None or not mapped:
                exact = False
            else:
                mine = tuple(r for r in mapped if gpus[r] == gpu)
                if mine:
                    ranks = mine
                else:
                    words = ", ".join(f"gpu{gpus[r]} of rank {r}" for r in mapped[:4])
                    why = f"on {s.device}, not on the culprit's GPU ({words})"
        out.append(Judged(sample=s, kind=kind, ranks=ranks, exact=exact, why_not=why,
                          hardware=(kind, symptom) not in CORROBORATE_ONLY))
    out.sort(key=lambda j: (not j.converts, not j.relevant, -_SEVERITY[j.sample.severity],
                            not j.exact, j.sample.time_us, j.sample.device, j.sample.metric))
    return out


def health_events(obs: Observation, settings: DetectionSettings) -> dict[str, list[HealthSample]]:
    """Warning and critical samples near the window, per node, worst and earliest first."""
    slack = int(settings.hardware.health_slack_s * US_PER_S)
    lo, hi = obs.window_start_us - slack, obs.window_end_us + slack
    out: dict[str, list[HealthSample]] = {}
    for s in obs.health:
        if s.severity in _SEVERITY and lo <= s.time_us <= hi:
            out.setdefault(str(s.node), []).append(s)
    for samples in out.values():
        samples.sort(key=lambda s: (-_SEVERITY[s.severity], s.time_us, s.device, s.metric))
    return out


def _event_words(s: HealthSample, obs: Observation) -> str:
    when = (s.time_us - obs.window_end_us) / US_PER_S
    rel = f"{-when:.1f} s before the window ended" if when <= 0 else f"{when:.1f} s after it"
    value = f"{s.value:g}"
    detail = f" ({s.detail})" if s.detail else ""
    return f"{s.severity.value} {s.metric}={value} on {s.device} of node {s.node}{detail}, {rel}"


def _health_evidence(samples: Sequence[HealthSample], obs: Observation,
                     rank: int, limit: int) -> list[Evidence]:
    return [
        Evidence(fact=Fact.HEALTH, rank=rank, node=str(s.node), detail=_event_words(s, obs),
                 value=float(s.value))
        for s in samples[:limit]
    ]


def _judged_evidence(judged: Sequence[Judged], obs: Observation) -> list[Evidence]:
    """Evidence for judged samples, at most `_EVENTS_PER_NODE` per node; the irrelevant ones
    worded as context, the corroborating ones as such."""
    out: list[Evidence] = []
    per_node: Counter[str] = Counter()
    for j in judged:
        s = j.sample
        node = str(s.node)
        if per_node[node] >= _EVENTS_PER_NODE:
            continue
        per_node[node] += 1
        words = _event_words(s, obs)
        if not j.relevant:
            words = f"context, does not change the verdict: {words}; {j.why_not}"
        elif not j.hardware:
            words = f"corroborates the verdict, kind kept: {words}"
        out.append(Evidence(fact=Fact.HEALTH, rank=j.ranks[0] if j.ranks else -1, node=node,
                            detail=words, value=float(s.value)))
    return out


def correlate_hardware(verdict: Verdict, obs: Observation, settings: DetectionSettings, *,
                       critical_only: bool = False) -> Verdict | None:
    """The hardware verdict behind an anomaly verdict, or None when no culprit node reported a
    health sample relevant to it (see the module docstring). `critical_only`: only a CRITICAL
    sample counts (a stall, whose busy rank is alive)."""
    if verdict.kind not in UPGRADABLE:
        return None
    judged = judge_health(verdict, obs, settings)
    relevant = [j for j in judged
                if j.converts and (j.sample.severity is HealthSeverity.CRITICAL
                                   or not critical_only)]
    if not relevant:
        return None
    others = [j for j in judged if j not in relevant]
    hit: list[str] = list(dict.fromkeys(str(j.sample.node) for j in relevant))
    known = rank_nodes(obs.snapshot)
    named = [r for j in relevant for r in j.ranks]
    rest = [r for r in verdict.culprit_ranks if known.get(r, "unknown") in hit]
    ranks = tuple(dict.fromkeys([*named, *rest]))
    best = relevant[0]
    critical = best.sample.severity is HealthSeverity.CRITICAL
    level = CERTAIN if critical else STRONG
    if verdict.basis is Basis.UNLOCALIZED:
        # The event localizes the stall, nothing else does.
        level = LIKELY if critical else WEAK
        confidence = level if best.exact else nudged(level, -1)
    else:
        confidence = max(verdict.confidence, level if best.exact else nudged(level, -1))
    culprit_words = who(ranks, known) if ranks else f"node {hit[0]}"
    summary = (
        f"{_event_words(best.sample, obs)} coincides with the {verdict.kind.value} of "
        f"{culprit_words}: {verdict.summary}"
    )
    return replace(
        verdict, kind=IncidentKind.HARDWARE, basis=Basis.HEALTH_CORRELATION,
        culprit_ranks=ranks, culprit_nodes=tuple(hit), confidence=round(confidence, 3),
        summary=summary,
        evidence=(*_judged_evidence(relevant, obs), *verdict.evidence,
                  *_judged_evidence(others, obs)),
    )


def with_health_evidence(verdict: Verdict, obs: Observation,
                         settings: DetectionSettings) -> Verdict:
    """The verdict with the health samples of its culprit nodes appended as evidence, kind and
    culprits unchanged: an Xid on the node of the rank that crashed first, NIC errors that
    corroborate a slow link (one notch more confidence), or a warning that bears on nothing the
    verdict shows, worded as context."""
    judged = judge_health(verdict, obs, settings)
    if verdict.kind is not IncidentKind.CRASH:
        # A relevant sample left standing: a warning on a stall (see `correlate_hardware`).
        judged = [
            j if not j.converts else replace(
                j, why_not=f"a {j.sample.severity.value} does not turn a {verdict.kind.value} "
                           "into a hardware fault")
            for j in judged
        ]
    extra = _judged_evidence(judged, obs)
    if not extra:
        return verdict
    confidence = verdict.confidence
    if any(j.corroborates for j in judged):
        confidence = nudged(confidence)
    return replace(verdict, confidence=confidence, evidence=verdict.evidence + tuple(extra))


def _makes_slow_node(kind: HealthKind) -> bool:
    return _S.SLOW_NODE in RELEVANCE[kind] and (kind, _S.SLOW_NODE) not in CORROBORATE_ONLY


def _slow_node_events(obs: Observation,
                      settings: DetectionSettings) -> dict[str, list[HealthSample]]:
    """The samples near the window that can explain a slow node (its column of the table),
    per node, worst and earliest first."""
    per_node = node_ranks(rank_nodes(obs.snapshot))
    out: dict[str, list[HealthSample]] = {}
    for node, samples in health_events(obs, settings).items():
        kept = [s for s in samples if _makes_slow_node(health_kind(s))]
        # Throttling of one GPU slows one rank (`detect_throttled_gpu`), not its node: a node
        # slowed alike needs it reported by at least half its GPUs, or for the whole host.
        throttled = {g for s in kept if health_kind(s) is HealthKind.SLOWDOWN
                     and (g := _gpu_index(s.device)) is not None}
        if 0 < len(throttled) < max(2, len(per_node.get(node, ())) / 2):
            kept = [s for s in kept if health_kind(s) is not HealthKind.SLOWDOWN
                    or _gpu_index(s.device) is None]
        if kept:
            out[node] = kept
    return out


def _late_windows(obs: Observation, node: str, nodes: dict[int, str],
                  settings: DetectionSettings, interval: float) -> list[tuple[float, float]]:
    """(node lateness, peer median) per recent window when the node is late in every one of
    them (see the module docstring), else []."""
    windows = obs.node_windows
    if windows is None or node not in windows.nodes:
        return []
    mine = frozenset(node_ranks(nodes).get(node, ()))
    half = len(nodes) / 2
    peers: set[str] = set()
    for members in collective_groups(obs.snapshot, group_members(obs.snapshot)).values():
        if len(members) <= half and members & mine:
            peers.update(nodes.get(r, "") for r in members - mine)
    index = {n: i for i, n in enumerate(windows.nodes)}
    cols = [index[p] for p in sorted(peers) if p in index]
    if not cols:
        return []
    lateness = windows.features[-settings.outliers.windows:, :, 0]
    own = lateness[:, index[node]]
    seen = ~np.isnan(own)
    if int(seen.sum()) < settings.outliers.min_flagged:
        return []
    margin = max(settings.straggler.min_lateness_us, settings.straggler.min_slowdown * interval)
    out: list[tuple[float, float]] = []
    for w in np.flatnonzero(seen):
        theirs = lateness[w, cols]
        theirs = theirs[~np.isnan(theirs)]
        if theirs.size == 0:
            return []
        center = float(np.median(theirs))
        if float(own[w]) - center < margin:
            return []
        out.append((float(own[w]), center))
    return out


def detect_slow_node(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    """A hardware verdict on a node with a health event whose ranks arrive late at the
    collectives they share with other nodes in every recent window (see the module docstring)."""
    stats = obs.ranks
    if stats is None or obs.node_windows is None:
        return None
    events = _slow_node_events(obs, settings)
    if not events:
        return None
    judged = stats.n >= settings.straggler.min_collectives
    if not judged.any():
        return None
    interval = collective_interval(stats, judged)
    if interval <= 0:
        return None
    nodes = rank_nodes(obs.snapshot)
    found: list[tuple[int, float, str, list[tuple[float, float]]]] = []
    for node, samples in events.items():
        late = _late_windows(obs, node, nodes, settings, interval)
        if late:
            excess = min(own - center for own, center in late)
            found.append((-_SEVERITY[samples[0].severity], -excess, node, late))
    if not found:
        return None
    found.sort()
    _, _, node, late = found[0]
    ranks = tuple(node_ranks(nodes).get(node, ()))
    first = ranks[0] if ranks else -1
    excess = min(own - center for own, center in late)
    critical = events[node][0].severity is HealthSeverity.CRITICAL
    late_words = (
        f"the ranks of node {node} arrived {ms(sum(o for o, _ in late) / len(late))} after the "
        f"first member on average in each of the last {len(late)} windows, at least "
        f"{ms(excess)} later than the median of the nodes they share collective groups with "
        f"({excess / interval:.0%} of the time between collectives); no rank of it stands out "
        "within the node"
    )
    evidence = _health_evidence(events[node], obs, first, 4) + [
        Evidence(fact=Fact.LATE, rank=first, node=node,
                 detail=f"window {i + 1}: node lateness {ms(own)}, its peer nodes' median "
                        f"{ms(center)}",
                 value=round((own - center) / US_PER_S, 6))
        for i, (own, center) in enumerate(late)
    ]
    return Verdict(
        job=obs.snapshot.job, attempt=obs.snapshot.attempt, kind=IncidentKind.HARDWARE,
        culprit_ranks=ranks, culprit_nodes=(node,), confidence=STRONG if critical else LIKELY,
        basis=Basis.HEALTH_CORRELATION,
        summary=f"{_event_words(events[node][0], obs)} coincides with a slow node: {late_words}",
        evidence=tuple(evidence[: settings.max_evidence]), observed_at_us=obs.snapshot.now_us,
    )



def detect_throttled_gpu(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    """A hardware verdict on a GPU that reports throttling or slowed clocks (a warning or
    critical SLOWDOWN sample near the window) while its rank computes measurably longer than
    its role peers: `throttle_min_excess` x, by `straggler_min_excess_us` in all and by
    `straggler_min_step_cost` of each step (or the job waits on it alone that share of the
    time), not in one pause, and the slowest rank of its node
    (a node slowed alike is `detect_slow_node`'s).

    A thermal or power throttle of 10-30% is below what the straggler rule needs to name a rank
    from timing alone; the device's own report makes the smaller slowdown credible, and the
    measured slowdown keeps a harmless clock event (a brief power cap) from mattering."""
    stats = obs.ranks
    if stats is None:
        return None
    judged = judged_on_compute(stats, min_collectives=settings.straggler.busy_min_collectives,
                               min_active_us=settings.straggler.min_active_us)
    if int(judged.sum()) < 2:
        return None
    own = own_time(stats, judged, role_groups(obs.snapshot, obs.links, stats.rank))
    if own is None:
        return None
    step_us = typical_step_us(obs.snapshot)
    if step_us <= 0 or stats.active_us is None:
        return None
    # its extra compute costs the job a share of each step, as a straggler's must: by the
    # compute the trace sees, or by the job's waits on it alone (in data parallel jobs most of
    # a rank's compute overlaps its gradient buckets and hides from the trace; the wait does not)
    steps = np.maximum(np.asarray(stats.active_us, dtype=np.float64) / step_us, 1.0)
    throttled_slow = (
        judged
        & ((own.excess_us / steps >= settings.straggler.min_step_cost * step_us)
           | (own.blame_share >= settings.straggler.min_step_cost))
        & (own.ratio >= settings.hardware.throttle_min_excess)
        & (own.excess_us >= settings.straggler.min_excess_us)
        & own.spread_out()
    )
    nodes = rank_nodes(obs.snapshot)
    gpus = rank_gpus(obs.snapshot, settings)
    by_node = node_ranks(nodes)
    position = {int(r): i for i, r in enumerate(stats.rank)}
    found: list[tuple[float, int, HealthSample]] = []
    for node, samples in health_events(obs, settings).items():
        for s in samples:
            gpu = _gpu_index(s.device)
            if health_kind(s) is not HealthKind.SLOWDOWN or gpu is None:
                continue
            ranks = [r for r in by_node.get(node, ()) if r in position and judged[position[r]]
                     and gpus.get(r) == gpu]
            if len(ranks) != 1:
                continue  # the sample names no one rank's GPU
            i = position[ranks[0]]
            mates = [position[r] for r in by_node.get(node, ()) if r in position and r != ranks[0]]
            if throttled_slow[i] and all(own.ratio[i] > own.ratio[j] for j in mates):
                found.append((-float(own.ratio[i]), ranks[0], s))
    if not found:
        return None
    found.sort(key=lambda f: (f[0], -_SEVERITY[f[2].severity], f[2].time_us))
    _, rank, sample = found[0]
    i = position[rank]
    node = nodes.get(rank, "unknown")
    critical = sample.severity is HealthSeverity.CRITICAL
    slow = (
        f"rank {rank} on node {node} computes {own.ratio[i]:.2f}x as long as its role peers: "
        f"outside its operations {pct(own.share[i])} of its time against their "
        f"{pct(own.peer_share[i])}, about {ms(float(own.excess_us[i]))} more over "
        f"{int(stats.n[i])} collectives"
    )
    evidence = [
        *_health_evidence([x for _, r, x in found if r == rank], obs, rank, _EVENTS_PER_NODE),
        Evidence(fact=Fact.LATE, rank=rank, node=node, detail=slow,
                 value=round(float(own.ratio[i]), 4)),
    ]
    return Verdict(
        job=obs.snapshot.job, attempt=obs.snapshot.attempt, kind=IncidentKind.HARDWARE,
        culprit_ranks=(rank,), culprit_nodes=(node,), confidence=STRONG if critical else LIKELY,
        basis=Basis.HEALTH_CORRELATION,
        summary=f"{_event_words(sample, obs)} on the GPU of a slow rank: {slow}",
        evidence=tuple(evidence[: settings.max_evidence]), observed_at_us=obs.snapshot.now_us,
    )
