"""Where a restart's time goes: from the fault to every rank's first step of the next attempt.

The supervisor notes the times it knows (the fault as it saw it, the verdict, the stop, the
launch); the ranks of the new attempt report the rest through their heartbeats and process
groups in the store: when each created its default process group (rendezvous done), finished
loading its checkpoint (`Heartbeat.resumed_us`) and finished its first step. A phase ends when
the last rank is through it, since training resumes only when every rank has.

    detect           fault -> verdict
    decide           verdict -> the stop begins
    tear_down        the stop (ranks signalled and reaped, node agents drained)
    relaunch         the launch call (processes spawned, or warm spares handed their ranks)
    rendezvous       launched -> every rank has its default process group
    checkpoint_load  -> every rank has loaded its checkpoint (0 when none was loaded)
    first_step       -> every rank has finished its first step

"The fault" is what the supervisor can know: the first failed exit for a crash, else the last
step the culprit ranks reached before they stopped progressing (an upper bound on how long
detection took: the rank froze some time after that step).
"""

from __future__ import annotations

from dataclasses import dataclass

from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Verdict
from tracehound.tracing.events import Heartbeat

PHASES = ("detect", "decide", "tear_down", "relaunch", "rendezvous", "checkpoint_load",
          "first_step")
"""The phases of a restart, in order."""


@dataclass(slots=True, kw_only=True)
class PendingRestart:
    """What the supervisor noted about a restart whose new attempt has not made a step yet."""

    incident_id: str
    attempt: int
    """The new attempt."""
    fault_us: int
    detected_us: int
    stop_begin_us: int = 0
    stop_end_us: int = 0
    launch_begin_us: int = 0
    launch_end_us: int = 0
    warm: int = 0
    """Ranks started from warm spares."""
    cold: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RestartTiming:
    """A restart measured through to every rank's first step."""

    incident_id: str
    attempt: int
    fault_us: int
    resumed_us: int
    """When the last rank of the new attempt finished its first step."""
    phases: dict[str, float]
    """Seconds per phase (`PHASES`, in order)."""
    warm: int
    cold: int

    @property
    def resume_s(self) -> float:
        """Fault to training resumed on every rank."""
        return (self.resumed_us - self.fault_us) / 1e6

    def describe(self) -> str:
        parts = ", ".join(f"{name} {s:.2f}" for name, s in self.phases.items())
        return (f"attempt {self.attempt} resumed {self.resume_s:.2f} s after the fault "
                f"({self.warm} ranks from warm spares, {self.cold} spawned): {parts} s")

    def to_json(self) -> dict[str, object]:
        return {"incident_id": self.incident_id, "attempt": self.attempt,
                "resume_s": round(self.resume_s, 3), "warm_ranks": self.warm,
                "cold_ranks": self.cold,
                "phases": {k: round(v, 3) for k, v in self.phases.items()}}


def fault_time(verdict: Verdict, snapshot: JobSnapshot | None) -> int:
    """When the fault behind `verdict` happened, as far as the supervisor can tell (us)."""
    if snapshot is not None:
        failed = [e.time_us for e in snapshot.exits if e.exit_code != 0]
        if failed:
            return min(failed)
        culprits = set(verdict.culprit_ranks)
        steps = [h.step_us for h in snapshot.heartbeats if h.rank in culprits and h.step_us]
        if steps:
            return max(steps)
    return verdict.observed_at_us


def measure(pending: PendingRestart, snapshot: JobSnapshot) -> RestartTiming | None:
    """The restart's timing once every expected rank of the new attempt has made its first step
    (None until then)."""
    ranks = set(snapshot.expected_ranks)
    beats: dict[int, Heartbeat] = {
        h.rank: h for h in snapshot.heartbeats if h.attempt == pending.attempt
    }
    if not ranks or not ranks <= set(beats) or any(not beats[r].first_step_us for r in ranks):
        return None
    first_group: dict[int, int] = {}
    for g in snapshot.groups:
        if g.attempt == pending.attempt:
            first_group[g.rank] = min(first_group.get(g.rank, g.time_us), g.time_us)
    first_step = max(beats[r].first_step_us for r in ranks)
    launched = pending.launch_end_us
    rendezvous = max((first_group.get(r, launched) for r in ranks), default=launched)
    loaded = max((beats[r].resumed_us for r in ranks), default=0) or rendezvous
    marks = [pending.fault_us, pending.detected_us, pending.stop_begin_us or pending.detected_us,
             pending.stop_end_us or pending.detected_us, launched, rendezvous, loaded,
             first_step]
    # never negative: clocks of different processes, and a rendezvous that a rank's first group
    # reports after its checkpoint (a script that loads before it builds its group)
    for i in range(1, len(marks)):
        marks[i] = max(marks[i], marks[i - 1])
    phases = {name: (marks[i + 1] - marks[i]) / 1e6 for i, name in enumerate(PHASES)}
    return RestartTiming(incident_id=pending.incident_id, attempt=pending.attempt,
                         fault_us=pending.fault_us, resumed_us=marks[-1], phases=phases,
                         warm=pending.warm, cold=pending.cold)
