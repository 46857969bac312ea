"""Hardware: a device health event that coincides in time and place with an anomaly.

An anomaly verdict (hang, silent hang, straggler, slow link, node outlier) whose culprit nodes
include a node that reported a warning or critical health sample (XID, uncorrectable ECC, NVLink
or NIC errors, thermal throttling, ...) between `health_slack_s` before the window and
`health_slack_s` after it becomes a hardware verdict (a warning counts only on the verdict's most
likely node, or either end of a slow link: warnings such as corrected ECC errors are common and
mostly benign; a critical event counts on any culprit node): the node with the event is the culprit,
with the anomaly's ranks on it, and the anomaly's evidence stays attached. For a slow link this
also tells its two ends apart; for a hang that no rank explains it localizes the stall.

A health event alone, with no anomaly on its node, is never a verdict: the job still runs at
full speed there, and evicting on every ECC warning would evict healthy nodes (the hardware
monitor's own policy handles those). A crash and a mismatch keep their kind; a crash only gains
the health events of its node as evidence.

A slow node (`detect_slow_node`) is the one anomaly too spread out for the other detectors: a
fault that slows every GPU of a node alike (degraded NVLink slowing its tensor-parallel
collectives, a node-wide power cap) leaves no rank last within its node, no link slow, and only
one node of many late. Its ranks then arrive late at the collectives they share with other
nodes (data parallel), window after window. With a health event on that node, this is a
hardware verdict; without one it is no verdict (the machine-level outlier model judges nodes on
their own). Per node and window (`Observation.node_windows`) its mean lateness is compared with
the median of the nodes it shares a collective group with (groups spanning more than half the
job left out: they mix every pipeline stage, as do groups that carried no collective); it must
exceed it by `straggler_min_lateness_us` and `straggler_min_slowdown` of the median rank's time
between collectives in every one of the last `outlier_windows` windows (at least
`outlier_min_flagged` of them with rows), so a one-off pause (GC, I/O) never counts. The nodes
that share a pipeline with the slow node wait for it and are late too: the health event tells
them apart, which is why this check only runs when no sharper anomaly fired.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from tracehound.analysis.common import (
    US_PER_S,
    collective_groups,
    collective_interval,
    group_members,
    ms,
    node_ranks,
    rank_nodes,
    who,
)
from tracehound.analysis.confidence import CERTAIN, LIKELY, STRONG, WEAK
from tracehound.analysis.detect import DetectionSettings
from tracehound.analysis.observation import Observation
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import HealthSample, HealthSeverity, IncidentKind

UPGRADABLE = frozenset({
    IncidentKind.HANG, IncidentKind.SILENT_HANG, IncidentKind.STRAGGLER, IncidentKind.SLOW_LINK,
    IncidentKind.NODE_OUTLIER,
})
_SEVERITY = {HealthSeverity.CRITICAL: 2, HealthSeverity.WARNING: 1}


def health_events(obs: Observation, settings: DetectionSettings) -> dict[str, list[HealthSample]]:
    """Warning and critical samples near the window, per node, worst and earliest first."""
    slack = int(settings.health_slack_s * US_PER_S)
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


def correlate_hardware(verdict: Verdict, obs: Observation,
                       settings: DetectionSettings) -> Verdict | None:
    """The hardware verdict behind an anomaly verdict, or None when no culprit node reported a
    health event near the window (see the module docstring)."""
    if verdict.kind not in UPGRADABLE:
        return None
    events = health_events(obs, settings)
    # Warnings are common and mostly benign: they count on the verdict's most likely node (or
    # either end of a link) only; critical events count on any culprit node.
    primary = verdict.culprit_nodes[: 2 if verdict.culprit_link else 1]
    hit = [
        n for n in verdict.culprit_nodes
        if n in events and (n in primary or events[n][0].severity is HealthSeverity.CRITICAL)
    ]
    if not hit:
        return None
    hit.sort(key=lambda n: (-_SEVERITY[events[n][0].severity], verdict.culprit_nodes.index(n)))
    known = rank_nodes(obs.snapshot)
    nodes_of_culprits = {r: known.get(r, "unknown") for r in verdict.culprit_ranks}
    ranks = tuple(r for n in hit for r in verdict.culprit_ranks if nodes_of_culprits.get(r) == n)
    critical = events[hit[0]][0].severity is HealthSeverity.CRITICAL
    confidence = max(verdict.confidence, CERTAIN if critical else STRONG)
    if verdict.basis is Basis.UNLOCALIZED:
        # The event localizes the stall, nothing else does.
        confidence = LIKELY if critical else WEAK
    health: list[Evidence] = []
    for n in hit:
        rank = next((r for r in ranks if nodes_of_culprits.get(r) == n), -1)
        health += _health_evidence(events[n], obs, rank, 4)
    culprit_words = who(ranks, nodes_of_culprits) if ranks else f"node {hit[0]}"
    summary = (
        f"{_event_words(events[hit[0]][0], obs)} coincides with the {verdict.kind.value} of "
        f"{culprit_words}: {verdict.summary}"
    )
    link = verdict.culprit_link
    return replace(
        verdict, kind=IncidentKind.HARDWARE, basis=Basis.HEALTH_CORRELATION,
        culprit_ranks=ranks, culprit_nodes=tuple(hit), confidence=round(confidence, 3),
        summary=summary, evidence=tuple(health) + verdict.evidence, culprit_link=link,
    )


def with_health_evidence(verdict: Verdict, obs: Observation,
                         settings: DetectionSettings) -> Verdict:
    """The verdict with the health events of its culprit nodes appended as evidence (kind and
    culprits unchanged), e.g. an XID on the node of the rank that crashed first."""
    events = health_events(obs, settings)
    extra: list[Evidence] = []
    for n in verdict.culprit_nodes:
        if n in events:
            extra += _health_evidence(events[n], obs, -1, 4)
    if not extra:
        return verdict
    return replace(verdict, evidence=verdict.evidence + tuple(extra))


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
    lateness = windows.features[-settings.outlier_windows:, :, 0]
    own = lateness[:, index[node]]
    seen = ~np.isnan(own)
    if int(seen.sum()) < settings.outlier_min_flagged:
        return []
    margin = max(settings.straggler_min_lateness_us, settings.straggler_min_slowdown * interval)
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
    events = health_events(obs, settings)
    if not events:
        return None
    judged = stats.n >= settings.straggler_min_collectives
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
