"""The wire codec: every record survives encode -> JSON -> decode, and bad records are rejected
one by one with a reason that names the field, while the rest of their batch is kept."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    ProcessGroupInfo,
    RankExit,
    Record,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.wire import (
    InvalidRecord,
    decode,
    decode_batch,
    encode,
    encode_batch,
)

U64 = st.integers(min_value=0, max_value=2**63 - 1)
I32 = st.integers(min_value=0, max_value=2**31 - 1)
NAME = st.text(min_size=1, max_size=40)
MAYBE_EMPTY = st.text(max_size=40)

jobs = NAME.map(JobId)
nodes = NAME.map(NodeId)
ranks = I32.map(Rank)
group_ids = NAME.map(GroupId)

collectives = st.builds(
    CollectiveEvent, job=jobs, attempt=I32, node=nodes, rank=ranks, group=group_ids,
    seq=st.integers(min_value=1, max_value=2**63 - 1), op=NAME, nbytes=U64, dtype=MAYBE_EMPTY,
    peer=st.integers(min_value=-1, max_value=2**31 - 1), state=st.sampled_from(CollectiveState),
    enqueue_us=U64, complete_us=U64,
)
progress = st.builds(
    GroupProgress, group=group_ids, last_enqueued=U64, last_completed=U64,
    pending_op=MAYBE_EMPTY, last_enqueue_us=U64, last_complete_us=U64,
    pending_nbytes=U64, pending_dtype=MAYBE_EMPTY, oldest_seq=U64, oldest_op=MAYBE_EMPTY,
    oldest_nbytes=U64, oldest_dtype=MAYBE_EMPTY,
)
heartbeats = st.builds(
    Heartbeat, job=jobs, attempt=I32, node=nodes, rank=ranks, time_us=U64, pid=I32, step=U64,
    step_us=U64, start_step=U64, first_step_us=U64, dropped=U64,
    groups=st.lists(progress, max_size=4).map(tuple),
)
group_infos = st.builds(
    ProcessGroupInfo, job=jobs, attempt=I32, rank=ranks, group=group_ids,
    ranks=st.lists(I32, max_size=8).map(tuple), backend=MAYBE_EMPTY, time_us=U64,
)
exits = st.builds(
    RankExit, job=jobs, attempt=I32, node=nodes, rank=ranks, pid=I32,
    exit_code=st.integers(min_value=-(2**31 - 1), max_value=2**31 - 1), time_us=U64,
)
health_samples = st.builds(
    HealthSample, job=MAYBE_EMPTY.map(JobId), node=nodes, device=NAME, time_us=U64, source=NAME,
    metric=NAME, value=st.floats(allow_nan=False, allow_infinity=False),
    severity=st.sampled_from(HealthSeverity), detail=MAYBE_EMPTY,
)
stack_samples = st.builds(
    StackSample, job=jobs, attempt=I32, node=nodes, rank=ranks, time_us=U64,
    frames=st.lists(MAYBE_EMPTY, max_size=8).map(tuple),
)
records: st.SearchStrategy[Record] = st.one_of(
    collectives, heartbeats, group_infos, exits, health_samples, stack_samples
)


@pytest.mark.parametrize(
    "strategy", [collectives, heartbeats, group_infos, exits, health_samples, stack_samples],
    ids=["collective", "heartbeat", "group", "exit", "health", "stack"],
)
@given(data=st.data())
def test_every_record_type_round_trips_through_json(
    strategy: st.SearchStrategy[Record], data: st.DataObject
) -> None:
    record = data.draw(strategy)
    assert decode(json.loads(json.dumps(encode(record)))) == record


@given(batch_id=NAME, items=st.lists(records, max_size=12))
def test_batches_round_trip(batch_id: str, items: list[Record]) -> None:
    batch = Batch(batch_id=batch_id, records=tuple(items))
    decoded = decode_batch(encode_batch(batch))
    assert decoded.batch == batch
    assert decoded.rejected == ()


def good_collective(seq: int = 1) -> dict[str, Any]:
    return dict(encode(CollectiveEvent(
        job=JobId("j"), attempt=0, node=NodeId("n"), rank=Rank(0), group=GroupId("0"), seq=seq,
        op="all_reduce", nbytes=8, dtype="float32", peer=-1, state=CollectiveState.COMPLETED,
        enqueue_us=1, complete_us=2,
    )))


def good_health() -> dict[str, Any]:
    return dict(encode(HealthSample(
        job=JobId(""), node=NodeId("n"), device="gpu0", time_us=5, source="nvml", metric="xid",
        value=79, severity=HealthSeverity.CRITICAL,
    )))


def good_stack() -> dict[str, Any]:
    return dict(encode(StackSample(
        job=JobId("j"), attempt=0, node=NodeId("n"), rank=Rank(1), time_us=5,
        frames=("a.py:1 f", "b.py:2 g"),
    )))


def changed(raw: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**raw, **fields}


def without(raw: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in raw.items() if k != name}


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (changed(good_collective(), rank="3"), "field 'rank' must be an integer, got str"),
        (changed(good_collective(), nbytes=True), "field 'nbytes' must be an integer, got bool"),
        (without(good_collective(), "seq"), "missing field 'seq'"),
        (changed(good_collective(), seq=-1), "field 'seq' must be between 1 and"),
        (changed(good_collective(), seq=0), "field 'seq' must be between 1 and"),
        (changed(good_collective(), state="exploded"),
         "field 'state' must be one of completed, failed, got 'exploded'"),
        (changed(good_collective(), type="telemetry"), "field 'type' must be one of"),
        (changed(good_collective(), job=""), "field 'job' must not be empty"),
        (changed(good_collective(), complete_us=2**63), "field 'complete_us' must be between"),
        ("not an object", "a record must be a JSON object, got str"),
        (changed(good_health(), value="hot"), "field 'value' must be a number, got str"),
        (changed(good_health(), value=True), "field 'value' must be a number, got bool"),
        (changed(good_health(), value=float("nan")), "field 'value' must be a finite number"),
        (changed(good_health(), value=10**400), "field 'value' must be a finite number"),
        (changed(good_health(), severity="fatal"),
         "field 'severity' must be one of info, warning, critical, got 'fatal'"),
        (without(good_health(), "metric"), "missing field 'metric'"),
        (changed(good_health(), node=""), "field 'node' must not be empty"),
        (changed(good_stack(), frames="a.py:1 f"), "field 'frames' must be a list of strings"),
        (changed(good_stack(), frames=["ok", 3]), "frames[1] is int"),
        (changed(good_stack(), frames=["x" * 4097]), "frames[0] is over 4096 characters"),
        (changed(good_stack(), rank=-1), "field 'rank' must be between 0 and"),
        (changed(good_stack(), job=""), "field 'job' must not be empty"),
    ],
)
def test_a_bad_record_is_rejected_naming_the_field_and_the_rest_kept(
    bad: Any, reason: str
) -> None:
    body = json.dumps({"batch_id": "b", "records": [good_collective(1), bad, good_collective(2)]})
    decoded = decode_batch(body)
    assert [r.seq for r in decoded.batch.records if isinstance(r, CollectiveEvent)] == [1, 2]
    [rejection] = decoded.rejected
    assert rejection.index == 1
    assert reason in rejection.reason


def test_a_node_wide_health_sample_needs_no_job_attempt_or_rank() -> None:
    sample = decode(good_health())
    assert isinstance(sample, HealthSample)
    assert sample.job == ""
    assert sample.value == 79.0
    assert isinstance(sample.value, float)


def test_bad_heartbeat_group_progress_names_its_position() -> None:
    raw: dict[str, Any] = dict(encode(Heartbeat(
        job=JobId("j"), attempt=0, node=NodeId("n"), rank=Rank(0), time_us=1, pid=1, step=1,
        step_us=1, start_step=0, first_step_us=1, dropped=0,
        groups=(GroupProgress(group=GroupId("0"), last_enqueued=1, last_completed=1,
                              pending_op="", last_enqueue_us=1, last_complete_us=1),) * 2,
    )))
    raw["groups"][1] = {**raw["groups"][1], "last_enqueued": -4}
    with pytest.raises(InvalidRecord, match=r"groups\[1\]: field 'last_enqueued'"):
        decode(raw)


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"{not json", "a batch must be JSON"),
        (b"[]", "a batch must be a JSON object"),
        (b'{"records": []}', "missing field 'batch_id'"),
        (b'{"batch_id": "b", "records": "x"}', "field 'records' must be a list"),
    ],
)
def test_a_malformed_batch_is_refused_as_a_whole(body: bytes, complaint: str) -> None:
    with pytest.raises(InvalidRecord, match=complaint):
        decode_batch(body)
