"""A job's state machine, kept in the store, so that a controller killed mid-incident and started
again carries on where the first one was, without acting twice.

    running ──> suspect ──> stalled ──> diagnosing ──> isolating ──> restarting ──> running
       │  ^────────┘  ^───────┘  │           │   └─────────────────────^   │
       └──────────────────────────────────────> finished / failed <──────┘

The supervisor writes each state through its journal (so it is on local disk before the
supervisor acts on it) to the store (`JobState`, table `job_states`) *before* doing what the state
announces: `diagnosing` carries the incident and its whole plan, `restarting` names the attempt
about to be launched. A controller started on the same job reads the latest state (the journal's
pending records are newer than the store's) and:

    running, suspect, stalled   adopts the attempt's ranks if they still run, else relaunches
    diagnosing, isolating       carries out the plan's steps that have no action stored yet
                                (actions are keyed by incident, kind and target), then goes on
    restarting                  adopts the new attempt if it was launched, else launches it
    finished, failed            (a new run of the job starts afresh)

What it needs besides the state comes from the store too: the isolated nodes (in every state),
the times of earlier restarts and isolations (the policy's limits), the last incident number.
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from tracehound.controller.policy.recovery import PlannedAction
from tracehound.tracing.errors import StoreError
from tracehound.tracing.events import Action, ActionKind, Incident, JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.jobs import TERMINAL, latest_run
from tracehound.tracing.store import HeldRecords, TraceStore

WATCHING = frozenset({JobPhase.RUNNING, JobPhase.SUSPECT, JobPhase.STALLED})
"""States in which an attempt runs and no action is under way."""
ACTING = frozenset({JobPhase.DIAGNOSING, JobPhase.ISOLATING})

NEXT: dict[JobPhase, frozenset[JobPhase]] = {
    JobPhase.RUNNING: frozenset({JobPhase.SUSPECT, JobPhase.STALLED, JobPhase.DIAGNOSING,
                                 JobPhase.RESTARTING, *TERMINAL}),
    # (suspect or stalled again: another incident observed before the first one's calm)
    JobPhase.SUSPECT: frozenset({JobPhase.RUNNING, JobPhase.SUSPECT, JobPhase.STALLED,
                                 JobPhase.DIAGNOSING, JobPhase.RESTARTING, *TERMINAL}),
    JobPhase.STALLED: frozenset({JobPhase.RUNNING, JobPhase.SUSPECT, JobPhase.STALLED,
                                 JobPhase.DIAGNOSING, JobPhase.RESTARTING, *TERMINAL}),
    # (suspect or stalled: a watcher that can only observe, or run a command, leaves the job
    # running as it is once the plan is carried out)
    JobPhase.DIAGNOSING: frozenset({JobPhase.ISOLATING, JobPhase.RESTARTING, JobPhase.SUSPECT,
                                    JobPhase.STALLED, *TERMINAL}),
    JobPhase.ISOLATING: frozenset({JobPhase.RESTARTING, *TERMINAL}),
    JobPhase.RESTARTING: frozenset({JobPhase.RUNNING, *TERMINAL}),
    JobPhase.FINISHED: frozenset({JobPhase.RUNNING}),
    JobPhase.FAILED: frozenset({JobPhase.RUNNING}),
}
"""Which state may follow which (`running` after a terminal state: a new run of the job)."""


def controller_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def plan_to_json(plan: Iterable[PlannedAction]) -> str:
    return json.dumps([{"kind": s.kind.value, "target": s.target, "reason": s.reason,
                        "rule": s.rule} for s in plan], separators=(",", ":"))


def plan_from_json(text: str) -> tuple[PlannedAction, ...]:
    """The plan `plan_to_json` wrote; ValueError naming what does not fit."""
    try:
        steps = json.loads(text) if text else []
        return tuple(PlannedAction(kind=ActionKind(s["kind"]), target=str(s["target"]),
                                   reason=str(s["reason"]), rule=str(s.get("rule", "")))
                     for s in steps)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"a stored plan is not a list of steps: {exc}: {text[:200]!r}") from exc


def done_steps(plan: Iterable[PlannedAction], actions: Iterable[Action]) -> list[bool]:
    """For each step of `plan`, whether an action of the incident already carried it out."""
    taken = {(ActionKind(a.kind), a.target) for a in actions}
    return [(s.kind, s.target) in taken for s in plan]


_NUMBER = re.compile(r"/(\d+)$")


def last_incident_number(incidents: Iterable[Incident]) -> int:
    """The largest trailing number of the incident ids (`JOB/ATTEMPT/N`), 0 without any."""
    numbers = [int(m.group(1)) for i in incidents if (m := _NUMBER.search(i.incident_id))]
    return max(numbers, default=0)


@dataclass(slots=True)
class History:
    """What the store (and the journal's pending records) hold of a job's run so far."""

    states: list[JobState] = field(default_factory=list)
    incidents: list[Incident] = field(default_factory=list)
    """With their actions."""

    @property
    def latest(self) -> JobState | None:
        return self.states[-1] if self.states else None

    @property
    def run(self) -> list[JobState]:
        """The states of the job's latest run: those after the last terminal state before the
        latest one."""
        return latest_run(self.states)

    @property
    def run_since_us(self) -> int:
        """When the latest run started (0 without any state)."""
        run = self.run
        return run[0].time_us if run else 0

    def actions_of(self, incident_id: str) -> list[Action]:
        return [a for i in self.incidents if i.incident_id == incident_id for a in i.actions]

    def incident(self, incident_id: str) -> Incident | None:
        return next((i for i in self.incidents if i.incident_id == incident_id), None)

    def times(self, kind: ActionKind, since_us: int = 0) -> list[int]:
        """When each action of `kind` of this run was taken (since the run's start)."""
        return sorted(a.time_us for i in self.incidents for a in i.actions
                      if ActionKind(a.kind) is kind and a.ok and a.time_us >= since_us)


def read_history(store: TraceStore, job: JobId, pending: Iterable[object]) -> History:
    """The job's states and incidents from the store plus the `pending` journaled records not
    yet in it (a store that cannot answer counts as empty: the journal then is all there is)."""
    history = History()
    try:
        history.states = list(store.job_states(job))
        history.incidents = list(store.incidents(job))
    except StoreError:
        pass
    held = HeldRecords(set(), set())  # what is stored, by the identities the outbox checks
    stored: list[Incident | Action | JobState] = [*history.states, *history.incidents]
    stored += [a for i in history.incidents for a in i.actions]
    for known in stored:
        held.add(known)
    by_id = {i.incident_id: i for i in history.incidents}
    extra_actions: list[Action] = []
    for record in pending:
        if getattr(record, "job", None) != job:
            continue
        if isinstance(record, JobState) and not held.has(record):
            history.states.append(record)
        elif isinstance(record, Incident):
            by_id.setdefault(record.incident_id, record)
        elif isinstance(record, Action) and not held.has(record):
            extra_actions.append(record)
    incidents = []
    for incident in by_id.values():
        more = tuple(a for a in extra_actions if a.incident_id == incident.incident_id)
        incidents.append(msgspec.structs.replace(incident, actions=incident.actions + more))
    history.incidents = sorted(incidents, key=lambda i: i.detected_at_us)
    history.states.sort(key=lambda s: (s.seq, s.time_us))
    return history


def episode_of(incident: Incident) -> tuple[object, ...]:
    """The episode key (`supervisor._episode`) of the verdict a stored incident was made of:
    kind, culprits, group and the collective the peers waited in."""
    try:
        verdict = json.loads(incident.verdict_json)
        group = str(verdict.get("group", ""))
        seq = max((int(e.get("seq", 0)) for e in verdict.get("evidence", ())
                   if e.get("fact") == "waiting"), default=0)
    except (ValueError, TypeError, AttributeError):
        group, seq = "", 0
    return (incident.kind, tuple(incident.culprit_ranks), group, seq)
