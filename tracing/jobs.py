"""What a job's stored states and incidents say about it: its latest run, its open incidents and
how much of its wall time it spent training. Read by `tracehound status` and by the dashboard;
pure functions over records, no store access.

A job id can be run again after it ended (`tracehound run --job-id` of a finished job): its
states then hold several runs, and "the latest run" is the states after the last terminal state
before the newest one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tracehound.tracing.events import ActionKind, Incident, JobPhase, JobState

TERMINAL = frozenset({JobPhase.FINISHED, JobPhase.FAILED})
TRAINING = frozenset({JobPhase.RUNNING, JobPhase.SUSPECT})
"""States in which the job trains: an attempt runs and makes progress (a suspect job still
trains; a stalled one waits)."""

_RESOLVING = frozenset({ActionKind.RESUMED})
_ACTING = frozenset({ActionKind.STOP_JOB, ActionKind.ISOLATE_NODE, ActionKind.RESTART,
                     ActionKind.GIVE_UP})


def latest_run(states: Sequence[JobState]) -> list[JobState]:
    """The states of the job's latest run, oldest first (`states` in the order written)."""
    starts = [i + 1 for i, s in enumerate(states[:-1]) if s.state in TERMINAL]
    return list(states[starts[-1] if starts else 0:])


def open_incidents(states: Sequence[JobState], incidents: Sequence[Incident]) -> list[Incident]:
    """The latest run's incidents that nothing has resolved: not followed by a resumed attempt,
    and either acted on or about the attempt that runs now (none once the job finished)."""
    run = latest_run(states)
    if not run or run[-1].state is JobPhase.FINISHED:
        return []
    latest, since = run[-1], run[0].time_us
    out = []
    for incident in incidents:
        kinds = {ActionKind(a.kind) for a in incident.actions}
        if incident.detected_at_us < since or kinds & _RESOLVING:
            continue
        if kinds & _ACTING or incident.attempt == latest.attempt:
            out.append(incident)
    return out


@dataclass(frozen=True, slots=True)
class TrainingTime:
    """How the latest run's wall time divides: time in a training state against all of it."""

    training_us: int
    wall_us: int

    @property
    def ratio(self) -> float | None:
        """Effective training time ratio; None before any time has passed."""
        return self.training_us / self.wall_us if self.wall_us > 0 else None


def training_time(states: Sequence[JobState], now_us: int) -> TrainingTime:
    """The latest run's time in `TRAINING` states against its wall time: from its first state to
    its terminal state, or to `now_us` while it has none. Each state lasts until the next one is
    written; launching, detecting, stopping, isolating and restarting count as lost time, as do
    stalls. A state written after `now_us` (a clock ahead of the reader's) counts from `now_us`."""
    run = latest_run(states)
    if not run:
        return TrainingTime(0, 0)
    end = run[-1].time_us if run[-1].state in TERMINAL else max(now_us, run[-1].time_us)
    training = 0
    for state, after in zip(run, [*run[1:], None], strict=True):
        until = after.time_us if after is not None else end
        if state.state in TRAINING:
            training += max(0, until - state.time_us)
    return TrainingTime(training_us=training, wall_us=max(0, end - run[0].time_us))
