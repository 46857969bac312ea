"""The trace store embedded in this process (chdb: the ClickHouse engine as a library).

`chdb:///path/to/dir`: zero setup on one machine. Tables live in the database `tracehound` under
that directory, with the same schema and SQL as on a server.

Two limits of chdb shape this adapter:
- only ONE process may open a directory (ClickHouse locks `<dir>/status`): opening a directory
  another process holds raises StoreConfigError saying so. `open_store` does not come here then:
  it goes through the holder, which shares the store with the other processes of the machine
  (`store.sharing`), and node agents ship their batches to the holder's ingest endpoint
  (`store.ingest`);
- one process holds at most one directory at a time: a second store on another directory fails
  (StoreConfigError) until the first is closed; after `close()` another directory can be opened.

Values are bound with chdb's query parameters (`{name:Type}`). chdb parses a parameter value in
ClickHouse's *escaped* text form, so `param_text` escapes backslash, tab and newline first; it is
used only here. This adapter must never format a value into SQL text, and never lets a chdb error
escape unwrapped (it raises PermanentStoreError, or StoreConfigError when the store cannot open).
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from tracehound.tracing.errors import PermanentStoreError, StoreConfigError
from tracehound.tracing.store.engine import Row, SqlTraceStore
from tracehound.tracing.store.schema import Table
from tracehound.tracing.store.sql import QUERY_LIMITS, Param, Params
from tracehound.tracing.store.urls import embedded_path

EMBEDDED_DATABASE = "tracehound"

_PARAM_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n"})


def param_text(value: Param) -> str:
    """A query parameter value in the escaped text form chdb parses it from.

    chdb reads `{name:String}` values like a TSV field: a backslash starts an escape sequence
    (`\\n` would become a newline) and a raw tab or newline ends the value. So backslash, tab and
    newline are escaped; everything else passes as is. Integers are written by `int()`, floats by
    `repr()`; bools are refused (an ambiguous parameter is a bug)."""
    if isinstance(value, bool):
        raise TypeError("bool query parameters are ambiguous: pass 0 or 1")
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return value.translate(_PARAM_ESCAPES)
    raise TypeError(f"unsupported query parameter type {type(value).__name__}")


_ARRAY = re.compile(r"Array\((.+)\)")


def _arrow_type(clickhouse_type: str) -> Any:
    import pyarrow as pa

    array = _ARRAY.fullmatch(clickhouse_type)
    if array:
        return pa.list_(_arrow_type(array.group(1)))
    types = {
        "String": pa.string(), "UInt8": pa.uint8(), "UInt32": pa.uint32(),
        "UInt64": pa.uint64(), "Int32": pa.int32(), "Int64": pa.int64(),
        "Float64": pa.float64(),
    }
    return types[clickhouse_type]


def lock_holder(path: str) -> str | None:
    """What holds the ClickHouse lock on `path` from another process ("pid N" or "another
    process"), or None if it is free or held by this process (chdb lets one process open its
    own directory again)."""
    status = os.path.join(path, "status")
    try:
        fd = os.open(status, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            with open(status, errors="replace") as f:
                match = re.search(r"PID:\s*(\d+)", f.read())
            if match is None:
                return "another process"
            if int(match.group(1)) == os.getpid():
                return None
            return f"pid {match.group(1)}"
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _arrow_strings(values: npt.NDArray[np.str_]) -> Any:
    """A numpy string column as an Arrow string array. Converting each distinct value once and
    taking them by index is several times faster than converting every row (columns of group
    ids, ops and nodes repeat a few values over and over)."""
    import pyarrow as pa

    from tracehound.tracing.summaries import factorize

    uniques, codes = factorize(values)
    dictionary = pa.array(uniques.tolist(), type=pa.string())
    return dictionary.take(pa.array(codes))


class EmbeddedClickHouseStore(SqlTraceStore):
    """A TraceStore in a chdb session on a directory; one session, used under a lock."""

    def __init__(self, url: str) -> None:
        path = embedded_path(url)
        super().__init__(shown_url=url, database=EMBEDDED_DATABASE)
        self.path = path
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise StoreConfigError(
                f"embedded store {path}: cannot create the directory: {exc}"
            ) from exc
        from chdb import session

        holder = lock_holder(path)
        if holder is not None:
            raise StoreConfigError(self._held_message(holder))
        try:
            self._session: Any = session.Session(path)  # type: ignore[no-untyped-call]
            for name, value in QUERY_LIMITS.items():
                self._session.query(f"SET {name} = {int(value)}")  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise self._open_error(exc) from exc
        self._lock = threading.Lock()

    def _held_message(self, holder: str) -> str:
        return (
            f"embedded store {self.path} is held by another process ({holder}): only one process "
            "may open a chdb directory; send batches to that process's ingest endpoint instead"
        )

    def _open_error(self, exc: Exception) -> StoreConfigError:
        text = str(exc)
        if "already initialized with path" in text:
            return StoreConfigError(
                f"embedded store {self.path}: this process already has another chdb directory "
                f"open and can hold only one at a time; close that store first ({text})"
            )
        holder = lock_holder(self.path)
        if holder is not None:
            return StoreConfigError(self._held_message(holder))
        return StoreConfigError(f"embedded store {self.path} cannot be opened: {text}")

    def _session_or_fail(self) -> Any:
        if self._session is None:
            raise PermanentStoreError(f"embedded store {self.path} is closed")
        return self._session

    def _query(self, sql: str, params: Params) -> list[Row]:
        bound = {name: param_text(value) for name, value in params.items()}
        with self._lock:
            session = self._session_or_fail()
            try:
                table = session.query(sql, "ArrowTable", params=bound)
            except Exception as exc:
                raise PermanentStoreError(
                    f"embedded store {self.path} refused the request: {exc}"
                ) from exc
        return list(zip(*(column.to_pylist() for column in table.columns), strict=True))

    def _insert(self, table: Table, columns: list[list[Any]]) -> None:
        import pyarrow as pa

        try:
            arrow_table = pa.table({
                c.name: pa.array(values, type=_arrow_type(c.type))
                for c, values in zip(table.columns, columns, strict=True)
            })
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
            raise PermanentStoreError(
                f"embedded store {self.path}: rows for {table.name} do not fit its columns: {exc}"
            ) from exc
        self._insert_arrow(table, arrow_table)

    def _insert_arrow(self, table: Table, batch_table: Any) -> None:
        """Write an Arrow table (columns named and ordered like `table`) in ONE insert."""
        names = ", ".join(table.column_names)
        # chdb's Python() table function finds `batch_table` by name in this frame.
        # Schema identifiers only; the values travel in batch_table.
        target = f"{self.database}.{table.name} ({names})"
        sql = f"INSERT INTO {target} SELECT {names} FROM Python(batch_table)"  # noqa: S608
        with self._lock:
            session = self._session_or_fail()
            try:
                session.query(sql)
            except Exception as exc:
                raise PermanentStoreError(
                    f"embedded store {self.path} refused an insert into {table.name}: {exc}"
                ) from exc

    def _insert_arrays(self, table: Table, columns: Sequence[npt.NDArray[Any]]) -> None:
        import pyarrow as pa

        try:
            arrays = [
                _arrow_strings(values) if values.dtype.kind == "U"
                else pa.array(values, type=_arrow_type(c.type))
                for c, values in zip(table.columns, columns, strict=True)
            ]
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as exc:
            raise PermanentStoreError(
                f"embedded store {self.path}: rows for {table.name} do not fit its columns: {exc}"
            ) from exc
        self._insert_arrow(table, pa.table(arrays, names=list(table.column_names)))

    def close(self) -> None:
        with self._lock:
            if self._session is not None:
                self._session.close()
                self._session = None
