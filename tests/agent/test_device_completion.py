"""On a GPU a collective returns to the CPU once its work is enqueued on a stream; it completes
when the device has done it. For the groups of a device backend (NCCL) the recorder keeps a call
in flight until a marker recorded after it (a CUDA event on the current stream, which waits for
the collective's stream) says the device is done, polled from the heartbeat thread, and ends
async calls by their Work's `is_completed()`, not by their future (which NCCL completes at
enqueue). So a rank whose GPU stopped shows its calls entered and not completed, as NCCL's
Flight Recorder does, and the analysis sees it stuck there (`analysis.mismatch`).

No GPU here: the markers are stand-ins whose completion the test decides, and the wrappers are
the real compiled ones over a stand-in collective (as in test_agent_recorder)."""

from __future__ import annotations

import types
from typing import Any

import torch
from recorder_fakes import Clock, Sink

from tracehound.agent.rank import hooks
from tracehound.agent.rank.recorder import Recorder, cuda_marker
from tracehound.tracing.events import GroupProgress


class Marker:
    """Stands in for a CUDA event: done when the test's `device` has run past it."""

    def __init__(self, device: Device) -> None:
        self.device, self.index = device, device.enqueued
        device.enqueued += 1

    def is_completed(self) -> bool:
        return self.index < self.device.ran

    def exception(self) -> None:
        return None


class Device:
    """A stream: markers complete in order, as far as `ran` says."""

    def __init__(self) -> None:
        self.enqueued = 0
        self.ran = 0

    def marker(self) -> Marker:
        return Marker(self)


def recorder(device: Device | None = None) -> tuple[Recorder, Sink]:
    sink = Sink()
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=sink, clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    if device is not None:
        rec.device_marker = device.marker
    return rec, sink


def calls(sink: Sink) -> list[Any]:
    """The collective events the sink took (not the group announcements)."""
    return [item for item in sink.items if isinstance(item, tuple)]


def progress(rec: Recorder, group: str = "0") -> GroupProgress:
    return next(g for g in rec.heartbeat_record().groups if g.group == group)


def test_a_call_of_a_device_group_completes_when_the_device_has_done_it() -> None:
    device = Device()
    rec, sink = recorder(device)
    rec.group_created("0", (0, 1), "nccl")
    for _ in range(3):
        rec.returned(rec.enter("0", "all_reduce", 4096, "bfloat16"))
    assert calls(sink) == []  # returned, not done: nothing recorded as complete yet
    g = progress(rec)
    assert (g.last_enqueued, g.last_completed, g.pending_op) == (3, 0, "all_reduce")
    device.ran = 1
    rec.poll()
    assert [item[2] for item in calls(sink)] == [1]
    # the device stops at #2: the CPU goes on issuing #4 and #5, none completes
    for _ in range(2):
        rec.returned(rec.enter("0", "all_reduce", 4096, "bfloat16"))
    rec.poll()
    g = progress(rec)
    assert (g.last_enqueued, g.last_completed, g.oldest_seq, g.oldest_op) == (
        5, 1, 2, "all_reduce")
    device.ran = 5
    rec.poll()
    assert [item[2] for item in calls(sink)] == [1, 2, 3, 4, 5]
    assert all(item[7] is False for item in calls(sink))  # none failed
    g = progress(rec)
    assert (g.last_completed, g.pending_op, g.oldest_seq) == (5, "", 0)


def test_a_cpu_group_completes_on_return_whatever_the_device() -> None:
    rec, sink = recorder(Device())
    rec.group_created("0", (0, 1), "gloo")
    rec.returned(rec.enter("0", "all_reduce", 64, "float32"))
    assert [item[2] for item in calls(sink)] == [1]
    assert progress(rec).last_completed == 1


def test_without_a_marker_a_device_call_completes_on_return_and_is_counted() -> None:
    rec, sink = recorder()

    def broken() -> Any:
        raise RuntimeError("CUDA error: an illegal memory access")

    rec.device_marker = broken
    rec.group_created("0", (0, 1), "nccl")
    for _ in range(2):
        rec.returned(rec.enter("0", "all_reduce", 64, "float32"))
    assert [item[2] for item in calls(sink)] == [1, 2]
    assert rec.device_fallbacks == 2 and rec.errors == 1


def test_where_cuda_is_missing_a_nccl_group_is_left_to_the_cpu() -> None:
    rec, _ = recorder()
    rec.group_created("0", (0, 1), "nccl")
    assert rec.groups["0"].device is torch.cuda.is_available()
    assert (rec.device_marker is cuda_marker) is torch.cuda.is_available()


# -- through the compiled wrapper and an async call ----------------------------------------------


class Group:
    def __init__(self, name: str) -> None:
        self.group_name = name


def all_reduce(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    return Work() if async_op else None


class Work:
    """An async call's Work: its future completes at once (NCCL's does at enqueue)."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def exception(self) -> None:
        return None

    def get_future(self) -> Any:
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future


def wrapped_all_reduce(rec: Recorder) -> Any:
    dist = types.SimpleNamespace(
        distributed_c10d=types.SimpleNamespace(
            GroupMember=types.SimpleNamespace(NON_GROUP_MEMBER=object()),
            _get_default_group=lambda: Group("0")),
        get_global_rank=lambda pg, r: r)
    return hooks.installer._Installer(rec, dist, lambda: None).wrap("all_reduce", all_reduce)


def test_the_compiled_wrapper_leaves_a_device_call_in_flight_until_done() -> None:
    device = Device()
    rec, sink = recorder(device)
    rec.group_created("7", (0, 1), "nccl")
    rec.group_created("8", (0, 1), "gloo")
    call = wrapped_all_reduce(rec)
    call(torch.zeros(4), group=Group("7"))
    call(torch.zeros(4), group=Group("8"))
    assert [(item[1], item[2]) for item in calls(sink)] == [("8", 1)]
    assert progress(rec, "7").pending_op == "all_reduce"
    device.ran = 1
    rec.poll()
    assert [(item[1], item[2]) for item in calls(sink)] == [("8", 1), ("7", 1)]


def test_an_async_device_call_ends_by_its_work_not_its_future() -> None:
    rec, sink = recorder(Device())
    rec.group_created("7", (0, 1), "nccl")
    work = wrapped_all_reduce(rec)(torch.zeros(4), group=Group("7"), async_op=True)
    rec.poll()
    assert calls(sink) == [] and progress(rec, "7").pending_op == "all_reduce"
    work.done = True
    rec.poll()
    assert [(item[1], item[2]) for item in calls(sink)] == [("7", 1)]
