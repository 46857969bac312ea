"""The ingest endpoint and the controller restarted while node agents ship: nothing lost, nothing
stored twice, by counts.

With the embedded store the controller process owns the store and runs the ingest endpoint;
node agents post their spooled batches to it. Two ways it goes away and comes back:

- `tracehound run` SIGKILLed mid-job on a real 2 nodes x 2 ranks gloo job and started again on
  the same job, workdir and store: its ingest endpoint dies with it, the node agents keep
  receiving and spooling (their sealed segments pile up), the new controller adopts the ranks,
  restarts the node agents on the same sockets and spools with its new endpoint, and they ship
  it all;
- in-process (fast): an `IngestServer` stopped and started again on the same store and port
  several times while a real `NodeAgent` ships the records of recorders writing through real
  transports, once with an answer that comes too late (the batch was stored, the agent retries
  it as a possible duplicate).

Each rank's recorder counts what it produced and what its transport refused (`ship_harness`);
the store's rows, duplicates included, are counted against that per key (job, attempt, rank,
group, seq).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from ship_harness import (
    REPORTING,
    Key,
    load_reports,
    refused_segments,
    spool_segments,
    start_node_agent,
    stop,
    stored_keys,
    tally,
)

from tracehound.agent.node.daemon import NodeAgent
from tracehound.agent.node.spool import HttpSink, Spool
from tracehound.agent.rank.recorder import Recorder
from tracehound.agent.rank.transport import SocketTransport
from tracehound.tracing.events import Batch
from tracehound.tracing.store import InsertReport, TraceStore, open_store
from tracehound.tracing.store.ingest import IngestServer

pytestmark = pytest.mark.e2e

JOB_SCRIPT = r'''
import datetime, sys, time

import torch
import torch.distributed as dist
''' + REPORTING + r'''
steps, step_ms, reports = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
pair = pairs[rank // 2]
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, steps + 1):
    model(torch.ones(1, 8)).sum().backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
    optimizer.step()
    optimizer.zero_grad()
    dist.all_reduce(torch.ones(1), group=pair)
    if step % 10 == 0:
        print(f"step {step}", flush=True)
    time.sleep(step_ms / 1000.0)
write_report(f"{reports}/rank-{rank}.json")
dist.destroy_process_group()
'''


class Controller:
    """One `tracehound run --json` process on a chdb store; its log lines are collected."""

    def __init__(self, tmp_path: Path, job: str, script: Path, script_args: list[str]) -> None:
        self.store = f"chdb://{tmp_path / 'store'}"
        self.work = tmp_path / "work" / job
        cmd = [sys.executable, "-m", "tracehound.controller.cli", "run", "--job-id", job,
               "--store", self.store, "--workdir", str(tmp_path / "work"), "--timeout", "600",
               "--json", "--nnodes", "2", "--nproc-per-node", "2",
               "--no-warm-spares",  # one attempt: no spares to start
               str(script), *script_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    def log(self) -> str:
        return "".join(self.lines)[-6000:]

    def wait_for_step(self, step: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        log = self.work / "logs" / "attempt-0" / "rank-0.log"
        while f"step {step}\n" not in (log.read_text() if log.exists() else ""):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.1)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=30)

    def outcome(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        self.proc.wait(timeout=600)
        self._reader.join(timeout=30)
        assert out, self.log()
        result: dict[str, Any] = json.loads(out)
        return result


def rank_pids(work: Path) -> list[int]:
    noted = json.loads((work / "attempts" / "attempt-0.json").read_text())
    return [int(r["pid"]) for r in noted["ranks"]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"


def test_controller_killed_and_started_again_loses_and_doubles_nothing(tmp_path: Path) -> None:
    job, steps = "ingest-restart", 500
    script = tmp_path / "job.py"
    script.write_text(JOB_SCRIPT)
    reports = tmp_path / "reports"
    reports.mkdir()
    args = [str(steps), "30", str(reports)]
    first = Controller(tmp_path, job, script, args)
    pids: list[int] = []
    try:
        first.wait_for_step(60)
        pids = rank_pids(first.work)
        first.kill()
        check_restart(tmp_path, job, script, args, pids, first, steps, reports)
    finally:  # a failed run leaves no ranks behind (they run in sessions of their own)
        if first.proc.poll() is None:
            first.proc.kill()
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def check_restart(tmp_path: Path, job: str, script: Path, args: list[str], pids: list[int],
                  first: Controller, steps: int, reports: Path) -> None:
    assert all(alive(p) for p in pids), "the ranks outlive their controller"
    # the endpoint is gone: the node agents keep receiving and spooling what they cannot ship
    spool = first.work / "spool"
    deadline = time.monotonic() + 60
    while spool_segments(spool) < 4:
        assert time.monotonic() < deadline, "the node agents spooled nothing while alone"
        time.sleep(0.1)
    time.sleep(2.0)
    piled_up = spool_segments(spool)

    second = Controller(tmp_path, job, script, args)
    outcome = second.outcome()
    assert "adopted 4 running ranks" in second.log(), second.log()
    assert outcome["completed"] is True and outcome["incidents"] == [], outcome
    assert spool_segments(spool) == 0 and refused_segments(spool) == 0, "all shipped"

    ranks = load_reports(reports)
    assert [r.rank for r in ranks] == [0, 1, 2, 3]
    for report in ranks:
        assert report.accounting_errors() == [], (report.rank, report.accounting_errors())
        assert report.refused == 0, "no rank's buffer filled while its agent was restarted"
        # world: one all_reduce per parameter (weight, bias); its pair: one; every step
        assert sorted(report.produced.values()) == [steps, 2 * steps]
    expected: Counter[Key] = Counter()
    for report in ranks:
        expected.update(report.accepted())
    with open_store(second.store) as store:
        stored = stored_keys(store, [job])
    counts = tally(expected, stored)
    print(f"controller restart: {piled_up} segments piled up while the endpoint was gone; "
          f"{counts}")
    assert counts.expected == 4 * 3 * steps
    assert counts.lost == 0 and counts.duplicated == 0 and counts.unexpected == 0, counts
    assert counts.stored_rows == counts.expected


# -- in-process: an IngestServer stopped and started under a shipping node agent ---------------


class LateAnswers:
    """The real store behind an endpoint whose answers can be made late: while `late` is set,
    an insert is stored and then held longer than the agent waits for the answer (the agent
    must take it as failed, retry it as a possible duplicate, and the store keep it once).
    Every other call goes to the store as it is."""

    def __init__(self, store: TraceStore, hold_s: float) -> None:
        self.store = store
        self.hold_s = hold_s
        self.late = threading.Event()
        self.held = 0

    def insert(self, batch: Batch, *, maybe_duplicate: bool = False) -> InsertReport:
        report = self.store.insert(batch, maybe_duplicate=maybe_duplicate)
        if self.late.is_set() and report.inserted:
            self.late.clear()
            self.held += report.inserted
            time.sleep(self.hold_s)
        return report

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


class Rank:
    """A recorder writing through a real transport, as a training process does: `rate`
    collectives a second in each of two groups, from its own thread."""

    def __init__(self, *, job: str, rank: int, socket_path: Path, rate: float,
                 burst: int = 1) -> None:
        self.transport = SocketTransport(str(socket_path), bound=1_000_000)
        self.recorder = Recorder(job=job, attempt=0, node="node-0", rank=rank,
                                 sink=self.transport, heartbeat_s=0.2)
        self.rate = rate
        self.burst = burst
        self.done: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self.transport.start()
        self.recorder.start()
        self.thread.start()

    def _run(self) -> None:
        period = self.burst / self.rate
        while not self.stop.is_set():
            for _ in range(self.burst):
                for group in ("0", "1"):
                    token = self.recorder.begin(group, "all_reduce", 4, "float32")
                    self.recorder.end(token, True)
                    self.done[group] += 1
            time.sleep(period)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=30)
        self.recorder.close(timeout=60.0)
        self.transport.close()

    def accepted(self) -> Counter[Key]:
        return Counter((self.recorder.job, 0, self.recorder.rank, group, seq)
                       for group, n in self.done.items() for seq in range(1, n + 1))


def test_ingest_endpoint_restarted_under_a_shipping_agent_loses_and_doubles_nothing(
    tmp_path: Path,
) -> None:
    from clickhouse_harness import free_port

    job, port = "ingest-bounce", free_port()
    store = open_store(f"chdb://{tmp_path / 'store'}")
    late = LateAnswers(store, hold_s=1.5)
    spool = Spool(tmp_path / "spool", node="node-0", seal_interval_s=0.1)
    sink = HttpSink(f"http://127.0.0.1:{port}", timeout=1.0)
    socket_path = tmp_path / "agent.sock"
    agent = NodeAgent(job=job, node="node-0", socket_path=str(socket_path), spool=spool,
                      sink=sink)
    agent.shipper.max_backoff_s = 0.5
    ranks = [Rank(job=job, rank=r, socket_path=socket_path, rate=200.0) for r in range(3)]
    endpoints: list[IngestServer] = []
    piled: list[int] = []
    try:
        agent.start()
        for rank in ranks:
            rank.start()

        def serve() -> IngestServer:
            server = IngestServer(late, port=port).start()  # type: ignore[arg-type]
            endpoints.append(server)
            return server

        server = serve()
        for bounce in range(3):
            time.sleep(1.0)
            if bounce == 1:
                late.late.set()  # the next batch is stored, its answer comes too late
                deadline = time.monotonic() + 30
                while late.late.is_set():
                    assert time.monotonic() < deadline, "no batch was shipped"
                    time.sleep(0.05)
            server.stop()
            spooled = spool.stats.spooled
            time.sleep(1.0)  # the endpoint is gone: the agent keeps spooling
            piled.append(spool.stats.spooled - spooled)
            server = serve()
        time.sleep(1.0)
        for rank in ranks:
            rank.finish()
        assert agent.stop(drain_s=60.0), "the agent shipped everything"
        for endpoint in endpoints:
            endpoint.stop()
        stats = agent.stats()
        expected: Counter[Key] = Counter()
        for rank in ranks:
            assert rank.recorder.dropped == 0 and rank.transport.pending == 0
            expected.update(rank.accepted())
        stored = stored_keys(store, [job])
    finally:
        for rank in ranks:
            rank.stop.set()
        for endpoint in endpoints:
            endpoint.stop()
        store.close()
    counts = tally(expected, stored)
    skipped = sum(e.skipped_total for e in endpoints)
    print(f"ingest endpoint bounced 3 times: records spooled while it was gone {piled}, retries "
          f"{stats['retries']}, late answer held {late.held} records, skipped as duplicates "
          f"{skipped}; {counts}")
    assert all(n > 200 for n in piled), "the agent spooled while the endpoint was gone"
    assert stats["retries"] >= 3 and stats["rejected"] == 0 and stats["refused_batches"] == 0
    # the batch whose answer came late was sent again and recognised: none of it stored twice
    assert late.held > 0 and skipped >= late.held
    assert counts.expected > 3 * 2 * 200
    assert counts.lost == 0 and counts.duplicated == 0 and counts.unexpected == 0, counts
    assert counts.stored_rows == counts.expected


def test_node_agents_replaced_under_writing_ranks_lose_nothing(tmp_path: Path) -> None:
    """What an adopting controller does to the node agents of the controller it replaces: the
    old agent (shipping to an endpoint that is gone) is told to stop, does not finish within the
    grace (it cannot ship), and is killed; a new one takes its socket and spool. Ranks write all
    along, fast; whatever the old agent had read is in the spool, whatever it had not must reach
    the new one."""
    from clickhouse_harness import free_port

    job = "agent-handover"
    socket_path, spool = tmp_path / "agent.sock", tmp_path / "spool"
    gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there: the dead controller's
    store = open_store(f"chdb://{tmp_path / 'store'}")
    ranks = [Rank(job=job, rank=r, socket_path=socket_path, rate=4000.0, burst=20)
             for r in range(2)]
    agents: list[subprocess.Popen[bytes]] = []
    handovers = 3
    try:
        with IngestServer(store) as ingest:
            agents.append(start_node_agent(job=job, node="node-0", socket_path=socket_path,
                                           spool=spool, sink=gone,
                                           stats_file=tmp_path / "stats-0.json"))
            for rank in ranks:
                rank.start()
            for n in range(handovers):
                # every rank is connected to this agent and wrote 5000 records to it
                deadline = time.monotonic() + 60
                sent = [r.transport.sent for r in ranks]
                while not all(r.transport.connects == n + 1 and r.transport.sent > s + 5000
                              for r, s in zip(ranks, sent, strict=True)):
                    assert time.monotonic() < deadline, "the ranks never reached the agent"
                    time.sleep(0.05)
                old = agents[-1]
                old.send_signal(signal.SIGTERM)  # it tries to ship to `gone` ...
                time.sleep(1.0)
                old.kill()  # ... and is killed at the end of its grace
                old.wait(timeout=30)
                last = n == handovers - 1
                # the last agent ships its predecessors' spool as well as what it reads; on a
                # loaded machine that outlasts the default 10 s of shipping at a stop, which
                # would leave the rest in the spool for a next agent, so it may ship until done
                agents.append(start_node_agent(job=job, node="node-0", socket_path=socket_path,
                                               spool=spool, sink=ingest.url if last else gone,
                                               stats_file=tmp_path / f"stats-{n + 1}.json",
                                               drain_s=300.0 if last else 10.0))
            time.sleep(1.0)
            for rank in ranks:
                rank.finish()
            assert stop(agents[-1], timeout=330) == 0
            skipped = ingest.skipped_total
        stored = stored_keys(store, [job])
    finally:
        for rank in ranks:
            rank.stop.set()
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        store.close()
    expected: Counter[Key] = Counter()
    for rank in ranks:
        assert rank.recorder.dropped == 0 and rank.transport.pending == 0
        expected.update(rank.accepted())
    counts = tally(expected, stored)
    reconnects = [r.transport.connects for r in ranks]
    print(f"node agent replaced {handovers} times under 2 ranks writing: connections "
          f"{reconnects}, skipped as duplicates {skipped}; {counts}")
    assert reconnects == [handovers + 1] * len(ranks), "each rank wrote to every agent"
    assert spool_segments(spool) == 0 and refused_segments(spool) == 0
    assert counts.lost == 0 and counts.duplicated == 0 and counts.unexpected == 0, counts
    assert counts.stored_rows == counts.expected
