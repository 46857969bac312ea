"""The recorder's heartbeats carry the size and dtype of each group's pending call (what a size
or dtype mismatch that hangs is told by), and forget them once the call completes."""

from __future__ import annotations

import threading

from recorder_fakes import Clock, Sink

from tracehound.agent.rank.recorder import Recorder
from tracehound.tracing.events import GroupProgress


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


def test_with_several_calls_in_flight_the_oldest_is_reported_too() -> None:
    """DDP's gradient buckets: a rank enters several all_reduces before the first completes.
    The group is blocked on the oldest; a mismatched call there would otherwise be hidden
    behind the newer calls entered after it."""
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=Sink(), clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    one = rec.begin("0", "all_reduce", 1000, "float32")
    assert progress(rec)["0"].oldest_seq == 0  # one call pending: it is last_enqueued
    odd = rec.begin("0", "reduce_scatter_tensor", 3000, "bfloat16")
    rec.begin("0", "all_reduce", 2000, "float32")
    rec.begin("0", "all_reduce", 2000, "float32")
    rec.end(one, True)
    g = progress(rec)["0"]
    assert (g.last_enqueued, g.last_completed, g.pending_op) == (4, 1, "all_reduce")
    assert (g.oldest_seq, g.oldest_op, g.oldest_nbytes, g.oldest_dtype) == (
        2, "reduce_scatter_tensor", 3000, "bfloat16")
    rec.end(odd, True)
    assert (progress(rec)["0"].oldest_seq, progress(rec)["0"].oldest_op) == (3, "all_reduce")


def test_calls_that_never_end_do_not_stay_the_oldest() -> None:
    """A work object dropped unwaited never ends; once a later call completes, the group's
    oldest call is the next one after it, not the forgotten one."""
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=Sink(), clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    rec.begin("0", "all_reduce", 8, "float32")  # never ends
    later = rec.begin("0", "all_reduce", 8, "float32")
    rec.end(later, True)
    rec.begin("0", "broadcast", 16, "int64")
    rec.begin("0", "all_reduce", 8, "float32")
    g = progress(rec)["0"]
    assert (g.oldest_seq, g.oldest_op) == (3, "broadcast")


def test_a_full_in_flight_table_is_pruned_only_after_progress() -> None:
    # Calls that never end fill the table; rebuilding it on every later call (nothing can go
    # while nothing completed) would cost each call ~100 us. It is rebuilt once progress allows.
    from tracehound.agent.rank import recorder as recorder_module

    rec = Recorder(job="job", attempt=0, node="n", rank=0, sink=Sink(), clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    cap = recorder_module._MAX_IN_FLIGHT
    tokens = [rec.begin("0", "all_reduce", 4, "float32") for _ in range(cap)]
    group = tokens[0][0]
    table = group.in_flight
    for _ in range(3):
        rec.begin("0", "all_reduce", 4, "float32")
        assert group.in_flight is table and len(table) == cap
    rec.end(tokens[0], True)
    rec.end(tokens[1], True)
    rec.begin("0", "all_reduce", 4, "float32")
    assert len(group.in_flight) == cap - 1  # the two ended left; the new one is remembered
    assert progress(rec)["0"].last_completed == 2


def test_a_counted_group_reports_what_was_entered_and_completed_never_going_back() -> None:
    """`Recorder.counted` (DDP's own communication, hooks.ddp._DdpCount): pending while more was
    entered than is known complete, since when it was entered; neither count goes back;
    `record_span` records a completed operation of it."""
    sink = Sink()
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=sink, clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    rec.counted("0:ddp", "ddp_comm", 3, 3)
    assert (progress(rec)["0:ddp"].last_enqueued, progress(rec)["0:ddp"].pending_op) == (3, "")
    rec.counted("0:ddp", "ddp_comm", 4, entered_us=1_000)
    g = progress(rec)["0:ddp"]
    assert (g.last_enqueued, g.last_completed, g.pending_op, g.last_enqueue_us) == (
        4, 3, "ddp_comm", 1_000)
    rec.counted("0:ddp", "ddp_comm", 4, entered_us=2_000)  # seen again: still since 1_000
    rec.counted("0:ddp", "ddp_comm", 2)
    g = progress(rec)["0:ddp"]
    assert (g.last_enqueued, g.last_enqueue_us, g.pending_op) == (4, 1_000, "ddp_comm")
    rec.counted("0:ddp", "ddp_comm", 4, 4)
    g = progress(rec)["0:ddp"]
    assert (g.last_completed, g.pending_op) == (4, "")
    rec.counted("0:ddp", "ddp_comm", 2, 2)
    assert (progress(rec)["0:ddp"].last_enqueued, progress(rec)["0:ddp"].last_completed) == (4, 4)
    assert sink.items == []
    rec.record_span("0:ddp", 4, "ddp_comm", 1_000)
    (row,) = sink.items
    assert isinstance(row, tuple)
    assert row[:8] == (("job", 0, "n", 1), "0:ddp", 4, "ddp_comm", 0, "", -1, False)
    assert row[8] == 1_000 * 1000  # queued in ns: the sender divides
    assert row[9] > 1_000


def test_a_synchronous_call_shows_pending_inside_and_complete_after_without_the_lock() -> None:
    """`enter`/`returned` (a call that returns complete, the hot path) take no lock: the call
    still shows as pending in a heartbeat taken while it runs, its event is queued when it
    returns, and its sequence id follows on from async calls of the same group."""
    sink = Sink()
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=sink, clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    first = rec.begin("0", "all_reduce", 64, "float32")
    rec.end(first, True)
    token = rec.enter("0", "broadcast", 128, "int64")
    rec._lock.acquire()  # another thread holding the lock does not stop a synchronous call
    try:
        other = rec.enter("0", "barrier", 0, "")
        rec.returned(other)
    finally:
        rec._lock.release()
    assert (token[1], other[1]) == (2, 3)
    g = progress(rec)["0"]
    assert (g.last_enqueued, g.last_completed, g.pending_op) == (3, 3, "")
    inside = rec.enter("0", "all_reduce", 256, "bfloat16")
    g = progress(rec)["0"]
    assert (g.last_enqueued, g.last_completed, g.pending_op, g.pending_nbytes) == (
        4, 3, "all_reduce", 256)
    assert rec.pending_since() == inside[6] // 1000  # a token's time is in ns
    rec.returned(inside)
    g = progress(rec)["0"]
    completed_ns = sink.items[-1][9]
    assert (g.last_completed, g.pending_op, g.last_complete_us) == (4, "", completed_ns // 1000)
    assert rec.pending_since() == 0
    assert [(i[2], i[3], i[7]) for i in sink.items] == [
        (1, "all_reduce", False), (3, "barrier", False), (4, "all_reduce", False)]
    rec.end(token, False)  # the broadcast raised: recorded as failed, completion kept at 4
    assert sink.items[-1][2:8] == (2, "broadcast", 128, "int64", -1, True)
    assert progress(rec)["0"].last_completed == 4


def test_an_async_end_after_a_later_synchronous_return_does_not_move_completion_back() -> None:
    """An async call's future completes on another thread, after a later synchronous call of
    the group returned: the group's last completed call stays the later one (the two are
    kept apart, so neither write can undo the other), and with the async call pending behind
    a synchronous one both count as in flight."""
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=Sink(), clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    work = rec.begin("0", "all_gather_into_tensor", 512, "float32")
    sync = rec.enter("0", "all_reduce", 64, "float32")
    g = progress(rec)["0"]
    assert (g.oldest_seq, g.oldest_op, g.pending_op) == (1, "all_gather_into_tensor",
                                                         "all_reduce")
    assert rec.pending_since() == work[6] // 1000
    rec.returned(sync)
    rec.end(work, True)
    g = progress(rec)["0"]
    assert (g.last_enqueued, g.last_completed, g.pending_op, g.oldest_seq) == (2, 2, "", 0)


def test_a_new_group_is_added_under_the_lock_the_heartbeat_iterates_under() -> None:
    """Only a group's first synchronous call takes the lock: the heartbeat thread iterates the
    groups under it, and a group added meanwhile would break that iteration."""
    rec = Recorder(job="job", attempt=0, node="n", rank=1, sink=Sink(), clock=Clock(),
                   heartbeat_s=0.5, pid=7)
    tokens: list[object] = []
    rec._lock.acquire()
    try:
        first = threading.Thread(target=lambda: tokens.append(rec.enter("9", "barrier", 0, "")))
        first.start()
        first.join(0.2)
        assert first.is_alive() and not tokens  # waits for the lock
    finally:
        rec._lock.release()
    first.join(10)
    assert len(tokens) == 1 and progress(rec)["9"].pending_op == "barrier"
