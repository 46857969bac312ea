"""Slow is not hung: real gloo jobs whose ranks spend seconds outside collectives, through
`tracehound run`, with the incidents read back by `tracehound incidents --json`.

The script (`scripts/busy_train.py`) is a plain torchrun DDP script with no Tracehound import.
A checkpoint write, an evaluation pass, a slow first step and a data-loading stall each finish
with no stop, isolation or restart, and a `stall` incident that names the rank and where it
was. A rank stopped inside a pipeline recv is named first though its partner, blocked in the
matching send, has the lower number. A user-code deadlock outside collectives becomes a hang
once the idle grace has passed: its process does nothing at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from run_harness import brief, run_and_list

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parent / "scripts" / "busy_train.py"


def run_job(tmp_path: Path, job: str, *script_args: str, nproc: int = 2,
            extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    return run_and_list(tmp_path, job, [
        "--nnodes", "2", "--nproc-per-node", str(nproc), "--spare-nodes", "1",
        # cold restarts where there are any: warm spares are tested in test_warm_spares.py,
        # and a job's last spares would import torch for nothing
        "--no-warm-spares", *extra,
        str(SCRIPT), "--workdir", str(tmp_path), *script_args,
    ])


def stack_words(incident: dict[str, Any]) -> str:
    return " ".join(e["detail"] for e in incident["verdict"]["evidence"]
                    if e["fact"] in ("stack", "busy"))


def test_checkpoint_evaluation_slow_first_step_and_data_loading_are_stalls(
        tmp_path: Path) -> None:
    """One job, four stalls one after the other, each of a different rank's kind of work: rank
    2's first step is 10 s of CPU work (compilation), rank 0 writes a 12 s checkpoint (at step
    60) and runs a 12 s evaluation (at step 150), rank 3 waits 12 s for its data (at step 240).
    Each is a stall naming its rank and where it was; nothing is stopped, isolated or
    restarted."""
    outcome, incidents = run_job(
        tmp_path, "stalls", "--steps", "300", "--stall", "first-step@2:0",
        "--stall", "checkpoint@0:60", "--stall", "eval@0:150", "--stall", "dataload@3:240")
    assert outcome["completed"] is True, outcome
    assert outcome["attempts"] == 1, (outcome, brief(incidents))
    # Nothing but observations: four ranks share two cores here, and a busy rank may also be
    # seen computing longer than its peers around its stall (a straggler, a soft fault watched
    # until it repeats); the job is left alone either way.
    for incident in incidents:
        assert {a["kind"] for a in incident["actions"]} == {"observe"}, brief(incidents)
    assert {i["kind"] for i in incidents} <= {"stall", "straggler"}, brief(incidents)
    stalls = [i for i in incidents if i["kind"] == "stall"]
    words = [(i["culprit_ranks"][0], stack_words(i)) for i in stalls]
    for rank, where in ((2, "busy_for"), (0, "write"), (0, "busy_train.py"),
                        (3, "busy_train.py")):
        assert any(r == rank and where in w for r, w in words), (rank, where, words)
    assert {r for r, _ in words} == {0, 2, 3}, words


def test_the_frozen_side_of_a_p2p_pair_is_named_first(tmp_path: Path) -> None:
    outcome, incidents = run_job(tmp_path, "p2p", "--scenario", "pipeline", "--steps", "60",
                                 "--at-step", "20", nproc=1)
    assert outcome["completed"] is True, outcome
    hangs = [i for i in incidents if i["kind"] == "hang"]
    assert len(hangs) == 1, brief(incidents)
    assert hangs[0]["culprit_ranks"][0] == 1
    assert hangs[0]["culprit_nodes"][0] == "node-1"
    # its script makes no optimizer step: the restart cannot be measured to a first step
    assert [a["kind"] for a in hangs[0]["actions"]] == ["stop_job", "isolate_node", "restart"]
    assert hangs[0]["actions"][1]["target"] == "node-1"


def test_a_user_code_deadlock_outside_collectives_is_a_hang_after_the_idle_grace(
    tmp_path: Path,
) -> None:
    # the stall is recorded between the hang threshold and the idle grace, once the node agent
    # has the deadlocked rank's stack (at 2 s and 8 s a CI run with both lanes busy went
    # straight to the hang); the rank waits on a lock of its own, asleep: idle, not busy, so a
    # hang at the idle grace of 15 s, long before the busy grace of 600
    outcome, incidents = run_job(tmp_path, "deadlock", "--scenario", "deadlock", "--rank", "1",
                                 extra=("--idle-grace", "15"))
    assert outcome["completed"] is True, outcome
    assert outcome["attempts"] == 2, outcome
    kinds = [i["kind"] for i in incidents]
    assert kinds == ["stall", "hang"], incidents
    stall, hang = incidents
    assert stall["culprit_ranks"] == [1] and hang["culprit_ranks"] == [1]
    assert {a["kind"] for a in stall["actions"]} == {"observe"}
    assert hang["verdict"]["basis"] == "idle_timeout"
    idle = [e for e in hang["verdict"]["evidence"] if e["fact"] == "idle"]
    assert idle and "busy_train.py" in idle[0]["detail"], hang["verdict"]["evidence"]
    # The process was alive: its machine is not evicted.
    assert [a["kind"] for a in hang["actions"]] == ["stop_job", "restart", "resumed"]
