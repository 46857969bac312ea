"""The ingest endpoint over real HTTP: batches into a real embedded store, bad records rejected
one by one, and the answers a node agent retries on."""

from __future__ import annotations

import json
import logging
import socket
import struct
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clickhouse_harness import free_port

from tracehound.tracing.errors import PermanentStoreError, TemporaryStoreError
from tracehound.tracing.events import Batch, CollectiveEvent, CollectiveState, RankExit
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import InsertReport
from tracehound.tracing.store.embedded import EmbeddedClickHouseStore
from tracehound.tracing.store.ingest import IngestResult, IngestServer, post_batch
from tracehound.tracing.wire import encode, encode_batch

JOB = JobId("job-i")


def collective(rank: int, seq: int) -> CollectiveEvent:
    return CollectiveEvent(
        job=JOB, attempt=0, node=NodeId("n0"), rank=Rank(rank), group=GroupId("0"), seq=seq,
        op="all_reduce", nbytes=8, dtype="float32", peer=-1, state=CollectiveState.COMPLETED,
        enqueue_us=1_700_000_000_000_000 + seq, complete_us=1_700_000_000_000_100 + seq,
    )


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[EmbeddedClickHouseStore]:
    store = EmbeddedClickHouseStore(f"chdb://{tmp_path / 'store'}")
    store.ensure_schema()
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def server(embedded: EmbeddedClickHouseStore) -> Iterator[IngestServer]:
    with IngestServer(embedded) as running:
        yield running


def post_raw(url: str, body: bytes, query: str = "") -> tuple[int, dict[str, Any], Any]:
    request = urllib.request.Request(f"{url}/v1/batches{query}", data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read()), answer.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def test_a_batch_lands_in_the_store_exactly_once(
    server: IngestServer, embedded: EmbeddedClickHouseStore
) -> None:
    batch = Batch(batch_id="b1", records=(
        collective(0, 1), collective(1, 1),
        RankExit(job=JOB, attempt=0, node=NodeId("n0"), rank=Rank(1), pid=7, exit_code=-9,
                 time_us=5),
    ))
    first = post_batch(server.url, batch, maybe_duplicate=False)
    assert first == IngestResult(inserted=3, skipped=0, rejected=())
    retry = post_batch(server.url, batch, maybe_duplicate=True)
    assert retry == IngestResult(inserted=0, skipped=3, rejected=())

    assert sorted((k.rank, k.seq) for k in embedded.collective_keys(JOB)) == [(0, 1), (1, 1)]
    assert [e.exit_code for e in embedded.exits(JOB, 0)] == [-9]
    assert (server.batches_total, server.inserted_total, server.skipped_total) == (2, 3, 3)


def test_bad_records_are_rejected_and_the_good_ones_kept(
    server: IngestServer, embedded: EmbeddedClickHouseStore, caplog: pytest.LogCaptureFixture
) -> None:
    good = [dict(encode(collective(0, s))) for s in (1, 2, 3)]
    records = [
        good[0],
        {**good[1], "seq": -1},
        good[1],
        {**good[2], "state": "exploded"},
        good[2],
    ]
    body = json.dumps({"batch_id": "b-mixed", "records": records}).encode()
    with caplog.at_level(logging.WARNING, logger="tracehound.tracing.store.ingest"):
        status, payload, _ = post_raw(server.url, body, "?maybe_duplicate=1")
    assert status == 200
    assert payload["inserted"] == 3
    assert payload["skipped"] == 0
    assert [r["index"] for r in payload["rejected"]] == [1, 3]
    assert "field 'seq'" in payload["rejected"][0]["reason"]
    assert "field 'state'" in payload["rejected"][1]["reason"]
    assert server.rejected_total == 2
    assert "b-mixed: rejected 2 of 5 records" in caplog.text
    assert sorted(k.seq for k in embedded.collective_keys(JOB)) == [1, 2, 3]


def test_post_batch_reports_rejections(server: IngestServer) -> None:
    result = post_batch(server.url + "/v1/batches", Batch(batch_id="b", records=()),
                        maybe_duplicate=True)
    assert result == IngestResult(inserted=0, skipped=0, rejected=())


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"{nope", "malformed batch: a batch must be JSON"),
        (b'{"records": []}', "malformed batch: missing field 'batch_id'"),
        (b'{"batch_id": "b", "records": {}}', "field 'records' must be a list"),
    ],
)
def test_a_malformed_batch_is_a_400_with_a_clear_error(
    server: IngestServer, body: bytes, complaint: str
) -> None:
    status, payload, _ = post_raw(server.url, body)
    assert status == 400
    assert complaint in payload["error"]


def test_post_batch_raises_permanent_on_400(server: IngestServer) -> None:
    with pytest.raises(PermanentStoreError, match=r"400.*batch_id"):
        post_batch(server.url, Batch(batch_id="", records=(collective(0, 1),)),
                   maybe_duplicate=False)


def test_unknown_path_is_404(server: IngestServer) -> None:
    request = urllib.request.Request(f"{server.url}/v2/other", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 404


class OutageStore:
    """Our own port, faked: a store that is down. (The real adapters' outage behaviour is
    tested in test_store_errors against a real closed port.)"""

    url = "chdb:///fake"

    def insert(self, batch: Batch, *, maybe_duplicate: bool = False) -> InsertReport:
        raise TemporaryStoreError("store is down for maintenance", retry_after=2.5)


def test_a_store_outage_is_a_503_with_retry_after() -> None:
    with IngestServer(OutageStore()) as server:  # type: ignore[arg-type]
        body = json.dumps({"batch_id": "b", "records": [encode(collective(0, 1))]}).encode()
        status, payload, headers = post_raw(server.url, body)
        assert status == 503
        assert headers["Retry-After"] == "3"
        assert "down for maintenance" in payload["error"]

        with pytest.raises(TemporaryStoreError) as caught:
            post_batch(server.url, Batch(batch_id="b", records=(collective(0, 1),)),
                       maybe_duplicate=True)
        assert caught.value.retry_after == 3.0
        assert "503" in str(caught.value)


def test_an_unreachable_endpoint_is_temporary() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TemporaryStoreError, match="unreachable") as caught:
        post_batch(url, Batch(batch_id="b", records=()), maybe_duplicate=False)
    assert url in str(caught.value)


def test_stop_then_url_says_not_running(embedded: EmbeddedClickHouseStore) -> None:
    server = IngestServer(embedded).start()
    assert server.url.startswith("http://127.0.0.1:")
    server.stop()
    server.stop()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url


def test_a_sender_that_resets_before_its_answer_is_counted_and_the_next_is_served(
        server: IngestServer, capfd: pytest.CaptureFixture[str]) -> None:
    """A node agent whose request timed out closes its connection; the endpoint counts that
    instead of printing socketserver's traceback, and goes on serving."""
    host, port = server.url.removeprefix("http://").split(":")
    body = encode_batch(Batch(batch_id="gone", records=(collective(0, 1),)))
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body) + 100}"
                     f"\r\n\r\n".encode() + body)
        # closed with a reset (linger 0) while the endpoint waits for the rest of the body
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    deadline = time.monotonic() + 30
    while server.senders_gone_total == 0:
        assert time.monotonic() < deadline, "the reset connection was never counted"
        time.sleep(0.05)
    following = Batch(batch_id="next", records=(collective(0, 2),))
    status, payload, _ = post_raw(server.url, encode_batch(following))
    assert status == 200 and payload["inserted"] == 1
    assert server.senders_gone_total == 1
    assert "Traceback" not in capfd.readouterr().err
