"""Recovery planning and node assignment, with exact expectations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tracehound.analysis.confidence import LIKELY, STRONG, TYPICAL, WEAK
from tracehound.analysis.verdict import Basis, Verdict
from tracehound.controller.orchestrator import AttemptPlan, NodePool, NotEnoughNodes
from tracehound.controller.policy import (
    SOFT_KINDS,
    KindRule,
    PolicySettings,
    Response,
    plan_recovery,
)
from tracehound.tracing.events import ActionKind, IncidentKind
from tracehound.tracing.ids import JobId, NodeId


def verdict(*, basis: Basis = Basis.CONTROL_DEPENDENCY, confidence: float = 0.95,
            nodes: tuple[str, ...] = ("node-1",), attempt: int = 0) -> Verdict:
    return Verdict(
        job=JobId("j"), attempt=attempt, kind=IncidentKind.HANG, culprit_ranks=(3,),
        culprit_nodes=nodes, confidence=confidence, basis=basis, summary="rank 3 hangs",
        evidence=(), observed_at_us=0,
    )


def kinds(plan: tuple) -> list[tuple[str, str]]:  # type: ignore[type-arg]
    return [(a.kind.value, a.target) for a in plan]


def test_localized_fault_isolates_the_node_then_restarts() -> None:
    plan = plan_recovery(verdict(), restarts_done=0, healthy_spares=1, settings=PolicySettings())
    assert kinds(plan) == [("stop_job", "attempt 0"), ("isolate_node", "node-1"),
                           ("restart", "attempt 1")]


def test_unsure_verdict_on_a_running_job_is_watched_then_restarts_without_evicting() -> None:
    settings = PolicySettings(watch_s=600.0)
    for v in (verdict(basis=Basis.UNLOCALIZED), verdict(confidence=0.4)):
        plan = plan_recovery(v, restarts_done=0, healthy_spares=1, settings=settings)
        assert kinds(plan) == [("observe", "node-1")]
        assert plan[0].reason.startswith("not sure enough to evict")
        later = plan_recovery(v, restarts_done=0, healthy_spares=1, settings=settings,
                              watched_s=600.0)
        assert kinds(later) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
        assert "nobody evicted" in later[1].reason


def test_too_few_spares_never_gives_up_on_a_running_job() -> None:
    two = verdict(nodes=("node-0", "node-1"))
    plan = plan_recovery(two, restarts_done=0, healthy_spares=1, settings=PolicySettings())
    assert kinds(plan) == [("observe", "node-0, node-1")]
    assert plan[0].reason.startswith("2 node(s) to isolate but only 1 spare(s) left: watching")
    later = plan_recovery(two, restarts_done=0, healthy_spares=1, settings=PolicySettings(),
                          watched_s=601.0)
    assert kinds(later) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]


def test_a_crash_with_too_few_spares_restarts_at_once_without_evicting() -> None:
    crash = replace(verdict(nodes=("node-0", "node-1")), kind=IncidentKind.CRASH,
                    basis=Basis.EXIT_STATUS)
    plan = plan_recovery(crash, restarts_done=0, healthy_spares=1, settings=PolicySettings())
    assert kinds(plan) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert "only 1 spare(s) left; nobody evicted" in plan[1].reason


def test_gives_up_only_when_restarts_run_out() -> None:
    plan = plan_recovery(verdict(attempt=3), restarts_done=3, healthy_spares=1,
                         settings=PolicySettings(max_restarts=3))
    assert [a.kind for a in plan] == [ActionKind.STOP_JOB, ActionKind.GIVE_UP]


def test_a_stall_is_only_observed_and_a_busy_timeout_restarts_without_evicting() -> None:
    stall = replace(verdict(), kind=IncidentKind.STALL)
    for watched in (0.0, 10_000.0):
        plan = plan_recovery(stall, restarts_done=0, healthy_spares=1, settings=PolicySettings(),
                             watched_s=watched)
        assert kinds(plan) == [("observe", "node-1")]
    busy = replace(verdict(), basis=Basis.BUSY_TIMEOUT, confidence=0.8)
    plan = plan_recovery(busy, restarts_done=0, healthy_spares=0, settings=PolicySettings())
    assert kinds(plan) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert plan[1].reason.startswith("the rank was alive and busy")


def test_a_spare_takes_the_isolated_nodes_place_and_others_keep_theirs() -> None:
    pool = NodePool([NodeId(f"node-{i}") for i in range(4)])
    assert pool.assign(2) == ("node-0", "node-1")
    assert pool.healthy_spares() == ["node-2", "node-3"]
    pool.isolate(NodeId("node-0"), "hang")
    assert pool.assign(2) == ("node-2", "node-1")
    pool.isolate(NodeId("node-1"), "crash")
    assert pool.assign(2) == ("node-2", "node-3")
    pool.isolate(NodeId("node-3"), "crash")
    with pytest.raises(NotEnoughNodes, match="need 2 healthy nodes, have 1"):
        pool.assign(2)


def test_attempt_plan_maps_ranks_to_nodes_like_torchrun() -> None:
    plan = AttemptPlan(job=JobId("j"), attempt=0, nodes=(NodeId("a"), NodeId("b")),
                       nproc_per_node=2, command=("python", "x.py"))
    assert plan.world_size == 4
    assert plan.rank_nodes() == {0: "a", 1: "a", 2: "b", 3: "b"}


def test_soft_faults_are_observed_first_and_acted_on_when_seen_again() -> None:
    slow = Verdict(
        job=JobId("j"), attempt=0, kind=IncidentKind.STRAGGLER, culprit_ranks=(5,),
        culprit_nodes=("node-1",), confidence=0.9, basis=Basis.ARRIVAL_LATENESS,
        summary="rank 5 arrives last", evidence=(), observed_at_us=0,
    )
    first = plan_recovery(slow, restarts_done=0, healthy_spares=1, settings=PolicySettings())
    assert kinds(first) == [("observe", "node-1")]
    again = plan_recovery(slow, restarts_done=0, healthy_spares=1, settings=PolicySettings(),
                          times_seen=2)
    assert kinds(again) == [("stop_job", "attempt 0"), ("isolate_node", "node-1"),
                            ("restart", "attempt 1")]


def test_a_mismatch_is_the_programs_fault_and_is_not_restarted() -> None:
    bug = Verdict(
        job=JobId("j"), attempt=0, kind=IncidentKind.MISMATCH, culprit_ranks=(2,),
        culprit_nodes=("node-1",), confidence=0.95, basis=Basis.MAJORITY_VOTE,
        summary="rank 2 called broadcast where 3 ranks called all_reduce", evidence=(),
        observed_at_us=0,
    )
    plan = plan_recovery(bug, restarts_done=0, healthy_spares=1, settings=PolicySettings())
    assert [a.kind for a in plan] == [ActionKind.STOP_JOB, ActionKind.GIVE_UP]
    assert "training program" in plan[1].reason


# A basis each kind is ordinarily found by (the policy reads only UNLOCALIZED and BUSY_TIMEOUT).
_BASIS = {
    IncidentKind.HARDWARE: Basis.HEALTH_CORRELATION,
    IncidentKind.CRASH: Basis.EXIT_STATUS,
    IncidentKind.STRAGGLER: Basis.ARRIVAL_LATENESS,
    IncidentKind.SLOW_LINK: Basis.LINK_LATENCY,
    IncidentKind.NODE_OUTLIER: Basis.OUTLIER_MODEL,
    IncidentKind.SILENT_HANG: Basis.MAJORITY_VOTE,
}


def of_kind(kind: IncidentKind, confidence: float,
            nodes: tuple[str, ...] = ("node-1",)) -> Verdict:
    return replace(verdict(confidence=confidence, nodes=nodes), kind=kind,
                   basis=_BASIS.get(kind, Basis.CONTROL_DEPENDENCY))


def test_every_kind_has_a_rule_and_a_typical_confidence() -> None:
    settings = PolicySettings()
    assert set(settings.rules) == set(IncidentKind) == set(TYPICAL)
    assert all(r.why for r in settings.rules.values())
    assert {k for k in IncidentKind if settings.repeated(k)} == SOFT_KINDS == {
        IncidentKind.STRAGGLER, IncidentKind.SLOW_LINK, IncidentKind.NODE_OUTLIER}


@pytest.mark.parametrize("kind", [k for k, r in PolicySettings().rules.items() if r.isolates])
def test_every_kind_that_isolates_does_so_at_its_typical_confidence(kind: IncidentKind) -> None:
    """The analysis' ordinary verdict of each kind reaches its rule's thresholds: after the
    repeats the rule asks for, it stops the job and evicts the culprit's node at once."""
    settings = PolicySettings()
    rule = settings.rule(kind)
    assert rule.isolate_from is not None
    assert TYPICAL[kind] >= rule.isolate_from >= rule.act_from
    plan = plan_recovery(of_kind(kind, TYPICAL[kind]), restarts_done=0, healthy_spares=1,
                         settings=settings, times_seen=rule.repeats)
    assert kinds(plan) == [("stop_job", "attempt 0"), ("isolate_node", "node-1"),
                           ("restart", "attempt 1")]


def test_kinds_that_never_isolate_say_why() -> None:
    rules = PolicySettings().rules
    assert {k for k, r in rules.items() if not r.isolates} == {
        IncidentKind.MISMATCH, IncidentKind.STALL}
    assert rules[IncidentKind.MISMATCH].response is Response.GIVE_UP
    assert rules[IncidentKind.STALL].response is Response.OBSERVE


def test_one_outlier_node_is_evicted_once_seen_again_several_are_only_watched() -> None:
    settings = PolicySettings()
    repeats = settings.rule(IncidentKind.NODE_OUTLIER).repeats
    one = of_kind(IncidentKind.NODE_OUTLIER, LIKELY)
    again = plan_recovery(one, restarts_done=0, healthy_spares=1, settings=settings,
                          times_seen=repeats)
    assert ("isolate_node", "node-1") in kinds(again)
    several = of_kind(IncidentKind.NODE_OUTLIER, WEAK, nodes=("node-1", "node-2"))
    plan = plan_recovery(several, restarts_done=0, healthy_spares=2, settings=settings,
                         times_seen=repeats)
    assert kinds(plan) == [("observe", "node-1, node-2")]
    later = plan_recovery(several, restarts_done=0, healthy_spares=2, settings=settings,
                          times_seen=repeats, watched_s=settings.watch_s)
    assert kinds(later) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]


def test_crash_ties_restart_at_once_without_evicting() -> None:
    tie = of_kind(IncidentKind.CRASH, WEAK, nodes=("node-0", "node-1"))
    plan = plan_recovery(tie, restarts_done=0, healthy_spares=2, settings=PolicySettings())
    assert kinds(plan) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert "nobody evicted" in plan[1].reason


def test_between_act_and_isolate_the_job_restarts_at_once_evicting_nobody() -> None:
    rules = {**PolicySettings().rules,
             IncidentKind.HANG: KindRule(act_from=LIKELY, isolate_from=STRONG, why="test")}
    settings = PolicySettings(rules=rules)
    plan = plan_recovery(verdict(confidence=0.8), restarts_done=0, healthy_spares=1,
                         settings=settings)
    assert kinds(plan) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert plan[1].reason.startswith("not sure enough to evict (confidence 0.80, hang evicts "
                                     "from 0.85); nobody evicted")
    sure = plan_recovery(verdict(confidence=STRONG), restarts_done=0, healthy_spares=1,
                         settings=settings)
    assert ("isolate_node", "node-1") in kinds(sure)
