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

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tracehound.analysis.common import US_PER_S, rank_nodes, who
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
    confidence = max(verdict.confidence, 0.9 if critical else 0.8)
    if verdict.basis is Basis.UNLOCALIZED:
        confidence = 0.6 if critical else 0.5  # the event localizes the stall, nothing else does
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
