"""`tracehound instrument -- torchrun ...`: the recorder gets into every rank that a real torchrun
starts, with no `tracehound run`, and the node agent ships their traces to the store; the
command's exit status comes back; `--env` prints the variables for launchers driven by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracehound.tracing.store import open_store

pytestmark = pytest.mark.e2e

SCRIPT = str(Path(__file__).parent / "scripts" / "torchrun_job.py")


def instrument(tmp_path: Path, job: str, *script_args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEHOUND_")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "instrument", "--job", job,
         "--node", "host-a", "--gpu", "off", "--store", f"chdb://{tmp_path / 'store'}",
         "--workdir", str(tmp_path / "work"), "--json", "--",
         sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "3", SCRIPT, *script_args],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )


def test_torchrun_ranks_are_traced_and_the_exit_status_comes_back_with_the_diagnosis(
        tmp_path: Path) -> None:
    # rank 1 exits with status 3 once the job's work is done: torchrun reports that failure as
    # its own exit status 1, and the traces of the attempt are diagnosed (under instrument the
    # ranks' exit codes are torchrun's to know, not stored)
    done = instrument(tmp_path, "inst1", "--steps", "20", "--exit-code", "3")
    assert done.returncode == 1, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert (report["job"], report["node"], report["exit_status"]) == ("inst1", "host-a", 1)
    assert report["diagnosis"]["job"] == "inst1" and report["diagnosis"]["attempt"] == 0
    assert report["agent"]["shipped"] > 0 and report["agent"]["rejected"] == 0
    store = open_store(f"chdb://{tmp_path / 'store'}")
    try:
        beats = store.latest_heartbeats("inst1", 0)
        assert sorted(hb.rank for hb in beats) == [0, 1, 2]
        assert {hb.node for hb in beats} == {"host-a"}
        world = {hb.rank: {g.group: g.last_completed for g in hb.groups} for hb in beats}
        # every rank completed the same collectives of the world group: 20 all-reduces and the
        # barrier; ranks 0 and 1 also their group's 20
        assert {progress["0"] for progress in world.values()} == {21}
        pair = {rank: [v for g, v in progress.items() if g != "0"]
                for rank, progress in world.items()}
        assert pair[0] == pair[1] == [20] and pair[2] == []
    finally:
        store.close()


def test_env_prints_the_variables(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "instrument", "--env", "--job",
         "exp7", "--node", "n3"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    lines = dict(line.removeprefix("export ").split("=", 1)
                 for line in done.stdout.splitlines() if line.startswith("export "))
    assert lines["TRACEHOUND_JOB_ID"] == "exp7" and lines["TRACEHOUND_NODE_ID"] == "n3"
    assert lines["TRACEHOUND_AGENT_SOCKET"] == "/tmp/tracehound-exp7-n3.sock"
    assert lines["PYTHONPATH"].split(os.pathsep)[0].endswith("_bootstrap")


def test_inside_a_slurm_job_the_defaults_are_slurms(tmp_path: Path) -> None:
    # every node of a Slurm job records under one job id, named as `tracehound watch --slurm`
    # finds its Slurm job; nodes are named as scontrol drains them; a requeue is an attempt
    slurm = {**{k: v for k, v in os.environ.items() if not k.startswith("TRACEHOUND_")},
             "SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "c7", "SLURM_RESTART_COUNT": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "instrument", "--env"],
        capture_output=True, text=True, timeout=120, check=True, env=slurm,
    )
    lines = dict(line.removeprefix("export ").split("=", 1)
                 for line in done.stdout.splitlines() if line.startswith("export "))
    assert (lines["TRACEHOUND_JOB_ID"], lines["TRACEHOUND_NODE_ID"]) == ("slurm-4242", "c7")
    assert lines["TRACEHOUND_ATTEMPT"] == "2"
    assert "tracehound agent --job slurm-4242 --node c7" in done.stdout
    given = subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "instrument", "--env", "--job",
         "exp7", "--node", "n3"],
        capture_output=True, text=True, timeout=120, check=True,
        env={**slurm, "TRACEHOUND_ATTEMPT": "5"},
    )
    lines = dict(line.removeprefix("export ").split("=", 1)
                 for line in given.stdout.splitlines() if line.startswith("export "))
    assert (lines["TRACEHOUND_JOB_ID"], lines["TRACEHOUND_NODE_ID"]) == ("exp7", "n3")
    assert "TRACEHOUND_ATTEMPT" not in lines  # the recorder reads the one already set
