"""Machine-level outliers: flagged only when they stay outliers over consecutive windows."""

from __future__ import annotations

import numpy as np
from observation_builders import T0, S, arrivals, groups, node_of, observe, snapshot

from tracehound.analysis.confidence import LIKELY
from tracehound.analysis.outliers import detect_node_outliers, outlier_nodes
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import NodeWindows

SETTINGS = DetectionSettings()


def windows(bad: dict[int, list[int]], *, nodes: int = 40, seed: int = 0) -> NodeWindows:
    """Per-node features in 6 windows; `bad` node -> windows where it is 3x late, 4x last."""
    rng = np.random.default_rng(seed)
    f = np.empty((6, nodes, 3))
    f[..., 0] = 1_000.0 * (1 + 0.1 * rng.standard_normal((6, nodes)))
    f[..., 1] = 0.125 * (1 + 0.1 * rng.standard_normal((6, nodes)))
    f[..., 2] = 5_000.0 * (1 + 0.1 * rng.standard_normal((6, nodes)))
    for node, ws in bad.items():
        for w in ws:
            f[w, node, 0] *= 3.0
            f[w, node, 1] *= 4.0
            f[w, node, 2] *= 0.5
    return NodeWindows(nodes=tuple(node_of(8 * i) for i in range(nodes)),
                       window_start_us=T0 + np.arange(6) * 10 * S, features=f)


def test_a_node_that_stays_an_outlier_is_flagged_with_its_ranks() -> None:
    nw = windows({7: [2, 3, 4, 5]})
    verdict = detect_node_outliers(observe(snapshot(T0 + 60 * S, 320), node_windows=nw),
                                   SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.NODE_OUTLIER
    assert verdict.basis is Basis.OUTLIER_MODEL
    assert verdict.culprit_nodes == ("node-7",)
    assert verdict.culprit_ranks == tuple(range(56, 64))
    assert verdict.confidence == LIKELY
    assert verdict.evidence[0].fact is Fact.OUTLIER
    assert verdict.summary.startswith("node node-7 was an outlier in 4 of the last 4 windows")


def test_an_outlier_in_two_of_four_windows_is_noise() -> None:
    assert outlier_nodes(windows({7: [3, 5]}), SETTINGS) == []


def test_a_faster_node_that_waits_more_is_not_an_outlier() -> None:
    nw = windows({})
    nw.features[:, 7, 0] *= 0.2
    nw.features[:, 7, 2] *= 3.0
    assert outlier_nodes(nw, SETTINGS) == []


def test_missing_windows_and_tiny_jobs_give_nothing() -> None:
    nw = windows({7: [2, 3, 4, 5]})
    nw.features[:, 3, :] = np.nan
    assert [o.node for o in outlier_nodes(nw, SETTINGS)] == ["node-7"]
    small = windows({1: [2, 3, 4, 5]}, nodes=4)
    assert outlier_nodes(small, SETTINGS) == []


def test_healthy_arrivals_flag_no_node() -> None:
    for seed in range(5):
        a = arrivals(ranks=128, seed=seed, jitter=0.035, spikes=3)
        obs = observe(snapshot(a.end_us, 128, members=groups(8, 128)),
                      start_us=a.start_us, node_windows=a.node_windows)
        assert detect_node_outliers(obs, SETTINGS) is None
