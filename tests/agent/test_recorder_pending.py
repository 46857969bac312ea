"""The recorder's heartbeats carry the size and dtype of each group's pending call (what a size
or dtype mismatch that hangs is told by), and forget them once the call completes."""

from __future__ import annotations

from tracehound.agent.recorder import Pending, Recorder
from tracehound.tracing.events import GroupProgress


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        self.now += 10
        return self.now


class Sink:
    def __init__(self) -> None:
        self.items: list[Pending] = []

    def offer(self, item: Pending) -> bool:
        self.items.append(item)
        return True

    def flush(self, timeout: float) -> bool:
        return True


def progress(rec: Recorder) -> dict[str, GroupProgress]:
    return {g.group: g for g in rec.heartbeat_record().groups}


def test_pending_calls_report_their_size_and_dtype_until_they_complete() -> None:
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=Sink(), clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    first = rec.begin("727", "all_reduce", 4096, "bfloat16")
    rec.begin("1500", "all_gather_into_tensor", 512, "float32")
    now = progress(rec)
    assert (now["727"].pending_op, now["727"].pending_nbytes, now["727"].pending_dtype) == (
        "all_reduce", 4096, "bfloat16")
    assert (now["1500"].pending_nbytes, now["1500"].pending_dtype) == (512, "float32")
    rec.end(first, True)
    done = progress(rec)["727"]
    assert (done.pending_op, done.pending_nbytes, done.pending_dtype) == ("", 0, "")
    # Two calls in flight: the group reports the later one until both complete.
    a = rec.begin("727", "all_reduce", 100, "float16")
    b = rec.begin("727", "broadcast", 200, "int64")
    rec.end(a, True)
    late = progress(rec)["727"]
    assert (late.pending_op, late.pending_nbytes, late.pending_dtype) == (
        "broadcast", 200, "int64")
    rec.end(b, False)
    assert progress(rec)["727"].pending_nbytes == 0
