"""Small pure helpers shared by the detectors: who runs where, who is in which group, which
ranks do the same work, how much each rank computes against them, robust statistics, and the
wording of evidence.

Never does I/O and never reads the clock; everything comes from the snapshot or the arrays passed
in. Lookups are built once per call in O(ranks), so that detectors stay linear at 10,000 ranks.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing.summaries import (
    COUNTED_SUFFIX,
    F64,
    I64,
    P2P_MARK,
    RECV_OPS,
    SEND_OPS,
    LinkStats,
    RankStats,
)

US_PER_S = 1_000_000


def rank_nodes(snap: JobSnapshot) -> dict[int, str]:
    """Rank -> node from every record that names one (the launcher's list wins)."""
    nodes: dict[int, str] = {int(e.rank): str(e.node) for e in snap.exits}
    nodes.update((int(hb.rank), str(hb.node)) for hb in snap.heartbeats)
    nodes.update((int(r), str(n)) for r, n in snap.expected_ranks.items())
    return nodes


def node_ranks(nodes: Mapping[int, str]) -> dict[str, list[int]]:
    """Node -> its ranks, sorted."""
    out: dict[str, list[int]] = {}
    for rank in sorted(nodes):
        out.setdefault(nodes[rank], []).append(rank)
    return out


def group_members(snap: JobSnapshot) -> dict[str, frozenset[int]]:
    """Group -> global ranks, from group records and from who reports progress in it."""
    members: dict[str, set[int]] = {}
    seen: set[tuple[str, tuple[int, ...]]] = set()
    for info in snap.groups:
        key = (str(info.group), info.ranks)
        if key in seen:  # every member records the same group: read each once
            continue
        seen.add(key)
        members.setdefault(str(info.group), set()).update(int(r) for r in info.ranks)
    for hb in snap.heartbeats:
        for g in hb.groups:
            members.setdefault(str(g.group), set()).add(int(hb.rank))
    return {g: frozenset(m) for g, m in members.items()}


def groups_of(members: Mapping[str, frozenset[int]], ranks: Iterable[int]) -> dict[int, list[str]]:
    """Rank -> the groups it belongs to, for the given ranks only."""
    wanted = set(ranks)
    out: dict[int, list[str]] = {r: [] for r in wanted}
    for group, ms in members.items():
        for r in wanted & ms:
            out[r].append(group)
    return out


def collective_interval(stats: RankStats, judged: npt.NDArray[np.bool_]) -> float:
    """The median judged rank's time between collectives, outside them: its compute (and
    bubbles). From the spread of the rank's own arrivals, not the window's length: a job that
    started (or paused) inside the window would otherwise look sparser than it is."""
    spacing = stats.span_us.astype(np.float64) / np.maximum(stats.n - 1.0, 1.0)
    return float(np.median(spacing[judged])) - float(np.median(stats.wait_mean_us[judged]))


def collective_groups(snap: JobSnapshot,
                      members: Mapping[str, frozenset[int]]) -> dict[str, frozenset[int]]:
    """The groups of `members` that may carry collectives: not point-to-point pair groups, and
    not groups that every heartbeat reporting them shows without a single collective (a
    pipeline group whose traffic all goes through its pair groups). Groups no heartbeat
    reports are kept: nothing says they are idle."""
    reported: set[str] = set()
    active: set[str] = set()
    for hb in snap.heartbeats:
        for g in hb.groups:
            reported.add(str(g.group))
            if g.last_enqueued > 0:
                active.add(str(g.group))
    return {
        g: m for g, m in members.items()
        if not is_p2p_group(g) and (g in active or g not in reported)
    }


def is_p2p_group(group: str) -> bool:
    return P2P_MARK in group


def is_counted_group(group: str) -> bool:
    """A group reported by counting its operations (DDP's unrecorded steps): heartbeats tell
    who entered how many and who waits, but not which call each one is."""
    return group.endswith(COUNTED_SUFFIX)


def is_p2p_op(op: str) -> bool:
    return op in SEND_OPS or op in RECV_OPS


def robust_center_scale(values: F64, floor: float) -> tuple[float, float]:
    """Median and MAD-based standard deviation (1.4826 * MAD), the scale at least `floor`.

    The scale floor keeps perfectly quiet populations (a MAD of 0) from turning microsecond
    differences into huge scores."""
    center = float(np.median(values))
    mad = float(np.median(np.abs(values - center))) * 1.4826
    return center, max(mad, floor)


def ms(us: float) -> str:
    """Microseconds as milliseconds in words: `48.0 ms`, `0.35 ms`."""
    value = us / 1000.0
    return f"{value:.1f} ms" if abs(value) >= 10 else f"{value:.2f} ms"


def span(us: float) -> str:
    """A duration in words, in seconds from 1 s on: `48.0 ms`, `1.25 s`, `23.4 s`."""
    seconds = us / US_PER_S
    if abs(seconds) >= 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.2f} s" if abs(seconds) >= 1 else ms(us)


def pct(fraction: float) -> str:
    return f"{100.0 * fraction:.0f}%"


def who(ranks: Sequence[int], nodes: Mapping[int, str], limit: int = 4) -> str:
    """`rank 3 on node node-1, rank 7 on node node-3 and 2 more`."""
    named = ", ".join(f"rank {r} on node {nodes.get(r, 'unknown')}" for r in ranks[:limit])
    more = f" and {len(ranks) - limit} more" if len(ranks) > limit else ""
    return named + more


def ordered_nodes(ranks: Sequence[int], nodes: Mapping[int, str]) -> tuple[str, ...]:
    """The distinct nodes of `ranks`, in the order of their first rank (most likely first)."""
    return tuple(dict.fromkeys(nodes.get(r, "unknown") for r in ranks))


# --- role peers and own compute -----------------------------------------------------------------

_EXACT_UP_TO = 64
"""Groups up to this size get an exact leave-one-out median; in larger ones a member's own value
barely moves the median, which is then taken over all members."""


def pipeline_pairs(members: Mapping[str, frozenset[int]],
                   links: LinkStats | None) -> dict[int, set[int]]:
    """Rank -> the ranks it exchanges point-to-point transfers with (pipeline neighbours), from
    the two-member p2p groups among `members` (`group_members`) and the links of the window."""
    partners: dict[int, set[int]] = {}

    def pair(a: int, b: int) -> None:
        if a != b:
            partners.setdefault(a, set()).add(b)
            partners.setdefault(b, set()).add(a)

    for group, ranks in members.items():
        if len(ranks) == 2 and is_p2p_group(group):
            a, b = sorted(ranks)
            pair(a, b)
    if links is not None:
        for a, b in zip(links.src.tolist(), links.dst.tolist(), strict=True):
            pair(int(a), int(b))
    return partners


def pipeline_chains(partners: Mapping[int, set[int]]) -> dict[int, int]:
    """Rank -> its pipeline (the lowest rank of its connected component in the graph of
    point-to-point neighbours); ranks without neighbours are left out."""
    parent: dict[int, int] = {}

    def root(r: int) -> int:
        parent.setdefault(r, r)
        while parent[r] != r:
            parent[r] = parent[parent[r]]
            r = parent[r]
        return r

    for a, bs in partners.items():
        for b in bs:
            ra, rb = root(a), root(b)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    return {r: root(r) for r in parent}


def role_groups(snap: JobSnapshot, links: LinkStats | None, ranks: I64) -> list[I64]:
    """The groups whose members do the same work, as positions into `ranks` (sorted; groups with
    fewer than two of them left out): the collective groups (`collective_groups`) holding at
    most one rank of each pipeline (`pipeline_chains`). Pipeline stages differ in their work
    (the first holds the embedding, the last the loss); tensor and data parallel groups hold one
    rank of each of their pipelines, all of one stage, while pipeline, embedding, model
    parallel and world groups hold several ranks of one pipeline. In a job without pipeline
    every group does the same work."""
    everyone = group_members(snap)
    chain = pipeline_chains(pipeline_pairs(everyone, links))
    out: list[I64] = []
    seen: set[frozenset[int]] = set()
    for members in collective_groups(snap, everyone).values():
        if members in seen:
            continue
        seen.add(members)
        chains = [chain[r] for r in members if r in chain]
        if len(chains) != len(set(chains)):
            continue  # two ranks of one pipeline: the group spans stages
        wanted = np.fromiter(sorted(members), dtype=np.int64, count=len(members))
        pos = np.searchsorted(ranks, wanted)
        present = pos < ranks.shape[0]
        present[present] = ranks[pos[present]] == wanted[present]
        if int(present.sum()) >= 2:
            out.append(pos[present].astype(np.int64))
    return out


def _group_medians(values: F64, judged: npt.NDArray[np.bool_],
                   groups: Sequence[I64]) -> tuple[I64, F64, F64]:
    """(position, median, weight) for every position of every group: the median of the group's
    other judged members (of all of a group larger than `_EXACT_UP_TO`) and how many they are;
    groups nobody judged in left out."""
    masked = np.where(judged, values, np.nan)
    by_size: dict[int, list[I64]] = {}
    for g in groups:
        by_size.setdefault(int(g.shape[0]), []).append(g)
    where: list[I64] = []
    medians: list[F64] = []
    weights: list[F64] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: groups nobody judged in
        for size, gs in by_size.items():
            pos = np.stack(gs)
            vals = masked[pos]
            count = (~np.isnan(vals)).sum(axis=1).astype(np.float64)
            if size <= _EXACT_UP_TO:
                for j in range(size):
                    where.append(pos[:, j])
                    medians.append(np.nanmedian(np.delete(vals, j, axis=1), axis=1))
                    weights.append(count - ~np.isnan(vals[:, j]))
            else:
                med = np.nanmedian(vals, axis=1)
                where.append(pos.ravel())
                medians.append(np.repeat(med, size))
                weights.append(np.repeat(count, size))
    if not where:
        return np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
    at, med, weight = np.concatenate(where), np.concatenate(medians), np.concatenate(weights)
    keep = ~np.isnan(med) & (weight > 0)
    return at[keep], med[keep], weight[keep]


def _or_job_median(ref: F64, values: F64, judged: npt.NDArray[np.bool_]) -> F64:
    """`ref`, the median of every judged value where it is NaN (as it is where nothing is)."""
    if judged.any():
        return np.where(np.isnan(ref), float(np.median(values[judged])), ref)
    return ref


def peer_median(values: F64, judged: npt.NDArray[np.bool_], groups: Sequence[I64]) -> F64:
    """Per position of `values`: the median of its role peers' values (`role_groups`), pooled
    over its groups: each group's median of its other judged members, weighted by how many
    they are (so a one-member view of a small group does not outweigh a large group); the
    median of every judged value where no group gives one. NaN when nothing is judged."""
    ref = np.full(values.shape, np.nan)
    at, med, weight = _group_medians(values, judged, groups)
    order = np.lexsort((med, at))
    at, med, weight = at[order], med[order], weight[order]
    if at.size:
        starts = np.flatnonzero(np.r_[True, at[1:] != at[:-1]])
        total = np.add.reduceat(weight, starts)
        before = np.repeat(np.cumsum(weight)[starts] - weight[starts], np.diff(
            np.r_[starts, at.size]))
        reached = np.cumsum(weight) - before >= np.repeat(total / 2.0, np.diff(
            np.r_[starts, at.size]))
        # the first value of each position at which half its peers' weight is reached
        first = np.flatnonzero(reached & np.r_[True, ~(reached[:-1] & (at[1:] == at[:-1]))])
        ref[at[first]] = med[first]
    return _or_job_median(ref, values, judged)


def peer_floor(values: F64, judged: npt.NDArray[np.bool_], groups: Sequence[I64]) -> F64:
    """Per position of `values`: the least of its groups' medians of their other judged members
    (the job's median where no group gives one). Where half a data parallel group pauses at
    once (a checkpoint written from one replica, an evaluation), that group's median is a
    pause; its tensor parallel group's is not."""
    ref = np.full(values.shape, np.nan)
    at, med, _ = _group_medians(values, judged, groups)
    np.fmin.at(ref, at, med)  # fmin: a NaN (no group yet) gives way to any median
    return _or_job_median(ref, values, judged)


@dataclass(frozen=True, slots=True, eq=False)
class OwnTime:
    """Per rank of a RankStats (same positions): the time it spent outside its operations (its
    compute, as the trace sees it) against the peers that do the same work, and how long the
    job waited on it alone. See `own_time`."""

    share: F64
    """busy_us per us of the rank's active span."""
    peer_share: F64
    """The share of its role peers (`peer_median`)."""
    longest_ratio: F64
    """Its longest gap between operations over its peers' (`peer_median`)."""
    rest_ratio: F64
    """Its other gaps, as a share of its active span, over its peers'."""
    ratio: F64
    """How much longer it computes than its peers: the lesser of the two ratios (1.0 for a rank
    that computes like its peers)."""
    excess_us: F64
    """(ratio - 1) x its peers' busy time over its active span: the compute it adds."""
    rest_excess_us: F64
    """How much longer its other gaps are than its peers' (over its active span)."""
    longest_excess_us: F64
    """How much longer its longest gap is than its peers' longest."""
    excess_gaps: F64
    """rest_excess_us counted in its peers' longest gaps."""
    peer_gaps: F64
    """How many of their longest gaps its peers' busy time holds (about the steps of the window
    where one gap per step dominates, more where compute is cut into many similar gaps)."""
    blame_us: F64
    """How long its groups waited on it alone (0 where the source has no blame column)."""
    blame_share: F64
    """blame_us per us active (sums over overlapping collectives: may exceed 1)."""
    has_blame: bool

    def spread_out(self) -> npt.NDArray[np.bool_]:
        """Per rank: whether its extra compute is spread over its gaps, as a slow GPU's is,
        rather than put in a few long ones, as pauses put theirs (`PAUSES`)."""
        return self.rest_excess_us >= PAUSES * self.longest_excess_us


PAUSES = 1.5
"""A slow GPU spreads its excess over all its gaps, pauses put theirs in a few long ones: the
excess of a rank's other gaps must be more than this many pauses as long as its longest gap's
excess (a rank paused twice has a second one in its other gaps; a 1.3x straggler's other gaps
add more than its longest one as soon as there are a few of them)."""


def judged_on_compute(stats: RankStats, *, min_collectives: int,
                      min_active_us: float) -> npt.NDArray[np.bool_]:
    """Per rank: whether the window holds enough of its work to judge its compute against its
    peers': `min_collectives` collectives, spread over at least `min_active_us` (without the
    busy columns, the count alone)."""
    judged = stats.n >= min_collectives
    if stats.active_us is not None:
        judged &= np.asarray(stats.active_us, dtype=np.float64) >= min_active_us
    return judged


def own_time(stats: RankStats, judged: npt.NDArray[np.bool_],
             groups: Sequence[I64]) -> OwnTime | None:
    """Each rank's own compute against its role peers', or None when the source has no busy
    columns (`tracing.summaries`: busy_us, busy_max_us, active_us).

    A slow GPU lengthens every gap between a rank's operations; other things lengthen one kind:
    a one-off pause (an evaluation on rank 0, a checkpoint write, a GC pause) only the longest
    gap, and being the last to arrive only the rest: its peers' compute then overlaps their
    (longer) non-blocking operations, gradient buckets or posted sends, and hides from the trace,
    while its own shows. So the rank's compute counts as longer than its peers' only as far as
    both its longest gap (against its peers' longest, `peer_floor`: the group where nobody
    paused) and its other gaps (as a share of its active span, against its peers' share) are
    longer: the lesser ratio. How much longer its
    other gaps are in all, counted in its peers' longest gaps (`excess_gaps`), says whether more
    than one step shows it: a pause, or one step of being last after it, adds one or two."""
    if stats.busy_us is None or stats.busy_max_us is None or stats.active_us is None:
        return None
    busy = np.asarray(stats.busy_us, dtype=np.float64)
    longest = np.minimum(np.asarray(stats.busy_max_us, dtype=np.float64), busy)
    active = np.maximum(np.asarray(stats.active_us, dtype=np.float64), 1.0)
    rest = (busy - longest) / active
    peer_rest = peer_median(rest, judged, groups)
    rest_ratio = np.divide(rest, peer_rest, out=np.ones_like(rest), where=peer_rest > 0)
    peer_longest = peer_floor(longest, judged, groups)
    longest_ratio = np.divide(longest, peer_longest, out=np.ones_like(longest),
                              where=peer_longest > 0)
    ratio = np.minimum(rest_ratio, longest_ratio)
    share = busy / active
    peer_share = peer_median(share, judged, groups)
    unit = np.maximum(peer_longest, 1.0)
    blame = (np.zeros_like(busy) if stats.blame_us is None
             else np.asarray(stats.blame_us, dtype=np.float64))
    rest_excess = (rest - peer_rest) * active
    return OwnTime(
        share=share, peer_share=peer_share, longest_ratio=longest_ratio, rest_ratio=rest_ratio,
        ratio=ratio, excess_us=(ratio - 1.0) * peer_share * active, rest_excess_us=rest_excess,
        longest_excess_us=longest - peer_longest, excess_gaps=rest_excess / unit,
        peer_gaps=peer_share * active / unit,
        blame_us=blame, blame_share=blame / active, has_blame=stats.blame_us is not None,
    )


def typical_step_us(snap: JobSnapshot) -> float:
    """The median rank's mean step time since its first step, from the heartbeats (0 when no
    rank has finished two steps)."""
    per = [
        (hb.step_us - hb.first_step_us) / (hb.step - hb.start_step - 1)
        for hb in snap.heartbeats
        if hb.step > hb.start_step + 1 and hb.step_us > hb.first_step_us > 0
    ]
    return float(np.median(per)) if per else 0.0
