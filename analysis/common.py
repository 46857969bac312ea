"""Small pure helpers shared by the detectors: who runs where, who is in which group, robust
statistics, and the wording of evidence.

Never does I/O and never reads the clock; everything comes from the snapshot or the arrays passed
in. Lookups are built once per call in O(ranks), so that detectors stay linear at 10,000 ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import numpy.typing as npt

from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing.summaries import F64, P2P_MARK, RECV_OPS, SEND_OPS, RankStats

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
