"""What a store says when it cannot work: bad URLs, an unreachable server, a refused query, an
embedded directory another process holds."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from clickhouse_harness import free_port
from holder_harness import is_shared

from tracehound.tracing.errors import (
    PermanentStoreError,
    StoreConfigError,
    TemporaryStoreError,
)
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store
from tracehound.tracing.store.embedded import EmbeddedClickHouseStore
from tracehound.tracing.store.server import ClickHouseServerStore


@pytest.mark.parametrize(
    ("url", "shown", "complaint"),
    [
        ("mysql://db.example:3306/tracehound", "mysql://db.example:3306/tracehound",
         "unknown scheme 'mysql'"),
        ("localhost:9000", "localhost:9000", "unknown scheme"),
        ("clickhouse:///tracehound", "clickhouse:///tracehound", "names no host"),
        ("clickhouse://u:secret@ch.example:99999/db", "clickhouse://u:***@ch.example:99999/db",
         "bad port"),
        ("clickhouse://ch.example:nine/db", "clickhouse://ch.example:nine/db", "bad port"),
        ("clickhouse://ch.example:9000/trace-hound", "clickhouse://ch.example:9000/trace-hound",
         "database name 'trace-hound'"),
        ("clickhouse://ch.example:9000/db;drop", "clickhouse://ch.example:9000/db;drop",
         "database name"),
        ("chdb://", "chdb://", "names no directory"),
    ],
)
def test_malformed_urls_are_config_errors_naming_the_url(
    url: str, shown: str, complaint: str
) -> None:
    with pytest.raises(StoreConfigError) as caught:
        open_store(url)
    message = str(caught.value)
    assert shown in message
    assert complaint in message
    assert "secret" not in message


def test_an_unreachable_server_is_a_temporary_error_naming_the_masked_url() -> None:
    port = free_port()  # nothing listens here
    url = f"clickhouse://default:s3cret@127.0.0.1:{port}/tracehound"
    with pytest.raises(TemporaryStoreError) as caught:
        open_store(url)
    message = str(caught.value)
    assert f"clickhouse://default:***@127.0.0.1:{port}/tracehound is unreachable" in message
    assert "s3cret" not in message
    assert caught.value.__cause__ is not None


def test_an_unreachable_server_fails_every_call_and_recovers_nothing_silently() -> None:
    store = ClickHouseServerStore(f"clickhouse://127.0.0.1:{free_port()}/tracehound")
    try:
        for call in (store.jobs, lambda: store.attempts(JobId("j"))):
            with pytest.raises(TemporaryStoreError):
                call()
    finally:
        store.close()


@pytest.mark.clickhouse_server
def test_a_query_the_server_refuses_is_permanent(clickhouse_url: str) -> None:
    # The database of this URL was never created: the server answers UNKNOWN_DATABASE.
    store = ClickHouseServerStore(clickhouse_url.rsplit("/", 1)[0] + "/tracehound_missing_db")
    try:
        with pytest.raises(PermanentStoreError) as caught:
            store.jobs()
        assert "tracehound_missing_db" in str(caught.value)
        assert "Stack trace" not in str(caught.value)
    finally:
        store.close()


def test_a_query_before_the_schema_exists_is_permanent_on_both(
    store_url: str, request: pytest.FixtureRequest
) -> None:
    if is_shared(request):
        pytest.skip("the holder made the schema when it opened the directory (a bare holder's "
                    "refusal crossing to a client: test_store_sharing)")
    store = open_store(store_url, create=False)
    try:
        with pytest.raises(PermanentStoreError):
            store.exits(JobId("j"), 0)
    finally:
        store.close()


_HOLDER = textwrap.dedent(
    """
    import sys
    from tracehound.tracing.store import open_store
    store = open_store(sys.argv[1])
    print("holding", flush=True)
    sys.stdin.read()
    store.close()
    """
)


def test_an_embedded_directory_held_by_another_process_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "held"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, f"chdb://{path}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(StoreConfigError) as caught:
            EmbeddedClickHouseStore(f"chdb://{path}")
        message = str(caught.value)
        assert str(path) in message
        assert f"another process (pid {holder.pid})" in message
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait()
    # Once the other process let go, this one can open it.
    store = EmbeddedClickHouseStore(f"chdb://{path}")
    try:
        assert store.jobs() == []
    finally:
        store.close()


def test_one_process_holds_one_embedded_directory_at_a_time(tmp_path: Path) -> None:
    first = EmbeddedClickHouseStore(f"chdb://{tmp_path / 'one'}")
    try:
        with pytest.raises(StoreConfigError) as caught:
            EmbeddedClickHouseStore(f"chdb://{tmp_path / 'two'}")
        assert str(tmp_path / "two") in str(caught.value)
        assert "only one at a time" in str(caught.value)
        # The same directory again is fine: chdb shares it within the process.
        again = EmbeddedClickHouseStore(f"chdb://{tmp_path / 'one'}")
        again.close()
        first.ensure_schema()
    finally:
        first.close()
    second = EmbeddedClickHouseStore(f"chdb://{tmp_path / 'two'}")
    second.close()


def test_a_closed_embedded_store_says_so(tmp_path: Path) -> None:
    store = EmbeddedClickHouseStore(f"chdb://{tmp_path / 's'}")
    store.close()
    with pytest.raises(PermanentStoreError, match="is closed"):
        store.jobs()
