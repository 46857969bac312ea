"""The dashboard never writes to the store it shows.

On the real ClickHouse server: the store the dashboard opens (`ui.store.shared_store`) carries
ClickHouse's `readonly=2` setting on every query, so the server itself refuses a write or a
DDL statement from it, while a store opened normally on the same URL writes. And every view of
the dashboard, run headless (Streamlit's AppTest) over a filled store, leaves the row count of
every table of the store's database as it found it.

The embedded store (chdb) has no such guard: the dashboard opens it without creating anything
and its code has no write path; and chdb lets only one process hold the directory, so a
dashboard on it cannot run beside a writer anyway.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tracehound.tracing.errors import PermanentStoreError
from tracehound.tracing.events import JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store
from tracehound.tracing.store.server import ClickHouseServerStore
from tracehound.ui.store import close_shared_store, shared_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ui"))  # for `import ui_harness`

pytestmark = pytest.mark.clickhouse_server


@pytest.fixture
def server_store_url(clickhouse_url: str) -> Iterator[str]:
    url = urlsplit(clickhouse_url)._replace(
        path=f"/tracehound_ro{uuid.uuid4().hex[:10]}").geturl()
    close_shared_store()
    try:
        yield url
    finally:
        close_shared_store()
        cleanup = ClickHouseServerStore(url)
        try:
            cleanup.drop_database()
        finally:
            cleanup.close()


def row_counts(url: str) -> dict[str, int]:
    """Rows of every table of the store's database, read through a connection of its own."""
    from clickhouse_driver import Client

    parts = urlsplit(url)
    database = parts.path.strip("/")
    client = Client(host=parts.hostname or "127.0.0.1", port=parts.port or 9000,
                    user=parts.username or "default", password=parts.password or "")
    try:
        tables = [name for (name,) in client.execute(
            "SELECT name FROM system.tables WHERE database = %(d)s AND engine NOT LIKE "
            "'%%View' ORDER BY name", {"d": database})]
        return {name: int(client.execute(f"SELECT count() FROM `{database}`.`{name}`")[0][0])
                for name in tables}
    finally:
        client.disconnect()


def state(at: int) -> JobState:
    return JobState(job=JobId("ro-probe"), time_us=at, seq=1, state=JobPhase.RUNNING,
                    attempt=0, nodes=("n0",))


def test_the_dashboards_store_is_refused_every_write(server_store_url: str) -> None:
    writer = open_store(server_store_url)
    try:
        writer.record_state(state(1_700_000_000_000_000))  # a store opened normally writes
    finally:
        writer.close()
    opened = shared_store(server_store_url)
    assert opened.error is None and opened.store is not None
    before = row_counts(server_store_url)
    with pytest.raises(PermanentStoreError) as raised:
        opened.store.record_state(state(1_700_000_000_000_001))
    assert "readonly" in str(raised.value).lower()
    with pytest.raises(PermanentStoreError):
        opened.store.ensure_schema()
    assert opened.store.job_states(JobId("ro-probe"))[-1].time_us == 1_700_000_000_000_000
    assert row_counts(server_store_url) == before
    assert before["job_states"] == 1


def test_no_view_changes_a_row(server_store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from ui_harness import HOSTILE, UNLOCALIZED, app, fill_simulated

    fill_simulated(server_store_url)
    before = row_counts(server_store_url)
    # an incident each: two simulated jobs, the hostile one, the live stall, the unlocalized hang
    assert len(before) >= 8 and before["collectives"] > 0 and before["incidents"] == 5
    views = [("jobs", {}), ("incident", {"job": "sim-hang"}),
             ("incident", {"job": HOSTILE, "incident": "h/0/1"}),
             ("incident", {"job": "live"}), ("incident", {"job": UNLOCALIZED}),
             ("progress", {"job": "sim-hang", "group": "0"}),
             ("stragglers", {"job": "sim-straggler"}), ("health", {"job": "sim-hang"})]
    for view, params in views:
        app(server_store_url, view, monkeypatch, **params)
    assert row_counts(server_store_url) == before
