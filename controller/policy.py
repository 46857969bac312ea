"""Recovery policy: what to do about a verdict. Pure: it returns the plan, the supervisor acts.

- Hard faults (crash, hang, hardware, silent hang) stop the job, isolate the culprit's node at
  once when the verdict is sure enough, and restart from the latest complete checkpoint.
- Soft faults (straggler, slow link, node outlier) are only observed the first time; seen again
  in the next window, they are treated like hard ones. A slow machine costs time, a wrong
  eviction costs a restart: a repeat is the price of not crying wolf.
- A mismatch is a bug in the training program: restarting would repeat it, so the job is
  stopped and the policy gives up, saying why.
- A verdict that could not localize the fault restarts without evicting anyone; when the job
  has used up its restarts or spares, the policy gives up rather than loop.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracehound.analysis.verdict import Basis, Verdict
from tracehound.tracing.events import ActionKind, IncidentKind
from tracehound.tracing.ids import NodeId

SOFT_KINDS = frozenset({IncidentKind.STRAGGLER, IncidentKind.SLOW_LINK, IncidentKind.NODE_OUTLIER})
USER_CODE_KINDS = frozenset({IncidentKind.MISMATCH})


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    max_restarts: int = 3
    """Restarts allowed per job before the controller gives up."""
    min_confidence_to_isolate: float = 0.5
    """Verdicts less sure than this restart without isolating anyone."""
    soft_repeats: int = 2
    """How many consecutive windows must show a soft fault on the same nodes before acting."""


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
    times_seen: int = 1,
) -> tuple[PlannedAction, ...]:
    """The actions for a verdict, in the order they must be taken. `times_seen` counts the
    consecutive windows that gave this verdict (kind and nodes), this one included."""
    if verdict.kind in SOFT_KINDS and times_seen < settings.soft_repeats:
        return (PlannedAction(
            kind=ActionKind.OBSERVE, target=", ".join(verdict.culprit_nodes) or verdict.job,
            reason=f"soft fault seen {times_seen} time(s); acting at {settings.soft_repeats}",
        ),)
    stop = PlannedAction(kind=ActionKind.STOP_JOB, target=f"attempt {verdict.attempt}",
                         reason=verdict.summary)
    if verdict.kind in USER_CODE_KINDS:
        return (stop, PlannedAction(
            kind=ActionKind.GIVE_UP, target=verdict.job,
            reason="the training program itself is at fault; a restart would repeat it",
        ))
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
