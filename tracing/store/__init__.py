"""Where traces are kept: the store ports, URLs, the ClickHouse schema and SQL, the server and
embedded adapters, the ingest endpoint of an embedded store, and the sharing of an embedded store
with the other processes of its machine (the client adapter and the calls it sends).

Open a store with `open_store(url)`; read and write through the `TraceStore` port; tools and
tests reach the bulk paths through `bulk(store)`. Adapters load their client libraries only when
a store of their kind is opened.
"""

from tracehound.tracing.store.factory import open_store
from tracehound.tracing.store.port import (
    FOREVER_US,
    BulkStore,
    CollectiveKey,
    HeldRecords,
    InsertReport,
    TraceStore,
    bulk,
)
from tracehound.tracing.store.urls import (
    DEFAULT_STORE_DIR,
    ServerAddress,
    default_store_url,
    embedded_path,
    is_embedded,
    mask_url,
    parse_server_url,
)

__all__ = [
    "DEFAULT_STORE_DIR",
    "FOREVER_US",
    "BulkStore",
    "CollectiveKey",
    "HeldRecords",
    "InsertReport",
    "ServerAddress",
    "TraceStore",
    "bulk",
    "default_store_url",
    "embedded_path",
    "is_embedded",
    "mask_url",
    "open_store",
    "parse_server_url",
]
