"""A counted DDP group's heartbeat count (`hooks.ddp._DdpCount.seen`, on the heartbeat thread) never
takes in the op of a call the wrappers recorded (a Python comm hook's `dist.all_reduce`): such a
call's op is the user's, not DDP's, and a count once reported never goes back. And it ends at
the group's last op: destroying the group counts what the heartbeat thread had not seen yet.

The heartbeat thread reads c10d's counter, then the ops recorded calls issued (`outside`), then
checks that no recorded call was in progress. The training thread may run a whole call between
those reads: begin it, issue its op (the counter moves) and end it before the check. These tests
play that interleaving in one thread, at the points where the interpreter may switch threads
(inside the counter's read, and between the count and the check)."""

from __future__ import annotations

from typing import Any

from tracehound.agent.rank.hooks.ddp import _DdpCount


class Recorder:
    """What _DdpCount calls of the recorder; keeps the counts it was told."""

    def __init__(self) -> None:
        self.reported: list[int] = []
        self.completed: list[int] = []

    def counted(self, _name: str, _op: str, entered: int, completed: int = -1) -> None:
        self.reported.append(entered)
        self.completed.append(completed)

    def now_us(self) -> int:
        return 0


class Counter:
    """c10d's op counter; `during_read` runs while it is read, as another thread would."""

    def __init__(self) -> None:
        self.value = 0
        self.during_read: Any = None

    def __call__(self) -> int:
        action, self.during_read = self.during_read, None
        if action is not None:
            action()
        return self.value


class Interleaved(_DdpCount):
    """`after_ops` runs once the count was taken, before `seen` checks for calls in progress."""

    __slots__ = ("after_ops",)

    def ops(self) -> int:
        n = super().ops()
        action, self.after_ops = getattr(self, "after_ops", None), None
        if action is not None:
            action()
        return n


def a_count() -> tuple[Interleaved, Counter, Recorder]:
    counter, recorder = Counter(), Recorder()
    return Interleaved(recorder, "0:ddp", counter), counter, recorder  # type: ignore[arg-type]


def test_a_recorded_call_run_whole_while_the_count_is_taken_is_not_counted() -> None:
    count, counter, recorder = a_count()
    counter.value = 5  # DDP's own ops
    count.seen()
    assert recorder.reported == [5]
    calls: list[int] = []

    def hook_call_begins_and_issues() -> None:  # the training thread, mid-read
        calls.append(count.enter())
        counter.value += 1  # the hook's all_reduce is issued: the counter moves

    counter.during_read = hook_call_begins_and_issues
    count.after_ops = lambda: count.around(calls[0])  # the call ends before the check
    count.seen()
    assert recorder.reported == [5]  # not 6: that op was the hook's
    count.seen()  # the next look, with nothing in progress
    assert recorder.reported == [5, 5]
    counter.value += 2  # DDP issues two more
    count.seen()
    assert recorder.reported == [5, 5, 7]


def test_nothing_is_reported_while_a_recorded_call_is_in_progress() -> None:
    count, counter, recorder = a_count()
    before = count.enter()
    counter.value += 1
    count.seen()
    count.started()
    count.done()
    assert recorder.reported == []
    count.around(before)
    count.seen()
    assert recorder.reported == [0]


def test_the_last_ops_are_counted_when_the_group_is_destroyed() -> None:
    """The heartbeat thread may not have looked since the last ops: destroying the group counts
    them, as completed (the group is gone, nothing of it pending), and stops reading the
    counter."""
    count, counter, recorder = a_count()
    counter.value = 5
    count.seen()
    counter.value = 8  # the last step's buckets, not looked at yet
    count.detach()
    assert (recorder.reported, recorder.completed) == ([5, 8], [-1, 8])
    counter.value = 20  # whatever the counter does afterwards is not read
    count.seen()
    assert recorder.reported == [5, 8]
