"""The ClickHouse server is down for many of the node agents' retry cycles in the middle of a real
job, then comes back.

A 2-node gloo DDP job (`tracehound run`, one rank per node, its node agents shipping straight
into the server, their longest wait between tries set to 2 s with
TRACEHOUND_SHIP_MAX_BACKOFF_S) trains while the server is stopped for 15 s: seven and a half
times that longest wait, as a minute is six times the default's 10 s. Afterwards:

- every collective the ranks completed (by their final heartbeats) is stored exactly once,
  counted by (job, attempt, rank, group, seq) over the raw rows; no heartbeat is stored twice;
- the node agents felt the outage (retries) and shipped everything they spooled;
- training was not held up: each rank's own heartbeats (spooled during the outage and shipped
  after it) show it stepping in every sixth of the outage, and its log shows the same.

tests/controller/test_store_outage.py does the same for 10 s at the default settings, shorter
than one longest wait; this outage outlasts the agents' longest wait several times over and
leaves a backlog of thousands of records per node.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clickhouse_harness import start_server
from reliability_harness import (
    duplicated_heartbeats,
    end_run,
    read_store,
    steps_in_slices,
    tally,
)

from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.events import now_us
from tracehound.tracing.ids import JobId
from tracehound.tracing.settings import TRACEHOUND_SHIP_MAX_BACKOFF_S
from tracehound.tracing.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.clickhouse_server]

JOB = JobId("outage")
OUTAGE_S = 15.0
RETRY_MAX_S = 2.0
STEPS = 1000
STEP_SLEEP_MS = 30  # at most ~33 steps/s: 1000 steps outlast the outage by a quarter minute
SLICES = 6


def latest_step(url: str) -> int:
    store = open_store(url)
    try:
        beats = store.latest_heartbeats(JOB, 0)
    finally:
        store.close()
    return min((hb.step for hb in beats), default=0) if len(beats) == 2 else 0


def logged_step(log: Path) -> int:
    """The last step a rank printed (train_ddp prints every 10 steps)."""
    steps = re.findall(r": step (\d+) loss", log.read_text(errors="replace"))
    return int(steps[-1]) if steps else 0


def test_store_down_for_many_retries_loses_nothing_stores_nothing_twice_training_goes_on(
    tmp_path: Path,
) -> None:
    from tracehound.controller.cli.demo import training_script

    server = start_server(tmp_path / "clickhouse")
    url = server.url
    work = tmp_path / "work"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracehound.controller.cli", "run", "--nnodes", "2",
         "--nproc-per-node", "1", "--job-id", JOB, "--store", url, "--workdir", str(work),
         "--no-warm-spares", "--json", training_script(), "--steps", str(STEPS),
         "--step-sleep-ms", str(STEP_SLEEP_MS), "--checkpoint-every", "500"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # every DDP bucket a record (by default they are counted, a step recorded now and
        # then), so every seq of every group must be stored
        env={**os.environ, "TRACEHOUND_DDP_TRACE_EVERY": "1",
             TRACEHOUND_SHIP_MAX_BACKOFF_S: str(RETRY_MAX_S)},
    )
    logs = work / JOB / "logs" / "attempt-0"
    try:
        deadline = time.monotonic() + 300
        while latest_step(url) < 20:
            assert proc.poll() is None, "the job ended before the outage could be staged"
            assert time.monotonic() < deadline, "the job never reached step 20"
            time.sleep(0.5)
        down_us = now_us()
        server.stop()
        logged_at_down = [logged_step(logs / f"rank-{r}.log") for r in range(2)]
        with pytest.raises(TemporaryStoreError):
            open_store(url)
        time.sleep(OUTAGE_S)
        logged_at_up = [logged_step(logs / f"rank-{r}.log") for r in range(2)]
        assert proc.poll() is None, "the job must outlive the outage for this test to mean much"
        up_us = now_us()
        server = start_server(tmp_path / "clickhouse", tcp_port=server.tcp_port)
        out, err = proc.communicate(timeout=900)
    finally:
        end_run(proc, work / JOB)
    try:
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out)["completed"] is True
        stored = read_store(url, JOB)
    finally:
        server.stop()

    counted = tally(stored)
    outage = {r: steps_in_slices(stored.heartbeats, rank=r, start_us=down_us, end_us=up_us,
                                 slices=SLICES) for r in range(2)}
    agent_logs = sorted(logs.glob("agent-*.log"))
    finals = [re.findall(r"received (\d+), spooled (\d+), shipped (\d+), rejected (\d+), "
                         r"pending segments (\d+), retries (\d+)", p.read_text())[-1]
              for p in agent_logs]
    print(f"store down {OUTAGE_S:.0f} s: {counted.describe()}; steps per {OUTAGE_S / SLICES:.0f} s "
          f"of the outage by heartbeats {outage}; printed steps {logged_at_down} -> "
          f"{logged_at_up}; agents (received, spooled, shipped, rejected, pending, retries) "
          f"{finals}")

    assert sorted(hb.rank for hb in stored.final) == [0, 1]
    for hb in stored.final:
        assert hb.step == STEPS and hb.dropped == 0
    # a DDP gradient all-reduce every step at least, on both ranks
    assert counted.expected >= 2 * STEPS
    assert not counted.missing, f"{len(counted.missing)} completed collectives never stored: " \
                                f"{counted.missing[:10]}"
    assert not counted.duplicated, f"stored more than once: {list(counted.duplicated)[:10]}"
    assert not counted.unexpected, f"stored but never completed: {counted.unexpected[:10]}"
    assert counted.stored_rows == counted.expected
    assert duplicated_heartbeats(stored.heartbeats) == 0

    assert len(finals) == 2, agent_logs
    for received, spooled, shipped, rejected, pending, retries in finals:
        assert int(rejected) == 0 and int(pending) == 0
        assert int(received) <= int(spooled) == int(shipped)
        assert int(retries) > 0, "the agent never noticed the outage"

    for rank, per_slice in outage.items():
        # the heartbeats sent while the server was down were stored: the rank stepped in
        # every part of the outage
        assert all(n > 0 for n in per_slice), f"rank {rank} stood still: {per_slice}"
        assert logged_at_up[rank] > logged_at_down[rank]
