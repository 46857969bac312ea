"""End to end through the real command: a real 4-rank gloo DDP job, a fault injected from outside
(SIGSTOP or SIGKILL of one rank), detection, isolation of the node, restart from checkpoint on the
spare, and training to the end. Then the stored incident and diagnosis, read back by the CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from demo_harness import DemoRun

from tracehound.controller.policy.recovery import SOFT_KINDS

pytestmark = pytest.mark.e2e

SOFT = {kind.value for kind in SOFT_KINDS}


def tracehound(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", *args],
        capture_output=True, text=True, timeout=900, check=False,
    )


def run_demo(fault: str, rank: int, store: str, workdir: Path, job: str) -> dict[str, Any]:
    proc = tracehound("demo", "--fault", fault, "--rank", str(rank), "--store", store,
                      "--workdir", str(workdir), "--job-id", job, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def check_recovery(report: dict[str, Any], fault: str, rank: int) -> None:
    assert report["fault"] == fault
    assert report["injected_rank"] == rank
    assert report["culprit_ranks"] == [rank]
    assert report["culprit_nodes"] == [f"node-{rank // 2}"]
    assert report["kind"] == fault
    assert report["completed"] is True
    assert report["attempts"] == 2
    assert report["actions"] == ["stop_job attempt 0", f"isolate_node node-{rank // 2}",
                                 "restart attempt 1"]
    assert report["detect_s"] > 0
    assert report["resume_s"] > report["detect_s"]
    # The restart resumed from a checkpoint taken before the fault (every 25 steps): it lost
    # fewer than 25 steps plus the steps run while the fault went unnoticed.
    assert 0 <= report["steps_lost"] < 25 + 10


def check_stored(store: str, job: str, fault: str, rank: int) -> None:
    listed = tracehound("incidents", "--job", job, "--store", store, "--json")
    assert listed.returncode == 0, listed.stderr
    incidents = json.loads(listed.stdout)
    incident, *later = incidents
    # 4 ranks share 2 cores with the rest of the suite: the load can make one rank of the
    # restarted job compute a sixth longer, a straggler by the job's own timing (seen in a CI
    # run: rank 2 at 1.17x). Seen in two windows in a row it is an incident, watched and never
    # acted on before its third: no stop, no isolation, no restart of a healthy attempt.
    for soft in later:
        assert soft["attempt"] == 1 and soft["kind"] in SOFT, incidents
        assert {a["kind"] for a in soft["actions"]} <= {"observe", "alert"}, incidents
    assert incident["kind"] == fault
    assert incident["culprit_ranks"] == [rank]
    assert incident["culprit_nodes"] == [f"node-{rank // 2}"]
    assert incident["confidence"] >= 0.8
    assert incident["detected_at"] > 0
    assert [a["kind"] for a in incident["actions"]] == [
        "stop_job", "isolate_node", "restart", "resumed"]

    diag = tracehound("diagnose", "--job", job, "--attempt", "0", "--store", store, "--json")
    assert diag.returncode == 0, diag.stderr
    verdict = json.loads(diag.stdout)
    assert verdict["kind"] == fault
    assert verdict["culprit_ranks"] == [rank]
    assert verdict["evidence"]
    healthy = tracehound("diagnose", "--job", job, "--attempt", "1", "--store", store, "--json")
    # the whole attempt judged at once may or may not hold the window a soft fault was seen in
    assert json.loads(healthy.stdout)["kind"] in ({"healthy"} | (SOFT if later else set()))


def test_demo_hang_is_localized_and_recovered_embedded_store(demo_hang: DemoRun) -> None:
    check_recovery(demo_hang.report, "hang", 3)
    check_stored(demo_hang.store, demo_hang.job, "hang", 3)


@pytest.mark.clickhouse_server
def test_demo_crash_is_localized_and_recovered_server_store(demo_crash: DemoRun) -> None:
    check_recovery(demo_crash.report, "crash", 1)
    check_stored(demo_crash.store, demo_crash.job, "crash", 1)


def test_demo_xid_on_one_node_is_a_hardware_verdict_naming_it(tmp_path: Path) -> None:
    # rank 2's simulated GPU (gpu0 of node-1) reports Xid 79 and the rank freezes: the hang is
    # explained by the GPU's fault, read from the health samples the node agent shipped
    store = f"chdb://{tmp_path / 'store'}"
    report = run_demo("xid", 2, store, tmp_path / "work", "e2e-xid")
    assert (report["kind"], report["culprit_ranks"], report["culprit_nodes"]) == (
        "hardware", [2], ["node-1"]), report
    assert "xid=79 on gpu0 of node node-1" in report["summary"]
    assert report["actions"][:2] == ["stop_job attempt 0", "isolate_node node-1"]
    assert report["completed"] is True
    diag = tracehound("diagnose", "--job", "e2e-xid", "--attempt", "0", "--store", store,
                      "--json")
    verdict = json.loads(diag.stdout)
    assert verdict["kind"] == "hardware" and verdict["culprit_nodes"] == ["node-1"]
    assert verdict["basis"] == "health_correlation"


def test_bad_store_url_is_named_in_a_clear_error() -> None:
    proc = tracehound("incidents", "--store", "clickhouse://default:secret@:9000/x")
    assert proc.returncode == 2
    assert "names no host" in proc.stderr
    assert "secret" not in proc.stderr
    proc = tracehound("incidents", "--store", "postgres://h/db")
    assert proc.returncode == 2
    assert "unknown scheme 'postgres'" in proc.stderr


def test_unreachable_server_is_named_in_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = tracehound("incidents", "--store", f"clickhouse://default:@127.0.0.1:{port}/db")
    assert proc.returncode == 2
    assert f"127.0.0.1:{port}" in proc.stderr
    assert "unreachable" in proc.stderr
