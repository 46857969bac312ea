"""The watcher's action port: what `tracehound watch` does about an incident of a job that it did
not launch.

A supervised job (`tracehound run`, the operator) is acted on through its orchestrator, which
started it. A watched job was started by someone else, so the watcher acts through whatever the
site gives it, one adapter per system:

- `observe.ObserveActions`, the default: nothing is done to the job. A plan of the policy that
  would stop, evict or restart is recorded as one `observe` step that says so in words.
- `command.CommandActions` (`--on-incident CMD`): a shell command, once per incident, with the
  incident as JSON on stdin.
- `slurm.SlurmActions` (`--slurm`): drain the culprit nodes, then requeue or cancel the job, as
  the policy's plan says.

`Chain` puts a command after either of the others.

An adapter first turns the policy's plan into its own steps (`plan`, which is pure), each one
naming the policy rule that decided it. The watcher journals those steps with the incident's
state before it takes any of them. It records each step's outcome as an action of the incident,
so a watcher that is started again takes only the steps that have no action yet. A step whose
outcome was not recorded (the watcher was killed while taking it) may be handed to `take` a
second time. `take` must then check the system's own state first and not repeat what is done:
the node already drained, the job already requeued. Where the system cannot tell, `take` must
refuse to run again: the command runs at most once per incident.

`take` never raises for a failure of the system it drives (a command that fails, `scontrol`
refusing). That failure is its outcome, recorded on the incident, and the watcher goes on
watching. `check` runs once at start and raises `ActionsUnavailable` when the system cannot be
used at all (`scontrol` missing), naming what is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tracehound.analysis.verdict import Verdict
from tracehound.controller.policy.recovery import PlannedAction
from tracehound.tracing.events import ActionKind, Incident


class ActionsUnavailable(RuntimeError):
    """An action adapter's system cannot be used (a command missing, no permission): permanent
    until the setup is fixed; the message names what is missing and where it was looked for."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of one step."""

    ok: bool
    detail: str
    """What was done (or why not), in words; stored as the action's detail."""


class IncidentActions(Protocol):
    """Turns the policy's plan for an incident into steps on one system, and takes them."""

    @property
    def kinds(self) -> frozenset[ActionKind]:
        """The kinds of step this adapter takes (`Chain` hands each step to the first adapter
        that takes its kind; an `observe` step needs no adapter)."""
        ...

    def describe(self) -> str:
        """What the adapter does, for the watcher's first lines ("drain and requeue through
        scontrol for Slurm job 1234")."""
        ...

    def check(self) -> None:
        """Raise `ActionsUnavailable` if the system cannot be used at all."""
        ...

    def plan(self, verdict: Verdict,
             policy: tuple[PlannedAction, ...]) -> tuple[PlannedAction, ...]:
        """The steps for an incident of `verdict`, given the policy's plan for it, in the order
        they are to be taken; each names in `rule` the setting that decided it. Pure."""
        ...

    def take(self, step: PlannedAction, incident: Incident) -> Outcome:
        """Take one step of `plan`'s for `incident` (again, after a restart, when its outcome was
        not recorded: see the module docstring). Never raises for the system's failures."""
        ...

    def close(self) -> None:
        ...


def ends_attempt(steps: tuple[PlannedAction, ...]) -> bool:
    """Whether taking `steps` ends the watched attempt: the job is requeued (a `restart` step)
    or cancelled (a `give_up` step)."""
    return any(s.kind in (ActionKind.RESTART, ActionKind.GIVE_UP) for s in steps)


class Chain:
    """Several adapters in turn: the steps of each, in order; each step taken by the first
    adapter that takes its kind, `observe` steps by nobody (they are records)."""

    def __init__(self, *adapters: IncidentActions) -> None:
        if not adapters:
            raise ValueError("a chain of action adapters needs at least one")
        self.adapters = adapters

    @property
    def kinds(self) -> frozenset[ActionKind]:
        return frozenset().union(*(a.kinds for a in self.adapters))

    def describe(self) -> str:
        return "; then ".join(a.describe() for a in self.adapters)

    def check(self) -> None:
        for adapter in self.adapters:
            adapter.check()

    def plan(self, verdict: Verdict,
             policy: tuple[PlannedAction, ...]) -> tuple[PlannedAction, ...]:
        steps: list[PlannedAction] = []
        for adapter in self.adapters:
            for step in adapter.plan(verdict, policy):
                if step.kind is ActionKind.OBSERVE and step in steps:
                    continue  # two adapters passing the policy's observation on: once
                steps.append(step)
        return tuple(steps)

    def take(self, step: PlannedAction, incident: Incident) -> Outcome:
        if step.kind is ActionKind.OBSERVE:
            return Outcome(True, step.reason)
        for adapter in self.adapters:
            if step.kind in adapter.kinds:
                return adapter.take(step, incident)
        return Outcome(False, f"no action adapter takes a {step.kind.value} step "
                              f"({self.describe()})")

    def close(self) -> None:
        for adapter in self.adapters:
            adapter.close()
