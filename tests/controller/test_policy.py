"""Recovery planning and node assignment, with exact expectations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tracehound.analysis.confidence import LIKELY, STRONG, TYPICAL, WEAK
from tracehound.analysis.verdict import Basis, Verdict
from tracehound.controller.orchestrators.port import AttemptPlan, NodePool, NotEnoughNodes
from tracehound.controller.policy.recovery import (
    SOFT_KINDS,
    KindRule,
    PlannedAction,
    PolicySettings,
    Response,
    Uncertain,
    plan_recovery,
    smallest_group_nodes,
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


# -- limits, backoff, over-eviction and the rule behind every action -------------------------


def rules_of(plan: tuple[PlannedAction, ...]) -> list[str]:
    return [a.rule for a in plan]


def test_restart_delay_doubles_from_the_backoff_up_to_its_cap() -> None:
    settings = PolicySettings(restart_backoff_s=10.0, restart_backoff_max_s=60.0)
    assert [settings.restart_delay_s(done) for done in range(5)] == [10.0, 20.0, 40.0, 60.0, 60.0]
    assert settings.restart_delay_s(100_000) == 60.0
    assert [PolicySettings().restart_delay_s(done) for done in (0, 1, 50)] == [0.0, 0.0, 0.0]


def test_restarts_per_hour_used_up_stop_and_give_up_naming_the_limit() -> None:
    settings = PolicySettings(max_restarts=10, max_restarts_per_hour=2)
    plan = plan_recovery(verdict(attempt=2), restarts_done=2, healthy_spares=1,
                         settings=settings, restarts_last_hour=2)
    assert [a.kind for a in plan] == [ActionKind.STOP_JOB, ActionKind.GIVE_UP]
    assert rules_of(plan) == ["max_restarts_per_hour"] * 2
    assert plan[1].reason.startswith("max_restarts_per_hour: 2 of 2 restarts used in the last "
                                     "hour")
    below = plan_recovery(verdict(attempt=2), restarts_done=2, healthy_spares=1,
                          settings=settings, restarts_last_hour=1)
    assert kinds(below) == [("stop_job", "attempt 2"), ("isolate_node", "node-1"),
                            ("restart", "attempt 3")]
    ran_out = plan_recovery(verdict(attempt=3), restarts_done=3, healthy_spares=1,
                            settings=PolicySettings(max_restarts=3))
    assert rules_of(ran_out) == ["max_restarts"] * 2
    assert ran_out[1].reason == "3 restarts used of 3 (max_restarts)"


def test_isolations_used_up_restart_at_once_without_evicting_naming_the_limit() -> None:
    two = verdict(nodes=("node-0", "node-1"))
    per_job = PolicySettings(max_isolations=3)
    assert ("isolate_node", "node-1") in kinds(plan_recovery(
        two, restarts_done=0, healthy_spares=2, settings=per_job, isolations_done=1))
    plan = plan_recovery(two, restarts_done=0, healthy_spares=2, settings=per_job,
                         isolations_done=2)
    assert kinds(plan) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert rules_of(plan) == ["max_isolations"] * 2
    assert plan[1].reason == ("max_isolations: 2 of 3 node isolations used in this job, 2 more "
                              "needed; nobody evicted; resume from the latest complete checkpoint")
    per_hour = PolicySettings(max_isolations_per_hour=1)
    plan = plan_recovery(verdict(), restarts_done=0, healthy_spares=0, settings=per_hour,
                         isolations_last_hour=1)
    # no spare either: with nobody to evict there is nothing to wait for
    assert kinds(plan) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert rules_of(plan) == ["max_isolations_per_hour"] * 2
    assert plan[1].reason.startswith("max_isolations_per_hour: 1 of 1 node isolations used in "
                                     "the last hour, 1 more needed; nobody evicted")


# a hang rule that acts from LIKELY and evicts from STRONG, and a group of two nodes
_CAREFUL = {**PolicySettings().rules,
            IncidentKind.HANG: KindRule(act_from=LIKELY, isolate_from=STRONG, why="test")}
_GROUP = ("node-0", "node-1")


def over_evicting(**changes: object) -> PolicySettings:
    return replace(PolicySettings(rules=_CAREFUL, uncertain=Uncertain.ISOLATE_GROUP), **changes)


@pytest.mark.parametrize("confidence", [0.8, WEAK])
def test_isolate_group_evicts_the_culprits_smallest_group_at_once(confidence: float) -> None:
    """Below isolate_from (0.8) and below act_from (WEAK, a running job): both evict the group
    at once instead of restarting evicting nobody or watching."""
    plan = plan_recovery(verdict(confidence=confidence), restarts_done=0, healthy_spares=2,
                         settings=over_evicting(), group_nodes=_GROUP)
    assert kinds(plan) == [("stop_job", "attempt 0"), ("isolate_node", "node-0"),
                           ("isolate_node", "node-1"), ("restart", "attempt 1")]
    assert rules_of(plan) == ["uncertain"] * 4
    threshold = STRONG if confidence >= LIKELY else LIKELY
    assert plan[1].reason == (f"hang: confidence {confidence:.2f} is below {threshold:.2f}: "
                              "every node of the smallest group holding rank 3 is evicted "
                              "(uncertain: isolate_group)")


def test_isolate_group_with_too_few_spares_is_the_same_as_watch() -> None:
    settings = over_evicting()
    watch = replace(settings, uncertain=Uncertain.WATCH)
    between = verdict(confidence=0.8)
    plan = plan_recovery(between, restarts_done=0, healthy_spares=1, settings=settings,
                         group_nodes=_GROUP)
    assert kinds(plan) == kinds(plan_recovery(between, restarts_done=0, healthy_spares=1,
                                              settings=watch, group_nodes=_GROUP))
    assert kinds(plan) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert rules_of(plan) == ["rules.hang.isolate_from"] * 2
    assert plan[1].reason.startswith(
        "not sure enough to evict (confidence 0.80, hang evicts from 0.85) (uncertain: "
        "isolate_group, but the 2 node(s) of the smallest group holding rank 3 exceed the 1 "
        "spare(s) left); nobody evicted")
    unsure = verdict(confidence=WEAK)
    plan = plan_recovery(unsure, restarts_done=0, healthy_spares=1, settings=settings,
                         group_nodes=_GROUP)
    assert kinds(plan) == [("observe", "node-1")]
    assert rules_of(plan) == ["rules.hang.act_from"]
    later = plan_recovery(unsure, restarts_done=0, healthy_spares=1, settings=settings,
                          group_nodes=_GROUP, watched_s=settings.watch_s)
    assert kinds(later) == [("stop_job", "attempt 0"), ("restart", "attempt 1")]
    assert rules_of(later) == ["watch_s"] * 2


def test_isolate_group_within_the_isolation_limits_only() -> None:
    settings = over_evicting(max_isolations=2)
    plan = plan_recovery(verdict(confidence=WEAK), restarts_done=0, healthy_spares=2,
                         settings=settings, group_nodes=_GROUP, isolations_done=1)
    assert kinds(plan) == [("observe", "node-1")]
    assert "isolate_group, but max_isolations: 1 of 2 node isolations used" in plan[0].reason


@pytest.mark.parametrize("case", ["unlocalized", "busy", "never evicts", "no group"])
def test_isolate_group_never_evicts_where_watch_would_not_evict(case: str) -> None:
    v, settings = verdict(confidence=WEAK), over_evicting()
    if case == "unlocalized":
        v = verdict(basis=Basis.UNLOCALIZED, confidence=0.3)
    elif case == "busy":
        v = replace(verdict(), basis=Basis.BUSY_TIMEOUT, confidence=0.8)
    elif case == "never evicts":
        v = replace(verdict(confidence=0.8), kind=IncidentKind.CRASH, basis=Basis.EXIT_STATUS)
        settings = replace(settings, rules={
            **settings.rules, IncidentKind.CRASH: KindRule(isolate_from=None, why="test")})
    group = () if case == "no group" else _GROUP
    for watched in (0.0, settings.watch_s):
        plan = plan_recovery(v, restarts_done=0, healthy_spares=5, settings=settings,
                             group_nodes=group, watched_s=watched)
        watching = plan_recovery(v, restarts_done=0, healthy_spares=5, watched_s=watched,
                                 settings=replace(settings, uncertain=Uncertain.WATCH))
        assert not any(a.kind is ActionKind.ISOLATE_NODE for a in plan)
        assert kinds(plan) == kinds(watching)
        assert rules_of(plan) == rules_of(watching)


def test_group_nodes_are_ignored_unless_the_policy_over_evicts() -> None:
    for confidence in (0.95, 0.8, WEAK):
        v = verdict(confidence=confidence)
        settings = PolicySettings(rules=_CAREFUL)
        assert plan_recovery(v, restarts_done=0, healthy_spares=2, settings=settings,
                             group_nodes=_GROUP) == plan_recovery(
            v, restarts_done=0, healthy_spares=2, settings=settings)


def test_every_action_names_the_rule_that_decided_it() -> None:
    crash_tie = replace(verdict(confidence=WEAK, nodes=("node-0", "node-1")),
                        kind=IncidentKind.CRASH, basis=Basis.EXIT_STATUS)
    crash_spares = replace(crash_tie, confidence=0.95)
    # (verdict, healthy spares, restarts done, watched for, the rules of its plan)
    cases: list[tuple[Verdict, int, int, float, list[str]]] = [
        (replace(verdict(), kind=IncidentKind.STALL), 2, 0, 0.0, ["rules.stall.response"]),
        (replace(verdict(), kind=IncidentKind.STRAGGLER, basis=Basis.ARRIVAL_LATENESS), 2, 0,
         0.0, ["rules.straggler.repeats"]),
        (replace(verdict(), kind=IncidentKind.MISMATCH, basis=Basis.MAJORITY_VOTE), 2, 0, 0.0,
         ["rules.mismatch.response"] * 2),
        (verdict(), 2, 0, 0.0, ["rules.hang.isolate_from"] * 3),
        (verdict(confidence=WEAK), 2, 0, 0.0, ["rules.hang.act_from"]),
        (verdict(confidence=WEAK), 2, 0, 600.0, ["watch_s"] * 2),
        (verdict(nodes=("node-0", "node-1")), 1, 0, 0.0, ["watch_s"]),
        (verdict(nodes=("node-0", "node-1")), 1, 0, 600.0, ["watch_s"] * 2),
        (crash_tie, 2, 0, 0.0, ["rules.crash.act_from"] * 2),
        (crash_spares, 1, 0, 0.0, ["rules.crash.isolate_from"] * 2),
        (replace(verdict(), basis=Basis.BUSY_TIMEOUT, confidence=0.8), 2, 0, 0.0,
         ["rules.hang.act_from"] * 2),
        (verdict(attempt=3), 2, 3, 0.0, ["max_restarts"] * 2),
    ]
    for v, spares, done, watched, expected in cases:
        plan = plan_recovery(v, restarts_done=done, healthy_spares=spares, watched_s=watched,
                             settings=PolicySettings())
        assert rules_of(plan) == expected, (v.kind, v.confidence, spares, watched, plan)


def test_smallest_group_nodes_picks_the_fewest_nodes_then_the_fewest_ranks() -> None:
    rank_nodes = {r: f"node-{r // 2}" for r in range(8)}  # two ranks per node
    world = tuple(range(8))
    tensor = [(0, 1), (2, 3), (4, 5), (6, 7)]           # within a node
    pipeline = [(0, 2, 4, 6), (1, 3, 5, 7)]             # across the four nodes
    halves = [(0, 1, 2, 3), (4, 5, 6, 7)]               # two nodes each
    groups = [world, *pipeline, *halves, *tensor]
    assert smallest_group_nodes((3,), groups, rank_nodes) == ("node-1",)
    assert smallest_group_nodes((1, 2), groups, rank_nodes) == ("node-0", "node-1")
    assert smallest_group_nodes((1, 7), groups, rank_nodes) == ("node-0", "node-1", "node-2",
                                                                "node-3")
    # same nodes, fewer ranks wins: (0, 2) spans node-0 and node-1 like the half (0, 1, 2, 3)
    assert smallest_group_nodes((0, 2), [(0, 1, 2, 3), (2, 0)], rank_nodes) == ("node-0",
                                                                              "node-1")
    assert smallest_group_nodes((3, 9), groups, rank_nodes) == ()
    assert smallest_group_nodes((), groups, rank_nodes) == ()
    with pytest.raises(ValueError, match="rank 8 of a process group"):
        smallest_group_nodes((3,), [(2, 3, 8)], rank_nodes)
