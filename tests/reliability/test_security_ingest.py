"""The ingest endpoint of an embedded store: loopback unless configured, a token when not.

- An endpoint on an address other than loopback refuses to start without a token; with one
  (given, or from $TRACEHOUND_INGEST_TOKEN) it starts.
- With a token, a request without it or with a wrong one is answered 401 and stores nothing
  (counted in `unauthorized_total`); the sender gets a StoreConfigError, so a node agent keeps
  the batch spooled and sends it again once the token is right (a PermanentStoreError would set
  it aside); with the token (given, or from the same variable on the sender's side) the batch
  is stored.
- Without a token, an endpoint on loopback takes any local caller, as before.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.events import Batch, CollectiveEvent, CollectiveState
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.settings import TRACEHOUND_INGEST_TOKEN
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.store.ingest import IngestServer, is_loopback, post_batch

TOKEN = "ingest-token-3f9d-canary"


@pytest.fixture
def embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TraceStore]:
    monkeypatch.delenv(TRACEHOUND_INGEST_TOKEN, raising=False)
    store = open_store(f"chdb://{tmp_path / 'store'}")
    try:
        yield store
    finally:
        store.close()


def batch(batch_id: str, n: int = 3) -> Batch:
    return Batch(batch_id=batch_id, records=tuple(
        CollectiveEvent(
            job=JobId("tok"), attempt=0, node=NodeId("n0"), rank=Rank(0), group=GroupId("0"),
            seq=seq, op="all_reduce", nbytes=8, dtype="float32", peer=-1,
            state=CollectiveState.COMPLETED, enqueue_us=1_700_000_000_000_000 + seq,
            complete_us=1_700_000_000_000_100 + seq)
        for seq in range(1, n + 1)))


def stored(store: TraceStore) -> int:
    return len(store.collectives(JobId("tok"), 0))


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("", False), ("::", False), ("10.0.0.5", False),
    ("ingest.example", False),
])
def test_which_addresses_are_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "", "10.0.0.5"])
def test_an_endpoint_beyond_loopback_refuses_to_start_without_a_token(
        embedded: TraceStore, host: str) -> None:
    with pytest.raises(StoreConfigError) as raised:
        IngestServer(embedded, host=host)
    assert f"set ${TRACEHOUND_INGEST_TOKEN}" in str(raised.value)
    assert "without a token" in str(raised.value)


def test_an_endpoint_beyond_loopback_starts_with_the_token_of_the_environment(
        embedded: TraceStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRACEHOUND_INGEST_TOKEN, TOKEN)
    with IngestServer(embedded, host="0.0.0.0") as server:
        port = server.url.rsplit(":", 1)[1]
        url = f"http://127.0.0.1:{port}"
        # the sender reads the same variable
        result = post_batch(url, batch("env/1"), maybe_duplicate=False)
        assert (result.inserted, result.skipped) == (3, 0)
        monkeypatch.delenv(TRACEHOUND_INGEST_TOKEN)
        with pytest.raises(StoreConfigError):
            post_batch(url, batch("env/2"), maybe_duplicate=False)
        assert server.unauthorized_total == 1
    assert stored(embedded) == 3


def test_without_the_token_nothing_is_stored(embedded: TraceStore) -> None:
    with IngestServer(embedded, token=TOKEN) as server:
        for n, token in enumerate(("", "wrong-token", TOKEN + "x", TOKEN[:-1])):
            with pytest.raises(StoreConfigError) as raised:
                post_batch(server.url, batch(f"bad/{n}"), maybe_duplicate=False, token=token)
            assert "no or a wrong token" in str(raised.value)
            assert TOKEN not in str(raised.value)
        # a raw request: 401 with a Bearer challenge, whatever the scheme
        for header in (None, f"Basic {TOKEN}", TOKEN):
            request = urllib.request.Request(
                server.url + "/v1/batches", data=b"{}", method="POST",
                headers={} if header is None else {"Authorization": header})
            with pytest.raises(urllib.error.HTTPError) as answered:
                urllib.request.urlopen(request, timeout=5)
            assert answered.value.code == 401
            assert answered.value.headers["WWW-Authenticate"] == "Bearer"
            answered.value.close()
        assert server.unauthorized_total == 7
        assert server.batches_total == 0
        assert stored(embedded) == 0
        result = post_batch(server.url, batch("good/1"), maybe_duplicate=False, token=TOKEN)
        assert (result.inserted, result.skipped) == (3, 0)
        assert server.unauthorized_total == 7
    assert stored(embedded) == 3


def test_a_loopback_endpoint_without_a_token_takes_local_callers(embedded: TraceStore) -> None:
    with IngestServer(embedded) as server:
        assert server.url.startswith("http://127.0.0.1:")
        result = post_batch(server.url, batch("open/1"), maybe_duplicate=False)
        assert (result.inserted, result.skipped) == (3, 0)
        assert server.unauthorized_total == 0


def test_run_and_demo_give_their_loopback_endpoint_a_token_of_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tracehound.controller.cli.options import own_ingest_token

    # set, then removed: the test's end restores the variable's state from before it
    monkeypatch.setenv("TRACEHOUND_INGEST_TOKEN", "")
    monkeypatch.delenv("TRACEHOUND_INGEST_TOKEN")
    with own_ingest_token() as made:
        assert os.environ["TRACEHOUND_INGEST_TOKEN"] == made and len(made) >= 32
        with own_ingest_token() as inner:  # a token already there is kept
            assert inner == made
        assert os.environ["TRACEHOUND_INGEST_TOKEN"] == made
    # gone again: a process that runs `main` more than once does not keep a token of a run
    assert "TRACEHOUND_INGEST_TOKEN" not in os.environ
    monkeypatch.setenv("TRACEHOUND_INGEST_TOKEN", "configured")
    with own_ingest_token() as kept:
        assert kept == "configured"
    assert os.environ["TRACEHOUND_INGEST_TOKEN"] == "configured"
