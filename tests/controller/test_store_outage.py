"""No loss, no duplicates: the ClickHouse server goes away for ten seconds in the middle of a real
job and comes back. Every collective the ranks recorded must end up stored exactly once, counted
by (job, attempt, rank, group, sequence id) against what each rank says it completed in its final
heartbeat; the supervisor's own records (rank exits) pass through its journal in the job's
workdir, which ends empty.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clickhouse_harness import start_server

from tracehound.agent.rank.backend import BACKEND_SUFFIX
from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.clickhouse_server]

JOB = JobId("outage")


def wait_for_step(url: str, step: int, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended before the outage could be staged"
        store = open_store(url)
        try:
            beats = store.latest_heartbeats(JOB, 0)
        finally:
            store.close()
        if len(beats) == 2 and min(hb.step for hb in beats) >= step:
            return
        time.sleep(0.5)
    raise AssertionError(f"the job never reached step {step}")


def test_store_outage_mid_job_loses_nothing_and_stores_nothing_twice(tmp_path: Path) -> None:
    from tracehound.controller.cli.demo import training_script

    server = start_server(tmp_path / "clickhouse")
    url = server.url
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracehound.controller.cli", "run", "--nnodes", "2",
         "--nproc-per-node", "1", "--no-warm-spares",  # one attempt: no spares to start
         "--job-id", JOB, "--store", url, "--workdir",
         str(tmp_path / "work"), "--json", training_script(), "--steps", "700",
         "--step-sleep-ms", "30", "--checkpoint-every", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # every DDP bucket recorded (by default they are counted, a step recorded now and
        # then): each seq of each group must then be stored, a record a bucket
        env={**os.environ, "TRACEHOUND_DDP_TRACE_EVERY": "1"},
    )
    try:
        wait_for_step(url, 20, proc)
        server.stop()
        with pytest.raises(TemporaryStoreError):
            open_store(url)
        time.sleep(10)
        assert proc.poll() is None, "the job must outlive the outage for this test to mean much"
        server = start_server(tmp_path / "clickhouse", tcp_port=server.tcp_port)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    try:
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out)["completed"] is True

        store = open_store(url)
        try:
            keys = store.collective_keys(JOB)
            final = store.latest_heartbeats(JOB, 0)
            exits = store.exits(JOB, 0)
        finally:
            store.close()
        assert sorted((e.rank, e.exit_code) for e in exits) == [(0, 0), (1, 0)]
        journal = tmp_path / "work" / JOB / "journal.jsonl"
        assert journal.read_bytes() == b"", "the supervisor's journal was written to the store"
        counts = collections.Counter((k.attempt, k.rank, k.group, k.seq) for k in keys)
        twice = {k: n for k, n in counts.items() if n > 1}
        assert not twice, f"stored more than once: {sorted(twice)[:10]}"

        assert sorted(hb.rank for hb in final) == [0, 1]
        expected = set()
        for hb in final:
            assert hb.dropped == 0
            assert hb.step == 700
            for g in hb.groups:
                if g.group.endswith(BACKEND_SUFFIX):
                    continue  # the backend's own count, in heartbeats only (reliability_harness)
                assert g.last_completed == g.last_enqueued
                expected |= {(0, hb.rank, g.group, s) for s in range(1, g.last_completed + 1)}
        # 700 steps of DDP gradient all-reduce at least, on both ranks.
        assert len(expected) >= 2 * 700
        missing = expected - set(counts)
        assert not missing, f"{len(missing)} recorded collectives never stored"
        assert set(counts) == expected
    finally:
        server.stop()
