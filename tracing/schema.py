"""The ClickHouse schema of a trace store: one table per record kind, one CREATE statement each.

The same statements run on Debian's ClickHouse 18.16 server and on the embedded engine (chdb 4.4,
ClickHouse 26.x), so they keep to the subset both understand: no DateTime64, Map, JSON, TTL,
CODEC or LowCardinality. Sub-second times are UInt64 microseconds; the `ts` column exists only to
partition by day (retention is `ALTER TABLE ... DROP PARTITION`). Tables of batch records carry
the `batch_id` they arrived in, which is how a retried batch is recognised.

This module only describes tables. It must never run a query or hold a connection, and it must
never put a value into SQL text: the only names it formats into statements are validated
identifiers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tracehound.tracing.errors import StoreConfigError

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def check_identifier(name: str) -> str:
    """`name` if it is a plain ClickHouse identifier (letters, digits, _), else StoreConfigError."""
    if not _IDENTIFIER.fullmatch(name):
        raise StoreConfigError(
            f"{name!r} is not a usable database or table name: expected letters, digits and _, "
            "not starting with a digit"
        )
    return name


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str
    """A ClickHouse type understood by 18.16 and chdb (String, UInt64, Array(String), ...)."""


@dataclass(frozen=True, slots=True)
class Table:
    """One table: the columns an insert writes (in order), and how it is stored."""

    name: str
    columns: tuple[Column, ...]
    time_column: str
    """The microsecond column the `ts` partition column is computed from."""
    order_by: tuple[str, ...]
    engine: str = "MergeTree"
    key: tuple[str, ...] = ()
    """Columns that identify a row within one batch (record tables only): a retried batch's rows
    whose key is already stored under the same batch_id are not written again."""

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    def create_statement(self, database: str) -> str:
        """The CREATE TABLE IF NOT EXISTS statement of this table in `database`."""
        check_identifier(database)
        check_identifier(self.name)
        columns = ",\n".join(f"    {c.name} {c.type}" for c in self.columns)
        return (
            f"CREATE TABLE IF NOT EXISTS {database}.{self.name} (\n{columns},\n"
            f"    ts DateTime('UTC') DEFAULT toDateTime(intDiv({self.time_column}, 1000000), 'UTC')"
            f"\n) ENGINE = {self.engine}\n"
            "PARTITION BY toYYYYMMDD(ts)\n"
            f"ORDER BY ({', '.join(self.order_by)})"
        )


def _cols(spec: str) -> tuple[Column, ...]:
    """Columns from 'name Type, name Type' (types here hold no top-level commas)."""
    out = []
    for part in spec.split(","):
        name, type_ = part.split()
        out.append(Column(name, type_))
    return tuple(out)


COLLECTIVES = Table(
    name="collectives",
    columns=_cols(
        "batch_id String, job String, attempt UInt32, node String, rank UInt32, group_id String,"
        " seq UInt64, op String, nbytes UInt64, dtype String, peer Int32, state String,"
        " enqueue_us UInt64, complete_us UInt64"
    ),
    time_column="enqueue_us",
    # Replacing: a safety net that folds a row stored twice into one at merge time; queries that
    # must count every stored row (collective_keys) read without FINAL.
    engine="ReplacingMergeTree",
    order_by=("job", "attempt", "group_id", "seq", "rank"),
    key=("job", "attempt", "group_id", "seq", "rank"),
)

HEARTBEATS = Table(
    name="heartbeats",
    columns=_cols(
        "batch_id String, job String, attempt UInt32, node String, rank UInt32, time_us UInt64,"
        " pid UInt32, step UInt64, step_us UInt64, start_step UInt64, first_step_us UInt64,"
        " dropped UInt64, group_ids Array(String), group_last_enqueued Array(UInt64),"
        " group_last_completed Array(UInt64), group_pending_op Array(String),"
        " group_last_enqueue_us Array(UInt64), group_last_complete_us Array(UInt64)"
    ),
    time_column="time_us",
    order_by=("job", "attempt", "rank", "time_us"),
    key=("job", "attempt", "rank", "time_us"),
)

PROCESS_GROUPS = Table(
    name="process_groups",
    columns=_cols(
        "batch_id String, job String, attempt UInt32, rank UInt32, group_id String,"
        " ranks Array(UInt32), backend String, time_us UInt64"
    ),
    time_column="time_us",
    order_by=("job", "attempt", "group_id", "rank"),
    key=("job", "attempt", "group_id", "rank", "time_us"),
)

RANK_EXITS = Table(
    name="rank_exits",
    columns=_cols(
        "batch_id String, job String, attempt UInt32, node String, rank UInt32, pid UInt32,"
        " exit_code Int32, time_us UInt64"
    ),
    time_column="time_us",
    order_by=("job", "attempt", "rank", "time_us"),
    key=("job", "attempt", "rank", "pid", "time_us"),
)

HEALTH = Table(
    name="health",
    columns=_cols(
        "batch_id String, job String, node String, device String, time_us UInt64, source String,"
        " metric String, value Float64, severity String, detail String"
    ),
    time_column="time_us",
    # Read by node and time, whatever the job (a node-wide reading has job "").
    order_by=("node", "time_us", "device", "metric"),
    key=("job", "node", "device", "time_us", "source", "metric"),
)

STACKS = Table(
    name="stacks",
    columns=_cols(
        "batch_id String, job String, attempt UInt32, node String, rank UInt32, time_us UInt64,"
        " frames Array(String)"
    ),
    time_column="time_us",
    order_by=("job", "attempt", "rank", "time_us"),
    key=("job", "attempt", "rank", "time_us"),
)

PROCESSES = Table(
    name="processes",
    columns=_cols(
        "batch_id String, job String, attempt UInt32, node String, rank UInt32, pid UInt32,"
        " time_us UInt64, state String, cpu_s Float64, cpu_rate Float64, read_bytes UInt64,"
        " write_bytes UInt64, io_rate Float64"
    ),
    time_column="time_us",
    order_by=("job", "attempt", "rank", "time_us"),
    key=("job", "attempt", "rank", "pid", "time_us"),
)

INCIDENTS = Table(
    name="incidents",
    columns=_cols(
        "job String, incident_id String, attempt UInt32, detected_at_us UInt64, kind String,"
        " culprit_ranks Array(Int64), culprit_nodes Array(String), confidence Float64,"
        " summary String, verdict_json String, schema_version UInt32"
    ),
    time_column="detected_at_us",
    order_by=("job", "detected_at_us", "incident_id"),
)

ACTIONS = Table(
    name="actions",
    columns=_cols(
        "job String, incident_id String, kind String, target String, time_us UInt64, ok UInt8,"
        " detail String"
    ),
    time_column="time_us",
    order_by=("job", "incident_id", "time_us"),
)

RECORD_TABLES = (
    COLLECTIVES, HEARTBEATS, PROCESS_GROUPS, RANK_EXITS, HEALTH, STACKS, PROCESSES,
)
"""Tables filled from batches; each has batch_id and a key."""

TABLES = (*RECORD_TABLES, INCIDENTS, ACTIONS)


def create_statements(database: str) -> list[str]:
    """Every statement that creates the store in `database`, in order; each is idempotent."""
    check_identifier(database)
    return [f"CREATE DATABASE IF NOT EXISTS {database}"] + [
        t.create_statement(database) for t in TABLES
    ]
