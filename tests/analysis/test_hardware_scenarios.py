"""Health relevance on simulated jobs: a harmless warning on the culprit's own GPU (or NIC)
keeps the verdict of a straggler, a slow link and a hang; a thermal throttle on the straggler's
GPU and an Xid 79 on the hung rank's GPU make it a hardware verdict. Each test prints how many
of its seeds kept (or got) the right kind."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import pytest

from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import Observation
from tracehound.analysis.sim import SimulatedJob, consecutive_windows, simulate
from tracehound.analysis.verdict import Fact, Verdict
from tracehound.tracing.events import HealthSample, HealthSeverity, IncidentKind
from tracehound.tracing.ids import NodeId

SEEDS = range(8)
RANKS = 64
S = 1_000_000


@cache
def scenario(fault: str, seed: int) -> tuple[SimulatedJob, Observation]:
    """A simulated job and its observation, played once per module for every test."""
    sim = simulate(ranks=RANKS, fault=fault, seed=seed)
    return sim, sim.observation()


def device_of(sim: SimulatedJob, rank: int) -> str:
    """The GPU a rank drives: its index among its node's ranks."""
    node = sim.rank_nodes[rank]
    return f"gpu{rank - min(r for r, n in sim.rank_nodes.items() if n == node)}"


def onset_us(sim: SimulatedJob, obs: Observation) -> int:
    """When the fault struck, or the window's start for one present throughout: the worst
    moment for a harmless warning to appear."""
    return sim.truth.fault_us or obs.window_start_us


def sample(sim: SimulatedJob, rank: int, metric: str, value: float, severity: HealthSeverity,
           at_us: int, detail: str) -> HealthSample:
    """A sample of `rank`'s GPU (of a NIC of its node for NIC metrics)."""
    device = "mlx5_0" if metric.startswith("nic_") else device_of(sim, rank)
    return HealthSample(job=sim.job, node=NodeId(sim.rank_nodes[rank]), device=device,
                        time_us=at_us, source="nvml", metric=metric, value=value,
                        severity=severity, detail=detail)


def right_kind(sim: SimulatedJob, verdict: Verdict | None) -> bool:
    """The verdict is of the injected kind (a rank stuck computing while it reports is a stall
    until the busy grace has passed, as in bench/diagnosis.py)."""
    if verdict is None:
        return False
    truth = sim.truth
    if truth.kind is IncidentKind.HANG and truth.variant == "compute_stuck":
        return verdict.kind in (IncidentKind.HANG, IncidentKind.STALL)
    return verdict.kind is truth.kind


@pytest.mark.parametrize("fault", ["straggler", "slow_link", "hang"])
@pytest.mark.parametrize(("metric", "value", "detail"), [
    ("ecc_correctable", 3.0, "single bit ECC errors"),
    ("pcie_replays", 12.0, "PCIe replay counter increased"),
    ("nic_errors", 20.0, "link-level retransmissions"),
])
def test_a_harmless_warning_on_the_culprits_gpu_keeps_the_verdict(
        fault: str, metric: str, value: float, detail: str) -> None:
    right_before = right_after = 0
    for seed in SEEDS:
        sim, obs = scenario(fault, seed)
        before = diagnose_observation(obs)
        culprit = sim.truth.culprit_ranks[0]
        warning = sample(sim, culprit, metric, value, HealthSeverity.WARNING,
                         onset_us(sim, obs), detail)
        after = diagnose_observation(replace(obs, health=(*obs.health, warning)))
        right_before += right_kind(sim, before)
        right_after += right_kind(sim, after)
        assert (before is None) == (after is None), seed
        if before is None or after is None:
            continue
        assert (after.kind, after.culprit_ranks) == (before.kind, before.culprit_ranks), seed
        if sim.rank_nodes[culprit] not in before.culprit_nodes:
            assert after.confidence == before.confidence, seed
            continue
        quoted = [e.detail for e in after.evidence if e.fact is Fact.HEALTH
                  and f" {metric}=" in e.detail]
        assert quoted, seed
        if metric == "nic_errors" and after.kind is IncidentKind.SLOW_LINK:
            # NIC errors on a slow link's node: its kind kept, one notch more sure.
            assert after.confidence >= before.confidence, seed
            assert any(q.startswith("corroborates the verdict, kind kept: ") for q in quoted)
        else:
            # Quoted as context, and said to change nothing.
            assert after.confidence == before.confidence, seed
            assert all(q.startswith("context, does not change the verdict: ") for q in quoted)
    print(f"\n{fault} + {metric} warning on the culprit's device: right kind in {right_after} of "
          f"{len(SEEDS)} seeds (without it: {right_before})")
    assert right_after == right_before


def event_on_the_culprit_makes_hardware(fault: str, metric: str, value: float,
                                        severity: HealthSeverity, after_onset_us: int,
                                        detail: str) -> tuple[int, int]:
    """Over the seeds whose `fault` was seen: a sample on the culprit's GPU `after_onset_us`
    after the fault's onset must make the verdict hardware on that culprit. Returns (made
    hardware, seen)."""
    found = judged = 0
    for seed in SEEDS:
        sim, obs = scenario(fault, seed)
        if not right_kind(sim, diagnose_observation(obs)):
            continue  # the fault not seen: nothing for the sample to explain
        judged += 1
        culprit = sim.truth.culprit_ranks[0]
        event = sample(sim, culprit, metric, value, severity,
                       onset_us(sim, obs) + after_onset_us, detail)
        after = diagnose_observation(replace(obs, health=(*obs.health, event)))
        assert after is not None and after.kind is IncidentKind.HARDWARE, seed
        assert after.culprit_ranks[0] == culprit, seed
        found += 1
    return found, judged


def test_a_thermal_throttle_on_the_stragglers_gpu_is_hardware() -> None:
    found, judged = event_on_the_culprit_makes_hardware(
        "straggler", "throttle", 1.0, HealthSeverity.WARNING, 0,
        "HW thermal slowdown (clocks event reason 0x40)")
    print(f"\nstraggler + thermal throttle on its GPU: hardware in {found} of {judged} seeds "
          f"whose straggler was seen ({len(SEEDS)} seeds)")
    assert judged >= len(SEEDS) // 2
    assert found == judged


def test_an_xid_79_on_the_hung_ranks_gpu_is_hardware() -> None:
    found, judged = event_on_the_culprit_makes_hardware(
        "hang", "xid", 79.0, HealthSeverity.CRITICAL, S // 5,
        "Xid 79: GPU has fallen off the bus")
    print(f"\nhang + Xid 79 on the hung rank's GPU: hardware in {found} of {judged} seeds whose "
          f"hang was seen ({len(SEEDS)} seeds)")
    assert judged >= len(SEEDS) // 2
    assert found == judged


def test_a_throttled_gpu_too_slightly_slow_for_a_straggler_verdict_is_hardware() -> None:
    """Thermal throttles of 1.1-1.8x on field jobs (`detect_throttled_gpu`): where the timing
    alone names no straggler, the GPU's throttle report and its rank's measured excess compute
    together make a hardware verdict on that rank."""
    found = led = 0
    for seed in range(12):
        sim = simulate(ranks=RANKS, fault="hardware", variant="thermal", seed=100 + seed)
        obs = sim.observation()
        verdict = diagnose_observation(obs)
        right = (verdict is not None and verdict.kind is IncidentKind.HARDWARE
                 and verdict.culprit_ranks[0] == sim.truth.culprit_ranks[0])
        found += right
        led += right and "on the GPU of a slow rank" in verdict.summary
    print(f"\nthermal throttles named as hardware: {found} of 12 ({led} from the GPU's report)")
    assert found >= 9 and led >= 1


def test_a_power_cap_report_on_a_gpu_at_full_speed_changes_nothing() -> None:
    """A clock event healthy fleets report all the time, on healthy jobs' GPUs (each rank's in
    turn): no verdict, since no rank computes measurably longer than its peers."""
    for seed in range(4):
        sim = simulate(ranks=RANKS, fault=None, seed=200 + seed)
        obs = sim.observation()
        assert diagnose_observation(obs) is None, seed
        for rank in range(0, RANKS, 7):
            cap = sample(sim, rank, "clocks_event_reasons", 4.0, HealthSeverity.WARNING,
                         obs.window_start_us + S, "SW power cap (clocks event reason 0x4)")
            assert diagnose_observation(replace(obs, health=(*obs.health, cap))) is None, (
                seed, rank)


def test_an_xid_reported_once_explains_the_stop_in_every_later_window() -> None:
    """An Xid 79 is reported once, when its rank stops; the windows after it no longer hold it,
    yet the rank stays stopped. Each observation holds the events of the minutes before its
    window, so every window after the stop still names the hardware fault, the last ones with
    the Xid seconds to tens of seconds before them."""
    windows = list(consecutive_windows(ranks=RANKS, seed=549665576, count=6, window_s=10.0,
                                       fault="hardware", skew_ms=20.0))
    struck = [w for w in windows if w.truth.kind is not None]
    assert struck and struck[0].truth.variant == "xid_hang"
    before_window = 0
    for w in struck:
        obs = w.observation()
        verdict = diagnose_observation(obs)
        assert verdict is not None and verdict.kind is IncidentKind.HARDWARE
        assert verdict.culprit_ranks[0] == w.truth.culprit_ranks[0]
        xid = [h for h in obs.health if h.metric == "xid"]
        assert len(xid) == 1
        before_window += xid[0].time_us < obs.window_start_us
    assert before_window >= 2
