"""Sharded jobs under `tracehound run`, a rank stopped with SIGSTOP where the recorder's plain
torch.distributed wrappers do not reach: real FSDP2 and tensor-parallel gloo jobs
(`tracehound.agent.examples.train_sharded`), the verdicts read back with `tracehound incidents`
and the records from the store.

The stopped rank stops itself (`os.kill(getpid(), SIGSTOP)`) at an exact point of its program,
which an outside `kill -STOP` can only hit by chance: inside an FSDP all-gather, inside
`clip_grad_norm_` before its functional all_reduce, in the optimizer step, and before a
collective no recorder hook sees (a process group's own method). One job carries several stops,
one per attempt: each attempt must name the stopped rank, isolate its node and resume from the
checkpoint. How long each took after the stop is printed (bench/sharded_stops.py measures it).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from run_harness import beside_observed_stragglers, run_and_list

from tracehound.tracing.store.factory import open_store

pytestmark = pytest.mark.e2e


def script() -> str:
    spec = importlib.util.find_spec("tracehound.agent.examples.train_sharded")
    assert spec is not None and spec.origin is not None
    return spec.origin


def stops(log: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in log.glob("stop-*.json")}


def resumed_steps(store_url: str, job: str) -> dict[int, tuple[int, int]]:
    """Attempt -> (the step it resumed from, the furthest step a rank of it reached)."""
    store = open_store(store_url, create=False)
    try:
        out = {}
        for attempt in store.attempts(job):
            beats = store.latest_heartbeats(job, attempt)
            out[attempt] = (min(hb.start_step for hb in beats), max(hb.step for hb in beats))
        return out
    finally:
        store.close()


def check_each_stop(incidents: list[Any], stopped: dict[int, dict[str, Any]], rank: int,
                    basis: dict[int, str], resumed: dict[int, tuple[int, int]]) -> None:
    """One hang per stopped attempt, naming the stopped rank, found after the stop, acted on
    by isolating its node and restarting; the next attempt resumed from a checkpoint and
    trained on. Nothing else but watched stragglers."""
    hangs = beside_observed_stragglers(incidents)
    assert [(i["attempt"], i["kind"], i["culprit_ranks"]) for i in hangs] == [
        (a, "hang", [rank]) for a in sorted(stopped)], hangs
    for incident in hangs:
        attempt = incident["attempt"]
        after = incident["detected_at"] - stopped[attempt]["time"]
        print(f"attempt {attempt}: stopped at {stopped[attempt]['point']}, named rank "
              f"{incident['culprit_ranks'][0]} {after:.1f} s later "
              f"({incident['verdict']['basis']})")
        assert after > 0
        assert incident["verdict"]["basis"] == basis[attempt], incident["verdict"]["summary"]
        assert [a["kind"] for a in incident["actions"]][:3] == [
            "stop_job", "isolate_node", "restart"], incident["actions"]
        start, reached = resumed[attempt + 1]
        assert 0 < start < reached, (attempt, resumed)


def test_fsdp2_rank_stopped_in_all_gather_clip_optimizer_and_an_untraced_group(
        tmp_path: Path) -> None:
    """2 nodes x 2 ranks, every linear layer fully_shard'ed, gradient clipping every step
    (DTensor's functional all_reduce), a checkpoint every 10 steps, and an all_reduce every
    step through a process group's own method (no wrapper sees it); rank 1 stops inside an
    all-gather (attempt 0), inside clip_grad_norm_ before its all_reduce (1), in the optimizer
    step (2) and before the untraced all_reduce (3). The functional all_reduce of the clipping
    is in the trace: the peers are seen waiting in it; the untraced one is seen through the
    group's backend progress (its Flight Recorder's counts, agent/backend.py)."""
    log = tmp_path / "stops"
    outcome, incidents = run_and_list(tmp_path, "fsdp-stops", [
        # cold restarts: the TP job below hands its ranks to warm spares
        "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "4", "--max-restarts", "4",
        "--no-warm-spares",
        script(), "--layout", "fsdp", "--steps", "55", "--checkpoint-every", "10",
        "--untraced-group", "--stop", "all_gather@0", "--stop", "clip@1", "--stop", "optim@2",
        "--stop", "untraced@3", "--stop-rank", "1", "--stop-log", str(log),
    ])
    assert outcome["completed"] is True, outcome
    stopped = stops(log)
    assert sorted((a, s["point"]) for a, s in stopped.items()) == [
        (0, "all_gather"), (1, "clip"), (2, "optim"), (3, "untraced")]
    check_each_stop(incidents, stopped, 1, {a: "control_dependency" for a in stopped},
                    resumed_steps(f"chdb://{tmp_path / 'store'}", "fsdp-stops"))
    hangs = beside_observed_stragglers(incidents)
    waits = [e for e in hangs[1]["verdict"]["evidence"] if e["fact"] == "waiting"]
    assert waits and all("all_reduce" in e["detail"] for e in waits), waits
    backend = [e for e in hangs[3]["verdict"]["evidence"] if e["fact"] == "waiting"]
    assert backend and all(e["group"].endswith(":c10d") for e in backend), backend
    # (run_and_list held every fact to the stored records.) The dashboard's progress view of
    # the hang in the all-gather: the culprit's row, its own state at the collective it hangs
    # in, and "furthest behind" led by it
    from tracehound.ui import data

    store = open_store(f"chdb://{tmp_path / 'store'}", create=False)
    try:
        (first,) = [i for i in store.incidents("fsdp-stops") if i.attempt == 0
                    and i.kind == "hang"]
        states = data.culprit_states(first)
        own = states[1]
        grid = store.progress_grid("fsdp-stops", 0, own.group, last_seqs=64)
    finally:
        store.close()
    frame = data.progress_frame(grid, first.culprit_ranks, states)
    at_hang = frame[frame["seq"] == own.seq].set_index("ranks")
    assert at_hang.loc["1 culprit", "status"] == own.status, (own, at_hang)
    assert own.status in ("culprit: not entered", "culprit: frozen"), own
    assert "its process is stopped" in own.words, own
    behind = data.behind_frame(grid, culprits=first.culprit_ranks, states=states)
    assert behind["ranks"].iloc[0] == "1" and behind["evidence"].iloc[0].startswith(
        "culprit rank 1: "), behind
    print(f"attempt 0 at #{own.seq} of group {own.group}: {own.words}")


def test_tensor_parallel_functional_collectives_and_the_standstill_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 nodes x 1 rank, a tensor-parallel MLP (ColwiseParallel, RowwiseParallel), which
    communicates through functional collectives only, plus an all_reduce every step through a
    process group's own method, with the Flight Recorder off (TORCH_FR_BUFFER_SIZE=0): no
    recorder hook sees that group at all. Rank 1 stops before its forward (attempt 0: its peer
    waits in the forward's functional all_reduce) and before the untraced all_reduce (attempt
    1: nothing traced is pending; the job's standstill alone names it). In attempt 1 rank 1's
    recorder is also muted, so nothing of it reaches its node agent (a CI run once met a rank
    like that, handed to a warm spare on a spare node), and its peer's stack shows only the
    user's `Work.wait()` line: its node agent, told the ranks' pids by the launcher, still
    samples its stopped process, which names it. The store holds the functional collectives
    with their group, sequence and op."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    log = tmp_path / "stops"
    outcome, incidents = run_and_list(tmp_path, "tp-stops", [
        "--nnodes", "2", "--nproc-per-node", "1", "--spare-nodes", "2",
        script(),
        "--layout", "tp", "--steps", "40", "--checkpoint-every", "10", "--untraced-group",
        "--stop", "forward@0", "--stop", "untraced@1", "--stop-rank", "1", "--mute", "1",
        "--stop-log", str(log),
    ])
    assert outcome["completed"] is True, outcome
    stopped = stops(log)
    check_each_stop(incidents, stopped, 1, {0: "control_dependency", 1: "standstill"},
                    resumed_steps(f"chdb://{tmp_path / 'store'}", "tp-stops"))
    standstill = beside_observed_stragglers(incidents)[1]["verdict"]
    assert "no traced collective is pending" in standstill["summary"]
    store = open_store(f"chdb://{tmp_path / 'store'}", create=False)
    try:
        events = store.collectives("tp-stops", 2)
        groups = {(g.group, tuple(g.ranks)) for g in store.groups("tp-stops", 2)}
    finally:
        store.close()
    ops = {e.op for e in events}
    # forward: the row-parallel layer's output all_reduce; backward: the column-parallel
    # layer's input-gradient all_reduce; clip_grad_norm_: the norm's all_reduce
    assert "all_reduce" in ops, ops
    by_rank: dict[int, list[tuple[str, int, str]]] = {}
    for e in events:
        by_rank.setdefault(int(e.rank), []).append((str(e.group), int(e.seq), str(e.op)))
    assert sorted(by_rank) == [0, 1]
    assert sorted(by_rank[0]) == sorted(by_rank[1])
    tp_groups = {g for g, _, _ in by_rank[0]}
    assert all((g, (0, 1)) in groups for g in tp_groups), (tp_groups, groups)
    seqs = sorted(s for g, s, _ in by_rank[0] if g == min(tp_groups))
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
