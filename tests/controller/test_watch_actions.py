"""The watcher's action port, adapter by adapter: observe (the default), a user's command (a real
/bin/sh running real commands) and Slurm. No Slurm cluster runs in this test: the Slurm adapter
is driven through a fake `SlurmControl` (`watch_fakes.FakeSlurm`) that keeps node and job
states the way scontrol reports them and records every call (the real scontrol module and
cluster are another test's)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from watch_fakes import FakeSlurm, SlurmError

from tracehound.analysis.verdict import Basis, Verdict
from tracehound.controller.actions.command import CommandActions, marker_name
from tracehound.controller.actions.observe import NOT_ACTED, ObserveActions
from tracehound.controller.actions.port import ActionsUnavailable, Chain, ends_attempt
from tracehound.controller.actions.slurm import SlurmActions, slurm_job_of, state_word
from tracehound.controller.policy.recovery import PlannedAction, PolicySettings, plan_recovery
from tracehound.tracing.events import ActionKind, Incident, IncidentKind
from tracehound.tracing.ids import JobId


def verdict(kind: IncidentKind = IncidentKind.HANG, confidence: float = 0.95) -> Verdict:
    return Verdict(job=JobId("j"), attempt=0, kind=kind, culprit_ranks=(3,),
                   culprit_nodes=("node-1",), confidence=confidence,
                   basis=Basis.HEARTBEAT_LOSS, summary="rank 3 on node-1 is frozen",
                   evidence=(), observed_at_us=1)


def policy_plan(v: Verdict) -> tuple[PlannedAction, ...]:
    return plan_recovery(v, restarts_done=0, healthy_spares=5, settings=PolicySettings())


def incident(incident_id: str = "j/0/1", summary: str = "rank 3 on node-1 is frozen") -> Incident:
    return Incident(job="j", incident_id=incident_id, attempt=0, detected_at_us=1, kind="hang",
                    culprit_ranks=(3,), culprit_nodes=("node-1",), confidence=0.95,
                    summary=summary, verdict_json="{}")


# -- observe ------------------------------------------------------------------------------------


def test_observe_passes_an_observation_on_and_records_an_acting_plan_as_not_done() -> None:
    observe = ObserveActions()
    watch_only = policy_plan(verdict(IncidentKind.STALL))
    assert observe.plan(verdict(IncidentKind.STALL), watch_only) == watch_only
    acting = policy_plan(verdict())
    assert [s.kind for s in acting] == [ActionKind.STOP_JOB, ActionKind.ISOLATE_NODE,
                                        ActionKind.RESTART]
    (step,) = observe.plan(verdict(), acting)
    assert step.kind is ActionKind.OBSERVE and step.reason.startswith(NOT_ACTED)
    assert "isolate_node node-1" in step.reason and "restart attempt 1" in step.reason
    assert step.rule == acting[0].rule == "rules.hang.isolate_from"
    assert observe.take(step, incident()).ok and not ends_attempt((step,))


# -- a command ----------------------------------------------------------------------------------


def command(tmp_path: Path, cmd: str, **kw: object) -> CommandActions:
    return CommandActions(cmd, state_dir=tmp_path / "markers", **kw)  # type: ignore[arg-type]


def test_the_command_gets_the_incident_as_json_on_stdin_and_in_its_environment(
        tmp_path: Path) -> None:
    out = tmp_path / "seen"
    actions = command(tmp_path, f"cat > {out}.json; env | grep ^TRACEHOUND_INCIDENT_ | sort "
                                f"> {out}.env; echo done for $TRACEHOUND_INCIDENT_INCIDENT")
    (step,) = actions.plan(verdict(), policy_plan(verdict()))
    assert (step.kind, step.rule) == (ActionKind.COMMAND, "on_incident")
    outcome = actions.take(step, incident(summary="it's \"frozen\"; $HOME stays"))
    assert outcome.ok, outcome.detail
    assert "exited with status 0" in outcome.detail and "done for j/0/1" in outcome.detail
    assert json.loads((tmp_path / "seen.json").read_text()) == {
        "job": "j", "incident": "j/0/1", "kind": "hang", "culprit_ranks": [3],
        "culprit_nodes": ["node-1"], "confidence": 0.95,
        "summary": "it's \"frozen\"; $HOME stays"}
    env = dict(line.split("=", 1) for line in (tmp_path / "seen.env").read_text().splitlines())
    assert env == {"TRACEHOUND_INCIDENT_JOB": "j", "TRACEHOUND_INCIDENT_INCIDENT": "j/0/1",
                   "TRACEHOUND_INCIDENT_KIND": "hang", "TRACEHOUND_INCIDENT_CULPRIT_RANKS": "3",
                   "TRACEHOUND_INCIDENT_CULPRIT_NODES": "node-1",
                   "TRACEHOUND_INCIDENT_CONFIDENCE": "0.95",
                   "TRACEHOUND_INCIDENT_SUMMARY": "it's \"frozen\"; $HOME stays"}


def test_a_failing_command_is_a_failed_action_with_its_status_and_the_tail_of_its_output(
        tmp_path: Path) -> None:
    actions = command(tmp_path, "seq 1 5000; echo 'no pager configured' >&2; exit 3",
                      tail_chars=40)
    outcome = actions.take(actions.plan(verdict(), ())[0], incident())
    assert not outcome.ok
    assert "exited with status 3" in outcome.detail
    assert outcome.detail.endswith("4999\n5000\nno pager configured")
    assert "\n1\n2\n" not in outcome.detail  # only the tail


def test_a_command_past_its_timeout_is_killed_with_what_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    actions = command(tmp_path, f"sleep 300 & echo $! > {pidfile}; echo started; wait",
                      timeout_s=1.0)
    outcome = actions.take(actions.plan(verdict(), ())[0], incident())
    assert not outcome.ok and "did not finish within 1 s: killed" in outcome.detail
    assert "started" in outcome.detail
    child = int(pidfile.read_text())
    # the background sleep went with its process group (reaped by init, or a zombie at most):
    # SIGKILL was sent to it, and a loaded machine may show it running while it is torn down
    # (seen in CI: state R just after), with the SIGKILL pending
    while _state(child) not in ("", "Z"):
        assert _sigkill_pending(child) is not False, _state(child)
        time.sleep(0.05)


def _state(pid: int) -> str:
    """The process' state letter ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return ""


def _sigkill_pending(pid: int) -> bool | None:
    """Whether SIGKILL is pending for the process (None once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    masks = [int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]
    return any(mask & (1 << (signal.SIGKILL - 1)) for mask in masks)


def test_the_command_never_runs_twice_for_one_incident_also_after_a_restart(
        tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    step = command(tmp_path, "x").plan(verdict(), ())[0]
    first = command(tmp_path, f"echo ran >> {runs}")
    assert first.take(step, incident()).ok
    # a watcher started again, whose record of the first run was lost
    again = command(tmp_path, f"echo ran >> {runs}").take(step, incident())
    assert not again.ok and again.detail.startswith("not run again: it was started at ")
    assert runs.read_text() == "ran\n"
    # another incident runs it again
    assert first.take(step, incident("j/0/2")).ok
    assert runs.read_text() == "ran\nran\n"
    assert (tmp_path / "markers" / marker_name("j/0/1")).exists()
    assert marker_name("a/b") != marker_name("a_b")


def test_a_command_that_cannot_start_or_an_empty_one_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="the command is empty"):
        command(tmp_path, "  ")
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        command(tmp_path, "true", timeout_s=0)
    outcome = command(tmp_path, "no-such-command-anywhere").take(
        PlannedAction(kind=ActionKind.COMMAND, target="x", reason="r"), incident())
    assert not outcome.ok and "exited with status 127" in outcome.detail
    assert "not found" in outcome.detail


# -- Slurm --------------------------------------------------------------------------------------


def slurm(fake: FakeSlurm, slurm_job: str | None = "4242", over: bool = False) -> SlurmActions:
    return SlurmActions(fake, job="j", slurm_job=slurm_job, errors=(SlurmError,),
                        attempt_over=lambda attempt: over)


def test_slurm_drains_the_culprit_node_then_requeues_each_step_with_its_rule() -> None:
    fake = FakeSlurm()
    actions = slurm(fake)
    steps = actions.plan(verdict(), policy_plan(verdict()))
    assert [(s.kind, s.target, s.rule) for s in steps] == [
        (ActionKind.ISOLATE_NODE, "node-1", "rules.hang.isolate_from"),
        (ActionKind.RESTART, "slurm job 4242", "rules.hang.isolate_from")]
    assert ends_attempt(steps)
    outcomes = [actions.take(s, incident()) for s in steps]
    assert all(o.ok for o in outcomes), outcomes
    assert fake.calls == [("drain", "node-1", "tracehound j/0/1"), ("requeue", "4242")]
    assert outcomes[0].detail.startswith("scontrol update NodeName=node-1 State=DRAIN")
    # handed over again after a restart: Slurm says it is done, nothing is done twice
    again = [actions.take(s, incident()) for s in steps]
    assert all(o.ok for o in again) and fake.calls == [("drain", "node-1", "tracehound j/0/1"),
                                                       ("requeue", "4242")]
    assert "not drained again" in again[0].detail and "not requeued again" in again[1].detail


def test_slurm_does_not_requeue_a_job_running_its_next_attempt_or_one_that_ended() -> None:
    requeue = PlannedAction(kind=ActionKind.RESTART, target="slurm job 4242", reason="r")
    fake = FakeSlurm()
    outcome = slurm(fake, over=True).take(requeue, incident())
    assert outcome.ok and "newer attempt" in outcome.detail and fake.calls == []
    fake.job = "COMPLETED"
    outcome = slurm(fake).take(requeue, incident())
    assert not outcome.ok and "nothing to requeue" in outcome.detail and fake.calls == []


def test_slurm_cancels_when_the_policy_gives_up() -> None:
    mismatch = verdict(IncidentKind.MISMATCH)
    fake = FakeSlurm()
    actions = slurm(fake)
    steps = actions.plan(mismatch, policy_plan(mismatch))
    assert [(s.kind, s.rule) for s in steps] == [(ActionKind.GIVE_UP,
                                                  "rules.mismatch.response")]
    assert actions.take(steps[0], incident()).ok and fake.calls == [("cancel", "4242")]
    assert "not cancelled" in actions.take(steps[0], incident()).detail


def test_slurm_never_drains_a_node_that_is_not_the_jobs() -> None:
    fake = FakeSlurm(job_nodes_=["c1", "c2"], nodes={"node-1": "IDLE"})
    outcome = slurm(fake).take(PlannedAction(kind=ActionKind.ISOLATE_NODE, target="node-1",
                                             reason="r"), incident())
    assert not outcome.ok and "not one of Slurm job 4242's nodes (c1, c2)" in outcome.detail
    assert fake.calls == []


def test_a_failing_scontrol_is_a_failed_step_and_a_missing_one_an_error_at_start() -> None:
    fake = FakeSlurm(fail="drain")
    outcome = slurm(fake).take(PlannedAction(kind=ActionKind.ISOLATE_NODE, target="node-1",
                                             reason="r"), incident())
    assert not outcome.ok and "Unable to contact slurm controller" in outcome.detail
    with pytest.raises(ActionsUnavailable, match="--slurm: scontrol check"):
        slurm(FakeSlurm(fail="check")).check()


def test_without_a_slurm_job_id_the_plan_is_recorded_as_not_taken_saying_why() -> None:
    (step,) = slurm(FakeSlurm(), slurm_job=None).plan(verdict(), policy_plan(verdict()))
    assert step.kind is ActionKind.OBSERVE and "--slurm-job" in step.reason
    assert slurm_job_of("slurm-4242") == "4242" and slurm_job_of("slurm-77_3") == "77_3"
    assert slurm_job_of("exp7") is None and slurm_job_of("slurm-") is None
    assert state_word("mixed+DRAIN") == "MIXED" and state_word("PENDING (Priority)") == "PENDING"


# -- in a chain ---------------------------------------------------------------------------------


def test_a_chain_takes_slurm_steps_first_then_the_command_each_by_its_adapter(
        tmp_path: Path) -> None:
    fake = FakeSlurm()
    runs = tmp_path / "runs"
    chain = Chain(slurm(fake), command(tmp_path, f"cat >> {runs}"))
    steps = chain.plan(verdict(), policy_plan(verdict()))
    assert [s.kind for s in steps] == [ActionKind.ISOLATE_NODE, ActionKind.RESTART,
                                       ActionKind.COMMAND]
    assert all(chain.take(s, incident()).ok for s in steps)
    assert fake.calls[-1] == ("requeue", "4242")
    assert json.loads(runs.read_text())["incident"] == "j/0/1"
    watch_only = policy_plan(verdict(IncidentKind.STALL))
    assert [s.kind for s in chain.plan(verdict(IncidentKind.STALL), watch_only)] == [
        ActionKind.OBSERVE, ActionKind.COMMAND]
    assert "drain" in chain.describe() and "once per incident" in chain.describe()
    assert os.access("/bin/sh", os.X_OK)
