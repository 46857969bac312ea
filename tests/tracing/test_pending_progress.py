"""The size and dtype of a pending call in heartbeats: old records without them still decode,
and both store adapters keep them."""

from __future__ import annotations

from typing import Any

from tracehound.tracing.events import Batch, GroupProgress, Heartbeat
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore
from tracehound.tracing.wire import decode, encode


def heartbeat(*groups: GroupProgress) -> Heartbeat:
    return Heartbeat(job=JobId("j"), attempt=0, node=NodeId("n"), rank=Rank(3), time_us=10,
                     pid=1, step=1, step_us=5, start_step=0, first_step_us=5, dropped=0,
                     groups=groups)


PENDING = GroupProgress(group=GroupId("727"), last_enqueued=41, last_completed=40,
                        pending_op="all_reduce", last_enqueue_us=9, last_complete_us=8,
                        pending_nbytes=2048, pending_dtype="bfloat16")


def test_a_heartbeat_from_an_older_recorder_decodes_without_size_and_dtype() -> None:
    raw: dict[str, Any] = dict(encode(heartbeat(PENDING)))
    old = {k: v for k, v in raw["groups"][0].items()
           if k not in ("pending_nbytes", "pending_dtype")}
    assert set(raw["groups"][0]) - set(old) == {"pending_nbytes", "pending_dtype"}
    got = decode({**raw, "groups": [old]})
    assert isinstance(got, Heartbeat)
    (g,) = got.groups
    assert (g.pending_op, g.pending_nbytes, g.pending_dtype) == ("all_reduce", 0, "")
    assert decode(raw) == heartbeat(PENDING)


def test_stores_keep_the_pending_size_and_dtype(store: TraceStore) -> None:
    idle = GroupProgress(group=GroupId("1500"), last_enqueued=7, last_completed=7,
                         pending_op="", last_enqueue_us=3, last_complete_us=4)
    store.insert(Batch(batch_id="b", records=(heartbeat(PENDING, idle),)))
    (got,) = store.latest_heartbeats(JobId("j"), 0)
    assert got.groups == (PENDING, idle)
    assert (got.groups[1].pending_nbytes, got.groups[1].pending_dtype) == (0, "")
