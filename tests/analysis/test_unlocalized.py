"""Naming everyone is not a localization: when every member of a group is inside one collective
with agreeing calls, and none lags, is frozen, is stuck elsewhere or disagrees, the verdict is an
unlocalized hang. It names no culprit rank, lists the group's nodes as suspects (the network, the
collective library) and says what it ruled out; the policy only watches it (and restarts without
evicting anyone once it has lasted the busy grace); the dashboard and `tracehound diagnose` say
it is not localized.

Negative controls as the field's dumps show them: a gather's root waiting with its non-roots,
and an all_to_all with equal splits, everyone inside.
"""

from __future__ import annotations

import msgspec
import pytest
from observation_builders import T0, S, beat, health, observe, progress, snapshot

from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.verdict import Basis, Fact, Verdict
from tracehound.controller.cli.explain import format_verdict
from tracehound.controller.policy.recovery import PolicySettings, plan_recovery
from tracehound.tracing.events import HealthSeverity, Incident, IncidentKind
from tracehound.ui import data

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S
SINCE = NOW - 8 * S


def inside(op: str, ranks: int = 16, nbytes: int = 4096, group: str = "dp-1") -> Verdict:
    """Every rank of `group` (all of the job) inside `op` #41 for 8 s, the same call on each."""
    call = msgspec.structs.replace(progress(group, 41, 40, enq_us=SINCE, op=op),
                                   pending_nbytes=nbytes, pending_dtype="float32")
    beats = [beat(r, NOW - S // 5, call) for r in range(ranks)]
    verdict = diagnose_observation(
        observe(snapshot(NOW, ranks, beats, {group: list(range(ranks))})), SETTINGS)
    assert verdict is not None
    return verdict


@pytest.mark.parametrize("op", ["all_reduce", "gather", "all_to_all_single"])
def test_everyone_inside_one_call_names_no_culprit_and_the_nodes_as_suspects(op: str) -> None:
    verdict = inside(op)
    assert verdict.kind is IncidentKind.HANG
    assert verdict.basis is Basis.UNLOCALIZED
    assert verdict.culprit_ranks == () and verdict.culprit_nodes == ()
    assert verdict.group == "dp-1"
    suspects = [e for e in verdict.evidence if e.fact is Fact.SUSPECT]
    assert [(e.node, e.rank, e.value) for e in suspects] == [("node-0", 0, 8.0),
                                                             ("node-1", 8, 8.0)]
    assert "not a culprit, a suspect" in suspects[0].detail
    assert "no culprit rank: none lags, is frozen, is stuck elsewhere or called the collective " \
           "differently (op, size, dtype)" in verdict.summary
    assert verdict.summary.endswith("Suspect the network or the collective library of group "
                                    "dp-1, on nodes node-0, node-1")


def test_with_an_xid_on_one_gpu_the_hang_is_hardware_on_that_rank() -> None:
    call = msgspec.structs.replace(progress("dp-1", 41, 40, enq_us=SINCE), pending_nbytes=64,
                                   pending_dtype="float32")
    beats = [beat(r, NOW - S // 5, call) for r in range(16)]
    xid = health("node-1", "xid", SINCE + S // 5, value=79.0, device="gpu3",
                 severity=HealthSeverity.CRITICAL, detail="Xid 79: GPU has fallen off the bus")
    verdict = diagnose_observation(
        observe(snapshot(NOW, 16, beats, {"dp-1": list(range(16))}), health=(xid,)), SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.HARDWARE, verdict
    # the GPU's rank first, then the other ranks of its node
    assert verdict.culprit_ranks[0] == 11 and verdict.culprit_nodes == ("node-1",)
    assert set(verdict.culprit_ranks) == set(range(8, 16))


def test_the_policy_watches_it_and_later_restarts_evicting_nobody() -> None:
    verdict = inside("all_reduce")
    settings = PolicySettings(watch_s=600.0)
    now = plan_recovery(verdict, restarts_done=0, healthy_spares=4, settings=settings)
    assert [(a.kind.value, a.target) for a in now] == [("observe", "j")]
    assert now[0].reason.startswith("not sure enough to evict")
    later = plan_recovery(verdict, restarts_done=0, healthy_spares=4, settings=settings,
                          watched_s=600.0)
    assert [a.kind.value for a in later] == ["stop_job", "restart"]
    assert "nobody evicted" in later[1].reason


def test_the_dashboard_and_diagnose_say_it_is_not_localized() -> None:
    verdict = inside("all_reduce")
    incident = Incident(
        job=verdict.job, incident_id="j/0/1", attempt=0, detected_at_us=NOW,
        kind=verdict.kind.value, culprit_ranks=verdict.culprit_ranks,
        culprit_nodes=verdict.culprit_nodes, confidence=verdict.confidence,
        summary=verdict.summary, verdict_json=verdict.to_json(),
    )
    assert data.suspects_of(incident) == ["node-0", "node-1"]
    assert "hang: not localized, no culprit rank; suspects node-0, node-1 (confidence" in (
        data.incident_line(incident))
    assert "not localized, no culprit rank; suspects node-0, node-1" in data.incident_label(
        incident)
    text = format_verdict({**verdict.to_dict(), "ranks_seen": 16})
    assert "  culprits: none, not localized; suspects: nodes ['node-0', 'node-1']" in text
