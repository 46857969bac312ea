"""`tracehound watch --slurm` on the batch script users run, examples/slurm/train.sbatch,
submitted with `sbatch --requeue` to a real Slurm cluster of three nodes: the job runs on two
of them, one rank is stopped from outside with SIGSTOP, and the watcher, reading the store from
another process, names the rank, drains its node and requeues the job through the real
`scontrol`. Slurm runs the job again on the two nodes left, where it resumes from its last
checkpoint as attempt 1 and finishes; the watcher says so and exits 0. And a healthy job whose
rank 0 takes 12 s over one checkpoint, watched the same way, is only observed: no node is
drained and the job is never requeued.

The hung job's cluster is one of the test's own (three nodes, `start_cluster`), beside the
session's two-node one, so that a drained node leaves the job enough nodes to run again. The
store is an embedded one that the test holds, as in test_train_sbatch.py: its ingest endpoint on
the cluster's bridge for the job's node agents, and shared on loopback (`Sharing`) for the
watcher."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from evidence_check import check_incidents
from slurm_harness import SlurmCluster, job_store, start_cluster

from tracehound.tracing.events import ActionKind, JobPhase
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore
from tracehound.tracing.store.sharing import Sharing

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"


@dataclass
class Watched:
    """A store this test holds (ingest on the cluster's bridge, shared on loopback), the job's
    environment, and a `tracehound watch --slurm` of one job on it."""

    store: TraceStore
    env: dict[str, str]
    out: Path
    err: Path
    watcher: subprocess.Popen[bytes] | None = None

    def watch(self, cluster: SlurmCluster, job: str, workdir: Path) -> None:
        with open(self.out, "wb") as sink, open(self.err, "wb") as err:
            self.watcher = subprocess.Popen(
                [sys.executable, "-m", "tracehound.controller.cli", "watch", "--job", job,
                 "--slurm", "--store", self.store.url, "--workdir", str(workdir), "--json",
                 "--poll", "0.5"],
                stdout=sink, stderr=err, env={**cluster.env, "PATH": self.env["PATH"]})

    def ended(self, cluster: SlurmCluster) -> None:
        """Wait for the watcher to end with its job, and find it exited 0."""
        watcher = self.watcher
        assert watcher is not None
        cluster.wait_for("the watcher ends with the job", lambda: watcher.poll() is not None)
        assert watcher.returncode == 0, self.err.read_text()[-3000:]

    def events(self) -> list[dict[str, Any]]:
        text = self.out.read_text() if self.out.exists() else ""
        return [json.loads(line) for line in text[:text.rfind("\n") + 1].splitlines() if line]


@contextlib.contextmanager
def watched_store(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Watched]:
    """The job store of the Slurm harness, shared on loopback for the watcher's process."""
    with job_store(cluster, tmp_path / "store") as held:
        sharing = Sharing(held.store)
        watched = Watched(held.store, held.env, tmp_path / "watch.out", tmp_path / "watch.err")
        try:
            assert sharing.start() is not None
            yield watched
        finally:
            if watched.watcher is not None and watched.watcher.poll() is None:
                watched.watcher.send_signal(signal.SIGTERM)
                watched.watcher.wait(timeout=60)
            sharing.stop()


def test_watch_slurm_drains_the_stopped_ranks_node_and_the_requeued_job_resumes(
        tmp_path: Path) -> None:
    cluster = start_cluster(tmp_path / "cluster", nodes=3)
    stopped: int | None = None
    try:
        with watched_store(cluster, tmp_path) as watched:
            store = watched.store
            work = tmp_path / "work"
            work.mkdir()
            slurm_id = cluster.sbatch(SCRIPT, args=("--steps", "300", "--checkpoint-every",
                                                    "10", "--step-sleep-ms", "50"),
                                      env=watched.env, cwd=work)
            job = JobId(f"slurm-{slurm_id}")
            watched.watch(cluster, job, tmp_path / "watch")

            def training() -> bool:
                beats = store.latest_heartbeats(job, 0)
                return len(beats) == 4 and min(hb.step for hb in beats) >= 20

            cluster.wait_for("every rank past step 20", training)
            beats = {hb.rank: hb for hb in store.latest_heartbeats(job, 0)}
            assert beats[3].node == "node-2"
            assert cluster.job_field(slurm_id, "NodeList") == "node-[1-2]"
            stopped = beats[3].pid
            os.kill(stopped, signal.SIGSTOP)
            stopped_at = time.monotonic()

            cluster.wait_for("the job requeued",
                             lambda: cluster.job_field(slurm_id, "Restarts") == "1")
            requeued_s = time.monotonic() - stopped_at
            state = cluster.wait_job_state(slurm_id, {"COMPLETED", "FAILED", "CANCELLED"})
            log = (work / f"tracehound-ddp-{slurm_id}.out").read_text()
            assert state == "COMPLETED", log[-4000:]
            watched.ended(cluster)
            print(f"SIGSTOP of rank 3 to the job requeued: {requeued_s:.1f} s")

            # the stopped rank named, its node drained, the job requeued: one incident
            (incident,) = store.incidents(job)
            assert (incident.kind, incident.culprit_ranks, incident.culprit_nodes) == (
                "hang", (3,), ("node-2",)), incident.summary
            steps = {a.kind: a for a in incident.actions}
            assert steps[ActionKind.ISOLATE_NODE].ok and steps[ActionKind.RESTART].ok, steps
            assert "NodeName=node-2" in steps[ActionKind.ISOLATE_NODE].detail
            assert "requeue" in steps[ActionKind.RESTART].detail
            assert cluster.node_states()["node-2"] in ("drained", "draining")
            reason = cluster.run("scontrol", "show", "node", "node-2").stdout
            assert f"Reason=tracehound {incident.incident_id}" in reason

            # the second run, on the nodes left, resumed from the checkpoint before the stop
            assert f"run 1 of job {job} on node-[1,3]" in log, log[-4000:]
            resumed = re.findall(r"rank (\d)/4: resumed from step (\d+)", log)
            assert sorted(r for r, _ in resumed) == ["0", "1", "2", "3"], log[-4000:]
            assert len({s for _, s in resumed}) == 1 and int(resumed[0][1]) >= 20
            assert sorted(re.findall(r"rank (\d)/4: finished at step 300", log)) == [
                "0", "1", "2", "3"]
            assert {hb.node for hb in store.latest_heartbeats(job, 1)} == {"node-1", "node-3"}

            # the watcher followed the requeue to attempt 1 and ended with the job
            events = watched.events()
            watching = [e for e in events if e["event"] == "watching"]
            assert [e["attempt"] for e in watching] == [0, 1], events
            # a node whose ranks had not reported when the watcher first saw an attempt is
            # counted, not named (one run under load met attempt 1 with node-1's ranks unheard)
            for e, nodes in zip(watching, (["node-1", "node-2"], ["node-1", "node-3"]),
                                strict=True):
                assert set(e["nodes"]) <= set(nodes) and e["nodes"], events
                assert e["ranks"] == 4 and e["unreported"] == 4 - 2 * len(e["nodes"]), events
            (ended,) = [e for e in events if e["event"] == "ended"]
            assert ended["state"] == "finished" and ended["how"] == "exited", ended
            assert store.job_states(job)[-1].state is JobPhase.FINISHED
            # the incident's facts agree with what the store held when the watcher read it
            check_incidents(store, job, as_stored=True)
    finally:
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGCONT)
        cluster.stop()


def test_a_healthy_job_with_a_slow_checkpoint_is_only_observed(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    with watched_store(slurm_cluster, tmp_path) as watched:
        work = tmp_path / "work"
        work.mkdir()
        # rank 0's checkpoint of step 40 takes 12 s more: its peers wait in the next step's
        # collectives past the 5 s hang threshold, on a rank that is alive
        slurm_id = slurm_cluster.sbatch(
            SCRIPT, args=("--steps", "120", "--checkpoint-every", "20", "--step-sleep-ms", "50",
                          "--fault-in", "ckpt:0:40@0", "--slow-checkpoint-s", "12"),
            env=watched.env, cwd=work)
        job = JobId(f"slurm-{slurm_id}")
        watched.watch(slurm_cluster, job, tmp_path / "watch")
        state = slurm_cluster.wait_job_state(slurm_id, {"COMPLETED", "FAILED", "CANCELLED"})
        log = (work / f"tracehound-ddp-{slurm_id}.out").read_text()
        assert state == "COMPLETED", log[-4000:]
        assert "rank 0: slow checkpoint at step 40 (12 s)" in log
        watched.ended(slurm_cluster)

        assert slurm_cluster.job_field(slurm_id, "Restarts") == "0"
        assert set(slurm_cluster.node_states().values()) == {"idle"}
        incidents = watched.store.incidents(job)
        # the pause is a stall of rank 0, recorded and watched; nothing else, and no Slurm step
        assert [(i.kind, i.culprit_ranks) for i in incidents] == [("stall", (0,))], [
            (i.kind, i.culprit_ranks, i.summary) for i in incidents]
        assert {a.kind for i in incidents for a in i.actions} <= {ActionKind.OBSERVE,
                                                                   ActionKind.ALERT}
        events = watched.events()
        assert not [e for e in events if e["event"] == "action"
                    and e["action"] in ("isolate_node", "restart", "give_up")], events
        (ended,) = [e for e in events if e["event"] == "ended"]
        assert ended["state"] == "finished", ended
