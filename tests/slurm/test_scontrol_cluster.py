"""The scontrol adapter (controller.actions.scontrol) against the real two-node test cluster:
drain and resume (twice: the second changes nothing; the other node keeps running jobs),
requeue of a running `sbatch --requeue` job that then runs again (and what it will not requeue),
cancel, the nodes of a job, and the errors when the controller does not answer, answers
nothing, or scontrol is missing."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest
from slurm_harness import SlurmCluster

from tracehound.controller.actions.scontrol import SlurmControl, SlurmError

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

SCONTROL = shutil.which("scontrol") or "/usr/bin/scontrol"
SCANCEL = str(Path(SCONTROL).parent / "scancel")


def runs(out: Path) -> str:
    """A batch script that notes each of its runs in `out`, then sleeps."""
    return (f'#!/bin/bash\necho "run ${{SLURM_RESTART_COUNT:-0}} on $(hostname)" >> {out}\n'
            "sleep 600\n")


def control(cluster: SlurmCluster, **options: object) -> SlurmControl:
    return SlurmControl(env=cluster.env, **options)  # type: ignore[arg-type]


def test_the_controller_answers_and_every_node_is_idle(slurm_cluster: SlurmCluster) -> None:
    slurm = control(slurm_cluster)
    slurm.check()
    assert [slurm.node_state(n) for n in slurm_cluster.node_names] == ["IDLE", "IDLE"]


def test_drain_twice_then_resume_twice(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    slurm = control(slurm_cluster)
    drained = slurm.drain(["node-1"], "tracehound 7: rank 3 hung")
    assert drained.ok and drained.changed
    assert drained.command == (SCONTROL, "update", "NodeName=node-1", "State=DRAIN",
                               "Reason=tracehound 7: rank 3 hung")
    assert drained.detail == "drained node-1 (reason 'tracehound 7: rank 3 hung')"
    assert slurm.node_state("node-1") == "IDLE+DRAIN"
    assert slurm_cluster.node_states() == {"node-1": "drained", "node-2": "idle"}

    # again, with another reason: nothing runs, and the first reason stays
    again = slurm.drain(["node-1"], "another reason")
    assert (again.ok, again.changed, again.command) == (True, False, ())
    assert again.detail == "node-1 already IDLE+DRAIN (reason 'tracehound 7: rank 3 hung')"
    shown = slurm_cluster.run("scontrol", "show", "node", "node-1").stdout
    assert "Reason=tracehound 7: rank 3 hung [root@" in shown

    # the other node still takes jobs: a 2-task job runs there, all of it
    job = slurm_cluster.sbatch(runs(tmp_path / "out"), "--ntasks=2", "--output=/dev/null")
    slurm_cluster.wait_job_state(job, {"RUNNING"})
    assert slurm.job_nodes(job) == ["node-2"]
    assert slurm.node_state("node-2") == "ALLOCATED"

    # both: only the one not drained yet is drained
    both = slurm.drain(["node-1", "node-2"], "tracehound 8")
    assert both.changed and both.command[2] == "NodeName=node-2"
    assert both.detail == ("drained node-2 (reason 'tracehound 8'); node-1 already IDLE+DRAIN "
                           "(reason 'tracehound 7: rank 3 hung')")
    assert slurm.node_state("node-2") == "ALLOCATED+DRAIN"
    assert slurm.job_state(job) == "RUNNING"  # a drain lets running jobs finish

    resumed = slurm.resume(["node-1", "node-2"])
    assert resumed.ok and resumed.changed
    assert resumed.command == (SCONTROL, "update", "NodeName=node-1,node-2", "State=RESUME")
    assert resumed.detail == ("resumed node-1, node-2 (node-1 was IDLE+DRAIN, node-2 was "
                              "ALLOCATED+DRAIN)")
    # a resumed node is NOT_RESPONDING until the controller's next ping of it
    slurm_cluster.wait_for("node-1 idle", lambda: slurm.node_state("node-1") == "IDLE")
    again = slurm.resume(["node-1"])
    assert (again.ok, again.changed, again.command) == (True, False, ())
    assert again.detail == "node-1 already in service (IDLE)"


def test_drain_of_an_unknown_node_changes_nothing(slurm_cluster: SlurmCluster) -> None:
    slurm = control(slurm_cluster)
    result = slurm.drain(["node-1", "node-9"], "why")
    assert (result.ok, result.changed) == (False, False)
    assert "unknown node(s): node-9" in result.detail and "Node node-9 not found" in result.detail
    assert slurm.node_state("node-1") == "IDLE"
    with pytest.raises(SlurmError, match=r"unknown node.*node-9"):
        slurm.node_state("node-9")


def test_requeue_of_a_running_job_runs_it_again(slurm_cluster: SlurmCluster,
                                                tmp_path: Path) -> None:
    slurm = control(slurm_cluster)
    out = tmp_path / "runs"
    job = slurm_cluster.sbatch(runs(out), "--requeue", "--ntasks=1", "--output=/dev/null")
    slurm_cluster.wait_for("the first run", lambda: out.exists() and out.read_text())
    assert slurm.job_state(job) == "RUNNING"
    (node,) = slurm.job_nodes(job)

    requeued = slurm.requeue(job)
    assert requeued.ok and requeued.changed
    assert requeued.command == (SCONTROL, "requeue", job)
    assert requeued.detail.startswith(f"requeued job {job} (was RUNNING, Restarts 0 -> 1)")

    # at once again: it waits for the requeue to settle (COMPLETING), then sees it was done
    again = slurm.requeue(job)
    assert (again.ok, again.changed, again.command) == (True, False, ())
    assert again.detail.startswith(f"job {job} already requeued: PENDING (reason BeginTime) "
                                   "after 1 restart(s), eligible ")
    assert slurm.job_state(job) == "PENDING"

    # the same job runs again, and knows it is its second run
    slurm_cluster.wait_job_state(job, {"RUNNING"})
    slurm_cluster.wait_for("the second run", lambda: len(out.read_text().splitlines()) == 2)
    first, second = out.read_text().splitlines()
    assert first == f"run 0 on {node}"
    assert re.fullmatch(r"run 1 on node-[12]", second)
    assert slurm_cluster.job_field(job, "Restarts") == "1"
    # running again, so a requeue now is a new one
    assert slurm.requeue(job).changed


def test_what_requeue_leaves_alone(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    slurm = control(slurm_cluster)
    # submitted with --no-requeue: Slurm refuses, and the job runs on
    kept = slurm_cluster.sbatch(runs(tmp_path / "kept"), "--no-requeue", "--ntasks=1",
                                "--output=/dev/null")
    slurm_cluster.wait_job_state(kept, {"RUNNING"})
    refused = slurm.requeue(kept)
    assert (refused.ok, refused.changed) == (False, False)
    assert refused.command == (SCONTROL, "requeue", kept)
    assert refused.detail.startswith(f"job {kept} was submitted with --no-requeue (Requeue=0): "
                                     f"`scontrol requeue {kept}` exited with status 1")
    assert "presently disabled" in refused.detail
    assert slurm.job_state(kept) == "RUNNING"

    # held before it ever started: nothing to requeue
    held = slurm_cluster.sbatch(runs(tmp_path / "held"), "--hold", "--requeue",
                                "--output=/dev/null")
    waiting = slurm.requeue(held)
    assert (waiting.ok, waiting.changed, waiting.command) == (True, False, ())
    assert waiting.detail == (f"job {held} is PENDING (reason JobHeldUser) and has not started "
                              "yet: nothing to requeue")

    # cancelled: not brought back
    assert slurm.cancel(kept).changed
    gone = slurm.requeue(kept)
    assert (gone.ok, gone.changed, gone.command) == (False, False, ())
    assert gone.detail.startswith(f"job {kept} is CANCELLED: not requeued")
    assert slurm.job_state(kept) == "CANCELLED"


def test_cancel_twice(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    slurm = control(slurm_cluster)
    job = slurm_cluster.sbatch(runs(tmp_path / "out"), "--requeue", "--ntasks=4",
                               "--output=/dev/null")
    slurm_cluster.wait_job_state(job, {"RUNNING"})
    assert slurm.job_nodes(job) == ["node-1", "node-2"]
    cancelled = slurm.cancel(job)
    assert cancelled.ok and cancelled.changed
    assert cancelled.command == (SCANCEL, job)
    assert re.fullmatch(rf"cancelled job {job} \(was RUNNING, now (CANCELLED|COMPLETING)\)",
                        cancelled.detail)
    slurm_cluster.wait_job_state(job, {"CANCELLED"})
    again = slurm.cancel(job)
    assert (again.ok, again.changed, again.command) == (True, False, ())
    assert again.detail == f"job {job} already ended (CANCELLED)"
    # a job id the controller never had
    unknown = slurm.cancel("987654")
    assert (unknown.ok, unknown.changed) == (True, False)
    assert "not known to the controller" in unknown.detail
    with pytest.raises(SlurmError, match=r"`scontrol show job 987654 --oneliner` exited with "
                                         r"status 1: slurm_load_jobs error: Invalid job id"):
        slurm.job_state("987654")


def _conf_with_port(cluster: SlurmCluster, path: Path, port: int) -> dict[str, str]:
    text = re.sub(r"(?m)^SlurmctldPort=\d+$", f"SlurmctldPort={port}", cluster.conf.read_text())
    path.write_text(text)
    return {**cluster.env, "SLURM_CONF": str(path)}


def test_a_controller_that_is_down_or_does_not_answer(slurm_cluster: SlurmCluster,
                                                       tmp_path: Path) -> None:
    # the cluster's configuration (its munged too) with the controller's port moved to one that
    # nothing listens on: DOWN at once
    with socket.socket() as free:
        free.bind(("0.0.0.0", 0))
        port = free.getsockname()[1]
    down = SlurmControl(env=_conf_with_port(slurm_cluster, tmp_path / "down.conf", port))
    with pytest.raises(SlurmError, match=r"^slurmctld does not answer: `scontrol ping` exited "
                                         r"with status 1: Slurmctld\(primary\) at .* is DOWN"):
        down.check()

    # ... to a port that takes the connection and never answers: the timeout ends the wait
    with socket.create_server(("0.0.0.0", 0)) as silent:
        env = _conf_with_port(slurm_cluster, tmp_path / "silent.conf",
                              silent.getsockname()[1])
        mute = SlurmControl(env=env, timeout_s=2)
        with pytest.raises(SlurmError, match=r"^slurmctld does not answer: `scontrol ping` did "
                                             r"not finish within 2 s") as raised:
            mute.check()
        assert raised.value.returncode is None
        with pytest.raises(SlurmError, match=r"^`scontrol show job 1 --oneliner` did not "
                                             r"finish within 2 s"):
            mute.job_state("1")
        # a step says so, and that it may be run again
        step = mute.drain(["node-1"], "why")
        assert (step.ok, step.changed, step.command) == (False, False, ())
        assert "did not finish within 2 s" in step.detail


def test_scontrol_missing_from_path(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    slurm = SlurmControl(env={**slurm_cluster.env, "PATH": str(tmp_path)})
    with pytest.raises(SlurmError, match=rf"^scontrol: not found on PATH \({tmp_path}\); "
                                         "install slurm-client"):
        slurm.check()
    with pytest.raises(SlurmError, match="scontrol: not found on PATH"):
        slurm.drain(["node-1"], "why")
    assert control(slurm_cluster).node_state("node-1") == "IDLE"
