"""Hardware: health events that explain an anomaly of their device, node and time, and only then."""

from __future__ import annotations

from dataclasses import replace

import pytest
from observation_builders import S, arrivals, beat, groups, health, observe, progress, snapshot

from tracehound.analysis.common import collective_groups, group_members
from tracehound.analysis.confidence import CERTAIN, LIKELY, STRONG, WEAK, nudged
from tracehound.analysis.detect import detect_hang
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.hardware import (
    RELEVANCE,
    HealthKind,
    Symptom,
    correlate_hardware,
    detect_slow_node,
    health_kind,
    judge_health,
    rank_gpus,
    with_health_evidence,
)
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings, HardwareSettings
from tracehound.analysis.straggler import detect_straggler
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import HealthSeverity, IncidentKind, RankExit
from tracehound.tracing.ids import JobId, NodeId, Rank

SETTINGS = DetectionSettings()
WARNING = HealthSeverity.WARNING
CRITICAL = HealthSeverity.CRITICAL
CONTEXT = "context, does not change the verdict: "
NOW = 1_700_000_100 * S


def straggling(*samples_at: tuple[str, str, HealthSeverity, int],
               device: str = "gpu1", value: float = 1.0) -> Observation:
    """Rank 17 (node-2, its second GPU: gpu1) is 40% slower; health samples as (node, metric,
    severity, offset s from the window's end), on `device`, of `value`."""
    a = arrivals(slow={17: 1.4}, seed=3)
    snap = snapshot(a.end_us, 64, members=groups(8, 64))
    samples = tuple(health(n, m, a.end_us + off * S, severity=sev, value=value, device=device)
                    for n, m, sev, off in samples_at)
    return observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                   health=samples)


def context_of(verdict: Verdict) -> list[str]:
    return [e.detail for e in verdict.evidence
            if e.fact is Fact.HEALTH and e.detail.startswith(CONTEXT)]


# -- the tables -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("metric", "value", "severity", "kind"), [
    ("xid", 79, CRITICAL, HealthKind.GPU_FAULT),
    ("xid", 48, CRITICAL, HealthKind.GPU_FAULT),
    ("xid", 79, WARNING, HealthKind.GPU_FAULT),  # fallen off the bus, whatever the source says
    ("xid", 74, CRITICAL, HealthKind.NVLINK_DOWN),
    ("xid", 13, CRITICAL, HealthKind.APPLICATION),
    ("xid", 43, CRITICAL, HealthKind.APPLICATION),
    ("xid", 92, CRITICAL, HealthKind.LOW_GRADE),
    ("xid", 154, CRITICAL, HealthKind.GPU_FAULT),  # unlisted: the source's severity decides
    ("xid", 154, WARNING, HealthKind.LOW_GRADE),
    ("gpu_lost", 1, CRITICAL, HealthKind.GPU_FAULT),
    ("ecc_uncorrectable", 1, CRITICAL, HealthKind.GPU_FAULT),
    ("remapped_rows", 1, WARNING, HealthKind.LOW_GRADE),
    ("remapped_rows", 1, CRITICAL, HealthKind.GPU_FAULT),
    ("nvlink_down", 1, CRITICAL, HealthKind.NVLINK_DOWN),
    ("nvlink_errors", 40, WARNING, HealthKind.NVLINK),
    ("throttle", 1, WARNING, HealthKind.SLOWDOWN),
    ("temperature_c", 93, WARNING, HealthKind.SLOWDOWN),
    ("power_w", 700, WARNING, HealthKind.SLOWDOWN),
    ("sm_clock_mhz", 1100, WARNING, HealthKind.SLOWDOWN),
    # NVML clock event reasons: a bitmask; only the slowdown bits say the GPU runs slow
    ("clocks_event_reasons", 0x4, WARNING, HealthKind.LOW_GRADE),  # software power cap
    ("clocks_event_reasons", 0x1 | 0x2 | 0x10, CRITICAL, HealthKind.LOW_GRADE),
    ("clocks_event_reasons", 0x8, WARNING, HealthKind.SLOWDOWN),  # hardware slowdown
    ("clocks_event_reasons", 0x4 | 0x40, WARNING, HealthKind.SLOWDOWN),  # + hw thermal
    ("clocks_event_reasons", 0x20, WARNING, HealthKind.SLOWDOWN),  # software thermal
    ("clocks_event_reasons", 0x80, CRITICAL, HealthKind.SLOWDOWN),  # power brake
    ("nic_errors", 12, WARNING, HealthKind.NETWORK),
    ("ib_link_down", 1, CRITICAL, HealthKind.NETWORK_DOWN),
    ("ecc_correctable", 3, WARNING, HealthKind.LOW_GRADE),
    ("ecc_correctable", 3000, CRITICAL, HealthKind.SLOWDOWN),  # the source judged the rate
    ("pcie_replays", 9, WARNING, HealthKind.LOW_GRADE),
    ("fan_speed", 9, CRITICAL, HealthKind.UNKNOWN),
])
def test_health_kinds_follow_the_table(metric: str, value: float, severity: HealthSeverity,
                                       kind: HealthKind) -> None:
    assert health_kind(health("node-0", metric, NOW, severity=severity, value=value)) is kind


def test_only_device_faults_and_link_downs_explain_a_stop_and_low_grade_explains_nothing() -> None:
    stops = {k for k, rules in RELEVANCE.items() if Symptom.STOPPED in rules}
    assert stops == {HealthKind.GPU_FAULT, HealthKind.NVLINK_DOWN, HealthKind.NETWORK_DOWN}
    for quiet in (HealthKind.LOW_GRADE, HealthKind.APPLICATION, HealthKind.UNKNOWN):
        assert not RELEVANCE[quiet]
    assert set(RELEVANCE[HealthKind.SLOWDOWN]) == {Symptom.COMPUTE, Symptom.SLOW_NODE}


def test_ranks_drive_the_gpu_of_their_index_on_an_aligned_node() -> None:
    snap = snapshot(NOW, 24)
    gpus = rank_gpus(snap, SETTINGS)
    assert gpus[0] == 0 and gpus[17] == 1 and gpus[23] == 7
    # Node-1 lost its first rank: its indices cannot be trusted, the other nodes' can.
    partial = replace(snap, expected_ranks={r: n for r, n in snap.expected_ranks.items()
                                            if r != 8})
    assert 9 not in rank_gpus(partial, SETTINGS) and rank_gpus(partial, SETTINGS)[17] == 1
    by_node = DetectionSettings(hardware=HardwareSettings(health_gpu_by_local_rank=False))
    assert rank_gpus(snap, by_node) == {}


# -- stragglers ---------------------------------------------------------------------------------


def test_a_throttle_on_the_stragglers_gpu_makes_it_hardware() -> None:
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
    assert verdict.evidence[0].rank == 17
    assert verdict.evidence[0].detail == (
        "warning throttle=1 on gpu1 of node node-2, 1.0 s before the window ended")
    assert any(e.fact is Fact.LATE for e in verdict.evidence)
    assert verdict.summary.startswith("warning throttle=1 on gpu1 of node node-2, 1.0 s before "
                                      "the window ended coincides with the straggler of rank 17")


def test_a_software_power_cap_on_the_stragglers_gpu_leaves_the_straggler() -> None:
    """Every GPU at its power limit reports the software power cap; it explains no GPU slower
    than its peers at the same limit. A thermal slowdown bit in the same report does."""
    capped = diagnose_observation(straggling(("node-2", "clocks_event_reasons", WARNING, -1),
                                             value=0x4), SETTINGS)
    assert capped is not None and capped.kind is IncidentKind.STRAGGLER
    assert capped.culprit_ranks == (17,)
    [context] = context_of(capped)
    assert context.startswith(CONTEXT + "warning clocks_event_reasons=4 on gpu1 of node node-2")
    hot = diagnose_observation(straggling(("node-2", "clocks_event_reasons", WARNING, -1),
                                          value=0x44), SETTINGS)
    assert hot is not None and hot.kind is IncidentKind.HARDWARE
    assert hot.culprit_ranks == (17,)


def test_a_throttle_on_another_gpu_of_the_node_is_context() -> None:
    verdict = diagnose_observation(straggling(("node-2", "throttle", WARNING, -1),
                                              device="gpu5"), SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.STRAGGLER
    assert verdict.culprit_ranks == (17,)
    assert context_of(verdict) == [
        CONTEXT + "warning throttle=1 on gpu5 of node node-2, 1.0 s before the window ended; "
        "on gpu5, not on the culprit's GPU (gpu1 of rank 17)"]


@pytest.mark.parametrize("metric", ["ecc_correctable", "pcie_replays", "nic_errors",
                                    "nvlink_errors", "fan_speed"])
def test_warnings_that_do_not_slow_computation_leave_the_straggler(metric: str) -> None:
    obs = straggling(("node-2", metric, WARNING, -1))
    verdict = diagnose_observation(obs, SETTINGS)
    own = detect_straggler(obs, SETTINGS)
    assert verdict is not None and own is not None
    assert verdict.kind is IncidentKind.STRAGGLER
    assert (verdict.culprit_ranks, verdict.confidence) == (own.culprit_ranks, own.confidence)
    assert verdict.evidence[: len(own.evidence)] == own.evidence
    [context] = context_of(verdict)
    assert context.startswith(CONTEXT + f"warning {metric}=1 on gpu1 of node node-2")
    assert context.endswith("does not explain slow computation")


def test_an_event_elsewhere_or_long_before_leaves_the_straggler_verdict() -> None:
    elsewhere = diagnose_observation(straggling(("node-5", "xid", CRITICAL, -1)), SETTINGS)
    assert elsewhere is not None and elsewhere.kind is IncidentKind.STRAGGLER
    assert context_of(elsewhere) == []  # not on a culprit node: not even context
    # An observation holds the events of minutes before its window (for stops that began
    # then); one from before the window's slack says nothing of a slow rank in it.
    stale = diagnose_observation(straggling(("node-2", "throttle", WARNING, -300)), SETTINGS)
    assert stale is not None and stale.kind is IncidentKind.STRAGGLER
    assert context_of(stale) == []


def by_hand(kind: IncidentKind, ranks: tuple[int, ...], *, confidence: float = LIKELY,
            link: tuple[int, int] | None = None) -> Verdict:
    """An anomaly verdict as a detector would give it, over ranks of the 64-rank snapshot."""
    nodes = tuple(dict.fromkeys(f"node-{r // 8}" for r in ranks))
    return Verdict(job=JobId("j"), attempt=0, kind=kind, culprit_ranks=ranks,
                   culprit_nodes=nodes, confidence=confidence, basis=Basis.ARRIVAL_LATENESS,
                   summary="x", evidence=(Evidence(fact=Fact.LATE, rank=ranks[0],
                                                   node=nodes[0], detail="late"),),
                   observed_at_us=NOW, culprit_link=link)


def with_health(*samples: tuple[str, str, HealthSeverity, str]) -> Observation:
    """The 64-rank snapshot with (node, metric, severity, device) samples a second ago."""
    return observe(snapshot(NOW, 64), health=tuple(
        health(n, m, NOW - S, severity=sev, device=dev, value=1.0) for n, m, sev, dev in samples))


def test_a_node_level_match_costs_one_notch() -> None:
    straggler = by_hand(IncidentKind.STRAGGLER, (17,))
    exact = correlate_hardware(straggler, with_health(("node-2", "throttle", WARNING, "gpu1")),
                               SETTINGS)
    assert exact is not None and exact.confidence == STRONG
    host = correlate_hardware(straggler, with_health(("node-2", "power_cap", WARNING, "host")),
                              SETTINGS)
    assert host is not None and host.confidence == nudged(STRONG, -1)
    unmapped = correlate_hardware(straggler,
                                  with_health(("node-2", "throttle", WARNING, "gpu5")),
                                  DetectionSettings(hardware=HardwareSettings(health_gpu_by_local_rank=False)))
    assert unmapped is not None and unmapped.confidence == nudged(STRONG, -1)
    assert unmapped.culprit_ranks == (17,)
    critical = correlate_hardware(straggler,
                                  with_health(("node-2", "gpu_lost", CRITICAL, "gpu1")), SETTINGS)
    assert critical is not None and critical.confidence == CERTAIN


# -- slow links ---------------------------------------------------------------------------------


def test_nvlink_errors_make_a_slow_link_within_a_node_hardware() -> None:
    within = by_hand(IncidentKind.SLOW_LINK, (5, 6), link=(5, 6), confidence=STRONG)
    upgraded = correlate_hardware(within, with_health(("node-0", "nvlink_errors", WARNING,
                                                       "gpu6")), SETTINGS)
    assert upgraded is not None and upgraded.kind is IncidentKind.HARDWARE
    assert upgraded.culprit_nodes == ("node-0",) and upgraded.culprit_ranks == (5, 6)
    assert upgraded.culprit_link == (5, 6)
    # NVLink carries no traffic between nodes; a slow link is timed from the later arrival, so
    # a throttled GPU does not slow it either.
    between = by_hand(IncidentKind.SLOW_LINK, (5, 21), link=(5, 21), confidence=STRONG)
    assert correlate_hardware(between, with_health(("node-0", "nvlink_errors", WARNING,
                                                    "gpu5")), SETTINGS) is None
    hot = with_health(("node-0", "throttle", WARNING, "gpu5"))
    assert correlate_hardware(within, hot, SETTINGS) is None
    [judged] = judge_health(within, hot, SETTINGS)
    assert judged.why_not == (
        "throttling or slowed clocks does not explain a slow link within a node")


def test_nic_errors_corroborate_a_slow_link_between_nodes_and_keep_its_kind() -> None:
    between = by_hand(IncidentKind.SLOW_LINK, (5, 21), link=(5, 21), confidence=WEAK)
    for metric, severity in (("nic_errors", WARNING), ("ib_link_down", CRITICAL)):
        obs = with_health(("node-2", metric, severity, "mlx5_1"))
        assert correlate_hardware(between, obs, SETTINGS) is None
        kept = with_health_evidence(between, obs, SETTINGS)
        assert kept.kind is IncidentKind.SLOW_LINK
        assert kept.culprit_ranks == (5, 21) and kept.confidence == nudged(WEAK)
        assert kept.evidence[-1].detail.startswith(
            f"corroborates the verdict, kind kept: {severity.value} {metric}=1 on mlx5_1 of "
            "node node-2")
    # Within a node they explain nothing.
    within = by_hand(IncidentKind.SLOW_LINK, (5, 6), link=(5, 6), confidence=STRONG)
    kept = with_health_evidence(within, with_health(("node-0", "nic_errors", WARNING, "mlx5_0")),
                                SETTINGS)
    assert kept.confidence == STRONG and context_of(kept)


# -- hangs and stalls ---------------------------------------------------------------------------


def hung(*, since_s: int = 9, frozen: bool = True,
         samples: tuple[tuple[str, HealthSeverity, float, str, int], ...] = ()) -> Observation:
    """Ranks 0..15 (group tp-1) wait in #7 since `since_s` s; rank 11 (node-1, gpu3) never
    entered it: frozen (silent for 20 s) or alive and busy. Health samples as (metric,
    severity, value, device, offset s from now) on node-1."""
    beats = [beat(r, NOW - S // 5, progress("tp-1", 7, 6, enq_us=NOW - since_s * S))
             for r in range(16) if r != 11]
    beats.append(beat(11, NOW - (20 * S if frozen else S // 5),
                      progress("tp-1", 6, 6, enq_us=NOW - (since_s + 1) * S)))
    snap = snapshot(NOW, 16, beats, {"tp-1": list(range(16))})
    return observe(snap, health=tuple(
        health("node-1", m, NOW + off * S, severity=sev, value=v, device=dev)
        for m, sev, v, dev, off in samples))


def test_an_xid_on_the_hung_ranks_gpu_as_it_stopped_is_hardware() -> None:
    verdict = diagnose_observation(hung(samples=(("xid", CRITICAL, 79.0, "gpu3", -9),)),
                                   SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HARDWARE
    assert verdict.culprit_ranks == (11,) and verdict.culprit_nodes == ("node-1",)
    assert verdict.confidence == CERTAIN
    assert verdict.evidence[0].detail == "critical xid=79 on gpu3 of node node-1, 9.0 s before " \
                                         "the window ended"


@pytest.mark.parametrize(("sample", "why"), [
    (("xid", CRITICAL, 79.0, "gpu5", -9), "on gpu5, not on the culprit's GPU (gpu3 of rank 11)"),
    (("xid", CRITICAL, 79.0, "gpu3", -400), "reported 390 s before the ranks stopped, more "
                                            "than the 30 s slack"),
    (("xid", CRITICAL, 13.0, "gpu3", -9), "an Xid the application's own kernels usually raise "
                                          "does not explain a rank that stopped"),
    (("ecc_correctable", WARNING, 2.0, "gpu3", -9), "a low-grade warning does not explain a "
                                                     "rank that stopped"),
    (("nvlink_errors", WARNING, 40.0, "gpu3", -9), "NVLink errors does not explain a rank that "
                                                    "stopped"),
])
def test_an_irrelevant_sample_leaves_the_hang(sample: tuple[str, HealthSeverity, float, str, int],
                                              why: str) -> None:
    verdict = diagnose_observation(hung(samples=(sample,)), SETTINGS)
    plain = diagnose_observation(hung(), SETTINGS)
    assert verdict is not None and plain is not None
    assert verdict.kind is IncidentKind.HANG
    assert (verdict.culprit_ranks, verdict.confidence) == (plain.culprit_ranks, plain.confidence)
    [context] = context_of(verdict)
    assert context.endswith("; " + why)


def test_a_gpu_fault_long_after_the_stop_began_did_not_cause_it() -> None:
    late = hung(since_s=300, samples=(("xid", CRITICAL, 79.0, "gpu3", -60),))
    verdict = diagnose_observation(late, SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.HANG
    [context] = context_of(verdict)
    assert "s after the ranks stopped, more than the 30 s slack" in context
    soon = diagnose_observation(hung(since_s=300, samples=(("xid", CRITICAL, 79.0, "gpu3", -290),)),
                                SETTINGS)
    assert soon is not None and soon.kind is IncidentKind.HARDWARE


def test_a_stall_turns_hardware_only_for_a_critical_relevant_event() -> None:
    busy = diagnose_observation(hung(frozen=False), SETTINGS)
    assert busy is not None and busy.kind is IncidentKind.STALL
    xid = diagnose_observation(hung(frozen=False, samples=(("xid", CRITICAL, 48.0, "gpu3", -9),)),
                               SETTINGS)
    assert xid is not None and xid.kind is IncidentKind.HARDWARE and xid.culprit_ranks == (11,)
    for sample in (("ecc_uncorrectable", WARNING, 1.0, "gpu3", -9),  # a warning: not enough
                   ("nic_errors", CRITICAL, 500.0, "nic0", -9),  # explains no stop
                   ("throttle", CRITICAL, 1.0, "gpu3", -9)):
        verdict = diagnose_observation(hung(frozen=False, samples=(sample,)), SETTINGS)
        assert verdict is not None and verdict.kind is IncidentKind.STALL
        assert verdict.evidence[: len(busy.evidence)] == busy.evidence
        assert len(context_of(verdict)) == 1


def test_an_xid_localizes_a_hang_that_no_rank_explains() -> None:
    # A GPU fell off the bus inside the collective: every member waits on #7, nobody lags.
    beats = [beat(r, NOW - S // 5, progress("tp-1", 7, 6, enq_us=NOW - 9 * S))
             for r in range(8, 16)]
    beats += [beat(r, NOW - S // 5, progress("tp-0", 7, 7, enq_us=NOW - 9 * S)) for r in range(8)]
    snap = snapshot(NOW, 16, beats, {"tp-1": list(range(8, 16))})
    obs = observe(snap, health=(health("node-1", "xid", NOW - 8 * S, device="gpu5"),))
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HARDWARE
    assert verdict.culprit_nodes == ("node-1",)
    # The rank on gpu5 first, then the rest of the group the stall named.
    assert verdict.culprit_ranks == (13, 8, 9, 10, 11, 12, 14, 15)
    assert verdict.confidence == LIKELY  # the event alone localizes: no higher


def test_a_warning_counts_on_the_most_likely_node_only() -> None:
    beats = [beat(r, NOW - S // 5, progress("tp-1", 7, 6, enq_us=NOW - 9 * S))
             for r in range(0, 16)]
    hang = detect_hang(snapshot(NOW, 16, beats, {"tp-1": list(range(16))}), SETTINGS)
    assert hang is not None and hang.culprit_nodes == ("node-0", "node-1")
    obs = observe(snapshot(NOW, 16, beats),
                  health=(health("node-1", "ecc_uncorrectable", NOW - S, severity=WARNING),))
    assert correlate_hardware(hang, obs, SETTINGS) is None
    first = replace(obs, health=(health("node-0", "ecc_uncorrectable", NOW - S,
                                        severity=WARNING),))
    upgraded = correlate_hardware(hang, first, SETTINGS)
    assert upgraded is not None and upgraded.culprit_nodes == ("node-0",)
    assert upgraded.confidence == WEAK
    critical = replace(obs, health=(health("node-1", "xid", NOW - S),))
    upgraded = correlate_hardware(hang, critical, SETTINGS)
    assert upgraded is not None and upgraded.culprit_nodes == ("node-1",)


def test_a_crash_keeps_its_kind_and_gains_the_health_evidence() -> None:
    exit_ = RankExit(job=JobId("j"), attempt=0, node=NodeId("node-1"), rank=Rank(9), pid=1,
                     exit_code=-6, time_us=NOW - 2 * S)
    snap = replace(snapshot(NOW, 16), exits=(exit_,))
    obs = observe(snap, health=(health("node-1", "xid", NOW - 3 * S, value=79.0, device="gpu1"),
                                health("node-1", "pcie_replays", NOW - 3 * S, value=4.0,
                                       severity=WARNING, device="gpu1")))
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.CRASH
    assert verdict.culprit_ranks == (9,)
    assert [e.fact for e in verdict.evidence] == [Fact.EXIT, Fact.HEALTH, Fact.HEALTH]
    assert verdict.evidence[1].detail.startswith("critical xid=79 on gpu1 of node node-1")
    assert verdict.evidence[2].detail.startswith(CONTEXT + "warning pcie_replays=4 on gpu1")


# -- slow nodes ---------------------------------------------------------------------------------


def slow_node(*samples: tuple[str, str, HealthSeverity], device: str = "gpu3") -> Observation:
    """Every rank of node-2 (ranks 16..23, one TP group) computes 30% slower (degraded NVLink
    stretching its tensor-parallel work): nobody within the node stands out, the node arrives
    late at every data-parallel all-reduce. Health samples as (node, metric, severity), all on
    `device`."""
    slow = {r: 1.3 for r in range(16, 24)}
    a = arrivals(slow=slow, seed=5)
    snap = snapshot(a.end_us, 64, members=groups(8, 64))
    return observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                   health=tuple(health(n, m, a.end_us - S, severity=sev, value=40.0,
                                       device=device)
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


def test_a_slow_node_without_a_relevant_health_event_on_it_is_no_hardware_verdict() -> None:
    assert detect_slow_node(slow_node(), SETTINGS) is None
    assert detect_slow_node(slow_node(("node-5", "nvlink_errors", WARNING)), SETTINGS) is None
    for low in ("ecc_correctable", "pcie_replays"):
        assert detect_slow_node(slow_node(("node-2", low, WARNING)), SETTINGS) is None
    # A NIC would slow the node's links, which the slow-link check judges.
    assert detect_slow_node(slow_node(("node-2", "nic_errors", WARNING)), SETTINGS) is None
    # A power cap of the whole host slows every GPU of it; one GPU's slows one rank only.
    power = detect_slow_node(slow_node(("node-2", "power_cap", WARNING), device="host"), SETTINGS)
    assert power is not None and power.culprit_nodes == ("node-2",)
    assert detect_slow_node(slow_node(("node-2", "power_cap", WARNING)), SETTINGS) is None


def test_a_health_event_without_an_anomaly_is_no_verdict() -> None:
    a = arrivals(seed=3)
    snap = snapshot(a.end_us, 64, members=groups(8, 64))
    obs = observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                  health=(health("node-2", "xid", a.end_us - S),
                          health("node-4", "ecc_correctable", a.end_us - S, severity=WARNING)))
    assert diagnose_observation(obs, SETTINGS) is None


def test_healthy_nodes_with_warnings_are_not_slow_nodes() -> None:
    for seed in range(5):
        a = arrivals(seed=seed)  # three 100-400 ms pauses on random ranks: one window each
        snap = snapshot(a.end_us, 64, members=groups(8, 64))
        samples = tuple(health(f"node-{n}", "throttle", a.end_us - S, severity=WARNING)
                        for n in range(8))
        obs = observe(snap, start_us=a.start_us, ranks=a.ranks, node_windows=a.node_windows,
                      health=samples)
        assert detect_slow_node(obs, SETTINGS) is None
        assert diagnose_observation(obs, SETTINGS) is None


def test_slow_nodes_are_compared_within_groups_that_carried_collectives() -> None:
    # A pipeline group whose heartbeats show no collective (its traffic goes through pair
    # groups) and the pair groups themselves are no comparison; a group nobody reports is kept.
    members = {"tp-0": [0, 1], "pp-0": [0, 8], "pp-0:p2p:0-8": [0, 8], "dp-0": [0, 16]}
    beats = [beat(r, NOW, progress("tp-0", 9, 9, enq_us=NOW), progress("pp-0", 0, 0, enq_us=0))
             for r in (0, 1)]
    snap = snapshot(NOW, 24, beats, members)
    assert sorted(collective_groups(snap, group_members(snap))) == ["dp-0", "tp-0"]
