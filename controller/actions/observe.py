"""Observe: the watcher's default action adapter. It never touches the job.

A plan of the policy that only observes is passed on as it is. A plan that would stop, evict or
restart becomes one `observe` step that says what the policy decided and that nothing was done,
so the incident shows what a supervisor would have done and why (its rule), and the dashboard
and `tracehound incidents` show that it was not done.
"""

from __future__ import annotations

from typing import Final

from tracehound.analysis.verdict import Verdict
from tracehound.controller.actions.port import Outcome
from tracehound.controller.policy.recovery import PlannedAction, observe_only
from tracehound.tracing.events import ActionKind, Incident

NOT_ACTED: Final = "not acted on: "
"""How the detail of an `observe` step that stands for a plan not carried out begins (a watcher
started again tells such an incident, whose episode was dealt with, by it)."""


def plan_words(policy: tuple[PlannedAction, ...]) -> str:
    """A plan's steps in words: "stop_job attempt 0, isolate_node node-1, restart attempt 1"."""
    return ", ".join(f"{s.kind.value} {s.target}" for s in policy)


def unacted(policy: tuple[PlannedAction, ...], why: str) -> PlannedAction:
    """One `observe` step standing for a plan that is not carried out, with the plan's rule."""
    acting = [s for s in policy if s.kind is not ActionKind.OBSERVE]
    first = acting[0] if acting else policy[0]
    return PlannedAction(
        kind=ActionKind.OBSERVE, target=first.target,
        reason=f"{NOT_ACTED}the policy's plan is {plan_words(policy)} ({first.reason}); {why}",
        rule=first.rule)


class ObserveActions:
    """Records what the policy would do; does nothing."""

    @property
    def kinds(self) -> frozenset[ActionKind]:
        return frozenset()

    def describe(self) -> str:
        return "observe: incidents and what the policy would do are recorded, the job is " \
               "never touched"

    def check(self) -> None:
        return None

    def plan(self, verdict: Verdict,
             policy: tuple[PlannedAction, ...]) -> tuple[PlannedAction, ...]:
        if not policy or observe_only(policy):
            return policy
        return (unacted(policy, "this watcher only observes (--slurm acts through Slurm)"),)

    def take(self, step: PlannedAction, incident: Incident) -> Outcome:
        return Outcome(True, step.reason)

    def close(self) -> None:
        return None
