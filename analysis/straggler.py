"""Computation straggler: the rank that consistently arrives last at its collectives.

Reads `Observation.ranks` (RankStats over the detection window). A healthy rank arrives last at
about 1/group-size of its collectives, by chance; a straggler (slower GPU, throttled clocks, a
noisy neighbour) at most of them, and late by a consistent margin. Both must hold:

- consistency: its count of last arrivals exceeds what the median rank's rate predicts by
  `straggler_min_last_z` binomial standard deviations, and its last fraction is at least
  `straggler_min_last_fraction` and `straggler_min_last_ratio` x the median rank's;
- magnitude: its mean lateness (arrival minus the first arrival) exceeds the median lateness of
  the ranks it shares a group with (its pipeline stage; groups spanning most of the job left
  out) by `straggler_min_lateness_us` and by `straggler_min_slowdown` of the median rank's time
  between collectives (window / collectives - time inside one). Never against the whole job and
  with no z-score: in a pipelined job lateness differs by pipeline stage far more than by noise.
  A GPU a few percent slower than its peers is last often too, but it costs the job little: it
  is no straggler worth evicting a node for.

Occasional spikes raise a healthy rank's mean lateness but not its count of last arrivals; a
rank that is last by a hair every time (identical clocks) is not late. A straggler's group peers
wait for it and then arrive late together at their next collective in another group: they are
its shadows and are dropped when they share a group with a stronger candidate.

Pure: numpy over the columns, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from tracehound.analysis.common import (
    collective_interval,
    group_members,
    groups_of,
    ms,
    ordered_nodes,
    pct,
    rank_nodes,
    who,
)
from tracehound.analysis.confidence import CERTAIN, LIKELY, WEAK, between
from tracehound.analysis.detect import DetectionSettings
from tracehound.analysis.observation import Observation
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import F64, I64

_MIN_RANKS = 4


def _peer_lateness(ranks: I64, lateness: F64, judged: npt.NDArray[np.bool_], which: I64,
                   members: Mapping[str, frozenset[int]], *, default: float) -> F64:
    """Per rank: the median lateness of the ranks it shares a group with (groups spanning more
    than half the job left out: they mix every pipeline stage), for the positions `which`;
    `default` elsewhere and where a rank's groups are unknown."""
    out = np.full(lateness.shape, default)
    if which.size == 0 or not members:
        return out
    position = {int(r): i for i, r in enumerate(ranks)}
    half = len(position) / 2
    local = {g: m for g, m in members.items() if len(m) <= half}
    for i in which:
        rank = int(ranks[i])
        peers = {p for g, m in local.items() if rank in m for p in m if p != rank}
        idx = [position[p] for p in peers if p in position and judged[position[p]]]
        if idx:
            out[i] = float(np.median(lateness[idx]))
    return out


def detect_straggler(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    """The consistently last rank(s) of the window, or None (see the module docstring)."""
    stats = obs.ranks
    if stats is None:
        return None
    judged = stats.n >= settings.straggler_min_collectives
    if int(judged.sum()) < _MIN_RANKS:
        return None
    n = stats.n.astype(np.float64)
    last = stats.last_count.astype(np.float64)
    fraction = np.divide(last, n, out=np.zeros_like(n), where=n > 0)
    lateness = stats.lateness_mean_us.astype(np.float64)

    p0 = float(np.clip(np.median(fraction[judged]), 1e-3, 0.999))
    z_last = (last - n * p0) / np.sqrt(np.maximum(n * p0 * (1.0 - p0), 1e-9))
    center = float(np.median(lateness[judged]))
    interval = collective_interval(stats, judged)
    consistent = (
        judged
        & (z_last >= settings.straggler_min_last_z)
        & (fraction >= max(settings.straggler_min_last_fraction,
                           settings.straggler_min_last_ratio * p0))
    )
    members = group_members(obs.snapshot)
    peer_center = _peer_lateness(stats.rank, lateness, judged, np.flatnonzero(consistent),
                                 members, default=center)
    excess = lateness - peer_center
    slowdown = excess / interval if interval > 0 else np.full_like(lateness, np.inf)
    candidate = (
        consistent
        & (excess >= settings.straggler_min_lateness_us)
        & (slowdown >= settings.straggler_min_slowdown)
    )
    idx = np.flatnonzero(candidate)
    if idx.size == 0:
        return None
    # strongest first: last most often, then latest
    idx = idx[np.lexsort((-lateness[idx], -fraction[idx]))]
    ranks_of = [int(r) for r in stats.rank[idx]]

    in_groups = groups_of(members, ranks_of)
    kept: list[int] = []  # positions into idx
    for pos, rank in enumerate(ranks_of):
        mine = set(in_groups.get(rank, ()))
        shadow = False
        for k in kept:
            stronger = ranks_of[k]
            shares = bool(mine & set(in_groups.get(stronger, ()))) if members else True
            i, j = idx[pos], idx[k]
            if (
                shares
                and lateness[i] <= lateness[j]
                and fraction[i] < settings.straggler_shadow_ratio * fraction[j]
            ):
                shadow = True
                break
        if not shadow:
            kept.append(pos)

    nodes = rank_nodes(obs.snapshot)
    culprit_idx = [int(idx[k]) for k in kept]
    culprits = tuple(int(stats.rank[i]) for i in culprit_idx)
    lead = culprit_idx[0]
    strength = (fraction[lead] - p0) / max(1.0 - p0, 1e-9)
    # Past every threshold a straggler is likely; one last at every collective is certain.
    confidence = between(LIKELY, CERTAIN, float(strength))
    if len(culprits) > max(8, 0.02 * int(judged.sum())):
        confidence = min(confidence, WEAK)  # many late ranks: something broader than one rank

    def words(i: int) -> str:
        rank = int(stats.rank[i])
        return (
            f"rank {rank} on node {nodes.get(rank, 'unknown')} arrived last at "
            f"{pct(fraction[i])} of {int(stats.n[i])} collectives, {ms(lateness[i])} after the "
            f"first on average (median rank of its groups: {ms(peer_center[i])}, last at "
            f"{pct(p0)})"
        )

    evidence = tuple(
        Evidence(
            fact=Fact.LATE, rank=int(stats.rank[i]), node=nodes.get(int(stats.rank[i]), "unknown"),
            detail=words(i) + f"; its peers waited {ms(float(np.median(stats.wait_mean_us)))} "
            "per collective (median)",
            value=round(float(lateness[i]) / 1e6, 6),
        )
        for i in culprit_idx[: settings.max_evidence]
    )
    summary = words(lead)
    if len(culprits) > 1:
        summary = f"{who(culprits, nodes)} straggle; " + summary
    return Verdict(
        job=obs.snapshot.job, attempt=obs.snapshot.attempt, kind=IncidentKind.STRAGGLER,
        culprit_ranks=culprits, culprit_nodes=ordered_nodes(culprits, nodes),
        confidence=confidence, basis=Basis.ARRIVAL_LATENESS, summary=summary,
        evidence=evidence, observed_at_us=obs.snapshot.now_us,
    )
