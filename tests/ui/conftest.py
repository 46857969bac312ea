"""Stores for the dashboard's tests: simulated jobs (a hang at 1,024 ranks, a straggler at 512,
a job with hostile names and text) diagnosed and recorded as incidents, and a real demo run."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import ui_harness`

from ui_harness import FilledStore, fill_simulated

from tracehound.ui.store import close_shared_store


@pytest.fixture(autouse=True)
def _no_store_left_open() -> Iterator[None]:
    """The dashboard keeps one store per process; an embedded one must be closed before a test
    opens another directory."""
    close_shared_store()
    yield
    close_shared_store()


@pytest.fixture(scope="session")
def sim_store(tmp_path_factory: pytest.TempPathFactory) -> FilledStore:
    url = f"chdb://{tmp_path_factory.mktemp('ui-sim') / 'store'}"
    return FilledStore(url, fill_simulated(url))


@pytest.fixture(scope="session")
def demo_store(tmp_path_factory: pytest.TempPathFactory) -> FilledStore:
    """A real `tracehound demo` run (2 nodes x 2 gloo ranks, rank 3 stopped with SIGSTOP)."""
    base = tmp_path_factory.mktemp("ui-demo")
    url = f"chdb://{base / 'store'}"
    proc = subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "demo", "--job-id", "demo-hang",
         "--store", url, "--workdir", str(base / "work"), "--json"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["completed"] is True, report
    return FilledStore(url, {"demo-hang": {
        "kind": "hang", "culprit_ranks": [report["injected_rank"]],
        "culprit_nodes": [report["injected_node"]]}})

