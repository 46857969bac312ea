"""Straggler by consistent last arrival, on arrivals played from a seeded TP x DP job."""

from __future__ import annotations

import pytest
from observation_builders import arrivals, groups, observe, snapshot

from tracehound.analysis.detect import DetectionSettings
from tracehound.analysis.observation import Observation
from tracehound.analysis.straggler import detect_straggler
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind

SETTINGS = DetectionSettings()


def observation(**kw: object) -> Observation:
    a = arrivals(**kw)  # type: ignore[arg-type]
    snap = snapshot(a.end_us, 64, members=groups(8, 64))
    return observe(snap, start_us=a.start_us, ranks=a.ranks)


@pytest.mark.parametrize("seed", range(5))
def test_a_rank_twenty_percent_slower_is_the_straggler(seed: int) -> None:
    verdict = detect_straggler(observation(slow={17: 1.2}, seed=seed), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.STRAGGLER
    assert verdict.basis is Basis.ARRIVAL_LATENESS
    assert verdict.culprit_ranks == (17,)  # its TP peers, late at the DP collectives, are not
    assert verdict.culprit_nodes == ("node-2",)
    assert verdict.confidence >= 0.9
    assert verdict.evidence[0].fact is Fact.LATE


def test_the_summary_says_how_often_and_how_late() -> None:
    verdict = detect_straggler(observation(slow={17: 1.5}, seed=0), SETTINGS)
    assert verdict is not None
    assert verdict.summary.startswith("rank 17 on node node-2 arrived last at 99% of 240 "
                                      "collectives, 9.")
    # its group peers wait for it, then arrive late at the DP collectives: their median is not
    # the job's (0.88 ms), and the comparison stays conservative
    assert verdict.summary.endswith("(median rank of its groups: 3.46 ms, last at 11%)")


@pytest.mark.parametrize("seed", range(10))
def test_healthy_noise_and_pauses_give_no_straggler(seed: int) -> None:
    # jitter, three 100-400 ms pauses (GC, page cache), and one GPU 4% slower than its peers
    obs = observation(jitter=0.035, spikes=3, slow={seed: 1.04}, seed=seed)
    assert detect_straggler(obs, SETTINGS) is None


def test_a_quiet_job_where_everyone_ties_has_no_straggler() -> None:
    assert detect_straggler(observation(jitter=0.0, spikes=0), SETTINGS) is None


def test_two_stragglers_in_different_groups_are_both_named() -> None:
    verdict = detect_straggler(observation(slow={17: 1.6, 42: 1.3}, seed=1), SETTINGS)
    assert verdict is not None
    assert set(verdict.culprit_ranks) == {17, 42}
    assert verdict.culprit_ranks[0] in (17, 42)


def test_too_few_collectives_are_not_judged() -> None:
    assert detect_straggler(observation(slow={17: 1.5}, steps=2), SETTINGS) is None
