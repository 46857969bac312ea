"""Fixtures shared by the whole test suite: a real ClickHouse server, and store URLs for both
trace store adapters.

The server comes from `tests/clickhouse_harness.py` (Debian's clickhouse-server, started once per
session in a temp dir) unless TRACEHOUND_TEST_CLICKHOUSE_URL names a running one.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import clickhouse_harness`

from clickhouse_harness import start_server

from tracehound.tracing.store import TraceStore, open_store

CLICKHOUSE_URL_ENV = "TRACEHOUND_TEST_CLICKHOUSE_URL"


@pytest.fixture(scope="session")
def clickhouse_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real ClickHouse server: $TRACEHOUND_TEST_CLICKHOUSE_URL, else one this session
    starts (and stops at its end) with the harness."""
    given = os.environ.get(CLICKHOUSE_URL_ENV)
    if given:
        yield given
        return
    server = start_server(tmp_path_factory.mktemp("clickhouse-server"))
    try:
        yield server.url
    finally:
        server.stop()


def _with_database(url: str, database: str) -> str:
    return urlsplit(url)._replace(path=f"/{database}").geturl()


@pytest.fixture(
    params=[
        pytest.param("server", marks=pytest.mark.clickhouse_server, id="server"),
        pytest.param("embedded", id="embedded"),
    ]
)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store URL per test, once for each adapter.

    - server: the session's ClickHouse server with a new database `tracehound_t<random>`,
      dropped after the test.
    - embedded: `chdb://<tmp_path>/chdb`, a new directory per test.

    chdb lets one process hold only ONE data directory at a time ("EmbeddedServer already
    initialized with path ..."), but once every store on it is closed the same process can open
    another directory (checked with chdb 4.4: open a, close, open b, close, reopen a all work;
    ~0.1 s per open + schema). So embedded tests run in the pytest process with a fresh
    directory each, and every test must close its embedded store before the next one opens:
    use the `store` fixture, or `with open_store(url) as store` / `store.close()`.
    """
    if request.param == "embedded":
        yield f"chdb://{tmp_path / 'chdb'}"
        return
    server_url: str = request.getfixturevalue("clickhouse_url")
    url = _with_database(server_url, f"tracehound_t{uuid.uuid4().hex[:12]}")
    yield url
    from tracehound.tracing.store.server import ClickHouseServerStore

    cleanup = ClickHouseServerStore(url)
    try:
        cleanup.drop_database()
    finally:
        cleanup.close()


@pytest.fixture
def store(store_url: str) -> Iterator[TraceStore]:
    """An open store with its schema, on each adapter; closed after the test."""
    opened = open_store(store_url)
    try:
        yield opened
    finally:
        opened.close()
