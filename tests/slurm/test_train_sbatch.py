"""The batch script users run under Slurm, examples/slurm/train.sbatch, submitted as it is on disk
to the real two-node test cluster: one `tracehound agent` per node, four gloo ranks (two per
node) each with the recorder for its own node's agent, records in the store; and, hung in its
first run and requeued with the watcher's adapter, the same job resumes from its last
checkpoint as attempt 1. README.md shows this file to users; tests/slurm/test_slurm_section.py
keeps the two the same.

The store: the README's pattern for jobs that Tracehound does not launch is a node agent per
node shipping to `TRACEHOUND_SINK`, which is a ClickHouse server or the http:// ingest endpoint
of an embedded store's owner. The test server of tests/clickhouse_harness.py listens on the
host's loopback only, which the cluster's nodes cannot reach (each node has its own network
namespace), so these tests own an embedded (chdb) store and serve its ingest endpoint
(`tracing.store.ingest.IngestServer`, with a token, as `tracehound run` does for remote agents)
on the cluster's bridge address, and the job gets that URL and token. chdb lets one process hold
one store at a time, so each test opens and closes its own."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_harness import JobStore, SlurmCluster, job_store

from tracehound.agent.checkpoint import latest_complete
from tracehound.controller.actions.scontrol import SlurmControl
from tracehound.tracing.ids import JobId

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"


@pytest.fixture
def store(slurm_cluster: SlurmCluster, tmp_path: Path) -> Iterator[JobStore]:
    with job_store(slurm_cluster, tmp_path / "store") as held:
        yield held


def submit(cluster: SlurmCluster, store: JobStore, workdir: Path, *args: str) -> str:
    """sbatch the script as it is on disk, from `workdir`; `args` go to the training script."""
    workdir.mkdir(parents=True, exist_ok=True)
    return cluster.sbatch(SCRIPT, args=args, env=store.env, cwd=workdir)


def output(workdir: Path, job: str) -> str:
    return (workdir / f"tracehound-ddp-{job}.out").read_text()


def test_a_healthy_job_runs_on_both_nodes_and_its_records_reach_the_store(
        slurm_cluster: SlurmCluster, store: JobStore, tmp_path: Path) -> None:
    work = tmp_path / "work"
    job = submit(slurm_cluster, store, work, "--steps", "40", "--checkpoint-every", "10")
    state = slurm_cluster.wait_job_state(job, {"COMPLETED", "FAILED", "CANCELLED"})
    log = output(work, job)
    assert state == "COMPLETED", log[-4000:]
    assert f"run 0 of job slurm-{job} on node-[1-2]" in log
    assert sorted(re.findall(r"rank (\d)/4: finished at step 40", log)) == ["0", "1", "2", "3"]
    assert latest_complete(work / "checkpoints" / f"slurm-{job}") is not None
    assert latest_complete(work / "checkpoints" / f"slurm-{job}")[0] == 40  # type: ignore[index]

    # every rank's records came through its own node's agent
    beats = store.store.latest_heartbeats(JobId(f"slurm-{job}"), 0)
    assert sorted((hb.rank, hb.node) for hb in beats) == [
        (0, "node-1"), (1, "node-1"), (2, "node-2"), (3, "node-2")]
    world = {hb.rank: {g.group: g.last_completed for g in hb.groups}["0"] for hb in beats}
    assert len(set(world.values())) == 1 and world[0] > 0, world
    assert store.server.unauthorized_total == 0 and store.server.rejected_total == 0
    # both agents stopped with SIGTERM and shipped what they held (a SIGKILL would not log this)
    assert sorted(re.findall(r"node=(node-\d)\] stopping: shipping what is left", log)) == [
        "node-1", "node-2"]


def test_hung_then_requeued_it_resumes_from_its_checkpoint_as_attempt_1(
        slurm_cluster: SlurmCluster, store: JobStore, tmp_path: Path) -> None:
    # what the watcher does about a hang: rank 3 stops at step 30 in the first run (the example
    # script's own fault injection, in attempt 0 only), the job is requeued, and its second run
    # resumes from the checkpoint of step 30 and finishes
    work = tmp_path / "work"
    job = submit(slurm_cluster, store, work, "--steps", "60", "--checkpoint-every", "10",
                 "--fault-in", "hang:3:30@0")
    checkpoints = work / "checkpoints" / f"slurm-{job}"

    def at_step_30() -> bool:
        found = latest_complete(checkpoints)
        return found is not None and found[0] == 30

    slurm_cluster.wait_for("the checkpoint of step 30", at_step_30)
    slurm_cluster.wait_for("rank 3's hang", lambda: "rank 3: injected hang at step 30"
                           in output(work, job))
    assert slurm_cluster.job_state(job) == "RUNNING"
    requeued = SlurmControl(env=slurm_cluster.env).requeue(job)
    assert requeued.ok and requeued.changed, requeued.detail

    state = slurm_cluster.wait_job_state(job, {"COMPLETED", "FAILED", "CANCELLED"})
    log = output(work, job)
    assert state == "COMPLETED", log[-4000:]
    assert slurm_cluster.job_field(job, "Restarts") == "1"
    assert f"run 0 of job slurm-{job}" in log and f"run 1 of job slurm-{job}" in log
    resumed = re.findall(r"rank (\d)/4: resumed from step (\d+)", log)
    assert sorted(resumed) == [("0", "30"), ("1", "30"), ("2", "30"), ("3", "30")]
    assert sorted(re.findall(r"rank (\d)/4: finished at step 60", log)) == ["0", "1", "2", "3"]

    # each run's records are its own attempt's, from both nodes
    for attempt in (0, 1):
        beats = store.store.latest_heartbeats(JobId(f"slurm-{job}"), attempt)
        assert sorted((hb.rank, hb.node) for hb in beats) == [
            (0, "node-1"), (1, "node-1"), (2, "node-2"), (3, "node-2")], attempt
