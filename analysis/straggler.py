"""Computation straggler: the rank that computes longer than the peers doing the same work, and
keeps the job waiting for it.

Reads `Observation.ranks` (RankStats over the detection window). The rule has two parts, both
needed:

- excess compute: the time a rank spends outside its operations (`busy_us`, its compute as the
  trace sees it) is longer than that of its role peers (`analysis.common.own_time`: the ranks
  of its tensor and data parallel groups, never another pipeline stage) in both of its parts:
  its longest gap (a slow GPU lengthens every gap, the longest too) and its other gaps as a
  share of its active span (a one-off pause, an evaluation on rank 0, a checkpoint write or a
  GC pause, lengthens only the longest), each `straggler_min_excess` x its peers', by
  `straggler_min_excess_us` in all; and the other gaps by more than being last for one step
  could make them (`compute_stragglers`: the peers' compute hides behind their gradient
  buckets while the last rank's shows). A rank that waits for a slow pipeline stage waits
  inside its operations (a receive, a collective): its compute does not grow, so the slow
  stage is named, not the stage behind it. No count of last arrivals is needed, so plain
  data parallel jobs (where a straggler is often last only at the first gradient bucket after
  its backward, or not at all when others pause longer) and two-member groups are judged like
  any other; nor a fixed number of collectives: a window of 23-second steps with four
  collectives per rank is judged on the compute its gaps hold, with less asked of fewer gaps.
- the job waits on it: its groups waited on it alone (`blame_us`: at collectives where it was
  the only last arrival, the time from the second latest arrival to its own) for at least
  `straggler_min_blame` of its active span. A GPU a few percent slower than its peers computes
  a few percent longer and costs the job about as little; one 30% slower is evicted.

Confidence grows with the margin (how much longer it computes) and with the evidence (how many
collectives the window holds). Without the busy columns (an older source) the rank that is last
at most of its collectives, by a margin, is the straggler (`_by_arrival`).

Pure: numpy over the columns, no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from tracehound.analysis.common import (
    OwnTime,
    collective_interval,
    group_members,
    groups_of,
    judged_on_compute,
    ms,
    ordered_nodes,
    own_time,
    pct,
    rank_nodes,
    role_groups,
    span,
    typical_step_us,
    who,
)
from tracehound.analysis.confidence import CERTAIN, LIKELY, WEAK, between
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import F64, I64, RankStats

_MIN_RANKS = 4
"""The arrival rule (`_by_arrival`) needs this many judged ranks for a median to mean much."""
_FULL_MARGIN = 0.6
"""A rank computing this much longer than its peers (1.6x) has the full margin."""
_HALF_EVIDENCE = 4
"""Collectives at which the evidence counts half (sqrt(n / (n + this)) of full)."""
_GAPS_PER_GAP = 0.8
"""Excess of a longest gap asked per gap beyond the first in windows of few gaps, where that is
less than `straggler_min_excess_gaps` (`_needed_gaps`)..."""
_FEW_GAPS_PER_GAP = 0.25
"""...and in windows of few collectives per gap, where being last hides little."""
_MANY_COLLECTIVES_PER_GAP = 8.0
"""From this many collectives per gap (gradient buckets overlapping the backward), being last
for a step can make a rank's other gaps look one or two longest gaps longer."""


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
    """The rank(s) computing longer than their role peers while the job waits on them, or None
    (see the module docstring)."""
    stats = obs.ranks
    if stats is None:
        return None
    judged = judged_on_compute(stats, min_collectives=settings.straggler.busy_min_collectives,
                               min_active_us=settings.straggler.min_active_us)
    groups = role_groups(obs.snapshot, obs.links, stats.rank)
    own = own_time(stats, judged, groups)
    if own is None:
        return _by_arrival(obs, settings)
    if int(judged.sum()) < 2:
        return None
    return _by_compute(obs, settings, stats, own, judged, has_groups=bool(groups),
                       one_group=len(groups) == 1)


def compute_stragglers(own: OwnTime, judged: npt.NDArray[np.bool_], n: I64,
                       settings: DetectionSettings) -> npt.NDArray[np.bool_]:
    """Per rank: whether it computes markedly longer than its role peers, whatever the job's
    waits: its longest gap and its other gaps both `straggler_min_excess` x its peers', by
    `straggler_min_excess_us` in all, and its other gaps longer by more than being last for a
    step could make them (`_needed_gaps`) and than `PAUSES` more pauses as long as its longest
    gap's excess could (a second evaluation on rank 0, a checkpoint write). A rank slow at
    everything, whose transfers look slow too (`analysis.links` leaves such links to this
    detector). `n`: each rank's collectives."""
    return (
        judged
        & (own.ratio >= settings.straggler.min_excess)
        & (own.excess_us >= settings.straggler.min_excess_us)
        & (own.excess_gaps >= _needed_gaps(own, n, settings))
        & own.spread_out()
    )


def _needed_gaps(own: OwnTime, n: I64, settings: DetectionSettings) -> F64:
    """How many of its peers' longest gaps a rank's other gaps must exceed theirs by.

    Being last for a step shows the rank's compute that its peers hide behind their
    non-blocking collectives (gradient buckets): up to a step's backward, one or two longest
    gaps. That needs many collectives per gap; in windows with few (about one per compute
    segment, as in long pipeline steps) there is little to hide behind. So: in a window whose
    peers' busy time holds W of their longest gaps, `straggler_min_excess_gaps`, or
    `_GAPS_PER_GAP` x (W - 1) where that is fewer (windows of few gaps, long steps), and with
    fewer than `_MANY_COLLECTIVES_PER_GAP` collectives per gap `_FEW_GAPS_PER_GAP` x (W - 1)
    (a rank that much slower than its peers)."""
    gaps = np.maximum(own.peer_gaps, 1.0)
    per_gap = np.where(n / gaps >= _MANY_COLLECTIVES_PER_GAP, _GAPS_PER_GAP, _FEW_GAPS_PER_GAP)
    return np.minimum(settings.straggler.min_excess_gaps, per_gap * (gaps - 1.0))


def _by_compute(obs: Observation, settings: DetectionSettings, stats: RankStats, own: OwnTime,
                judged: npt.NDArray[np.bool_], *, has_groups: bool,
                one_group: bool) -> Verdict | None:
    """Excess compute corroborated by the job's waits (see the module docstring)."""
    n = stats.n.astype(np.float64)
    last = stats.last_count.astype(np.float64)
    fraction = np.divide(last, n, out=np.zeros_like(n), where=n > 0)
    candidate = compute_stragglers(own, judged, stats.n, settings)
    p0 = float(np.median(fraction[judged]))
    # Its extra compute per training step, as a share of a step (None without step times).
    # Where collectives overlap compute (gradient buckets) the busy time of the rank that is
    # last counts its lag once per pending collective, so a GPU a few percent slower looks far
    # slower than it is by the busy ratio alone; per step it costs a few percent.
    step_us = typical_step_us(obs.snapshot)
    cost: F64 | None = None
    if step_us > 0 and stats.active_us is not None:
        steps = np.maximum(stats.active_us.astype(np.float64) / step_us, 1.0)
        cost = own.excess_us / steps / step_us
    heavy = (np.zeros(n.shape, dtype=np.bool_) if cost is None
             else cost >= 2 * settings.straggler.min_step_cost)
    if own.has_blame:
        candidate &= own.blame_share >= settings.straggler.min_blame
        # ...and consistently: last far more often than chance makes the median rank (in a
        # large group a rank that met more slow moments than its peers by chance is last a few
        # times its share; a slower GPU is last at most collectives of the step it is slow in;
        # in small groups, where the median rank is last often, a margin above it suffices)
        consistent = fraction >= min(settings.straggler.consistent_ratio * p0, (1.0 + p0) / 2,
                                     p0 + settings.straggler.consistent_margin)
        # (a window of few collectives, as in long pipeline steps, says little by counts: there
        # a rank whose extra compute costs the job a large share of a step needs only to be
        # last more often than the median rank)
        few = n < settings.straggler.min_collectives * 2
        candidate &= consistent | (few & (fraction > p0) & (last >= 2) & heavy)
    else:
        # without blame, the arrival order corroborates: last well above the median rank
        candidate &= fraction >= min(settings.straggler.min_last_ratio * p0, (1.0 + p0) / 2)
    if cost is not None:
        # ...and it costs the job a share of each step
        if own.has_blame and one_group:
            # Where every rank does the same work in one group (DDP, ZeRO) either the job
            # waits on it for a good share of a step each time it is last (DDP: a GPU a few
            # percent slower is last at many buckets but by a few percent of a step each), or
            # its extra compute costs twice the usual share of a step (ZeRO: gathers every
            # layer, so the lag at each is short however slow the rank).
            # Where its collectives overlap its compute (many per gap: DDP's gradient buckets)
            # its other gaps are no measure of that cost: its peers' compute hides inside their
            # pending buckets while its own shows, so a GPU 5% slower computes 1.4x as long
            # by them (and costs the job 5% of a step). Its longest gap (the forward, with
            # nothing pending) is not so inflated, unless a pause fell in it: there the busy
            # excess counts only where the longest gap is no further ahead of its peers' than
            # the other gaps are (a slow GPU's, not a pause's), else the lag alone.
            lag = own.blame_us / np.maximum(last, 1.0) / step_us
            overlapped = n / np.maximum(own.peer_gaps, 1.0) >= _MANY_COLLECTIVES_PER_GAP
            measured = ~overlapped | (own.longest_ratio <= own.rest_ratio)
            candidate &= (lag >= settings.straggler.min_lag) | (heavy & measured)
            # ...and, every rank meeting every collective, it is last at a large share of
            # them: a slower GPU at most of each step's; a GPU a few percent slower, or one
            # that met more pauses than its peers, mostly at less than a quarter (half that
            # for a rank computing far longer than its peers, as no GPU a few percent slower
            # does: pauses elsewhere hide part of its lateness)
            clear = own.ratio >= settings.straggler.one_group_clear_ratio
            candidate &= fraction >= np.where(clear, 0.5, 1.0) * (
                settings.straggler.one_group_min_last)
        else:
            candidate &= cost >= settings.straggler.min_step_cost
    idx = np.flatnonzero(candidate)
    if idx.size == 0:
        return None
    idx = idx[np.lexsort((-own.blame_share[idx], -own.ratio[idx]))]
    culprits = tuple(int(r) for r in stats.rank[idx])
    nodes = rank_nodes(obs.snapshot)
    lead = int(idx[0])
    margin = min(1.0, (float(own.ratio[lead]) - 1.0) / _FULL_MARGIN)
    amount = float(np.sqrt(n[lead] / (n[lead] + _HALF_EVIDENCE)))
    confidence = between(WEAK, CERTAIN, margin * amount)
    if len(culprits) > max(8, 0.02 * int(judged.sum())):
        confidence = min(confidence, WEAK)  # many slow ranks: something broader than one rank
    peers = "its role peers" if has_groups else "the job's median rank"

    def words(i: int) -> str:
        rank = int(stats.rank[i])
        active = float(stats.active_us[i]) if stats.active_us is not None else 0.0
        steps = f", about {active / step_us:.1f} steps" if step_us > 0 else ""
        waited = (
            f"; its groups waited {span(own.blame_us[i])} on it alone, at the "
            f"{int(stats.last_count[i])} collectives it arrived last at"
            if own.has_blame else
            f"; it arrived last at {pct(fraction[i])} of them"
        )
        return (
            f"rank {rank} on node {nodes.get(rank, 'unknown')} computes "
            f"{own.ratio[i]:.2f}x as long as {peers} (its longest stretch between operations "
            f"{own.longest_ratio[i]:.2f}x theirs, the others {own.rest_ratio[i]:.2f}x): outside "
            f"its operations {pct(own.share[i])} of its time against their "
            f"{pct(own.peer_share[i])}, about {span(own.excess_us[i])} more, over "
            f"{int(stats.n[i])} collectives in {span(active)}{steps}{waited}"
        )

    evidence = tuple(
        Evidence(
            fact=Fact.LATE, rank=int(stats.rank[i]),
            node=nodes.get(int(stats.rank[i]), "unknown"), detail=words(int(i)),
            value=round(float(own.ratio[i]), 4),
        )
        for i in idx[: settings.max_evidence]
    )
    return _verdict(obs, culprits, nodes, confidence=confidence, lead_words=words(lead),
                    evidence=evidence)


def _verdict(obs: Observation, culprits: tuple[int, ...], nodes: Mapping[int, str], *,
             confidence: float, lead_words: str, evidence: tuple[Evidence, ...]) -> Verdict:
    """The straggler verdict on `culprits`, its summary led by the first culprit's words."""
    summary = lead_words
    if len(culprits) > 1:
        summary = f"{who(culprits, nodes)} straggle; " + summary
    return Verdict(
        job=obs.snapshot.job, attempt=obs.snapshot.attempt, kind=IncidentKind.STRAGGLER,
        culprit_ranks=culprits, culprit_nodes=ordered_nodes(culprits, nodes),
        confidence=confidence, basis=Basis.ARRIVAL_LATENESS, summary=summary,
        evidence=evidence, observed_at_us=obs.snapshot.now_us,
    )


def _by_arrival(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    """The consistently last rank(s) of the window: the rule for sources without the busy
    columns. A healthy rank arrives last at about 1/group-size of its collectives, by chance; a
    straggler at most of them, and late by a consistent margin. Both must hold:

    - consistency: its count of last arrivals exceeds what the median rank's rate predicts by
      `straggler_min_last_z` binomial standard deviations, and its last fraction is at least
      `straggler_min_last_fraction` and `straggler_min_last_ratio` x the median rank's (in
      two-member groups, where that exceeds 100%, halfway from the median rank's to always);
    - magnitude: its mean lateness (arrival minus the first arrival) exceeds the median
      lateness of the ranks it shares a group with (its pipeline stage; groups spanning most
      of the job left out) by `straggler_min_lateness_us` and by `straggler_min_slowdown` of
      the median rank's time between collectives. Never against the whole job and with no
      z-score: in a pipelined job lateness differs by pipeline stage far more than by noise.

    Occasional spikes raise a healthy rank's mean lateness but not its count of last arrivals.
    A straggler's group peers wait for it and then arrive late together at their next
    collective in another group: they are its shadows and are dropped when they share a group
    with a stronger candidate."""
    stats = obs.ranks
    if stats is None:
        return None
    judged = stats.n >= settings.straggler.min_collectives
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
        & (z_last >= settings.straggler.min_last_z)
        & (fraction >= max(settings.straggler.min_last_fraction,
                           min(settings.straggler.min_last_ratio * p0, (1.0 + p0) / 2)))
    )
    members = group_members(obs.snapshot)
    peer_center = _peer_lateness(stats.rank, lateness, judged, np.flatnonzero(consistent),
                                 members, default=center)
    excess = lateness - peer_center
    slowdown = excess / interval if interval > 0 else np.full_like(lateness, np.inf)
    candidate = (
        consistent
        & (excess >= settings.straggler.min_lateness_us)
        & (slowdown >= settings.straggler.min_slowdown)
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
                and fraction[i] < settings.straggler.shadow_ratio * fraction[j]
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
    return _verdict(obs, culprits, nodes, confidence=confidence, lead_words=words(lead),
                    evidence=evidence)
