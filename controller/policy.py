"""Recovery policy: what to do about a verdict. Pure: it returns the plan, the supervisor acts.

The first rule is never to harm a healthy job: stop, isolate or restart only on evidence that
holds; otherwise record, say so loudly and keep watching. Every threshold lives in one settings
object, `PolicySettings`, one `KindRule` per verdict kind, on the analysis' confidence scale
(`analysis.confidence`: CERTAIN 0.95, STRONG 0.85, LIKELY 0.7, WEAK 0.5, UNSURE 0.3).

- Hard faults (crash, hang, hardware, silent hang) stop the job, isolate the culprit's node at
  once when the verdict reaches its kind's `isolate_from`, and restart from the latest complete
  checkpoint.
- A stall (peers wait on a rank that is alive and busy outside collectives: a checkpoint write,
  an evaluation, compilation, data loading) is only observed. The analysis turns it into a hang
  once it lasts the busy grace; such a hang restarts without isolating anyone, since the
  process was alive and its machine is not implicated.
- Soft faults (straggler, slow link, node outlier) are only observed until they are seen in
  `repeats` consecutive windows; then they are treated like hard ones. A slow machine costs
  time, a wrong eviction costs a restart: a repeat is the price of not crying wolf.
- A mismatch is a bug in the training program: restarting would repeat it, so the job is
  stopped and the policy gives up, saying why.
- Unsure verdicts (not localized, or less sure than their kind's `act_from`) and verdicts
  naming more nodes than there are healthy spares do not stop a job that is still running: they
  are observed while the same verdict lasts less than `watch_s`, then the job restarts without
  evicting anyone. A crashed job is not running: it restarts at once, evicting only when the
  verdict is sure enough and the spares suffice.
- The policy gives up only on a definite fault it cannot recover from: a program error, or
  restarts used up.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

from tracehound.analysis.confidence import LIKELY, WEAK
from tracehound.analysis.verdict import Basis, Verdict
from tracehound.tracing.events import ActionKind, IncidentKind
from tracehound.tracing.ids import NodeId

STOPPED_KINDS = frozenset({IncidentKind.CRASH})
"""Kinds whose job is no longer running when the verdict comes: there is nothing to watch."""


class Response(enum.StrEnum):
    """What the policy does, in kind, about verdicts of one kind."""

    RECOVER = "recover"
    """Stop the job, evict the culprit nodes when sure enough, restart from a checkpoint."""
    OBSERVE = "observe"
    """Record and watch; never act (the analysis turns it into another kind when it must)."""
    GIVE_UP = "give_up"
    """Stop the job and give up: the training program is at fault, a restart would repeat it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KindRule:
    """How the policy treats the verdicts of one kind."""

    response: Response = Response.RECOVER
    act_from: float = LIKELY
    """Least confidence to stop a running job at once. A less sure verdict is watched for
    `PolicySettings.watch_s`, then the job restarts evicting nobody."""
    isolate_from: float | None = LIKELY
    """Least confidence to evict the culprit nodes (None: never). From `act_from` up to this,
    the job restarts at once evicting nobody."""
    repeats: int = 1
    """Consecutive detection windows that must show the verdict on the same nodes before
    anything is done; until then it is only observed."""
    why: str = ""
    """Why the rule is what it is, in particular which verdicts of the kind it does not act on."""

    @property
    def isolates(self) -> bool:
        """Whether verdicts of this kind can lead to isolating a node at all."""
        return self.response is Response.RECOVER and self.isolate_from is not None


SOFT_REPEATS: Final = 2
"""Windows a soft fault (straggler, slow link, node outlier) must be seen in before acting."""

DEFAULT_RULES: Final[Mapping[IncidentKind, KindRule]] = MappingProxyType({
    IncidentKind.CRASH: KindRule(
        why="a crash whose first failures were too close to order (WEAK) restarts without "
            "evicting anyone: one of them failed first, evicting all would evict healthy nodes"),
    IncidentKind.HANG: KindRule(
        why="a stall no rank explains (UNLOCALIZED, UNSURE) is watched: a long legitimate "
            "collective looks the same at first"),
    IncidentKind.HARDWARE: KindRule(
        why="a warning that only localizes a stall nothing else explains (WEAK) is watched"),
    IncidentKind.SILENT_HANG: KindRule(
        why="when too many ranks' stacks differ, the group named whole (UNSURE) is watched"),
    IncidentKind.STRAGGLER: KindRule(
        repeats=SOFT_REPEATS,
        why="many late ranks at once (WEAK) point to something broader than one machine: "
            "watched, then restarted evicting nobody"),
    IncidentKind.SLOW_LINK: KindRule(
        act_from=WEAK, isolate_from=WEAK, repeats=SOFT_REPEATS,
        why="the two ends of a link that cannot be told apart (WEAK) are both evicted: the "
            "fault lies between them and would survive a restart"),
    IncidentKind.NODE_OUTLIER: KindRule(
        repeats=SOFT_REPEATS,
        why="one flagged node (LIKELY) is evicted once seen again; several flagged at once "
            "(WEAK) are watched, then restarted evicting nobody: a model that flags several "
            "machines more likely sees a job-wide effect than one bad machine"),
    IncidentKind.MISMATCH: KindRule(
        response=Response.GIVE_UP, isolate_from=None,
        why="the training program is at fault: no machine is, and a restart would repeat it"),
    IncidentKind.STALL: KindRule(
        response=Response.OBSERVE, isolate_from=None,
        why="the rank is alive and busy; the analysis makes it a hang after the busy grace"),
})
"""The default rule of every verdict kind. A kind without one gets `KindRule()`."""

SOFT_KINDS = frozenset(k for k, r in DEFAULT_RULES.items() if r.repeats > 1)
"""Kinds acted on only when seen again under the default rules (straggler, slow link, node
outlier); `PolicySettings.repeated` says the same for the rules in force."""


def _default_rules() -> Mapping[IncidentKind, KindRule]:
    return DEFAULT_RULES


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    """Every threshold of the recovery policy (see the module docstring)."""

    max_restarts: int = 3
    """Restarts allowed per job before the controller gives up."""
    watch_s: float = 600.0
    """How long an unsure verdict (or one naming more nodes than there are spares) on a running
    job is only watched before the job restarts without evicting anyone (`--busy-grace`)."""
    rules: Mapping[IncidentKind, KindRule] = field(default_factory=_default_rules)
    """The rule of each verdict kind; kinds left out get `KindRule()`."""

    def rule(self, kind: IncidentKind) -> KindRule:
        """The rule for verdicts of `kind`."""
        return self.rules.get(kind, KindRule())

    def repeated(self, kind: IncidentKind) -> bool:
        """Whether verdicts of `kind` wait for a repeat: the caller counts the consecutive
        windows that show them and passes the count as `times_seen`."""
        return self.rule(kind).repeats > 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedAction:
    kind: ActionKind
    target: str
    reason: str


def observe_only(plan: tuple[PlannedAction, ...]) -> bool:
    """Whether a plan leaves the job running as it is."""
    return all(a.kind is ActionKind.OBSERVE for a in plan)


def _observe(target: str, reason: str) -> tuple[PlannedAction, ...]:
    return (PlannedAction(kind=ActionKind.OBSERVE, target=target, reason=reason),)


def _doubt(verdict: Verdict, rule: KindRule, *, evict: bool, nodes: int, spares: int) -> str:
    """Why the verdict should not be acted on at once ("" when it should): it is not localized
    or less sure than its kind's `act_from`, or it would evict more nodes than there are
    spares."""
    if verdict.basis is Basis.UNLOCALIZED or verdict.confidence < rule.act_from:
        return (f"not sure enough to evict (confidence {verdict.confidence:.2f}, basis "
                f"{verdict.basis.value}; {verdict.kind.value} is acted on from "
                f"{rule.act_from:.2f})")
    if evict and nodes > spares:
        return f"{nodes} node(s) to isolate but only {spares} spare(s) left"
    return ""


def _restart_reason(verdict: Verdict, rule: KindRule, *, machine: bool, doubt: str) -> str:
    """Why nobody is evicted, if nobody is, before the restart itself."""
    if not machine:
        why = "the rank was alive and busy: its machine is not implicated; "
    elif doubt:
        why = f"{doubt}; nobody evicted; "
    elif rule.isolate_from is None:
        why = f"{verdict.kind.value} never evicts; "
    elif verdict.confidence < rule.isolate_from:
        why = (f"not sure enough to evict (confidence {verdict.confidence:.2f}, "
               f"{verdict.kind.value} evicts from {rule.isolate_from:.2f}); nobody evicted; ")
    else:
        why = ""
    return f"{why}resume from the latest complete checkpoint"


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
    rule = settings.rule(verdict.kind)
    target = ", ".join(verdict.culprit_nodes) or verdict.job
    if rule.response is Response.OBSERVE:
        return _observe(target, f"{verdict.kind.value}: the rank is alive; nothing is done "
                                "while it lasts")
    if times_seen < rule.repeats:
        return _observe(target, f"soft fault seen {times_seen} time(s); acting at "
                                f"{rule.repeats}")
    stop = PlannedAction(kind=ActionKind.STOP_JOB, target=f"attempt {verdict.attempt}",
                         reason=verdict.summary)
    if rule.response is Response.GIVE_UP:
        return (stop, PlannedAction(
            kind=ActionKind.GIVE_UP, target=verdict.job,
            reason="the training program itself is at fault; a restart would repeat it",
        ))
    running = verdict.kind not in STOPPED_KINDS
    nodes = [NodeId(n) for n in verdict.culprit_nodes]
    machine = verdict.basis is not Basis.BUSY_TIMEOUT
    evict = (machine and rule.isolate_from is not None
             and verdict.confidence >= rule.isolate_from)
    doubt = _doubt(verdict, rule, evict=evict, nodes=len(nodes), spares=healthy_spares)
    if doubt and running and watched_s < settings.watch_s:
        return _observe(target, f"{doubt}: watching; restarting without evicting anyone if it "
                                f"lasts {settings.watch_s:.0f} s")
    if restarts_done >= settings.max_restarts:
        used = f"{restarts_done} restarts used of {settings.max_restarts}"
        return (stop, PlannedAction(kind=ActionKind.GIVE_UP, target=verdict.job, reason=used))
    isolate = [
        PlannedAction(kind=ActionKind.ISOLATE_NODE, target=n,
                      reason=f"{verdict.kind.value}: confidence {verdict.confidence:.2f}")
        for n in nodes
    ] if evict and not doubt else []
    restart = PlannedAction(
        kind=ActionKind.RESTART, target=f"attempt {verdict.attempt + 1}",
        reason=_restart_reason(verdict, rule, machine=machine, doubt=doubt),
    )
    return (stop, *isolate, restart)
