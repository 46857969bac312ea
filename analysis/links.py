"""Communication slow: a link, or one node's network, slower than comparable ones.

Reads `Observation.links` (LinkStats: per (src, dst) point-to-point transfer times, measured from
the later of the two enqueues to the earlier of the two completions, so a late sender's compute
does not count, nor a side whose call also waited for something else: Megatron's non-batched p2p
sends and receives the next input in one call). Links are compared within their class only (both
ends on one node vs on two nodes: NVLink and the network differ by an order of magnitude), and
within it against the links of the same pipeline boundary (from the same stage to the same stage,
`_boundaries`) where there are enough of them: the schedule's issue order makes some boundaries'
transfers look longer than others' on a healthy job, the same for every replica. A link is slow
when its mean transfer time over its boundary's median is `link_min_z` robust deviations (1.4826
MAD) above the class's such ratios and `link_min_ratio` x; a link's mean is taken without its
single worst transfer (n * mean - max) / (n - 1), so one network hiccup (a transfer stalled for
300 ms) does not make a link slow, while a consistently slow link stays slow. The margin shrinks
with the link's transfers past `link_full_margin_transfers` (a hiccup left after trimming weighs
less in a longer mean), to `link_node_min_ratio` at most: a link 2x slower in bandwidth moves a
transfer that also pays fixed latency about 1.3-1.5x slower.

A node is judged on all its links together, so each needs less margin (`link_node_min_ratio`):
when such slow links reach at least two different peers of a node and make up
`link_node_fraction` of its links, the node (its NIC, its switch port) is blamed.
Where two nodes qualify alike (all links of one pipeline boundary run between them), the links
cannot tell the sides apart; the node's other traffic can: a slow NIC also slows the node's
inter-node collectives (its data-parallel all-reduces), and with them every collective of its
groups. Both nodes are named with WEAK confidence, the one whose collectives take longer first,
measured per rank as wait + lateness (mean time inside a collective plus mean arrival after its
first member): that is the time from a collective's first arrival to its completion, the same
for every member whatever its own arrival, so it measures the collectives, not the rank's place
in the pipeline (its mean wait alone does not: the last pipeline stage waits longest in the
world all-reduce). Collectives of different stages may differ in size, so the order stays a hint.
Otherwise the slowest link is: both its ranks, the one whose other links are slower first; where
those do not tell (a pipeline pair has no other link), the one whose collectives take longer from
first arrival to completion (a NIC per GPU slows its rank's data-parallel collectives too); the
sender when nothing tells them apart.

A slow GPU makes its transfers look slow too (its kernels start late), but it is slow at
everything: at its own compute above all. A link with an end that computes markedly longer than
its role peers (`analysis.straggler.compute_stragglers`: the busy time the trace shows, a
one-off pause left out) is no evidence of a slow link and is left out before any link or node
is judged: the straggler detector names that rank. A real slow link slows transfers and leaves
both ends' compute as it was.

Pure: numpy over the columns, no I/O, no clock.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tracehound.analysis.common import ms, own_time, rank_nodes, role_groups
from tracehound.analysis.confidence import LIKELY, STRONG, WEAK
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.straggler import compute_stragglers
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import F64, I64, LinkStats

_FLOOR_US = 1.0
_REL_FLOOR = 0.05
_END_MARGIN = 1.1
"""The receiver is named first only when its other links are 10% slower than the sender's."""


_MIN_BOUNDARY_PEERS = 4
"""Links of one pipeline boundary that are compared among themselves (fewer: with their whole
class)."""


def _boundaries(obs: Observation, links: LinkStats) -> I64:
    """A label per link: the pipeline boundary it crosses, as (stage of its source, stage of
    its destination). A stage is a set of ranks that do the same work (`role_groups`: tensor
    and data parallel groups, one rank of each pipeline) joined together; a rank in no such
    group is a stage of its own."""
    ranks = np.unique(np.concatenate([links.src, links.dst]))
    parent = np.arange(ranks.shape[0])

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    for positions in role_groups(obs.snapshot, links, ranks):
        first = root(int(positions[0]))
        for p in positions[1:]:
            parent[root(int(p))] = first
    stage = np.array([root(i) for i in range(ranks.shape[0])], dtype=np.int64)
    src: I64 = stage[np.searchsorted(ranks, links.src)]
    dst: I64 = stage[np.searchsorted(ranks, links.dst)]
    labels: I64 = src * ranks.shape[0] + dst
    return labels


def _other_links_ratio(rank: int, skip: tuple[int, int], *, src: I64, dst: I64, ratio: F64,
                       judged: npt.NDArray[np.bool_]) -> float:
    """Median slowness (vs class median) of the rank's links other than the pair `skip`."""
    a, b = skip
    touches = judged & ((src == rank) | (dst == rank))
    pair = ((src == a) & (dst == b)) | ((src == b) & (dst == a))
    others = ratio[touches & ~pair]
    return float(np.median(others)) if others.size else 1.0


def _collective_time(obs: Observation, ranks: set[int]) -> float:
    """Mean over `ranks` of wait + lateness: how long their collectives took from the first
    member's arrival to completion, whatever the rank's own arrival (0 without rank statistics
    or without any of them in them)."""
    stats = obs.ranks
    if stats is None:
        return 0.0
    on = np.isin(stats.rank, list(ranks))
    if not on.any():
        return 0.0
    return float((stats.wait_mean_us[on] + stats.lateness_mean_us[on]).mean())


def _node_collective_time(obs: Observation, node: str, nodes: dict[int, str]) -> float:
    """`_collective_time` of the node's ranks."""
    return _collective_time(obs, {r for r, n in nodes.items() if n == node})


def _slow_computing(obs: Observation, settings: DetectionSettings) -> set[int]:
    """The ranks that compute markedly longer than their role peers (empty without rank
    statistics or their busy columns)."""
    stats = obs.ranks
    if stats is None:
        return set()
    judged = stats.n >= settings.straggler.busy_min_collectives
    own = own_time(stats, judged, role_groups(obs.snapshot, obs.links, stats.rank))
    if own is None:
        return set()
    return {int(r) for r in stats.rank[compute_stragglers(own, judged, stats.n, settings)]}


def detect_slow_link(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    """The slowest outlier link, or the node whose links are all slow (see the docstring)."""
    links = obs.links
    if links is None or links.src.shape[0] < settings.link.min_comparable:
        return None
    nodes = rank_nodes(obs.snapshot)
    codes: dict[str, int] = {}
    src_code = np.array([codes.setdefault(nodes.get(int(r), f"?{r}"), len(codes))
                         for r in links.src], dtype=np.int64)
    dst_code = np.array([codes.setdefault(nodes.get(int(r), f"?{r}"), len(codes))
                         for r in links.dst], dtype=np.int64)
    names = list(codes)
    judged = links.n >= settings.link.min_transfers
    # the mean without the worst transfer: one network hiccup does not make a link slow
    count = links.n.astype(np.float64)
    total = links.transfer_mean_us.astype(np.float64) * count
    transfer = np.where(
        count >= 2, (total - links.transfer_max_us) / np.maximum(count - 1, 1),
        links.transfer_mean_us,
    ).astype(np.float64)
    intra = src_code == dst_code
    boundary = _boundaries(obs, links)

    z = np.zeros_like(transfer)
    ratio = np.ones_like(transfer)
    median = np.zeros_like(transfer)
    comparable = np.zeros_like(transfer)
    for cls in (intra, ~intra):
        sel = judged & cls
        in_class = int(sel.sum())
        if in_class < settings.link.min_comparable:
            continue
        class_center = float(np.median(transfer[sel]))
        median[sel], comparable[sel] = class_center, in_class
        # each link against the links of its own boundary where they are enough to have a
        # median of their own: the schedule's issue order makes some boundaries' transfers
        # look longer than others' on a healthy job
        for b in np.unique(boundary[sel]):
            peers = sel & (boundary == b)
            if int(peers.sum()) >= _MIN_BOUNDARY_PEERS:
                median[peers] = float(np.median(transfer[peers]))
                comparable[peers] = int(peers.sum())
        ratio[sel] = transfer[sel] / np.maximum(median[sel], _FLOOR_US)
        center = float(np.median(ratio[sel]))
        mad = float(np.median(np.abs(ratio[sel] - center))) * 1.4826
        scale = max(mad, _REL_FLOOR * center, _FLOOR_US / max(class_center, _FLOOR_US))
        z[sel] = (ratio[sel] - center) / scale
    # One hiccup left after trimming lifts a link's mean by its size over the link's transfers:
    # a link of many transfers needs less margin (down to the node margin) than one of a dozen.
    needed = np.maximum(
        settings.link.node_min_ratio,
        1.0 + (settings.link.min_ratio - 1.0)
        * np.minimum(1.0, settings.link.full_margin_transfers / np.maximum(count, 1.0)),
    )
    slow = judged & (z >= settings.link.min_z) & (ratio >= needed)
    # A node is judged on all its links together, so each of them needs less margin.
    weak = judged & (z >= settings.link.min_z) & (ratio >= settings.link.node_min_ratio)
    if not weak.any():
        return None
    # Links with a slow GPU at one end: slow at everything, a straggler's, not a link's.
    computing = np.fromiter(_slow_computing(obs, settings), dtype=np.int64)
    explained = np.isin(links.src, computing) | np.isin(links.dst, computing)
    slow &= ~explained
    weak &= ~explained
    if not weak.any():
        return None

    def where(i: int) -> str:
        return "intra-node" if intra[i] else "inter-node"

    def link_words(i: int) -> str:
        s, d = int(links.src[i]), int(links.dst[i])
        return (
            f"transfers from rank {s} on node {names[src_code[i]]} to rank {d} on node "
            f"{names[dst_code[i]]} took {ms(float(links.transfer_mean_us[i]))} on average over "
            f"{int(links.n[i])} "
            f"(worst {ms(float(links.transfer_max_us[i]))}), {ratio[i]:.1f}x the median of "
            f"{int(comparable[i])} comparable {where(i)} links ({ms(median[i])})"
        )

    def evidence_of(idx: I64) -> tuple[Evidence, ...]:
        return tuple(
            Evidence(
                fact=Fact.SLOW_TRANSFER, rank=int(links.src[i]), node=names[src_code[i]],
                detail=link_words(i), value=round(float(transfer[i]) / 1e6, 6),
            )
            for i in idx[: settings.max_evidence]
        )

    # node blame: most of a node's links are slow, towards at least two different peers
    n_codes = len(names)
    cross = src_code != dst_code
    touch = np.bincount(src_code[judged], minlength=n_codes) + np.bincount(
        dst_code[judged & cross], minlength=n_codes)
    slow_touch = np.bincount(src_code[weak], minlength=n_codes) + np.bincount(
        dst_code[weak & cross], minlength=n_codes)
    qualified: list[int] = []
    for code in np.flatnonzero(slow_touch >= 2):
        mine = weak & ((src_code == code) | (dst_code == code))
        peers = set(links.dst[mine & (src_code == code)].tolist()) | set(
            links.src[mine & (dst_code == code)].tolist())
        share = slow_touch[code] / max(touch[code], 1)
        if len(peers) >= 2 and share >= settings.link.node_fraction:
            qualified.append(int(code))
    most = max((int(slow_touch[c]) for c in qualified), default=0)
    tied = [c for c in qualified if slow_touch[c] == most]
    if len(tied) > 1:
        # Two nodes whose links all go to each other (one pipeline boundary): a slow NIC also
        # slows its node's inter-node collectives, so the collectives of its ranks take longer.
        tied.sort(key=lambda c: (-_node_collective_time(obs, names[c], nodes), names[c]))
    best_node = tied[0] if tied else -1

    job, attempt, now = obs.snapshot.job, obs.snapshot.attempt, obs.snapshot.now_us
    weak_idx = np.flatnonzero(weak)
    weak_idx = weak_idx[np.argsort(-ratio[weak_idx], kind="stable")]
    if best_node >= 0:
        mine_idx = [int(i) for i in weak_idx
                    if src_code[i] == best_node or dst_code[i] == best_node]
        ranks: list[int] = []
        for i in mine_idx:
            for r, c in ((int(links.src[i]), src_code[i]), (int(links.dst[i]), dst_code[i])):
                if c == best_node and r not in ranks:
                    ranks.append(r)
        worst = mine_idx[0]
        node = names[best_node]
        summary = (
            f"the network of node {node} is slow: {int(slow_touch[best_node])} of "
            f"{int(touch[best_node])} links touching it are outliers, up to "
            f"{ratio[worst]:.1f}x the median of comparable links "
            f"({ms(transfer[worst])} vs {ms(median[worst])})"
        )
        others = tuple(names[c] for c in tied[1:])
        if others:
            summary += (
                f"; so are those of node(s) {', '.join(others)}, whose links all go to it: "
                "either side's network may be the slow one"
            )
            if obs.ranks is not None:
                summary += (
                    f" (its ranks' collectives take {ms(_node_collective_time(obs, node, nodes))} "
                    "from first arrival to completion, those of "
                    f"{others[0]} {ms(_node_collective_time(obs, others[0], nodes))})"
                )
        return Verdict(
            job=job, attempt=attempt, kind=IncidentKind.SLOW_LINK, culprit_ranks=tuple(ranks),
            culprit_nodes=(node, *others), confidence=WEAK if others else STRONG,
            basis=Basis.LINK_LATENCY, summary=summary, evidence=evidence_of(np.asarray(mine_idx)),
            observed_at_us=now,
            culprit_link=(int(links.src[worst]), int(links.dst[worst])),
        )

    slow_idx = np.flatnonzero(slow)
    if slow_idx.size == 0:
        return None
    slow_idx = slow_idx[np.argsort(-ratio[slow_idx], kind="stable")]
    worst = int(slow_idx[0])
    s, d = int(links.src[worst]), int(links.dst[worst])
    s_other = _other_links_ratio(s, (s, d), src=links.src, dst=links.dst, ratio=ratio,
                                 judged=judged)
    d_other = _other_links_ratio(d, (s, d), src=links.src, dst=links.dst, ratio=ratio,
                                 judged=judged)
    ends = [(s, names[src_code[worst]]), (d, names[dst_code[worst]])]
    if d_other >= _END_MARGIN * s_other:
        ends.reverse()
    elif s_other < _END_MARGIN * d_other:
        # the links do not tell the ends apart (a pipeline pair has no other link): a slow
        # NIC also slows its rank's inter-node collectives, the peer's stay as they were
        s_time, d_time = _collective_time(obs, {s}), _collective_time(obs, {d})
        if d_time >= _END_MARGIN * s_time > 0:
            ends.reverse()
    culprit_ranks = tuple(r for r, _ in ends)
    culprit_nodes = tuple(dict.fromkeys(n for _, n in ends))
    # Twice as slow as comparable links is surely slow; from 1.5x to 2x, load may explain some.
    confidence = STRONG if ratio[worst] >= 2.0 else LIKELY
    also = f"; {slow_idx.size - 1} other link(s) are slow too" if slow_idx.size > 1 else ""
    return Verdict(
        job=job, attempt=attempt, kind=IncidentKind.SLOW_LINK, culprit_ranks=culprit_ranks,
        culprit_nodes=culprit_nodes, confidence=confidence, basis=Basis.LINK_LATENCY,
        summary=link_words(worst) + also, evidence=evidence_of(slow_idx), observed_at_us=now,
        culprit_link=(s, d),
    )
