"""A rank that floods events: its drops are counted exactly, and nobody else pays for them.

One real node agent ships into a real embedded store (an `IngestServer` in the test process)
for two real 2-rank gloo jobs at once. Every rank trains at the same normal rate (one world
all_reduce per step). In the middle of the run rank 1 of the `noisy` job floods: 100 extra
1-element all_reduces per step in a process group of its own, 100x its normal rate. Every rank
has a small recorder buffer (64 records), so the flood overflows the flooder's and a stall of the
agent on anybody else's connection would overflow theirs within a fraction of a second. A second
run floods 1000x with an unbounded buffer for the flooder: nothing is refused at the source and
~100k records go through the one agent beside the others' trickle.

Counted, per rank, from the rank's own report (`ship_harness`) against the store's rows:
- the flooder: collectives produced = stored + refused, exactly; its refusals counted the same by
  the transport and by the recorder (whose heartbeats carry the count to the agent);
- every other rank, of the same job and of the other job: nothing refused, every collective
  stored once;
- their step times inside and outside the flood are printed (not asserted: the machine is shared
  and the flood costs CPU).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from ship_harness import (
    REPORTING,
    Key,
    RankReport,
    free_port,
    load_reports,
    rank_env,
    start_node_agent,
    stop,
    stored_keys,
    tally,
    tally_ranks,
)

from tracehound.tracing.store import open_store
from tracehound.tracing.store.ingest import IngestServer

pytestmark = pytest.mark.e2e

WORLD = 2
BUFFER = 64
"""Recorder buffer of every rank, in records (TRACEHOUND_BUFFER_RECORDS)."""
STEPS, STEP_MS = 300, 20
FLOOD, FLOOD_FROM, FLOOD_TO = 100, 101, 200
"""Extra collectives per step of the flooder, during steps FLOOD_FROM..FLOOD_TO."""

JOB_SCRIPT = r'''
import datetime, sys, time

import torch
import torch.distributed as dist
''' + REPORTING + r'''
steps, step_ms, flood, flooder, first, last, out = sys.argv[1:]
steps, step_ms, flood, flooder, first, last = (
    int(steps), float(step_ms), int(flood), int(flooder), int(first), int(last))
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank = dist.get_rank()
solo = dist.new_group([flooder]) if flooder >= 0 else None
model = torch.nn.Linear(64, 64, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(32, 64)
tiny = torch.zeros(1)
times, window = [], [0.0, 0.0]
for step in range(1, steps + 1):
    started, t0 = time.time(), time.perf_counter()
    model(data).square().mean().backward()
    dist.all_reduce(model.weight.grad)  # the step's one collective
    optimizer.step()
    optimizer.zero_grad()
    if rank == flooder and first <= step <= last:
        window[0] = window[0] or time.time()
        for _ in range(flood):
            dist.all_reduce(tiny, group=solo)
        window[1] = time.time()
    times.append([started, time.perf_counter() - t0])
    time.sleep(step_ms / 1000.0)
write_report(f"{out}.rank{rank}.json", steps=times, flood_window=window)
dist.destroy_process_group()
'''


def launch(tmp_path: Path, *, job: str, flooder: int, socket_path: Path,
           flooder_buffer: int = BUFFER, flood: int = FLOOD) -> list[subprocess.Popen[bytes]]:
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = rank_env(rank=rank, world=WORLD, port=port, job=job, attempt=0, node="node-0",
                       socket_path=socket_path, checkpoint_dir=tmp_path / "ckpt")
        env["TRACEHOUND_BUFFER_RECORDS"] = str(flooder_buffer if rank == flooder else BUFFER)
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(STEPS), str(STEP_MS), str(flood), str(flooder),
             str(FLOOD_FROM), str(FLOOD_TO), str(tmp_path / "reports" / job)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        ))
    return procs


def finish(procs: list[subprocess.Popen[bytes]], timeout: float = 600.0) -> None:
    """Wait for the ranks (a blocked one fails the test at `timeout`); each must exit 0."""
    try:
        for proc in procs:
            text, _ = proc.communicate(timeout=timeout)
            output = text.decode(errors="replace")
            assert proc.returncode == 0, output
            assert "tracehound recorder error" not in output, output
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def step_ms(report: RankReport, window: tuple[float, float]) -> dict[str, float]:
    """Median step time (ms) of a rank's steps that started inside and outside the flood."""
    inside = [d for t, d in report.extra["steps"] if window[0] <= t <= window[1]]
    outside = [d for t, d in report.extra["steps"] if not window[0] <= t <= window[1]]
    return {"inside": round(1000 * statistics.median(inside), 2) if inside else -1.0,
            "outside": round(1000 * statistics.median(outside), 2)}


@pytest.mark.parametrize(("flooder_buffer", "per_step"), [
    pytest.param(BUFFER, FLOOD, id="100x-overflows-its-buffer"),
    pytest.param(1_000_000, 10 * FLOOD, id="1000x-unbounded-buffer-loads-the-agent"),
])
def test_a_flooding_rank_drops_only_its_own_records_and_counts_them(
    tmp_path: Path, flooder_buffer: int, per_step: int,
) -> None:
    (tmp_path / "reports").mkdir()
    socket_path, stats_file = tmp_path / "agent.sock", tmp_path / "agent-stats.json"
    store = open_store(f"chdb://{tmp_path / 'store'}")
    try:
        with IngestServer(store) as ingest:
            agent = start_node_agent(job="node", node="node-0", socket_path=socket_path,
                                     spool=tmp_path / "spool", sink=ingest.url,
                                     stats_file=stats_file)
            try:
                procs = (launch(tmp_path, job="noisy", flooder=1, socket_path=socket_path,
                                flooder_buffer=flooder_buffer, flood=per_step)
                         + launch(tmp_path, job="quiet", flooder=-1, socket_path=socket_path))
                finish(procs)
            finally:
                assert stop(agent, timeout=120) == 0
            skipped = ingest.skipped_total
        stored = stored_keys(store, ["noisy", "quiet"])
    finally:
        store.close()
    agent_stats: dict[str, Any] = json.loads(stats_file.read_text())
    reports = load_reports(tmp_path / "reports")
    by_rank = {(r.job, r.rank): r for r in reports}
    assert sorted(by_rank) == [("noisy", 0), ("noisy", 1), ("quiet", 0), ("quiet", 1)]
    flooder = by_rank[("noisy", 1)]
    window = (flooder.extra["flood_window"][0], flooder.extra["flood_window"][1])
    tallies = tally_ranks(reports, stored)
    for (job, rank), report in sorted(by_rank.items()):
        print(f"{job} rank {rank}: produced {report.collectives} collectives "
              f"({report.offered} records), refused {report.refused_collectives} collectives "
              f"({report.refused} records), sent {report.sent}; store {tallies[(job, rank)]}; "
              f"step ms {step_ms(report, window)}")
    print(f"node agent: {agent_stats}")

    for report in reports:
        assert report.accounting_errors() == [], (report.job, report.rank,
                                                  report.accounting_errors())
        assert tallies[(report.job, report.rank)].exact, (report.job, report.rank)
    # the flooder: every collective it produced is stored once or counted as refused; with
    # the small buffer the flood overflows it, with the unbounded one the agent takes it all
    flood = per_step * (FLOOD_TO - FLOOD_FROM + 1)
    assert sorted(flooder.produced.values()) == [STEPS, flood]
    if flooder_buffer == BUFFER:
        assert flooder.refused_collectives > 0
    else:
        assert flooder.refused == 0
    assert tallies[("noisy", 1)].stored_rows == flooder.collectives - flooder.refused_collectives
    # everybody else, in its job and in the other: nothing refused, everything stored
    others = [r for r in reports if r is not flooder]
    for report in others:
        assert report.refused == 0, (report.job, report.rank)
        assert report.collectives == STEPS
        assert tallies[(report.job, report.rank)].stored_rows == STEPS
    expected: Counter[Key] = Counter()
    for report in reports:
        expected.update(report.accepted())
    assert tally(expected, stored).exact and skipped == 0
    # the agent received every line whole, and learned the drops from the heartbeats
    assert agent_stats["rejected"] == 0 and agent_stats["pending_segments"] == 0
    assert agent_stats["dropped"] == flooder.dropped
