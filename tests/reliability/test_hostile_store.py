"""Hostile names through the whole path into both store adapters: job, node and group names, ops,
dtypes and stack frames with quotes, SQL fragments, ClickHouse parameter syntax, backslashes and
escape sequences, tabs, newlines, NUL, right-to-left marks and emoji, up to the schema's limit of
MAX_TEXT characters, are decoded from the wire, stored and read back verbatim, on the ClickHouse
server (plain and cluster mode) and in chdb. Nothing is executed: the tables are all still
there afterwards and every count is exact. A name one character over the limit is a counted
rejection naming the field, never a truncated row."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from store_urls import on_adapter

from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    HealthSample,
    HealthSeverity,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.kinds import MAX_TEXT
from tracehound.tracing.store import InsertReport, TraceStore, open_store
from tracehound.tracing.store.engine import SqlTraceStore
from tracehound.tracing.wire import batch_of_lines, decode_batch, encode_line

HOSTILE = [
    "'); DROP TABLE collectives; --",
    "\"; DROP DATABASE IF EXISTS tracehound; --",
    "{job:String}", "{db}", "{table}", "%(job)s", "%s", "?", "$1",
    "it's", "back\\slash", "\\", "\\N", "\\0", "\\x00", "\\'", "''", "\"",
    "tab\there", "new\nline", "cr\rreturn", "nul\x00inside", "\x00",
    "\u202eevil\u202c", "\u200f\u05e9\u05dc\u05d5\u05dd", "emoji \U0001f525\U0001f4a5",
    "\ufeffbom", "` backtick", "/* comment */", "SELECT 1 UNION ALL SELECT 2",
]
"""Names a store that splices text into SQL, or escapes it badly, would break on."""

names = st.sampled_from(HOSTILE) | st.text(st.characters(blacklist_categories=("Cs",)),
                                           min_size=1, max_size=40)
at_limit = st.sampled_from(["j", "\U0001f525", "'", "\\", "\x00", "\n"]).map(
    lambda c: c * MAX_TEXT)

_attempts = itertools.count(1)
_stored: dict[str, set[str]] = {}
"""Every job name each store (by URL) has been given by the examples so far."""

T0 = 1_700_000_000_000_000


def records_for(name: str, attempt: int, rank: int) -> list[Any]:
    """One record of each kind that carries text, every text field holding `name`."""
    return [
        CollectiveEvent(
            job=JobId(name), attempt=attempt, node=NodeId(name), rank=Rank(rank),
            group=GroupId(name), seq=1, op=name, nbytes=4, dtype=name, peer=-1,
            state=CollectiveState.COMPLETED, enqueue_us=T0 + rank, complete_us=T0 + rank + 1),
        RankExit(job=JobId(name), attempt=attempt, node=NodeId(name), rank=Rank(rank), pid=3,
                 exit_code=-9, time_us=T0 + rank),
        StackSample(job=JobId(name), attempt=attempt, node=NodeId(name), rank=Rank(rank),
                    time_us=T0 + rank, frames=(name, "", name)),
        HealthSample(job=JobId(name), node=NodeId(name), device=name, time_us=T0 + attempt,
                     source=name, metric=name, value=1.5, severity=HealthSeverity.WARNING,
                     detail=name),
    ]


def over_limit(line: bytes, name: str) -> bytes:
    """`line` with its job one character past the limit (a JSON string spliced in, at the
    `job` key: a name such as `":"` also matches the text between another key and its value)."""
    cut = line.replace(b'"job":' + msgspec.json.encode(name),
                       b'"job":' + msgspec.json.encode("x" * (MAX_TEXT + 1)), 1)
    assert cut != line
    return cut


def check_store(store: TraceStore, url: str, jobs: list[str]) -> None:
    attempt = next(_attempts)
    records = [r for rank, name in enumerate(jobs) for r in records_for(name, attempt, rank)]
    lines = [encode_line(r) for r in records]
    bad = [over_limit(encode_line(records_for(jobs[0], attempt, 99)[1]), jobs[0])]
    decoded = decode_batch(batch_of_lines(f"hostile/{attempt}/{jobs[0]}", lines + bad))

    assert list(decoded.batch.records) == records
    assert [(r.index, r.reason) for r in decoded.rejected] == [
        (len(lines), f"field 'job' must be at most {MAX_TEXT} characters")]
    assert store.insert(decoded.batch) == InsertReport(inserted=len(records), skipped=0)
    assert store.insert(decoded.batch, maybe_duplicate=True) == InsertReport(
        inserted=0, skipped=len(records))

    assert isinstance(store, SqlTraceStore)
    stored = _stored.setdefault(url, set())
    stored.update(jobs)
    for kind in (CollectiveEvent, RankExit, StackSample):
        for name in set(jobs):
            mine = [r for r in store.records(kind, JobId(name)) if r.attempt == attempt]
            assert mine == sorted((r for r in records if isinstance(r, kind) and r.job == name),
                                  key=lambda r: r.rank), (kind, name)
    for name in set(jobs):
        assert store.collectives(JobId(name), attempt) == [
            r for r in records if isinstance(r, CollectiveEvent) and r.job == name]
        assert store.exits(JobId(name), attempt) == [
            r for r in records if isinstance(r, RankExit) and r.job == name]
        health = store.health([name], T0 + attempt, T0 + attempt + 1)
        assert [(h.job, h.node, h.device, h.source, h.metric, h.detail) for h in health] == [
            (name,) * 6]
    # nothing was executed and nothing cut: every table still answers, with exact counts
    assert store.jobs() == sorted(stored)
    for name in stored:
        assert len(store.collective_keys(JobId(name))) == len(
            store.records(CollectiveEvent, JobId(name)))


STORE = settings(max_examples=12, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


# on the server and the embedded engine: cluster mode stores these rows through the same
# client as the server (its schema under every hostile name: the ingest test below)
@pytest.mark.parametrize("store_url", [on_adapter("server"), on_adapter("embedded")],
                         indirect=True)
@STORE
@given(jobs=st.lists(names, min_size=1, max_size=4, unique=True))
@example(jobs=HOSTILE[:8])
@example(jobs=HOSTILE[8:16])
@example(jobs=HOSTILE[16:24])
@example(jobs=HOSTILE[24:])
def test_hostile_names_are_stored_and_read_back_verbatim(store_url: str,
                                                         jobs: list[str]) -> None:
    with open_store(store_url) as store:
        check_store(store, store_url, jobs)


@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=st.lists(at_limit, min_size=1, max_size=2, unique=True))
def test_names_at_the_limit_are_stored_whole(store_url: str, jobs: list[str]) -> None:
    with open_store(store_url) as store:
        check_store(store, store_url, jobs)


def test_the_ingest_batch_of_every_hostile_name_leaves_the_schema_whole(store_url: str) -> None:
    """All of them in one batch, then a fresh store on the same URL finds every table in place
    (ensure_schema creates nothing new) and the same rows."""
    with open_store(store_url) as store:
        check_store(store, store_url, HOSTILE)
        before = {name: len(store.records(CollectiveEvent, JobId(name))) for name in HOSTILE}
    with open_store(store_url) as again:
        assert again.jobs() == sorted(_stored[store_url])
        assert {name: len(again.records(CollectiveEvent, JobId(name)))
                for name in HOSTILE} == before
        assert again.insert(Batch(batch_id="after", records=tuple(
            records_for("after", 0, 0)))) == InsertReport(inserted=4, skipped=0)
