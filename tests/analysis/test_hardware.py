"""Hardware: health events that coincide with an anomaly on the same node, and only then."""

from __future__ import annotations

from dataclasses import replace

from observation_builders import S, arrivals, beat, groups, health, observe, progress, snapshot

from tracehound.analysis.common import collective_groups, group_members
from tracehound.analysis.confidence import LIKELY, STRONG
from tracehound.analysis.detect import DetectionSettings, detect_hang
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.hardware import correlate_hardware, detect_slow_node
from tracehound.analysis.observation import Observation
from tracehound.analysis.straggler import detect_straggler
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import HealthSeverity, IncidentKind

SETTINGS = DetectionSettings()
WARNING = HealthSeverity.WARNING


def straggling(*samples_at: tuple[str, str, HealthSeverity, int]) -> Observation:
    """Rank 17 (node-2) is 40% slower; health samples as (node, metric, severity, offset s)."""
    a = arrivals(slow={17: 1.4}, seed=3)
    snap = snapshot(a.end_us, 64, members=groups(8, 64))
    samples = tuple(health(n, m, a.end_us + off * S, severity=sev, value=1.0)
                    for n, m, sev, off in samples_at)
    return observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                   health=samples)


def test_a_throttle_warning_on_the_stragglers_node_makes_it_hardware() -> None:
    obs = straggling(("node-2", "throttle", WARNING, -1))
    verdict = diagnose_observation(obs, SETTINGS)
    own = detect_straggler(obs, SETTINGS)
    assert verdict is not None and own is not None
    assert verdict.kind is IncidentKind.HARDWARE
    assert verdict.basis is Basis.HEALTH_CORRELATION
    assert verdict.culprit_ranks == (17,)
    assert verdict.culprit_nodes == ("node-2",)
    # A warning makes it STRONG at least; the straggler's own confidence is higher, and kept.
    assert verdict.confidence == own.confidence > STRONG
    assert verdict.evidence[0].fact is Fact.HEALTH
    assert verdict.evidence[0].detail == (
        "warning throttle=1 on gpu3 of node node-2, 1.0 s before the window ended")
    assert any(e.fact is Fact.LATE for e in verdict.evidence)
    assert verdict.summary.startswith("warning throttle=1 on gpu3 of node node-2, 1.0 s before "
                                      "the window ended coincides with the straggler of rank 17")


def test_an_event_elsewhere_or_long_before_leaves_the_straggler_verdict() -> None:
    elsewhere = diagnose_observation(straggling(("node-5", "xid", HealthSeverity.CRITICAL, -1)),
                                     SETTINGS)
    assert elsewhere is not None and elsewhere.kind is IncidentKind.STRAGGLER
    stale = diagnose_observation(straggling(("node-2", "throttle", WARNING, -3600)), SETTINGS)
    assert stale is not None and stale.kind is IncidentKind.STRAGGLER


def test_a_health_event_without_an_anomaly_is_no_verdict() -> None:
    a = arrivals(seed=3)
    snap = snapshot(a.end_us, 64, members=groups(8, 64))
    obs = observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                  health=(health("node-2", "xid", a.end_us - S),
                          health("node-4", "ecc_correctable", a.end_us - S, severity=WARNING)))
    assert diagnose_observation(obs, SETTINGS) is None


def test_an_xid_localizes_a_hang_that_no_rank_explains() -> None:
    # A GPU fell off the bus inside the collective: every member waits on #7, nobody lags.
    now = 1_700_000_100 * S
    beats = [beat(r, now - S // 5, progress("tp-1", 7, 6, enq_us=now - 9 * S))
             for r in range(8, 16)]
    beats += [beat(r, now - S // 5, progress("tp-0", 7, 7, enq_us=now - 9 * S)) for r in range(8)]
    snap = snapshot(now, 16, beats, {"tp-1": list(range(8, 16))})
    obs = observe(snap, health=(health("node-1", "xid", now - 8 * S, device="gpu5"),))
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HARDWARE
    assert verdict.culprit_nodes == ("node-1",)
    assert verdict.culprit_ranks == tuple(range(8, 16))
    assert verdict.confidence == LIKELY  # the event alone localizes: no higher


def test_a_warning_counts_on_the_most_likely_node_only() -> None:
    now = 1_700_000_100 * S
    beats = [beat(r, now - S // 5, progress("tp-1", 7, 6, enq_us=now - 9 * S))
             for r in range(0, 16)]
    hang = detect_hang(snapshot(now, 16, beats, {"tp-1": list(range(16))}), SETTINGS)
    assert hang is not None and hang.culprit_nodes == ("node-0", "node-1")
    obs = observe(snapshot(now, 16, beats),
                  health=(health("node-1", "pcie_replays", now - S, severity=WARNING),))
    assert correlate_hardware(hang, obs, SETTINGS) is None
    critical = replace(obs, health=(health("node-1", "xid", now - S),))
    upgraded = correlate_hardware(hang, critical, SETTINGS)
    assert upgraded is not None and upgraded.culprit_nodes == ("node-1",)


def test_a_crash_keeps_its_kind_and_gains_the_health_evidence() -> None:
    from tracehound.tracing.events import RankExit
    from tracehound.tracing.ids import JobId, NodeId, Rank

    now = 1_700_000_100 * S
    exit_ = RankExit(job=JobId("j"), attempt=0, node=NodeId("node-1"), rank=Rank(9), pid=1,
                     exit_code=-6, time_us=now - 2 * S)
    snap = replace(snapshot(now, 16), exits=(exit_,))
    obs = observe(snap, health=(health("node-1", "xid", now - 3 * S, value=79.0),))
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.CRASH
    assert verdict.culprit_ranks == (9,)
    assert [e.fact for e in verdict.evidence] == [Fact.EXIT, Fact.HEALTH]


def slow_node(*samples: tuple[str, str, HealthSeverity], spike_node: int = -1) -> Observation:
    """Every rank of node-2 (ranks 16..23, one TP group) computes 30% slower (degraded NVLink
    stretching its tensor-parallel work): nobody within the node stands out, the node arrives
    late at every data-parallel all-reduce. Health samples as (node, metric, severity)."""
    slow = {r: 1.3 for r in range(16, 24)}
    a = arrivals(slow=slow, seed=5)
    snap = snapshot(a.end_us, 64, members=groups(8, 64))
    return observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                   health=tuple(health(n, m, a.end_us - S, severity=sev, value=40.0)
                                for n, m, sev in samples))


def test_a_slow_node_with_an_nvlink_warning_is_hardware() -> None:
    obs = slow_node(("node-2", "nvlink_errors", WARNING))
    assert detect_straggler(obs, SETTINGS) is None  # no rank is last most of the time
    verdict = detect_slow_node(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HARDWARE
    assert verdict.basis is Basis.HEALTH_CORRELATION
    assert verdict.culprit_nodes == ("node-2",)
    assert verdict.culprit_ranks == tuple(range(16, 24))
    assert verdict.confidence == LIKELY
    assert verdict.evidence[0].fact is Fact.HEALTH
    assert [e.fact for e in verdict.evidence[1:]] == [Fact.LATE] * 4  # every recent window
    assert verdict.summary.startswith(
        "warning nvlink_errors=40 on gpu3 of node node-2, 1.0 s before the window ended "
        "coincides with a slow node: the ranks of node node-2 arrived")
    diagnosed = diagnose_observation(obs, SETTINGS)
    assert diagnosed is not None and diagnosed.kind is IncidentKind.HARDWARE
    assert diagnosed.culprit_nodes == ("node-2",)


def test_a_slow_node_without_a_health_event_on_it_is_no_hardware_verdict() -> None:
    assert detect_slow_node(slow_node(), SETTINGS) is None
    assert detect_slow_node(slow_node(("node-5", "nvlink_errors", WARNING)), SETTINGS) is None


def test_healthy_nodes_with_warnings_are_not_slow_nodes() -> None:
    for seed in range(5):
        a = arrivals(seed=seed)  # three 100-400 ms pauses on random ranks: one window each
        snap = snapshot(a.end_us, 64, members=groups(8, 64))
        samples = tuple(health(f"node-{n}", "ecc_correctable", a.end_us - S, severity=WARNING)
                        for n in range(8))
        obs = observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                      health=samples)
        assert detect_slow_node(obs, SETTINGS) is None
        assert diagnose_observation(obs, SETTINGS) is None


def test_slow_nodes_are_compared_within_groups_that_carried_collectives() -> None:
    # A pipeline group whose heartbeats show no collective (its traffic goes through pair
    # groups) and the pair groups themselves are no comparison; a group nobody reports is kept.
    now = 1_700_000_100 * S
    members = {"tp-0": [0, 1], "pp-0": [0, 8], "pp-0:p2p:0-8": [0, 8], "dp-0": [0, 16]}
    beats = [beat(r, now, progress("tp-0", 9, 9, enq_us=now), progress("pp-0", 0, 0, enq_us=0))
             for r in (0, 1)]
    snap = snapshot(now, 24, beats, members)
    assert sorted(collective_groups(snap, group_members(snap))) == ["dp-0", "tp-0"]
