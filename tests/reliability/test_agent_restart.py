"""A node agent SIGKILLed in the middle of a real job and started again on its spool.

Two gloo DDP ranks (agent/examples/train_ddp.py, the recorder auto-installed) report to one node
agent (`tracehound agent`) that ships into a real ClickHouse server. The agent seals a segment
every second, so when it is killed its spool holds records it had accepted and not shipped. It
stays dead for ten seconds, then a new agent starts on the same socket and spool. Afterwards:

- the records the dead agent left in its spool are all stored, exactly once: the new agent
  shipped them;
- every collective the ranks completed (by their final heartbeats) is stored exactly once,
  counted by (job, attempt, rank, group, seq) over the raw rows, and no rank dropped a record;
- training never waited for the agent: each rank's heartbeats (buffered in the rank while no
  agent listened) show it stepping in every part of the ten seconds.

What the kernel held for the killed agent (lines in its socket buffer, or read and not yet
spooled) is not lost either: the agent acknowledges what it spooled, and the rank's transport
writes the rest again to the next agent. A fast test below kills the "agent" at exactly that
point, with lines written and never acknowledged.
"""

from __future__ import annotations

import collections
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_harness import (
    PYTHON,
    Key,
    agent_command,
    drop_database,
    duplicated_heartbeats,
    fresh_database_url,
    kill_all,
    launch_ranks,
    read_stats,
    read_store,
    start_agent,
    steps_in_slices,
    stop_agent,
    tally,
    wait_ranks,
)

from tracehound.agent.rank.recorder import Recorder
from tracehound.agent.rank.transport import SocketTransport
from tracehound.tracing.events import CollectiveEvent, now_us
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store
from tracehound.tracing.wire import decode_line

pytestmark = [pytest.mark.e2e, pytest.mark.clickhouse_server]

JOB = JobId("agent-restart")
NODE = "node-0"
STEPS = 1500
DOWN_S = 10.0
SLICES = 4
TRAIN_DDP = str(Path(__file__).resolve().parents[2] / "agent" / "examples" / "train_ddp.py")


@pytest.fixture
def url(clickhouse_url: str) -> Iterator[str]:
    database = fresh_database_url(clickhouse_url)
    yield database
    drop_database(database)


def spooled_keys(spool: Path) -> collections.Counter[Key]:
    """The collectives in the segment files of a spool (open or sealed), by key."""
    found: collections.Counter[Key] = collections.Counter()
    for path in sorted(spool.glob("seg-*")):
        if path.suffix not in (".open", ".seg"):
            continue
        for line in path.read_bytes().splitlines():
            try:
                record = decode_line(line)
            except Exception:
                continue  # a line torn by the kill: the new agent skips it as well
            if isinstance(record, CollectiveEvent):
                found[(record.attempt, record.rank, record.group, record.seq)] += 1
    return found


def holds_records(spool: Path) -> bool:
    """Whether the spool's open segment holds anything yet."""
    for path in spool.glob("seg-*.open"):
        try:
            if path.stat().st_size > 0:
                return True
        except FileNotFoundError:
            continue  # sealed meanwhile
    return False


def latest_step(url: str) -> int:
    store = open_store(url)
    try:
        beats = store.latest_heartbeats(JOB, 0)
    finally:
        store.close()
    return min((hb.step for hb in beats), default=0) if len(beats) == 2 else 0


def test_agent_killed_and_restarted_mid_job_resumes_its_spool_and_loses_nothing(
    tmp_path: Path, url: str,
) -> None:
    spool, stats = tmp_path / "spool", tmp_path / "stats.json"
    socket_path = tmp_path / "agent.sock"
    command = agent_command(job=JOB, node=NODE, socket_path=socket_path, spool=spool, sink=url,
                            stats_file=stats, extra=["--seal-interval", "1.0"])
    logs = tmp_path / "logs"
    logs.mkdir()
    first = start_agent(command, logs / "agent-1.log")
    ranks = launch_ranks(
        world=2, command=[PYTHON, TRAIN_DDP, "--steps", str(STEPS), "--step-sleep-ms", "20",
                          "--checkpoint-every", "0"],
        job=JOB, node=NODE, socket_path=socket_path, checkpoint_dir=tmp_path / "ckpt", logs=logs,
        # every DDP bucket a record (by default they are counted, a step recorded now and
        # then), so every seq of every group must be stored
        env={"TRACEHOUND_DDP_TRACE_EVERY": "1"})
    second = None
    try:
        deadline = time.monotonic() + 300
        while latest_step(url) < 100:
            assert all(r.poll() is None for r in ranks), "a rank ended before the kill"
            assert time.monotonic() < deadline, "the job never reached step 100"
            time.sleep(0.2)
        # kill while the spool holds collectives the agent accepted and has not shipped: the
        # agent is stopped first, so no seal or shipment can empty the spool between the look
        # and the kill (a CI run once lost that race under load)
        while True:
            first.send_signal(signal.SIGSTOP)
            if holds_records(spool) and spooled_keys(spool):
                break
            first.send_signal(signal.SIGCONT)
            assert time.monotonic() < deadline, "the agent's spool never held a collective"
            time.sleep(0.01)
        first.send_signal(signal.SIGKILL)
        first.wait()
        down_us = now_us()
        before = read_stats(stats)
        left = spooled_keys(spool)
        time.sleep(DOWN_S)
        assert all(r.poll() is None for r in ranks), "the job must outlive the agent's absence"
        up_us = now_us()
        second = start_agent(command, logs / "agent-2.log")
        wait_ranks(ranks, logs)
        assert stop_agent(second) == 0
        after = read_stats(stats)
    finally:
        kill_all(ranks)
        for agent in (first, second):
            if agent is not None and agent.poll() is None:
                agent.kill()
                agent.wait()

    stored = read_store(url, JOB)
    counts = stored.counts()
    counted = tally(stored)
    stepping = {r: steps_in_slices(stored.heartbeats, rank=r, start_us=down_us, end_us=up_us,
                                   slices=SLICES) for r in range(2)}
    second_log = (logs / "agent-2.log").read_text()
    print(f"agent killed for {DOWN_S:.0f} s: {sum(left.values())} collectives left in its spool; "
          f"{counted.describe()}; steps per {DOWN_S / SLICES:.1f} s without an agent "
          f"{stepping}; first agent's last stats {json.dumps(before)}; second agent's "
          f"{json.dumps(after)}")

    assert left, "the killed agent left nothing in its spool: nothing to resume"
    assert "left open by an earlier agent" in second_log
    not_shipped = {k for k in left if counts[k] != 1}
    assert not not_shipped, f"spooled by the dead agent, stored {len(not_shipped)} times != 1"
    assert after["shipped"] >= sum(left.values())
    assert after["pending_segments"] == 0 and after["rejected"] == 0

    assert sorted(hb.rank for hb in stored.final) == [0, 1]
    for hb in stored.final:
        assert hb.step == STEPS and hb.dropped == 0
    assert counted.expected >= 2 * STEPS
    assert not counted.missing, f"{len(counted.missing)} completed collectives never stored: " \
                                f"{counted.missing[:10]}"
    assert not counted.duplicated, f"stored more than once: {list(counted.duplicated)[:10]}"
    assert not counted.unexpected, f"stored but never completed: {counted.unexpected[:10]}"
    assert counted.stored_rows == counted.expected
    assert duplicated_heartbeats(stored.heartbeats) == 0

    for rank, per_slice in stepping.items():
        assert all(n > 0 for n in per_slice), f"rank {rank} stood still: {per_slice}"


class Listener:
    """A stand-in node agent on a unix socket: says it acknowledges, takes lines, acknowledges
    only the first `ack_upto` of them and, with `die_after`, drops the connection once it has
    read that many lines (the rest of what was written is never read: a killed agent)."""

    def __init__(self, path: Path, *, ack_upto: int, die_after: int | None = None) -> None:
        self.lines: list[bytes] = []
        self.ack_upto, self.die_after = ack_upto, die_after
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        conn.sendall(b"0\n")
        buffer = b""
        try:
            while self.die_after is None or len(self.lines) < self.die_after:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                *lines, buffer = (buffer + chunk).split(b"\n")
                self.lines.extend(lines)
                conn.sendall(b"%d\n" % min(len(self.lines), self.ack_upto))
        finally:
            self.server.close()  # first: the transport must not find it still listening
            conn.close()
            self.done.set()


def test_lines_written_to_an_agent_that_died_unacknowledged_go_to_the_next_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "agent.sock"
    total, acked = 300, 120
    transport = SocketTransport(str(path), bound=10_000)
    recorder = Recorder(job="j", attempt=0, node="n", rank=0, sink=transport)
    first = Listener(path, ack_upto=acked, die_after=200)
    for _ in range(total):
        recorder.end(recorder.begin("0", "all_reduce", 4, "float32"), True)
    transport.start()
    assert first.done.wait(30), "the first listener never got its lines"
    path.unlink()
    second = Listener(path, ack_upto=total)
    try:
        assert transport.flush(30.0)
    finally:
        transport.close(timeout=1.0)
    first_seqs = [decode_line(line).seq for line in first.lines[:acked]]
    second_seqs = [decode_line(line).seq for line in second.lines]
    print(f"first agent read {len(first.lines)} lines and acknowledged {acked}; the second "
          f"got {len(second_seqs)}: {second_seqs[:3]}..{second_seqs[-3:]}")
    assert first_seqs == list(range(1, acked + 1))
    # the second agent gets everything from the first unacknowledged line on, once
    assert second_seqs == list(range(acked + 1, total + 1))
    assert transport.sent == total and transport.pending == 0 and transport.lost == 0
    assert transport.connects == 2
