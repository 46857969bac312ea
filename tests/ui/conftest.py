"""Stores for the dashboard's tests: simulated jobs (a hang at 1,024 ranks, a straggler at 512,
a job with hostile names and text) diagnosed and recorded as incidents, and a real demo run."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import ui_harness`

from demo_harness import DemoRun
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
def demo_store(demo_hang: DemoRun) -> FilledStore:
    """A real `tracehound demo` run (2 nodes x 2 gloo ranks, rank 3 stopped with SIGSTOP):
    the session's `demo_hang`, which the demo's own checks read too."""
    report = demo_hang.report
    assert report["completed"] is True, report
    return FilledStore(demo_hang.store, {demo_hang.job: {
        "kind": "hang", "culprit_ranks": [report["injected_rank"]],
        "culprit_nodes": [report["injected_node"]]}})
