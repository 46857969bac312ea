"""Heartbeats while a call is in flight: every 100 ms once a call has been pending for
TRACEHOUND_INFLIGHT_S, at the normal interval otherwise. The rule is checked with an injected
clock; the rate with a real 2-rank gloo job whose rank 0 waits ~3 s in an all_reduce."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from coverage_harness import assert_same_calls, run_scenario

from tracehound.agent.rank import autoinstall
from tracehound.agent.rank.recorder import Pending, Recorder
from tracehound.tracing.events import Heartbeat
from tracehound.tracing.settings import SettingError


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        return self.now


class Sink:
    def offer(self, item: Pending) -> bool:
        return True

    def flush(self, timeout: float) -> bool:
        return True


def recorder(clock: Clock) -> Recorder:
    return Recorder(job="j", attempt=0, node="n", rank=0, sink=Sink(), clock=clock,
                    heartbeat_s=0.5, inflight_s=1.0, pid=1)


def test_interval_is_fast_only_while_a_call_is_pending_past_the_threshold() -> None:
    clock = Clock()
    rec = recorder(clock)
    assert rec.heartbeat_interval_s(clock.now) == 0.5  # nothing pending
    old = rec.begin("0", "all_reduce", 4, "float32")
    clock.now += 600_000
    newer = rec.begin("1", "broadcast", 4, "float32")
    assert rec.pending_since() == 1_000_000
    assert rec.heartbeat_interval_s(clock.now) == 0.5  # pending 0.6 s: not yet
    clock.now += 400_000
    assert rec.heartbeat_interval_s(clock.now) == 0.1  # the oldest call: pending 1.0 s
    rec.end(old, True)
    assert rec.pending_since() == 1_600_000
    assert rec.heartbeat_interval_s(clock.now) == 0.5  # the newer one: 0.4 s
    clock.now += 600_000
    assert rec.heartbeat_interval_s(clock.now) == 0.1
    rec.end(newer, True)
    assert rec.pending_since() == 0
    assert rec.heartbeat_interval_s(clock.now) == 0.5


def test_a_call_left_behind_by_a_completed_later_one_is_not_pending() -> None:
    """A work dropped unwaited never ends; once a later call of its group completed, the
    group is not stuck on it (the oldest-call rule of the heartbeats)."""
    clock = Clock()
    rec = recorder(clock)
    rec.begin("0", "all_reduce", 4, "float32")
    rec.end(rec.begin("0", "all_reduce", 4, "float32"), True)
    clock.now += 5_000_000
    assert rec.pending_since() == 0
    assert rec.heartbeat_interval_s(clock.now) == 0.5


def test_fast_interval_never_exceeds_the_normal_one() -> None:
    clock = Clock()
    rec = Recorder(job="j", attempt=0, node="n", rank=0, sink=Sink(), clock=clock,
                   heartbeat_s=0.05, inflight_s=0.0, pid=1)
    rec.begin("0", "barrier", 0, "")
    assert rec.heartbeat_interval_s(clock.now) == 0.05


def test_bad_inflight_setting_names_the_variable() -> None:
    with pytest.raises(SettingError, match="TRACEHOUND_INFLIGHT_S='soon'"):
        autoinstall._inflight_s({"TRACEHOUND_INFLIGHT_S": "soon"})
    with pytest.raises(SettingError, match="TRACEHOUND_INFLIGHT_S='-1'"):
        autoinstall._inflight_s({"TRACEHOUND_INFLIGHT_S": "-1"})
    assert autoinstall._inflight_s({}) == 1.0
    assert autoinstall._inflight_s({"TRACEHOUND_INFLIGHT_S": "0.25"}) == 0.25


def test_bad_send_setting_names_the_variable() -> None:
    for bad in ("soon", "0", "-1", "nan", "inf"):
        with pytest.raises(SettingError, match=f"TRACEHOUND_SEND_S='{bad}'"):
            autoinstall._send_s({"TRACEHOUND_SEND_S": bad})
    assert autoinstall._send_s({}) == 0.2
    assert autoinstall._send_s({"TRACEHOUND_SEND_S": "0.05"}) == 0.05


class NudgedSink(Sink):
    """Counts the heartbeats offered and the nudges after them."""

    def __init__(self) -> None:
        self.beats = 0
        self.nudged = 0
        self.lock = threading.Lock()

    def offer(self, item: Pending) -> bool:
        if isinstance(item, Heartbeat):
            with self.lock:
                self.beats += 1
        return True

    def nudge(self) -> None:
        with self.lock:
            self.nudged += 1


def wait_for(condition: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 30
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_heartbeats_of_a_call_long_in_flight_are_sent_at_once() -> None:
    """The heartbeat thread nudges its sink (a SocketTransport sends then rather than at its
    next TRACEHOUND_SEND_S tick) after each fast heartbeat, and after no other."""
    sink = NudgedSink()
    rec = Recorder(job="j", attempt=0, node="n", rank=0, sink=sink, heartbeat_s=0.2,
                   inflight_s=0.0, pid=1)
    rec.start()
    try:
        assert wait_for(lambda: sink.beats >= 3)
        assert sink.nudged == 0  # nothing in flight: beats at the normal interval, not nudged
        token = rec.begin("0", "all_reduce", 4, "float32")
        assert wait_for(lambda: sink.nudged >= 3)
        rec.end(token, True)
        with sink.lock:
            nudged, beats = sink.nudged, sink.beats
        assert wait_for(lambda: sink.beats >= beats + 3)
        assert sink.nudged <= nudged + 1  # at most the beat that was on its way
    finally:
        rec.close(timeout=1.0)


@pytest.mark.e2e
def test_heartbeats_every_100_ms_while_a_call_hangs(tmp_path: Path) -> None:
    run = run_scenario("inflight", 2, tmp_path, heartbeat_s=1.0,
                       env={"TRACEHOUND_INFLIGHT_S": "0.5"})
    assert [op for _, op in assert_same_calls(run)["0"]] == ["barrier", "all_reduce", "barrier"]
    wait = next(e for e in run.events if (e.rank, e.seq) == (0, 2))
    beats = sorted((b for b in run.beats if b.rank == 0), key=lambda b: b.time_us)

    def pending(b: Heartbeat) -> str:
        return next((g.pending_op for g in b.groups if g.group == "0"), "")

    # while rank 0 waited in the all_reduce for more than 0.5 s: the pending op, every ~100 ms
    stuck = [b for b in beats
             if wait.enqueue_us + 600_000 <= b.time_us < wait.complete_us - 100_000]
    assert len(stuck) >= 8, [b.time_us for b in beats]
    assert all(pending(b) == "all_reduce" for b in stuck)
    gaps = [b.time_us - a.time_us for a, b in itertools.pairwise(stuck)]
    assert statistics.median(gaps) < 500_000
    # afterwards, idle with nothing pending: back to the 1 s interval
    idle_end = run.fact(0, "idle_end_us")["t"]
    idle = [b for b in beats if wait.complete_us + 200_000 <= b.time_us < idle_end]
    assert idle and all(pending(b) == "" for b in idle)
    assert len(idle) <= 4, [b.time_us for b in idle]
    if len(idle) >= 2:
        idle_gaps = [b.time_us - a.time_us for a, b in itertools.pairwise(idle)]
        assert min(idle_gaps) >= 500_000
