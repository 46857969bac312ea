"""Opening the store for a controller run, the ingest endpoint an embedded store needs, and the
sharing of an embedded store with the other processes of the machine.

With a ClickHouse server, node agents write to it directly (the sink is the store URL). With
the embedded store only one process may open it. When this process is the one, an ingest
endpoint in it takes the agents' batches (the sink is the endpoint's http:// URL), and the same
endpoint serves the store to the machine's other processes (`tracing.store.sharing`: the
dashboard, `tracehound diagnose`, a watcher) for as long as the session lasts. When another
process holds the store already (a dashboard started first), this process reaches it through
that one like any other, and its endpoint passes the agents' batches on.

The endpoint always has a token: the configured $TRACEHOUND_INGEST_TOKEN, else one made for the
session, which the node agents started in it inherit and the endpoint file gives the store's
other readers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from tracehound.controller.cli.options import own_ingest_token
from tracehound.tracing.settings import TRACEHOUND_STORE, env_str
from tracehound.tracing.store import TraceStore, default_store_url, is_embedded, open_store
from tracehound.tracing.store.ingest import IngestServer
from tracehound.tracing.store.sharing import sharing


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
    if not is_embedded(resolved):
        store = open_store(resolved)
        try:
            yield StoreSession(store, resolved, resolved)
        finally:
            store.close()
        return
    with own_ingest_token() as token:
        store = open_store(resolved)
        try:
            server = IngestServer(store, token=token)
            server.start()
            try:
                with sharing(store, server):
                    yield StoreSession(store, resolved, server.url)
            finally:
                server.stop()
        finally:
            store.close()
