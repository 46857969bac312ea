"""The Slurm action adapter (`tracehound watch --slurm`): drain the culprit nodes, then requeue or
cancel the job, as the policy's plan says.

The policy's plan for a watched job becomes:

    isolate_node N   ->  scontrol update NodeName=N State=DRAIN Reason="tracehound <incident>"
    restart          ->  scontrol requeue JOBID     (Slurm stops every task and queues the job
                                                     again; the batch script resumes it from its
                                                     latest checkpoint)
    give_up          ->  scontrol cancel JOBID
    stop_job         ->  (nothing of its own: the requeue or the cancel stops the job)
    observe          ->  (a record, as the policy gave it)

Each step keeps the rule of the policy step it comes from. `scontrol` is driven through
`tracehound.controller.actions.scontrol.SlurmControl` (`SlurmControlPort` declares the part used
here, which the tests' fakes stand in for).

Every step asks Slurm first, so that a step handed over again by a watcher started again (its
outcome was not recorded) does not act twice: a node already draining or drained is not drained
again; a job already pending (requeued) is not requeued again, nor a running one whose incident's
attempt is over (a newer attempt of the job reports: the requeue happened and the job runs
again); a job that already ended is neither requeued nor cancelled. A culprit node that is not
one of the Slurm job's nodes is never drained: the job's node names must be Slurm's (see
`tracehound instrument --env`).

Which Slurm job a watched job is: `--slurm-job ID`, else the id in a Tracehound job id of the form
`slurm-ID` (the default job id `tracehound instrument` gives inside a Slurm allocation). Without
one, the Slurm steps are recorded as not taken, saying why.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Final, Protocol

from tracehound.analysis.verdict import Verdict
from tracehound.controller.actions.observe import unacted
from tracehound.controller.actions.port import ActionsUnavailable, Outcome
from tracehound.controller.actions.scontrol import SlurmControl, SlurmError
from tracehound.controller.policy.recovery import PlannedAction, observe_only
from tracehound.tracing.events import ActionKind, Incident

_SLURM_JOB_ID = re.compile(r"^slurm-(\d+(?:_\d+)?)$")

WAITING: Final = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
                            "RESV_DEL_HOLD"})
"""Slurm job states of a job queued again (or not yet started)."""
ENDED: Final = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL",
                          "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY", "PREEMPTED", "REVOKED",
                          "SPECIAL_EXIT"})
"""Slurm job states of a job that ended."""


class StepResultLike(Protocol):
    """`scontrol.StepResult`: one scontrol call's outcome."""

    @property
    def command(self) -> tuple[str, ...]: ...
    @property
    def ok(self) -> bool: ...
    @property
    def changed(self) -> bool: ...
    @property
    def detail(self) -> str: ...


class SlurmControlPort(Protocol):
    """The part of `scontrol.SlurmControl` this adapter uses. Its methods raise its module's
    `SlurmError` (naming the command line, its exit status and its stderr) when scontrol fails
    or is missing."""

    def check(self) -> None: ...
    def node_state(self, node: str) -> str: ...
    def job_state(self, job_id: str) -> str: ...
    def job_nodes(self, job_id: str) -> list[str]: ...
    def drain(self, nodes: Sequence[str], reason: str) -> StepResultLike: ...
    def requeue(self, job_id: str) -> StepResultLike: ...
    def cancel(self, job_id: str) -> StepResultLike: ...


def slurm_job_of(job: str) -> str | None:
    """The Slurm job id in a Tracehound job id of the form `slurm-ID` (`slurm-1234`,
    `slurm-1234_7` for an array task); None for any other job id."""
    match = _SLURM_JOB_ID.match(job)
    return match.group(1) if match else None


def state_word(state: str) -> str:
    """The base state of a Slurm state string, upper case, without the flags after a `+` or
    anything after a space: "MIXED" of "mixed+DRAIN", "PENDING" of "PENDING (Priority)"."""
    return re.split(r"[+\s(]", state.strip().upper(), maxsplit=1)[0]


def load_control(*, scontrol: str = "scontrol", timeout_s: float = 30.0
                 ) -> tuple[SlurmControlPort, tuple[type[Exception], ...]]:
    """The real `SlurmControl` and the error it raises when scontrol fails."""
    return SlurmControl(scontrol=scontrol, timeout_s=timeout_s), (SlurmError,)


def _result(result: StepResultLike) -> Outcome:
    line = " ".join(result.command)
    note = "" if result.changed else " (nothing changed)"
    return Outcome(result.ok, f"{line}: {result.detail}{note}")


class SlurmActions:
    """Drains, requeues and cancels through scontrol (see the module docstring)."""

    def __init__(self, control: SlurmControlPort, *, job: str, slurm_job: str | None,
                 errors: tuple[type[Exception], ...] = (Exception,),
                 attempt_over: Callable[[int], bool] = lambda attempt: False) -> None:
        """`job` is the Tracehound job, `slurm_job` its Slurm job id (None: not known);
        `errors` are what `control` raises when scontrol fails; `attempt_over(a)` says whether a
        newer attempt than `a` of the job reports (the job was requeued and runs again)."""
        self.control = control
        self.job = job
        self.slurm_job = slurm_job
        self.errors = errors
        self.attempt_over = attempt_over

    @property
    def kinds(self) -> frozenset[ActionKind]:
        return frozenset({ActionKind.ISOLATE_NODE, ActionKind.RESTART, ActionKind.GIVE_UP})

    def describe(self) -> str:
        which = f"Slurm job {self.slurm_job}" if self.slurm_job else "an unknown Slurm job"
        return (f"drain the culprit nodes, then requeue or cancel {which} as the policy says "
                "(scontrol)")

    def check(self) -> None:
        try:
            self.control.check()
        except self.errors as exc:
            raise ActionsUnavailable(f"--slurm: {exc}") from exc

    def plan(self, verdict: Verdict,
             policy: tuple[PlannedAction, ...]) -> tuple[PlannedAction, ...]:
        if not policy or observe_only(policy):
            return policy
        if self.slurm_job is None:
            return (unacted(policy, f"no Slurm job id is known for job {self.job} (give "
                                    "--slurm-job ID, or name the job slurm-ID)"),)
        target = f"slurm job {self.slurm_job}"
        steps: list[PlannedAction] = []
        for step in policy:
            if step.kind is ActionKind.ISOLATE_NODE:
                steps.append(PlannedAction(kind=ActionKind.ISOLATE_NODE, target=step.target,
                                           reason=f"drain: {step.reason}", rule=step.rule))
            elif step.kind is ActionKind.RESTART:
                steps.append(PlannedAction(kind=ActionKind.RESTART, target=target,
                                           reason=f"requeue: {step.reason}", rule=step.rule))
            elif step.kind is ActionKind.GIVE_UP:
                steps.append(PlannedAction(kind=ActionKind.GIVE_UP, target=target,
                                           reason=f"cancel: {step.reason}", rule=step.rule))
            elif step.kind is ActionKind.OBSERVE:
                steps.append(step)
            # stop_job: the requeue or the cancel stops every task
        return tuple(steps)

    def take(self, step: PlannedAction, incident: Incident) -> Outcome:
        try:
            if step.kind is ActionKind.ISOLATE_NODE:
                return self._drain(step.target, incident)
            if step.kind is ActionKind.RESTART:
                return self._requeue(incident)
            if step.kind is ActionKind.GIVE_UP:
                return self._cancel()
        except self.errors as exc:
            return Outcome(False, str(exc))
        return Outcome(False, f"the Slurm adapter takes no {step.kind.value} step")

    def _drain(self, node: str, incident: Incident) -> Outcome:
        state = self.control.node_state(node)
        if "DRAIN" in state.upper():
            return Outcome(True, f"node {node} is {state} already: not drained again")
        slurm_job = self.slurm_job or ""
        nodes = self.control.job_nodes(slurm_job)
        if node not in nodes:
            return Outcome(False, f"node {node} is not one of Slurm job {slurm_job}'s nodes "
                                  f"({', '.join(nodes) or 'none'}): not drained (the job's "
                                  "node names must be Slurm's)")
        return _result(self.control.drain([node], f"tracehound {incident.incident_id}"))

    def _requeue(self, incident: Incident) -> Outcome:
        slurm_job = self.slurm_job or ""
        state = self.control.job_state(slurm_job)
        word = state_word(state)
        if word in ENDED:
            return Outcome(False, f"Slurm job {slurm_job} is {state}: nothing to requeue")
        if word in WAITING:
            return Outcome(True, f"Slurm job {slurm_job} is {state} already: not requeued "
                                 "again")
        if self.attempt_over(incident.attempt):
            return Outcome(True, f"Slurm job {slurm_job} runs a newer attempt than "
                                 f"{incident.attempt} already: not requeued again")
        return _result(self.control.requeue(slurm_job))

    def _cancel(self) -> Outcome:
        slurm_job = self.slurm_job or ""
        state = self.control.job_state(slurm_job)
        if state_word(state) in ENDED:
            return Outcome(True, f"Slurm job {slurm_job} is {state} already: not cancelled")
        return _result(self.control.cancel(slurm_job))

    def close(self) -> None:
        return None
