"""The trace store port: where records, incidents and actions are kept and asked about.

Two adapters implement it, chosen by URL:

- `clickhouse://user:password@host:9000/database`: a ClickHouse server over the native protocol
  (`tracing.clickhouse_server`); every node agent can write to it directly.
- `chdb:///path/to/dir`: ClickHouse embedded in this process (`tracing.clickhouse_embedded`), the
  zero-setup default on one machine. Only one process may open a path, so node agents ship their
  batches to the process that owns it (the controller's ingest endpoint) instead.

Adapters import their client libraries lazily, so importing this module costs nothing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote, urlsplit

from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.events import (
    Action,
    Batch,
    HealthSample,
    Heartbeat,
    Incident,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import JobId

FOREVER_US = 2**63 - 1
"""A time after every record: "no upper bound"."""

if TYPE_CHECKING:  # numpy is imported by the adapters, not by the port
    from tracehound.tracing.summaries import (
        CollectiveColumns,
        Disagreement,
        LinkStats,
        NodeWindows,
        RankStats,
    )

DEFAULT_STORE_DIR = ".tracehound/store"
"""Where the embedded store lives when no URL is given (relative to the working directory)."""


@dataclass(frozen=True, slots=True)
class InsertReport:
    """What a store did with a batch."""

    inserted: int
    """Records written now."""
    skipped: int
    """Records the store already held from an earlier try of the same batch."""


@dataclass(frozen=True, slots=True)
class CollectiveKey:
    """The identity of one rank's part in one collective; unique in a store."""

    attempt: int
    rank: int
    group: str
    seq: int


class TraceStore(Protocol):
    """A place that keeps traces. Implementations must be safe to call from several threads."""

    @property
    def url(self) -> str:
        """The store's URL with any password masked, for messages and logs."""
        ...

    def ensure_schema(self) -> None:
        """Create the database and tables if they are missing (idempotent)."""
        ...

    def insert(self, batch: Batch, *, maybe_duplicate: bool = False) -> InsertReport:
        """Write a batch. With `maybe_duplicate` (a retry whose earlier try may have landed),
        records the store already holds from this batch id are skipped, so a retried batch is
        stored exactly once."""
        ...

    def latest_heartbeats(self, job: JobId, attempt: int,
                          until_us: int = FOREVER_US) -> list[Heartbeat]:
        """The newest heartbeat of every rank of an attempt sent at or before `until_us`,
        ordered by rank."""
        ...

    def exits(self, job: JobId, attempt: int) -> list[RankExit]:
        """Every rank exit of an attempt, earliest first."""
        ...

    def groups(self, job: JobId, attempt: int) -> list[ProcessGroupInfo]:
        """One entry per process group of an attempt (its members as first reported)."""
        ...

    def attempts(self, job: JobId) -> list[int]:
        """The attempts of a job that left any record, ascending."""
        ...

    def jobs(self) -> list[JobId]:
        """Every job with records or incidents, sorted."""
        ...

    def collective_keys(self, job: JobId) -> list[CollectiveKey]:
        """Every stored collective row's key, duplicates included (used to prove no loss and no
        double storage)."""
        ...

    def insert_columns(
        self,
        job: JobId,
        attempt: int,
        cols: CollectiveColumns,
        node_of_rank: Mapping[int, str],
        *,
        batch_id: str,
    ) -> int:
        """Write collective rows given as columns (the simulator's bulk path) in ONE insert and
        return how many were written; each row's node is `node_of_rank[rank]`.

        No retry check is made (unlike `insert(maybe_duplicate=True)`): call it once per
        `batch_id`. ClickHouse writes an insert block by block (up to 1,048,576 rows each, its
        `max_insert_block_size`), so a call of up to that many rows is all-or-nothing and a larger
        one that fails may have stored a prefix (its rows carry `batch_id`). Raises ValueError
        for columns of unequal length, negative counts or times, or a rank without a node."""
        ...

    def rank_stats(self, job: JobId, attempt: int, start_us: int, end_us: int) -> RankStats:
        """Per-rank arrival statistics of the window [start_us, end_us), computed by the store
        (definitions: `tracing.summaries`)."""
        ...

    def link_stats(self, job: JobId, attempt: int, start_us: int, end_us: int) -> LinkStats:
        """Per-(src, dst) point-to-point transfer statistics of the window."""
        ...

    def disagreements(
        self, job: JobId, attempt: int, start_us: int, end_us: int, limit: int = 100
    ) -> list[Disagreement]:
        """The first `limit` collectives of the window, by (group, seq), whose ranks disagree on
        op, nbytes or dtype."""
        ...

    def node_windows(
        self, job: JobId, attempt: int, start_us: int, end_us: int, window_us: int
    ) -> NodeWindows:
        """Per-node arrival features in consecutive windows of `window_us` from `start_us`."""
        ...

    def latest_stacks(self, job: JobId, attempt: int, since_us: int) -> list[StackSample]:
        """The newest stack sample of every rank taken at or after `since_us`, ordered by rank."""
        ...

    def latest_processes(self, job: JobId, attempt: int, since_us: int) -> list[ProcessSample]:
        """The newest process sample of every rank taken at or after `since_us`, ordered by
        rank."""
        ...

    def health(self, nodes: Sequence[str], start_us: int, end_us: int) -> list[HealthSample]:
        """Health samples of `nodes` in [start_us, end_us), whatever job they name, oldest
        first."""
        ...

    def record_incident(self, incident: Incident) -> None:
        ...

    def record_action(self, action: Action) -> None:
        ...

    def incidents(self, job: JobId | None = None) -> list[Incident]:
        """Incidents, oldest first, each with its actions."""
        ...

    def close(self) -> None:
        ...


def mask_url(url: str) -> str:
    """`url` with the password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


@dataclass(frozen=True, slots=True)
class ServerAddress:
    host: str
    port: int
    user: str
    password: str
    database: str


def parse_server_url(url: str) -> ServerAddress:
    """Split a `clickhouse://` URL, naming the part that is wrong when it cannot be used."""
    parts = urlsplit(url)
    shown = mask_url(url)
    if parts.scheme != "clickhouse":
        raise StoreConfigError(f"store URL {shown!r}: expected clickhouse://user:pass@host:9000/db")
    if not parts.hostname:
        raise StoreConfigError(f"store URL {shown!r} names no host (clickhouse://host:9000/db)")
    try:
        port = parts.port or 9000
    except ValueError:
        raise StoreConfigError(
            f"store URL {shown!r} has a bad port: expected a number from 1 to 65535"
        ) from None
    database = parts.path.lstrip("/") or "tracehound"
    if not database.replace("_", "").isalnum():
        raise StoreConfigError(
            f"store URL {shown!r}: database name {database!r} may hold only letters, digits and _"
        )
    return ServerAddress(
        host=parts.hostname,
        port=port,
        user=unquote(parts.username or "default"),
        password=unquote(parts.password or ""),
        database=database,
    )


def embedded_path(url: str) -> str:
    """The directory of a `chdb://` URL (`chdb:///abs/dir` or `chdb://./relative/dir`)."""
    if not url.startswith("chdb://"):
        raise StoreConfigError(f"store URL {url!r}: expected chdb:///path/to/dir")
    path = url[len("chdb://"):]
    if not path:
        raise StoreConfigError(f"store URL {url!r} names no directory: expected chdb:///path/to/dir")
    return os.path.abspath(path)


def default_store_url() -> str:
    return f"chdb://{os.path.abspath(DEFAULT_STORE_DIR)}"


def is_embedded(url: str) -> bool:
    return url.startswith("chdb://")


def open_store(url: str | None = None, *, create: bool = True) -> TraceStore:
    """Open the store a URL names (the embedded default when None) and make sure its schema exists.

    Raises StoreConfigError for a malformed URL and TemporaryStoreError for a server that does not
    answer, both naming the URL."""
    url = url or default_store_url()
    if url.startswith("clickhouse://"):
        from tracehound.tracing.clickhouse_server import ClickHouseServerStore

        store: TraceStore = ClickHouseServerStore(url)
    elif url.startswith("chdb://"):
        from tracehound.tracing.clickhouse_embedded import EmbeddedClickHouseStore

        store = EmbeddedClickHouseStore(url)
    else:
        scheme = url.split("://", 1)[0] if "://" in url else url
        raise StoreConfigError(
            f"store URL {mask_url(url)!r}: unknown scheme {scheme!r}; expected "
            "clickhouse://user:pass@host:9000/db or chdb:///path/to/dir"
        )
    if create:
        store.ensure_schema()
    return store


def group_records(batch: Batch) -> dict[type, Sequence[object]]:
    """The records of a batch sorted by type, in batch order."""
    out: dict[type, list[object]] = {}
    for record in batch.records:
        out.setdefault(type(record), []).append(record)
    return dict(out)
