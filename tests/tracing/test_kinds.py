"""A record kind is declared once. A kind that only this test declares is on the wire (with
validation messages that name its fields), in the DDL, in the column batches and in a real store,
and no other file knows it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, ClassVar

import pytest
from holder_harness import is_shared

from tracehound.tracing import kinds, wire
from tracehound.tracing.events import Batch
from tracehound.tracing.ids import JobId
from tracehound.tracing.kinds import (
    NON_EMPTY,
    U64,
    RecordBase,
    Stored,
    Text,
    forget_kind,
    integer,
    record_kind,
)
from tracehound.tracing.store import bulk, open_store
from tracehound.tracing.store.schema import create_statements


class Probe(RecordBase, frozen=True, tag="probe_test_only"):
    """A reading that exists only in this test."""

    TABLE: ClassVar[Stored] = Stored(
        "probe_test_only", time="time_us", order_by=("job", "time_us"), key=("job", "time_us"),
    )

    job: Annotated[JobId, NON_EMPTY]
    time_us: U64
    level: Annotated[int, integer("Int32", ge=-5, le=5)]
    tags: tuple[Text, ...] = ()
    ratio: float = 0.0


@pytest.fixture
def probe() -> Iterator[type[Probe]]:
    record_kind(Probe)
    try:
        yield Probe
    finally:
        forget_kind(Probe)


def sample(t: int, level: int = 1) -> Probe:
    return Probe(job=JobId("pj"), time_us=t, level=level, tags=("a", "b"), ratio=0.5)


def test_a_declared_kind_is_on_the_wire_with_named_validation(probe: type[Probe]) -> None:
    line = wire.encode_line(sample(7))
    assert json.loads(line) == {"type": "probe_test_only", "job": "pj", "time_us": 7, "level": 1,
                                "tags": ["a", "b"], "ratio": 0.5}
    assert wire.decode_line(line) == sample(7)
    bad = {**json.loads(line), "level": 9}
    body = json.dumps({"batch_id": "b", "records": [json.loads(line), bad]})
    decoded = wire.decode_batch(body)
    assert decoded.batch.records == (sample(7),)
    [rejection] = decoded.rejected
    assert rejection.reason == "field 'level' must be between -5 and 5, got 9"
    assert "probe_test_only" in wire.record_types()


def test_a_declared_kind_has_its_table_and_column_batches(probe: type[Probe]) -> None:
    ddl = [s for s in create_statements("db") if "db.probe_test_only (" in s]
    assert len(ddl) == 1
    for column in ("batch_id String", "job String", "time_us UInt64", "level Int32",
                   "tags Array(String)", "ratio Float64"):
        assert f"    {column}" in ddl[0]
    assert "ORDER BY (job, time_us)" in ddl[0]
    columns = kinds.layout(Probe).column_batch([sample(1), sample(2, level=-3)], "b1")
    assert columns == [["b1", "b1"], ["pj", "pj"], [1, 2], [1, -3], [["a", "b"], ["a", "b"]],
                       [0.5, 0.5]]


def test_a_declared_kind_round_trips_through_a_real_store(
    probe: type[Probe], store_url: str, request: pytest.FixtureRequest
) -> None:
    with open_store(store_url) as store:
        records = (sample(1), sample(2, level=-3))
        if is_shared(request):
            # the kind is declared in this process only: the holder cannot store it, and says so
            with pytest.raises(TypeError, match="no record kind 'probe_test_only' is "
                                                "declared in the process that holds the "
                                                "store"):
                store.insert(Batch(batch_id="p1", records=records))  # type: ignore[arg-type]
            assert "pj" not in store.jobs()
            return
        report = store.insert(Batch(batch_id="p1", records=records))  # type: ignore[arg-type]
        assert report.inserted == 2
        again = store.insert(Batch(batch_id="p1", records=records),  # type: ignore[arg-type]
                             maybe_duplicate=True)
        assert (again.inserted, again.skipped) == (0, 2)
        assert bulk(store).records(Probe, JobId("pj")) == list(records)
        assert "pj" in store.jobs()


def test_a_forgotten_kind_is_no_longer_accepted(probe: type[Probe]) -> None:
    line = wire.encode_line(sample(7))
    forget_kind(Probe)
    with pytest.raises(wire.InvalidRecord, match="field 'type' must be one of collective"):
        wire.decode_line(line)
    record_kind(Probe)  # the fixture forgets it again


def test_declarations_that_cannot_be_stored_are_refused() -> None:
    class NoWidth(RecordBase, frozen=True, tag="no_width_test_only"):
        TABLE: ClassVar[Stored] = Stored("no_width_test_only", time="t", order_by=("t",))
        t: int

    with pytest.raises(TypeError, match="declare the integer's width"):
        record_kind(NoWidth)

    class Twice(RecordBase, frozen=True, tag="collective"):
        TABLE: ClassVar[Stored] = Stored("twice_test_only", time="t", order_by=("t",))
        t: U64

    with pytest.raises(TypeError, match="'collective' is already declared by CollectiveEvent"):
        record_kind(Twice)

    class BadOrder(RecordBase, frozen=True, tag="bad_order_test_only"):
        TABLE: ClassVar[Stored] = Stored("bad_order_test_only", time="t", order_by=("nope",))
        t: U64

    with pytest.raises(TypeError, match="names column 'nope'"):
        record_kind(BadOrder)


def test_floats_must_be_finite_even_when_built_in_process(probe: type[Probe]) -> None:
    with pytest.raises(ValueError, match="field 'ratio' must be a finite number"):
        Probe(job=JobId("pj"), time_us=1, level=0, ratio=float("inf"))
