"""A whole node lost under `tracehound run`: its ranks, its node agent and its snapshot keeper
killed at once, mid-training. The job is a real 2 nodes x 2 ranks DDP job taking an in-memory
snapshot every step (persisted to disk every 50). The node is isolated, the job restarts on the
spare node, and every rank resumes from the memory of the surviving node: the spare's ranks from
the replicas it holds for the lost node. No disk checkpoint is read, and the steps lost are
those in flight when the node died.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_harness import beside_observed_stragglers, brief

from tracehound.agent.rank.restore import complete_steps

pytestmark = pytest.mark.e2e

KILL_AFTER_STEP = 120


def last_step(log: Path) -> int:
    steps = re.findall(r"step (\d+) loss", log.read_text()) if log.exists() else []
    return int(steps[-1]) if steps else 0


def node_pids(work: Path, node: str) -> list[int]:
    noted = json.loads((work / "attempts" / "attempt-0.json").read_text())
    pids = [r["pid"] for r in noted["ranks"] if r["node"] == node]
    pids += [a["pid"] for a in noted["agents"] if a["node"] == node]
    keepers = json.loads((work / "keepers.json").read_text())
    pids += [k["pid"] for k in keepers if k["node"] == node]
    return pids


def test_a_lost_node_is_restored_on_the_spare_from_the_replicas_in_memory(tmp_path: Path) -> None:
    from tracehound.controller.cli.demo import training_script

    store = f"chdb://{tmp_path / 'store'}"
    work = tmp_path / "work" / "lost-node"  # the run's own directory under --workdir
    run = subprocess.Popen(
        [sys.executable, "-m", "tracehound.controller.cli", "run", "--job-id", "lost-node",
         "--store", store, "--workdir", str(work.parent), "--timeout", "600", "--json",
         "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "--no-warm-spares",
         training_script(), "--steps", "260", "--step-sleep-ms", "20", "--print-every", "1",
         "--snapshot-every", "1", "--checkpoint-every", "50", "--pg-timeout-s", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        logs = work / "logs" / "attempt-0"
        deadline = time.monotonic() + 600
        while min(last_step(logs / f"rank-{r}.log") for r in (2, 3)) < KILL_AFTER_STEP:
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.05)
        victims = node_pids(work, "node-1")
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        reached = max(last_step(logs / f"rank-{r}.log") for r in range(4))
        out, err = run.communicate(timeout=600)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    outcome = json.loads(out)
    assert outcome["completed"] is True, err[-3000:]
    listed = subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "incidents", "--job", "lost-node",
         "--store", store, "--json"], capture_output=True, text=True, timeout=120, check=True)
    incidents = beside_observed_stragglers(json.loads(listed.stdout))
    assert [(i["kind"], i["culprit_nodes"]) for i in incidents] == [("crash", ["node-1"])], \
        brief(incidents)
    assert "isolate_node" in [a["kind"] for a in incidents[0]["actions"]]

    # every rank of attempt 1 resumed from the same step, in the memory of node-0: ranks 2 and 3,
    # now on the spare node-2, from the replicas of node-1's snapshots
    resumed = {}
    for rank in range(4):
        text = (work / "logs" / "attempt-1" / f"rank-{rank}.log").read_text()
        found = re.search(r"resumed from step (\d+) \(step \1 from the memory of node (\S+)\)",
                          text)
        assert found, text[-2000:]
        resumed[rank] = (int(found.group(1)), found.group(2))
    steps = {step for step, _ in resumed.values()}
    assert len(steps) == 1 and {node for _, node in resumed.values()} == {"node-0"}, resumed
    (step,) = steps
    noted = json.loads((work / "attempts" / "attempt-1.json").read_text())
    assert {r["node"] for r in noted["ranks"] if r["rank"] in (2, 3)} == {"node-2"}
    # newer than any disk checkpoint, and within the steps in flight when the node died (the
    # killed ranks had printed step `reached` at most; a survivor may have run a step further)
    on_disk = max(s for s in complete_steps(work / "checkpoints") if s <= reached)
    assert step > on_disk, (step, on_disk)
    assert reached - 3 <= step <= reached + 1, (step, reached)
    # the persisted snapshots of the run are complete steps, each with every rank's file
    for path in (work / "checkpoints").glob("step-*"):
        if (path / "COMPLETE").exists():
            assert sorted(p.name for p in path.glob("rank-*.snap")) == [
                f"rank-{r:05d}.snap" for r in range(4)]
    # and no keeper is left running
    for keeper in json.loads((work / "keepers.json").read_text()):
        assert not Path(f"/proc/{keeper['pid']}").exists(), keeper
    print(f"lost node at step {reached}: resumed from step {step} (memory), disk had "
          f"{on_disk}")
