"""Recovery policy: what to do about a verdict. Pure: it returns the plan, the supervisor acts.

Hard evidence (a rank that died, a rank others provably wait on) isolates the culprit's node at
once; a verdict that could not localize the fault restarts without evicting anyone; when the job
has used up its restarts or spares, the policy gives up rather than loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracehound.analysis.verdict import Basis, Verdict
from tracehound.tracing.events import ActionKind
from tracehound.tracing.ids import NodeId


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    max_restarts: int = 3
    """Restarts allowed per job before the controller gives up."""
    min_confidence_to_isolate: float = 0.5
    """Verdicts less sure than this restart without isolating anyone."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedAction:
    kind: ActionKind
    target: str
    reason: str


def plan_recovery(
    verdict: Verdict,
    *,
    restarts_done: int,
    healthy_spares: int,
    settings: PolicySettings,
) -> tuple[PlannedAction, ...]:
    """The actions for a verdict, in the order they must be taken."""
    stop = PlannedAction(kind=ActionKind.STOP_JOB, target=f"attempt {verdict.attempt}",
                         reason=verdict.summary)
    if restarts_done >= settings.max_restarts:
        used = f"{restarts_done} restarts used of {settings.max_restarts}"
        return (stop, PlannedAction(kind=ActionKind.GIVE_UP, target=verdict.job, reason=used))
    isolate: list[PlannedAction] = []
    localized = verdict.basis is not Basis.UNLOCALIZED
    if localized and verdict.confidence >= settings.min_confidence_to_isolate:
        nodes = [NodeId(n) for n in verdict.culprit_nodes]
        if len(nodes) > healthy_spares:
            return (stop, PlannedAction(
                kind=ActionKind.GIVE_UP, target=verdict.job,
                reason=f"{len(nodes)} node(s) to isolate but only {healthy_spares} spare(s) left",
            ))
        isolate = [
            PlannedAction(kind=ActionKind.ISOLATE_NODE, target=n,
                          reason=f"{verdict.kind.value}: confidence {verdict.confidence:.2f}")
            for n in nodes
        ]
    restart = PlannedAction(kind=ActionKind.RESTART, target=f"attempt {verdict.attempt + 1}",
                            reason="resume from the latest complete checkpoint")
    return (stop, *isolate, restart)
