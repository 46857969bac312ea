"""The supervision loop: launch an attempt, watch it through the store, act on verdicts.

Every `poll_s` the supervisor records new rank exits in the store, reads a snapshot of the
attempt back from the store and asks the analysis for a verdict. A verdict becomes an incident;
the policy's plan (stop, isolate, restart or give up) is carried out through the orchestrator
and each action is recorded with its outcome. Training scripts resume from their latest complete
checkpoint on their own (see `tracehound.agent.checkpoint`).

Exits, incidents and actions go through the supervisor's journal (`controller.journal`): each is
made durable on local disk first and written to the store exactly once, when the store answers.
A store outage of any length loses none of them and never holds up acting on the job; what is
still pending when a run ends is written by the next supervisor on the same journal.

Time and sleep are injected, so the loop can be driven step by step in tests.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from tracehound.analysis.detect import DetectionSettings
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import load_observation
from tracehound.analysis.snapshot import JobSnapshot, snapshot_to_json
from tracehound.analysis.verdict import Fact, Verdict
from tracehound.controller.alerts import Alert, Status, alert_for
from tracehound.controller.journal import JOURNAL_FILE, STORE_RETRY, Journal, Outbox
from tracehound.controller.orchestrator import AttemptPlan, NodePool, NotEnoughNodes, Orchestrator
from tracehound.controller.policy import (
    SOFT_KINDS,
    PlannedAction,
    PolicySettings,
    observe_only,
    plan_recovery,
    smallest_group_nodes,
)
from tracehound.controller.restarts import PendingRestart, RestartTiming, fault_time, measure
from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.events import Action, ActionKind, Incident, RankExit, now_us
from tracehound.tracing.ids import JobId, NodeId
from tracehound.tracing.logs import JobLogger
from tracehound.tracing.retry import Backoff
from tracehound.tracing.store import TraceStore

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    """What to run and on how much."""

    job: JobId
    command: tuple[str, ...]
    nnodes: int
    nproc_per_node: int
    spare_nodes: int = 0
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorSettings:
    poll_s: float = 0.5
    """How often the supervisor reads the store and runs the analysis."""
    detection: DetectionSettings = field(default_factory=DetectionSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    timeout_s: float | None = None
    """Give up on the whole run after this long (None: never)."""
    window_s: float = 10.0
    """Length of the detection window of collective summaries (stragglers, links, mismatches)."""
    summaries_every_s: float = 2.0
    """How often the window summaries are computed; crashes and hangs are checked every poll."""
    store_retry: Backoff = STORE_RETRY
    """Waits between tries of journaled records while the store is away (tried at the polls)."""
    journal_drain_s: float = 10.0
    """How long the end of a run waits for the store to take what is still journaled; the rest
    is written by the next supervisor on the same journal."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    job: JobId
    completed: bool
    attempts: int
    """How many attempts were launched."""
    incidents: tuple[Incident, ...]
    reason: str
    """Why the run ended, in words."""
    restarts: tuple[RestartTiming, ...] = ()
    """The restarts measured through to the new attempt's first step, with their phases."""


@dataclass(frozen=True, slots=True)
class PollView:
    """What an observer sees at each poll (the demo injects faults from here)."""

    attempt: int
    snapshot: JobSnapshot
    orchestrator: Orchestrator


class Supervisor:
    def __init__(
        self,
        *,
        spec: JobSpec,
        store: TraceStore,
        orchestrator: Orchestrator,
        settings: SupervisorSettings | None = None,
        clock: Callable[[], int] = now_us,
        sleep: Callable[[float], None] = time.sleep,
        observer: Callable[[PollView], None] | None = None,
        evidence_dir: Path | None = None,
        journal_path: Path | None = None,
        notify: Callable[[Alert], object] | None = None,
    ) -> None:
        """`journal_path` is where records wait for the store (default: `journal.jsonl` in
        `evidence_dir`; with neither they wait in memory only and are lost with the process).
        `notify` is told each incident as it fires, and again once the job is healthy (the
        restarted attempt made its first step, or the attempt finished): the alert outbox's
        `Dispatcher.enqueue`, usually."""
        self.spec = spec
        self.store = store
        self.orch = orchestrator
        self.settings = settings or SupervisorSettings()
        self.clock = clock
        self.sleep = sleep
        self.observer = observer
        self.evidence_dir = evidence_dir
        self.notify = notify
        self._open: list[Incident] = []
        """Incidents announced and not yet resolved."""
        self._last_snapshot: JobSnapshot | None = None
        self._soft_seen: dict[tuple[str, tuple[str, ...]], int] = {}
        self._first_seen: dict[tuple[object, ...], int] = {}
        """When each verdict episode (kind, culprits, where) was first seen."""
        self._recorded: set[tuple[object, ...]] = set()
        """Watched episodes already recorded as incidents (recorded once, however long)."""
        self._soft_quiet_until = 0
        self.pool = NodePool(
            [NodeId(f"node-{i}") for i in range(spec.nnodes + spec.spare_nodes)]
        )
        self.log = JobLogger(log, job=spec.job)
        self._incidents: list[Incident] = []
        self._restarts: list[RestartTiming] = []
        self._restart_times: list[int] = []
        """When each restart of this run was decided (us): the policy's hourly limit."""
        self._isolation_times: list[int] = []
        """When each node was isolated (us): the policy's isolation limits."""
        self._pending_restart: PendingRestart | None = None
        self._ids = itertools.count(1)
        if journal_path is None and evidence_dir is not None:
            journal_path = evidence_dir / JOURNAL_FILE
        self.journal = Journal(journal_path)
        self.outbox = Outbox(self.journal, store, clock=lambda: self.clock() / 1e6,
                             policy=self.settings.store_retry)

    def run(self) -> RunResult:
        started = self.clock()
        attempt = 0
        self.outbox.flush(force=True)  # what an earlier supervisor left in the journal
        try:
            while True:
                try:
                    nodes = self.pool.assign(self.spec.nnodes)
                except NotEnoughNodes as exc:
                    return self._result(attempt, completed=False, reason=str(exc))
                plan = AttemptPlan(
                    job=self.spec.job, attempt=attempt, nodes=nodes,
                    nproc_per_node=self.spec.nproc_per_node, command=self.spec.command,
                    env=self.spec.env,
                )
                pending = self._pending_restart
                if pending is not None:
                    pending.launch_begin_us = self.clock()
                self.orch.launch(plan)
                if pending is not None:
                    pending.launch_end_us = self.clock()
                    launched = getattr(self.orch, "last_launch", {})
                    pending.warm = int(launched.get("warm", 0))
                    pending.cold = int(launched.get("cold", plan.world_size))
                outcome = self._supervise(plan, started)
                if outcome is None:
                    self.orch.finish()
                    self.log.info("attempt %d finished: every rank exited cleanly", attempt)
                    return self._result(attempt + 1, completed=True, reason="training finished")
                if isinstance(outcome, str):
                    self.orch.stop()
                    return self._result(attempt + 1, completed=False, reason=outcome)
                verdict, steps = outcome
                gave_up = self._recover(verdict, steps)
                if gave_up is not None:
                    return self._result(attempt + 1, completed=False,
                                        reason=f"gave up after {verdict.kind.value} "
                                               f"({verdict.summary}): {gave_up}")
                attempt += 1
                self._restart_times.append(self.clock())
                delay = self.settings.policy.restart_delay_s(attempt - 1)
                if delay > 0:
                    self.log.info("restart %d: backing off %.1f s first (restart_backoff_s)",
                                  attempt, delay)
                    self.sleep(delay)
        finally:
            try:
                self.orch.close()
            finally:
                self._drain_journal()

    def _drain_journal(self) -> None:
        """Give the store a last chance at what is journaled; say where the rest waits."""
        if self.outbox.drain(self.settings.journal_drain_s, self.sleep):
            return
        self.log.error("%d records could not be stored in %s yet; they wait in the journal %s "
                       "for the next supervisor of this job", len(self.outbox.pending()),
                       self.store.url, self.journal.path or "(memory only: lost)")

    def _result(self, attempts: int, *, completed: bool, reason: str) -> RunResult:
        return RunResult(job=self.spec.job, completed=completed, attempts=attempts,
                         incidents=tuple(self._incidents), reason=reason,
                         restarts=tuple(self._restarts))

    # -- one attempt ---------------------------------------------------------------------------
    def _supervise(
        self, plan: AttemptPlan, started_us: int
    ) -> tuple[Verdict, tuple[PlannedAction, ...]] | str | None:
        """None when the attempt finished cleanly, a verdict and the plan that acts on it when it
        failed, or a reason to stop. Verdicts whose plan only observes are recorded and the
        attempt goes on."""
        clean: set[int] = set()
        rank_nodes = plan.rank_nodes()
        last_summaries_us = 0
        timeout_us = (
            int(self.settings.timeout_s * 1e6) if self.settings.timeout_s is not None else None
        )
        wait_exit = getattr(self.orch, "wait_exit", None)
        while True:
            if wait_exit is not None:  # wake at once when a rank exits
                wait_exit(self.settings.poll_s)
            else:
                self.sleep(self.settings.poll_s)
            for exit_ in self.orch.poll_exits():
                self._record_exit(exit_)
                if exit_.exit_code == 0:
                    clean.add(exit_.rank)
            if len(clean) == plan.world_size:
                self._measure_restart(plan, None)
                self._resolve_open()
                return None
            now = self.clock()
            if timeout_us is not None and now - started_us > timeout_us:
                return f"timed out after {self.settings.timeout_s:.0f} s"
            refresh = now - last_summaries_us >= int(self.settings.summaries_every_s * 1e6)
            # the exits go to the store before the snapshot is read: read first, a crash would
            # wait a poll to be seen
            exits_stored = self._exits_stored()
            try:
                obs = load_observation(
                    self.store, job=plan.job, attempt=plan.attempt, now_us=now,
                    window_s=self.settings.window_s, expected_ranks=rank_nodes,
                    summaries=refresh,
                    uneven_ops=self.settings.detection.mismatch_size_exempt_ops,
                )
                if refresh:
                    last_summaries_us = now
            except TemporaryStoreError as exc:
                self.log.warning("store unavailable, analysis paused: %s", exc)
                continue
            self._measure_restart(plan, obs.snapshot)
            if not exits_stored:
                continue
            if self.observer is not None:
                self.observer(PollView(plan.attempt, obs.snapshot, self.orch))
            verdict = diagnose_observation(obs, self.settings.detection)
            if verdict is None or not self._soft_gate(verdict, now):
                continue
            self._last_snapshot = obs.snapshot
            steps = self._plan(verdict, now)
            if not observe_only(steps):
                return verdict, steps
            key = _episode(verdict)
            if verdict.kind in SOFT_KINDS or key not in self._recorded:
                self._recorded.add(key)
                self._recover(verdict, steps)  # observed only; the attempt goes on

    def _measure_restart(self, plan: AttemptPlan, snapshot: JobSnapshot | None) -> None:
        """Once every rank of a restarted attempt has made its first step: record where the
        restart's time went (a `resumed` action on the incident, and in the run's result)."""
        pending = self._pending_restart
        if pending is None or pending.attempt != plan.attempt:
            return
        if snapshot is None:  # the attempt finished before a poll saw its first steps
            try:
                snapshot = load_observation(
                    self.store, job=plan.job, attempt=plan.attempt, now_us=self.clock(),
                    window_s=self.settings.window_s, expected_ranks=plan.rank_nodes(),
                    summaries=False,
                ).snapshot
            except TemporaryStoreError:
                return
        timing = measure(pending, snapshot)
        if timing is None:
            return
        self._pending_restart = None
        self._resolve_open()
        self._restarts.append(timing)
        self.log.info("restart of incident %s: %s", pending.incident_id, timing.describe())
        self.outbox.put(Action(
            job=plan.job, incident_id=pending.incident_id, kind=ActionKind.RESUMED,
            target=f"attempt {plan.attempt}", time_us=max(self.clock(), timing.resumed_us),
            ok=True, detail=timing.describe(),
        ))

    def _announce(self, incident: Incident, status: Status) -> None:
        """Tell `notify` about an incident; a failure there is logged, never raised."""
        if self.notify is None:
            return
        if status == "firing":
            self._open.append(incident)
        try:
            self.notify(alert_for(incident, status=status, at_us=self.clock()))
        except Exception as exc:
            self.log.error("could not queue the %s alert of incident %s: %r", status,
                           incident.incident_id, exc)

    def _resolve_open(self) -> None:
        """The job is healthy again: every open incident resolves."""
        open_, self._open = self._open, []
        for incident in open_:
            self._announce(incident, "resolved")

    def _exits_stored(self) -> bool:
        """Whether the store has every exit seen so far (the store answered: try it now). The
        analysis waits until it has: without them a crash would read as a silence."""
        if self.outbox.flush(force=True):
            return True
        waiting = [e for e in self.outbox.pending() if isinstance(e.record, RankExit)]
        if waiting:
            self.log.warning("analysis paused: %d rank exits not yet in the store",
                             len(waiting))
        return not waiting

    def _plan(self, verdict: Verdict, now_us: int) -> tuple[PlannedAction, ...]:
        first = self._first_seen.setdefault(_episode(verdict), now_us)
        hour_ago = now_us - 3_600_000_000
        snapshot = self._last_snapshot
        group_nodes: tuple[str, ...] = ()
        if snapshot is not None and verdict.culprit_ranks:
            members = {(g.group, g.ranks) for g in snapshot.groups}
            try:
                group_nodes = smallest_group_nodes(
                    verdict.culprit_ranks, [ranks for _, ranks in members],
                    dict(snapshot.expected_ranks),
                )
            except ValueError as exc:  # a group member the attempt does not place
                self.log.warning("no parallel group to over-evict: %s", exc)
        return plan_recovery(
            verdict, restarts_done=verdict.attempt,
            healthy_spares=len(self.pool.healthy_spares()), settings=self.settings.policy,
            times_seen=self._times_seen(verdict) if verdict.kind in SOFT_KINDS else 1,
            watched_s=(now_us - first) / 1e6,
            restarts_last_hour=sum(t > hour_ago for t in self._restart_times),
            isolations_done=len(self._isolation_times),
            isolations_last_hour=sum(t > hour_ago for t in self._isolation_times),
            group_nodes=group_nodes,
        )

    def _times_seen(self, verdict: Verdict) -> int:
        return self._soft_seen.get((verdict.kind.value, verdict.culprit_nodes), 1)

    def _soft_gate(self, verdict: Verdict, now_us: int) -> bool:
        """Whether to act on a verdict now. Hard verdicts always pass. A soft one is counted at
        most once per detection window, so "seen again" means "seen in the next window"; a
        window without it starts the count afresh."""
        window_us = int(self.settings.window_s * 1e6)
        if self._soft_seen and now_us > self._soft_quiet_until + window_us:
            self._soft_seen = {}
        if verdict.kind not in SOFT_KINDS:
            return True
        if now_us < self._soft_quiet_until:
            return False
        key = (verdict.kind.value, verdict.culprit_nodes)
        self._soft_seen = {key: self._soft_seen.get(key, 0) + 1}
        self._soft_quiet_until = now_us + window_us
        return True

    def _record_exit(self, exit_: RankExit) -> None:
        level = logging.INFO if exit_.exit_code == 0 else logging.WARNING
        JobLogger(log, job=exit_.job, node=exit_.node, rank=exit_.rank).log(
            level, "attempt %d: exited with code %d", exit_.attempt, exit_.exit_code
        )
        self.outbox.put(exit_)

    # -- acting on a verdict -------------------------------------------------------------------
    def _recover(self, verdict: Verdict, plan: tuple[PlannedAction, ...]) -> str | None:
        """Record the incident and carry out the policy's plan; the reason if it gave up."""
        incident_id = f"{verdict.job}/{verdict.attempt}/{next(self._ids)}"
        detected = self.clock()
        incident = Incident(
            job=verdict.job, incident_id=incident_id, attempt=verdict.attempt,
            detected_at_us=detected, kind=verdict.kind.value,
            culprit_ranks=verdict.culprit_ranks, culprit_nodes=verdict.culprit_nodes,
            confidence=verdict.confidence, summary=verdict.summary,
            verdict_json=verdict.to_json(),
        )
        self.log.warning("incident %s: %s %s (confidence %.2f)", incident_id, verdict.kind.value,
                         verdict.summary, verdict.confidence)
        self.outbox.put(incident)
        self._announce(incident, "firing")
        self._keep_evidence(incident_id)
        if any(step.kind is ActionKind.RESTART for step in plan):
            self._pending_restart = PendingRestart(
                incident_id=incident_id, attempt=verdict.attempt + 1,
                fault_us=fault_time(verdict, self._last_snapshot), detected_us=detected,
            )
        actions: list[Action] = []
        gave_up: str | None = None
        at = detected
        for step in plan:
            ok, detail = self._act(step)
            at = max(self.clock(), at + 1)  # strictly increasing: actions read back in order
            if step.kind is ActionKind.GIVE_UP:
                gave_up = step.reason
            action = Action(job=verdict.job, incident_id=incident_id, kind=step.kind,
                            target=step.target, time_us=at, ok=ok,
                            detail=detail or step.reason, rule=step.rule)
            actions.append(action)
            self.outbox.put(action)
        self._incidents.append(msgspec.structs.replace(incident, actions=tuple(actions)))
        return gave_up

    def _keep_evidence(self, incident_id: str) -> None:
        """Save the snapshot behind a verdict: it replays through the analysis as it was."""
        if self.evidence_dir is None or self._last_snapshot is None:
            return
        path = self.evidence_dir / (incident_id.replace("/", "_") + ".snapshot.json")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(snapshot_to_json(self._last_snapshot))
        except OSError as exc:
            self.log.warning("could not keep the evidence of %s in %s: %s", incident_id, path, exc)

    def _act(self, step: PlannedAction) -> tuple[bool, str]:
        # Not acting is news too: whoever reads the log must see why the job was left running.
        level = logging.WARNING if step.kind is ActionKind.OBSERVE else logging.INFO
        self.log.log(level, "action %s %s: %s", step.kind.value, step.target, step.reason)
        if step.kind is ActionKind.STOP_JOB:
            pending = self._pending_restart
            if pending is not None:
                pending.stop_begin_us = self.clock()
            self.orch.stop()
            if pending is not None:
                pending.stop_end_us = self.clock()
            return True, f"stopped; {step.reason}"
        if step.kind is ActionKind.ISOLATE_NODE:
            node = NodeId(step.target)
            self._isolation_times.append(self.clock())
            self.pool.isolate(node, step.reason)
            self.orch.isolate(node, reason=step.reason)
            return True, f"isolated {node}: {step.reason}"
        return True, step.reason  # restart, observe and give up are carried out by the loop


def _episode(verdict: Verdict) -> tuple[object, ...]:
    """What makes two verdicts of successive polls the same incident: kind, culprits and the
    collective the peers wait in (a stall at the next checkpoint is a new one)."""
    seq = max((e.seq for e in verdict.evidence if e.fact is Fact.WAITING), default=0)
    return (verdict.kind.value, verdict.culprit_ranks, verdict.group, seq)
