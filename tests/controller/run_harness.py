"""Runs `tracehound run --json` on a real job and reads its incidents back with
`tracehound incidents --json`, as a script would."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from demo_harness import NOT_A_TRANSITION
from evidence_check import assert_facts_agree


def run_and_list(tmp_path: Path, job: str, run_args: list[str]
                 ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The outcome of `tracehound run ... RUN_ARGS` on a fresh chdb store under `tmp_path`,
    and the job's incidents as `tracehound incidents --json` lists them."""
    store = f"chdb://{tmp_path / 'store'}"
    proc = subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "run", "--job-id", job, "--store",
         store, "--workdir", str(tmp_path / "work"), "--timeout", "600", "--json", *run_args],
        capture_output=True, text=True, timeout=900, check=False,
    )
    assert proc.stdout, proc.stderr[-3000:]
    # every state the job went through followed from the one before
    assert NOT_A_TRANSITION not in proc.stderr, proc.stderr
    outcome: dict[str, Any] = json.loads(proc.stdout)
    listed = subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "incidents", "--job", job,
         "--store", store, "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )
    incidents: list[dict[str, Any]] = json.loads(listed.stdout)
    # every fact of every incident agrees with the records the job stored
    assert_facts_agree(store, job)
    return outcome, incidents


def brief(incidents: list[Any]) -> str:
    """One line per incident for an assertion's message: its kind, culprits, basis, actions
    and summary (the full dicts are truncated by pytest before the part that explains)."""
    return "\n".join(
        f"{i['incident_id']} {i['kind']} ranks={i['culprit_ranks']} "
        f"basis={i['verdict'].get('basis')} actions={[a['kind'] for a in i['actions']]}: "
        f"{i['verdict'].get('summary', '')}" for i in incidents)


def beside_observed_stragglers(incidents: list[Any]) -> list[Any]:
    """The incidents but stragglers that were only watched, which four ranks sharing two cores
    here may show around a fault or in a restarted attempt (CI runs: a rank at 1.15x its
    peers; rank 0 at 1.29x over the last 0.26 s of a resumed attempt). A straggler acted on
    stays in, and fails the comparison it is part of."""
    return [i for i in incidents if not (
        i["kind"] == "straggler" and [a["kind"] for a in i["actions"]] == ["observe"])]
