"""The one-tensor collective wrapper does what `Recorder.enter` and `Recorder.returned` do,
inline (hooks.py: two calls less on the hot path). These tests hold the two to the same
records and the same group state, so neither can change alone.

The wrapper is built by the real installer around a stand-in for `all_reduce` (same
signature) that calls back into the test, so the group's state can be read while the call is
inside; no process group is needed (the default group's name is given to the installer's
cache)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from recorder_fakes import Clock, Sink

from tracehound.agent.rank import hooks
from tracehound.agent.rank.recorder import Recorder, materialize
from tracehound.agent.rank.transport import SocketTransport

HEADERS = ["parameters written out", "*args, **kwargs"]


def wrapped_all_reduce(recorder: Recorder, inside: Callable[..., None] = lambda *a, **k: None,
                       header: str = HEADERS[0]) -> Callable[..., Any]:
    """all_reduce's wrapper from the real installer, around a stand-in that calls `inside`
    with what it was given. With all_reduce's signature the wrapper takes the same parameters;
    a stand-in that also takes `*rest` gets the wrapper that reads them from `*args,
    **kwargs` (the same body: `hooks.wrappers._collective_source`)."""
    if header == HEADERS[0]:
        def stand_in(*args: Any, **kwargs: Any) -> None:
            inside(*args, **kwargs)

        stand_in.__signature__ = inspect.signature(dist.all_reduce)  # type: ignore[attr-defined]
    else:
        def stand_in(tensor: Any, op: Any = dist.ReduceOp.SUM,  # type: ignore[misc]
                     group: Any = None, async_op: bool = False, *rest: Any) -> None:
            inside(tensor, op, group, async_op, *rest)

    installer = hooks.installer._Installer(recorder, dist, on_group=lambda: None)
    installer.groups.default = (object(), "0")
    spec = hooks.catalog._spec("all_reduce", stand_in)
    wrapper = installer.wrap_collective(spec, stand_in, leaf=True)
    source = hooks.wrappers._collective_source(stand_in, spec, {}, leaf=True, wall_clock=False)
    assert source.startswith("def wrapper(*args" if header == HEADERS[1] else "def wrapper(tensor")
    return wrapper


def without_times(item: tuple[Any, ...]) -> tuple[Any, ...]:
    return item[:-2]


@pytest.mark.parametrize("header", HEADERS)
@pytest.mark.parametrize("tensor", [torch.ones(3), torch.zeros(2, 2, dtype=torch.bfloat16)])
def test_the_wrapper_records_what_enter_and_returned_record(tensor: torch.Tensor, header: str
                                                            ) -> None:
    by_wrapper, by_methods = Sink(), Sink()
    wrapper_clock, methods_clock = Clock(), Clock()
    traced = Recorder(job="j", attempt=2, node="n", rank=5, sink=by_wrapper, clock=wrapper_clock)
    reference = Recorder(job="j", attempt=2, node="n", rank=5, sink=by_methods,
                         clock=methods_clock)
    all_reduce = wrapped_all_reduce(traced, header=header)
    dtype = str(tensor.dtype).removeprefix("torch.")
    for _ in range(3):
        all_reduce(tensor)
        reference.returned(reference.enter("0", "all_reduce", tensor.nbytes, tensor.dtype))
    all_reduce(tensor=tensor)  # by keyword

    reference.returned(reference.enter("0", "all_reduce", tensor.nbytes, tensor.dtype))
    assert [without_times(i) for i in by_wrapper.items] == \
        [without_times(i) for i in by_methods.items]
    assert [i[2] for i in by_wrapper.items] == [1, 2, 3, 4]  # seq
    # the dtype is kept as torch's object and named off the training thread
    assert {materialize(i).dtype for i in by_wrapper.items} == {dtype}
    for item in by_wrapper.items:
        assert item[-2] < item[-1]  # entered before it returned, each a clock read
    assert by_wrapper.items[-1][-2:] == by_methods.items[-1][-2:]  # the same clock reads
    mine, theirs = traced.groups["0"], reference.groups["0"]
    assert mine.returned == theirs.returned and mine.done == theirs.done == (0, 0)
    assert mine.last is not None and theirs.last is not None
    assert mine.last[1:] == theirs.last[1:]
    assert mine.in_flight == theirs.in_flight == {}


@pytest.mark.parametrize("header", HEADERS)
def test_the_original_gets_each_argument_for_its_parameter(header: str) -> None:
    signature = inspect.signature(dist.all_reduce)
    got: list[dict[str, Any]] = []

    def inside(*args: Any, **kwargs: Any) -> None:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        got.append(dict(bound.arguments))

    recorder = Recorder(job="j", attempt=0, node="n", rank=0, sink=Sink(), clock=Clock())
    all_reduce = wrapped_all_reduce(recorder, inside, header)
    t, group, avg, plain = torch.ones(2), object(), dist.ReduceOp.AVG, dist.ReduceOp.SUM
    all_reduce(t)
    all_reduce(t, avg)
    all_reduce(t, group=group)
    all_reduce(async_op=False, tensor=t, op=avg)
    assert [(a["tensor"], a["op"], a["group"], a["async_op"]) for a in got] == [
        (t, plain, None, False), (t, avg, None, False), (t, plain, group, False),
        (t, avg, None, False)]
    with pytest.raises(TypeError):
        all_reduce(t, nonsense=1)  # refused, as the original refuses it
    assert len(got) == 4


def test_records_go_straight_onto_the_transports_queue_until_it_is_full() -> None:
    transport = SocketTransport("/nonexistent/agent.sock", bound=2)  # never started
    recorder = Recorder(job="j", attempt=0, node="n", rank=0, sink=transport, clock=Clock())
    all_reduce = wrapped_all_reduce(recorder)
    for _ in range(3):
        all_reduce(torch.ones(1))
    assert [item[2] for item in transport._queue] == [1, 2]  # seq
    assert (transport.dropped, recorder.dropped) == (1, 1)  # the third, refused by offer
    # a sink set after the wrapper was made: the wrapper's queue (a global of its own) follows
    later = SocketTransport("/nonexistent/agent.sock", bound=1)
    recorder.sink = later
    all_reduce(torch.ones(1))
    all_reduce(torch.ones(1))
    assert [item[2] for item in later._queue] == [4] and len(transport) == 2
    assert (later.dropped, recorder.dropped) == (1, 2)
    later._queue.clear()
    recorder.disable()
    all_reduce(torch.ones(1))
    assert len(later) == 0 and len(transport) == 2 and recorder.dropped == 2


@pytest.mark.parametrize("header", HEADERS)
def test_inside_the_wrapped_call_it_shows_pending_and_after_it_complete(header: str) -> None:
    recorder = Recorder(job="j", attempt=0, node="n", rank=0, sink=Sink(), clock=Clock())
    seen: list[tuple[int, int]] = []

    def inside(*args: Any, **kwargs: Any) -> None:
        state = recorder.groups["0"]
        seen.append((state.last_enqueued, state.last_completed))

    all_reduce = wrapped_all_reduce(recorder, inside, header)
    all_reduce(torch.ones(1))
    all_reduce(torch.ones(1))
    assert seen == [(1, 0), (2, 1)]
    assert recorder.groups["0"].last_completed == 2


def test_a_refused_record_is_counted_and_nothing_is_offered_once_disabled() -> None:
    full = Sink(full=True)
    recorder = Recorder(job="j", attempt=0, node="n", rank=0, sink=full, clock=Clock())
    all_reduce = wrapped_all_reduce(recorder)
    all_reduce(torch.ones(1))
    all_reduce(torch.ones(1))
    assert recorder.dropped == 2 and recorder.errors == 0

    kept = Sink()
    recorder.sink = kept  # what the sink is at the call is what is used
    all_reduce(torch.ones(1))
    assert [i[2] for i in kept.items] == [3]  # seq
    recorder.disable()
    all_reduce(torch.ones(1))
    assert len(kept.items) == 1 and recorder.dropped == 2


def test_a_call_that_raises_is_recorded_failed_and_the_error_reaches_the_caller() -> None:
    sink = Sink()
    recorder = Recorder(job="j", attempt=0, node="n", rank=0, sink=sink, clock=Clock())

    def boom(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("connection reset by peer")

    all_reduce = wrapped_all_reduce(recorder, boom)
    with pytest.raises(RuntimeError, match="connection reset"):
        all_reduce(torch.ones(1))
    ((*_, seq, op, _nbytes, _dtype, _peer, failed, _enq, _comp),) = sink.items
    assert (seq, op, failed) == (1, "all_reduce", True)
    assert recorder.groups["0"].last_completed == 1
