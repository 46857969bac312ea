"""The dashboard's one store per process.

Streamlit runs the script again for every interaction, in threads of one process: the store is
opened once and shared (stores are thread-safe). An embedded store's directory can be held by
one process only. When another process holds it (a running `tracehound run`), the dashboard
reads it through that process (`tracing.store.sharing`); when the dashboard is the first, it
holds the directory and shares it in turn, so a `tracehound run` or `tracehound diagnose`
started next works through it. A store read through another process that fails (its holder
ended) is opened again on the next run of the script: directly, once nobody holds the
directory. The store is opened without creating anything, and a server store read-only
(ClickHouse's `readonly=2` on every query: the server refuses any write); a store switched to
another URL closes the old one.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from tracehound.tracing.errors import StoreError
from tracehound.tracing.settings import TRACEHOUND_STORE, env_str
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.store.client import SharedStoreClient
from tracehound.tracing.store.sharing import Sharing
from tracehound.tracing.store.urls import default_store_url, mask_url

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Opened:
    url: str
    store: TraceStore | None
    error: str | None = None
    sharing: Sharing | None = None
    """This process's sharing of the store, when the dashboard holds an embedded store."""

    def close(self) -> None:
        if self.sharing is not None:
            self.sharing.stop()
        if self.store is not None:
            self.store.close()


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
        if _current is not None:
            _current.close()
        try:
            store = open_store(url, create=False, read_only=True)
        except StoreError as exc:
            hint = (" An embedded store is held by the process that writes it (a running "
                    "`tracehound run` or `tracehound demo`), which shares it with this machine's "
                    "processes: if it does not, look again when it ends, or use a ClickHouse "
                    "server (clickhouse://...)." if url.startswith("chdb://") else "")
            _current = Opened(url, None, f"{mask_url(url)}: {exc}{hint}")
            return _current
        sharing = Sharing(store)
        try:
            sharing.start()  # nothing when the store is not an embedded one held here
        except StoreError as exc:
            logger.warning("the dashboard holds %s but cannot share it: %s", url, exc)
            sharing.stop()
            _current = Opened(url, store)
            return _current
        _current = Opened(url, store, sharing=sharing)
        return _current


def reopen_after(error: StoreError) -> None:
    """Forget a store read through another process after `error`, so the next run of the script
    opens it again (the process that held it may have ended: then this one opens it itself).
    A store this process holds, or a server store, is kept."""
    global _current
    with _lock:
        if _current is not None and isinstance(_current.store, SharedStoreClient):
            logger.info("reading %s again on the next run after: %s", _current.url, error)
            _current.close()
            _current = None


def close_shared_store() -> None:
    """Close the process's store (tests that open another embedded store next)."""
    global _current
    with _lock:
        if _current is not None:
            _current.close()
        _current = None
