"""Recovery policy: what to do about a verdict. Pure: it returns the plan, the supervisor acts.

The first rule is never to harm a healthy job: stop, isolate or restart only on evidence that
holds; otherwise record, say so loudly and keep watching.

- Hard faults (crash, hang, hardware, silent hang) stop the job, isolate the culprit's node at
  once when the verdict is sure enough, and restart from the latest complete checkpoint.
- A stall (peers wait on a rank that is alive and busy outside collectives: a checkpoint write,
  an evaluation, compilation, data loading) is only observed. The analysis turns it into a hang
  once it lasts the busy grace; such a hang restarts without isolating anyone, since the
  process was alive and its machine is not implicated.
- Soft faults (straggler, slow link, node outlier) are only observed the first time; seen again
  in the next window, they are treated like hard ones. A slow machine costs time, a wrong
  eviction costs a restart: a repeat is the price of not crying wolf.
- A mismatch is a bug in the training program: restarting would repeat it, so the job is
  stopped and the policy gives up, saying why.
- Unsure verdicts (not localized, or less sure than `min_confidence_to_isolate`) and verdicts
  naming more nodes than there are healthy spares do not stop a job that is still running: they
  are observed while the same verdict lasts less than `watch_s`, then the job restarts without
  evicting anyone. A crashed job is not running: it restarts at once, evicting only when the
  spares suffice.
- The policy gives up only on a definite fault it cannot recover from: a program error, or
  restarts used up.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracehound.analysis.verdict import Basis, Verdict
from tracehound.tracing.events import ActionKind, IncidentKind
from tracehound.tracing.ids import NodeId

SOFT_KINDS = frozenset({IncidentKind.STRAGGLER, IncidentKind.SLOW_LINK, IncidentKind.NODE_OUTLIER})
USER_CODE_KINDS = frozenset({IncidentKind.MISMATCH})
OBSERVED_KINDS = frozenset({IncidentKind.STALL})
"""Kinds that are recorded and watched, never acted on."""
STOPPED_KINDS = frozenset({IncidentKind.CRASH})
"""Kinds whose job is no longer running when the verdict comes: there is nothing to watch."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    max_restarts: int = 3
    """Restarts allowed per job before the controller gives up."""
    min_confidence_to_isolate: float = 0.5
    """Verdicts less sure than this never isolate a node."""
    soft_repeats: int = 2
    """How many consecutive windows must show a soft fault on the same nodes before acting."""
    watch_s: float = 600.0
    """How long an unsure verdict (or one naming more nodes than there are spares) on a running
    job is only watched before the job restarts without evicting anyone (`--busy-grace`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedAction:
    kind: ActionKind
    target: str
    reason: str


def observe_only(plan: tuple[PlannedAction, ...]) -> bool:
    """Whether a plan leaves the job running as it is."""
    return all(a.kind is ActionKind.OBSERVE for a in plan)


def plan_recovery(
    verdict: Verdict,
    *,
    restarts_done: int,
    healthy_spares: int,
    settings: PolicySettings,
    times_seen: int = 1,
    watched_s: float = 0.0,
) -> tuple[PlannedAction, ...]:
    """The actions for a verdict, in the order they must be taken. `times_seen` counts the
    consecutive windows that gave this verdict (kind and nodes), this one included; `watched_s`
    is how long the same verdict has been seen on the running job."""
    target = ", ".join(verdict.culprit_nodes) or verdict.job
    if verdict.kind in OBSERVED_KINDS:
        return (PlannedAction(
            kind=ActionKind.OBSERVE, target=target,
            reason=f"{verdict.kind.value}: the rank is alive; nothing is done while it lasts",
        ),)
    if verdict.kind in SOFT_KINDS and times_seen < settings.soft_repeats:
        return (PlannedAction(
            kind=ActionKind.OBSERVE, target=target,
            reason=f"soft fault seen {times_seen} time(s); acting at {settings.soft_repeats}",
        ),)
    stop = PlannedAction(kind=ActionKind.STOP_JOB, target=f"attempt {verdict.attempt}",
                         reason=verdict.summary)
    if verdict.kind in USER_CODE_KINDS:
        return (stop, PlannedAction(
            kind=ActionKind.GIVE_UP, target=verdict.job,
            reason="the training program itself is at fault; a restart would repeat it",
        ))
    running = verdict.kind not in STOPPED_KINDS
    nodes = [NodeId(n) for n in verdict.culprit_nodes]
    sure = (
        verdict.basis is not Basis.UNLOCALIZED
        and verdict.confidence >= settings.min_confidence_to_isolate
    )
    machine = verdict.basis is not Basis.BUSY_TIMEOUT
    doubt = ""
    if not sure:
        doubt = (f"not sure enough to evict (confidence {verdict.confidence:.2f}, basis "
                 f"{verdict.basis.value})")
    elif machine and len(nodes) > healthy_spares:
        doubt = f"{len(nodes)} node(s) to isolate but only {healthy_spares} spare(s) left"
    if doubt and running and watched_s < settings.watch_s:
        return (PlannedAction(
            kind=ActionKind.OBSERVE, target=target,
            reason=f"{doubt}: watching; restarting without evicting anyone if it lasts "
                   f"{settings.watch_s:.0f} s",
        ),)
    if restarts_done >= settings.max_restarts:
        used = f"{restarts_done} restarts used of {settings.max_restarts}"
        return (stop, PlannedAction(kind=ActionKind.GIVE_UP, target=verdict.job, reason=used))
    isolate: list[PlannedAction] = []
    if machine and not doubt:
        isolate = [
            PlannedAction(kind=ActionKind.ISOLATE_NODE, target=n,
                          reason=f"{verdict.kind.value}: confidence {verdict.confidence:.2f}")
            for n in nodes
        ]
    if not machine:
        why = "the rank was alive and busy: its machine is not implicated; "
    elif doubt:
        why = f"{doubt}; nobody evicted; "
    else:
        why = ""
    restart = PlannedAction(kind=ActionKind.RESTART, target=f"attempt {verdict.attempt + 1}",
                            reason=f"{why}resume from the latest complete checkpoint")
    return (stop, *isolate, restart)
