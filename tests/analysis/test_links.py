"""Slow link and slow node from point-to-point transfer times, and the slow GPU whose transfers
only look slow."""

from __future__ import annotations

import numpy as np
import pytest
from observation_builders import T0, S, arrivals, groups, links, observe, snapshot
from played_jobs import megatron

from tracehound.analysis.confidence import STRONG, WEAK
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.links import detect_slow_link
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings, StragglerSettings
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.summaries import LinkStats, RankStats

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S


def pipeline_links(factor: dict[tuple[int, int], float] | None = None, *, seed: int = 0,
                   slow_node: int = -1, node_factor: float = 1.0) -> list[tuple[int, int, float]]:
    """64 ranks in 4 stages of 16: activations r -> r+16, gradients back; ~800 us each."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(48):
        for src, dst in ((r, r + 16), (r + 16, r)):
            t = 800.0 * (1 + 0.02 * rng.standard_normal())
            t *= (factor or {}).get((src, dst), 1.0)
            if slow_node in (src // 8, dst // 8):
                t *= node_factor
            rows.append((src, dst, t))
    return rows


def observation(stats: LinkStats) -> Observation:
    return observe(snapshot(NOW, 64), links=stats)


def test_the_slow_link_is_named_with_both_ends() -> None:
    verdict = detect_slow_link(observation(links(pipeline_links({(5, 21): 2.5}))), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.SLOW_LINK
    assert verdict.basis is Basis.LINK_LATENCY
    assert verdict.culprit_link == (5, 21)
    assert verdict.culprit_ranks == (5, 21)
    assert verdict.culprit_nodes == ("node-0", "node-2")
    assert verdict.confidence == STRONG  # 2.5x: twice as slow is no hiccup
    assert verdict.summary.startswith(
        "transfers from rank 5 on node node-0 to rank 21 on node node-2 took 1.98 ms")
    assert "2.5x the median of 96 comparable inter-node links" in verdict.summary
    assert [e.fact for e in verdict.evidence] == [Fact.SLOW_TRANSFER]


def test_the_end_whose_other_links_are_slow_too_comes_first() -> None:
    # Rank 21's other link (to 37) is a little slow as well: the receiver is the likelier culprit.
    rows = pipeline_links({(5, 21): 2.5, (21, 37): 1.2, (37, 21): 1.2})
    verdict = detect_slow_link(observation(links(rows)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_link == (5, 21)
    assert verdict.culprit_ranks == (21, 5)


def test_a_node_whose_links_are_all_slow_is_blamed() -> None:
    # node-3 (ranks 24..31, stage 1) talks to stage 0 and stage 2: two different peer nodes.
    rows = pipeline_links(slow_node=3, node_factor=1.6)
    verdict = detect_slow_link(observation(links(rows)), SETTINGS)
    assert verdict is not None
    assert verdict.culprit_nodes == ("node-3",)
    assert set(verdict.culprit_ranks) == set(range(24, 32))
    assert verdict.confidence == STRONG
    assert verdict.summary.startswith("the network of node node-3 is slow: 32 of 32 links")


def test_one_hiccup_does_not_make_a_link_slow() -> None:
    rows = pipeline_links()
    stats = links(rows, n=12)
    # link 0: one transfer of 30 ms among 12 of 0.8 ms
    mean = stats.transfer_mean_us.copy()
    peak = stats.transfer_max_us.copy()
    mean[0] = (11 * 800.0 + 30_000.0) / 12
    peak[0] = 30_000.0
    hiccup = LinkStats(src=stats.src, dst=stats.dst, n=stats.n, transfer_mean_us=mean,
                       transfer_max_us=peak)
    assert detect_slow_link(observation(hiccup), SETTINGS) is None


def test_a_link_of_many_transfers_needs_less_margin_than_one_of_a_dozen() -> None:
    """A link 2x slower in bandwidth moves transfers that also pay fixed latency ~1.35x slower.
    Over 64 transfers that is no leftover hiccup (one would lift the trimmed mean by a few
    percent): slow. Over 12, two hiccups can lift a healthy link that far: not slow."""
    rows = pipeline_links({(5, 21): 1.35})
    many = detect_slow_link(observation(links(rows, n=64)), SETTINGS)
    assert many is not None and many.culprit_link == (5, 21)
    assert detect_slow_link(observation(links(rows, n=12)), SETTINGS) is None


def test_healthy_links_give_no_verdict() -> None:
    for seed in range(10):
        assert detect_slow_link(observation(links(pipeline_links(seed=seed))), SETTINGS) is None


def test_intra_node_links_are_not_compared_with_network_links() -> None:
    # Fast NVLink pairs inside nodes (80 us) next to network pairs (800 us): nothing is slow.
    rows = pipeline_links() + [(r, r + 1, 80.0 + r) for r in range(0, 64, 2)]
    assert detect_slow_link(observation(links(rows)), SETTINGS) is None


def boundary_stats(wait: dict[int, float], lateness: dict[int, float]) -> RankStats:
    """RankStats of 64 ranks: 1 ms mean wait and 0.2 ms mean lateness unless given per node."""
    ranks = np.arange(64, dtype=np.int64)
    return RankStats(
        rank=ranks, n=np.full(64, 200, dtype=np.int64),
        lateness_mean_us=np.array([lateness.get(int(r) // 8, 200.0) for r in ranks]),
        last_count=np.full(64, 25, dtype=np.int64),
        wait_mean_us=np.array([wait.get(int(r) // 8, 1_000.0) for r in ranks]),
        span_us=np.full(64, 10 * S, dtype=np.int64),
    )


def test_a_pipeline_pair_s_end_whose_collectives_take_longer_comes_first() -> None:
    """Ranks 5 and 37 only talk to each other (two stages: r <-> r + 32) and both directions
    are slow: the links cannot tell the ends apart. Rank 37's NIC also slows its data-parallel
    collectives (node-4's ranks' collectives take longer from first arrival to completion):
    it is named first; with nothing to tell them apart, the sender is."""
    rows = []
    for r in range(32):
        for src, dst in ((r, r + 32), (r + 32, r)):
            rows.append((src, dst, (2_000.0 if r == 5 else 800.0) + 3.0 * r))
    slow_peer = boundary_stats(wait={}, lateness={4: 3_000.0})
    verdict = detect_slow_link(observe(snapshot(NOW, 64), links=links(rows), ranks=slow_peer),
                               SETTINGS)
    assert verdict is not None and verdict.culprit_ranks == (37, 5)
    even = detect_slow_link(observe(snapshot(NOW, 64), links=links(rows),
                                    ranks=boundary_stats(wait={}, lateness={})), SETTINGS)
    assert even is not None and even.culprit_ranks == (5, 37)


def test_at_a_pipeline_boundary_the_node_whose_collectives_take_longer_comes_first() -> None:
    # Two stages of 32 ranks: r <-> r + 32, so node-0's links all go to node-4 and back. Every
    # one of them is slow: the links cannot tell node-0 from node-4.
    rows = []
    for r in range(32):
        for src, dst in ((r, r + 32), (r + 32, r)):
            rows.append((src, dst, (2_000.0 if r < 8 else 800.0) + 3.0 * r))
    # node-0's ranks (the last stage of their pipeline here) wait longest in the world
    # all-reduce, but they arrive early: from first arrival to completion, node-4's collectives
    # (its slow NIC slows its data-parallel all-reduces) take longer.
    stats = boundary_stats(wait={0: 9_000.0, 4: 6_000.0}, lateness={0: 200.0, 4: 4_000.0})
    obs = observe(snapshot(NOW, 64), links=links(rows), ranks=stats)
    verdict = detect_slow_link(obs, SETTINGS)
    assert verdict is not None
    assert verdict.culprit_nodes == ("node-4", "node-0")
    assert set(verdict.culprit_ranks) == set(range(32, 40))
    assert verdict.confidence == WEAK
    assert "either side's network may be the slow one (its ranks' collectives take 10.0 ms " \
           "from first arrival to completion, those of node-0 9.20 ms)" in verdict.summary
    # ...and the other way round when node-0's collectives are the slow ones.
    flipped = observe(snapshot(NOW, 64), links=links(rows),
                      ranks=boundary_stats(wait={0: 9_000.0, 4: 6_000.0},
                                           lateness={0: 2_000.0, 4: 200.0}))
    other = detect_slow_link(flipped, SETTINGS)
    assert other is not None and other.culprit_nodes == ("node-0", "node-4")


# --- a slow GPU is slow at everything: its transfers look slow too ------------------------------


@pytest.mark.parametrize("seed", range(3))
def test_a_slow_gpu_s_transfers_are_left_to_the_straggler(seed: int) -> None:
    # Rank 21 computes twice as long and its transfers take twice as long (its kernels start
    # late): its links alone would make a slow link between it and its pipeline neighbour.
    obs = megatron(slow={21: 2.0}, slow_kernels=True, seed=seed)
    # no rank counts as slow computing
    alone = DetectionSettings(straggler=StragglerSettings(min_excess=100.0))
    blind = detect_slow_link(obs, alone)
    assert blind is not None and 21 in blind.culprit_ranks
    assert detect_slow_link(obs, SETTINGS) is None
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.STRAGGLER
    assert verdict.culprit_ranks == (21,)


@pytest.mark.parametrize("seed", range(3))
def test_a_real_slow_link_stays_a_slow_link(seed: int) -> None:
    # Transfers from rank 21 to 37 take 2.5x as long; both ranks compute as their peers do.
    obs = megatron(slow_links={(21, 37): 2.5}, seed=seed)
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.SLOW_LINK
    assert verdict.culprit_link == (21, 37)
    assert set(verdict.culprit_ranks) == {21, 37}


def test_a_straggler_named_by_arrivals_wins_over_its_slow_link() -> None:
    # A source without the busy columns: the arrival rule names rank 17, and the link from it
    # to its pipeline neighbour looks 2.5x slow. The straggler explains both.
    a = arrivals(slow={17: 1.5}, seed=0)
    rows = pipeline_links({(17, 33): 2.5})
    obs = observe(snapshot(a.end_us, 64, members=groups(8, 64)), start_us=a.start_us,
                  ranks=a.ranks, links=links(rows))
    link = detect_slow_link(obs, SETTINGS)
    assert link is not None and link.culprit_link == (17, 33)
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.STRAGGLER
    assert verdict.culprit_ranks[0] == 17
