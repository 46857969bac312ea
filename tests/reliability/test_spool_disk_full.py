"""The node agent's spool disk fills up while a real job trains.

The spool lives on a 2 MiB tmpfs mounted for the test (root in this container may mount; where it
may not, or with TRACEHOUND_TEST_NO_MOUNT=1, the agent runs under a small wrapper that makes the
spool module's `os.write` fail with ENOSPC once the spool directory holds 2 MiB: the same error
at the same call, injected). The agent (`tracehound agent`, its own health and process sources
off so that every record it spools comes from the ranks) ships to a ClickHouse server that is
not there yet, so the spool grows until the disk is full. It stays full for a while, training
on; then the server starts, the spool drains, and the job finishes. Afterwards:

- a clear error: the agent logged the failure once, at ERROR, with the spool path and the errno
  (28, ENOSPC), once that it could write again, and its stats file carries the dropped count,
  the failed writes and the last error;
- bounded: while the disk was full the agent used well under a core (no retry loop), its memory
  did not grow with what it dropped, and its spool kept the same number of files;
- training continued: both ranks stepped all through the full window and finished, their
  recorders dropped nothing;
- the count is exact: records the ranks produced = records stored + records the agent counted
  as dropped, kind by kind where it can be told (the store) and in total (the agent's counter).

A fast test first checks the spool itself against a disk that fills up in the middle of a write
(the spool module's `os.write` replaced, in-process): the cut write is taken back, so every
record is either in a segment whole or counted as dropped.
"""

from __future__ import annotations

import collections
import errno
import itertools
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clickhouse_harness import free_port, start_server
from reliability_harness import (
    PYTHON,
    agent_command,
    cpu_seconds,
    kill_all,
    launch_ranks,
    read_stats,
    rss_kb,
    start_agent,
    stop_agent,
    wait_ranks,
)

from tracehound.agent.node import spool as spool_module
from tracehound.agent.node.spool import Spool
from tracehound.tracing import events
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store

pytestmark = [pytest.mark.e2e, pytest.mark.clickhouse_server]

JOB = JobId("spool-full")
NODE = "node-0"
DISK_BYTES = 2 * 1024 * 1024
FULL_S = 10.0
SLICES = 4

STEPS_JOB = r'''
import datetime, json, os, resource, sys, threading, time

import torch
import torch.distributed as dist

from tracehound.agent.rank import autoinstall

out, stop_gate, progress = sys.argv[1], sys.argv[2], sys.argv[3]


class Counting:
    """Passes every record on to the transport and counts what the recorder produced, by kind."""

    def __init__(self, inner):
        self.inner = inner
        self.lock = threading.Lock()
        self.offered = {}
        self.refused = 0

    def offer(self, item):
        accepted = self.inner.offer(item)
        kind = "CollectiveEvent" if isinstance(item, tuple) else type(item).__name__
        with self.lock:
            self.offered[kind] = self.offered.get(kind, 0) + 1
            self.refused += not accepted
        return accepted

    def flush(self, timeout):
        return self.inner.flush(timeout)


recorder = autoinstall.recorder()
assert recorder is not None, "the recorder was not installed"
transport = recorder.sink
counting = recorder.sink = Counting(transport)

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
rank = dist.get_rank()
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.ones(8)
step = 0
with open(f"{progress}.rank{rank}", "w", buffering=1) as log:
    while True:
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        for _ in range(3):
            dist.all_reduce(x)
            x.fill_(1.0)
        step += 1
        log.write(f"{step} {time.time_ns() // 1000}\n")
        time.sleep(0.01)
        flag = torch.tensor([1.0 if os.path.exists(stop_gate) else 0.0])
        dist.all_reduce(flag)
        if flag.item() > 0:
            break

recorder.close(timeout=60.0)  # the final heartbeat, and everything flushed to the agent
recorder.disable()


def snapshot():
    with counting.lock:
        offered = dict(counting.offered)
    return {"offered": offered, "refused": counting.refused, "sent": transport.sent,
            "pending": transport.pending, "lost": transport.lost,
            "dropped": recorder.dropped, "errors": recorder.errors}


a, b = snapshot(), snapshot()
while a != b:
    time.sleep(0.05)
    a, b = b, snapshot()
a["steps"] = step
a["peak_rss_kb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
with open(f"{out}.rank{rank}", "w") as handle:
    json.dump(a, handle)
dist.destroy_process_group()
'''

ENOSPC_WRAPPER = r'''
"""Runs the node agent with ENOSPC injected at the spool's writes once its directory holds
LIMIT bytes (for hosts where the test may not mount a small tmpfs)."""
import errno, os, sys

from tracehound.agent.node import spool as spool_module
from tracehound.agent.node.daemon import main

directory, limit = sys.argv.pop(1), int(sys.argv.pop(1))
real_write = os.write


def used():
    return sum(e.stat().st_size for e in os.scandir(directory) if e.is_file())


class _Os:
    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def write(fd, data):
        room = limit - used()
        if room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, bytes(data[:room]))


spool_module.os = _Os()
sys.exit(main())  # what `tracehound agent` runs (it execs python -m tracehound.agent.node)
'''


class FillingDisk:
    """`os.write` for the spool module with room for `room` more bytes: a write that does not
    fit writes what fits (as a real full disk does), the next one fails with ENOSPC."""

    def __init__(self, room: int) -> None:
        self.room = room

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: Any) -> int:
        if self.room <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        part = bytes(data[: self.room])
        self.room -= len(part)
        return os.write(fd, part)


def test_a_write_cut_short_by_a_full_disk_is_taken_back_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    disk = FillingDisk(room=1000)
    monkeypatch.setattr(spool_module, "os", disk)
    clock = [0.0]
    spool = Spool(tmp_path, node="n", seal_interval_s=3600, monotonic=lambda: clock[0],
                  recover_after_s=1.0)
    line = b'{"k":"' + b"x" * 91 + b'"}'  # 99 bytes, 100 with its newline
    appended = 0
    with caplog.at_level(logging.WARNING, logger="tracehound.agent.node.spool"):
        results = []
        for _ in range(8):  # 4 lines per append: the third append finds room for 2.5 of them
            results.append(spool.append([line] * 4))
            appended += 4
        disk.room = 2  # a short line goes through now and then on a disk on the edge
        results.append(spool.append([b"1"]))
        results.append(spool.append([line]))
        appended += 2
        disk.room = 10_000  # a segment was shipped: room again
        for at in (5.0, 5.5, 6.0):  # going through for a second ends the episode
            clock[0] = at
            results.append(spool.append([line] * 4))
            appended += 4
    assert results == [True, True] + [False] * 6 + [True, False] + [True] * 3
    assert spool.maybe_seal(force=True)
    (number,) = spool.sealed()
    batch = spool.read(number)
    stats = spool.stats
    print(f"disk full mid-write: {stats}")
    assert len(batch.lines) == stats.spooled == 21 and spool.stats.corrupt_lines == 0
    assert stats.spool_dropped == 25 and stats.spool_write_errors == 7
    assert stats.spooled + stats.spool_dropped == appended
    assert spool.path(number, ".seg").stat().st_size == 20 * 100 + 2  # the cut writes are gone
    assert "[Errno 28] ENOSPC" in stats.spool_error
    errors = [r for r in caplog.records if "cannot write the spool" in r.getMessage()]
    assert len(errors) == 1 and errors[0].levelno == logging.ERROR
    assert str(tmp_path) in errors[0].getMessage() and "ENOSPC" in errors[0].getMessage()
    again = [r.getMessage() for r in caplog.records if "writable again" in r.getMessage()]
    assert again == [f"the spool at {tmp_path} is writable again; 25 records were dropped "
                     "while it was not"]


def test_a_full_disk_leaves_no_empty_segments_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(spool_module, "os", FillingDisk(room=0))
    spool = Spool(tmp_path, node="n", seal_interval_s=0.0)
    before = sorted(p.name for p in tmp_path.iterdir())
    for _ in range(50):
        assert not spool.append([b"{}"])
        assert not spool.maybe_seal()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert spool.stats.spool_dropped == 50 and spool.sealed() == []


NO_MOUNT_ENV = "TRACEHOUND_TEST_NO_MOUNT"
"""Set to 1 to take the injected-ENOSPC path even where the test could mount."""


def mount_tmpfs(directory: Path) -> bool:
    """A tmpfs of DISK_BYTES at `directory`; False when this host does not let the test mount
    (or $TRACEHOUND_TEST_NO_MOUNT=1)."""
    directory.mkdir(parents=True)
    if os.environ.get(NO_MOUNT_ENV) == "1":
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs",
                           str(directory)], capture_output=True, text=True, check=False)
    return done.returncode == 0


@pytest.fixture
def spool_disk(tmp_path: Path) -> Iterator[tuple[Path, bool]]:
    """The directory the spool goes in, and whether it is a real full-able tmpfs (else the
    agent runs under ENOSPC_WRAPPER)."""
    disk = tmp_path / "spooldisk"
    mounted = mount_tmpfs(disk)
    try:
        yield disk, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)


def last_step(progress: Path) -> tuple[int, int]:
    """(step, time_us) of the last step a rank logged; (0, 0) before the first."""
    try:
        lines = progress.read_text().splitlines()
    except FileNotFoundError:
        return 0, 0
    for line in reversed(lines):
        parts = line.split()
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    return 0, 0


def stored_by_kind(url: str, kinds: list[str]) -> dict[str, int]:
    """Rows of the job the store holds, per record kind (raw rows: duplicates would count)."""
    store: Any = open_store(url)
    try:
        return {kind: len(store.records(getattr(events, kind), JOB)) for kind in kinds}
    finally:
        store.close()


def wait_until(what: str, check: Any, *, timeout: float = 300.0, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(every)


def test_full_spool_disk_drops_counted_records_logs_once_and_training_goes_on(
    tmp_path: Path, spool_disk: tuple[Path, bool],
) -> None:
    disk, mounted = spool_disk
    spool = disk / "spool"
    stats = tmp_path / "stats.json"
    port = free_port()
    url = f"clickhouse://default:@127.0.0.1:{port}/tracehound_test"  # nothing listens there yet
    command = agent_command(
        job=JOB, node=NODE, socket_path=tmp_path / "agent.sock", spool=spool, sink=url,
        stats_file=stats,
        extra=["--proc-interval", "0", "--stack-after", "0", "--health-interval", "0"])
    if not mounted:
        wrapper = tmp_path / "enospc_agent.py"
        wrapper.write_text(ENOSPC_WRAPPER)
        spool.mkdir(parents=True)
        assert command[3] == "agent"
        command = [PYTHON, str(wrapper), str(spool), str(DISK_BYTES), *command[4:]]
    logs = tmp_path / "logs"
    logs.mkdir()
    agent_log = logs / "agent.log"
    agent = start_agent(command, agent_log)
    script = tmp_path / "steps_job.py"
    script.write_text(STEPS_JOB)
    out, gate, progress = tmp_path / "result", tmp_path / "stop", tmp_path / "progress"
    ranks = launch_ranks(world=2, command=[PYTHON, str(script), str(out), str(gate),
                                           str(progress)],
                         job=JOB, node=NODE, socket_path=tmp_path / "agent.sock",
                         checkpoint_dir=tmp_path / "ckpt", logs=logs)
    server = None
    try:
        wait_until("the spool disk filled up",
                   lambda: read_stats(stats).get("spool_dropped", 0) > 0)
        full_at = read_stats(stats)
        cpu_at, rss_at = cpu_seconds(agent.pid), rss_kb(agent.pid)
        files_at = len(list(spool.iterdir()))
        steps_at = [last_step(Path(f"{progress}.rank{r}")) for r in range(2)]
        seen: list[list[int]] = [[] for _ in range(2)]
        started = time.monotonic()
        for _part in range(SLICES):
            time.sleep(FULL_S / SLICES)
            for r in range(2):
                seen[r].append(last_step(Path(f"{progress}.rank{r}"))[0])
            assert all(p.poll() is None for p in ranks), "a rank ended while the disk was full"
        window_s = time.monotonic() - started
        cpu_s, rss_now = cpu_seconds(agent.pid) - cpu_at, rss_kb(agent.pid)
        files_now = len(list(spool.iterdir()))
        still_full = read_stats(stats)
        assert agent.poll() is None, agent_log.read_text()[-3000:]

        server = start_server(tmp_path / "clickhouse", tcp_port=port)
        assert server.url == url
        wait_until("the agent could write its spool again",
                   lambda: "is writable again" in agent_log.read_text())
        gate.touch()
        wait_ranks(ranks, logs)
        assert stop_agent(agent) == 0
        final = read_stats(stats)
        results = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(2)]
        kinds = sorted({k for res in results for k in res["offered"]})
        stored = stored_by_kind(url, kinds)
    finally:
        kill_all(ranks)
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if server is not None:
            server.stop()

    text = agent_log.read_text()
    failures = [line for line in text.splitlines() if "cannot write the spool" in line]
    recovered = re.findall(r"the spool at (\S+) is writable again; (\d+) records were dropped",
                           text)
    produced = collections.Counter[str]()
    for res in results:
        produced.update(res["offered"])
    print(f"spool disk full ({'tmpfs' if mounted else 'injected ENOSPC'}, "
          f"{DISK_BYTES} bytes): produced {dict(produced)}, stored {stored}, agent: received "
          f"{final['received']} spooled {final['spooled']} dropped {final['spool_dropped']} "
          f"in {final['spool_write_errors']} failed writes; while full for {window_s:.1f} s: "
          f"agent CPU {cpu_s:.2f} s, RSS {rss_at} -> {rss_now} kB, spool files {files_at} -> "
          f"{files_now}, steps {steps_at} then {seen}; ranks {results}")

    # a clear error, logged once, with the path and the errno; and in the counters
    assert len(failures) == 1, failures
    assert "ERROR" in failures[0] and str(spool) in failures[0], failures[0]
    assert "[Errno 28]" in failures[0] and "ENOSPC" in failures[0], failures[0]
    assert len(recovered) == 1 and recovered[0][0] == str(spool), recovered
    assert int(recovered[0][1]) == final["spool_dropped"]  # none dropped after the recovery
    assert str(spool) in final["spool_error"] and "[Errno 28] ENOSPC" in final["spool_error"]
    assert 0 < final["spool_write_errors"] <= final["spool_dropped"]
    assert still_full["spool_dropped"] > full_at["spool_dropped"], "nothing arrived while full"

    # bounded: no retry loop, no memory kept for what was dropped, no pile of empty segments
    assert cpu_s < 0.5 * window_s, f"the agent used {cpu_s:.2f} s of CPU in {window_s:.1f} s"
    assert rss_now - rss_at < 8 * 1024, f"the agent's RSS grew {rss_now - rss_at} kB while full"
    assert files_now <= files_at + 1, f"{files_at} -> {files_now} files in the spool"

    # training continued: both ranks stepped in every part of the full window, and finished
    for r in range(2):
        marks = [steps_at[r][0], *seen[r]]
        assert all(b > a for a, b in itertools.pairwise(marks)), (r, marks)
        res = results[r]
        assert res["dropped"] == res["refused"] == res["lost"] == res["errors"] == 0, res
        assert res["pending"] == 0, res
        assert res["sent"] == sum(res["offered"].values()), res

    # exact: produced = stored + counted as dropped
    total_produced = sum(produced.values())
    assert final["rejected"] == 0
    assert final["received"] == total_produced
    assert final["received"] == final["spooled"] + final["spool_dropped"]
    assert final["shipped"] == final["spooled"] and final["pending_segments"] == 0
    assert sum(stored.values()) == final["spooled"]
    assert total_produced == sum(stored.values()) + final["spool_dropped"]
    for kind, count in produced.items():
        assert stored[kind] <= count, (kind, stored[kind], count)
    assert stored["CollectiveEvent"] < produced["CollectiveEvent"]  # some were dropped
