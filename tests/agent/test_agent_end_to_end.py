"""A real 2-rank gloo DDP job (agent/examples/train_ddp.py) launched with the controller's env
contract, a real node agent process, and a small in-test ingest endpoint that keeps the batches.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from agent_harness import (
    CollectingIngest,
    collectives,
    groups,
    heartbeats,
    run_job,
    start_node_agent,
    stop,
)

from tracehound.agent.rank.checkpoint import MARKER, latest_complete, step_path

WORLD = 2
STEPS = 12


def run_traced(tmp_path: Path, ingest: CollectingIngest, *, args: list[str], attempt: int = 0,
               checkpoint_dir: Path | None = None, env: dict[str, str] | None = None,
               ) -> list[tuple[int, str]]:
    socket_path = tmp_path / "agent.sock"
    agent = start_node_agent(
        job="job-e2e", node="node-0", socket_path=socket_path, spool=tmp_path / "spool",
        sink=ingest.url, stats_file=tmp_path / "stats.json",
    )
    try:
        results = run_job(
            world=WORLD, args=args, job="job-e2e", node="node-0", socket_path=socket_path,
            checkpoint_dir=checkpoint_dir or tmp_path / "ckpt", attempt=attempt, env=env,
        )
    finally:
        assert stop(agent) == 0
    for code, output in results:
        assert code == 0, output
        assert "tracehound recorder error" not in output, output
    return results


@pytest.mark.e2e
@pytest.mark.parametrize("every", ["0", "1"])
def test_ddp_job_is_traced_end_to_end(tmp_path: Path, every: str) -> None:
    """With TRACEHOUND_DDP_TRACE_EVERY 0 (the default) DDP's gradient all-reduces are counted in
    the group `0:ddp`; with 1 each bucket is recorded in the group `0`. The script's own loss
    all-reduce (one float) is recorded in `0` either way."""
    with CollectingIngest() as ingest:
        run_traced(tmp_path, ingest, args=["--steps", str(STEPS), "--checkpoint-every", "6"],
                   env={"TRACEHOUND_DDP_TRACE_EVERY": every})
        received = ingest.received

    everything = collectives(received)
    counted = [e for e in everything if e.group == "0:ddp"]
    events = [e for e in everything if e.group != "0:ddp"]
    by_rank: dict[int, list[int]] = defaultdict(list)
    ops: dict[tuple[int, int], str] = {}
    for e in events:
        assert e.group == "0" and e.job == "job-e2e" and e.node == "node-0"
        by_rank[e.rank].append(e.seq)
        ops[(e.rank, e.seq)] = e.op
        assert e.complete_us >= e.enqueue_us > 0
    assert sorted(by_rank) == list(range(WORLD))
    count = len(by_rank[0])
    for rank in range(WORLD):
        assert sorted(by_rank[rank]) == list(range(1, count + 1)), f"rank {rank}"
    # Same program, same sequence: the op at every seq is the same on every rank.
    for seq in range(1, count + 1):
        assert len({ops[(r, seq)] for r in range(WORLD)}) == 1
    # with 1, DDP's gradient all-reduce goes through the recorder's process group: >= 1 per
    # step; with 0 only the script's own loss all-reduce (at its log steps) is in `0`
    reduces = [e for e in events if e.rank == 0 and e.op == "all_reduce"]
    if every == "1":
        assert len(reduces) >= STEPS
        assert counted == []
    else:
        assert 1 <= len(reduces) < STEPS and all(e.nbytes == 4 for e in reduces), reduces
        assert {e.op for e in counted} == {"ddp_comm"}
        assert {e.rank for e in counted} == set(range(WORLD))
        assert all(e.complete_us >= e.enqueue_us > 0 for e in counted)

    infos = [g for g in groups(received) if g.group == "0"]
    assert sorted(g.rank for g in infos) == list(range(WORLD))
    assert all(g.ranks == tuple(range(WORLD)) and g.backend == "gloo" for g in infos)

    beats = heartbeats(received)
    last_counted: set[int] = set()
    for rank in range(WORLD):
        mine = sorted((b for b in beats if b.rank == rank), key=lambda b: b.time_us)
        steps = [b.step for b in mine]
        assert steps == sorted(steps) and steps[-1] == STEPS and len(set(steps)) >= 2
        final = mine[-1]
        assert final.dropped == 0 and final.start_step == 0 and final.first_step_us > 0
        (progress,) = [g for g in final.groups if g.group == "0"]
        assert progress.last_completed == progress.last_enqueued == count
        assert progress.pending_op == ""
        if every == "0":  # every step counted, on every rank alike
            (ddp,) = [g for g in final.groups if g.group == "0:ddp"]
            assert ddp.last_completed == ddp.last_enqueued >= max(e.seq for e in counted)
            assert ddp.last_enqueued >= STEPS and ddp.pending_op == ""
            last_counted.add(ddp.last_enqueued)
    assert len(last_counted) <= 1

    stats = (tmp_path / "stats.json").read_text()
    assert '"pending_segments": 0' in stats


def test_latest_complete_skips_incomplete_checkpoints(tmp_path: Path) -> None:
    assert latest_complete(tmp_path / "missing") is None
    for step, complete in [(5, True), (10, True), (15, False)]:
        path = step_path(tmp_path, step)
        path.mkdir(parents=True)
        if complete:
            (path / MARKER).write_text(f"{step}\n")
    (tmp_path / "step-junk").mkdir()
    assert latest_complete(tmp_path) == (10, step_path(tmp_path, 10))


@pytest.mark.e2e
def test_checkpoints_resume_and_report_start_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    with CollectingIngest() as ingest:
        run_traced(tmp_path / "a", ingest, args=["--steps", "10", "--checkpoint-every", "5"],
                   checkpoint_dir=ckpt)
        assert latest_complete(ckpt) == (10, step_path(ckpt, 10))
        # A checkpoint a crash left without its marker is never loaded.
        step_path(ckpt, 15).mkdir()
        results = run_traced(tmp_path / "b", ingest, attempt=1, checkpoint_dir=ckpt,
                             args=["--steps", "14", "--checkpoint-every", "5"])
        beats = [b for b in heartbeats(ingest.received) if b.attempt == 1]
    for rank, (_, output) in enumerate(results):
        assert f"rank {rank}/{WORLD}: resumed from step 10" in output
    for rank in range(WORLD):
        final = max((b for b in beats if b.rank == rank), key=lambda b: b.time_us)
        assert (final.start_step, final.step) == (10, 14)
        assert final.first_step_us > 0
    assert latest_complete(ckpt) == (10, step_path(ckpt, 10))
