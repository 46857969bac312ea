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

The job's state (`controller.jobstate`: running, suspect, stalled, diagnosing, isolating,
restarting, finished, failed) goes the same way, each written before the supervisor does what it
announces. A supervisor started on a job whose latest state is not finished or failed picks the
job up there: it adopts a running attempt, finishes an incident's plan without repeating a step
already taken, or launches the attempt a restart was about to launch.

Time and sleep are injected, so the loop can be driven step by step in tests.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Final

import msgspec

from tracehound.analysis.diagnose import diagnose_with_records
from tracehound.analysis.idle import IdleTracker, idle_hang
from tracehound.analysis.observation import Observation, load_observation
from tracehound.analysis.rhythm import (
    EXPECTED_PAUSE,
    Pause,
    Rhythm,
    history_words,
    place_in,
    place_of,
    waited_s,
)
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot, load_snapshot, snapshot_to_json
from tracehound.analysis.verdict import Evidence, Fact, Verdict
from tracehound.controller.alerts import Alert, Severity, Status, alert_for
from tracehound.controller.journal import JOURNAL_FILE, STORE_RETRY, Journal, Outbox
from tracehound.controller.orchestrators.port import (
    AttemptPlan,
    NodePool,
    NotEnoughNodes,
    Orchestrator,
)
from tracehound.controller.policy.recovery import (
    SOFT_KINDS,
    PlannedAction,
    PolicySettings,
    observe_only,
    plan_recovery,
    smallest_group_nodes,
)
from tracehound.controller.supervision.jobstate import (
    ACTING,
    NEXT,
    WATCHING,
    History,
    controller_id,
    done_steps,
    episode_of,
    last_incident_number,
    plan_from_json,
    plan_to_json,
    read_history,
)
from tracehound.controller.supervision.restarts import (
    PendingRestart,
    RestartTiming,
    fault_time,
    measure,
)
from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Incident,
    IncidentKind,
    JobPhase,
    JobState,
    RankExit,
    StackSample,
    now_us,
)
from tracehound.tracing.ids import JobId, NodeId
from tracehound.tracing.jobs import TERMINAL
from tracehound.tracing.kinds import MAX_TEXT
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
    pool: tuple[str, ...] = ()
    """The nodes the job may use, in the order spares are taken (default: node-0 .. node-N for
    nnodes + spare_nodes local "nodes")."""


SOFT_RECORDED_FROM: Final = 2
"""A soft fault (straggler, slow link, node outlier) becomes an incident from its second
detection window in a row; in one window it is a suspicion, logged and shown as the job's
`suspect` state. Healthy jobs give such one-window verdicts (0.2% of the simulator's healthy
windows, never two in a row: `bench/diagnosis.py`); a real one is seen again (0.955 of the
simulated stragglers within two windows), which is also when the default policy acts on one
(its kind's `repeats`, 2)."""


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
    warmup_s: float = 3.0
    """Soft faults (a straggler, a slow link, a node outlier) are judged only on what an attempt
    did from this long after its ranks' first training steps (or after its launch, for a script
    whose steps are not seen): the first steps after a launch or a restart (lazy initialization,
    a checkpoint's load, compilation, cold caches) run unevenly on healthy ranks. They are first
    judged once a whole `window_s` has passed since then: a shorter window holds too little of
    a rank's work to tell a straggler from noise."""
    rhythm_factor: float = 3.0
    """A pause at a place where the job paused before (its rhythm: a checkpoint, an evaluation,
    `analysis.rhythm`) is expected, recorded on the job and not as an incident, while it lasts
    at most this many times the longest of its past pauses there; longer, it is a stall
    incident, with that history in its words."""
    stall_stack_wait_s: float = 10.0
    """How long a stall (observed only) waits to be recorded for a stack of its lead rank
    captured since the peers began to wait, when the first verdicts have none: where the rank
    is is most of what a stall incident tells, and the agent's capture of it may come a poll or
    two after the stall is seen. A stall with no such stack by then is recorded without it."""


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


class _GoOn(enum.Enum):
    GO_ON = "go on"


GO_ON: Final = _GoOn.GO_ON
"""What `Supervisor._poll` returns while the attempt goes on."""


@dataclass(slots=True, kw_only=True)
class AttemptWatch:
    """What the supervisor keeps between the polls of one attempt."""

    plan: AttemptPlan
    started_us: int
    """When the run started (the attempt's `timeout_s` counts from here)."""
    rank_nodes: dict[int, str]
    """Rank -> node of every rank the attempt is expected to have."""
    trains_since_us: int
    """The attempt's launch, until every rank's first step is seen; then that step's end."""
    clean: set[int] = field(default_factory=set)
    """Ranks that exited cleanly."""
    last_summaries_us: int = 0
    warmed: bool = False
    settled_at_us: int | None = None
    """When the first failed exit has settled (the crash detector waits that long)."""
    snapshot: JobSnapshot | None = None
    """The snapshot the latest poll read."""


class Detached(Exception):
    """Raised by a supervisor's `sleep` to leave the job as it is: the ranks keep running, no
    state is written, and a later supervisor on the same store picks the job up (the
    Kubernetes operator shutting down or moving)."""


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
        on_state: Callable[[JobState], object] | None = None,
    ) -> None:
        """`journal_path` is where records wait for the store (default: `journal.jsonl` in
        `evidence_dir`; with neither they wait in memory only and are lost with the process).
        `notify` is told each incident as it fires, and again once the job is healthy (the
        restarted attempt made its first step, or the attempt finished): the alert outbox's
        `Dispatcher.enqueue`, usually (what became of each alert is recorded on its incident
        by the dispatcher's `AlertRecorder`, as an `alert` action no decision here reads).
        `on_state` is told each state once it is journaled (the operator mirrors it into the
        TrainingJob's status); it must not raise."""
        self.spec = spec
        self.store = store
        self.orch = orchestrator
        self.settings = settings or SupervisorSettings()
        self.clock = clock
        self.sleep = sleep
        self.observer = observer
        self.evidence_dir = evidence_dir
        self.notify = notify
        self.on_state = on_state
        self._open: list[Incident] = []
        """Incidents announced and not yet resolved."""
        self._last_snapshot: JobSnapshot | None = None
        self._soft_seen: dict[tuple[str, tuple[str, ...]], int] = {}
        self._first_seen: dict[tuple[object, ...], int] = {}
        """When each verdict episode (kind, culprits, where) was first seen."""
        self._recorded: set[tuple[object, ...]] = set()
        """Watched episodes already recorded as incidents (recorded once, however long)."""
        self._held: tuple[Verdict, tuple[PlannedAction, ...]] | None = None
        """A stall held back for its rank's stack (`_awaits_stack`), with its plan."""
        self._rhythm = Rhythm(factor=self.settings.rhythm_factor)
        self._idle = IdleTracker()
        """Since when each rank's process has done nothing (`analysis.idle`)."""
        self._idle_hangs: set[tuple[int, str]] = set()
        """(rank, place) of the idle stalls made hangs: a second one there is the program's
        rhythm more likely than a fault, and gets the busy grace."""
        self._pause: _PauseWatch | None = None
        """The stall episode going on, followed until it ends (its length goes to `_rhythm`)."""
        self._stacks: tuple[StackSample, ...] = ()
        """The latest stack of each rank, as of the last poll."""
        self._held_ended: list[tuple[Verdict, tuple[PlannedAction, ...], int]] = []
        """Held stalls that ended before a stack came in, with when they ended."""
        self._unplaced: list[tuple[_PauseWatch, int]] = []
        """Pauses that ended before a stack placed them, with when they ended."""
        self._severity: dict[str, Severity] = {}
        """Incidents announced louder than their kind's default (a stall past the policy's
        `stall_alert_after_s`): their resolution goes out as loud."""
        self._soft_quiet_until = 0
        self.controller = controller_id()
        """Who writes this supervisor's job states (`JobState.controller`)."""
        self.pool = NodePool(
            [NodeId(n) for n in spec.pool]
            or [NodeId(f"node-{i}") for i in range(spec.nnodes + spec.spare_nodes)]
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
        self._state: JobState | None = None
        """The latest state written (or found, when picking a job up)."""
        self._seq = 0
        self._quiet_since: int | None = None
        """Since when no verdict was seen while suspect or stalled."""
        if journal_path is None and evidence_dir is not None:
            journal_path = evidence_dir / JOURNAL_FILE
        self.journal = Journal(journal_path)
        self.outbox = Outbox(self.journal, store, clock=lambda: self.clock() / 1e6,
                             policy=self.settings.store_retry)

    def run(self) -> RunResult:
        started = self.clock()
        self.outbox.flush(force=True)  # what an earlier supervisor left in the journal
        try:
            picked = self._pick_up()
            if isinstance(picked, RunResult):
                return picked
            attempt, adopted = picked
            while True:
                if adopted:
                    nodes = self.pool.current
                else:
                    try:
                        nodes = self.pool.assign(self.spec.nnodes)
                    except NotEnoughNodes as exc:
                        return self._result(attempt, completed=False, reason=str(exc))
                plan = self._attempt(attempt, nodes)
                if not adopted:
                    self._launch(plan)
                adopted = False
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
                self._restart(attempt)
        except Detached as exc:  # the job goes on; a later supervisor picks it up
            self.log.info("detached from the job (%s): its ranks keep running", exc)
            last = self._state.attempt if self._state is not None else 0
            return RunResult(job=self.spec.job, completed=False, attempts=last + 1,
                             incidents=tuple(self._incidents), reason=f"detached: {exc}",
                             restarts=tuple(self._restarts))
        except KeyboardInterrupt as exc:  # the operator stopped the run: a run of its own ended
            last = self._state.attempt if self._state is not None else 0
            self._set_state(JobPhase.FAILED, last, detail=f"interrupted ({exc or 'Ctrl-C'}); "
                                                          "every rank stopped")
            raise
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
        last = max(attempts - 1, 0)
        if completed:
            self._set_state(JobPhase.FINISHED, last, detail=reason)
        else:
            self._set_state(JobPhase.FAILED, last, detail=reason)
        return RunResult(job=self.spec.job, completed=completed, attempts=attempts,
                         incidents=tuple(self._incidents), reason=reason,
                         restarts=tuple(self._restarts))

    def _attempt(self, attempt: int, nodes: tuple[NodeId, ...]) -> AttemptPlan:
        return AttemptPlan(
            job=self.spec.job, attempt=attempt, nodes=nodes,
            nproc_per_node=self.spec.nproc_per_node, command=self.spec.command,
            env=self.spec.env,
        )

    def _restart(self, attempt: int, *, counted: bool = False) -> None:
        """Announce the launch of `attempt` (a restart), then back off as the policy says
        (`counted`: its time is among the restarts read back from the store already)."""
        if not counted:
            self._restart_times.append(self.clock())
        self._set_state(JobPhase.RESTARTING, attempt, incident_id=self._acting_on())
        delay = self.settings.policy.restart_delay_s(attempt - 1)
        if delay > 0:
            self.log.info("restart %d: backing off %.1f s first (restart_backoff_s)",
                          attempt, delay)
            self.sleep(delay)

    def _acting_on(self) -> str:
        pending = self._pending_restart
        return pending.incident_id if pending is not None else ""

    def _launch(self, plan: AttemptPlan) -> None:
        if plan.attempt == 0:  # written first: a controller started again must not launch twice
            self._set_state(JobPhase.RUNNING, 0, nodes=plan.nodes)
        pending = self._pending_restart
        if pending is not None:
            pending.launch_begin_us = self.clock()
        launched = self.orch.launch(plan)
        if pending is not None:
            pending.launch_end_us = self.clock()
            pending.warm, pending.cold = launched.warm, launched.cold
        self._set_state(JobPhase.RUNNING, plan.attempt, nodes=plan.nodes)

    # -- the job's state -------------------------------------------------------------------------
    def _state_record(self, phase: JobPhase, attempt: int, *, incident_id: str = "",
                      plan: tuple[PlannedAction, ...] = (), detail: str = "",
                      nodes: tuple[NodeId, ...] | None = None,
                      again: bool = False) -> JobState | None:
        """The next state, or None when it is the one the job is in already (unless `again`:
        a new note in the same state, such as the next expected pause)."""
        prev = self._state
        if (not again and prev is not None and prev.state is phase and prev.attempt == attempt
                and prev.incident_id == incident_id):
            return None
        if prev is not None and phase not in NEXT[prev.state]:
            self.log.error("state %s -> %s is not a transition of the job's state machine "
                           "(written anyway)", prev.state.value, phase.value)
        self._seq += 1
        state = JobState(
            job=self.spec.job, time_us=self.clock(), seq=self._seq, state=phase, attempt=attempt,
            incident_id=incident_id, nodes=tuple(self.pool.current if nodes is None else nodes),
            isolated=tuple(sorted(self.pool.isolated)),
            plan=plan_to_json(plan) if plan else "", detail=detail, controller=self.controller,
        )
        self._state = state
        return state

    def _set_state(self, phase: JobPhase, attempt: int, **kwargs: object) -> None:
        state = self._state_record(phase, attempt, **kwargs)  # type: ignore[arg-type]
        if state is not None:
            self.outbox.put(state)
            self._log_state(state)

    def _log_state(self, state: JobState) -> None:
        """Said once the state is journaled (and stored, if the store answered)."""
        self.log.info("state %s (attempt %d%s)", state.state.value, state.attempt,
                      f", incident {state.incident_id}" if state.incident_id else "")
        if self.on_state is not None:
            try:
                self.on_state(state)
            except Exception:  # an observer's failure must not stop the supervision
                self.log.exception("could not report state %s", state.state.value)

    def _pick_up(self) -> tuple[int, bool] | RunResult:
        """Where this run starts: (attempt, whether it is already running and was adopted).
        A fresh start unless an earlier controller of this job left it mid-run."""
        history = read_history(self.store, self.spec.job, [e.record for e in self.outbox.pending()])
        latest = history.latest
        self._ids = itertools.count(last_incident_number(history.incidents) + 1)
        if latest is None or latest.state in TERMINAL:
            self._seq = latest.seq if latest is not None else 0
            self._state = latest
            return 0, False
        self._seq, self._state = latest.seq, latest
        attempt = latest.attempt
        self.log.warning("picking the job up where controller %s left it: %s, attempt %d%s",
                         latest.controller or "?", latest.state.value, attempt,
                         f", incident {latest.incident_id}" if latest.incident_id else "")
        self._restore(history, latest)
        if latest.state in WATCHING:
            if self.orch.adopt(self._attempt(attempt, self.pool.current)):
                self._remember_watched(history, attempt)
                return attempt, True
            self.orch.kill_leftovers(attempt)
            attempt += 1
            self._set_state(JobPhase.RESTARTING, attempt, detail=(
                f"the ranks of attempt {attempt - 1} ended while no controller watched them; "
                "relaunched from the latest checkpoint"))
            return attempt, False
        if latest.state in ACTING:
            counted = any(ActionKind(a.kind) is ActionKind.RESTART
                          for a in history.actions_of(latest.incident_id))
            gave_up = self._finish_plan(history, latest)
            if gave_up is not None:
                return self._result(attempt + 1, completed=False, reason=gave_up)
            attempt += 1
            self._restart(attempt, counted=counted)
            return attempt, False
        # restarting: launched or not? (on the nodes the pool gives it: the same as before)
        try:
            nodes = self.pool.assign(self.spec.nnodes)
        except NotEnoughNodes as exc:
            return self._result(attempt, completed=False, reason=str(exc))
        if self.orch.adopt(self._attempt(attempt, nodes)):
            self._set_state(JobPhase.RUNNING, attempt)
            return attempt, True
        self.orch.kill_leftovers(attempt)
        if attempt > 0:
            self.orch.kill_leftovers(attempt - 1)
        return attempt, False

    def _restore(self, history: History, latest: JobState) -> None:
        """The pool, the limits' counts and the incident being acted on, from the history."""
        since = history.run_since_us
        # isolated: what the state says, and every isolation of this run (one may have been
        # taken after the state was written)
        reasons = {a.target: a.detail for i in history.incidents for a in i.actions
                   if ActionKind(a.kind) is ActionKind.ISOLATE_NODE and a.ok
                   and a.time_us >= since}
        self.pool.restore(latest.nodes or self.pool.current,
                          {n: reasons.get(n, "isolated by an earlier controller")
                           for n in {*latest.isolated, *reasons}})
        self._restart_times = history.times(ActionKind.RESTART, since)
        self._isolation_times = history.times(ActionKind.ISOLATE_NODE, since)
        # the incident whose recovery is under way, and the attempt whose first steps end it
        pending: tuple[Incident, int] | None = None
        acting = history.incident(latest.incident_id) if latest.incident_id else None
        if acting is not None and latest.state not in WATCHING:
            self._incidents.append(acting)
            pending = acting, latest.attempt + (latest.state in ACTING)
        elif latest.attempt > 0:
            # an earlier controller restarted the job into this attempt and was gone before
            # its first steps were measured: the incident still waits for its `resumed`
            restarted = next((
                i for i in reversed(history.incidents)
                if i.attempt == latest.attempt - 1
                and any(ActionKind(a.kind) is ActionKind.RESTART and a.ok
                        and a.time_us >= since for a in i.actions)
                and not any(ActionKind(a.kind) is ActionKind.RESUMED for a in i.actions)), None)
            if restarted is not None:
                pending = restarted, latest.attempt
        if pending is not None:
            incident, attempt = pending
            if self.notify is not None:
                self._open.append(incident)  # announced by the earlier controller
            self._pending_restart = PendingRestart(
                incident_id=incident.incident_id, attempt=attempt,
                fault_us=incident.detected_at_us, detected_us=incident.detected_at_us)

    def _remember_watched(self, history: History, attempt: int) -> None:
        """What was being watched in the adopted attempt: recorded once, not again."""
        for incident in history.incidents:
            if incident.attempt != attempt:
                continue
            key = episode_of(incident)
            self._recorded.add(key)
            self._first_seen.setdefault(key, incident.detected_at_us)

    def _finish_plan(self, history: History, latest: JobState) -> str | None:
        """Carry out what the earlier controller's plan had not done yet; the reason if the
        plan gives up."""
        plan = plan_from_json(latest.plan)
        # the plan's own steps: an alert's record (taken whenever a receiver answered) says
        # nothing about how far the plan got
        taken = [a for a in history.actions_of(latest.incident_id)
                 if ActionKind(a.kind) is not ActionKind.ALERT]
        self.orch.kill_leftovers(latest.attempt)  # stopped or not: that attempt is over
        self._carry_out(self._incident_of(history, latest), latest.attempt, plan,
                        after_us=max((a.time_us for a in taken), default=0),
                        done=done_steps(plan, taken), picked_up=True)
        return _gave_up(plan)

    def _incident_of(self, history: History, state: JobState) -> Incident:
        """The incident a state acts on, as stored or journaled (its id alone, with the state's
        attempt and time, when neither holds it any more)."""
        known = history.incident(state.incident_id)
        if known is not None:
            return known
        self.log.warning("incident %s of state %s is neither stored nor journaled",
                         state.incident_id, state.state.value)
        return Incident(job=self.spec.job, incident_id=state.incident_id, attempt=state.attempt,
                        detected_at_us=state.time_us, kind="", culprit_ranks=(),
                        culprit_nodes=(), confidence=0.0, summary="", verdict_json="{}")

    # -- one attempt ---------------------------------------------------------------------------
    def _supervise(
        self, plan: AttemptPlan, started_us: int
    ) -> tuple[Verdict, tuple[PlannedAction, ...]] | str | None:
        """None when the attempt finished cleanly, a verdict and the plan that acts on it when it
        failed, or a reason to stop. Verdicts whose plan only observes are recorded and the
        attempt goes on."""
        watch = AttemptWatch(plan=plan, started_us=started_us, rank_nodes=plan.rank_nodes(),
                             trains_since_us=started_us)
        while True:
            wait_s = self.settings.poll_s  # woken at once when a rank exits
            if watch.settled_at_us is not None:  # and when its exits have settled
                wait_s = min(wait_s, max(0.0, (watch.settled_at_us - self.clock()) / 1e6) + 0.005)
            exited = self.orch.wait_exit(wait_s, self.sleep)
            outcome = self._poll(watch, exited=exited)
            if outcome is not GO_ON:
                return outcome

    def _poll(self, watch: AttemptWatch, *, exited: bool
              ) -> tuple[Verdict, tuple[PlannedAction, ...]] | str | _GoOn | None:
        """One poll of the attempt `watch` follows: its new exits recorded, a snapshot read and
        diagnosed, an observed verdict recorded. `GO_ON` while the attempt goes on; else what
        `_supervise` returns. `exited`: the poll was woken by a rank's exit."""
        plan = watch.plan
        for exit_ in self.orch.poll_exits():
            self._record_exit(exit_)
            if exit_.exit_code == 0:
                watch.clean.add(exit_.rank)
            elif watch.settled_at_us is None:
                watch.settled_at_us = exit_.time_us + int(
                    self.settings.detection.crash.settle_s * 1e6)
        if watch.rank_nodes and len(watch.clean) == len(watch.rank_nodes):
            self._record_held(None, final=True)
            self._settle_ended(now_us=None)
            self._measure_restart(plan, None)
            self._resolve_open()
            return None
        now = self.clock()
        if self.settings.timeout_s is not None and (
                now - watch.started_us > int(self.settings.timeout_s * 1e6)):
            return f"timed out after {self.settings.timeout_s:.0f} s"
        # a poll woken by an exit reads no window summaries: a crash needs none of them
        judged_from_us = watch.trains_since_us + int(self.settings.warmup_s * 1e6)
        refresh = not exited and self._summaries_due(now, judged_from_us,
                                                     watch.last_summaries_us)
        # the exits go to the store before the snapshot is read: read first, a crash would
        # wait a poll to be seen
        exits_stored = self._exits_stored()
        try:
            obs = self._observe(watch, now_us=now, summaries=refresh,
                                since_us=judged_from_us)
            if refresh:
                watch.last_summaries_us = now
        except TemporaryStoreError as exc:
            self.log.warning("store unavailable, analysis paused: %s", exc)
            return GO_ON
        watch.snapshot = obs.snapshot
        self._measure_restart(plan, obs.snapshot)
        trained = None if watch.warmed else _trains_since_us(obs.snapshot)
        if trained is not None:
            watch.warmed = True
            watch.trains_since_us = trained
            self.orch.warm_up()  # spares for the next attempt, now that this one trains
        if not exits_stored:
            return GO_ON
        if self.observer is not None:
            self.observer(PollView(plan.attempt, obs.snapshot, self.orch))
        verdict, obs = diagnose_with_records(self.store, obs, self.settings.detection)
        self._stacks = obs.snapshot.stacks
        verdict = self._idle_hang(verdict, obs.snapshot, now)
        self._pause_ended(verdict, now)
        self._record_held(verdict)
        self._settle_ended(now)
        self._calm(plan.attempt, verdict, now)
        if verdict is None or not self._soft_gate(verdict, now):
            return GO_ON
        self._last_snapshot = obs.snapshot
        steps = self._plan(verdict, now)
        if not observe_only(steps):
            self._settle_ended(now_us=None)  # the attempt ends here: nothing left waiting
            return verdict, steps
        key = _episode(verdict)
        if verdict.kind is IncidentKind.STALL:
            self._follow_pause(verdict, now)
        if key not in self._recorded and self._awaits_stack(verdict, now):
            if self._held is None:
                self.log.info("stall of rank %d seen; recorded once a stack of it taken "
                              "since its peers began to wait is in, or within %.0f s",
                              verdict.culprit_ranks[0], self.settings.stall_stack_wait_s)
            self._held = (verdict, steps)
            return GO_ON
        self._held = None
        if key not in self._recorded and self._expected_pause(verdict):
            return GO_ON  # the job's rhythm: noted on the job, no incident
        if verdict.kind in SOFT_KINDS and self._times_seen(verdict) < SOFT_RECORDED_FROM:
            self._suspect(verdict)
            return GO_ON
        if verdict.kind in SOFT_KINDS or key not in self._recorded:
            self._recorded.add(key)
            recorded = len(self._incidents)
            self._recover(self._with_history(verdict), steps)  # observed only
            if (verdict.kind is IncidentKind.STALL and self._pause is not None
                    and len(self._incidents) > recorded):
                self._pause.incident = self._incidents[-1]
        self._alert_long_stall()
        return GO_ON

    def _idle_hang(self, verdict: Verdict | None, snap: JobSnapshot,
                   now_us: int) -> Verdict | None:
        """The verdict, or the hang that its stall is when every culprit has done nothing at
        all for the idle grace, or `rhythm_factor` times its longest past pause at that place
        (`analysis.idle`). Once per rank and place: a second one there gets the busy grace."""
        self._idle.observe(snap.processes, snap.stacks)
        if verdict is None or verdict.kind is not IncidentKind.STALL:
            return verdict
        grace = self.settings.detection.hang.idle_grace_s
        thresholds: dict[int, float] = {}
        places: list[tuple[int, str]] = []
        for rank in verdict.culprit_ranks:
            span = self._idle.span(rank, now_us)
            place = place_in(span.stack.frames) if span and span.stack else ""
            if (rank, place) in self._idle_hangs:
                return verdict
            # a pause that "ended" while the process stayed idle (the stall unseen for a poll)
            # was this one: it says nothing of the job's rhythm
            since = span.since_us if span else now_us
            past = [p for p in self._rhythm.history(rank, place) if p.ended_us < since]
            thresholds[rank] = max([grace, *(self._rhythm.factor * p.seconds for p in past)])
            places.append((rank, place))
        hang = idle_hang(verdict, self._idle, thresholds_s=thresholds, now_us=now_us)
        if hang is None:
            return verdict
        self._idle_hangs.update(places)
        self._pause = None  # a stuck rank's pause is no rhythm of the job
        self.log.warning("stall of rank(s) %s is a hang: %s", list(verdict.culprit_ranks),
                         hang.summary)
        return hang

    def _observe(self, watch: AttemptWatch, *, now_us: int, summaries: bool,
                 since_us: int) -> Observation:
        """What the poll at `now_us` reads of the attempt (`load_observation`)."""
        return load_observation(
            self.store, job=watch.plan.job, attempt=watch.plan.attempt, now_us=now_us,
            window_s=self.settings.window_s, expected_ranks=watch.rank_nodes,
            summaries=summaries, since_us=since_us,
            uneven_ops=self.settings.detection.mismatch.size_exempt_ops,
        )

    def _summaries_due(self, now_us: int, judged_from_us: int, last_us: int) -> bool:
        """Whether this poll reads the window summaries too (`summaries_due`)."""
        return summaries_due(self.settings, now_us=now_us, judged_from_us=judged_from_us,
                             last_us=last_us)

    def _follow_pause(self, verdict: Verdict, now_us: int) -> None:
        """Follow the stall episode of `verdict`: where its lead rank is and how long its peers
        have waited (`analysis.rhythm`)."""
        key = _episode(verdict)
        pause = self._pause
        if pause is None or pause.key != key:
            waited = waited_s(verdict)
            pause = self._pause = _PauseWatch(key=key, rank=verdict.culprit_ranks[0],
                                              started_us=now_us - int(waited * 1e6))
        pause.seconds = max(pause.seconds, waited_s(verdict))
        pause.place = place_of(verdict) or pause.place or self._stack_place(pause)

    def _stack_since(self, rank: int, since_us: int) -> StackSample | None:
        """The latest stack of `rank` as of the last poll, if taken since `since_us`."""
        return next((s for s in self._stacks if s.rank == rank and s.time_us >= since_us), None)

    def _stack_place(self, pause: _PauseWatch) -> str:
        """The place of the paused rank from its latest stack, if taken during the pause."""
        stack = self._stack_since(pause.rank, pause.started_us)
        return place_in(stack.frames) if stack is not None else ""

    def _note_expected(self, rank: int, place: str, seconds: float, attempt: int, *,
                       so_far: bool) -> None:
        """Note a pause of the job's rhythm on its states (`stalled`, `expected pause: ...`)."""
        past = self._rhythm.history(rank, place)
        detail = (f"{EXPECTED_PAUSE}: rank {rank} at {_short(place)}, {seconds:.1f} s"
                  f"{' so far' if so_far else ''}; {history_words(past)}")
        self.log.info("%s", detail)
        self._set_state(JobPhase.STALLED, attempt, detail=detail[:MAX_TEXT], again=True)

    def _pause_ended(self, verdict: Verdict | None, now_us: int) -> None:
        """Once the stall episode followed is over (another episode, none, or the attempt
        ended): its pause goes to the job's rhythm, once its place is known (a stack taken
        during it may come a poll or two later: `_settle_ended`)."""
        pause = self._pause
        if pause is None or (verdict is not None and _episode(verdict) == pause.key):
            return
        self._pause = None
        pause.place = pause.place or self._stack_place(pause)
        if pause.place:
            self._rhythm.add(Pause(rank=pause.rank, place=pause.place, seconds=pause.seconds,
                                   ended_us=now_us))
        else:
            self._unplaced.append((pause, now_us))
        if pause.noted and pause.incident is None and self._state is not None and (
                self._state.state is JobPhase.STALLED):
            # the job trains again: not a window later, as after a stall of its own
            self._set_state(JobPhase.RUNNING, self._state.attempt,
                            detail=f"the {EXPECTED_PAUSE} of rank {pause.rank} is over")

    def _settle_ended(self, now_us: int | None) -> None:
        """Stalls that ended before a stack of their rank came in: decided once one has (the
        job's rhythm, or a stall incident), or `stall_stack_wait_s` after they ended, or now
        (`now_us` None: the attempt is over)."""
        wait_us = int(self.settings.stall_stack_wait_s * 1e6)
        waiting = []
        for verdict, steps, ended_us in self._held_ended:
            if (now_us is not None and self._stack_of_held(verdict) is None
                    and now_us - ended_us < wait_us):
                waiting.append((verdict, steps, ended_us))
            elif not self._held_was_rhythm(verdict):
                self._record_ended(verdict, steps)
        self._held_ended = waiting
        unplaced = []
        for pause, ended_us in self._unplaced:
            pause.place = self._stack_place(pause)
            if pause.place:
                self._rhythm.add(Pause(rank=pause.rank, place=pause.place,
                                       seconds=pause.seconds, ended_us=ended_us))
            elif now_us is not None and now_us - ended_us < wait_us:
                unplaced.append((pause, ended_us))
        self._unplaced = unplaced

    def _expected_pause(self, verdict: Verdict) -> bool:
        """Whether a stall not yet recorded is the job's rhythm (`analysis.rhythm`); noted on
        the job as an expected pause, once an episode, when it is."""
        pause = self._pause
        if verdict.kind is not IncidentKind.STALL or pause is None:
            return False
        if not self._rhythm.expected(pause.rank, pause.place, pause.seconds):
            return False
        if not pause.noted:
            pause.noted = True
            self._note_expected(pause.rank, pause.place, pause.seconds, verdict.attempt,
                                so_far=True)
        return True

    def _with_history(self, verdict: Verdict) -> Verdict:
        """A stall at a place with history (it lasted longer than its rhythm) says so."""
        pause = self._pause
        if verdict.kind is not IncidentKind.STALL or pause is None:
            return verdict
        past = self._rhythm.history(pause.rank, pause.place)
        if not past:
            return verdict
        words = (f"{pause.seconds:.1f} s so far, more than {self._rhythm.factor:g} times its "
                 f"rhythm: {history_words(past)}")
        fact = Evidence(fact=Fact.BUSY, rank=pause.rank, node=verdict.culprit_nodes[0]
                        if verdict.culprit_nodes else "", value=pause.seconds,
                        detail=f"rank {pause.rank} at {_short(pause.place)}: {words}")
        return replace(verdict, summary=f"{verdict.summary}; {words}",
                       evidence=(fact, *verdict.evidence))

    def _alert_long_stall(self) -> None:
        """A stall incident whose peers have waited the policy's `stall_alert_after_s` is
        alerted as a warning (a stall's alert is info-level, which receivers take only when
        they ask for it: `Receiver.min_severity`)."""
        pause, after = self._pause, self.settings.policy.stall_alert_after_s
        if pause is None or pause.incident is None or pause.alerted or after is None:
            return
        if pause.seconds < after:
            return
        pause.alerted = True
        incident = pause.incident
        self._severity[incident.incident_id] = "warning"
        self.log.warning("stall of incident %s has lasted %.0f s: alerted", incident.incident_id,
                         pause.seconds)
        self._announce(incident, "firing")

    def _record_held(self, verdict: Verdict | None, *, final: bool = False) -> None:
        """The stall held back for a stack, once it is over (the next verdict is another
        episode, or none, or the attempt ended): decided when a stack of its rank taken during
        it is in (`_settle_ended`), or at once when `final`; never lost."""
        held = self._held
        if held is None or (verdict is not None and _episode(verdict) == _episode(held[0])):
            return
        self._held = None
        if _episode(held[0]) in self._recorded:
            return
        if not final and self._rhythm.knows(held[0].culprit_ranks[0]):
            # a stack may yet place it where its rank paused before
            self._held_ended.append((*held, self.clock()))
        elif not self._held_was_rhythm(held[0]):
            self._record_ended(*held)

    def _record_ended(self, verdict: Verdict, steps: tuple[PlannedAction, ...]) -> None:
        key = _episode(verdict)
        if key in self._recorded:
            return
        self._recorded.add(key)
        where = ("a stack taken during it" if self._stack_of_held(verdict)
                 else "no stack of it taken since its peers began to wait")
        self.log.info("the stall of rank %d ended before it was recorded: recorded with the "
                      "evidence it had (%s)", verdict.culprit_ranks[0], where)
        self._recover(verdict, steps)

    def _stack_of_held(self, verdict: Verdict) -> StackSample | None:
        """The latest stack of a stall's rank if taken since its peers began to wait."""
        started = verdict.observed_at_us - int(waited_s(verdict) * 1e6)
        return self._stack_since(verdict.culprit_ranks[0], started)

    def _held_was_rhythm(self, verdict: Verdict) -> bool:
        """Whether a stall that ended before it was recorded is the job's rhythm: a stack of
        its rank taken during it places it where the job paused before. If so it is noted on
        the job as an expected pause, and the job trains again."""
        stack = self._stack_of_held(verdict)
        place = place_in(stack.frames) if stack is not None else ""
        rank, waited = verdict.culprit_ranks[0], waited_s(verdict)
        if not place or not self._rhythm.expected(rank, place, waited):
            return False
        self._note_expected(rank, place, waited, verdict.attempt, so_far=False)
        # over already (it ended before its stack came in): the job trains again
        self._set_state(JobPhase.RUNNING, verdict.attempt,
                        detail=f"the {EXPECTED_PAUSE} of rank {rank} is over")
        return True

    def _awaits_stack(self, verdict: Verdict, now_us: int) -> bool:
        """Whether to hold a stall verdict back for its lead rank's stack (see
        `SupervisorSettings.stall_stack_wait_s`)."""
        if verdict.kind is not IncidentKind.STALL or not verdict.culprit_ranks:
            return False
        lead = verdict.culprit_ranks[0]
        if any(e.fact is Fact.STACK and e.rank == lead for e in verdict.evidence):
            return False
        first = self._first_seen.get(_episode(verdict), now_us)
        return now_us - first < int(self.settings.stall_stack_wait_s * 1e6)

    def _calm(self, attempt: int, verdict: Verdict | None, now_us: int) -> None:
        """Back to `running` once no verdict was seen for a detection window while suspect or
        stalled."""
        state = self._state
        if state is None or state.state not in (JobPhase.SUSPECT, JobPhase.STALLED):
            return
        if verdict is not None:
            self._quiet_since = None
            return
        if self._quiet_since is None:
            self._quiet_since = now_us
        elif now_us - self._quiet_since >= int(self.settings.window_s * 1e6):
            self._quiet_since = None
            self._set_state(JobPhase.RUNNING, attempt, detail="no fault seen for a window")

    def _measure_restart(self, plan: AttemptPlan, snapshot: JobSnapshot | None) -> None:
        """Once every rank of a restarted attempt has made its first step: record where the
        restart's time went (a `resumed` action on the incident, and in the run's result)."""
        pending = self._pending_restart
        if pending is None or pending.attempt != plan.attempt:
            return
        if snapshot is None:  # the attempt finished before a poll saw its first steps
            try:
                snapshot = load_snapshot(self.store, job=plan.job, attempt=plan.attempt,
                                         now_us=self.clock(), expected_ranks=plan.rank_nodes())
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
        if status == "firing" and all(i.incident_id != incident.incident_id for i in self._open):
            self._open.append(incident)
        try:
            self.notify(alert_for(incident, status=status, at_us=self.clock(),
                                  severity=self._severity.get(incident.incident_id)))
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
            healthy_spares=self._healthy_spares(), settings=self.settings.policy,
            times_seen=self._times_seen(verdict) if verdict.kind in SOFT_KINDS else 1,
            watched_s=(now_us - first) / 1e6,
            restarts_last_hour=sum(t > hour_ago for t in self._restart_times),
            isolations_done=len(self._isolation_times),
            isolations_last_hour=sum(t > hour_ago for t in self._isolation_times),
            group_nodes=group_nodes,
        )

    def _healthy_spares(self) -> int:
        """Nodes that could replace isolated ones (the policy evicts no more than that)."""
        return len(self.pool.healthy_spares())

    def _times_seen(self, verdict: Verdict) -> int:
        return self._soft_seen.get((verdict.kind.value, verdict.culprit_nodes), 1)

    def _suspect(self, verdict: Verdict) -> None:
        """A soft fault seen in one window: said in the log and in the job's state (suspect),
        an incident if it is seen in the next window too (`SOFT_RECORDED_FROM`)."""
        where = (f"rank(s) {', '.join(str(r) for r in verdict.culprit_ranks[:8])} on "
                 f"{', '.join(verdict.culprit_nodes[:4])}" if verdict.culprit_ranks
                 else "no rank named")
        detail = (f"{verdict.kind.value} of {where} seen in one window (confidence "
                  f"{verdict.confidence:.2f}); an incident if seen in the next")
        self.log.info("%s", detail)
        self._set_state(JobPhase.SUSPECT, verdict.attempt, detail=detail)

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
        if observe_only(plan):
            phase = JobPhase.STALLED if verdict.kind is IncidentKind.STALL else JobPhase.SUSPECT
            state = self._state_record(phase, verdict.attempt, incident_id=incident_id)
        else:  # the plan goes with the incident: a controller started again finishes it
            state = self._state_record(JobPhase.DIAGNOSING, verdict.attempt,
                                       incident_id=incident_id, plan=plan)
        self.outbox.put(incident, *([state] if state is not None else []))
        if state is not None:
            self._log_state(state)
        self._announce(incident, "firing")
        self._keep_evidence(incident_id)
        if any(step.kind is ActionKind.RESTART for step in plan):
            self._pending_restart = PendingRestart(
                incident_id=incident_id, attempt=verdict.attempt + 1,
                fault_us=fault_time(verdict, self._last_snapshot), detected_us=detected,
            )
        actions = self._carry_out(incident, verdict.attempt, plan, after_us=detected)
        self._incidents.append(msgspec.structs.replace(incident, actions=tuple(actions)))
        return _gave_up(plan)

    def _carry_out(self, incident: Incident, attempt: int, plan: tuple[PlannedAction, ...], *,
                   after_us: int, done: Sequence[bool] = (),
                   picked_up: bool = False) -> list[Action]:
        """Take the plan's steps (but those `done` already), each recorded as an action of the
        incident at a time after `after_us` and the previous one's, so that they read back in
        order. `picked_up`: an earlier controller's plan, whose attempt is already killed."""
        incident_id = incident.incident_id
        actions: list[Action] = []
        at = after_us
        for step, already in zip(plan, done or [False] * len(plan), strict=True):
            if already:
                self.log.info("action %s %s was taken by the earlier controller", step.kind.value,
                              step.target)
                continue
            if step.kind is ActionKind.ISOLATE_NODE:
                self._set_state(JobPhase.ISOLATING, attempt, incident_id=incident_id, plan=plan)
            if picked_up and step.kind is ActionKind.STOP_JOB:
                ok, detail = True, (f"stopped (what was left of it) by a controller started "
                                    f"again; {step.reason}")
            else:
                ok, detail = self._act(step, incident)
            at = max(self.clock(), at + 1)
            action = Action(job=self.spec.job, incident_id=incident_id, kind=step.kind,
                            target=step.target, time_us=at, ok=ok,
                            detail=detail or step.reason, rule=step.rule)
            actions.append(action)
            self.outbox.put(action)
        return actions

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

    def _act(self, step: PlannedAction, incident: Incident) -> tuple[bool, str]:
        """Take one step of an incident's plan; (whether it was done, what was done)."""
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


def _gave_up(plan: tuple[PlannedAction, ...]) -> str | None:
    """Why the plan gives up on the job, if it does."""
    return next((s.reason for s in plan if s.kind is ActionKind.GIVE_UP), None)


def summaries_due(settings: SupervisorSettings, *, now_us: int, judged_from_us: int,
                  last_us: int) -> bool:
    """Whether a poll at `now_us` reads the window summaries (soft faults): every
    `summaries_every_s`, and only once a whole `window_s` has passed since the attempt's warm-up
    ended at `judged_from_us` (soft faults are judged on full windows only: a window cut short
    by the warm-up can hold a fraction of a second of a rank's work, and bench/detection.py's
    restarted attempts showed a healthy rank "1.16x its peers" over 5 collectives in 152 ms)."""
    every_us = int(settings.summaries_every_s * 1e6)
    full_us = max(every_us, int(settings.window_s * 1e6))
    return now_us - judged_from_us >= full_us and now_us - last_us >= every_us


def _trains_since_us(snapshot: JobSnapshot) -> int | None:
    """When the last expected rank of the attempt finished its first step (its own clock);
    None until every one has."""
    first = {h.rank: h.first_step_us for h in snapshot.heartbeats
             if h.attempt == snapshot.attempt and h.first_step_us}
    if not snapshot.expected_ranks or not set(snapshot.expected_ranks) <= set(first):
        return None
    return max(first.values())


@dataclass(slots=True)
class _PauseWatch:
    """A stall episode as the supervisor follows it (`Supervisor._follow_pause`)."""

    key: tuple[object, ...]
    rank: int
    started_us: int
    """When its peers began to wait (as far as its first verdict says)."""
    seconds: float = 0.0
    """How long its peers have waited, at most, so far."""
    place: str = ""
    noted: bool = False
    """Noted on the job as an expected pause."""
    incident: Incident | None = None
    """Its stall incident, once recorded."""
    alerted: bool = False
    """Alerted past the policy's `stall_alert_after_s`."""


def _short(place: str) -> str:
    """A place's innermost three frames, for a line of text."""
    frames = place.split(" > ")
    return " > ".join(frames[-3:]) if place else "an unknown place"


def _episode(verdict: Verdict) -> tuple[object, ...]:
    """What makes two verdicts of successive polls the same incident: kind, culprits and the
    collective the peers wait in (a stall at the next checkpoint is a new one)."""
    seq = max((e.seq for e in verdict.evidence if e.fact is Fact.WAITING), default=0)
    return (verdict.kind.value, verdict.culprit_ranks, verdict.group, seq)
