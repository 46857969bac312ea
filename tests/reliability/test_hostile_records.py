"""Hostile records from ranks: the wire decoder and the ingest endpoint take arbitrary bytes and
arbitrary JSON without an exception escaping, a 500 or a dropped connection. A malformed batch
is a named 400 (InvalidRecord); a bad record inside a well-formed batch is rejected by its index
with a reason, and every good record of the same batch is kept, in order, and stored.

The inputs that once broke the decoder stay here as explicit examples: JSON nested deeper than
the recursion limit, integers of more than 4300 digits (Python's json refuses to convert them),
a `str` batch holding a lone surrogate, and `\\ud800` escapes (JSON allows a lone surrogate; no
store can keep one, so it used to fail the whole batch's insert)."""

from __future__ import annotations

import http.client
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tracehound.tracing.events import RankExit
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.kinds import MAX_TEXT
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.store.ingest import BATCHES_PATH, IngestServer
from tracehound.tracing.wire import (
    DecodedBatch,
    InvalidRecord,
    batch_of_lines,
    decode_batch,
    decode_line,
    encode_line,
)

FUZZ = settings(max_examples=150, deadline=None)
DEEP = b"[" * 100_000
HUGE_INT = b"1" * 5000

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=4),
    max_leaves=12,
)


def exit_record(job: str, rank: int) -> RankExit:
    return RankExit(job=JobId(job), attempt=0, node=NodeId("node-0"), rank=Rank(rank), pid=100,
                    exit_code=-9, time_us=1_700_000_000_000_000 + rank)


def with_field(line: bytes, field: str, raw_json: bytes) -> bytes:
    """A record's wire line with one field's JSON replaced by `raw_json` (kept undecoded, so
    the line can carry what Python's json would not write)."""
    doc = json.loads(line)
    marker = "\u2063hostile\u2063"
    doc[field] = marker
    return json.dumps(doc, ensure_ascii=False).encode().replace(
        json.dumps(marker, ensure_ascii=False).encode(), raw_json)


def bad_lines(good: bytes) -> st.SearchStrategy[tuple[bytes, str]]:
    """Records no decoder may accept, each with a word its rejection must contain."""
    return st.one_of(
        json_values.filter(lambda v: not isinstance(v, dict)).map(
            lambda v: (json.dumps(v).encode(), "")),
        st.text(min_size=1, max_size=12).filter(lambda t: t not in ("exit", "collective")).map(
            lambda t: (with_field(good, "type", json.dumps(t).encode()), "type")),
        st.sampled_from(["job", "node"]).map(
            lambda f: (with_field(good, f, json.dumps("x" * (MAX_TEXT + 1)).encode()), f)),
        st.sampled_from(["job", "node"]).map(
            lambda f: (with_field(good, f, b'"\\ud800 lone"'), f)),
        st.sampled_from([b"-1", b"2147483648", b"1.5", b'"7"', b"null", HUGE_INT]).map(
            lambda v: (with_field(good, "rank", v), "")),
        st.integers(min_value=1, max_value=500).map(
            lambda depth: (with_field(good, "pid", b"[" * depth + b"]" * depth), "pid")),
    )


Case = tuple[str, list[bytes], list[RankExit], list[tuple[int, str]]]


@st.composite
def mixed_batches(draw: st.DrawFn, job: str | None = None) -> Case:
    """A well-formed batch of good and bad records: (batch id, its lines, the good records in
    order, (index, word) of each bad one)."""
    job = job if job is not None else draw(st.text(min_size=1, max_size=20))
    goods: list[RankExit] = []
    bads: list[tuple[int, str]] = []
    lines: list[bytes] = []
    for index in range(draw(st.integers(min_value=0, max_value=12))):
        record = exit_record(job, index)
        if draw(st.booleans()):
            goods.append(record)
            lines.append(encode_line(record))
        else:
            line, word = draw(bad_lines(encode_line(record)))
            bads.append((index, word))
            lines.append(line)
    return draw(st.text(min_size=1, max_size=20)), lines, goods, bads


def check_mixed(decoded: DecodedBatch, goods: list[RankExit],
                bads: list[tuple[int, str]]) -> None:
    assert list(decoded.batch.records) == goods
    assert [r.index for r in decoded.rejected] == [index for index, _ in bads]
    for rejection, (_, word) in zip(decoded.rejected, bads, strict=True):
        assert rejection.reason
        assert word in rejection.reason


@FUZZ
@given(data=st.binary(max_size=300))
@example(data=DEEP)
@example(data=b'{"batch_id": "b", "records": [' + DEEP + b"]}")
@example(data=b'{"batch_id": "b", "records": [' + HUGE_INT + b"]}")
@example(data=b'{"batch_id": "\\udfff", "records": []}')
@example(data=b'{"batch_id": "b", "records": [NaN, Infinity]}')
@example(data=b"\xff\xfe{}")
def test_arbitrary_bytes_decode_or_give_a_named_invalid_record(data: bytes) -> None:
    try:
        decoded = decode_batch(data)
    except InvalidRecord as exc:
        assert str(exc)
        return
    assert len(decoded.batch.records) + len(decoded.rejected) == records_in(data)


class _Envelope(msgspec.Struct):
    records: list[msgspec.Raw]


def records_in(data: bytes) -> int:
    """How many records a batch that decoded holds (its records as raw JSON texts)."""
    try:
        return len(msgspec.json.decode(data, type=_Envelope).records)
    except msgspec.DecodeError:  # NaN, Infinity: only Python's json reads them
        return len(json.loads(data)["records"])


@FUZZ
@given(text=st.text(max_size=200))
@example(text='{"batch_id": "\ud800", "records": []}')
def test_arbitrary_text_decodes_or_gives_a_named_invalid_record(text: str) -> None:
    try:
        decode_batch(text)
    except InvalidRecord as exc:
        assert str(exc)
    try:
        decode_line(text)
    except InvalidRecord as exc:
        assert str(exc)


@FUZZ
@given(value=json_values)
def test_arbitrary_json_values_as_batches_and_lines(value: Any) -> None:
    body = json.dumps(value).encode()
    for decode in (decode_batch, decode_line):
        try:
            decode(body)
        except InvalidRecord as exc:
            assert str(exc)


@FUZZ
@given(case=mixed_batches())
def test_bad_records_are_rejected_by_index_and_good_ones_kept(case: Case) -> None:
    batch_id, lines, goods, bads = case
    check_mixed(decode_batch(batch_of_lines(batch_id, lines)), goods, bads)


def test_a_record_nested_past_any_parser_makes_the_batch_a_named_invalid_record() -> None:
    good = encode_line(exit_record("j", 0))
    with pytest.raises(InvalidRecord, match="nested too deep"):
        decode_batch(batch_of_lines("b", [good, DEEP[:5000] + b"]" * 5000, good]))


@FUZZ
@given(good=st.builds(exit_record, st.text(min_size=1, max_size=30), st.integers(0, 99)),
       data=st.data())
def test_one_line_from_a_rank_is_a_record_or_a_named_rejection(good: RankExit,
                                                               data: st.DataObject) -> None:
    line = encode_line(good)
    assert decode_line(line) == good
    bad, word = data.draw(bad_lines(line))
    with pytest.raises(InvalidRecord, match=word or None):
        decode_line(bad)
    torn = line[:data.draw(st.integers(min_value=1, max_value=len(line) - 1))]
    with pytest.raises(InvalidRecord, match="must be JSON"):
        decode_line(torn)


def test_a_name_one_character_over_the_limit_is_rejected_not_cut() -> None:
    at_limit = exit_record("j" * MAX_TEXT, 0)
    over = with_field(encode_line(at_limit), "job", json.dumps("j" * (MAX_TEXT + 1)).encode())
    decoded = decode_batch(batch_of_lines("b", [encode_line(at_limit), over]))
    assert decoded.batch.records == (at_limit,)
    [rejection] = decoded.rejected
    assert rejection.index == 1
    assert rejection.reason == f"field 'job' must be at most {MAX_TEXT} characters"


# -- the ingest endpoint over real HTTP, into a real (embedded) store ---------------------------


@pytest.fixture
def endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[tuple[IngestServer, TraceStore]]:
    monkeypatch.delenv("TRACEHOUND_INGEST_TOKEN", raising=False)
    store = open_store(f"chdb://{tmp_path / 'chdb'}")
    server = IngestServer(store).start()
    try:
        yield server, store
    finally:
        server.stop()
        store.close()


def post(server: IngestServer, body: bytes) -> tuple[int, dict[str, Any]]:
    """POST raw bytes; the answer's status and JSON (a dropped connection raises)."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", BATCHES_PATH, body=body,
                           headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        payload: dict[str, Any] = json.loads(answer.read())
        return answer.status, payload
    finally:
        connection.close()


_serial = itertools.count()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
@example(data=DEEP)
@example(data=b'{"batch_id": "b", "records": [' + HUGE_INT + b"]}")
@example(data=b'{"batch_id": "\\ud800", "records": []}')
def test_the_endpoint_answers_arbitrary_bodies_with_400_or_200_never_500(
    endpoint: tuple[IngestServer, TraceStore], data: bytes,
) -> None:
    server, _ = endpoint
    status, payload = post(server, data)
    assert status in (200, 400), (status, payload)
    if status == 400:
        assert payload["error"].startswith("malformed batch: ")
    else:
        assert payload["inserted"] == 0


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_endpoint_stores_the_good_records_and_counts_each_bad_one(
    endpoint: tuple[IngestServer, TraceStore], data: st.DataObject,
) -> None:
    server, store = endpoint
    # a job of this example's own, so examples share the store without meeting
    job = f"ingest-{next(_serial)}"
    batch_id, lines, goods, bads = data.draw(mixed_batches(job=job))
    rejected_before = server.rejected_total
    status, payload = post(server, batch_of_lines(f"{job}/{batch_id}", lines))
    assert status == 200, payload
    assert payload["inserted"] == len(goods)
    assert payload["skipped"] == 0
    assert [r["index"] for r in payload["rejected"]] == [index for index, _ in bads]
    assert server.rejected_total - rejected_before == len(bads)
    assert store.exits(JobId(job), 0) == goods
