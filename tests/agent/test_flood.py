"""A flood of tiny collectives while the node agent is missing or dies: training goes on, the
rank's memory stays bounded and every record the recorder produced is accounted for.

Real 2-rank gloo jobs with the auto-installed recorder (launched with the controller's env
contract, `agent_harness.rank_env`) run tens of thousands of 1-element all_reduces with a small
TRACEHOUND_BUFFER_RECORDS. The job script puts a counting pass-through in front of the
recorder's transport (`Recorder.sink`), so what the recorder produced is known independently of
the transport's own counters, and prints both at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from agent_harness import CollectingIngest, collectives, free_port, rank_env, start_node_agent, stop

from tracehound.tracing.events import CollectiveEvent

WORLD = 2
BUFFER = 1000

JOB = r'''
import datetime, json, os, resource, sys, threading, time

import torch
import torch.distributed as dist

from tracehound.agent.rank import autoinstall

calls, out, gate = int(sys.argv[1]), sys.argv[2], sys.argv[3]


class Counting:
    """Passes every record on to the transport and counts what the recorder produced."""

    def __init__(self, inner):
        self.inner = inner
        self.lock = threading.Lock()
        self.offered = self.refused = self.collectives = 0

    def offer(self, item):
        accepted = self.inner.offer(item)
        with self.lock:
            self.offered += 1
            self.refused += not accepted
            self.collectives += isinstance(item, tuple)
        return accepted

    def flush(self, timeout):
        return self.inner.flush(timeout)


recorder = autoinstall.recorder()
assert recorder is not None, "the recorder was not installed"
transport = recorder.sink
counting = recorder.sink = Counting(transport)

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
tensor = torch.zeros(1)
half = calls // 2
# with an agent listening (the gated run), the first half keeps the queue under half full, so
# nothing is dropped before the agent dies however slow the machine is; that makes the agent's
# share a gap-free prefix the test can check exactly
paced_until = time.monotonic() + 120 if gate != "-" else 0.0
for i in range(half):
    dist.all_reduce(tensor)
    if i % 100 == 0:
        while transport.pending > BUFFER // 2 and time.monotonic() < paced_until:
            time.sleep(0.001)
dropped_in_first_half = recorder.dropped
if gate != "-":
    open(f"{gate}.rank{rank}", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.01)
for _ in range(calls - half - 1):
    dist.all_reduce(tensor)
check = torch.full((1,), float(rank))
dist.all_reduce(check)  # the last of `calls`: the job still computes right
assert check.item() == sum(range(WORLD)) and tensor.item() == 0


def snapshot():
    return {
        "produced": counting.offered, "refused": counting.refused,
        "collectives": counting.collectives, "sent": transport.sent,
        "pending": transport.pending, "lost": transport.lost,
        "transport_dropped": transport.dropped, "dropped": recorder.dropped,
        "errors": recorder.errors, "dropped_in_first_half": dropped_in_first_half,
    }


# a heartbeat may be offered while we read: read until two readings agree
a, b = snapshot(), snapshot()
while a != b:
    time.sleep(0.05)
    a, b = b, snapshot()
a["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
a["queue"] = len(transport)
with open(f"{out}.rank{rank}", "w") as handle:
    json.dump(a, handle)
dist.destroy_process_group()
'''.replace("WORLD", str(WORLD)).replace("BUFFER", str(BUFFER))


def launch(tmp_path: Path, *, calls: int, socket_path: Path, name: str,
           gate: Path | None = None) -> tuple[list[subprocess.Popen[bytes]], Path]:
    script = tmp_path / "flood_job.py"
    script.write_text(JOB)
    out = tmp_path / f"{name}.json"
    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = rank_env(rank=rank, world=WORLD, port=port, job="flood", attempt=0, node="node-0",
                       socket_path=socket_path, checkpoint_dir=tmp_path / "ckpt")
        env["TRACEHOUND_BUFFER_RECORDS"] = str(BUFFER)
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(calls), str(out), str(gate or "-")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        ))
    return procs, out


def finish(procs: list[subprocess.Popen[bytes]], out: Path,
           timeout: float = 300.0) -> list[dict[str, Any]]:
    """Wait for the ranks (the job must finish: a blocked one fails the test at `timeout`);
    each rank's figures."""
    results = []
    try:
        for rank, proc in enumerate(procs):
            text, _ = proc.communicate(timeout=timeout)
            output = text.decode(errors="replace")
            assert proc.returncode == 0, output
            assert "tracehound recorder error" not in output, output
            results.append(json.loads(Path(f"{out}.rank{rank}").read_text()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def check_accounting(figures: dict[str, Any], calls: int) -> None:
    """Every record produced is sent, still pending, or dropped, and counted as such once."""
    assert figures["collectives"] == calls  # one record per collective, none missed
    assert figures["errors"] == 0 and figures["lost"] == 0
    assert figures["dropped"] == figures["refused"] == figures["transport_dropped"]
    assert figures["dropped"] == figures["produced"] - figures["sent"] - figures["pending"]


@pytest.mark.e2e
def test_flood_without_an_agent_finishes_with_bounded_memory_and_exact_drops(
    tmp_path: Path,
) -> None:
    small, large = 10_000, 50_000
    # the two jobs side by side, each in its own directory
    (tmp_path / "few").mkdir()
    (tmp_path / "many").mkdir()
    few_job = launch(tmp_path / "few", calls=small, socket_path=tmp_path / "nobody.sock",
                     name="few")
    many_job = launch(tmp_path / "many", calls=large, socket_path=tmp_path / "nobody.sock",
                      name="many")
    try:
        few = finish(*few_job)
    finally:  # the other job is waited for (and killed at its timeout) either way
        many = finish(*many_job)
    for figures, calls in [(f, small) for f in few] + [(f, large) for f in many]:
        check_accounting(figures, calls)
        # nothing ever reached an agent: the buffer holds the first BUFFER records, the rest
        # (all but those) were dropped
        assert figures["sent"] == 0
        assert figures["pending"] == figures["queue"] == BUFFER
        assert figures["dropped"] == figures["produced"] - BUFFER > calls - BUFFER
    print("flood without agent:", few, many)
    for rank in range(WORLD):
        # 40k more records than the small run: unbounded, they would take ~8.5 MB more
        growth_kb = many[rank]["peak_rss_kb"] - few[rank]["peak_rss_kb"]
        assert growth_kb < 4 * 1024, f"rank {rank}: peak RSS grew by {growth_kb} kB"


@pytest.mark.e2e
def test_flood_survives_the_agent_being_killed_mid_run(tmp_path: Path) -> None:
    calls = 30_000
    socket_path = tmp_path / "agent.sock"
    spool, stats = tmp_path / "spool", tmp_path / "stats.json"
    gate = tmp_path / "gate"
    with CollectingIngest() as ingest:
        agent = start_node_agent(job="flood", node="node-0", socket_path=socket_path,
                                 spool=spool, sink=ingest.url, stats_file=stats)
        procs, out = launch(tmp_path, calls=calls, socket_path=socket_path, name="killed",
                            gate=gate)
        try:
            deadline = time.monotonic() + 180
            markers = [Path(f"{gate}.rank{r}") for r in range(WORLD)]
            while not all(m.exists() for m in markers):  # both ranks did the first half
                assert all(p.poll() is None for p in procs), "a rank exited early"
                assert time.monotonic() < deadline, "the first half did not finish"
                time.sleep(0.05)
            while not (stats.exists() and json.loads(stats.read_text())["received"] > 0):
                assert time.monotonic() < deadline, "the agent received nothing"
                time.sleep(0.05)
            agent.send_signal(signal.SIGKILL)
            agent.wait(timeout=30)
            gate.touch()  # the second half floods a transport whose agent is gone
            results = finish(procs, out)
        finally:
            if agent.poll() is None:
                agent.kill()
        # a new agent on the same spool ships what the killed one had accepted
        os.unlink(socket_path)
        again = start_node_agent(job="flood", node="node-0", socket_path=socket_path,
                                 spool=spool, sink=ingest.url, stats_file=stats)
        deadline = time.monotonic() + 60
        while not socket_path.exists():  # it listens: set up, its spool open
            assert again.poll() is None, f"the new agent exited with {again.returncode}"
            assert time.monotonic() < deadline, "the new agent did not start"
            time.sleep(0.05)
        time.sleep(1.0)
        assert stop(again) == 0
        received = collectives(ingest.received)

    by_rank: dict[int, list[CollectiveEvent]] = defaultdict(list)
    for event in received:
        by_rank[event.rank].append(event)
    print("flood, agent killed:", results, {r: len(v) for r, v in by_rank.items()})
    for rank, figures in enumerate(results):
        check_accounting(figures, calls)
        assert figures["dropped"] > 0 and figures["sent"] > 0
        assert figures["dropped_in_first_half"] == 0  # the paced half dropped nothing
        # the queue is full again; at most one encoded chunk waits beside it
        assert BUFFER <= figures["pending"] <= BUFFER + 512
        seqs = sorted(e.seq for e in by_rank[rank])
        # the agent got a gap-free prefix of the rank's collectives, each once, and no more
        # than the transport says it sent (what the kernel held for the dead agent is lost)
        assert seqs == list(range(1, len(seqs) + 1)), f"rank {rank}"
        assert 0 < len(seqs) <= figures["sent"]
