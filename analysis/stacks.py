"""Silent hang and throughput collapse, localized by the ranks' stack traces.

Used only when the job is known to be stuck and the collective traces do not say by whom: a hang
that control dependency could not localize (every member pending on the same collective, nobody
lagging or silent, no op mismatch), or a throughput collapse (the median rank has not finished a
step for `step_stall_factor` typical step times and `step_stall_min_s`, or for the busy grace when
no rank waits in a collective: every rank busy on its own is a long evaluation or a checkpoint
until proven otherwise). Stacks of a healthy job
are diverse and prove nothing, so this module never judges a job that progresses.

The newest stack of each rank is reduced to a signature, its innermost `stack_frames` frames;
ranks are clustered by signature. Stuck ranks wait in a few large clusters (the same wait in the
same collective); a cluster at most 1/`stack_outlier_ratio` of the largest is an outlier, and its
ranks are the culprits, except a rank whose whole stack is a prefix of a large cluster's stack
(the sampler caught it in the wrapper around the same call) or extends one. When the outliers
are too many (`stack_max_outlier_fraction`) or the largest cluster too small
(`stack_min_dominant_fraction`), the analysis is unsure and names the first outlier's whole
smallest group (over-eviction) with low confidence.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from tracehound.analysis.common import (
    US_PER_S,
    group_members,
    ordered_nodes,
    rank_nodes,
    who,
)
from tracehound.analysis.confidence import LIKELY, STRONG, UNSURE, between
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind

_MIN_STACKS = 3


def throughput_collapse(snap: JobSnapshot, settings: DetectionSettings) -> str | None:
    """Words saying how long the job has made no step, when that is `step_stall_factor` typical
    step times (and `step_stall_min_s`) for the median reporting rank; None otherwise."""
    exited = {e.rank for e in snap.exits}
    fresh_after = snap.now_us - int(settings.hang.heartbeat_timeout_s * US_PER_S)
    rows = [
        (hb.time_us - hb.step_us, (hb.step_us - hb.first_step_us) / (hb.step - hb.start_step - 1))
        for hb in snap.heartbeats
        if hb.rank not in exited and hb.time_us >= fresh_after and hb.first_step_us > 0
        and hb.step - hb.start_step >= 2 and hb.step_us > hb.first_step_us
    ]
    if len(rows) < max(1, len(snap.heartbeats) // 2):
        return None
    arr = np.asarray(rows, dtype=np.float64)
    since, typical = float(np.median(arr[:, 0])), float(np.median(arr[:, 1]))
    floor = max(settings.stacks.step_stall_factor * typical,
                settings.stacks.step_stall_min_s * US_PER_S)
    waiting = any(
        g.pending_op
        for hb in snap.heartbeats if hb.rank not in exited and hb.time_us >= fresh_after
        for g in hb.groups
    )
    if not waiting:
        # Nobody waits in a collective: every rank is busy on its own (a long evaluation, a
        # checkpoint on every rank). That is a stall, a fault only after the busy grace.
        floor = max(floor, settings.hang.busy_grace_s * US_PER_S)
    if since < floor:
        return None
    return (
        f"the median rank has finished no step for {since / US_PER_S:.1f} s "
        f"(a step took {typical / US_PER_S:.2f} s before)"
    )


def detect_silent_hang(obs: Observation, settings: DetectionSettings, *,
                       stall: Verdict | None = None) -> Verdict | None:
    """The ranks whose stacks differ from the stuck majority, given `stall` (an unlocalized hang
    verdict) or a throughput collapse; None when the job progresses or stacks do not tell."""
    snap = obs.snapshot
    if stall is not None:
        why = stall.summary
    else:
        collapse = throughput_collapse(snap, settings)
        if collapse is None:
            return None
        why = collapse
    exited = {e.rank for e in snap.exits}
    samples = [s for s in obs.stacks if s.rank not in exited and s.frames]
    if len(samples) < _MIN_STACKS:
        return None
    k = max(1, settings.stacks.frames)
    signature = {int(s.rank): s.frames[-k:] for s in samples}
    clusters = Counter(signature.values())
    (dominant, largest), *_ = clusters.most_common()
    small = {sig for sig, size in clusters.items()
             if size * settings.stacks.outlier_ratio <= largest}
    if not small:
        return None
    # A stack that is a prefix of a large cluster's stack (the sampler caught the rank in the
    # wrapper around the call), or extends one, is at the same place: no outlier.
    large_prefixes: set[tuple[str, ...]] = set()
    large_stacks: set[tuple[str, ...]] = set()
    for smp in samples:
        if signature[int(smp.rank)] not in small and smp.frames not in large_stacks:
            large_stacks.add(smp.frames)
            large_prefixes.update(smp.frames[:i] for i in range(1, len(smp.frames) + 1))
    frames_of = {int(smp.rank): smp.frames for smp in samples}

    def same_place(rank: int) -> bool:
        frames = frames_of[rank]
        return frames in large_prefixes or any(
            frames[:i] in large_stacks for i in range(1, len(frames))
        )

    outliers = sorted((r for r, sig in signature.items() if sig in small and not same_place(r)),
                      key=lambda r: (clusters[signature[r]], r))
    if not outliers:
        return None
    total = len(signature)
    dominant_share = largest / total
    nodes = rank_nodes(snap)
    sure = (
        len(outliers) <= settings.stacks.max_outlier_fraction * total
        and dominant_share >= settings.stacks.min_dominant_fraction
    )
    group = ""
    if sure:
        culprits = outliers
        # The larger the cluster the outliers differ from, the surer the vote.
        confidence = between(LIKELY, STRONG, dominant_share)
    else:
        members = group_members(snap)
        first = outliers[0]
        holding = sorted((len(m), g) for g, m in members.items() if first in m)
        if holding:
            group = holding[0][1]
            rest = sorted(members[group] - {first}, key=lambda r: (r not in outliers, r))
            culprits = [first, *rest]
        else:
            culprits = outliers
        confidence = UNSURE

    def frame(sig: tuple[str, ...]) -> str:
        return sig[-1] if sig else "?"

    evidence = tuple(
        Evidence(
            fact=Fact.STACK, rank=r, node=nodes.get(r, "unknown"),
            detail=(
                f"rank {r} on node {nodes.get(r, 'unknown')} is in {frame(signature[r])} "
                f"(stack shared by {clusters[signature[r]]} rank(s)) while {largest} of "
                f"{total} ranks are in {frame(dominant)}"
            ),
            group=group, value=float(clusters[signature[r]]),
        )
        for r in outliers[: settings.max_evidence]
    )
    head = (
        f"{who(outliers, nodes)} {'is' if len(outliers) == 1 else 'are'} in "
        f"{frame(signature[outliers[0]])} while {largest} of {total} ranks are in "
        f"{frame(dominant)}"
    )
    if not sure:
        head += (
            f"; too many ranks differ for a sure call, so group {group} is named whole"
            if group else "; too many ranks differ for a sure call"
        )
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.SILENT_HANG,
        culprit_ranks=tuple(culprits), culprit_nodes=ordered_nodes(culprits, nodes),
        confidence=confidence, basis=Basis.MAJORITY_VOTE, summary=f"{head}; {why}",
        evidence=evidence, observed_at_us=snap.now_us, group=group,
    )
