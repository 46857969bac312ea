"""`tracehound agent` on its own, with simulated GPUs: faults written to its fault file reach the
store (the ClickHouse server directly, or the embedded store through its ingest endpoint) with
the right node, GPU and kind; its settings come from TRACEHOUND_* variables, and a bad one is
refused naming the variable."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tracehound.analysis.hardware import HealthKind, health_kind
from tracehound.tracing.events import HealthSample, HealthSeverity
from tracehound.tracing.store import TraceStore, is_embedded
from tracehound.tracing.store.ingest import IngestServer

pytestmark = pytest.mark.e2e

TRACEHOUND = [sys.executable, "-m", "tracehound.controller.cli"]


@pytest.fixture
def sink(store: TraceStore, store_url: str) -> Iterator[str]:
    if not is_embedded(store_url):
        yield store_url
        return
    server = IngestServer(store).start()
    try:
        yield server.url
    finally:
        server.stop()


def wait_for(store: TraceStore, nodes: list[str], want: int, deadline_s: float = 60.0
             ) -> list[HealthSample]:
    """The warnings and critical samples of `nodes`, once there are `want` of them (or at the
    deadline: the assertions that follow then say what is missing)."""
    end = time.monotonic() + deadline_s
    while True:
        found = [s for s in store.health(nodes, 0, 2**62)
                 if s.severity is not HealthSeverity.INFO]
        if len(found) >= want or time.monotonic() > end:
            return found
        time.sleep(0.2)


def test_simulated_gpu_faults_reach_the_store(tmp_path: Path, store: TraceStore,
                                              sink: str) -> None:
    faults = tmp_path / "faults.jsonl"
    faults.touch()
    env = {**os.environ, "TRACEHOUND_JOB_ID": "hw1", "TRACEHOUND_NODE_ID": "node-7",
           "TRACEHOUND_SINK": sink, "TRACEHOUND_GPU": "sim", "TRACEHOUND_SIM_GPUS": "4",
           "TRACEHOUND_SIM_GPU_FAULTS": str(faults), "TRACEHOUND_HEALTH_INTERVAL_S": "0.2"}
    stats = tmp_path / "stats.json"
    agent = subprocess.Popen(
        [*TRACEHOUND, "agent", "--socket", str(tmp_path / "a.sock"),
         "--spool", str(tmp_path / "spool"), "--stats-file", str(stats)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        lines = [{"node": "node-7", "gpu": 2, "kind": "xid", "code": 79},
                 {"node": "node-7", "gpu": 0, "kind": "thermal"},
                 {"node": "node-3", "gpu": 1, "kind": "xid", "code": 48}]  # another node's
        faults.write_text("".join(json.dumps(line) + "\n" for line in lines))
        found = wait_for(store, ["node-7", "node-3"], want=4)
    finally:
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=60)
    assert agent.returncode == 0, out.decode()
    by = {(s.node, s.device, s.metric): s for s in found}
    assert {k[:2] for k in by} == {("node-7", "gpu2"), ("node-7", "gpu0")}, sorted(by)
    xid = by[("node-7", "gpu2", "xid")]
    assert (xid.job, xid.value, xid.severity, xid.source) == (
        "hw1", 79.0, HealthSeverity.CRITICAL, "sim")
    assert health_kind(xid) is HealthKind.GPU_FAULT
    assert by[("node-7", "gpu2", "gpu_lost")].severity is HealthSeverity.CRITICAL
    assert health_kind(by[("node-7", "gpu0", "clocks_event_reasons")]) is HealthKind.SLOWDOWN
    # the host's readings ship too, and the agent counts what its sources gave
    readings = {s.metric for s in store.health(["node-7"], 0, 2**62)}
    assert {"load1", "mem_available_pct", "temperature_c"} <= readings
    assert json.loads(stats.read_text())["source_records"] > 0


def test_a_bad_setting_names_the_variable(tmp_path: Path) -> None:
    env = {**os.environ, "TRACEHOUND_JOB_ID": "hw2", "TRACEHOUND_SINK": "http://127.0.0.1:9",
           "TRACEHOUND_HEALTH_INTERVAL_S": "often"}
    done = subprocess.run([*TRACEHOUND, "agent", "--spool", str(tmp_path / "s")], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "TRACEHOUND_HEALTH_INTERVAL_S='often': expected a number" in done.stderr
    env["TRACEHOUND_HEALTH_INTERVAL_S"] = "1"
    env["TRACEHOUND_GPU"] = "cuda"
    done = subprocess.run([*TRACEHOUND, "agent", "--spool", str(tmp_path / "s")], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2
    assert "TRACEHOUND_GPU='cuda': expected one of auto, nvml, sim, off" in done.stderr
    del env["TRACEHOUND_JOB_ID"]
    env.pop("TORCHELASTIC_RUN_ID", None)
    env["TRACEHOUND_GPU"] = "sim"
    done = subprocess.run([*TRACEHOUND, "agent", "--spool", str(tmp_path / "s")], env=env,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "--job is required unless TRACEHOUND_JOB_ID" in done.stderr
