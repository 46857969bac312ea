"""Opening the store for a controller run, and the ingest endpoint an embedded store needs.

With a ClickHouse server, node agents write to it directly (the sink is the store URL). With
the embedded store only this process may open it, so an ingest endpoint in this process takes
the agents' batches (the sink is the endpoint's http:// URL).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from tracehound.tracing.settings import TRACEHOUND_STORE, env_str
from tracehound.tracing.store import TraceStore, default_store_url, is_embedded, open_store
from tracehound.tracing.store.ingest import IngestServer


@dataclass(frozen=True, slots=True)
class StoreSession:
    store: TraceStore
    url: str
    sink: str
    """Where node agents ship: the store itself, or this process' ingest endpoint."""


def resolve_store_url(url: str | None) -> str:
    return url or env_str(TRACEHOUND_STORE) or default_store_url()


@contextlib.contextmanager
def store_session(url: str | None) -> Iterator[StoreSession]:
    resolved = resolve_store_url(url)
    store = open_store(resolved)
    try:
        if is_embedded(resolved):
            server = IngestServer(store)
            server.start()
            try:
                yield StoreSession(store, resolved, server.url)
            finally:
                server.stop()
        else:
            yield StoreSession(store, resolved, resolved)
    finally:
        store.close()
