"""What both ClickHouse adapters share: the exactly-once insert, reads and summaries over SQL.

An adapter (`store.server`, `store.embedded`) subclasses `SqlTraceStore` and supplies two things:
run one query with bound parameters and return its rows, and write columns into one table in one
insert (optionally a faster insert of numpy columns, for bulk collective rows). Everything else
lives here, so both adapters run the same SQL (`store.sql`) and keep the same semantics, which
the one contract suite checks against both. Records become rows, and rows records, through their
kinds' layouts (`tracing.kinds`): nothing here spells out a record's fields.
"""

from __future__ import annotations

import abc
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import msgspec
import numpy as np
import numpy.typing as npt

from tracehound.tracing import kinds, summaries
from tracehound.tracing.events import (
    Action,
    Batch,
    ClockReading,
    CollectiveEvent,
    CollectiveState,
    HealthSample,
    Heartbeat,
    Incident,
    JobState,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import JobId
from tracehound.tracing.kinds import RecordBase
from tracehound.tracing.store import sql as q
from tracehound.tracing.store.port import FOREVER_US, CollectiveKey, InsertReport
from tracehound.tracing.store.schema import (
    ARRIVAL,
    COLLECTIVES,
    Table,
    add_arrival_statement,
    add_column_statement,
    check_identifier,
    create_statements,
    drop_partition_statement,
    table_of,
    tables,
)
from tracehound.tracing.store.sql import Param, Params
from tracehound.tracing.summaries import (
    BucketProgress,
    ClockCorrection,
    ClockSamples,
    CollectiveColumns,
    Disagreement,
    Disagreements,
    LatenessSeries,
    LinkStats,
    NodeWindows,
    ProgressCell,
    ProgressGrid,
    RankStats,
)

Row = Sequence[Any]


def columns_of(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Rows transposed into `width` columns."""
    return [[row[i] for row in rows] for i in range(width)]


Query = Callable[[str, Params], list[Row]]
"""Runs one SQL text with bound values on one server: `SqlTraceStore._query`, or a cluster
replica's connection (`store.cluster`)."""


def add_missing_columns(query: Query, database: str, table: Table) -> None:
    """Add to `database.<table>` on the server `query` runs on the declared columns it lacks
    (a store made by an older version)."""
    have = {str(r[0]) for r in query(
        q.SQL_TABLE_COLUMNS, {"database": database, "table": table.name})}
    for column in table.columns:
        if column.name not in have:
            query(add_column_statement(database, table, column), {})
    if ARRIVAL.name not in have:
        query(add_arrival_statement(database, table), {})


def old_partitions(rows: Sequence[Row], day: int) -> list[int]:
    """The daily partitions (`YYYYMMDD`) among the `partition` values of `rows` that are older
    than `day`, ascending and once each."""
    return sorted({int(p) for (p, *_) in rows if str(p).isdigit() and int(p) < day})


def drop_old_partitions(query: Query, database: str, table: Table, day: int, *,
                        dry_run: bool) -> list[int]:
    """The daily partitions of `database.<table>` on the server `query` runs on that are older
    than `day`, dropped unless `dry_run`."""
    old = old_partitions(query(q.SQL_PARTITIONS, {"database": database, "table": table.name}),
                         day)
    for partition in old if not dry_run else ():
        query(drop_partition_statement(database, table, partition), {})
    return old


class SqlTraceStore(abc.ABC):
    """A TraceStore over ClickHouse SQL; subclasses supply `_query`, `_insert` and `close`.

    Both hooks must be safe to call from several threads (each adapter holds a lock around its
    client) and must raise only StoreError subclasses."""

    def __init__(self, *, shown_url: str, database: str) -> None:
        self._shown_url = shown_url
        self.database = check_identifier(database)
        self._insert_lock = threading.Lock()

    @property
    def url(self) -> str:
        return self._shown_url

    # --- what an adapter supplies ---

    @abc.abstractmethod
    def _query(self, sql: str, params: Params) -> list[Row]:
        """Run `sql` (with `{name:Type}` placeholders bound to `params`) and return its rows."""

    @abc.abstractmethod
    def _insert(self, table: Table, columns: list[list[Any]]) -> None:
        """Write `columns` (one list per column of `table.columns`, in order) in ONE insert."""

    def _insert_arrays(self, table: Table, columns: Sequence[npt.NDArray[Any]]) -> None:
        """Write 1-d numpy `columns` (in `table.columns` order) in ONE insert. The default goes
        through `_insert`; an adapter may override it with a faster columnar path."""
        self._insert(table, [column.tolist() for column in columns])

    @abc.abstractmethod
    def close(self) -> None: ...

    # --- shared behaviour ---

    def _sql(self, template: str, *, table: Table | None = None, **names: str) -> str:
        """`template` with the database, and with `table`'s name, read columns and time column
        when given (all validated identifiers), and any other `{name}` in `names`."""
        sql = template.replace("{db}", self.database)
        if table is not None:
            names = {"table": table.name, "columns": ", ".join(table.read_columns),
                     "time": table.time_column, **names}
        for name, value in names.items():
            sql = sql.replace("{" + name + "}", value)
        return sql

    def _read(self, kind: type[RecordBase], template: str, params: Params,
              **names: str) -> list[Any]:
        """Records of `kind` read by `template` (which selects `{columns}`)."""
        layout = kinds.layout(kind)
        rows = self._query(self._sql(template, table=table_of(kind), **names), params)
        return [layout.from_row(r) for r in rows]

    def ensure_schema(self) -> None:
        """Creates what is missing: the database, the tables, and the columns a newer version
        declares that an existing table lacks (added at its end: every insert and read names
        its columns, so their order does not matter)."""
        for statement in create_statements(self.database):
            self._query(statement, {})
        for table in tables():
            add_missing_columns(self._query, self.database, table)

    def drop_days_before(self, day: int, *, dry_run: bool = False) -> dict[str, list[int]]:
        """Drop every table's daily partitions (`YYYYMMDD`, UTC) older than `day`; what was
        (or, with `dry_run`, would be) dropped, by table."""
        if not 19700101 <= day <= 99991231:
            raise ValueError(f"day: expected a date as YYYYMMDD, got {day}")
        dropped: dict[str, list[int]] = {}
        for table in tables():
            old = self._drop_partitions_before(table, day, dry_run=dry_run)
            if old:
                dropped[table.name] = old
        return dropped

    def _drop_partitions_before(self, table: Table, day: int, *, dry_run: bool) -> list[int]:
        """The daily partitions of `table` older than `day`, dropped unless `dry_run`. The
        server adapter's cluster mode overrides it: there the partitions are those of every
        shard's local table."""
        return drop_old_partitions(self._query, self.database, table, day, dry_run=dry_run)

    def insert(self, batch: Batch, *, maybe_duplicate: bool = False) -> InsertReport:
        inserted = skipped = 0
        with self._insert_lock:
            for kind, records in kinds.group_by_kind(batch.records).items():
                layout = kinds.layout(kind)
                if not layout.stored.batch:
                    raise TypeError(f"a batch may not carry {layout.tag!r} records")
                table = table_of(kind)
                if maybe_duplicate:
                    rows = layout.rows(records, batch.batch_id)
                    todo = self._not_yet_stored(table, batch.batch_id, rows)
                    columns = columns_of(todo, len(table.columns))
                else:
                    todo = records
                    columns = layout.column_batch(records, batch.batch_id)
                if todo:
                    self._insert(table, columns)
                inserted += len(todo)
                skipped += len(records) - len(todo)
        return InsertReport(inserted=inserted, skipped=skipped)

    def _not_yet_stored(
        self, table: Table, batch_id: str, rows: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        """The rows of a retried batch that an earlier try did not store in `table`."""
        count_rows = self._query(
            self._sql(q.SQL_BATCH_COUNT, table=table), {"batch_id": batch_id}
        )
        stored = int(count_rows[0][0])
        if stored == 0:
            return rows
        if stored == len(rows):
            return []
        # Partly there (not expected, as each table's rows go in one insert, but possible if a
        # batch id was reused): keep the rows whose key is not stored yet, counting duplicates.
        positions = [table.column_names.index(c) for c in table.key]
        key_rows = self._query(
            self._sql(q.SQL_BATCH_KEYS, table=table, key=", ".join(table.key)),
            {"batch_id": batch_id},
        )
        present = Counter(tuple(k) for k in key_rows)
        todo = []
        for row in rows:
            key = tuple(row[p] for p in positions)
            if present[key] > 0:
                present[key] -= 1
            else:
                todo.append(row)
        return todo

    def latest_heartbeats(self, job: JobId, attempt: int,
                          until_us: int = FOREVER_US) -> list[Heartbeat]:
        return self._read(Heartbeat, q.SQL_LATEST_HEARTBEATS,
                          {"job": job, "attempt": attempt, "until_us": max(until_us, 0)})

    def exits(self, job: JobId, attempt: int) -> list[RankExit]:
        return self._read(RankExit, q.SQL_EXITS, {"job": job, "attempt": attempt})

    def groups(self, job: JobId, attempt: int) -> list[ProcessGroupInfo]:
        found: list[ProcessGroupInfo] = self._read(
            ProcessGroupInfo, q.SQL_GROUPS, {"job": job, "attempt": attempt})
        return sorted(found, key=lambda g: (g.time_us, g.group))

    def attempts(self, job: JobId) -> list[int]:
        sql = self._sql(q.attempts_query(tables(batch=True)))
        return [int(r[0]) for r in self._query(sql, {"job": job})]

    def jobs(self) -> list[JobId]:
        return [JobId(r[0]) for r in self._query(self._sql(q.jobs_query(tables())), {})]

    def collective_keys(self, job: JobId) -> list[CollectiveKey]:
        rows = self._query(self._sql(q.SQL_COLLECTIVE_KEYS), {"job": job})
        return [
            CollectiveKey(attempt=int(a), rank=int(r), group=g, seq=int(s)) for a, r, g, s in rows
        ]

    def collectives(self, job: JobId, attempt: int) -> list[CollectiveEvent]:
        """Every stored collective row of an attempt, ordered by group, seq, rank."""
        return self._read(CollectiveEvent, q.SQL_COLLECTIVES, {"job": job, "attempt": attempt})

    def records(self, kind: type[RecordBase], job: JobId, *,
                stored_by_us: int | None = None) -> list[Any]:
        """Every stored record of one kind of a job, in time order (incidents without their
        actions); with `stored_by_us`, only those the store held by then."""
        if stored_by_us is None:
            return self._read(kind, q.SQL_RECORDS_OF_JOB, {"job": job})
        return self._read(kind, q.SQL_RECORDS_OF_JOB_STORED_BY,
                          {"job": job, "stored_by": int(stored_by_us)})

    def insert_columns(
        self,
        job: JobId,
        attempt: int,
        cols: CollectiveColumns,
        node_of_rank: Mapping[int, str],
        *,
        batch_id: str,
    ) -> int:
        """Write collective rows given as columns in one INSERT (no retry check: see the
        TraceStore docstring for atomicity); returns the number of rows written."""
        n = len(cols)
        for name in ("group", "seq", "op", "nbytes", "dtype", "peer", "completed",
                     "enqueue_us", "complete_us", "shape"):
            column = cols.shapes() if name == "shape" else getattr(cols, name)
            if column.shape != (n,):
                raise ValueError(f"column {name!r} has shape {column.shape}, "
                                 f"expected ({n},) like 'rank'")
        if n == 0:
            return 0
        for name in ("rank", "seq", "nbytes", "enqueue_us", "complete_us"):
            if int(getattr(cols, name).min()) < 0:
                raise ValueError(f"column {name!r} holds negative values")
        ranks, code = np.unique(cols.rank, return_inverse=True)
        missing = [int(r) for r in ranks if int(r) not in node_of_rank]
        if missing:
            raise ValueError(f"node_of_rank has no node for ranks {missing[:10]}")
        nodes = np.array([node_of_rank[int(r)] for r in ranks], dtype=np.str_)
        state = np.where(
            cols.completed, CollectiveState.COMPLETED.value, CollectiveState.FAILED.value
        )
        columns = [
            np.full(n, np.str_(batch_id)), np.full(n, np.str_(job)),
            np.full(n, attempt, dtype=np.int64), nodes[code.reshape(-1)], cols.rank, cols.group,
            cols.seq, cols.op, cols.nbytes, cols.dtype, cols.peer, state, cols.enqueue_us,
            cols.complete_us, cols.shapes(),
        ]
        self._insert_arrays(COLLECTIVES, columns)
        return n

    def _window_params(
        self, job: JobId, attempt: int, start_us: int, end_us: int
    ) -> dict[str, Param] | None:
        """The bound values of a summary query's window, or None when the window is empty."""
        start = max(start_us, 0)
        if end_us <= start:
            return None
        return {**q.SUMMARY_CONSTANTS, "job": job, "attempt": attempt, "start_us": start,
                "end_us": end_us}

    def _aligned(self, template: str, params: dict[str, Param],
                 clock: ClockCorrection | None) -> str:
        """`template` with `{enq}` and `{cmp}` as the rows' times on the common clock (the
        correction's values bound into `params`), or as recorded without a correction."""
        nodes = len(clock.nodes) if clock is not None else 0
        if clock is not None and nodes:
            params["clk_ref"] = clock.ref_us
            for i, (node, offset, drift) in enumerate(
                    zip(clock.nodes, clock.offset_us, clock.drift, strict=True)):
                params[f"clk_node_{i}"] = node
                params[f"clk_off_{i}"] = float(offset)
                params[f"clk_drift_{i}"] = float(drift)
        return self._sql(template, enq=q.aligned_time("enqueue_us", nodes),
                         cmp=q.aligned_time("complete_us", nodes))

    def rank_stats(self, job: JobId, attempt: int, start_us: int, end_us: int, *,
                   clock: ClockCorrection | None = None) -> RankStats:
        params = self._window_params(job, attempt, start_us, end_us)
        rows = (self._query(self._aligned(q.SQL_RANK_STATS, params, clock), params)
                if params else [])
        rank, n, lateness, last, wait, span, blame, busy, busy_max, active = columns_of(rows, 10)
        return RankStats(
            rank=np.array(rank, dtype=np.int64), n=np.array(n, dtype=np.int64),
            lateness_mean_us=np.array(lateness, dtype=np.float64),
            last_count=np.array(last, dtype=np.int64),
            wait_mean_us=np.array(wait, dtype=np.float64),
            span_us=np.array(span, dtype=np.int64),
            blame_us=np.array(blame, dtype=np.float64),
            busy_us=np.array(busy, dtype=np.float64),
            busy_max_us=np.array(busy_max, dtype=np.float64),
            active_us=np.array(active, dtype=np.float64),
        )

    def link_stats(self, job: JobId, attempt: int, start_us: int, end_us: int, *,
                   clock: ClockCorrection | None = None) -> LinkStats:
        params = self._window_params(job, attempt, start_us, end_us)
        rows = (self._query(self._aligned(q.SQL_LINK_STATS, params, clock), params)
                if params else [])
        src, dst, n, mean, most = columns_of(rows, 5)
        return LinkStats(
            src=np.array(src, dtype=np.int64), dst=np.array(dst, dtype=np.int64),
            n=np.array(n, dtype=np.int64), transfer_mean_us=np.array(mean, dtype=np.float64),
            transfer_max_us=np.array(most, dtype=np.float64),
        )

    def clock_readings(self, job: JobId, since_us: int) -> list[ClockReading]:
        return self._read(ClockReading, q.SQL_CLOCK_READINGS,
                          {"job": job, "since_us": max(since_us, 0)})

    def clock_samples(self, job: JobId, attempt: int, start_us: int, end_us: int,
                      width_us: int) -> ClockSamples:
        summaries.bucket_count(start_us, end_us, width_us)
        params = self._window_params(job, attempt, start_us, end_us)
        rows: list[Row] = []
        if params is not None:
            params.update(origin_us=start_us, width_us=width_us)
            rows = self._query(self._sql(q.SQL_CLOCK_SAMPLES), params)
        group, node, bucket, offset, n = columns_of(rows, 5)
        return ClockSamples(
            group=np.array(group, dtype=np.str_), node=np.array(node, dtype=np.str_),
            bucket=np.array(bucket, dtype=np.int64), offset_us=np.array(offset, np.float64),
            n=np.array(n, dtype=np.int64), start_us=start_us, width_us=width_us,
        )

    def disagreements(
        self, job: JobId, attempt: int, start_us: int, end_us: int, limit: int = 100, *,
        uneven_ops: tuple[str, ...] = (),
    ) -> Disagreements:
        if limit < 1:
            raise ValueError(f"limit must be at least 1, got {limit}")
        params = self._window_params(job, attempt, start_us, end_us)
        if params is None:
            return Disagreements()
        params["limit"] = limit
        params.update({f"uneven_{i}": op for i, op in enumerate(uneven_ops)})
        array = ("[" + ", ".join(f"{{uneven_{i}:String}}" for i in range(len(uneven_ops))) + "]"
                 if uneven_ops else "emptyArrayString()")
        rows = self._query(self._sql(q.SQL_DISAGREEMENTS, uneven_ops=array), params)
        kept = [
            Disagreement(
                group=g, seq=int(seq), ranks=tuple(int(r) for r in ranks), ops=tuple(ops),
                nbytes=tuple(int(b) for b in sizes), dtypes=tuple(dtypes),
                shapes=tuple(shapes), peer_op=peer_op, peer_nbytes=int(peer_nbytes),
                peer_dtype=peer_dtype, peer_groups=int(peer_groups),
            )
            for g, seq, ranks, ops, sizes, dtypes, shapes, peer_op, peer_nbytes, peer_dtype,
            peer_groups, _ in rows
        ]
        total = int(rows[0][-1]) if rows else 0
        return Disagreements(kept, dropped=total - len(kept))

    def node_windows(
        self, job: JobId, attempt: int, start_us: int, end_us: int, window_us: int, *,
        clock: ClockCorrection | None = None,
    ) -> NodeWindows:
        buckets = summaries.bucket_count(start_us, end_us, window_us)
        params = self._window_params(job, attempt, start_us, end_us)
        rows: list[Row] = []
        if params is not None:
            params.update(origin_us=start_us, window_us=window_us,
                          last_bucket=max(buckets - 1, 0))
            rows = self._query(self._aligned(q.SQL_NODE_WINDOWS, params, clock), params)
        nodes = sorted({str(r[1]) for r in rows})
        column = {node: i for i, node in enumerate(nodes)}
        features = np.full((buckets, len(nodes), len(NodeWindows.FEATURES)), np.nan)
        for bucket, node, lateness, last_fraction, wait in rows:
            features[int(bucket), column[node]] = (lateness, last_fraction, wait)
        return NodeWindows(
            nodes=tuple(nodes),
            window_start_us=start_us + np.arange(buckets, dtype=np.int64) * window_us,
            features=features,
        )

    def progress_grid(self, job: JobId, attempt: int, group: str, *, last_seqs: int = 64,
                      rank_buckets: int = 256) -> ProgressGrid:
        if last_seqs < 1:
            raise ValueError(f"last_seqs: expected at least 1 sequence id, got {last_seqs}")
        if rank_buckets < 1:
            raise ValueError(f"rank_buckets: expected at least 1 bucket, got {rank_buckets}")
        params: dict[str, Param] = {**q.UI_CONSTANTS, "job": job, "attempt": attempt,
                                    "group": group}
        ((rows, seq_min, seq_max, rank_max),) = self._query(
            self._sql(q.SQL_PROGRESS_EXTENT), params)
        ((beats, beat_rank_max),) = self._query(
            self._sql(q.SQL_PROGRESS_HEARTBEAT_RANKS), params)
        if not int(rows) and not int(beats):
            return ProgressGrid(group=group, width=1, seq_lo=0, seq_hi=0, cells=(), buckets=())
        top_rank = max(int(rank_max) if int(rows) else 0, int(beat_rank_max) if int(beats) else 0)
        width = max(1, -(-(top_rank + 1) // rank_buckets))
        params["width"] = width
        seq_lo = seq_hi = 0
        cells: tuple[ProgressCell, ...] = ()
        if int(rows):
            seq_hi = int(seq_max)
            seq_lo = max(seq_hi - last_seqs + 1, int(seq_min))
            params.update(seq_lo=seq_lo, seq_hi=seq_hi)
            cells = tuple(
                ProgressCell(bucket=int(bucket), seq=int(seq), ranks=int(n), failed=int(failed),
                             late_max_us=int(late_max), late_mean_us=float(late_mean),
                             op=str(op))
                for bucket, seq, n, failed, late_max, late_mean, op
                in self._query(self._sql(q.SQL_PROGRESS_CELLS), params)
            )
        buckets: tuple[BucketProgress, ...] = ()
        if int(beats):
            buckets = tuple(
                BucketProgress(bucket=int(bucket), ranks=int(n), min_completed=int(low),
                               max_completed=int(high), max_enqueued=int(entered),
                               pending=int(pending))
                for bucket, n, low, high, entered, pending
                in self._query(self._sql(q.SQL_PROGRESS_BUCKETS), params)
            )
        return ProgressGrid(group=group, width=width, seq_lo=seq_lo, seq_hi=seq_hi, cells=cells,
                            buckets=buckets)

    def lateness_series(self, job: JobId, attempt: int, start_us: int, end_us: int,
                        width_us: int, *, top: int = 8) -> LatenessSeries:
        if start_us >= end_us:
            raise ValueError(f"start_us: expected before end_us ({end_us}), got {start_us}")
        if width_us <= 0:
            raise ValueError(f"width_us: expected a positive bucket width, got {width_us}")
        if top < 1:
            raise ValueError(f"top: expected at least 1 rank, got {top}")
        summaries.bucket_count(start_us, end_us, width_us)
        params: dict[str, Param] = {
            **q.UI_CONSTANTS, "job": job, "attempt": attempt, "start_us": max(start_us, 0),
            "end_us": max(end_us, 0), "origin_us": start_us, "width_us": width_us, "top": top,
        }
        ranks, nodes, means, counts = columns_of(
            self._query(self._sql(q.SQL_LATENESS_TOP), params), 4)
        series: list[Row] = []
        if ranks:
            params.update({f"rank_{i}": int(r) for i, r in enumerate(ranks)})
            placeholders = ", ".join(f"{{rank_{i}:UInt32}}" for i in range(len(ranks)))
            series = self._query(self._sql(q.SQL_LATENESS_SERIES, ranks=placeholders), params)
        bucket, rank, mean, most, n = columns_of(series, 5)
        typical = (self._query(self._sql(q.SQL_LATENESS_TYPICAL), params)
                   if ranks else [])
        typical_bucket, typical_us, typical_n = columns_of(typical, 3)
        return LatenessSeries(
            start_us=start_us, width_us=width_us,
            top_rank=np.array(ranks, dtype=np.int64),
            top_node=np.array([str(x) for x in nodes], dtype=np.str_),
            top_mean_us=np.array(means, dtype=np.float64),
            top_n=np.array(counts, dtype=np.int64),
            bucket_us=np.array(bucket, dtype=np.int64), rank=np.array(rank, dtype=np.int64),
            mean_us=np.array(mean, dtype=np.float64), max_us=np.array(most, dtype=np.int64),
            n=np.array(n, dtype=np.int64),
            typical_bucket_us=np.array(typical_bucket, dtype=np.int64),
            typical_us=np.array(typical_us, dtype=np.float64),
            typical_n=np.array(typical_n, dtype=np.int64),
        )

    def recorded_reach(self, job: JobId, attempt: int, group: str, ranks: Sequence[int], *,
                       from_seq: int, until_us: int) -> dict[int, int]:
        wanted = sorted({int(r) for r in ranks if int(r) >= 0})
        if not wanted:
            return {}
        params: dict[str, Param] = {"job": job, "attempt": attempt, "group": group,
                                    "from_seq": max(int(from_seq), 0),
                                    "until_us": max(int(until_us), 0)}
        params.update({f"rank_{i}": rank for i, rank in enumerate(wanted)})
        placeholders = ", ".join(f"{{rank_{i}:UInt32}}" for i in range(len(wanted)))
        rows = self._query(self._sql(q.SQL_RECORDED_REACH, ranks=placeholders), params)
        return {int(rank): int(seq) for rank, seq in rows}

    def latest_stacks(self, job: JobId, attempt: int, since_us: int) -> list[StackSample]:
        return self._read(StackSample, q.SQL_LATEST_SINCE,
                          {"job": job, "attempt": attempt, "since_us": max(since_us, 0)})

    def latest_processes(self, job: JobId, attempt: int, since_us: int) -> list[ProcessSample]:
        return self._read(ProcessSample, q.SQL_LATEST_SINCE,
                          {"job": job, "attempt": attempt, "since_us": max(since_us, 0)})

    def health(self, nodes: Sequence[str], start_us: int, end_us: int, *,
               events_since_us: int | None = None) -> list[HealthSample]:
        wanted = sorted(set(nodes))
        start = max(start_us, 0)
        since = max(min(start, start if events_since_us is None else events_since_us), 0)
        if not wanted or end_us <= since:
            return []
        params: dict[str, Param] = {"start_us": start, "end_us": end_us,
                                    "events_since_us": since}
        params.update({f"node_{i}": node for i, node in enumerate(wanted)})
        placeholders = ", ".join(f"{{node_{i}:String}}" for i in range(len(wanted)))
        return self._read(HealthSample, q.SQL_HEALTH, params, nodes=placeholders)

    def record_incident(self, incident: Incident) -> None:
        self._insert(table_of(Incident), kinds.layout(Incident).column_batch([incident]))

    def record_action(self, action: Action) -> None:
        self._insert(table_of(Action), kinds.layout(Action).column_batch([action]))

    def record_state(self, state: JobState) -> None:
        self._insert(table_of(JobState), kinds.layout(JobState).column_batch([state]))

    def job_states(self, job: JobId) -> list[JobState]:
        found: list[JobState] = self._read(JobState, q.SQL_RECORDS_OF_JOB, {"job": job})
        return sorted(found, key=lambda s: (s.seq, s.time_us))

    def incidents(self, job: JobId | None = None) -> list[Incident]:
        found: list[Incident]
        if job is None:
            found = self._read(Incident, q.SQL_INCIDENTS_ALL, {})
            action_list: list[Action] = self._read(Action, q.SQL_ACTIONS_ALL, {})
        else:
            found = self._read(Incident, q.SQL_INCIDENTS_OF_JOB, {"job": job})
            action_list = self._read(Action, q.SQL_ACTIONS_OF_JOB, {"job": job})
        actions: dict[tuple[str, str], list[Action]] = {}
        for action in action_list:
            actions.setdefault((action.job, action.incident_id), []).append(action)
        return [
            msgspec.structs.replace(i, actions=tuple(actions.get((i.job, i.incident_id), ())))
            for i in found
        ]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
