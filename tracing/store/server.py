"""The trace store on a ClickHouse server, over the native protocol (clickhouse-driver).

`clickhouse://user:password@host:9000/database`. Works with ClickHouse 18.16 (Debian's) and
newer. Every node agent can write here directly; it is the store for more than one machine.

What this adapter must never do: build SQL from values (values are bound with clickhouse-driver's
`%(name)s` parameters), send a literal `INSERT ... VALUES (...)` text (it hangs on 18.16: inserts
always pass columns to `INSERT INTO t (cols) VALUES`), hang on an outage (short connect, send
and receive timeouts), or let a clickhouse-driver error escape unwrapped:

    connection refused / reset / timed out  -> TemporaryStoreError (names the masked URL)
    server busy (too many queries / parts)  -> TemporaryStoreError
    any other server or client error        -> PermanentStoreError
    malformed URL                           -> StoreConfigError (from `parse_server_url`)
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from tracehound.tracing.errors import PermanentStoreError, StoreError, TemporaryStoreError
from tracehound.tracing.store.engine import Row, SqlTraceStore
from tracehound.tracing.store.schema import Table
from tracehound.tracing.store.sql import QUERY_LIMITS, Params, to_pyformat
from tracehound.tracing.store.urls import mask_url, parse_server_url

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
    """A server error without its (long) stack trace."""
    text = str(exc).split("Stack trace:", 1)[0].strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ClickHouseServerStore(SqlTraceStore):
    """A TraceStore on a ClickHouse server. One client, used under a lock; it (re)connects on
    first use, so making the store does not touch the network."""

    def __init__(
        self,
        url: str,
        *,
        connect_timeout: float = 3.0,
        send_receive_timeout: float = 10.0,
    ) -> None:
        address = parse_server_url(url)
        super().__init__(shown_url=mask_url(url), database=address.database)
        from clickhouse_driver import Client

        # Connect to "default": the store's own database may not exist before ensure_schema().
        self._client: Any = Client(
            host=address.host,
            port=address.port,
            user=address.user,
            password=address.password,
            database="default",
            client_name="tracehound",
            connect_timeout=connect_timeout,
            send_receive_timeout=send_receive_timeout,
            sync_request_timeout=connect_timeout,
            settings=dict(QUERY_LIMITS),
        )
        self._lock = threading.Lock()

    def _wrap(self, exc: Exception) -> StoreError:
        from clickhouse_driver import errors

        if isinstance(exc, errors.ServerException):
            code = getattr(exc, "code", None)
            if code in _TEMPORARY_SERVER_CODES:
                return TemporaryStoreError(f"ClickHouse at {self.url} is busy: {_first_line(exc)}")
            return PermanentStoreError(
                f"ClickHouse at {self.url} refused the request: {_first_line(exc)}"
            )
        if isinstance(exc, errors.NetworkError | errors.SocketTimeoutError | OSError | EOFError
                      | socket.timeout | errors.UnexpectedPacketFromServerError):
            self._client.disconnect()
            return TemporaryStoreError(f"ClickHouse at {self.url} is unreachable: {exc}")
        return PermanentStoreError(
            f"ClickHouse at {self.url} could not run the request: {type(exc).__name__}: {exc}"
        )

    def _query(self, sql: str, params: Params) -> list[Row]:
        text = to_pyformat(sql)
        with self._lock:
            try:
                rows: list[Row] = self._client.execute(text, dict(params))
            except Exception as exc:
                raise self._wrap(exc) from exc
        return rows

    def _insert(self, table: Table, columns: list[list[Any]]) -> None:
        text = f"INSERT INTO {self.database}.{table.name} ({', '.join(table.column_names)}) VALUES"
        with self._lock:
            try:
                self._client.execute(text, columns, columnar=True)
            except Exception as exc:
                raise self._wrap(exc) from exc

    def drop_database(self) -> None:
        """Drop the store's database and everything in it (tests and `tracehound` cleanup)."""
        self._query(f"DROP DATABASE IF EXISTS {self.database}", {})

    def close(self) -> None:
        with self._lock:
            self._client.disconnect()
