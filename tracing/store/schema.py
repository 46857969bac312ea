"""The ClickHouse schema of a trace store: one table per record kind, one CREATE statement each,
derived from the kinds' declarations (`tracing.events`, `tracing.kinds`).

The same statements run on Debian's ClickHouse 18.16 server and on the embedded engine (chdb 4.4,
ClickHouse 26.x), so they keep to the subset both understand: no DateTime64, Map, JSON, TTL,
CODEC or LowCardinality. Sub-second times are UInt64 microseconds; the `ts` column exists only to
partition by day (retention is `ALTER TABLE ... DROP PARTITION`). Tables of batch records carry
the `batch_id` they arrived in, which is how a retried batch is recognised. Every table also
has `stored_us`, when the row reached the store by the store's clock (to the second: 18.16 has
no sub-second `now`), filled by the store itself: what a verdict could have read when it was
made is what was stored by then (`TraceStore.records(..., stored_by_us=)`).

In cluster mode (`store.cluster`) each table is kept twice: a `<table>_local` table of the same
columns and engine on every shard, and a `Distributed` table of the plain name over them, sharded
by `sharding_key`; every query and insert names the plain table, so it goes through the shards.

This module only describes tables. It must never run a query or hold a connection, and it must
never put a value into SQL text: the only names it formats into statements are validated
identifiers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from tracehound.tracing import kinds
from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.events import (
    Action,
    ClockReading,
    CollectiveEvent,
    HealthSample,
    Heartbeat,
    Incident,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    StackSample,
)
from tracehound.tracing.kinds import Column, RecordBase

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")

ARRIVAL = Column("stored_us", "UInt64")
"""When a row reached the store, in microseconds of the store's clock, to the second. No record
kind declares it and no insert names it: the store fills it (`ARRIVAL_DEFAULT`). Rows stored
before a store had the column read as stored when they are read."""

ARRIVAL_DEFAULT = "toUInt64(now()) * 1000000"


def check_identifier(name: str) -> str:
    """`name` if it is a plain ClickHouse identifier (letters, digits, _), else StoreConfigError."""
    if not _IDENTIFIER.fullmatch(name):
        raise StoreConfigError(
            f"{name!r} is not a usable database or table name: expected letters, digits and _, "
            "not starting with a digit"
        )
    return name


@dataclass(frozen=True, slots=True)
class Table:
    """One table: the columns an insert writes (in order), and how it is stored. Derived from a
    record kind's declaration (`table_of`)."""

    name: str
    columns: tuple[Column, ...]
    time_column: str
    """The microsecond column the `ts` partition column is computed from."""
    order_by: tuple[str, ...]
    engine: str = "MergeTree"
    key: tuple[str, ...] = ()
    """Columns that identify a row within one batch (batch kinds only): a retried batch's rows
    whose key is already stored under the same batch_id are not written again."""

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def read_columns(self) -> tuple[str, ...]:
        """The columns a record is read back from, in order: the table's, minus batch_id."""
        return tuple(name for name in self.column_names if name != "batch_id")

    @property
    def local(self) -> Table:
        """This table as each shard keeps it in cluster mode: `<name>_local`, same columns and
        engine (the Distributed table over them keeps the plain name)."""
        return replace(self, name=f"{self.name}_local")

    @property
    def sharding_key(self) -> str:
        """The expression a Distributed table spreads this table's rows over the shards by:
        `cityHash64(job, rank)` where there is a rank (a job's ranks spread over every shard,
        and one rank's rows stay together), else `cityHash64(job)` (a job's controller records,
        clock readings and health samples on one shard; node-wide health samples, whose job is
        '', all land on one shard)."""
        names = self.column_names
        if "job" not in names:
            raise StoreConfigError(f"table {self.name} has no job column to shard by")
        return "cityHash64(job, rank)" if "rank" in names else "cityHash64(job)"

    def _columns_text(self) -> str:
        check_identifier(self.name)
        for c in self.columns:
            check_identifier(c.name)
            if not _TYPE.fullmatch(c.type):
                raise StoreConfigError(f"column {self.name}.{c.name}: unsupported type {c.type!r}")
        columns = ",\n".join(f"    {c.name} {c.type}" for c in self.columns)
        return (
            f"(\n{columns},\n"
            f"    ts DateTime('UTC') DEFAULT toDateTime(intDiv({self.time_column}, 1000000), "
            f"'UTC'),\n    {ARRIVAL.name} {ARRIVAL.type} DEFAULT {ARRIVAL_DEFAULT}\n)"
        )

    def create_statement(self, database: str, *, on_cluster: str | None = None) -> str:
        """The CREATE TABLE IF NOT EXISTS statement of this table in `database` (on every host
        of the cluster `on_cluster`, when given)."""
        check_identifier(database)
        return (
            f"CREATE TABLE IF NOT EXISTS {database}.{self.name}{_on(on_cluster)} "
            f"{self._columns_text()} ENGINE = {self.engine}\n"
            "PARTITION BY toYYYYMMDD(ts)\n"
            f"ORDER BY ({', '.join(self.order_by)})"
        )

    def distributed_statement(
        self, database: str, *, cluster: str, local_database: str | None,
        on_cluster: str | None = None,
    ) -> str:
        """The CREATE TABLE IF NOT EXISTS statement of this table in `database` as a Distributed
        table over the `local` tables of `cluster`'s shards, in `local_database` on every shard,
        or with None in each replica's own `default_database` (the engine's '')."""
        check_identifier(database)
        check_identifier(cluster)
        shard_database = "''" if local_database is None else check_identifier(local_database)
        return (
            f"CREATE TABLE IF NOT EXISTS {database}.{self.name}{_on(on_cluster)} "
            f"{self._columns_text()} ENGINE = Distributed({cluster}, {shard_database}, "
            f"{self.local.name}, {self.sharding_key})"
        )


_TYPE = re.compile(r"(Array\()*(String|UInt8|UInt32|UInt64|Int32|Int64|Float64)\)*")
"""The column types both ClickHouse 18.16 and chdb take (no DateTime64, Map, JSON or
LowCardinality)."""


def table_of(kind: type[RecordBase]) -> Table:
    """The table a registered record kind is kept in."""
    layout = kinds.layout(kind)
    stored = layout.stored
    return Table(
        name=stored.table, columns=layout.columns, time_column=stored.time,
        order_by=stored.order_by, engine=stored.engine, key=stored.key,
    )


def tables(*, batch: bool | None = None) -> tuple[Table, ...]:
    """The tables of every registered kind (of batch kinds only, or of the others)."""
    return tuple(table_of(x.kind) for x in kinds.layouts(batch=batch))


COLLECTIVES = table_of(CollectiveEvent)
HEARTBEATS = table_of(Heartbeat)
PROCESS_GROUPS = table_of(ProcessGroupInfo)
RANK_EXITS = table_of(RankExit)
HEALTH = table_of(HealthSample)
CLOCK_READINGS = table_of(ClockReading)
STACKS = table_of(StackSample)
PROCESSES = table_of(ProcessSample)
INCIDENTS = table_of(Incident)
ACTIONS = table_of(Action)


def _on(cluster: str | None) -> str:
    """The ` ON CLUSTER name` of a distributed DDL statement, or nothing."""
    return "" if cluster is None else f" ON CLUSTER {check_identifier(cluster)}"


def add_column_statement(
    database: str, table: Table, column: Column, *, on_cluster: str | None = None
) -> str:
    """The ALTER TABLE that adds `column` (declared, missing from an older store) to `table`."""
    check_identifier(database)
    check_identifier(table.name)
    check_identifier(column.name)
    if not _TYPE.fullmatch(column.type):
        raise StoreConfigError(f"column {table.name}.{column.name}: unsupported type "
                               f"{column.type!r}")
    return (f"ALTER TABLE {database}.{table.name}{_on(on_cluster)} "
            f"ADD COLUMN {column.name} {column.type}")


def add_arrival_statement(database: str, table: Table, *,
                          on_cluster: str | None = None) -> str:
    """The ALTER TABLE that adds the `stored_us` column to a table of an older store."""
    check_identifier(database)
    check_identifier(table.name)
    return (f"ALTER TABLE {database}.{table.name}{_on(on_cluster)} "
            f"ADD COLUMN {ARRIVAL.name} {ARRIVAL.type} DEFAULT {ARRIVAL_DEFAULT}")


def drop_partition_statement(
    database: str, table: Table, partition: int, *, on_cluster: str | None = None
) -> str:
    """The ALTER TABLE that drops one daily partition (`YYYYMMDD`, an int) of `table`."""
    check_identifier(database)
    check_identifier(table.name)
    return f"ALTER TABLE {database}.{table.name}{_on(on_cluster)} DROP PARTITION {int(partition):d}"


def create_database_statement(database: str, *, on_cluster: str | None = None) -> str:
    return f"CREATE DATABASE IF NOT EXISTS {check_identifier(database)}{_on(on_cluster)}"


def create_statements(database: str) -> list[str]:
    """Every statement that creates the store in `database`, in order; each is idempotent."""
    return [create_database_statement(database)] + [
        t.create_statement(database) for t in tables()
    ]
