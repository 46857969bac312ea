"""The store URLs the store fixtures hand out, one per adapter: `store_url` of tests/conftest.py,
and of tests/tracing (which adds the client of an embedded store another process holds)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

CLUSTER_MARKS = (pytest.mark.clickhouse_server, pytest.mark.clickhouse_cluster,
                 pytest.mark.xdist_group("clickhouse-cluster"))
"""The marks of every test of the store's cluster mode: they share the test server's shard
databases, so they all go to one xdist worker, one after the other (`--dist loadgroup`), and the
serial lane leaves them to the parallel one (`clickhouse_cluster`)."""


def with_database(url: str, database: str) -> str:
    return urlsplit(url)._replace(path=f"/{database}").geturl()


def drop_server_store(url: str) -> None:
    """Drop a server store's database (and, in cluster mode, every shard's local tables)."""
    from tracehound.tracing.store.server import ClickHouseServerStore

    cleanup = ClickHouseServerStore(url)
    try:
        cleanup.drop_database()
    finally:
        cleanup.close()


STORE_ADAPTERS = [
    pytest.param("server", marks=pytest.mark.clickhouse_server, id="server"),
    pytest.param("cluster", marks=CLUSTER_MARKS, id="cluster"),
    pytest.param("embedded", id="embedded"),
]
"""The adapters `store_url` hands out a store of (tests/tracing adds the client of an embedded
store that another process holds)."""


def on_adapter(adapter: str, *values: object) -> object:
    """One case of a test parametrized over `store_url` (indirectly) and its own values
    together, on one adapter with that adapter's marks: for a test whose cases need not each
    run on every adapter."""
    (param,) = (p for p in STORE_ADAPTERS if p.id == adapter)
    return pytest.param(adapter, *values, marks=param.marks,
                        id="-".join([adapter, *map(str, values)]))


def store_url_of(adapter: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store URL of one adapter for one test.

    - server: the session's ClickHouse server with a new database `tracehound_t<random>`,
      dropped after the test.
    - cluster: the same in cluster mode over the server's own two-shard cluster
      (`cluster_url`); skipped when a server given by URL does not define that cluster.
    - embedded: `chdb://<tmp_path>/chdb`, a new directory per test.

    chdb lets one process hold only ONE data directory at a time ("EmbeddedServer already
    initialized with path ..."), but once every store on it is closed the same process can open
    another directory (checked with chdb 4.4: open a, close, open b, close, reopen a all work;
    ~0.1 s per open + schema). So embedded tests run in the pytest process with a fresh
    directory each, and every test must close its embedded store before the next one opens:
    use the `store` fixture, or `with open_store(url) as store` / `store.close()`.
    """
    if adapter == "embedded":
        yield f"chdb://{tmp_path / 'chdb'}"
        return
    if adapter == "cluster":
        yield request.getfixturevalue("cluster_url")
        return
    server_url: str = request.getfixturevalue("clickhouse_url")
    url = with_database(server_url, f"tracehound_t{uuid.uuid4().hex[:12]}")
    yield url
    drop_server_store(url)
