"""How often a counted DDP group records its steps (`hooks.ddp._DdpCount`, TRACEHOUND_DDP_SPAN_S):
the counting driven step by step on a clock of the test's, as the forward and step hooks of a
training process drive it."""

from __future__ import annotations

from typing import Any

import pytest

from tracehound.agent.rank import autoinstall
from tracehound.agent.rank.hooks.ddp import _DdpCount
from tracehound.tracing.settings import SettingError


class Rank:
    """One rank's counting: its clock, c10d's counter, the steps it recorded."""

    def __init__(self, span_s: float) -> None:
        self.clock_us = 1_000_000
        self.ops = 0
        self.spans: list[tuple[int, int]] = []
        self.count = _DdpCount(self, "0:ddp", lambda: self.ops, span_s)  # type: ignore[arg-type]

    # the Recorder methods _DdpCount calls
    def now_us(self) -> int:
        return self.clock_us

    def counted(self, *_: Any) -> None:
        pass

    def record_span(self, group: str, seq: int, op: str, since_us: int) -> None:
        assert (group, op) == ("0:ddp", "ddp_comm")
        self.spans.append((seq, since_us))

    def step(self, step_us: int, ops: int) -> None:
        """A training step of `step_us` whose backward issues `ops` ops."""
        self.count.started()
        self.clock_us += step_us // 2
        self.count.forwarded()
        self.ops += ops
        self.clock_us += step_us - step_us // 2
        self.count.done()

    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.spans]


def test_with_no_span_every_step_is_recorded() -> None:
    rank = Rank(0.0)
    for _ in range(200):
        rank.step(2_000, 3)
    assert rank.seqs() == list(range(3, 601, 3))


def test_fast_steps_are_recorded_about_one_a_span_at_seqs_crossing_a_power_of_two() -> None:
    rank = Rank(0.05)
    for _ in range(1000):
        rank.step(5_000, 3)  # 30 ops in 50 ms: a step recorded when its seq crosses a 32
    seqs = rank.seqs()
    assert seqs[:2] == [3, 6]  # the pace is not known before two recorded steps
    settled = seqs[2:]
    assert all(seq // 32 > (seq - 3) // 32 for seq in settled), settled
    assert len(settled) == pytest.approx(3000 / 32, abs=2)
    gaps = [b - a for (_, a), (_, b) in zip(rank.spans[2:], rank.spans[3:], strict=False)]
    assert min(gaps) >= 50_000 and max(gaps) <= 55_000, gaps


def test_slow_steps_are_each_recorded() -> None:
    rank = Rank(0.05)
    for _ in range(50):
        rank.step(200_000, 3)
    assert rank.seqs() == list(range(3, 151, 3))


def test_ranks_that_judge_the_pace_apart_record_the_steps_of_the_coarser_one() -> None:
    """One rank a little slower than the other, its pace just past a power of two: the ranks'
    powers differ, every step the coarser records the finer does too, and no step goes
    unrecorded on both for longer than the coarser's span."""
    fast, slow = Rank(0.05), Rank(0.05)
    for _ in range(2000):
        fast.step(1_560, 1)  # 32.05 ops a span: 64
        slow.step(1_570, 1)  # 31.8: 32
    assert fast.count.shift == 6 and slow.count.shift == 5
    both = set(fast.seqs()) & set(slow.seqs())
    assert set(fast.seqs()[2:]) <= set(slow.seqs())
    assert max(b - a for a, b in zip(sorted(both), sorted(both)[1:], strict=False)) == 64


def test_after_a_pause_or_a_slowdown_steps_are_recorded_again_within_a_few_spans() -> None:
    rank = Rank(0.05)
    for _ in range(300):
        rank.step(1_000, 1)
    assert rank.count.shift == 6  # 50 ops a span: one step in 64
    before = len(rank.spans)
    rank.clock_us += 30_000_000  # a checkpoint write between two steps
    for _ in range(5):
        rank.step(1_000, 1)
    # the first step after the pause is recorded (the next multiple of 64 is 19 steps on),
    # and the pace is taken again from there
    assert rank.seqs()[before:] == [301, 302], rank.spans[before:]
    for _ in range(300):
        rank.step(1_000, 1)
    assert rank.count.shift == 6
    # the steps slow down 40 times (a straggler): once two spans passed since the last record,
    # the pace is taken again at every step, so a step is recorded again within four spans;
    # then one in two (the least power of two of steps that fill a span)
    last = rank.spans[-1][1]
    for _ in range(100):
        rank.step(40_000, 1)
    slow = [t for _, t in rank.spans if t > last]
    gaps = [b - a for a, b in zip([last, *slow], slow, strict=False)]
    assert gaps and max(gaps) <= 200_000 and gaps[-5:] == [80_000] * 5, gaps
    assert rank.count.shift == 1


def test_a_bad_span_is_refused_naming_the_variable() -> None:
    for bad in ("-0.1", "often"):
        with pytest.raises(SettingError, match="TRACEHOUND_DDP_SPAN_S"):
            autoinstall._ddp_span_s({"TRACEHOUND_DDP_SPAN_S": bad})
    assert autoinstall._ddp_span_s({}) == 0.05
    assert autoinstall._ddp_span_s({"TRACEHOUND_DDP_SPAN_S": "0"}) == 0.0
