"""Watching jobs that Tracehound did not launch: the supervisor's detection loop, driven one poll
at a time, over what the store holds of a job started by Slurm, torchrun or Ray (and recorded by
`tracehound instrument` or `tracehound agent`).

`Watcher` is a `Supervisor` whose orchestrator is the observe-only `WatchedRanks`. Every
detection, policy and record of a supervised job is the same here: the verdicts, the stalls and
the job's rhythm, the soft faults' repeats, incidents, job states, alerts and the journal. What
differs is how a job comes and goes, and how the watcher acts:

- It learns the job's current attempt from the store: the newest attempt whose ranks sent a
  heartbeat within `silent_after_s`. It learns the ranks and nodes from their reports
  (`orchestrators.watched.placement`). A job that has not reported yet is waited for.
- The attempt is over when every rank's process is gone ("exited"), or when nothing of it has
  reported for `silent_after_s` ("stopped reporting"): `orchestrators.watched.attempt_end`. A
  newer attempt reporting within `end_grace_s` (its launcher restarted it) is watched next.
  Otherwise the job has ended: `finished` when its ranks exited and no hard incident is open,
  else `failed`, with how and after how long in the state's detail.
- It acts through its action port (`controller.actions`), not the orchestrator. The adapter
  turns the policy's plan into its own steps, and those are journaled with the incident before
  any is taken. An incident whose plan cannot change the job (observe, a command) is recorded
  once per episode, like the stalls a supervisor only observes, and the job is left as it is
  (suspect or stalled). A requeue makes the watcher wait for the job's next attempt. A cancel
  ends the watch.
- Started again on the same journal and store, it picks up where the last watcher left off. It
  adopts the attempt that was watched, without recording its incidents again. It takes the
  steps of an incident's plan that have no action yet (`_pick_up_plan`). It waits for the
  attempt that a requeue announced.

`WatchFleet` runs one watcher per job in one thread: one job (`--job J`), or every job whose id
matches a glob (`--jobs 'prod-*'`), found as they start to report. Each poll reads one job through
the store's per-job queries and window summaries. The watchers are polled in turn, earliest due
first.

A watcher never stops or starts a rank itself. Its state is written as `watch HOST:PID`, so a
supervised job (`tracehound run`) is never watched as well: two controllers would record its
incidents twice.
"""

from __future__ import annotations

import enum
import fnmatch
import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tracehound.analysis.observation import Observation, load_observation
from tracehound.analysis.snapshot import SAMPLES_HORIZON_S, JobSnapshot
from tracehound.analysis.verdict import Verdict
from tracehound.controller.actions.observe import NOT_ACTED
from tracehound.controller.actions.port import IncidentActions, ends_attempt
from tracehound.controller.alerts import Alert
from tracehound.controller.journal import JOURNAL_FILE
from tracehound.controller.orchestrators.port import AttemptPlan, NodePool
from tracehound.controller.orchestrators.watched import (
    UNKNOWN_NODE,
    AttemptEnd,
    WatchedRanks,
    attempt_end,
    known_nodes,
    placement,
)
from tracehound.controller.policy.recovery import SOFT_KINDS, PlannedAction, observe_only
from tracehound.controller.supervision.jobstate import (
    ACTING,
    WATCHING,
    History,
    controller_id,
    done_steps,
    episode_of,
    last_incident_number,
    plan_from_json,
    read_history,
)
from tracehound.controller.supervision.supervisor import (
    GO_ON,
    AttemptWatch,
    JobSpec,
    RunResult,
    Supervisor,
    SupervisorSettings,
    _episode,
)
from tracehound.tracing.errors import StoreError
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Heartbeat,
    Incident,
    IncidentKind,
    JobPhase,
    JobState,
    ProcessGroupInfo,
    ProcessSample,
    now_us,
)
from tracehound.tracing.ids import JobId, NodeId
from tracehound.tracing.jobs import TERMINAL
from tracehound.tracing.store import TraceStore

log = logging.getLogger(__name__)

WATCHER_MARK = "watch "
"""How the `controller` of a watcher's job states begins (`watch HOST:PID`)."""

_US = 1_000_000

_QUIET_KINDS = frozenset({*SOFT_KINDS, IncidentKind.STALL})
"""Incident kinds that leave a job that ended after them `finished` (nothing was wrong enough
with it to call its end a failure)."""

_BEHIND_S = 5.0
"""How far behind now the newest report of an attempt is before the watcher says so."""

_DECAY = 0.98
"""How much of the fleet's step time counts again at the next step (about the last 50 steps
count): its share of time on window summaries."""

_GROUPS_EVERY_S = 30.0
"""How often a watcher reads the process groups of the attempt it watches again."""

_UNSPARED = 2**31 - 1
"""The spare nodes a watched job has, as the policy sees them: its scheduler finds replacements
(or keeps the job queued), so the watcher never withholds an eviction for want of spares; the
policy's isolation limits still bound it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchSettings:
    supervisor: SupervisorSettings = field(
        default_factory=lambda: SupervisorSettings(poll_s=1.0, summaries_every_s=10.0))
    """Detection, policy and the poll interval, as for a supervised job. The window summaries
    (soft faults) are read once a detection window, not every 2 s: a soft fault is counted at
    most once a window anyway, and they are most of what a poll costs the store."""
    silent_after_s: float = 60.0
    """An attempt of which nothing (no heartbeat, no process sample) has reported for this long
    stopped reporting: it is over. Also how fresh a report must be for a job to count as
    running when the watch begins."""
    end_grace_s: float = 15.0
    """How long after an attempt ended a newer attempt of the job may take to report (its
    launcher restarting it) before the job has ended."""
    discover_s: float = 5.0
    """How often the store is asked for jobs (and for a waited-for job's attempts)."""
    summaries_share: float = 0.5
    """A fleet that falls behind (more jobs than the store answers for at the poll interval)
    spends at most this share of its time on polls that read window summaries (soft faults),
    so that the snapshot polls (hangs, crashes) of every job go on."""


class EventKind(enum.StrEnum):
    """What a watcher says (one line of text, or one JSON object with `--json`)."""

    WAITING = "waiting"
    """No job (or no attempt) to watch reports yet."""
    WATCHING = "watching"
    """An attempt reports: its ranks and nodes."""
    INCIDENT = "incident"
    ACTION = "action"
    RESTARTED = "restarted"
    """A newer attempt of the job reports."""
    ENDED = "ended"
    """The job ended: how (`exited` or `stopped reporting`) and after how long."""
    SKIPPED = "skipped"
    """A matching job that another controller supervises is not watched."""
    STOPPED = "stopped"
    """The watcher was stopped (Ctrl-C, SIGTERM); the jobs run on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WatchEvent:
    kind: EventKind
    job: str
    time_us: int
    text: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"event": self.kind.value, "job": self.job,
                "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(self.time_us / _US))
                + f".{self.time_us % _US // 1000:03d}Z", **self.data}


OnEvent = Callable[[WatchEvent], object]


class _Phase(enum.Enum):
    WAITING = "waiting for an attempt that reports"
    WATCHING = "watching an attempt"
    ENDING = "an attempt ended; a newer one may yet report"
    DONE = "the job ended"


def incident_data(incident: Incident) -> dict[str, Any]:
    return {"incident": incident.incident_id, "attempt": incident.attempt,
            "kind": incident.kind, "culprit_ranks": list(incident.culprit_ranks),
            "culprit_nodes": list(incident.culprit_nodes),
            "confidence": round(incident.confidence, 4), "summary": incident.summary}


def action_data(action: Action) -> dict[str, Any]:
    return {"incident": action.incident_id, "action": ActionKind(action.kind).value,
            "target": action.target, "ok": action.ok, "rule": action.rule,
            "detail": action.detail}


class Watcher(Supervisor):
    """The detection loop over one job Tracehound did not launch (see the module docstring).
    Drive it with `start()`, then `step()` until it returns None, then `close()`."""

    def __init__(
        self,
        *,
        job: JobId,
        store: TraceStore,
        actions: IncidentActions,
        settings: WatchSettings | None = None,
        workdir: Path | None = None,
        clock: Callable[[], int] = now_us,
        sleep: Callable[[float], None] = time.sleep,
        notify: Callable[[Alert], object] | None = None,
        on_event: OnEvent | None = None,
    ) -> None:
        """`workdir` holds the job's journal and incident evidence (None: in memory only,
        lost with the process: a watcher started again would act again)."""
        self.watch_settings = settings or WatchSettings()
        self._pids: dict[int, int] = {}
        super().__init__(
            spec=JobSpec(job=job, command=(), nnodes=0, nproc_per_node=0),
            store=store, orchestrator=WatchedRanks(pids=lambda: self._pids),
            settings=self.watch_settings.supervisor, clock=clock, sleep=sleep,
            evidence_dir=workdir / "incidents" if workdir is not None else None,
            journal_path=workdir / JOURNAL_FILE if workdir is not None else None,
            notify=notify,
        )
        self.controller = WATCHER_MARK + controller_id()
        self.actions = actions
        self.on_event = on_event
        self._phase = _Phase.WAITING
        self._min_attempt = 0
        """The attempt a waiting watcher looks for at least (the next one after a requeue)."""
        self._adopting: int | None = None
        """The attempt an earlier watcher watched, to be adopted without recording again."""
        self._watch: AttemptWatch | None = None
        self._watch_began_us = 0
        self._acted: set[tuple[object, ...]] = set()
        """Faults (kind, culprit ranks) whose acting plan was dealt with (carried out, or
        recorded as not done) since the job was last calm."""
        self._ending: tuple[AttemptEnd, int] | None = None
        self._hung: set[tuple[int, ...]] = set()
        """The culprit ranks of the hard incidents since the job was last calm: a stall of the
        same ranks is their hang ending (the rank goes on again), no new incident."""
        self._unresolved: list[Incident] = []
        """Hard incidents (not soft faults, not stalls) of the watched attempt that the job has
        not recovered from yet (it has not been calm for a window since)."""
        self._said_waiting = ""
        self._history: History | None = None
        self.ended: AttemptEnd | None = None
        """How the job ended, once it has."""
        self.outcome = ""
        """Why the watch ended, in words."""
        self.behind = False
        """Set by the fleet while it is behind and its share of time on window summaries is
        used up: this poll reads none (`WatchSettings.summaries_share`)."""
        self._said_behind = False
        self._groups: tuple[int, int, tuple[ProcessGroupInfo, ...]] | None = None
        """The watched attempt's process groups, until when they are read again."""
        self._found: tuple[int, int] | None = None
        """An attempt found reporting before the first step (the fleet's discovery)."""
        self.polls = 0
        """Polls of a watched attempt (each reads and diagnoses one observation)."""
        self.summarized = 0
        """Those of them that read the window summaries too (soft faults)."""
        self.poll_times: list[int] = []
        """When the first 10,000 of those polls were taken."""

    # -- driving --------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._phase is _Phase.DONE

    def start(self, reporting: tuple[int, int] | None = None) -> None:
        """Write what an earlier watcher journaled, and pick the job up where it left it.
        `reporting`: (attempt, newest heartbeat) of an attempt already found reporting."""
        self._found = reporting
        self.outbox.flush(force=True)
        history = read_history(self.store, self.spec.job,
                               [e.record for e in self.outbox.pending()])
        self._history = history
        latest = history.latest
        self._ids = itertools.count(last_incident_number(history.incidents) + 1)
        self._seq, self._state = (latest.seq, latest) if latest is not None else (0, None)
        if latest is None or latest.state in TERMINAL:
            return  # a fresh watch: the newest attempt that reports
        self.log.warning("picking the job up where controller %s left it: %s, attempt %d%s",
                         latest.controller or "?", latest.state.value, latest.attempt,
                         f", incident {latest.incident_id}" if latest.incident_id else "")
        drained = {a.target for i in history.incidents for a in i.actions
                   if ActionKind(a.kind) is ActionKind.ISOLATE_NODE and a.ok}
        self._nodes(latest.nodes, {*latest.isolated, *drained})
        self._restore(history, latest)
        self._min_attempt = latest.attempt
        if latest.state in WATCHING:
            self._adopting = latest.attempt
            noted = history.incident(latest.incident_id) if latest.incident_id else None
            if noted is not None and _kind(noted.kind) not in _QUIET_KINDS:
                self._unresolved.append(noted)
        elif latest.state in ACTING:
            self._adopting = latest.attempt
            self._pick_up_plan(history, latest)
        # restarting: the attempt the requeue announced is waited for

    def step(self) -> float | None:
        """One step: a poll of the watched attempt (or a look for one). Seconds until the next
        step is due; None once the job ended."""
        if self._phase is _Phase.DONE:
            return None
        if self._phase is _Phase.WATCHING:
            self._step_watching()
        elif self._phase is _Phase.ENDING:
            self._step_ending()
        else:
            self._step_waiting()
        return self._next_step_s()

    def _next_step_s(self) -> float | None:
        """Seconds until the next step in the phase the watcher is in; None when done."""
        if self._phase is _Phase.DONE:
            return None
        if self._phase is _Phase.WATCHING:
            return self.settings.poll_s
        if self._phase is _Phase.ENDING:
            return min(self.settings.poll_s * 2, self.watch_settings.discover_s)
        return self.watch_settings.discover_s

    def close(self, drain_s: float | None = None) -> None:
        """Give the store a last chance at what is journaled (the rest waits in the journal for
        the next watcher), and close the action adapter."""
        try:
            self.actions.close()
        finally:
            if drain_s is not None and not self.outbox.drain(drain_s, self.sleep):
                self.log.error("%d records could not be stored in %s yet; they wait in the "
                               "journal %s for the next watcher of this job",
                               len(self.outbox.pending()), self.store.url,
                               self.journal.path or "(memory only: lost)")
            elif drain_s is None:
                self._drain_journal()

    def run(self) -> RunResult:
        """Watch until the job ends (blocking; a `WatchFleet` drives several at once)."""
        self.start()
        try:
            while (delay := self.step()) is not None:
                self.sleep(delay)
        finally:
            self.close()
        last = self._state.attempt if self._state is not None else 0
        finished = self._state is not None and self._state.state is JobPhase.FINISHED
        return RunResult(job=self.spec.job, completed=finished, attempts=last + 1,
                         incidents=tuple(self._incidents), reason=self.outcome)

    # -- finding the attempt --------------------------------------------------------------------
    def _reporting_attempt(self) -> tuple[int, int] | None:
        """The newest attempt (at least `_min_attempt`) whose ranks reported within
        `silent_after_s`, with the time of its newest heartbeat; None when none does."""
        now = self.clock()
        fresh_us = now - int(self.watch_settings.silent_after_s * _US)
        attempts = [a for a in self.store.attempts(self.spec.job) if a >= self._min_attempt]
        for attempt in reversed(attempts[-2:]):  # the newest two: a restart's overlap
            beats = self.store.latest_heartbeats(self.spec.job, attempt)
            newest = max((hb.time_us for hb in beats), default=0)
            if newest >= fresh_us:
                return attempt, newest
        return None

    def _step_waiting(self) -> None:
        try:
            found, self._found = self._found or self._reporting_attempt(), None
            if found is not None and found[0] < self._min_attempt:
                found = self._reporting_attempt()
            if found is not None:
                self._adopt(found[0])
            elif self._adopting is not None:
                # an earlier watcher watched an attempt that reports no more: it ended unwatched
                self._end_unwatched(self._adopting)
            else:
                self._say_waiting()
        except StoreError as exc:
            self.log.warning("store unavailable; looking for the job again later: %s", exc)

    def _say_waiting(self) -> None:
        """Say once (and again when it changes) why nothing is watched yet."""
        attempts = self.store.attempts(self.spec.job)
        if not attempts:
            why = (f"job {self.spec.job} has no records in {self.store.url} yet; waiting for it "
                   "to report")
        else:
            beats = self.store.latest_heartbeats(self.spec.job, attempts[-1])
            newest = max((hb.time_us for hb in beats), default=0)
            ago = f"{(self.clock() - newest) / _US:.0f} s ago" if newest else "never"
            why = (f"job {self.spec.job} does not report: its attempt {attempts[-1]} last "
                   f"reported {ago}; waiting for it to report again")
        if why != self._said_waiting:
            self._said_waiting = why
            self._event(EventKind.WAITING, why, reason=why)

    def _adopt(self, attempt: int) -> None:
        """Watch `attempt` from now on."""
        picked_up = self._adopting is not None
        if self._adopting is not None and attempt == self._adopting and self._history is not None:
            self._remember(self._history, attempt)
        elif self._adopting is not None or (self._state is not None and self._state.state
                                            not in TERMINAL and attempt > self._state.attempt):
            self._set_state(JobPhase.RESTARTING, attempt, incident_id=self._acting_on(),
                            detail=f"attempt {attempt} reports: restarted by its launcher while "
                                   "no watcher watched it" if picked_up else
                                   f"attempt {attempt} reports")
        if not picked_up:
            self._acted.clear()  # another attempt: its faults are new
            self._hung.clear()
        self._adopting = None
        self._unresolved = [i for i in self._unresolved if i.attempt == attempt]
        now = self.clock()
        snapshot_nodes: dict[int, str] = {}
        try:
            snapshot = JobSnapshot(
                job=self.spec.job, attempt=attempt, now_us=now,
                heartbeats=tuple(self.store.latest_heartbeats(self.spec.job, attempt)),
                groups=tuple(self.store.groups(self.spec.job, attempt)))
            snapshot_nodes = placement(snapshot)
            self._pids = {int(hb.rank): int(hb.pid) for hb in snapshot.heartbeats}
        except StoreError as exc:
            self.log.warning("store unavailable while adopting attempt %d: %s", attempt, exc)
        plan = AttemptPlan(job=self.spec.job, attempt=attempt, nodes=(), nproc_per_node=0,
                           command=())
        self._watch = AttemptWatch(plan=plan, started_us=now, rank_nodes=snapshot_nodes,
                                   trains_since_us=now)
        self._watch_began_us = now
        self._min_attempt = attempt
        self._ending = None
        nodes = known_nodes(snapshot_nodes)
        self._nodes(nodes, self.pool.isolated)
        state = self._state
        if state is None or state.state in TERMINAL or state.attempt != attempt or (
                state.state is JobPhase.RESTARTING):
            self._set_state(JobPhase.RUNNING, attempt, nodes=self.pool.current)
        self._phase = _Phase.WATCHING
        unreported = sum(n == UNKNOWN_NODE for n in snapshot_nodes.values())
        # ranks a group names that have not reported yet (a launcher starts them apart): their
        # nodes come in with their first reports, into the job's nodes, not into this event
        not_yet = f", {unreported} rank(s) not reported yet" if unreported else ""
        self._event(EventKind.WATCHING,
                    f"watching job {self.spec.job} attempt {attempt}: {len(snapshot_nodes)} "
                    f"ranks on {len(nodes)} node(s) ({', '.join(nodes)}{not_yet}); actions: "
                    f"{self.actions.describe()}",
                    attempt=attempt, ranks=len(snapshot_nodes), nodes=nodes,
                    unreported=unreported, picked_up=picked_up)

    def _nodes(self, current: Any, isolated: Any) -> None:
        """The pool the job's states name: its current nodes and those isolated (drained)."""
        current = [NodeId(n) for n in current]
        isolated = {NodeId(n): (isolated.get(n, "") if isinstance(isolated, dict) else
                                "isolated by an earlier watcher") for n in isolated}
        self.pool = NodePool(sorted(set(current) | set(isolated)))
        self.pool.restore(current, isolated)

    def _healthy_spares(self) -> int:
        return _UNSPARED

    def _observe(self, watch: AttemptWatch, *, now_us: int, summaries: bool,
                 since_us: int) -> Observation:
        """As a supervisor reads it, but for the process groups: read once a while (they are
        created as a job starts, and one watcher polls many jobs)."""
        job, attempt = watch.plan.job, watch.plan.attempt
        cached = self._groups
        if cached is None or cached[0] != attempt or now_us >= cached[1]:
            groups = tuple(self.store.groups(job, attempt))
            cached = self._groups = (attempt, now_us + int(_GROUPS_EVERY_S * _US), groups)
        since = now_us - int(SAMPLES_HORIZON_S * _US)
        heartbeats = tuple(self.store.latest_heartbeats(job, attempt))
        processes = tuple(self.store.latest_processes(job, attempt, since))
        as_of = self._as_of(now_us, [*heartbeats, *processes])
        snapshot = JobSnapshot(
            job=job, attempt=attempt, now_us=as_of, heartbeats=heartbeats,
            exits=tuple(self.store.exits(job, attempt)), groups=cached[2],
            expected_ranks=dict(watch.rank_nodes), processes=processes,
            stacks=tuple(self.store.latest_stacks(job, attempt, since)))
        return load_observation(
            self.store, job=job, attempt=attempt, now_us=as_of,
            window_s=self.settings.window_s, expected_ranks=watch.rank_nodes,
            summaries=summaries, since_us=since_us, snapshot=snapshot,
            uneven_ops=self.settings.detection.mismatch.size_exempt_ops)

    def _as_of(self, now_us: int, reports: list[Heartbeat | ProcessSample]) -> int:
        """The time the poll judges the attempt at: now, or the newest report of the attempt
        when the store holds nothing newer. What reaches the store late (a node agent's
        shipping delay, a busy store) then delays a verdict, but it cannot make every rank look
        silent, nor make its peers' waits look longer than the records show. A rank that stops
        reporting while the others go on is judged as before."""
        newest = max((r.time_us for r in reports), default=0)
        if not newest:
            return now_us
        as_of = min(now_us, newest)
        behind_s = (now_us - as_of) / _US
        if behind_s >= _BEHIND_S and not self._said_behind:
            self.log.warning("the store's newest report of attempt %d is %.1f s old: its ranks "
                             "are judged as of then", reports[0].attempt, behind_s)
        self._said_behind = behind_s >= _BEHIND_S
        return as_of

    def _summaries_due(self, now_us: int, judged_from_us: int, last_us: int) -> bool:
        return not self.behind and super()._summaries_due(now_us, judged_from_us, last_us)

    # -- watching -------------------------------------------------------------------------------
    def _step_watching(self) -> None:
        watch = self._watch
        assert watch is not None
        was = self._state.state if self._state is not None else None
        summarized = watch.last_summaries_us
        outcome = self._poll(watch, exited=False)
        self.polls += 1
        self.summarized += watch.last_summaries_us != summarized
        if len(self.poll_times) < 10_000:
            self.poll_times.append(self.clock())
        snapshot = watch.snapshot
        if snapshot is not None:
            learned = placement(snapshot, watch.rank_nodes)
            reported = known_nodes(learned)
            if set(reported) != set(self.pool.current):
                self._nodes(reported, self.pool.isolated)
            watch.rank_nodes = learned
            self._pids = {int(hb.rank): int(hb.pid) for hb in snapshot.heartbeats}
        if isinstance(outcome, tuple):
            self._act_on(*outcome)
        if self._phase is not _Phase.WATCHING:
            return
        now = self.clock()
        if was in (JobPhase.SUSPECT, JobPhase.STALLED) and self._state is not None and (
                self._state.state is JobPhase.RUNNING):
            self._resolve_open()  # the job trains again: its incidents resolve
            self._unresolved = []
            self._acted.clear()  # a fault seen again from now on is a new one
            self._hung.clear()
        if outcome is GO_ON and snapshot is not None:
            end = attempt_end(snapshot, watch.rank_nodes, now_us=now,
                              silent_after_s=self.watch_settings.silent_after_s)
            if end is not None:
                self._ending = (end, now)
                self._phase = _Phase.ENDING
                self.log.info("attempt %d is over: %s; a newer attempt may still report "
                              "within %.0f s", watch.plan.attempt, end.words(now),
                              self.watch_settings.end_grace_s)

    def _act_on(self, verdict: Verdict, steps: tuple[PlannedAction, ...]) -> None:
        """A verdict the policy would act on: dealt with once until the job is calm again. (Its
        kind and culprits name it: as more peers reach the collective they wait in, the
        evidence changes, the fault does not.)"""
        key = _fault(verdict.kind.value, verdict.culprit_ranks)
        if key in self._acted:
            return
        self._acted.add(key)
        self._recorded.add(_episode(verdict))
        self._recover(verdict, steps)

    def _recover(self, verdict: Verdict, plan: tuple[PlannedAction, ...]) -> str | None:
        """The incident, with the action port's steps for the policy's plan."""
        ranks = tuple(int(r) for r in verdict.culprit_ranks)
        if verdict.kind is IncidentKind.STALL and ranks in self._hung:
            # the hung rank goes on (SIGCONT, a blip that passed): for a moment it reports
            # outside collectives while its peers still wait where the hang held them
            self.log.info("rank %s goes on: its peers' wait (a hang already recorded) ends",
                          ", ".join(map(str, ranks)))
            return None
        if verdict.kind is IncidentKind.HANG and not ranks and self._hung:
            # or it goes on inside the collective it froze in: for a moment every member
            # reports waiting there, none lagging, until the call completes (seen: an
            # unlocalized hang 0.6 s after the hang of a SIGSTOPped rank that was continued)
            self.log.info("every rank waits in one collective just after rank(s) %s, hung, "
                          "went on: that hang ending, no new incident",
                          "; ".join(",".join(map(str, r)) for r in sorted(self._hung)))
            return None
        if _kind(verdict.kind.value) not in _QUIET_KINDS:
            self._hung.add(ranks)
        steps = self.actions.plan(verdict, plan)
        gave_up = super()._recover(verdict, steps)
        incident = self._incidents[-1]
        if _kind(incident.kind) not in _QUIET_KINDS:
            self._unresolved.append(incident)
        self._event(EventKind.INCIDENT,
                    f"incident {incident.incident_id}: {incident.kind} "
                    f"{_culprits(incident)} (confidence {incident.confidence:.2f}): "
                    f"{incident.summary}", **incident_data(incident),
                    plan=[{"action": s.kind.value, "target": s.target, "rule": s.rule}
                          for s in steps])
        for action in incident.actions:
            self._action_event(action)
        self._after_plan(incident, steps)
        return gave_up

    def _after_plan(self, incident: Incident, steps: tuple[PlannedAction, ...]) -> None:
        """Where the job is once an incident's steps are taken: requeued (the next attempt is
        waited for), cancelled (the watch ends), or left as it is."""
        taken = [a for a in incident.actions if a.ok]
        kinds = {ActionKind(a.kind) for a in taken}
        attempt = incident.attempt
        if ActionKind.GIVE_UP in kinds:
            self._finish(JobPhase.FAILED, attempt,
                         f"cancelled after incident {incident.incident_id} "
                         f"({incident.kind}): {incident.summary}", how="cancelled")
            return
        if ActionKind.RESTART in kinds:
            self._min_attempt = attempt + 1
            self._restart_times.append(self.clock())
            self._set_state(JobPhase.RESTARTING, attempt + 1, incident_id=incident.incident_id,
                            detail=f"requeued after incident {incident.incident_id}; waiting "
                                   f"for attempt {attempt + 1} to report")
            self._watch = None
            self._phase = _Phase.WAITING
            return
        if observe_only(steps) or self._state is None:
            return  # the supervisor's own observation: suspect or stalled already
        if ends_attempt(steps):
            self.log.error("incident %s: its %s failed; the job runs on as it is",
                           incident.incident_id,
                           "requeue" if any(s.kind is ActionKind.RESTART for s in steps)
                           else "cancel")
        kind = _kind(incident.kind)
        phase = JobPhase.STALLED if kind in (IncidentKind.STALL, IncidentKind.HANG,
                                             IncidentKind.SILENT_HANG) else JobPhase.SUSPECT
        self._set_state(phase, attempt, incident_id=incident.incident_id,
                        detail="the incident's steps are taken; the job runs on as it is")

    def _act(self, step: PlannedAction, incident: Incident) -> tuple[bool, str]:
        if step.kind is ActionKind.OBSERVE:
            return super()._act(step, incident)
        self.log.info("action %s %s for incident %s: %s", step.kind.value, step.target,
                      incident.incident_id, step.reason)
        outcome = self.actions.take(step, incident)
        if outcome.ok and step.kind is ActionKind.ISOLATE_NODE:
            self._isolation_times.append(self.clock())
            self.pool.isolate(NodeId(step.target), step.reason)
        if not outcome.ok:
            self.log.error("action %s %s for incident %s failed: %s", step.kind.value,
                           step.target, incident.incident_id, outcome.detail)
        return outcome.ok, outcome.detail

    def _action_event(self, action: Action) -> None:
        kind = ActionKind(action.kind).value
        self._event(EventKind.ACTION,
                    f"incident {action.incident_id}: {kind} {action.target} "
                    f"{'done' if action.ok else 'FAILED'}: {action.detail}",
                    **action_data(action))

    # -- picking up ------------------------------------------------------------------------------
    def _pick_up_plan(self, history: History, latest: JobState) -> None:
        """Take the steps of the plan an earlier watcher journaled that have no action yet."""
        plan = plan_from_json(latest.plan)
        incident = self._incident_of(history, latest)
        taken = [a for a in history.actions_of(latest.incident_id)
                 if ActionKind(a.kind) is not ActionKind.ALERT]
        done = done_steps(plan, taken)
        self.log.warning("incident %s: %d of the %d steps of its plan were taken by the earlier "
                         "watcher; taking the rest", latest.incident_id, sum(done), len(plan))
        actions = self._carry_out(incident, latest.attempt, plan,
                                  after_us=max((a.time_us for a in taken), default=0), done=done)
        full = msgspec.structs.replace(incident, actions=(*incident.actions, *actions))
        self._incidents.append(full)
        if _kind(full.kind) not in _QUIET_KINDS:
            self._unresolved.append(full)
        key = episode_of(full)  # dealt with now: not again when its attempt is adopted
        self._acted.add(_fault(full.kind, full.culprit_ranks))
        self._recorded.add(key)
        if _kind(full.kind) not in _QUIET_KINDS:
            self._hung.add(tuple(int(r) for r in full.culprit_ranks))
        for action in actions:
            self._action_event(action)
        self._after_plan(full, plan)
        if self._phase is _Phase.WAITING and self._min_attempt > latest.attempt:
            self._adopting = None  # requeued: the next attempt is a new one

    def _remember(self, history: History, attempt: int) -> None:
        """The incidents of the adopted attempt: recorded, and, unless the job was calm again
        since (running), dealt with: not again."""
        self._remember_watched(history, attempt)
        calm = self._state is not None and self._state.state is JobPhase.RUNNING
        for incident in history.incidents:
            if incident.attempt != attempt:
                continue
            if _dealt_with(incident) and not calm:
                self._acted.add(_fault(incident.kind, incident.culprit_ranks))
            if _kind(incident.kind) not in _QUIET_KINDS and not calm:
                self._hung.add(tuple(int(r) for r in incident.culprit_ranks))

    # -- the end ----------------------------------------------------------------------------------
    def _step_ending(self) -> None:
        assert self._ending is not None and self._watch is not None
        end, since = self._ending
        attempt = self._watch.plan.attempt
        try:
            newer = self._reporting_attempt()
            if newer is not None and newer[0] > attempt:
                self._event(EventKind.RESTARTED,
                            f"job {self.spec.job}: attempt {newer[0]} reports (attempt "
                            f"{attempt} {end.words(self.clock())})", attempt=newer[0],
                            previous=attempt, how=end.how)
                self._adopt(newer[0])
                return
            if newer is not None and end.how == "stopped reporting" and newer[1] > end.at_us:
                self.log.info("attempt %d reports again", attempt)
                self._ending = None
                self._phase = _Phase.WATCHING
                return
        except StoreError as exc:
            self.log.warning("store unavailable; the end of attempt %d is decided later: %s",
                             attempt, exc)
            return
        if self.clock() - since < int(self.watch_settings.end_grace_s * _US):
            return
        self._job_ended(end, attempt)

    def _job_ended(self, end: AttemptEnd, attempt: int) -> None:
        now = self.clock()
        hard = [i for i in self._unresolved if i.attempt == attempt]
        watched = max(0.0, (end.at_us - self._watch_began_us) / _US)
        words = f"{end.words(now)}, {watched:.1f} s after the watch of attempt {attempt} began"
        if end.how == "exited" and not hard:
            self._resolve_open()
            phase = JobPhase.FINISHED
        else:
            phase = JobPhase.FAILED
            if hard:
                words += f"; after incident {hard[-1].incident_id} ({hard[-1].kind})"
        self.ended = end
        self._finish(phase, attempt, words, how=end.how, after_s=round(watched, 1),
                     ranks=end.ranks,
                     silent_s=round((now - end.at_us) / _US, 1)
                     if end.how == "stopped reporting" else None)

    def _end_unwatched(self, attempt: int) -> None:
        """The attempt an earlier watcher watched reports no more: it ended while none did."""
        self._finish(JobPhase.FAILED, attempt,
                     f"attempt {attempt} stopped reporting while no watcher watched it (nothing "
                     f"from it within {self.watch_settings.silent_after_s:.0f} s)",
                     how="stopped reporting", after_s=None, ranks=None, silent_s=None)

    def _finish(self, phase: JobPhase, attempt: int, words: str, **data: Any) -> None:
        self._set_state(phase, attempt, detail=words[:4000])
        self.outcome = words
        self._phase = _Phase.DONE
        self._event(EventKind.ENDED, f"job {self.spec.job} {phase.value}: {words}",
                    attempt=attempt, state=phase.value, **data)

    # -- saying ----------------------------------------------------------------------------------
    def _event(self, what: EventKind, text: str, /, **data: Any) -> None:
        if what not in (EventKind.INCIDENT, EventKind.ACTION):  # the supervisor logs those
            self.log.info("%s", text)
        if self.on_event is None:
            return
        try:
            self.on_event(WatchEvent(kind=what, job=self.spec.job, time_us=self.clock(),
                                     text=text, data=data))
        except Exception:  # a failing printer must not stop the watch
            self.log.exception("could not report a %s event", what.value)


def _kind(value: str) -> IncidentKind | None:
    try:
        return IncidentKind(value)
    except ValueError:
        return None


def _culprits(incident: Incident) -> str:
    if not incident.culprit_ranks:
        return "(not localized)"
    ranks = ", ".join(str(r) for r in incident.culprit_ranks)
    nodes = ", ".join(incident.culprit_nodes)
    return f"rank{'s' if len(incident.culprit_ranks) > 1 else ''} {ranks} on {nodes}"


def _fault(kind: str, culprit_ranks: tuple[int, ...]) -> tuple[object, ...]:
    """What a verdict the policy acts on is about, for `Watcher._act_on`."""
    return (kind, tuple(int(r) for r in culprit_ranks))


def _dealt_with(incident: Incident) -> bool:
    """Whether an incident's plan acted on the job, or stood for an acting plan not carried
    out (its episode is not acted on again)."""
    for action in incident.actions:
        kind = ActionKind(action.kind)
        if kind in (ActionKind.ALERT, ActionKind.RESUMED, ActionKind.COMMAND):
            continue  # (a command runs for every incident, acted on or only observed)
        if kind is not ActionKind.OBSERVE or action.detail.startswith(NOT_ACTED):
            return True
    return False


# -- many jobs ----------------------------------------------------------------------------------

class WatchFleet:
    """Watchers of one job, or of every job matching a glob, in one thread."""

    def __init__(
        self,
        *,
        store: TraceStore,
        make_watcher: Callable[[JobId], Watcher],
        job: str | None = None,
        pattern: str | None = None,
        settings: WatchSettings | None = None,
        clock: Callable[[], int] = now_us,
        sleep: Callable[[float], None] = time.sleep,
        on_event: OnEvent | None = None,
    ) -> None:
        if (job is None) == (pattern is None):
            raise ValueError("watch one job (job) or the jobs matching a glob (pattern)")
        self.store = store
        self.make_watcher = make_watcher
        self.job = job
        self.pattern = pattern
        self.settings = settings or WatchSettings()
        self.clock = clock
        self.sleep = sleep
        self.on_event = on_event
        self.watchers: dict[str, Watcher] = {}
        self._due: list[tuple[int, int, str]] = []
        self._order = itertools.count()
        self._ended: dict[str, int] = {}
        """Jobs whose watch ended, with when: watched again only once they report anew."""
        self._skipped: set[str] = set()
        self._next_discovery_us = 0
        self._said_nothing = ""
        self.polls = 0
        """Steps taken (polls of watched attempts and looks for attempts)."""
        self._steps_s = 0.0
        self._summaries_s = 0.0
        """The time the recent steps took, and the part of it in steps that read window
        summaries (each decaying by `_DECAY` a step)."""

    def __iter__(self) -> Iterator[Watcher]:
        return iter(list(self.watchers.values()))

    def start(self) -> None:
        if self.job is not None:
            self._watch(self.job)

    def step(self) -> float | None:
        """Take every step that is due; seconds until the next one, None when nothing is left to
        watch (only with one job: a glob keeps looking for new jobs)."""
        now = self.clock()
        if self.pattern is not None and now >= self._next_discovery_us:
            self._discover()
            self._next_discovery_us = now + int(self.settings.discover_s * _US)
        due = []  # one pass: each due watcher steps once, then discovery gets its turn
        while self._due and self._due[0][0] <= now:
            at, _, job = heapq.heappop(self._due)
            due.append((at, job))
        late_us = int(self.settings.supervisor.poll_s * _US)
        for at, job in due:
            watcher = self.watchers.get(job)
            if watcher is None:
                continue
            watcher.behind = (self.clock() - at > late_us
                              and self._summaries_s > self.settings.summaries_share
                              * self._steps_s)
            started, summarized = time.monotonic(), watcher.summarized
            delay = watcher.step()
            took = time.monotonic() - started
            self._steps_s = self._steps_s * _DECAY + took
            self._summaries_s = (self._summaries_s * _DECAY
                                 + (took if watcher.summarized > summarized else 0.0))
            self.polls += 1
            if delay is None:
                self._retire(job)
            else:
                heapq.heappush(self._due, (self.clock() + int(delay * _US), next(self._order),
                                           job))
        if self.job is not None and not self.watchers:
            return None
        wake = [self._due[0][0]] if self._due else []
        if self.pattern is not None:
            wake.append(self._next_discovery_us)
        return max(0.0, (min(wake) - self.clock()) / _US) if wake else self.settings.discover_s

    def run(self) -> None:
        """Until the one job ends (with a glob: until interrupted)."""
        self.start()
        while (delay := self.step()) is not None:
            if delay > 0:
                self.sleep(delay)

    def close(self, drain_s: float = 10.0) -> None:
        """Close every watcher, sharing `drain_s` for what their journals still hold."""
        deadline = time.monotonic() + drain_s
        for watcher in list(self.watchers.values()):
            watcher.close(max(0.0, deadline - time.monotonic()))
        self.watchers.clear()

    def _watch(self, job: str, reporting: tuple[int, int] | None = None) -> None:
        watcher = self.make_watcher(JobId(job))
        self.watchers[job] = watcher
        watcher.start(reporting)
        heapq.heappush(self._due, (self.clock(), next(self._order), job))

    def _retire(self, job: str) -> None:
        watcher = self.watchers.pop(job)
        self._ended[job] = self.clock()
        watcher.close(self.settings.supervisor.journal_drain_s)

    def _discover(self) -> None:
        """Watch every matching job that reports and that no other controller supervises."""
        assert self.pattern is not None
        try:
            jobs = self.store.jobs()
        except StoreError as exc:
            log.warning("store unavailable; jobs matching %r are looked for again later: %s",
                        self.pattern, exc)
            return
        matching = [j for j in jobs if fnmatch.fnmatchcase(j, self.pattern)]
        for job in matching:
            if job in self.watchers or job in self._skipped:
                continue
            try:
                reporting = self._reports(job)
                if reporting is None:
                    continue
                other = supervised_by(self.store, JobId(job))
            except StoreError as exc:
                log.warning("store unavailable while looking at job %s: %s", job, exc)
                continue
            if other:
                self._skipped.add(job)
                self._say(EventKind.SKIPPED, job,
                          f"job {job} is not watched: {other}", reason=other)
                continue
            self._watch(job, reporting)
        if not self.watchers:
            self._nothing_to_watch(jobs, matching)

    def _nothing_to_watch(self, jobs: list[JobId], matching: list[JobId]) -> None:
        """Say (once, and again when it changes) why no job is watched."""
        def some(names: list[JobId]) -> str:
            return ", ".join(names[:10]) + (f" and {len(names) - 10} more"
                                            if len(names) > 10 else "")

        if not matching:
            words = (f"no job in {self.store.url} matches {self.pattern!r} yet ("
                     f"{'jobs there: ' + some(jobs) if jobs else 'the store holds no job'}); "
                     "waiting for one to report")
        else:
            words = (f"no job matching {self.pattern!r} reports now ({some(matching)}: none "
                     f"sent a heartbeat in the last {self.settings.silent_after_s:.0f} s, or "
                     "another controller supervises it); waiting for one to report")
        if words != self._said_nothing:
            self._said_nothing = words
            self._say(EventKind.WAITING, "", words, reason=words, pattern=self.pattern)

    def _reports(self, job: str) -> tuple[int, int] | None:
        """(its newest attempt, that attempt's newest heartbeat) if the job sent a heartbeat
        lately (and since its last watch ended); None if it did not."""
        attempts = self.store.attempts(JobId(job))
        if not attempts:
            return None
        beats = self.store.latest_heartbeats(JobId(job), attempts[-1])
        newest = max((hb.time_us for hb in beats), default=0)
        fresh = self.clock() - int(self.settings.silent_after_s * _US)
        return (attempts[-1], newest) if newest >= max(fresh, self._ended.get(job, 0)) else None

    def _say(self, what: EventKind, job: str, text: str, /, **data: Any) -> None:
        log.info("%s", text)
        if self.on_event is not None:
            self.on_event(WatchEvent(kind=what, job=job, time_us=self.clock(), text=text,
                                     data=data))


def supervised_by(store: TraceStore, job: JobId) -> str:
    """Why `job` must not be watched: another controller than a watcher left it in a state that
    is not finished or failed ("" when it may be watched)."""
    states = store.job_states(job)
    if not states:
        return ""
    latest = states[-1]
    if latest.state in TERMINAL or latest.controller.startswith(WATCHER_MARK):
        return ""
    return (f"controller {latest.controller or '?'} supervises it (state {latest.state.value}, "
            f"attempt {latest.attempt}): watching it too would record its incidents twice")
