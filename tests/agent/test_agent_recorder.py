"""The recorder and the collective wrappers, with an injected clock and a fake sink.

The wrappers are exercised on stand-in functions with torch's signatures (no process group is
created in the test process, and torch.distributed itself is never patched here)."""

from __future__ import annotations

import gc
import time
import types
from typing import Any

import pytest
import torch

from tracehound.agent.rank import hooks
from tracehound.agent.rank.recorder import Pending, Recorder, materialize
from tracehound.tracing.events import (
    CollectiveEvent,
    CollectiveState,
    Heartbeat,
    ProcessGroupInfo,
    Record,
)


class FakeClock:
    def __init__(self, start: int = 1_000_000) -> None:
        self.now = start

    def __call__(self) -> int:
        return self.now

    def tick(self, us: int) -> None:
        self.now += us


class FakeSink:
    """Keeps what it is offered, up to `bound` items."""

    def __init__(self, bound: int = 1000) -> None:
        self.items: list[Pending] = []
        self.bound = bound
        self.flushed: list[float] = []

    def offer(self, item: Pending) -> bool:
        if len(self.items) >= self.bound:
            return False
        self.items.append(item)
        return True

    def flush(self, timeout: float) -> bool:
        self.flushed.append(timeout)
        return True

    def records(self) -> list[Record]:
        return [materialize(i) for i in self.items]

    def of(self, kind: type) -> list[Any]:
        return [r for r in self.records() if isinstance(r, kind)]


def make(sink: FakeSink | None = None, clock: FakeClock | None = None) -> Recorder:
    return Recorder(
        job="job", attempt=2, node="node-a", rank=3, sink=sink or FakeSink(),
        clock=clock or FakeClock(), heartbeat_s=0.5, pid=4242,
    )


def test_sequence_ids_count_per_group_and_events_carry_times() -> None:
    sink, clock = FakeSink(), FakeClock()
    rec = make(sink, clock)
    for group in ["0", "1", "0", "0", "1"]:
        token = rec.begin(group, "all_reduce", 64, "float32")
        clock.tick(10)
        rec.end(token, True)
        clock.tick(5)
    events = sink.of(CollectiveEvent)
    assert [(e.group, e.seq) for e in events] == [("0", 1), ("1", 1), ("0", 2), ("0", 3), ("1", 2)]
    first = events[0]
    assert first == CollectiveEvent(
        job="job", attempt=2, node="node-a", rank=3, group="0", seq=1, op="all_reduce",
        nbytes=64, dtype="float32", peer=-1, state=CollectiveState.COMPLETED,
        enqueue_us=1_000_000, complete_us=1_000_010,
    )


def test_heartbeat_reports_pending_op_steps_and_drops() -> None:
    sink, clock = FakeSink(), FakeClock()
    rec = make(sink, clock)
    done = rec.begin("0", "broadcast", 4, "int64")
    clock.tick(100)
    rec.end(done, True)
    clock.tick(100)
    rec.begin("0", "all_reduce", 8, "float32")  # still in flight
    optimizer = object()
    rec.resume_from(40)
    clock.tick(1000)
    rec.optimizer_stepped(optimizer)
    first_step_at = clock.now
    clock.tick(1000)
    rec.optimizer_stepped(optimizer)
    rec.optimizer_stepped(object())  # a second optimizer does not count twice
    clock.tick(7)
    rec.heartbeat()
    beat = sink.of(Heartbeat)[-1]
    assert (beat.step, beat.start_step, beat.first_step_us, beat.step_us) == (
        42, 40, first_step_at, first_step_at + 1000
    )
    assert (beat.time_us, beat.pid, beat.dropped, beat.rank) == (clock.now, 4242, 0, 3)
    (progress,) = beat.groups
    assert (progress.group, progress.last_enqueued, progress.last_completed) == ("0", 2, 1)
    assert progress.pending_op == "all_reduce"
    assert progress.last_complete_us == 1_000_100
    assert progress.last_enqueue_us == 1_000_200


def test_set_step_and_paused_steps() -> None:
    sink = FakeSink()
    rec = make(sink)
    opt = object()
    rec.optimizer_stepped(opt)
    rec.set_step(10)
    rec.optimizer_stepped(opt)
    rec.pause_steps(True)
    rec.optimizer_stepped(opt)
    rec.pause_steps(False)
    assert rec.step == 11


def test_full_buffer_drops_and_counts() -> None:
    sink = FakeSink(bound=3)
    rec = make(sink)
    for _ in range(5):
        rec.end(rec.begin("0", "barrier", 0, ""), True)
    assert len(sink.items) == 3
    assert rec.dropped == 2
    sink.bound = 10
    rec.heartbeat()
    assert sink.of(Heartbeat)[-1].dropped == 2


def test_group_created_record() -> None:
    sink, clock = FakeSink(), FakeClock()
    rec = make(sink, clock)
    rec.group_created("5", (0, 2), "gloo")
    assert sink.of(ProcessGroupInfo) == [ProcessGroupInfo(
        job="job", attempt=2, rank=3, group="5", ranks=(0, 2), backend="gloo", time_us=clock.now,
    )]


def test_close_sends_final_heartbeat_and_flushes_bounded() -> None:
    sink = FakeSink()
    rec = make(sink)
    rec.close(timeout=1.5)
    assert isinstance(sink.records()[-1], Heartbeat)
    assert sink.flushed == [1.5]


class BrokenSink(FakeSink):
    def offer(self, item: Pending) -> bool:
        raise RuntimeError("sink is broken")


def test_sink_errors_are_swallowed_and_counted() -> None:
    rec = make(BrokenSink())
    rec.end(rec.begin("0", "all_reduce", 4, "float32"), True)
    rec.heartbeat()
    assert rec.errors == 2


def test_polled_work_completes_from_poll() -> None:
    sink = FakeSink()
    rec = make(sink)

    class Work:
        done = False

        def is_completed(self) -> bool:
            return self.done

        def exception(self) -> None:
            return None

    work = Work()
    rec.poll_later(work, rec.begin("0:p2p:0-3", "isend", 4, "float32", 0))
    rec.poll()
    assert sink.of(CollectiveEvent) == []
    work.done = True
    rec.poll()
    (event,) = sink.of(CollectiveEvent)
    assert (event.op, event.peer, event.seq) == ("isend", 0, 1)


# -- the wrappers --------------------------------------------------------------------------------


class FakeGroup:
    def __init__(self, name: str) -> None:
        self.group_name = name


NON_MEMBER = object()
WORLD = FakeGroup("0")


def fake_dist() -> Any:
    c10d = types.SimpleNamespace(
        GroupMember=types.SimpleNamespace(NON_GROUP_MEMBER=NON_MEMBER),
        _get_default_group=lambda: WORLD,
    )
    return types.SimpleNamespace(distributed_c10d=c10d, get_global_rank=lambda pg, r: r + 10)


class UserError(Exception):
    pass


def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    if tensor.numel() == 0:
        raise UserError("empty")
    return None


def send(tensor: Any, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    return None


def installer(rec: Recorder) -> hooks.installer._Installer:
    return hooks.installer._Installer(rec, fake_dist(), lambda: None)


def test_wrapper_records_synchronous_ops_per_group() -> None:
    sink = FakeSink()
    rec = make(sink)
    wrapped = installer(rec).wrap("all_reduce", all_reduce)
    assert wrapped(torch.zeros(4)) is None
    wrapped(torch.zeros(2, dtype=torch.float64), group=FakeGroup("7"))
    wrapped(torch.zeros(1), None, FakeGroup("7"))
    wrapped(torch.zeros(1), group=NON_MEMBER)  # not a member: nothing happens, nothing counted
    events = sink.of(CollectiveEvent)
    assert [(e.group, e.seq, e.nbytes, e.dtype) for e in events] == [
        ("0", 1, 16, "float32"), ("7", 1, 16, "float64"), ("7", 2, 4, "float32"),
    ]


def test_wrapper_reraises_user_exceptions_unchanged() -> None:
    sink = FakeSink()
    rec = make(sink)
    wrapped = installer(rec).wrap("all_reduce", all_reduce)
    tensor = torch.zeros(0)
    with pytest.raises(UserError) as caught:
        wrapped(tensor)
    assert str(caught.value) == "empty"
    (event,) = sink.of(CollectiveEvent)
    assert event.state is CollectiveState.FAILED
    assert rec.errors == 0


def test_recorder_errors_do_not_reach_the_caller() -> None:
    sink = FakeSink()
    rec = make(sink)

    def broken_begin(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("recorder bug")

    rec.begin = broken_begin  # type: ignore[method-assign]
    calls: list[tuple[Any, ...]] = []

    def original(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> str:
        calls.append((tensor, op, group, async_op))
        return "result"

    wrapped = installer(rec).wrap("all_reduce", original)
    assert wrapped("t", "sum", async_op=False) == "result"
    assert calls == [("t", "sum", None, False)]
    assert rec.errors == 1


def test_point_to_point_counts_in_a_pair_group() -> None:
    sink = FakeSink()
    rec = make(sink)  # rank 3
    inst = installer(rec)
    wrapped = inst.wrap("send", send)
    wrapped(torch.zeros(2), 1)
    wrapped(torch.zeros(2), dst=5)
    wrapped(torch.zeros(2), dst=1)
    wrapped(torch.zeros(2), group_dst=2)  # global rank 12 via get_global_rank
    events = sink.of(CollectiveEvent)
    assert [(e.group, e.seq, e.peer) for e in events] == [
        ("0:p2p:1-3", 1, 1), ("0:p2p:3-5", 1, 5), ("0:p2p:1-3", 2, 1), ("0:p2p:3-12", 1, 12),
    ]
    pairs = sink.of(ProcessGroupInfo)
    assert next((g.group, g.ranks, g.backend) for g in pairs) == ("0:p2p:1-3", (1, 3), "p2p")


def test_nested_wrapped_calls_count_once() -> None:
    sink = FakeSink()
    rec = make(sink)
    inst = installer(rec)
    inner = inst.wrap("all_reduce", all_reduce)

    def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> None:
        inner(torch.zeros(1))

    inst.wrap("barrier", barrier)()
    events = sink.of(CollectiveEvent)
    assert [(e.op, e.seq) for e in events] == [("barrier", 1)]


def test_a_tensor_subclass_dispatching_back_into_a_leaf_collective_counts_once() -> None:
    """A leaf collective (its code calls no other wrapped function) skips setting the depth
    guard for plain tensors; a tensor subclass's `__torch_function__` dispatch calls the same
    function again, so for those the guard is set."""
    sink = FakeSink()
    rec = make(sink)
    inst = installer(rec)

    class Sub(torch.Tensor):
        pass

    def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> None:
        if type(tensor) is Sub:  # what handle_torch_function ends up doing
            wrapped(tensor.as_subclass(torch.Tensor), op, group, async_op)

    # as torch's all_reduce is (it dispatches through its own global name)
    wrapped = inst.wrap_collective(hooks.catalog._spec("all_reduce", all_reduce), all_reduce,
                                   leaf=True)
    wrapped(torch.zeros(2).as_subclass(Sub))
    wrapped(torch.zeros(2))
    events = sink.of(CollectiveEvent)
    assert [(e.op, e.seq, e.nbytes) for e in events] == [("all_reduce", 1, 8), ("all_reduce", 2, 8)]


def test_leaf_collectives_are_told_from_those_that_call_others() -> None:
    """`_is_leaf` on torch's own functions (through their logging decorators) and on closures."""
    c10d = torch.distributed.distributed_c10d
    assert hooks.wrappers._is_leaf(c10d.all_reduce)
    assert hooks.wrappers._is_leaf(c10d.barrier)
    for calls_others in (c10d.all_gather_object, c10d.broadcast_object_list, c10d.send,
                         c10d._all_gather_base, c10d.reduce_scatter_tensor):
        assert not hooks.wrappers._is_leaf(calls_others), calls_others
    inner = installer(make()).wrap("all_reduce", all_reduce)

    def closes_over_a_wrapped_one(group: Any = None) -> None:
        inner(torch.zeros(1))

    def calls_a_helper_that_does(group: Any = None) -> None:
        closes_over_a_wrapped_one(group)

    assert not hooks.wrappers._is_leaf(closes_over_a_wrapped_one)
    assert not hooks.wrappers._is_leaf(calls_a_helper_that_does)


class _Work:
    """A gloo work stand-in: completed or not, its future holding the result or `error`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.done, self.error = False, error

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> Any:
        future: Any = torch.futures.Future()
        if self.error is not None:
            future.set_exception(self.error)
        else:
            future.set_result([torch.ones(1)])
        return future


class _Inner:
    """The real group of a DDP model, standing in: hands out the works it is given."""

    def __init__(self, works: list[_Work]) -> None:
        self.works = works

    def allreduce(self, tensors: Any, opts: Any) -> _Work:
        return self.works.pop(0)


def test_ddp_buckets_end_when_seen_completed_in_order() -> None:
    """A DDP bucket's all_reduce ends when it is seen completed: at the next bucket, or at the
    next optimizer step (after DDP's own wait at the end of the backward pass). Works are ended
    in order (a later one that completed first waits for the earlier), a failed one as failed,
    at the time they are seen."""
    clock = FakeClock()
    sink = FakeSink()
    rec = Recorder(job="j", attempt=0, node="n", rank=0, sink=sink, clock=clock)
    works = [_Work(), _Work(), _Work(RuntimeError("Connection closed by peer"))]
    reducer = hooks.ddp._Reducer(_Inner(list(works)), "0", rec)
    rec.add_settler(reducer.settle)
    optimizer = object()
    bucket = [torch.zeros(4)]

    assert reducer.allreduce(bucket, None) is works[0]
    clock.tick(100)
    works[1].done = True  # the second completes before the first
    reducer.allreduce(bucket, None)
    assert sink.of(CollectiveEvent) == []
    clock.tick(100)
    works[0].done = True
    reducer.allreduce(bucket, None)  # sees both completed
    assert [(e.seq, e.complete_us - e.enqueue_us) for e in sink.of(CollectiveEvent)] == [
        (1, 200), (2, 100)]
    rec.optimizer_stepped(optimizer)  # the third is still running: nothing more ends
    assert len(sink.of(CollectiveEvent)) == 2 and len(reducer.open) == 1
    clock.tick(50)
    works[2].done = True
    rec.optimizer_stepped(optimizer)
    last = sink.of(CollectiveEvent)[-1]
    assert (last.seq, last.state, last.complete_us - last.enqueue_us) == (
        3, CollectiveState.FAILED, 50)
    assert reducer.open == [] and rec.step == 2


def test_ddp_settling_on_two_threads_at_once_ends_each_bucket_once() -> None:
    """The training thread and the heartbeat thread may settle at the same moment: the one that
    finds the other settling skips its turn, so no bucket is ended twice or lost."""
    sink = FakeSink()
    rec = Recorder(job="j", attempt=0, node="n", rank=0, sink=sink, clock=FakeClock())
    works = [_Work(), _Work()]
    reducer = hooks.ddp._Reducer(_Inner(list(works)), "0", rec)
    reducer.allreduce([torch.zeros(4)], None)
    works[0].done = True
    with reducer.settling:  # the other thread is settling
        reducer.allreduce([torch.zeros(4)], None)
        assert sink.of(CollectiveEvent) == [] and len(reducer.open) == 2
    works[1].done = True
    reducer.settle()
    reducer.settle()
    assert [e.seq for e in sink.of(CollectiveEvent)] == [1, 2] and reducer.open == []


def test_the_heartbeat_thread_settles_ddp_buckets_while_the_model_lives() -> None:
    """A rank that stops after its last bucket (no optimizer step comes) still gets its completed
    all_reduce ended: the recorder's poll asks the model's reducer; once the model is gone the
    recorder forgets it."""
    sink = FakeSink()
    rec = Recorder(job="j", attempt=0, node="n", rank=0, sink=sink, clock=FakeClock())
    work = _Work()
    reducer = hooks.ddp._Reducer(_Inner([work]), "0", rec)
    rec.add_settler(reducer.settle)
    reducer.allreduce([torch.zeros(4)], None)
    rec.poll()
    assert sink.of(CollectiveEvent) == []
    work.done = True
    rec.poll()
    assert [e.state for e in sink.of(CollectiveEvent)] == [CollectiveState.COMPLETED]
    del reducer
    gc.collect()
    rec.poll()
    assert [ref() for ref in rec._settlers] == [None]


def test_a_resume_is_beaten_and_sent_at_once_not_at_the_next_interval() -> None:
    """A rank that resumed from a checkpoint says so in a heartbeat right away (and asks its
    transport to send it now): the controller measures the restart by it, and a rank stopped
    soon after its resume would otherwise never report it. The beat interval here is an hour
    on a clock that stands still: only the resume can cause a beat."""

    class NudgedSink(FakeSink):
        nudges = 0

        def nudge(self) -> None:
            self.nudges += 1

    sink = NudgedSink()
    rec = Recorder(job="job", attempt=1, node="node-a", rank=0, sink=sink, clock=FakeClock(),
                   heartbeat_s=3600.0, pid=4242)
    rec.start()
    try:
        rec.resume_from(30)
        deadline = time.monotonic() + 60  # a functional wait for the thread, not a time limit
        while not sink.of(Heartbeat) and time.monotonic() < deadline:
            time.sleep(0.01)
        (beat,) = sink.of(Heartbeat)
        assert beat.start_step == 30 and beat.resumed_us == FakeClock().now
        assert sink.nudges == 1
    finally:
        rec.close()
