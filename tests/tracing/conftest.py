"""Makes the helper modules beside these tests importable (`summary_data`); the
suite runs with `--import-mode=importlib`, which puts no test directory on sys.path.

The store tests here run against one more adapter than elsewhere: `shared`, the client of an
embedded store that another process holds and shares (`store.client`), the way `tracehound
diagnose` reads the store of a running `tracehound run`. The holder is one real process per
test session (`holder_harness`), which opens and shares a fresh directory for each test; the
test's store is what `open_store` gives for that directory in this process: a client.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from holder_harness import SHARED, StoreHolder
from store_urls import STORE_ADAPTERS, store_url_of


@pytest.fixture(scope="session")
def store_holder() -> Iterator[StoreHolder]:
    """The session's holder process."""
    holder = StoreHolder()
    try:
        yield holder
    finally:
        holder.stop()


@pytest.fixture(params=[*STORE_ADAPTERS, pytest.param(SHARED, id=SHARED)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store URL per test, once for each adapter: those of tests/conftest.py,
    and `shared`, a chdb directory the session's holder process holds and shares."""
    if request.param != SHARED:
        yield from store_url_of(request.param, request, tmp_path)
        return
    holder: StoreHolder = request.getfixturevalue("store_holder")
    url = f"chdb://{tmp_path / 'chdb'}"
    holder.hold(url)
    try:
        yield url
    finally:
        holder.release()

