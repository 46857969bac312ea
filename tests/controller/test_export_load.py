"""`tracehound export` then `tracehound load` into the other store kind gives the same records and
the same `diagnose` verdict: on a real demo job (a real 2x2-rank gloo job, SIGKILLed rank,
restart) and on a simulated 1,024-rank job. Everything goes through the real command."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from demo_harness import DemoRun
from evidence_check import check_incidents

from tracehound.tracing.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.clickhouse_server]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracehound.controller.cli", *args],
                          capture_output=True, text=True, timeout=900, check=False)


def server_store(clickhouse_url: str) -> str:
    return urlsplit(clickhouse_url)._replace(
        path=f"/tracehound_x{uuid.uuid4().hex[:10]}").geturl()


def export(job: str, store: str, path: Path) -> list[str]:
    """The records of `job` in `store` as sorted JSON lines (the header aside)."""
    done = cli("export", "--job", job, "--store", store, "-o", str(path))
    assert done.returncode == 0, done.stderr
    header, *lines = path.read_text().splitlines()
    assert json.loads(header)["version"] == 1
    return sorted(lines)


def diagnose(job: str, store: str, attempt: int | None = None) -> dict[str, Any]:
    extra = ["--attempt", str(attempt)] if attempt is not None else []
    done = cli("diagnose", "--job", job, "--store", store, "--json", *extra)
    assert done.returncode == 0, done.stderr
    verdict: dict[str, Any] = json.loads(done.stdout)
    return verdict


def move(job: str, source: str, target: str, tmp_path: Path) -> tuple[list[str], list[str]]:
    """Export `job` from `source`, load it into `target`, export it again from there."""
    first = export(job, source, tmp_path / "first.jsonl")
    loaded = cli("load", str(tmp_path / "first.jsonl"), "--store", target, "--json")
    assert loaded.returncode == 0, loaded.stderr
    summary = json.loads(loaded.stdout)
    assert summary["rejected"] == [] and summary["unknown_kinds"] == {}
    assert summary["stored"] == len(first)
    second = export(job, target, tmp_path / "second.jsonl")
    return first, second


def test_a_simulated_1024_rank_job_moves_between_stores_with_its_verdict(
    tmp_path: Path, clickhouse_url: str
) -> None:
    embedded = f"chdb://{tmp_path / 'chdb'}"
    wrote = cli("simulate", "--ranks", "1024", "--fault", "straggler", "--seed", "11",
                "--job-id", "big", "--store", embedded, "--json")
    assert wrote.returncode == 0, wrote.stderr
    truth = json.loads(wrote.stdout)["truth"]
    server = server_store(clickhouse_url)
    first, second = move("big", embedded, server, tmp_path)
    assert len(first) > 100_000
    assert first == second
    before, after = diagnose("big", embedded), diagnose("big", server)
    assert before == after
    assert before["kind"] == "straggler"
    assert before["culprit_ranks"][0] in truth["culprit_ranks"]


def test_a_real_demo_job_moves_between_stores_with_its_verdict_and_incidents(
    tmp_path: Path, demo_crash: DemoRun
) -> None:
    """The demo's crash run (shared with tests/controller/test_demo_e2e.py)."""
    server, job = demo_crash.store, demo_crash.job
    assert demo_crash.report["culprit_ranks"] == [1]
    embedded = f"chdb://{tmp_path / 'chdb'}"
    first, second = move(job, server, embedded, tmp_path)
    assert first == second
    kinds = {json.loads(line)["type"] for line in first}
    assert {"collective", "heartbeat", "group", "exit", "process", "incident",
            "action"} <= kinds
    for attempt in (0, 1):
        assert diagnose(job, server, attempt) == diagnose(job, embedded, attempt)
    listed = [cli("incidents", "--job", job, "--store", s, "--json") for s in
              (server, embedded)]
    assert json.loads(listed[0].stdout) == json.loads(listed[1].stdout)
    assert json.loads(listed[1].stdout)[0]["culprit_ranks"] == [1]
    # the moved incidents' facts agree with the moved records (all of them: a loaded store's
    # arrivals are its load's, so not as stored when each verdict read the job's own store)
    with open_store(embedded, create=False) as moved:
        check_incidents(moved, job)
