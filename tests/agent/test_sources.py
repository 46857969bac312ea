"""The node agent's source poller: each source on its own interval, a failing source counted and
logged once per kind of error, refused records counted; time is injected."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tracehound.agent.sources import SourcePoller
from tracehound.tracing.events import HealthSample, HealthSeverity, Record


@dataclass
class Counting:
    name: str
    interval_s: float
    fail_with: Exception | None = None
    polled_at: list[int] = field(default_factory=list)
    closed: bool = False

    def poll(self, now_us: int) -> Sequence[Record]:
        self.polled_at.append(now_us)
        if self.fail_with is not None:
            raise self.fail_with
        return [HealthSample(job="j", node="n", device="host", time_us=now_us, source=self.name,
                             metric="load1", value=1.0, severity=HealthSeverity.INFO)]

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_each_source_on_its_interval() -> None:
    clock = Clock()
    fast, slow = Counting("fast", 1.0), Counting("slow", 5.0)
    got: list[Record] = []
    poller = SourcePoller([fast, slow], got.extend, clock=clock,
                          wall_us=lambda: int(clock.t * 1e6))
    for _ in range(11):  # t = 100 .. 110
        wait = poller.tick()
        assert 0 <= wait <= 1.0
        clock.t += 1.0
    assert len(fast.polled_at) == 11 and len(slow.polled_at) == 3  # 100, 105, 110
    assert len(got) == 14
    assert poller.flat_stats() == {"source_polls": 14, "source_records": 14,
                                   "source_errors": 0, "source_emit_failed": 0}
    assert poller.stop() and fast.closed and slow.closed


def test_a_failing_source_is_counted_logged_once_and_polled_again(
        caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    broken = Counting("nccl_ras", 1.0, fail_with=ConnectionRefusedError(111, "refused"))
    good = Counting("host", 1.0)
    got: list[Record] = []
    poller = SourcePoller([broken, good], got.extend, job="j", node="n", clock=clock)
    with caplog.at_level(logging.WARNING, logger="tracehound.agent.sources"):
        for _ in range(5):
            poller.tick()
            clock.t += 1.0
    assert len(broken.polled_at) == 5 and len(got) == 5
    assert poller.stats.errors == {"nccl_ras": 5}
    warnings = [r for r in caplog.records if "nccl_ras" in r.getMessage()]
    assert len(warnings) == 1 and "ConnectionRefusedError" in warnings[0].getMessage()


def test_records_the_spool_refuses_are_counted() -> None:
    clock = Clock()

    def refuse(records: Sequence[Record]) -> None:
        raise OSError("disk full")

    poller = SourcePoller([Counting("gpu", 1.0)], refuse, clock=clock)
    poller.tick()
    clock.t += 1
    poller.tick()
    assert poller.stats.emit_failed == 2 and poller.flat_stats()["source_records"] == 0


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="source 'gpu': interval_s must be > 0, got 0"):
        SourcePoller([Counting("gpu", 0.0)], lambda records: None)


def test_the_thread_polls_and_stops() -> None:
    src = Counting("host", 0.01)
    got: list[Record] = []
    poller = SourcePoller([src], got.extend)
    poller.start()
    while len(got) < 3:
        time.sleep(0.01)
    assert poller.stop(timeout_s=5.0) and src.closed


def test_the_agent_options_choose_the_sources(tmp_path: Path) -> None:
    from tracehound.agent.node.daemon import health_sources, parse_args

    base = ["--job", "j", "--node", "n", "--sink", "http://127.0.0.1:9",
            "--spool", str(tmp_path / "spool")]
    env: dict[str, str] = {}
    names = [s.name for s in health_sources(parse_args([*base, "--gpu", "sim"], env))]
    assert names == ["gpu", "host"]  # no NVML here: RAS stays off in auto
    args = parse_args([*base, "--gpu", "off", "--nccl-ras", "on",
                       "--nccl-inspector-dir", str(tmp_path)], env)
    assert [s.name for s in health_sources(args)] == ["host", "nccl_ras", "nccl_inspector"]
    args = parse_args([*base, "--health-interval", "0"],
                      {"TRACEHOUND_NCCL_INSPECTOR_DIR": str(tmp_path)})
    assert [s.name for s in health_sources(args)] == ["nccl_inspector"]
    assert parse_args(base, {"TRACEHOUND_CHECKPOINT_DIR": "/ckpt"}).disk_path == [
        str(tmp_path / "spool"), "/ckpt"]
    with pytest.raises(SystemExit):
        parse_args(base, {"TRACEHOUND_NCCL_RAS": "sometimes"})
