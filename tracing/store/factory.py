"""Opening the store a URL names. Adapters import their client libraries lazily, so importing
this module costs nothing."""

from __future__ import annotations

from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.store.port import TraceStore
from tracehound.tracing.store.urls import default_store_url, mask_url


def open_store(url: str | None = None, *, create: bool = True, read_only: bool = False
               ) -> TraceStore:
    """Open the store a URL names (the embedded default when None) and make sure its schema exists
    (unless not `create`). `read_only`: the server refuses every write from a server store, and
    a client of an embedded store another process holds refuses them itself (the dashboard's
    store); an embedded store this process opens itself ignores it.

    An embedded store (chdb://) whose directory another process of this machine holds and
    shares is opened through that process (`store.sharing`): the same port, every call a
    request to it.

    Raises StoreConfigError for a malformed URL (or an embedded directory another process holds
    without sharing it) and TemporaryStoreError for a server or a holder that does not answer,
    all naming the URL."""
    url = url or default_store_url()
    if url.startswith("clickhouse://"):
        from tracehound.tracing.store.server import ClickHouseServerStore

        store: TraceStore = ClickHouseServerStore(url, read_only=read_only)
    elif url.startswith("chdb://"):
        from tracehound.tracing.store.sharing import open_embedded

        # opened here, or a client of the process of this machine that holds the directory
        store = open_embedded(url, read_only=read_only)
    else:
        shown = mask_url(url)
        scheme = repr(shown.split("://", 1)[0]) if "://" in shown else "(no scheme://)"
        raise StoreConfigError(
            f"store URL {shown!r}: unknown scheme {scheme}; expected "
            "clickhouse://user:pass@host:9000/db or chdb:///path/to/dir"
        )
    if create:
        store.ensure_schema()
    return store
