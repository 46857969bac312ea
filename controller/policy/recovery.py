"""Recovery policy: what to do about a verdict. Pure: it returns the plan, the supervisor acts.

The first rule is never to harm a healthy job: stop, isolate or restart only on evidence that
holds; otherwise record, say so loudly and keep watching. Every threshold lives in one settings
object, `PolicySettings`, one `KindRule` per verdict kind, on the analysis' confidence scale
(`analysis.confidence`: CERTAIN 0.95, STRONG 0.85, LIKELY 0.7, WEAK 0.5, UNSURE 0.3). An operator
sets them in one policy file (`controller.policyfile`), and every `PlannedAction` names, in
`rule`, the path in that file of the setting that decided it ("rules.hang.isolate_from",
"max_restarts_per_hour", "uncertain", ...).

- Hard faults (crash, hang, hardware, silent hang) stop the job, isolate the culprit's node at
  once when the verdict reaches its kind's `isolate_from`, and restart from the latest complete
  checkpoint.
- A stall (peers wait on a rank that is alive and busy outside collectives: a checkpoint write,
  an evaluation, compilation, data loading) is only observed. The analysis turns it into a hang
  once it lasts the busy grace, or the idle grace where the rank does nothing at all
  (`analysis.idle`); such a hang restarts without isolating anyone, since the process was alive
  and its machine is not implicated.
- Soft faults (straggler, slow link, node outlier) are only observed until they are seen in
  `repeats` consecutive windows; then they are treated like hard ones. A slow machine costs
  time, a wrong eviction costs a restart: a repeat is the price of not crying wolf. (Seen in
  one window, the supervisor only marks the job suspect and records no incident:
  `supervisor.SOFT_RECORDED_FROM`.)
- A mismatch is a bug in the training program: restarting would repeat it, so the job is
  stopped and the policy gives up, saying why.
- Unsure verdicts (not localized, or less sure than their kind's `act_from`) and verdicts
  naming more nodes than there are healthy spares do not stop a job that is still running: they
  are observed while the same verdict lasts less than `watch_s`, then the job restarts without
  evicting anyone. A crashed job is not running: it restarts at once, evicting only when the
  verdict is sure enough and the spares suffice.
- With `uncertain: isolate_group`, a verdict that names its culprit ranks but is not sure enough
  to evict their node (below its kind's `isolate_from` or `act_from`) evicts instead every node
  of the smallest parallel group holding those ranks, at once, when the spares and the
  isolation limits allow (ByteRobust's over-eviction: a few healthy machines cost less than a
  long wait); otherwise it is treated as under `uncertain: watch`. Never for a kind that never
  evicts, an unlocalized verdict, or a rank that was alive and busy.
- Limits: `max_isolations` (per job) and `max_isolations_per_hour` bound the nodes evicted; when
  an eviction would pass them the job restarts evicting nobody. `max_restarts` (per job) and
  `max_restarts_per_hour` bound the restarts; `restart_delay_s` spaces them out (exponential
  backoff).
- The policy gives up only on a definite fault it cannot recover from: a program error, or
  restarts used up.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Mapping
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
        why="the rank is alive and busy; the analysis makes it a hang after the busy grace "
            "(the idle grace when it does nothing at all)"),
})
"""The default rule of every verdict kind. A kind without one gets `KindRule()`."""

SOFT_KINDS = frozenset(k for k, r in DEFAULT_RULES.items() if r.repeats > 1)
"""Kinds acted on only when seen again under the default rules (straggler, slow link, node
outlier); `PolicySettings.repeated` says the same for the rules in force."""


def _default_rules() -> Mapping[IncidentKind, KindRule]:
    return DEFAULT_RULES


class Uncertain(enum.StrEnum):
    """What the policy does about a verdict that names its culprit ranks but is not sure enough
    to evict their node (below its kind's `isolate_from`, or below its `act_from`)."""

    WATCH = "watch"
    """Evict nobody: a running job is watched for `watch_s` when the verdict is below `act_from`
    (a crashed one restarts at once), and restarts at once when it is sure enough to act on but
    not to evict."""
    ISOLATE_GROUP = "isolate_group"
    """Evict every node of the smallest parallel group holding the culprit ranks, at once, when
    there are as many healthy spares and the isolation limits allow it; otherwise as WATCH.
    Never for a kind that never evicts, an unlocalized verdict or a rank alive and busy."""


class WatchActions(enum.StrEnum):
    """How `tracehound watch` acts on a job Tracehound did not launch (`tracehound run` and the
    operator act through their own orchestrator and ignore it)."""

    OBSERVE = "observe"
    """Record incidents and what the policy would do; never touch the job."""
    SLURM = "slurm"
    """Through Slurm's scontrol: drain the culprit nodes, then requeue or cancel the job, as
    the plan says (`tracehound watch --slurm` asks for the same)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicySettings:
    """Every threshold of the recovery policy (see the module docstring). The policy file
    (`controller.policyfile`) has one key per field, under the same name."""

    max_restarts: int = 3
    """Restarts allowed per job before the controller gives up."""
    max_restarts_per_hour: int | None = None
    """Restarts allowed within any hour (the caller counts them: `restarts_last_hour`) before
    the controller gives up: a job failing again soon after every restart is not being
    recovered (None: no hourly limit)."""
    max_isolations: int | None = None
    """Nodes that may be isolated per job (None: unlimited). A recovery whose eviction would
    pass it restarts the job evicting nobody."""
    max_isolations_per_hour: int | None = None
    """Nodes that may be isolated within any hour (None: unlimited), as `max_isolations`: many
    machines failing at once more likely mean a fault the policy misreads than bad machines."""
    restart_backoff_s: float = 0.0
    """Wait before the first restart, doubled for each restart after it (0: restart at once);
    see `restart_delay_s`."""
    restart_backoff_max_s: float = 300.0
    """The longest wait before a restart."""
    watch_s: float = 600.0
    """How long an unsure verdict (or one naming more nodes than there are spares) on a running
    job is only watched before the job restarts without evicting anyone (`--busy-grace`)."""
    stall_alert_after_s: float | None = 300.0
    """A stall is recorded as an info-level incident, which alert receivers take only when they
    ask for it; once its peers have waited this long it is alerted as a warning (None:
    never)."""
    uncertain: Uncertain = Uncertain.WATCH
    """What to do about a localized verdict not sure enough to evict its culprits' node."""
    rules: Mapping[IncidentKind, KindRule] = field(default_factory=_default_rules)
    """The rule of each verdict kind; kinds left out get `KindRule()`."""
    watch_actions: WatchActions = WatchActions.OBSERVE
    """How `tracehound watch` carries out the plan for a job it did not launch."""

    def rule(self, kind: IncidentKind) -> KindRule:
        """The rule for verdicts of `kind`."""
        return self.rules.get(kind, KindRule())

    def repeated(self, kind: IncidentKind) -> bool:
        """Whether verdicts of `kind` wait for a repeat: the caller counts the consecutive
        windows that show them and passes the count as `times_seen`."""
        return self.rule(kind).repeats > 1

    def restart_delay_s(self, restarts_done: int) -> float:
        """Seconds to wait before the next restart of a job that was restarted `restarts_done`
        times: restart number n (n = restarts_done + 1) waits
        min(restart_backoff_max_s, restart_backoff_s * 2**(n-1)); 0.0 is at once."""
        if self.restart_backoff_s <= 0:
            return 0.0
        doublings = min(max(restarts_done, 0), 64)  # 2**64 times any backoff passes any cap
        return min(self.restart_backoff_max_s, self.restart_backoff_s * 2.0**doublings)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedAction:
    """One step of a plan, with why it is taken and which setting decided it."""

    kind: ActionKind
    target: str
    reason: str
    rule: str = ""
    """The setting that decided the step, as its path in the policy file: "rules.hang.act_from",
    "rules.stall.response", "rules.straggler.repeats", "max_restarts", "uncertain", "watch_s",
    ... The steps of one recovery (stop, isolations, restart or give up) name the same one."""


def observe_only(plan: tuple[PlannedAction, ...]) -> bool:
    """Whether a plan leaves the job running as it is."""
    return all(a.kind is ActionKind.OBSERVE for a in plan)


def smallest_group_nodes(
    culprit_ranks: Iterable[int],
    groups: Iterable[Collection[int]],
    rank_nodes: Mapping[int, str],
) -> tuple[str, ...]:
    """The nodes of the smallest process group holding every culprit rank (fewest nodes, then
    fewest ranks; the first of equals), ordered by their lowest rank: what `plan_recovery`
    evicts under `Uncertain.ISOLATE_GROUP`, passed to it as `group_nodes`. `groups` are the
    member ranks of the job's process groups, `rank_nodes` maps each global rank to its node.
    () when there is no culprit or no group holds them all; ValueError when a member of a
    group holding them has no node."""
    culprits = set(culprit_ranks)
    if not culprits:
        return ()
    best: tuple[tuple[int, int], tuple[str, ...]] | None = None
    for members in groups:
        ranks = sorted(set(members))
        if not culprits.issubset(ranks):
            continue
        nodes: dict[str, None] = {}
        for rank in ranks:
            node = rank_nodes.get(rank)
            if node is None:
                raise ValueError(f"rank {rank} of a process group holding the culprit ranks "
                                 f"{sorted(culprits)} has no node in rank_nodes")
            nodes[node] = None
        size = (len(nodes), len(ranks))
        if best is None or size < best[0]:
            best = (size, tuple(nodes))
    return () if best is None else best[1]


def _observe(target: str, reason: str, rule: str) -> tuple[PlannedAction, ...]:
    return (PlannedAction(kind=ActionKind.OBSERVE, target=target, reason=reason, rule=rule),)


def _isolation_limit(settings: PolicySettings, *, needed: int, done: int,
                     last_hour: int) -> tuple[str, str]:
    """The isolation limit that evicting `needed` more nodes would pass, as (its key, why);
    ("", "") when none would be passed."""
    per_job, per_hour = settings.max_isolations, settings.max_isolations_per_hour
    if per_job is not None and done + needed > per_job:
        return "max_isolations", (f"max_isolations: {done} of {per_job} node isolations used in "
                                  f"this job, {needed} more needed")
    if per_hour is not None and last_hour + needed > per_hour:
        return "max_isolations_per_hour", (
            f"max_isolations_per_hour: {last_hour} of {per_hour} node isolations used in the "
            f"last hour, {needed} more needed")
    return "", ""


def _ranks(ranks: tuple[int, ...]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def plan_recovery(
    verdict: Verdict,
    *,
    restarts_done: int,
    healthy_spares: int,
    settings: PolicySettings,
    times_seen: int = 1,
    watched_s: float = 0.0,
    restarts_last_hour: int = 0,
    isolations_done: int = 0,
    isolations_last_hour: int = 0,
    group_nodes: tuple[str, ...] = (),
) -> tuple[PlannedAction, ...]:
    """The actions for a verdict, in the order they must be taken, each naming in `rule` the
    setting that decided it. `times_seen` counts the consecutive windows that gave this verdict
    (kind and nodes), this one included; `watched_s` is how long the same verdict has been seen
    on the running job. `restarts_last_hour` counts the job's restarts within the last hour,
    `isolations_done` and `isolations_last_hour` the nodes it had isolated in all and within
    the last hour; `group_nodes` are the nodes of the smallest parallel group holding the
    culprit ranks (`smallest_group_nodes`), evicted under `uncertain: isolate_group`."""
    rule = settings.rule(verdict.kind)
    at = f"rules.{verdict.kind.value}"
    target = ", ".join(verdict.culprit_nodes) or verdict.job
    if rule.response is Response.OBSERVE:
        return _observe(target, f"{verdict.kind.value}: the rank is alive; nothing is done "
                                "while it lasts", f"{at}.response")
    if times_seen < rule.repeats:
        return _observe(target, f"soft fault seen {times_seen} time(s); acting at "
                                f"{rule.repeats}", f"{at}.repeats")

    def stop(decided: str) -> PlannedAction:
        return PlannedAction(kind=ActionKind.STOP_JOB, target=f"attempt {verdict.attempt}",
                             reason=verdict.summary, rule=decided)

    def give_up(decided: str, reason: str) -> tuple[PlannedAction, ...]:
        return (stop(decided), PlannedAction(kind=ActionKind.GIVE_UP, target=verdict.job,
                                             reason=reason, rule=decided))

    if rule.response is Response.GIVE_UP:
        return give_up(f"{at}.response",
                       "the training program itself is at fault; a restart would repeat it")
    running = verdict.kind not in STOPPED_KINDS
    nodes = tuple(NodeId(n) for n in verdict.culprit_nodes)
    machine = verdict.basis not in (Basis.BUSY_TIMEOUT, Basis.IDLE_TIMEOUT)
    localized = verdict.basis is not Basis.UNLOCALIZED
    unsure = not localized or verdict.confidence < rule.act_from
    sure = (machine and rule.isolate_from is not None
            and verdict.confidence >= rule.isolate_from)
    limit_key, limit = "", ""
    if sure:
        limit_key, limit = _isolation_limit(settings, needed=len(nodes), done=isolations_done,
                                            last_hour=isolations_last_hour)
    # why a running job is not stopped at once ("" when it is), and the setting that says so
    doubt, doubt_key = "", ""
    if unsure:
        doubt, doubt_key = (f"not sure enough to evict (confidence {verdict.confidence:.2f}, "
                            f"basis {verdict.basis.value}; {verdict.kind.value} is acted on "
                            f"from {rule.act_from:.2f})"), f"{at}.act_from"
    elif sure and not limit and len(nodes) > healthy_spares:
        doubt = f"{len(nodes)} node(s) to isolate but only {healthy_spares} spare(s) left"
        doubt_key = "watch_s" if running else f"{at}.isolate_from"

    evict: tuple[str, ...] = nodes if sure and not limit and not doubt else ()
    decided = limit_key or f"{at}.isolate_from"
    isolate_why = f"{verdict.kind.value}: confidence {verdict.confidence:.2f}"
    group_note = ""  # why the smallest group is not evicted after all, under isolate_group
    if (settings.uncertain is Uncertain.ISOLATE_GROUP and machine and localized
            and rule.isolate_from is not None and (unsure or not sure)):
        group_limit = _isolation_limit(settings, needed=len(group_nodes), done=isolations_done,
                                       last_hour=isolations_last_hour)[1]
        if not group_nodes:
            group_note = f"no parallel group holding {_ranks(verdict.culprit_ranks)} is known"
        elif len(group_nodes) > healthy_spares:
            group_note = (f"the {len(group_nodes)} node(s) of the smallest group holding "
                          f"{_ranks(verdict.culprit_ranks)} exceed the {healthy_spares} "
                          "spare(s) left")
        elif group_limit:
            group_note = group_limit
        else:
            evict, doubt, decided = group_nodes, "", "uncertain"
            threshold = rule.act_from if unsure else rule.isolate_from
            isolate_why = (f"{verdict.kind.value}: confidence {verdict.confidence:.2f} is below "
                           f"{threshold:.2f}: every node of the smallest group holding "
                           f"{_ranks(verdict.culprit_ranks)} is evicted "
                           "(uncertain: isolate_group)")
    also = f" (uncertain: isolate_group, but {group_note})" if group_note else ""

    if doubt and running and watched_s < settings.watch_s:
        return _observe(target, f"{doubt}{also}: watching; restarting without evicting anyone "
                                f"if it lasts {settings.watch_s:.0f} s", doubt_key)
    if restarts_done >= settings.max_restarts:
        return give_up("max_restarts", f"{restarts_done} restarts used of "
                                       f"{settings.max_restarts} (max_restarts)")
    per_hour = settings.max_restarts_per_hour
    if per_hour is not None and restarts_last_hour >= per_hour:
        return give_up("max_restarts_per_hour",
                       f"max_restarts_per_hour: {restarts_last_hour} of {per_hour} restarts "
                       "used in the last hour; the job keeps failing soon after its restarts")

    if decided == "uncertain":
        why = ""
    elif not machine:
        decided = ("watch_s" if running else doubt_key) if doubt else f"{at}.act_from"
        why = (f"the rank was alive and {'idle' if verdict.basis is Basis.IDLE_TIMEOUT else 'busy'}"
               ": its machine is not implicated; ")
    elif doubt:
        decided = "watch_s" if running else doubt_key
        why = f"{doubt}{also}; nobody evicted; "
    elif limit:
        why = f"{limit}; nobody evicted; "
    elif rule.isolate_from is None:
        why = f"{verdict.kind.value} never evicts; "
    elif verdict.confidence < rule.isolate_from:
        why = (f"not sure enough to evict (confidence {verdict.confidence:.2f}, "
               f"{verdict.kind.value} evicts from {rule.isolate_from:.2f}){also}; "
               "nobody evicted; ")
    else:
        why = ""
    isolate = [PlannedAction(kind=ActionKind.ISOLATE_NODE, target=n, reason=isolate_why,
                             rule=decided) for n in evict]
    restart = PlannedAction(kind=ActionKind.RESTART, target=f"attempt {verdict.attempt + 1}",
                            reason=f"{why}resume from the latest complete checkpoint",
                            rule=decided)
    return (stop(decided), *isolate, restart)
