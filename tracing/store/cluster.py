"""Cluster mode of the ClickHouse server store: one store spread over the shards of a ClickHouse
cluster, `clickhouse://user:pass@host:9000/db?cluster=NAME[&ddl=per_shard]`.

The layout: every table of `store.schema` is kept as `<table>_local` on each shard (same columns,
engine and daily partitions) and as a `Distributed` table of the plain name over them, sharded by
the table's `Table.sharding_key` (`cityHash64(job, rank)`, or `cityHash64(job)` for the tables
without a rank). Every query and insert of `store.engine` names the plain tables, so all of them
go through the Distributed tables unchanged: a read gathers every shard, an insert is split by
the key. The server adapter sends inserts with `insert_distributed_sync=1`, so an insert returns
once every shard holds its rows and they are readable at once: the retried-batch check
(`SqlTraceStore._not_yet_stored`) and every read-after-write depend on that. The reads that fold
duplicates do so with `LIMIT n BY`, which the entry server applies again to the merged shards'
rows (checked on 18.16); `FINAL` would also work through a Distributed table there, but no query
needs it.

Where the shards' tables come from is the URL's choice (`ClusterDdl`):

- `?cluster=NAME` (on_cluster): `CREATE/ALTER/DROP ... ON CLUSTER NAME`, run by the servers
  themselves. The local tables live in the store's database on every host, and the Distributed
  tables are made on every host too, so any of them can be the entry. The client reaches only the
  URL's server. This needs distributed DDL (ZooKeeper and `distributed_ddl` in the servers'
  config); Debian's 18.16 without it answers "DDL background thread is not initialized", which
  `ensure_schema` turns into a StoreConfigError that suggests the other mode.
- `?cluster=NAME&ddl=per_shard`: the store reads the cluster's replicas from `system.clusters`
  on the URL's server, connects to each with the URL's user and creates its local tables there:
  in the replica's `default_database` when the cluster names one (so two shards can live on one
  server, as the tests run it), else in the store's database. The Distributed tables are made
  on the URL's server only, with database '' (each replica's default database) or the store's.

Why the URL says which, rather than the store detecting whether ON CLUSTER works: the two modes
differ in what the client must reach (one server, or every replica) and in who applies the
schema (the cluster's DDL queue, or this client), which an operator decides once for a cluster.
Detection would turn a ZooKeeper outage on a cluster that has one into a silent switch to
per-replica DDL from wherever the client runs, beside DDL the queue may still apply later.

Retention (`drop_partitions_before`) drops the daily partitions of the LOCAL tables on every
shard: on_cluster lists them through `cluster(NAME, system, parts)` and drops them with
`ALTER TABLE ... ON CLUSTER`; per_shard lists and drops on each replica over its connection.

Limits, on purpose:
- per_shard with replicas that name a `default_database` keeps ONE store's local tables there:
  a second store (another database) on the same cluster would share them. Without a
  `default_database` each store's local tables are in its own database.
- Within one mode a cluster has all replicas name a `default_database` or none does; a mix is a
  StoreConfigError (the Distributed engine takes one database for every shard).
- The shards' local tables are plain (Replacing)MergeTree: a shard with several replicas is kept
  in step by the Distributed table writing to each (`internal_replication` false).
- on_cluster cannot be run here (no ZooKeeper): its statements are checked as text, the
  per_shard mode against a real two-shard cluster.

This module must never put a value into SQL text (only validated identifiers; values are bound)
and never keep a replica connection past the operation that opened it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from typing import Protocol

from tracehound.tracing.errors import PermanentStoreError, StoreConfigError
from tracehound.tracing.store.engine import (
    Query,
    Row,
    add_missing_columns,
    drop_old_partitions,
    old_partitions,
)
from tracehound.tracing.store.schema import (
    Table,
    add_column_statement,
    check_identifier,
    create_database_statement,
    drop_partition_statement,
    tables,
)
from tracehound.tracing.store.sql import Params
from tracehound.tracing.store.urls import ClusterDdl, ClusterSpec

SQL_REPLICAS = """
SELECT shard_num, replica_num, host_name, port, default_database
FROM system.clusters
WHERE cluster = {cluster:String}
ORDER BY shard_num, replica_num
"""

SQL_CLUSTERS = "SELECT DISTINCT cluster FROM system.clusters ORDER BY cluster"

# `{cluster}` is the validated cluster name: the cluster() table function reads one replica of
# every shard.
SQL_CLUSTER_COLUMNS = """
SELECT name FROM cluster({cluster}, system, columns)
WHERE database = {database:String} AND table = {table:String}
GROUP BY name
HAVING count() >= {shards:UInt64}
"""
"""The columns that every shard's copy of a table has."""

SQL_CLUSTER_PARTITIONS = """
SELECT DISTINCT partition FROM cluster({cluster}, system, parts)
WHERE database = {database:String} AND table = {table:String} AND active
"""


class Connection(Protocol):
    """A connection to one replica (the server adapter's): runs one query, then is closed."""

    def query(self, sql: str, params: Params) -> list[Row]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica of one shard, as `system.clusters` on the URL's server names it."""

    shard: int
    host: str
    port: int
    database: str
    """Where this replica keeps its shard's local tables (per_shard): its `default_database`,
    or the store's database when the cluster names none."""
    default_database: str
    """The cluster's `default_database` of this replica ('' when it names none)."""


class ClusterLayout:
    """The shard-side half of a cluster-mode store: creates and drops the local and Distributed
    tables, and drops old partitions on every shard. Queries and inserts need nothing from it:
    they name the Distributed tables."""

    def __init__(
        self,
        spec: ClusterSpec,
        *,
        database: str,
        shown_url: str,
        entry: Query,
        connect: Callable[[Replica], Connection],
    ) -> None:
        self.spec = spec
        self.cluster = check_identifier(spec.name)
        self.database = check_identifier(database)
        self._shown_url = shown_url
        self._entry = entry
        self._connect = connect

    def replicas(self) -> list[Replica]:
        """Every replica of the cluster, by shard; StoreConfigError when the URL's server does
        not define the cluster."""
        rows = self._entry(SQL_REPLICAS, {"cluster": self.cluster})
        if not rows:
            known = [str(r[0]) for r in self._entry(SQL_CLUSTERS, {})]
            raise StoreConfigError(
                f"store URL {self._shown_url!r}: parameter 'cluster' names {self.cluster!r}, "
                "which the server's remote_servers do not define; it defines "
                f"{', '.join(known) if known else 'no cluster'}"
            )
        return [
            Replica(shard=int(shard), host=str(host), port=int(port),
                    database=check_identifier(str(default) or self.database),
                    default_database=str(default))
            for shard, _replica, host, port, default in rows
        ]

    def _shard_database(self, replicas: list[Replica]) -> str | None:
        """The database argument of the Distributed tables (per_shard): None ('': each
        replica's default database) when every replica names one, the store's when none does."""
        named = [r for r in replicas if r.default_database]
        if not named:
            return self.database
        if len(named) == len(replicas):
            return None
        unnamed = ", ".join(f"{r.host}:{r.port} (shard {r.shard})"
                            for r in replicas if not r.default_database)
        raise StoreConfigError(
            f"store URL {self._shown_url!r}: cluster {self.cluster!r} names a default_database "
            f"for some replicas but not for {unnamed}; with ddl=per_shard expected all or none "
            "(the Distributed engine takes one database for every shard)"
        )

    # --- schema ---

    def ensure_schema(self) -> None:
        """Creates what is missing on every shard and on the entry, as `ensure_schema` of a
        single server does: databases, local and Distributed tables, and declared columns an
        older store lacks (on the local tables and on the Distributed ones)."""
        replicas = self.replicas()
        if self.spec.ddl is ClusterDdl.PER_SHARD:
            self._ensure_per_shard(replicas)
        else:
            self._ensure_on_cluster(len({r.shard for r in replicas}))

    def _ensure_per_shard(self, replicas: list[Replica]) -> None:
        shard_database = self._shard_database(replicas)
        for replica in replicas:
            with closing(self._connect(replica)) as connection:
                connection.query(create_database_statement(replica.database), {})
                for table in tables():
                    connection.query(table.local.create_statement(replica.database), {})
                    add_missing_columns(connection.query, replica.database, table.local)
        self._entry(create_database_statement(self.database), {})
        for table in tables():
            self._entry(table.distributed_statement(
                self.database, cluster=self.cluster, local_database=shard_database), {})
            add_missing_columns(self._entry, self.database, table)

    def _ensure_on_cluster(self, shards: int) -> None:
        try:
            self._entry(create_database_statement(self.database, on_cluster=self.cluster), {})
        except PermanentStoreError as exc:
            raise StoreConfigError(
                f"store URL {self._shown_url!r}: the server could not run ON CLUSTER DDL for "
                f"cluster {self.cluster!r} ({exc}); distributed DDL needs ZooKeeper and a "
                "distributed_ddl section on every host: on a cluster without them, add "
                "&ddl=per_shard to create each shard's tables over a connection to its replica"
            ) from exc
        for table in tables():
            self._entry(table.local.create_statement(self.database, on_cluster=self.cluster), {})
            self._entry(table.distributed_statement(
                self.database, cluster=self.cluster, local_database=self.database,
                on_cluster=self.cluster), {})
        for table in tables():
            for kept in (table.local, table):
                have = {str(r[0]) for r in self._entry(self._sql(SQL_CLUSTER_COLUMNS), {
                    "database": self.database, "table": kept.name, "shards": shards})}
                for column in kept.columns:
                    if column.name not in have:
                        self._entry(add_column_statement(
                            self.database, kept, column, on_cluster=self.cluster), {})

    def _sql(self, template: str) -> str:
        return template.replace("{cluster}", self.cluster)

    # --- retention and removal ---

    def drop_partitions_before(self, table: Table, day: int, *, dry_run: bool) -> list[int]:
        """The daily partitions older than `day` of `table`'s local tables on every shard (each
        once), dropped on every shard unless `dry_run`."""
        local = table.local
        if self.spec.ddl is ClusterDdl.ON_CLUSTER:
            self.replicas()
            old = old_partitions(self._entry(self._sql(SQL_CLUSTER_PARTITIONS), {
                "database": self.database, "table": local.name}), day)
            for partition in old if not dry_run else ():
                self._entry(drop_partition_statement(
                    self.database, local, partition, on_cluster=self.cluster), {})
            return old
        found: set[int] = set()
        for replica in self.replicas():
            with closing(self._connect(replica)) as connection:
                found.update(drop_old_partitions(connection.query, replica.database, local, day,
                                                 dry_run=dry_run))
        return sorted(found)

    def drop(self) -> None:
        """Drop the store: its database (Distributed tables) and every shard's local tables."""
        if self.spec.ddl is ClusterDdl.ON_CLUSTER:
            self._entry(f"DROP DATABASE IF EXISTS {self.database} ON CLUSTER {self.cluster}", {})
            return
        for replica in self.replicas():
            with closing(self._connect(replica)) as connection:
                if replica.database == self.database:
                    connection.query(f"DROP DATABASE IF EXISTS {self.database}", {})
                    continue
                for table in tables():
                    connection.query(
                        f"DROP TABLE IF EXISTS {replica.database}.{table.local.name}", {})
        self._entry(f"DROP DATABASE IF EXISTS {self.database}", {})
