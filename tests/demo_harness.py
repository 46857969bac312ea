"""Real `tracehound demo` runs for the tests that read them (the session fixtures `demo_hang` and
`demo_crash` of tests/conftest.py run each once)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evidence_check import assert_facts_agree

NOT_A_TRANSITION = "is not a transition of the job's state machine"
"""What the supervisor logs, as an error, for a job state that does not follow from the one
before (it writes the state anyway): a real run's log must never hold it."""


@dataclass(frozen=True)
class DemoRun:
    """A real `tracehound demo` run (2 nodes x 2 gloo ranks + a spare): its store, job and the
    report it printed."""

    store: str
    job: str
    report: dict[str, Any]


def run_demo(store: str, job: str, workdir: Path, *fault: str) -> DemoRun:
    done = subprocess.run(
        # 400 steps, not 200: the demo strikes at step 60 once a poll of the store shows it, and
        # on a machine this busy a poll came too late for 200 (the job had finished untouched)
        [sys.executable, "-m", "tracehound.controller.cli", "demo", *fault, "--steps", "400",
         "--store", store, "--workdir", str(workdir), "--job-id", job, "--json"],
        capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert NOT_A_TRANSITION not in done.stderr, done.stderr
    # every fact of every incident agrees with the records the job stored
    assert_facts_agree(store, job)
    return DemoRun(store, job, json.loads(done.stdout))
