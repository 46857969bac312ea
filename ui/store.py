"""The dashboard's one store per process.

Streamlit runs the script again for every interaction, in threads of one process: the store is
opened once and shared (stores are thread-safe). An embedded store's directory can be held by
one process only, so a dashboard pointed at the directory of a running `tracehound run` cannot
open it: it says so, and points at a ClickHouse server for live views. The store is opened
without creating anything, and a server store read-only (ClickHouse's `readonly=2` on every
query: the server refuses any write); a store switched to another URL closes the old one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tracehound.tracing.errors import StoreError
from tracehound.tracing.settings import TRACEHOUND_STORE, env_str
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.store.urls import default_store_url, mask_url


@dataclass(frozen=True, slots=True)
class Opened:
    url: str
    store: TraceStore | None
    error: str | None = None


_lock = threading.Lock()
_current: Opened | None = None


def shared_store(url: str | None) -> Opened:
    """The store of `url` (else $TRACEHOUND_STORE, else the embedded default), opened once per
    process; a failure is kept as its message and tried again on the next call."""
    global _current
    url = url or env_str(TRACEHOUND_STORE) or default_store_url()
    with _lock:
        if _current is not None and _current.url == url and _current.store is not None:
            return _current
        if _current is not None and _current.store is not None:
            _current.store.close()
        try:
            _current = Opened(url, open_store(url, create=False, read_only=True))
        except StoreError as exc:
            hint = (" An embedded store is held by the process that writes it (a running "
                    "`tracehound run` or `tracehound demo`): look again when it ends, or use a "
                    "ClickHouse server (clickhouse://...) for live views."
                    if url.startswith("chdb://") else "")
            _current = Opened(url, None, f"{mask_url(url)}: {exc}{hint}")
        return _current


def close_shared_store() -> None:
    """Close the process's store (tests that open another embedded store next)."""
    global _current
    with _lock:
        if _current is not None and _current.store is not None:
            _current.store.close()
        _current = None
