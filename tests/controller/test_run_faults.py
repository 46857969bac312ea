"""Every fault class that can be injected into a real gloo job here, localized end to end through
`tracehound run`: hang, crash, a slowed rank (straggler) and an op mismatch, each on a real
2 nodes x 2 ranks DDP job (faults injected from inside the training script), with the verdict
read back from the store by `tracehound incidents`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from run_harness import beside_observed_stragglers, run_and_list

pytestmark = pytest.mark.e2e


def run_job(tmp_path: Path, job: str, *script_args: str,
            extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[Any]]:
    from tracehound.controller.cli.demo import training_script

    return run_and_list(tmp_path, job, [
        "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", *extra,
        training_script(),
        "--checkpoint-every", "25", "--pg-timeout-s", "300", *script_args,
    ])


def test_hang_inside_a_rank(tmp_path: Path) -> None:
    # The script's hang sleeps forever outside collectives: alive and reporting, so a stall,
    # and a hang once the busy grace (short here) has passed; its machine is not evicted.
    # DDP's buckets are counted (the default, agent/rank/hooks/ddp.py `_DdpCount`); with every
    # bucket recorded (TRACEHOUND_DDP_TRACE_EVERY=1) the same records hold the same waits
    # (tests/agent/test_coverage_paths.py).
    outcome, incidents = run_job(tmp_path, "hang", "--steps", "120", "--step-sleep-ms", "20",
                                 "--fault", "hang", "--fault-rank", "1", "--fault-step", "40",
                                 extra=("--busy-grace", "12"))
    assert outcome["completed"] is True, outcome
    incidents = beside_observed_stragglers(incidents)
    assert [(i["kind"], i["culprit_ranks"], i["culprit_nodes"]) for i in incidents] == [
        ("stall", [1], ["node-0"]), ("hang", [1], ["node-0"])]
    assert [a["kind"] for a in incidents[1]["actions"]] == ["stop_job", "restart", "resumed"]


def test_crash_of_a_rank(tmp_path: Path) -> None:
    outcome, incidents = run_job(tmp_path, "crash", "--steps", "120", "--step-sleep-ms", "20",
                                 "--fault", "crash", "--fault-rank", "2", "--fault-step", "40")
    assert outcome["completed"] is True, outcome
    assert [(i["kind"], i["culprit_ranks"], i["culprit_nodes"])
            for i in beside_observed_stragglers(incidents)] == [("crash", [2], ["node-1"])]


def test_slowed_rank_is_a_straggler_observed_then_isolated(tmp_path: Path) -> None:
    # found from the steps' `ddp_comm` of the counted group (the default): who arrives last,
    # and the compute between steps
    outcome, incidents = run_job(tmp_path, "straggler", "--steps", "800", "--step-sleep-ms",
                                 "10", "--fault", "slow", "--slow-ms", "40", "--fault-rank", "3",
                                 "--fault-step", "20")
    assert outcome["completed"] is True, outcome
    kinds = [(i["kind"], i["culprit_ranks"][0], i["culprit_nodes"][0]) for i in incidents]
    assert kinds[:2] == [("straggler", 3, "node-1"), ("straggler", 3, "node-1")], kinds
    assert [a["kind"] for a in incidents[0]["actions"]] == ["observe"]
    assert [a["kind"] for a in incidents[1]["actions"]] == ["stop_job", "isolate_node",
                                                            "restart", "resumed"]
    # after the restart without node-1, at most a weak one watched (a CI run: rank 0 at 1.15x)
    later = incidents[2:]
    assert all(i["attempt"] == 1 and [a["kind"] for a in i["actions"]] == ["observe"]
               for i in later), later


def test_op_mismatch_names_the_odd_rank_and_stops(tmp_path: Path) -> None:
    outcome, incidents = run_job(tmp_path, "mismatch", "--steps", "200", "--step-sleep-ms",
                                 "10", "--fault", "mismatch", "--fault-rank", "2",
                                 "--fault-step", "30")
    assert outcome["completed"] is False
    (incident,) = beside_observed_stragglers(incidents)
    assert incident["kind"] == "mismatch"
    assert incident["culprit_ranks"][0] == 2
    assert incident["culprit_nodes"][0] == "node-1"
    assert [a["kind"] for a in incident["actions"]] == ["stop_job", "give_up"]
