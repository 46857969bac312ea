"""The node agent's process watcher (agent/procwatch.py).

Real processes (small Python children, no torch) for /proc sampling and py-spy; an injected clock,
fake heartbeats, a fake /proc reader and a fake capturer for the trigger rules, which are then
stated exactly. End to end through a real NodeAgent (socket -> spool -> sink) and through the
agent's command line (flags, SIGTERM).
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import CollectingIngest

from tracehound.agent.node.daemon import NodeAgent, parse_args, spool_writer
from tracehound.agent.node.procwatch import (
    CAPTURE_RETRIES,
    ProcFs,
    ProcReading,
    ProcWatcher,
    PySpy,
    StackCaptureError,
    SuspectKind,
    Suspicion,
    episode,
    find_py_spy,
    frames_from_dump,
    parse_io,
    parse_stat,
    read_launch_file,
    suspicion,
)
from tracehound.agent.node.spool import Spool
from tracehound.tracing import wire
from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.events import (
    Batch,
    GroupProgress,
    Heartbeat,
    ProcessSample,
    Record,
    StackSample,
    now_us,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank

S = 1_000_000
"""One second in microseconds."""
T0 = 1_700_000_000 * S
JOB = JobId("job-pw")
NODE = NodeId("node-0")


# -- helpers ----------------------------------------------------------------------------------


def progress(
    group: str = "0", *, enq: int, comp: int, pending: str = "", enq_us: int = 0,
    comp_us: int = 0,
) -> GroupProgress:
    return GroupProgress(
        group=GroupId(group), last_enqueued=enq, last_completed=comp, pending_op=pending,
        last_enqueue_us=enq_us, last_complete_us=comp_us,
    )


def beat(
    *, pid: int, time_us: int, rank: int = 0, attempt: int = 0,
    groups: tuple[GroupProgress, ...] = (),
) -> Heartbeat:
    return Heartbeat(
        job=JOB, attempt=attempt, node=NODE, rank=Rank(rank), time_us=time_us, pid=pid, step=0,
        step_us=0, start_step=0, first_step_us=0, dropped=0, groups=groups,
    )


class FakeClock:
    def __init__(self, now: int) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


class FakeReader:
    """Stands in for /proc in the trigger tests: a dict of what each pid reads as."""

    def __init__(self, readings: dict[int, ProcReading | None]) -> None:
        self.readings = readings
        self.calls: list[int] = []

    def read(self, pid: int) -> ProcReading | None:
        self.calls.append(pid)
        return self.readings.get(pid)


class FakeCapturer:
    """Stands in for py-spy in the trigger tests; fails with `error` when it is set."""

    def __init__(self, error: str = "") -> None:
        self.error = error
        self.calls: list[int] = []

    def capture(self, pid: int, *, cancel: threading.Event) -> tuple[str, ...]:
        self.calls.append(pid)
        if self.error:
            raise StackCaptureError(self.error)
        return ("train.py:55 main", f"train.py:10 work_{pid}")


def sleeping(cpu_s: float = 0.0, *, start: int = 7, read: int = 0, write: int = 0) -> ProcReading:
    return ProcReading(state="S", cpu_s=cpu_s, start_ticks=start, read_bytes=read,
                       write_bytes=write, io_known=True)


class Rig:
    """A watcher on fake parts, with the records it emitted."""

    def __init__(self, **kwargs: Any) -> None:
        self.clock = FakeClock(T0)
        self.reader = FakeReader({100: sleeping(), 101: sleeping(), 200: sleeping()})
        self.capturer = FakeCapturer()
        self.records: list[Record] = []
        self.watcher = ProcWatcher(
            emit=self.records.extend, reader=self.reader, capturer=self.capturer,
            clock=self.clock, **kwargs,
        )

    def at(self, seconds: float, *beats: Heartbeat) -> list[int]:
        """Move the clock to T0 + seconds, give the heartbeats, run a round; the pids captured."""
        self.clock.now = T0 + round(seconds * S)
        for hb in beats:
            self.watcher.observe(hb)
        before = len(self.capturer.calls)
        self.watcher.tick()
        return self.capturer.calls[before:]

    def stacks(self) -> list[StackSample]:
        return [r for r in self.records if isinstance(r, StackSample)]

    def samples(self) -> list[ProcessSample]:
        return [r for r in self.records if isinstance(r, ProcessSample)]


SLEEPER = """\
import sys, time

def snooze_in_named_function():
    print("ready", flush=True)
    time.sleep(3600)

snooze_in_named_function()
"""

BUSY = """\
print("ready", flush=True)

def spin_in_named_function():
    x = 0
    while True:
        x += 1

spin_in_named_function()
"""

WRITER = """\
import os, sys, time

def write_in_named_function(path):
    print("ready", flush=True)
    with open(path, "wb") as f:
        while True:
            f.write(b"x" * 65536)
            f.flush()
            os.fsync(f.fileno())
            f.seek(0)
            time.sleep(0.02)

write_in_named_function(sys.argv[1])
"""

RENAMED = """\
import time
with open("/proc/self/comm", "w") as f:
    f.write("x) R (y) z")
print("ready", flush=True)
time.sleep(3600)
"""


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts small Python children (each waits until it printed "ready"); kills them after."""
    children: list[subprocess.Popen[bytes]] = []

    def start(source: str, *args: str, name: str = "child.py") -> subprocess.Popen[bytes]:
        script = tmp_path / name
        script.write_text(source)
        child = subprocess.Popen([sys.executable, str(script), *args], stdout=subprocess.PIPE)
        children.append(child)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"ready"
        return child

    yield start
    for child in children:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait()


def poll(condition: Callable[[], bool], *, timeout: float = 30.0, every: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def asleep(pid: int) -> bool:
    """Waits until the process sleeps (a child that just printed "ready" may still run)."""
    return poll(lambda: (reading := ProcFs().read(pid)) is not None and reading.state == "S",
                every=0.02)


def real_watcher(records: list[Record], **kwargs: Any) -> ProcWatcher:
    return ProcWatcher(emit=records.extend, reader=ProcFs(), capturer=PySpy(find_py_spy()),
                       job=JOB, node=NODE, **kwargs)


def samples_of(records: list[Record], pid: int) -> list[ProcessSample]:
    return [r for r in records if isinstance(r, ProcessSample) and r.pid == pid]


# -- /proc parsing ----------------------------------------------------------------------------


def stat_line(comm: str, state: str = "S", utime: int = 250, stime: int = 50) -> str:
    fields = [state, "1", "1", "1", "0", "-1", "4194304", "10", "0", "0", "0", str(utime),
              str(stime), "0", "0", "20", "0", "1", "0", "98765", "1000", "200"]
    return f"4242 ({comm}) " + " ".join(fields) + "\n"


def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    for comm in ("python", "a) S (b", "x) R (y) z", "sp ace", ") )"):
        assert parse_stat(stat_line(comm, "D"), 100) == ("D", 3.0, 98765)
    with pytest.raises(ValueError):
        parse_stat("4242 no parenthesis here", 100)
    with pytest.raises(ValueError):
        parse_stat("4242 (short) S 1 2", 100)


def test_parse_io() -> None:
    text = ("rchar: 5\nwchar: 6\nsyscr: 1\nsyscw: 1\nread_bytes: 4096\nwrite_bytes: 8192\n"
            "cancelled_write_bytes: 0\n")
    assert parse_io(text) == (4096, 8192)
    with pytest.raises(ValueError):
        parse_io("rchar: 5\n")


def test_procfs_reads_a_process_whose_name_holds_parentheses(
    spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    child = spawn(RENAMED)
    assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "x) R (y) z"
    # A parser that split at the first ')' would read state "R" from the name, never "S".
    assert asleep(child.pid)


def test_procfs_unreadable_io_gives_zeros_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "stat").write_text(stat_line("a) b"))
    (tmp_path / "4242" / "io").write_text("rchar: 1\n")  # no read_bytes/write_bytes
    proc = ProcFs(tmp_path, clock_ticks=100)
    with caplog.at_level(logging.WARNING, logger="tracehound.agent.node.procwatch"):
        first, second = proc.read(4242), proc.read(4242)
    expected = ProcReading(state="S", cpu_s=3.0, start_ticks=98765)
    assert first == second == expected
    assert len([r for r in caplog.records if "io" in r.getMessage()]) == 1
    assert proc.read(4243) is None


# -- sampling real processes ------------------------------------------------------------------


def test_real_process_sampled_stopped_continued_and_gone_once(
    spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    child = spawn(SLEEPER)
    assert asleep(child.pid)
    records: list[Record] = []
    watcher = real_watcher(records, stack_after_s=0)
    watcher.observe(beat(pid=child.pid, time_us=now_us()))
    watcher.tick()
    (first,) = samples_of(records, child.pid)
    assert (first.state, first.pid, first.rank, first.job, first.node) == (
        "S", child.pid, 0, JOB, NODE)
    assert first.cpu_rate == 0.0 and first.io_rate == 0.0

    def latest_state(state: str) -> Callable[[], bool]:
        def check() -> bool:
            watcher.tick()
            return samples_of(records, child.pid)[-1].state == state
        return check

    os.kill(child.pid, signal.SIGSTOP)
    assert poll(latest_state("T"))
    os.kill(child.pid, signal.SIGCONT)
    assert poll(latest_state("S"))

    child.kill()
    child.wait()
    watcher.tick()
    watcher.tick()
    mine = samples_of(records, child.pid)
    gone = [s for s in mine if s.state == "gone"]
    assert len(gone) == 1 and mine[-1] is gone[0]
    assert gone[0].cpu_s == mine[-2].cpu_s and gone[0].cpu_rate == 0.0
    assert gone[0].write_bytes == mine[-2].write_bytes and gone[0].io_rate == 0.0
    assert watcher.watched() == []
    assert watcher.stats.process_samples == len(mine)


def test_busy_child_shows_cpu_rate(spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    child = spawn(BUSY)
    records: list[Record] = []
    watcher = real_watcher(records, stack_after_s=0)
    watcher.observe(beat(pid=child.pid, time_us=now_us()))

    def busy() -> bool:
        # a busy loop runs at one CPU-second a second on an idle core; on two cores shared by
        # three test lanes and a benchmark it got under a fifth of that for 30 s in a CI run:
        # any share shows it running, since a sleeping process's rate is 0
        watcher.tick()
        return any(s.cpu_rate > 0.05 for s in samples_of(records, child.pid))

    assert poll(busy, every=0.3)
    assert samples_of(records, child.pid)[-1].cpu_s > 0


def test_writing_child_shows_write_bytes_growing(
    spawn: Callable[..., subprocess.Popen[bytes]], tmp_path: Path,
) -> None:
    # write_bytes counts what goes to a block device, and tmpfs (where `make test` puts
    # tmp_path) has none: the child writes under /var/tmp, on disk
    where = "/var/tmp" if os.path.isdir("/var/tmp") else tmp_path
    with tempfile.TemporaryDirectory(dir=where) as on_disk:
        child = spawn(WRITER, str(Path(on_disk) / "out.bin"))
        first = ProcFs().read(child.pid)
        if first is None or not first.io_known:
            pytest.skip("/proc/PID/io is not readable here")
        records: list[Record] = []
        watcher = real_watcher(records, stack_after_s=0)
        watcher.observe(beat(pid=child.pid, time_us=now_us()))

        def growing() -> bool:
            watcher.tick()
            mine = samples_of(records, child.pid)
            return len(mine) >= 2 and mine[-1].write_bytes > mine[0].write_bytes and any(
                s.io_rate > 0 for s in mine)

        assert poll(growing, every=0.2)


# -- py-spy on real processes -----------------------------------------------------------------


def test_py_spy_captures_a_sleeping_child_outermost_first(
    spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    child = spawn(SLEEPER, name="sleeper.py")
    assert asleep(child.pid)
    spy = PySpy(find_py_spy())
    assert spy.path is not None
    frames = spy.capture(child.pid, cancel=threading.Event())
    assert frames[-1].startswith("sleeper.py:") and frames[-1].endswith(" snooze_in_named_function")
    assert frames[0].endswith(" <module>")
    os.kill(child.pid, signal.SIGSTOP)  # a stopped process is read without resuming it
    try:
        assert spy.capture(child.pid, cancel=threading.Event()) == frames
        assert ProcFs().read(child.pid) is not None
    finally:
        os.kill(child.pid, signal.SIGCONT)


def test_py_spy_failures_say_why(spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    with pytest.raises(StackCaptureError, match="not found"):
        PySpy(None).capture(1, cancel=threading.Event())
    with pytest.raises(StackCaptureError, match="cannot run"):
        PySpy("/nonexistent/py-spy").capture(1, cancel=threading.Event())
    child = subprocess.Popen(["sleep", "60"])  # not a Python process
    try:
        with pytest.raises(StackCaptureError, match="exited with"):
            PySpy(find_py_spy()).capture(child.pid, cancel=threading.Event())
    finally:
        child.kill()
        child.wait()


def test_frames_from_dump_picks_the_main_thread() -> None:
    def thread(name: str | None, tid: int, fn: str) -> dict[str, object]:
        return {"thread_name": name, "os_thread_id": tid, "frames": [
            {"name": fn, "filename": "/x/inner.py", "short_filename": "inner.py", "line": 3},
            {"name": "main", "filename": "/x/train.py", "short_filename": "", "line": 55},
        ]}

    worker, main = thread("Thread-1", 11, "work"), thread("MainThread", 10, "wait")
    assert frames_from_dump([worker, main], 10) == ("/x/train.py:55 main", "inner.py:3 wait")
    assert frames_from_dump([worker, main], 99)[-1] == "inner.py:3 wait"
    assert frames_from_dump([worker, thread(None, 12, "other")], 99)[-1] == "inner.py:3 work"
    bad: object
    for bad in ([], {}, "x", [1]):
        with pytest.raises(StackCaptureError):
            frames_from_dump(bad, 10)


# -- when to capture (injected clock, fake heartbeats) -----------------------------------------


def test_suspicion_rules() -> None:
    after = 2 * S
    pending = progress(enq=5, comp=4, pending="all_reduce", enq_us=T0, comp_us=T0 - S)
    idle = progress(enq=5, comp=5, enq_us=T0 - S, comp_us=T0)
    fresh = T0 + 10 * S

    def why(groups: tuple[GroupProgress, ...], now: int, hb_us: int = fresh) -> Suspicion | None:
        return suspicion(beat(pid=1, time_us=hb_us, groups=groups), now=now, after_us=after)

    assert why((pending,), T0 + 2 * S - 1, hb_us=T0 + S) is None
    assert why((pending,), T0 + 2 * S, hb_us=T0 + S) == Suspicion(
        SuspectKind.PENDING, T0, "in all_reduce (group 0)")
    assert why((idle,), T0 + 2 * S - 1, hb_us=T0 + S) is None
    assert why((idle,), T0 + 2 * S, hb_us=T0 + S) == Suspicion(SuspectKind.BUSY, T0)
    # Never did a collective: starting up, not suspect while it heartbeats.
    assert why((progress(enq=0, comp=0),), fresh) is None
    assert why((), fresh) is None
    # In a group since T0 with no collective for the threshold: a slow first step, busy.
    joined = beat(pid=1, time_us=T0 + 3 * S, groups=(progress(enq=0, comp=0),))
    assert suspicion(joined, now=T0 + 2 * S - 1, after_us=after, joined_us=T0) is None
    assert suspicion(joined, now=T0 + 2 * S, after_us=after, joined_us=T0) == Suspicion(
        SuspectKind.BUSY, T0)
    assert suspicion(beat(pid=1, time_us=T0 + 8 * S, groups=()), now=T0 + 9 * S,
                     after_us=after, joined_us=T0) is None
    # The oldest pending op of several groups counts.
    other = progress("1", enq=2, comp=2, enq_us=T0 + 5 * S, comp_us=T0 + 6 * S)
    assert why((other, pending), T0 + 3 * S, hb_us=T0 + 3 * S) == Suspicion(
        SuspectKind.PENDING, T0, "in all_reduce (group 0)")
    # Heartbeats stopped: silent, whatever the last one said.
    assert why((), T0 + 2 * S, hb_us=T0) == Suspicion(SuspectKind.SILENT, T0)
    assert why((pending,), T0 + 12 * S, hb_us=T0 + 10 * S) == Suspicion(SuspectKind.SILENT,
                                                                         T0 + 10 * S)
    assert episode(beat(pid=1, time_us=0, groups=(pending, other))) == (
        ("0", 5, 4), ("1", 2, 2))


def test_pending_rank_captured_once_per_episode_repeated_and_gapped() -> None:
    rig = Rig(stack_after_s=2, stack_repeat_s=30, stack_min_gap_s=5)
    stuck = (progress(enq=5, comp=4, pending="all_reduce", enq_us=T0, comp_us=T0 - S),)

    def at(seconds: float, groups: tuple[GroupProgress, ...] = stuck) -> list[int]:
        return rig.at(seconds, beat(pid=100, time_us=T0 + round(seconds * S), groups=groups))

    assert at(0) == [] and at(1.9) == []
    assert at(2.0) == [100]
    assert [at(s) for s in (3, 10, 31.9)] == [[], [], []]
    assert at(32) == [100], "the same episode is captured again every stack_repeat_s"
    # Progress: a new episode, pending again from 33 s; the min gap holds it back until 37 s.
    moved = (progress(enq=6, comp=5, pending="all_reduce", enq_us=T0 + 33 * S, comp_us=T0),)
    assert [at(s, moved) for s in (33, 35, 36.9)] == [[], [], []]
    assert at(37, moved) == [100]
    assert at(42, moved) == []
    stacks = rig.stacks()
    assert [s.time_us for s in stacks] == [T0 + 2 * S, T0 + 32 * S, T0 + 37 * S]
    assert stacks[0] == StackSample(job=JOB, attempt=0, node=NODE, rank=Rank(0),
                                    time_us=T0 + 2 * S,
                                    frames=("train.py:55 main", "train.py:10 work_100"))
    assert rig.watcher.stats.stacks_captured == 3


def test_busy_rank_outside_collectives_is_captured() -> None:
    rig = Rig(stack_after_s=2, stack_repeat_s=30, stack_min_gap_s=5)
    done = (progress(enq=3, comp=3, enq_us=T0 - S, comp_us=T0),)

    def at(seconds: float, groups: tuple[GroupProgress, ...] = done) -> list[int]:
        return rig.at(seconds, beat(pid=100, time_us=T0 + round(seconds * S), groups=groups))

    assert at(1.9) == []
    assert at(2) == [100]
    assert at(9) == []
    later = (progress(enq=4, comp=4, enq_us=T0 + 7 * S, comp_us=T0 + 8 * S),)
    assert at(9.9, later) == []
    assert at(10, later) == [100]


def test_a_rank_that_goes_from_waiting_to_computing_is_captured_again() -> None:
    """A rank waits in DDP's construction (a collective the recorder does not see), then
    computes a slow first step: no collective progress in between, but the stack from the wait
    does not stand for the step, so it is captured again once the process computes."""
    rig = Rig(stack_after_s=2, stack_repeat_s=30, stack_min_gap_s=5)
    joined = (progress(enq=0, comp=0),)

    def at(seconds: float, cpu_s: float) -> list[int]:
        rig.reader.readings[100] = sleeping(cpu_s)
        return rig.at(seconds, beat(pid=100, time_us=T0 + round(seconds * S), groups=joined))

    assert at(0, 0.0) == []
    assert at(2, 0.0) == [100], "busy since it joined: captured while it waits"
    assert at(3, 0.05) == []
    assert at(4, 1.0) == [100], "computing now: captured again, inside the min gap"
    assert [at(s, 1.0 + (s - 4) * 0.95) for s in (5, 6, 9, 20)] == [[], [], [], []]
    assert at(34, 29.5) == [100], "the episode's repeat"


def test_rank_without_collectives_is_not_captured_while_it_heartbeats() -> None:
    rig = Rig(stack_after_s=2)
    for seconds in (0, 5, 100):
        assert rig.at(seconds, beat(pid=100, time_us=T0 + seconds * S)) == []
    assert rig.at(100, beat(pid=100, time_us=T0 + 100 * S, groups=(progress(enq=0, comp=0),)))\
        == []


def test_silent_rank_captured_while_its_process_exists_only() -> None:
    rig = Rig(stack_after_s=2, stack_repeat_s=30, stack_min_gap_s=5)
    rig.at(0, beat(pid=100, time_us=T0))
    assert rig.at(1.9) == []
    assert rig.at(2) == [100]
    assert rig.at(31) == []
    rig.reader.readings[100] = None  # the process ended: no capture, one "gone" sample
    assert rig.at(40) == []
    assert rig.at(80) == []
    assert [s.state for s in rig.samples()][-1] == "gone"
    assert sum(s.state == "gone" for s in rig.samples()) == 1
    assert rig.reader.calls.count(100) == 5


def test_samples_rates_gone_and_reused_pid() -> None:
    rig = Rig(stack_after_s=0)
    rig.reader.readings[100] = sleeping(1.0, read=1000, write=0)
    rig.at(0, beat(pid=100, time_us=T0))
    rig.reader.readings[100] = sleeping(1.5, read=1000, write=2000)
    rig.at(1)
    rig.reader.readings[100] = sleeping(1.5, start=8)  # same pid, another process
    rig.at(2)
    rig.at(3)
    assert [(s.time_us, s.state, s.cpu_s, s.cpu_rate, s.read_bytes, s.write_bytes, s.io_rate)
            for s in rig.samples()] == [
        (T0, "S", 1.0, 0.0, 1000, 0, 0.0),
        (T0 + S, "S", 1.5, 0.5, 1000, 2000, 2000.0),
        (T0 + 2 * S, "gone", 1.5, 0.0, 1000, 2000, 0.0),
    ]
    assert rig.watcher.stats.process_samples == 3
    assert rig.capturer.calls == []


def test_a_last_look_reports_ranks_that_ended_since_the_last_round_gone_once() -> None:
    # a launcher that stops the agent as its ranks exit (tracehound instrument) gives the
    # watcher no later round: the last look is what tells a watcher that they exited
    rig = Rig(stack_after_s=0)
    rig.at(0, beat(pid=100, time_us=T0, rank=0), beat(pid=101, time_us=T0, rank=1))
    rig.reader.readings[100] = None  # ended after that round
    rig.clock.now = T0 + S // 2
    rig.watcher.last_look()
    rig.watcher.last_look()
    assert [(s.rank, s.state) for s in rig.samples()] == [(0, "S"), (1, "S"), (0, "gone"),
                                                          (1, "S"), (1, "S")]
    assert rig.capturer.calls == []
    Rig(proc_interval_s=0).watcher.last_look()  # sampling off: nothing to look at, no error


def test_newer_attempt_replaces_the_older_ones_ranks() -> None:
    rig = Rig(stack_after_s=2, stack_min_gap_s=5)
    rig.at(0, beat(pid=100, time_us=T0), beat(pid=101, rank=1, time_us=T0))
    assert rig.at(2) == [100, 101]  # both silent
    rig.at(3, beat(pid=200, attempt=1, time_us=T0 + 3 * S))
    assert rig.watcher.watched() == [((JOB, 1, Rank(0)), 200)]
    rig.at(4, beat(pid=100, time_us=T0 + 4 * S))  # a late heartbeat of attempt 0: ignored
    assert rig.watcher.watched() == [((JOB, 1, Rank(0)), 200)]
    rig.reader.calls.clear()
    assert rig.at(60) == [200]
    assert rig.reader.calls == [200]
    assert {(s.attempt, s.pid) for s in rig.samples() if s.time_us >= T0 + 4 * S} == {(1, 200)}


def launches(path: Path, *ranks: dict[str, Any], attempt: int = 0, job: str = JOB) -> None:
    """Write a launch file as `tracehound run` does (atomically: a new inode each time)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"job": job, "attempt": attempt, "ranks": list(ranks)}))
    tmp.replace(path)


def test_launched_ranks_are_sampled_before_they_report_and_stacks_wait_for_a_heartbeat(
    tmp_path: Path,
) -> None:
    """A rank the launcher noted is watched from its launch: its process state is sampled
    although it never sent a heartbeat (a recorder that never reached the agent), so a stopped
    one shows; its stack is not captured until it reports; ranks of other nodes and jobs are
    not watched; a heartbeat of the same pid takes over the watch."""
    path = tmp_path / "attempt-0.json"
    rig = Rig(stack_after_s=2, stack_min_gap_s=5, job=JOB, node=NODE,
              launch_file=path)
    assert rig.at(0) == [] and rig.samples() == []  # no file yet: nothing, no error
    launches(path, {"rank": 0, "pid": 100, "node": NODE, "start": 7},
             {"rank": 1, "pid": 101, "node": "node-1", "start": 7})
    assert read_launch_file(path, job="another-job", node=NODE) == (0, [])
    rig.reader.readings[100] = ProcReading(state="T", cpu_s=1.0, start_ticks=7)
    assert rig.at(1) == []
    assert rig.watcher.watched() == [((JOB, 0, Rank(0)), 100)]
    assert rig.at(30) == []  # silent for 30 s, but never heard: no stack
    assert [(s.rank, s.pid, s.state, s.node) for s in rig.samples()] == [
        (0, 100, "T", NODE), (0, 100, "T", NODE)]
    rig.reader.readings[100] = sleeping(1.0)
    rig.at(31, beat(pid=100, time_us=T0 + 31 * S))
    assert rig.watcher.watched() == [((JOB, 0, Rank(0)), 100)]
    assert rig.at(34) == [100]  # it reports now: silent 3 s, captured


def test_a_launched_pid_that_started_at_another_time_is_gone_not_watched(tmp_path: Path) -> None:
    path = tmp_path / "attempt-1.json"
    rig = Rig(stack_after_s=0, job=JOB, node=NODE, launch_file=path)
    rig.at(0, beat(pid=100, time_us=T0))
    launches(path, {"rank": 0, "pid": 101, "node": NODE, "start": 99}, attempt=1)
    rig.at(1)  # pid 101 runs a process started at tick 7: the rank's process is not there
    assert rig.watcher.watched() == []
    assert [(s.attempt, s.pid, s.state) for s in rig.samples()] == [
        (0, 100, "S"), (1, 101, "gone")]


@pytest.mark.parametrize(("content", "expected"), [
    ("not json", "not JSON"),
    ("[1, 2]", "expected a JSON object with job, attempt and ranks"),
    (json.dumps({"job": JOB, "attempt": -1, "ranks": []}), "attempt must be an integer >= 0"),
    (json.dumps({"job": JOB, "attempt": 0, "ranks": {}}), "ranks must be a list"),
    (json.dumps({"job": JOB, "attempt": 0, "ranks": [{"node": NODE, "rank": "0", "pid": 5}]}),
     "ranks[0].rank must be an integer >= 0, got '0'"),
    (json.dumps({"job": JOB, "attempt": 0, "ranks": [{"node": NODE, "rank": 0, "pid": 5,
                                                      "start": 1.5}]}),
     "ranks[0].start must be an integer or null"),
])
def test_a_bad_launch_file_is_named_logged_once_and_watched_ranks_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: str, expected: str,
) -> None:
    path = tmp_path / "attempt-0.json"
    with pytest.raises(ValueError, match=re.escape(expected)) as caught:
        path.write_text(content)
        read_launch_file(path, job=JOB, node=NODE)
    assert str(path) in str(caught.value)
    rig = Rig(stack_after_s=0, job=JOB, node=NODE, launch_file=path)
    with caplog.at_level(logging.WARNING):
        rig.at(0, beat(pid=100, time_us=T0))
        rig.at(1)
    warned = [r.getMessage() for r in caplog.records if "launch file" in r.getMessage()]
    assert len(warned) == 1 and expected in warned[0], warned
    assert rig.watcher.watched() == [((JOB, 0, Rank(0)), 100)]


def test_capture_failures_are_counted_retried_gapped_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rig = Rig(stack_after_s=2, stack_repeat_s=30, stack_min_gap_s=5)
    rig.capturer.error = "ptrace not permitted"
    with caplog.at_level(logging.DEBUG, logger="tracehound.agent.node.procwatch"):
        rig.at(0, beat(pid=100, time_us=T0), beat(pid=101, rank=1, time_us=T0))
        assert rig.at(2) == [100, 101]
        assert rig.at(3) == []
        # tried again every stack_after_s, CAPTURE_RETRIES times in a row ...
        assert [rig.at(s) for s in (4, 5, 6, 7, 8)] == [[100, 101], [], [100, 101], [],
                                                        [100, 101]]
        assert CAPTURE_RETRIES == 3
        # ... then no more often than a capture that worked: the episode's repeat
        assert [rig.at(s) for s in (10, 20, 37.9)] == [[], [], []]
        assert rig.at(38) == [100, 101]
    assert rig.watcher.stats.stacks_failed == 10 and rig.watcher.stats.stacks_captured == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "ptrace not permitted" in warnings[0]
    assert "job=job-pw node=node-0 rank=0" in warnings[0]
    assert rig.stacks() == []


def test_a_capture_that_failed_once_is_tried_again_soon() -> None:
    """py-spy reads a rank's memory without stopping it, and once in a while catches it mid-
    change and fails (a CI run: a rank writing a 12 s checkpoint). Its stack is what a stall
    incident tells, so the capture is tried again after stack_after_s, not a repeat later."""
    rig = Rig(stack_after_s=2, stack_repeat_s=30, stack_min_gap_s=5)
    done = (progress(enq=3, comp=3, enq_us=T0 - S, comp_us=T0),)

    def at(seconds: float) -> list[int]:
        return rig.at(seconds, beat(pid=100, time_us=T0 + round(seconds * S), groups=done))

    rig.capturer.error = "Failed to get stack traces"
    assert at(2) == [100]
    rig.capturer.error = ""
    assert at(3) == [] and at(4) == [100]
    assert [s.time_us for s in rig.stacks()] == [T0 + 4 * S]
    # the one that worked ends the retries: the same episode waits for its repeat
    assert [at(s) for s in (6, 8, 33.9)] == [[], [], []]
    assert at(34) == [100]


def test_switches_and_validation() -> None:
    no_samples = Rig(proc_interval_s=0, stack_after_s=2)
    no_samples.at(0, beat(pid=100, time_us=T0))
    assert no_samples.at(2) == [100]
    assert no_samples.samples() == [] and no_samples.watcher.stats.process_samples == 0
    no_stacks = Rig(stack_after_s=0)
    no_stacks.at(0, beat(pid=100, time_us=T0))
    assert no_stacks.at(100) == [] and len(no_stacks.samples()) == 2
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="stack_after_s"):
            ProcWatcher(emit=print, stack_after_s=bad)
    off = ProcWatcher(emit=print, proc_interval_s=0, stack_after_s=0)
    off.start()
    assert off.stop()


def test_emit_failure_is_logged_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    def full_disk(records: object) -> None:
        raise OSError(28, "No space left on device")

    rig = Rig(stack_after_s=2)
    rig.watcher.emit = full_disk
    with caplog.at_level(logging.WARNING, logger="tracehound.agent.node.procwatch"):
        rig.at(0, beat(pid=100, time_us=T0))
        rig.at(2)
    assert rig.watcher.stats.process_samples == 0 and rig.watcher.stats.stacks_captured == 0
    assert any("No space left" in r.getMessage() for r in caplog.records)


# -- through a real node agent ----------------------------------------------------------------


class GatedSink:
    """Refuses (temporarily) until opened; then keeps what it is sent."""

    def __init__(self) -> None:
        self.open = False
        self.stored: dict[str, Batch] = {}

    def send(self, batch: Batch, *, maybe_duplicate: bool) -> None:
        if not self.open:
            raise TemporaryStoreError("closed", retry_after=0.0)
        self.stored[batch.batch_id] = batch

    def records(self) -> list[Record]:
        return [r for b in self.stored.values() for r in b.records]


def send_lines(socket_path: str, *records: Record) -> None:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(socket_path)
        conn.sendall(b"".join(json.dumps(wire.encode(r)).encode() + b"\n" for r in records))


def stuck_beat(pid: int) -> Heartbeat:
    now = now_us()
    pending = progress(enq=3, comp=2, pending="all_reduce", enq_us=now - 10 * S,
                       comp_us=now - 11 * S)
    return beat(pid=pid, time_us=now, groups=(pending,))


def spool_lines(directory: Path) -> list[bytes]:
    return [line for path in sorted(directory.glob("seg-*"))
            for line in path.read_bytes().splitlines() if line.strip()]


def test_node_agent_spools_process_and_stack_samples(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    child = spawn(SLEEPER, name="sleeper.py")
    assert asleep(child.pid)
    socket_path = str(tmp_path / "agent.sock")
    sp = Spool(tmp_path / "spool", node=NODE, seal_interval_s=0.05)
    watcher = ProcWatcher(emit=spool_writer(sp), proc_interval_s=0.1, stack_after_s=1.0,
                          job=JOB, node=NODE)
    sink = GatedSink()
    agent = NodeAgent(job=JOB, node=NODE, socket_path=socket_path, spool=sp, sink=sink,
                      stats_file=str(tmp_path / "stats.json"), stats_interval_s=0.2,
                      watcher=watcher)
    agent.shipper.min_backoff_s = agent.shipper.max_backoff_s = 0.05
    agent.start()
    try:
        send_lines(socket_path, stuck_beat(child.pid))
        assert poll(lambda: agent.stats()["stacks_captured"] >= 1
                    and agent.stats()["process_samples"] >= 2)
        # Everything is still in the spool (the sink refuses): read it as the shipper would.
        lines = spool_lines(tmp_path / "spool")
        records = [wire.decode(json.loads(line)) for line in lines]
        samples = [r for r in records if isinstance(r, ProcessSample)]
        stacks = [r for r in records if isinstance(r, StackSample)]
        assert samples and stacks
        assert all(s.pid == child.pid and s.rank == 0 and s.state == "S" for s in samples)
        assert stacks[0].frames[-1].endswith(" snooze_in_named_function")
        for record in (samples[0], stacks[0]):
            own = json.dumps(wire.encode(record), separators=(",", ":")).encode()
            assert own in lines, "the agent's own records are spooled as compact wire lines"
        sink.open = True
    finally:
        assert agent.stop(drain_s=10.0)
    assert not any(t.name == "tracehound-node-procwatch" for t in threading.enumerate())
    shipped = sink.records()
    assert any(isinstance(r, ProcessSample) for r in shipped)
    assert any(isinstance(r, StackSample) for r in shipped)
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["received"] == 1, "records the watcher makes are not counted as received"
    assert stats["process_samples"] >= 2 and stats["stacks_captured"] >= 1
    assert stats["stacks_failed"] == 0
    assert stats["spooled"] == 1 + stats["process_samples"] + stats["stacks_captured"]


def test_cli_flags_and_defaults() -> None:
    base = ["--job", "j", "--node", "n", "--socket", "s", "--spool", "d", "--sink", "http://x"]
    args = parse_args(base)
    assert (args.proc_interval, args.stack_after, args.stack_repeat, args.py_spy) == (
        1.0, 2.0, 30.0, None)
    args = parse_args([*base, "--proc-interval", "0", "--stack-after", "0.5",
                       "--stack-repeat", "10", "--py-spy", "/opt/py-spy"])
    assert (args.proc_interval, args.stack_after, args.stack_repeat, args.py_spy) == (
        0.0, 0.5, 10.0, "/opt/py-spy")
    with pytest.raises(SystemExit):
        parse_args([*base, "--stack-after", "-1"])


@pytest.mark.e2e
def test_agent_process_watches_ranks_and_stops_on_sigterm(
    tmp_path: Path, spawn: Callable[..., subprocess.Popen[bytes]],
) -> None:
    child = spawn(SLEEPER, name="sleeper.py")
    assert asleep(child.pid)
    socket_path = tmp_path / "agent.sock"
    stats_file = tmp_path / "stats.json"
    with CollectingIngest() as ingest:
        agent = subprocess.Popen(
            [sys.executable, "-m", "tracehound.agent.node", "--job", JOB, "--node", NODE,
             "--socket", str(socket_path), "--spool", str(tmp_path / "spool"),
             "--sink", ingest.url, "--stats-file", str(stats_file),
             "--proc-interval", "0.2", "--stack-after", "1", "--stack-repeat", "30"],
        )
        try:
            assert poll(socket_path.exists)
            send_lines(str(socket_path), stuck_beat(child.pid))

            def captured() -> bool:
                try:
                    stats = json.loads(stats_file.read_text())
                except (OSError, ValueError):
                    return False
                return bool(stats["stacks_captured"] >= 1 and stats["process_samples"] >= 2)

            assert poll(captured)
        finally:
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=60) == 0
        samples = ingest.received.of(ProcessSample)
        stacks = ingest.received.of(StackSample)
    assert samples and all(s.pid == child.pid for s in samples)
    assert stacks and stacks[0].frames[-1].endswith(" snooze_in_named_function")
