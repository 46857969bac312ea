"""Stopping `tracehound run` (SIGTERM, as a scheduler does, or Ctrl-C) leaves no rank behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store

pytestmark = pytest.mark.e2e


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie has exited already
        return stat.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_the_controller_stops_every_rank(tmp_path: Path, sig: signal.Signals) -> None:
    from tracehound.controller.cli.demo import training_script

    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracehound.controller.cli", "run", "--nnodes", "2",
         "--nproc-per-node", "1", "--job-id", "stop", "--store", f"chdb://{store}",
         "--workdir", str(tmp_path / "work"), training_script(), "--steps", "100000",
         "--step-sleep-ms", "20", "--checkpoint-every", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    logs = tmp_path / "work" / "stop" / "logs" / "attempt-0"
    deadline = time.monotonic() + 120
    while not any("step 10 " in log.read_text() for log in logs.glob("rank-*.log")):
        assert time.monotonic() < deadline, "the job never started training"
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.5)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM if sig is signal.SIGINT else signal.SIGKILL)
        proc.communicate(timeout=60)
        raise
    assert proc.returncode == 130, err[-2000:]
    assert "all ranks were stopped" in err
    with open_store(f"chdb://{store}") as opened:
        pids = {hb.pid for hb in opened.latest_heartbeats(JobId("stop"), 0)}
        last = opened.job_states(JobId("stop"))[-1]
    assert len(pids) == 2
    # the run ended by the operator's hand: a new `tracehound run` of the job starts afresh
    assert last.state == "failed" and last.detail.startswith("interrupted")
    time.sleep(1)
    assert not [p for p in pids if alive(p)]
