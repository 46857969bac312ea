"""The trace store on a ClickHouse server, over the native protocol (clickhouse-driver).

`clickhouse://user:password@host:9000/database`. Works with ClickHouse 18.16 (Debian's) and
newer. Every node agent can write here directly; it is the store for more than one machine.
With `?secure=1` it speaks TLS (clickhouse-driver's `secure=True`; `verify` and `ca_certs` as
the URL says, `store.urls`). With `?cluster=NAME` (and `&ddl=per_shard` on a cluster without
ZooKeeper) the store spreads its tables over the shards of that cluster of the server's
`remote_servers`: local tables on each shard, Distributed tables over them that every query and
insert goes through (`store.cluster` says how and why); inserts then wait until every shard has
its rows (`insert_distributed_sync`).

What this adapter must never do: build SQL from values (values are bound with clickhouse-driver's
`%(name)s` parameters), send a literal `INSERT ... VALUES (...)` text (it hangs on 18.16: inserts
always pass columns to `INSERT INTO t (cols) VALUES`), hang on an outage (short connect, send
and receive timeouts), or let a clickhouse-driver error escape unwrapped:

    connection refused / reset / timed out  -> TemporaryStoreError (names the masked URL)
    TLS handshake or certificate refused    -> StoreConfigError (names the masked URL)
    server busy (too many queries / parts)  -> TemporaryStoreError
    any other server or client error        -> PermanentStoreError
    malformed URL                           -> StoreConfigError (from `parse_server_url`)
    cluster not defined / no ON CLUSTER DDL -> StoreConfigError (from `store.cluster`)
"""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Any

from tracehound.tracing.errors import (
    PermanentStoreError,
    StoreConfigError,
    StoreError,
    TemporaryStoreError,
)
from tracehound.tracing.store.cluster import ClusterLayout, Replica
from tracehound.tracing.store.engine import Row, SqlTraceStore
from tracehound.tracing.store.schema import Table
from tracehound.tracing.store.sql import QUERY_LIMITS, Params, to_pyformat
from tracehound.tracing.store.urls import TlsSpec, mask_url, parse_server_url

_TEMPORARY_SERVER_CODES = frozenset({
    159,  # TIMEOUT_EXCEEDED
    202,  # TOO_MANY_SIMULTANEOUS_QUERIES
    203,  # NO_FREE_CONNECTION
    209,  # SOCKET_TIMEOUT
    210,  # NETWORK_ERROR
    241,  # MEMORY_LIMIT_EXCEEDED
    242,  # TABLE_IS_READ_ONLY
    252,  # TOO_MANY_PARTS
})


def _first_line(exc: BaseException) -> str:
    """A server error without its (long) stack trace, on one line (18.16 puts the code and the
    message on lines of their own: "Code: 164.\nDB::Exception: Cannot ... in readonly mode.")."""
    text = " ".join(str(exc).split("Stack trace:", 1)[0].split())
    return text[:500] if text else type(exc).__name__


def _tls_failure(exc: BaseException) -> str | None:
    """"untrusted" or "handshake" when `exc` is a TLS certificate or handshake failure (an
    ssl.SSLError, or clickhouse-driver's NetworkError made of one: it keeps only the text),
    None for anything else, a TLS connection cut short (EOF) included."""
    text = str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        return "untrusted"
    if isinstance(exc, ssl.SSLEOFError | ssl.SSLZeroReturnError) or "EOF" in text:
        return None
    if isinstance(exc, ssl.SSLError) or "[SSL" in text:
        return "handshake"
    return None


class _Connection:
    """One clickhouse-driver client, used under a lock, whose errors come out as StoreErrors
    naming `shown`. It (re)connects on first use, so making one does not touch the network."""

    def __init__(
        self, *, host: str, port: int, user: str, password: str, shown: str,
        connect_timeout: float, send_receive_timeout: float, settings: dict[str, int],
        tls: TlsSpec | None = None,
    ) -> None:
        from clickhouse_driver import Client

        self.shown = shown
        tls_options: dict[str, Any] = {} if tls is None else {
            "secure": True, "verify": tls.verify, "check_hostname": tls.verify,
            "ca_certs": tls.ca_certs}
        # Connect to "default": the store's own database may not exist before ensure_schema().
        self._client: Any = Client(
            host=host,
            port=port,
            user=user,
            password=password,
            database="default",
            client_name="tracehound",
            connect_timeout=connect_timeout,
            send_receive_timeout=send_receive_timeout,
            sync_request_timeout=connect_timeout,
            settings=settings,
            **tls_options,
        )
        self.tls_options = tls_options
        """What the client was given for TLS (empty for a plain connection)."""
        self._lock = threading.Lock()

    def _wrap(self, exc: Exception) -> StoreError:
        from clickhouse_driver import errors

        if isinstance(exc, errors.ServerException):
            code = getattr(exc, "code", None)
            if code in _TEMPORARY_SERVER_CODES:
                return TemporaryStoreError(
                    f"ClickHouse at {self.shown} is busy: {_first_line(exc)}")
            return PermanentStoreError(
                f"ClickHouse at {self.shown} refused the request: {_first_line(exc)}"
            )
        tls_failure = _tls_failure(exc) if self.tls_options else None
        if tls_failure is not None:
            # the same handshake fails again: a setting to fix, not an outage to wait out
            self._client.disconnect()
            if tls_failure == "untrusted":
                return StoreConfigError(
                    f"ClickHouse at {self.shown}: the server's TLS certificate is not trusted "
                    f"({exc}); name its CA with &ca_certs=/path/ca.pem")
            return StoreConfigError(
                f"ClickHouse at {self.shown}: TLS handshake failed ({exc}); is this the "
                "server's secure native port (tcp_port_secure, usually 9440)?")
        if isinstance(exc, errors.NetworkError | errors.SocketTimeoutError | OSError | EOFError
                      | socket.timeout | errors.UnexpectedPacketFromServerError):
            self._client.disconnect()
            return TemporaryStoreError(f"ClickHouse at {self.shown} is unreachable: {exc}")
        return PermanentStoreError(
            f"ClickHouse at {self.shown} could not run the request: {type(exc).__name__}: {exc}"
        )

    def query(self, sql: str, params: Params) -> list[Row]:
        """Run `sql` (`{name:Type}` placeholders bound to `params`) and return its rows."""
        text = to_pyformat(sql)
        with self._lock:
            try:
                rows: list[Row] = self._client.execute(text, dict(params))
            except Exception as exc:
                raise self._wrap(exc) from exc
        return rows

    def insert(self, text: str, columns: list[list[Any]]) -> None:
        """Run `INSERT INTO t (cols) VALUES` with `columns` as its data, in one insert."""
        with self._lock:
            try:
                self._client.execute(text, columns, columnar=True)
            except Exception as exc:
                raise self._wrap(exc) from exc

    def close(self) -> None:
        with self._lock:
            self._client.disconnect()


class ClickHouseServerStore(SqlTraceStore):
    """A TraceStore on a ClickHouse server (or, with `?cluster=`, on a cluster through it). One
    client, used under a lock; it (re)connects on first use, so making the store does not touch
    the network."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 3.0,
        send_receive_timeout: float = 10.0,
        read_only: bool = False,
    ) -> None:
        """`read_only`: every query carries ClickHouse's `readonly=2` setting, so the server
        refuses any write or DDL from this store (the dashboard's) whatever the user may do."""
        address = parse_server_url(url)
        super().__init__(shown_url=mask_url(url), database=address.database)
        settings = dict(QUERY_LIMITS)
        if read_only:
            settings["readonly"] = 2
        if address.cluster is not None:
            # An insert returns once every shard has its rows: reads right after it (and the
            # retried-batch check) see them.
            settings["insert_distributed_sync"] = 1
        self._connection = _Connection(
            host=address.host, port=address.port, user=address.user,
            password=address.password, shown=self.url, connect_timeout=connect_timeout,
            send_receive_timeout=send_receive_timeout, settings=settings, tls=address.tls,
        )
        self._cluster: ClusterLayout | None = None
        if address.cluster is not None:

            def connect(replica: Replica) -> _Connection:
                return _Connection(
                    host=replica.host, port=replica.port, user=address.user,
                    password=address.password,
                    shown=f"{self.url} (shard {replica.shard}: {replica.host}:{replica.port})",
                    connect_timeout=connect_timeout,
                    send_receive_timeout=send_receive_timeout, settings=dict(QUERY_LIMITS),
                    tls=address.tls,
                )

            self._cluster = ClusterLayout(
                address.cluster, database=address.database, shown_url=self.url,
                entry=self._query, connect=connect,
            )

    def _query(self, sql: str, params: Params) -> list[Row]:
        return self._connection.query(sql, params)

    def _insert(self, table: Table, columns: list[list[Any]]) -> None:
        self._connection.insert(
            f"INSERT INTO {self.database}.{table.name} ({', '.join(table.column_names)}) VALUES",
            columns,
        )

    def ensure_schema(self) -> None:
        if self._cluster is None:
            super().ensure_schema()
        else:
            self._cluster.ensure_schema()

    def _drop_partitions_before(self, table: Table, day: int, *, dry_run: bool) -> list[int]:
        if self._cluster is None:
            return super()._drop_partitions_before(table, day, dry_run=dry_run)
        return self._cluster.drop_partitions_before(table, day, dry_run=dry_run)

    def drop_database(self) -> None:
        """Drop the store's database and everything in it (tests and `tracehound` cleanup); in
        cluster mode also every shard's local tables."""
        if self._cluster is None:
            self._query(f"DROP DATABASE IF EXISTS {self.database}", {})
        else:
            self._cluster.drop()

    def close(self) -> None:
        self._connection.close()
