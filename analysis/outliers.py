"""Machine-level outliers: a node that stays unlike the other nodes over consecutive windows.

Reads `Observation.node_windows` (per node and window: mean lateness, last fraction, mean wait).
Each window's features are standardized across nodes by median and MAD, so that a job-wide
slowdown shifts no node. A (node, window) is an outlier when both hold:

- its lateness and its last fraction are both `outlier_z` robust deviations above the median
  node's (the bad direction: a node that arrives early and waits more is a healthy, faster node;
  one that is last more often but not later sits at a pipeline boundary);
- scikit-learn's LocalOutlierFactor (deterministic; fitted on the standardized features of the
  last `outlier_windows` windows of all nodes) scores it at least `outlier_lof`.

A node is flagged only when it is an outlier in `outlier_min_flagged` of the last
`outlier_windows` windows, so one noisy window never evicts a healthy node. The model is only
fitted when some node passes the cheap first test often enough, which keeps a healthy
10,000-rank job's check in the milliseconds. scikit-learn is imported lazily, on that path.

Pure: no I/O, no clock; the model is fitted on the arrays passed in and discarded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from tracehound.analysis.common import ms, node_ranks, pct, rank_nodes
from tracehound.analysis.confidence import LIKELY, WEAK
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import F64, NodeWindows

_FLOORS = np.array([100.0, 0.02, 100.0])
"""Scale floors per feature (us, fraction, us): a quiet job's microsecond jitter is no outlier."""
_REL_FLOOR = 0.05
_CLIP = 50.0


@dataclass(frozen=True, slots=True)
class NodeOutlier:
    node: str
    flagged: int
    """Windows (of the last `outlier_windows`) in which the node was an outlier."""
    windows: int
    lateness_us: float
    last_fraction: float
    median_lateness_us: float
    median_last_fraction: float
    score: float
    """Mean robust z-score of the bad-direction feature over the flagged windows."""


def _standardize(features: F64) -> tuple[F64, F64]:
    """Per window and feature: (x - median) / max(1.4826 MAD, floors); and the medians."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)  # windows where no node had rows
        center = np.nanmedian(features, axis=1, keepdims=True)
        mad = np.nanmedian(np.abs(features - center), axis=1, keepdims=True) * 1.4826
    scale = np.maximum(np.maximum(np.nan_to_num(mad), _REL_FLOOR * np.abs(np.nan_to_num(center))),
                       _FLOORS)
    z: F64 = (features - center) / scale
    return z, center[:, 0, :]


def outlier_nodes(nw: NodeWindows, settings: DetectionSettings) -> list[NodeOutlier]:
    """The nodes flagged over the last windows, most outlying first (see the docstring)."""
    features = np.asarray(nw.features, dtype=np.float64)
    if features.ndim != 3 or features.shape[1] < settings.outliers.min_nodes:
        return []
    features = features[-settings.outliers.windows:]
    windows = features.shape[0]
    if windows < settings.outliers.min_flagged:
        return []
    z, medians = _standardize(features)
    bad = np.fmin(z[:, :, 0], z[:, :, 1])  # lateness and last fraction, the weaker of the two
    first = np.nan_to_num(bad, nan=-np.inf) >= settings.outliers.z
    candidates = np.flatnonzero(first.sum(axis=0) >= settings.outliers.min_flagged)
    if candidates.size == 0:
        return []

    from sklearn.neighbors import LocalOutlierFactor

    finite = np.isfinite(z).all(axis=2)
    points = np.clip(z[finite], -_CLIP, _CLIP)
    if points.shape[0] <= 2:
        return []
    lof = LocalOutlierFactor(n_neighbors=min(settings.outliers.neighbors, points.shape[0] - 1))
    lof.fit(points)
    score = np.zeros(z.shape[:2])
    score[finite] = -lof.negative_outlier_factor_
    flagged = first & finite & (score >= settings.outliers.lof)
    counts = flagged.sum(axis=0)
    out: list[NodeOutlier] = []
    for c in candidates:
        if counts[c] < settings.outliers.min_flagged:
            continue
        rows = flagged[:, c]
        out.append(NodeOutlier(
            node=nw.nodes[c], flagged=int(counts[c]), windows=windows,
            lateness_us=float(np.nanmean(features[rows, c, 0])),
            last_fraction=float(np.nanmean(features[rows, c, 1])),
            median_lateness_us=float(np.nanmean(medians[rows, 0])),
            median_last_fraction=float(np.nanmean(medians[rows, 1])),
            score=float(np.mean(bad[rows, c])),
        ))
    out.sort(key=lambda o: (-o.flagged, -o.score, o.node))
    return out


def _words(o: NodeOutlier) -> str:
    return (
        f"node {o.node} was an outlier in {o.flagged} of the last {o.windows} windows: its "
        f"ranks arrived {ms(o.lateness_us)} after the first on average and last at "
        f"{pct(o.last_fraction)} of collectives (median node: {ms(o.median_lateness_us)}, "
        f"{pct(o.median_last_fraction)})"
    )


def detect_node_outliers(obs: Observation, settings: DetectionSettings) -> Verdict | None:
    """A node_outlier verdict naming the flagged nodes and their ranks, or None."""
    if obs.node_windows is None:
        return None
    found = outlier_nodes(obs.node_windows, settings)
    if not found:
        return None
    ranks_on = node_ranks(rank_nodes(obs.snapshot))
    ranks = tuple(r for o in found for r in ranks_on.get(o.node, ()))
    evidence = tuple(
        Evidence(fact=Fact.OUTLIER, rank=ranks_on.get(o.node, [-1])[0], node=o.node,
                 detail=_words(o), value=round(o.score, 3))
        for o in found[: settings.max_evidence]
    )
    more = f"; {len(found) - 1} more node(s) flagged" if len(found) > 1 else ""
    # Several nodes flagged at once are candidates, not a culprit: more likely a job-wide effect.
    confidence = LIKELY if len(found) == 1 else WEAK
    return Verdict(
        job=obs.snapshot.job, attempt=obs.snapshot.attempt, kind=IncidentKind.NODE_OUTLIER,
        culprit_ranks=ranks, culprit_nodes=tuple(o.node for o in found), confidence=confidence,
        basis=Basis.OUTLIER_MODEL, summary=_words(found[0]) + more, evidence=evidence,
        observed_at_us=obs.snapshot.now_us,
    )
