"""What both ClickHouse adapters share: SQL texts, record <-> row conversion, exactly-once insert.

An adapter (`clickhouse_server`, `clickhouse_embedded`) subclasses `SqlTraceStore` and supplies
two things: run one query with bound parameters and return its rows, and write columns into one
table in one insert (optionally a faster insert of numpy columns, for bulk collective rows).
Everything else lives here, so both adapters run the same SQL and keep the same semantics, which
the one contract suite checks against both. The window summaries (`rank_stats`, `link_stats`,
`disagreements`, `node_windows`) are computed by the SQL here, per the definitions in
`tracing.summaries`, so only per-rank, per-link or per-node rows come back.

SQL texts are written once with `{name:Type}` placeholders; an adapter translates the placeholder
*syntax* for its client (never the values). This module must never format a value into SQL: the
only names formatted into texts are the validated database name and the schema's table and
column names.
"""

from __future__ import annotations

import abc
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

import numpy as np
import numpy.typing as npt

from tracehound.tracing import summaries
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    Incident,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.schema import (
    ACTIONS,
    COLLECTIVES,
    HEALTH,
    HEARTBEATS,
    INCIDENTS,
    PROCESS_GROUPS,
    PROCESSES,
    RANK_EXITS,
    RECORD_TABLES,
    STACKS,
    Table,
    check_identifier,
    create_statements,
)
from tracehound.tracing.store import FOREVER_US, CollectiveKey, InsertReport
from tracehound.tracing.summaries import (
    CollectiveColumns,
    Disagreement,
    LinkStats,
    NodeWindows,
    RankStats,
)

Param = str | int | float
Params = Mapping[str, Param]
Row = Sequence[Any]

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*):([A-Za-z0-9_(), ]+)\}")
"""A bound value in the shared SQL texts: `{job:String}`."""


def to_pyformat(sql: str) -> str:
    """`sql` with `{name:Type}` placeholders as `%(name)s` (clickhouse-driver's client-side
    binding), and literal % doubled so the driver's %-substitution leaves them alone."""
    return PLACEHOLDER.sub(lambda m: f"%({m.group(1)})s", sql.replace("%", "%%"))


# --- records -> rows (in each table's column order) -----------------------------------------


def _collective_row(batch_id: str, r: CollectiveEvent) -> tuple[Any, ...]:
    return (
        batch_id, r.job, r.attempt, r.node, r.rank, r.group, r.seq, r.op, r.nbytes, r.dtype,
        r.peer, r.state.value, r.enqueue_us, r.complete_us,
    )


def _heartbeat_row(batch_id: str, r: Heartbeat) -> tuple[Any, ...]:
    g = r.groups
    return (
        batch_id, r.job, r.attempt, r.node, r.rank, r.time_us, r.pid, r.step, r.step_us,
        r.start_step, r.first_step_us, r.dropped,
        [p.group for p in g], [p.last_enqueued for p in g], [p.last_completed for p in g],
        [p.pending_op for p in g], [p.last_enqueue_us for p in g],
        [p.last_complete_us for p in g],
    )


def _group_row(batch_id: str, r: ProcessGroupInfo) -> tuple[Any, ...]:
    return (batch_id, r.job, r.attempt, r.rank, r.group, list(r.ranks), r.backend, r.time_us)


def _exit_row(batch_id: str, r: RankExit) -> tuple[Any, ...]:
    return (batch_id, r.job, r.attempt, r.node, r.rank, r.pid, r.exit_code, r.time_us)


def _health_row(batch_id: str, r: HealthSample) -> tuple[Any, ...]:
    return (
        batch_id, r.job, r.node, r.device, r.time_us, r.source, r.metric, float(r.value),
        r.severity.value, r.detail,
    )


def _stack_row(batch_id: str, r: StackSample) -> tuple[Any, ...]:
    return (batch_id, r.job, r.attempt, r.node, r.rank, r.time_us, list(r.frames))


def _process_row(batch_id: str, r: ProcessSample) -> tuple[Any, ...]:
    return (
        batch_id, r.job, r.attempt, r.node, r.rank, r.pid, r.time_us, r.state, float(r.cpu_s),
        float(r.cpu_rate), r.read_bytes, r.write_bytes, float(r.io_rate),
    )


def _incident_row(i: Incident) -> tuple[Any, ...]:
    return (
        i.job, i.incident_id, i.attempt, i.detected_at_us, i.kind, list(i.culprit_ranks),
        list(i.culprit_nodes), float(i.confidence), i.summary, i.verdict_json, i.schema_version,
    )


def _action_row(a: Action) -> tuple[Any, ...]:
    return (a.job, a.incident_id, a.kind.value, a.target, a.time_us, int(a.ok), a.detail)


_RECORD_TABLE: dict[type, tuple[Table, Callable[[str, Any], tuple[Any, ...]]]] = {
    CollectiveEvent: (COLLECTIVES, _collective_row),
    Heartbeat: (HEARTBEATS, _heartbeat_row),
    ProcessGroupInfo: (PROCESS_GROUPS, _group_row),
    RankExit: (RANK_EXITS, _exit_row),
    HealthSample: (HEALTH, _health_row),
    StackSample: (STACKS, _stack_row),
    ProcessSample: (PROCESSES, _process_row),
}


def rows_by_table(batch: Batch) -> dict[str, list[tuple[Any, ...]]]:
    """A batch's rows per record table name, in batch order."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for record in batch.records:
        table, to_row = _RECORD_TABLE[type(record)]
        out.setdefault(table.name, []).append(to_row(batch.batch_id, record))
    return out


def columns_of(rows: Sequence[Sequence[Any]], width: int) -> list[list[Any]]:
    """Rows transposed into `width` columns."""
    return [[row[i] for row in rows] for i in range(width)]


# --- rows -> records (in `read_columns` order) ---------------------------------------------------


def _heartbeat(r: Row) -> Heartbeat:
    groups = tuple(
        GroupProgress(
            group=GroupId(g), last_enqueued=int(le), last_completed=int(lc), pending_op=op,
            last_enqueue_us=int(eu), last_complete_us=int(cu),
        )
        for g, le, lc, op, eu, cu in zip(r[11], r[12], r[13], r[14], r[15], r[16], strict=True)
    )
    return Heartbeat(
        job=JobId(r[0]), attempt=int(r[1]), node=NodeId(r[2]), rank=Rank(int(r[3])),
        time_us=int(r[4]), pid=int(r[5]), step=int(r[6]), step_us=int(r[7]),
        start_step=int(r[8]), first_step_us=int(r[9]), dropped=int(r[10]), groups=groups,
    )


def _exit(r: Row) -> RankExit:
    return RankExit(
        job=JobId(r[0]), attempt=int(r[1]), node=NodeId(r[2]), rank=Rank(int(r[3])),
        pid=int(r[4]), exit_code=int(r[5]), time_us=int(r[6]),
    )


def _group(r: Row) -> ProcessGroupInfo:
    return ProcessGroupInfo(
        job=JobId(r[0]), attempt=int(r[1]), rank=Rank(int(r[2])), group=GroupId(r[3]),
        ranks=tuple(int(x) for x in r[4]), backend=r[5], time_us=int(r[6]),
    )


def collective_from_row(r: Row) -> CollectiveEvent:
    return CollectiveEvent(
        job=JobId(r[0]), attempt=int(r[1]), node=NodeId(r[2]), rank=Rank(int(r[3])),
        group=GroupId(r[4]), seq=int(r[5]), op=r[6], nbytes=int(r[7]), dtype=r[8],
        peer=int(r[9]), state=CollectiveState(r[10]), enqueue_us=int(r[11]),
        complete_us=int(r[12]),
    )


def _health(r: Row) -> HealthSample:
    return HealthSample(
        job=JobId(r[0]), node=NodeId(r[1]), device=r[2], time_us=int(r[3]), source=r[4],
        metric=r[5], value=float(r[6]), severity=HealthSeverity(r[7]), detail=r[8],
    )


def _stack(r: Row) -> StackSample:
    return StackSample(
        job=JobId(r[0]), attempt=int(r[1]), node=NodeId(r[2]), rank=Rank(int(r[3])),
        time_us=int(r[4]), frames=tuple(r[5]),
    )


def _process(r: Row) -> ProcessSample:
    return ProcessSample(
        job=JobId(r[0]), attempt=int(r[1]), node=NodeId(r[2]), rank=Rank(int(r[3])),
        pid=int(r[4]), time_us=int(r[5]), state=r[6], cpu_s=float(r[7]), cpu_rate=float(r[8]),
        read_bytes=int(r[9]), write_bytes=int(r[10]), io_rate=float(r[11]),
    )


def _incident(r: Row, actions: tuple[Action, ...]) -> Incident:
    return Incident(
        job=JobId(r[0]), incident_id=r[1], attempt=int(r[2]), detected_at_us=int(r[3]),
        kind=r[4], culprit_ranks=tuple(int(x) for x in r[5]), culprit_nodes=tuple(r[6]),
        confidence=float(r[7]), summary=r[8], verdict_json=r[9], schema_version=int(r[10]),
        actions=actions,
    )


def _action(r: Row) -> Action:
    return Action(
        job=JobId(r[0]), incident_id=r[1], kind=ActionKind(r[2]), target=r[3],
        time_us=int(r[4]), ok=bool(r[5]), detail=r[6],
    )


# --- SQL texts ------------------------------------------------------------------------------
# Written out in full, in the subset both ClickHouse 18.16 and chdb run. `{db}` (and `{table}`,
# `{key}`) are replaced by validated schema identifiers; `{name:Type}` are bound values. Each
# SELECT lists its table's columns in schema order minus batch_id (tests check this).

SQL_LATEST_HEARTBEATS = """
SELECT job, attempt, node, rank, time_us, pid, step, step_us, start_step, first_step_us, dropped,
       group_ids, group_last_enqueued, group_last_completed, group_pending_op,
       group_last_enqueue_us, group_last_complete_us
FROM {db}.heartbeats
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND time_us <= {until_us:UInt64}
ORDER BY rank, time_us DESC
LIMIT 1 BY rank
"""

SQL_EXITS = """
SELECT job, attempt, node, rank, pid, exit_code, time_us
FROM {db}.rank_exits
WHERE job = {job:String} AND attempt = {attempt:UInt32}
ORDER BY time_us, rank
"""

SQL_GROUPS = """
SELECT job, attempt, rank, group_id, ranks, backend, time_us
FROM {db}.process_groups
WHERE job = {job:String} AND attempt = {attempt:UInt32}
ORDER BY group_id, time_us, rank
LIMIT 1 BY group_id
"""

SQL_COLLECTIVES = """
SELECT job, attempt, node, rank, group_id, seq, op, nbytes, dtype, peer, state, enqueue_us,
       complete_us
FROM {db}.collectives
WHERE job = {job:String} AND attempt = {attempt:UInt32}
ORDER BY group_id, seq, rank
"""

SQL_ATTEMPTS = """
SELECT DISTINCT attempt FROM (
    SELECT DISTINCT attempt FROM {db}.collectives WHERE job = {job:String}
    UNION ALL SELECT DISTINCT attempt FROM {db}.heartbeats WHERE job = {job:String}
    UNION ALL SELECT DISTINCT attempt FROM {db}.process_groups WHERE job = {job:String}
    UNION ALL SELECT DISTINCT attempt FROM {db}.rank_exits WHERE job = {job:String}
    UNION ALL SELECT DISTINCT attempt FROM {db}.stacks WHERE job = {job:String}
)
ORDER BY attempt
"""

SQL_JOBS = """
SELECT DISTINCT job FROM (
    SELECT DISTINCT job FROM {db}.collectives
    UNION ALL SELECT DISTINCT job FROM {db}.heartbeats
    UNION ALL SELECT DISTINCT job FROM {db}.process_groups
    UNION ALL SELECT DISTINCT job FROM {db}.rank_exits
    UNION ALL SELECT DISTINCT job FROM {db}.stacks
    UNION ALL SELECT DISTINCT job FROM {db}.health WHERE job != ''
    UNION ALL SELECT DISTINCT job FROM {db}.incidents
    UNION ALL SELECT DISTINCT job FROM {db}.actions
)
ORDER BY job
"""

SQL_COLLECTIVE_KEYS = """
SELECT attempt, rank, group_id, seq
FROM {db}.collectives
WHERE job = {job:String}
ORDER BY attempt, group_id, seq, rank
"""

_SELECT_INCIDENTS = """
SELECT job, incident_id, attempt, detected_at_us, kind, culprit_ranks, culprit_nodes,
       confidence, summary, verdict_json, schema_version
FROM {db}.incidents
"""
# LIMIT 1 BY: an incident recorded twice (a retried record_incident) is read back once.
_INCIDENTS_ORDER = """
ORDER BY detected_at_us, incident_id
LIMIT 1 BY job, incident_id
"""
SQL_INCIDENTS_ALL = _SELECT_INCIDENTS + _INCIDENTS_ORDER
SQL_INCIDENTS_OF_JOB = _SELECT_INCIDENTS + "WHERE job = {job:String}" + _INCIDENTS_ORDER

_SELECT_ACTIONS = """
SELECT job, incident_id, kind, target, time_us, ok, detail
FROM {db}.actions
"""
SQL_ACTIONS_ALL = _SELECT_ACTIONS + "ORDER BY time_us"
SQL_ACTIONS_OF_JOB = _SELECT_ACTIONS + "WHERE job = {job:String} ORDER BY time_us"

SQL_LATEST_STACKS = """
SELECT job, attempt, node, rank, time_us, frames
FROM {db}.stacks
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND time_us >= {since_us:UInt64}
ORDER BY rank, time_us DESC
LIMIT 1 BY rank
"""

SQL_LATEST_PROCESSES = """
SELECT job, attempt, node, rank, pid, time_us, state, cpu_s, cpu_rate, read_bytes, write_bytes,
       io_rate
FROM {db}.processes
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND time_us >= {since_us:UInt64}
ORDER BY rank, time_us DESC
LIMIT 1 BY rank
"""

# `{nodes}` becomes one `{node_<i>:String}` placeholder per node asked about.
SQL_HEALTH = """
SELECT job, node, device, time_us, source, metric, value, severity, detail
FROM {db}.health
WHERE node IN ({nodes}) AND time_us >= {start_us:UInt64} AND time_us < {end_us:UInt64}
ORDER BY time_us, node, device, metric, source, job
"""

# --- window summaries (definitions: tracing/summaries.py) ---
# Each reads one job/attempt window [start_us, end_us) without FINAL: the exactly-once insert
# path keeps a row from being stored twice. Differences of times are taken as Int64 so they never
# wrap. RANK_STATS and NODE_WINDOWS share one subquery: per (group, seq) of the collective rows
# that count (completed, not p2p, members >= 2), the first and last arrival and the members' rows
# as parallel arrays, which ARRAY JOIN turns back into rows (no self-join needed).

SQL_RANK_STATS = """
SELECT rank, count() AS n, avg(toInt64(enqueue) - toInt64(first_us)) AS lateness_mean_us,
       countIf(enqueue = last_us) AS last_count,
       avg(toInt64(complete) - toInt64(enqueue)) AS wait_mean_us,
       toInt64(max(enqueue)) - toInt64(min(enqueue)) AS span_us
FROM (
    SELECT min(enqueue_us) AS first_us, max(enqueue_us) AS last_us, groupArray(rank) AS ranks,
           groupArray(enqueue_us) AS enqueues, groupArray(complete_us) AS completes
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND state = {completed:String} AND position(group_id, {p2p:String}) = 0
    GROUP BY group_id, seq
    HAVING count() >= 2
)
ARRAY JOIN ranks AS rank, enqueues AS enqueue, completes AS complete
GROUP BY rank
ORDER BY rank
"""

SQL_NODE_WINDOWS = """
SELECT intDiv(toInt64(enqueue) - {origin_us:Int64}, {window_us:Int64}) AS bucket, node,
       avg(toInt64(enqueue) - toInt64(first_us)) AS lateness_mean_us,
       countIf(enqueue = last_us) / count() AS last_fraction,
       avg(toInt64(complete) - toInt64(enqueue)) AS wait_mean_us
FROM (
    SELECT min(enqueue_us) AS first_us, max(enqueue_us) AS last_us, groupArray(node) AS nodes,
           groupArray(enqueue_us) AS enqueues, groupArray(complete_us) AS completes
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND state = {completed:String} AND position(group_id, {p2p:String}) = 0
    GROUP BY group_id, seq
    HAVING count() >= 2
)
ARRAY JOIN nodes AS node, enqueues AS enqueue, completes AS complete
GROUP BY bucket, node
ORDER BY bucket, node
"""

SQL_LINK_STATS = """
SELECT src, dst, count() AS n, avg(transfer_us) AS transfer_mean_us,
       max(transfer_us) AS transfer_max_us
FROM (
    SELECT anyIf(rank, op IN ({send_op:String}, {isend_op:String})) AS src,
           anyIf(rank, op IN ({recv_op:String}, {irecv_op:String})) AS dst,
           toInt64(max(complete_us)) - toInt64(max(enqueue_us)) AS transfer_us
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND position(group_id, {p2p:String}) > 0
      AND op IN ({send_op:String}, {isend_op:String}, {recv_op:String}, {irecv_op:String})
    GROUP BY group_id, seq
    HAVING count() = 2 AND countIf(op IN ({send_op:String}, {isend_op:String})) = 1
       AND countIf(state = {completed:String}) = 2
)
GROUP BY src, dst
ORDER BY src, dst
"""

# DISAGREEMENTS: the first `limit` disagreeing (group, seq), LEFT JOINed on (seq, members) with
# the siblings' reference: per (seq, members, key) the number of agreeing (group, seq), the top
# key per (seq, members) by LIMIT 1 BY (so ANY and ALL join alike). Without a sibling the LEFT
# JOIN gives the column defaults '' and 0 (join_use_nulls stays off on both engines).
SQL_DISAGREEMENTS = """
SELECT group_id, seq, ranks, ops, sizes, dtypes, peer_op, peer_nbytes, peer_dtype, peer_groups
FROM (
    SELECT group_id, seq, count() AS members, arraySort(groupArray(rank)) AS ranks,
           arraySort((x, r) -> r, groupArray(op), groupArray(rank)) AS ops,
           arraySort((x, r) -> r, groupArray(nbytes), groupArray(rank)) AS sizes,
           arraySort((x, r) -> r, groupArray(dtype), groupArray(rank)) AS dtypes
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND position(group_id, {p2p:String}) = 0
    GROUP BY group_id, seq
    HAVING uniqExact(op) > 1 OR uniqExact(nbytes) > 1 OR uniqExact(dtype) > 1
    ORDER BY group_id, seq
    LIMIT {limit:UInt64}
) AS disagreeing
ANY LEFT JOIN (
    SELECT seq, members, peer_op, peer_nbytes, peer_dtype, count() AS peer_groups
    FROM (
        SELECT seq, count() AS members, any(op) AS peer_op, any(nbytes) AS peer_nbytes,
               any(dtype) AS peer_dtype
        FROM {db}.collectives
        WHERE job = {job:String} AND attempt = {attempt:UInt32}
          AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
          AND position(group_id, {p2p:String}) = 0
        GROUP BY group_id, seq
        HAVING uniqExact(op) = 1 AND uniqExact(nbytes) = 1 AND uniqExact(dtype) = 1
    )
    GROUP BY seq, members, peer_op, peer_nbytes, peer_dtype
    ORDER BY seq, members, peer_groups DESC, peer_op, peer_nbytes, peer_dtype
    LIMIT 1 BY seq, members
) AS siblings USING (seq, members)
ORDER BY group_id, seq
"""

SUMMARY_QUERIES = (SQL_RANK_STATS, SQL_NODE_WINDOWS, SQL_LINK_STATS, SQL_DISAGREEMENTS)
"""The window summary texts (the schema tests check them for the portable subset)."""

_SUMMARY_CONSTANTS: dict[str, Param] = {
    "p2p": summaries.P2P_MARK,
    "completed": CollectiveState.COMPLETED.value,
    "send_op": summaries.SEND_OPS[0],
    "isend_op": summaries.SEND_OPS[1],
    "recv_op": summaries.RECV_OPS[0],
    "irecv_op": summaries.RECV_OPS[1],
}
"""The fixed values the summary queries compare with, bound like any other value."""

SQL_BATCH_COUNT = "SELECT count() FROM {db}.{table} WHERE batch_id = {batch_id:String}"
SQL_BATCH_KEYS = "SELECT {key} FROM {db}.{table} WHERE batch_id = {batch_id:String}"

READ_QUERIES: dict[str, tuple[Table, str]] = {
    "latest_heartbeats": (HEARTBEATS, SQL_LATEST_HEARTBEATS),
    "exits": (RANK_EXITS, SQL_EXITS),
    "groups": (PROCESS_GROUPS, SQL_GROUPS),
    "collectives": (COLLECTIVES, SQL_COLLECTIVES),
    "incidents": (INCIDENTS, SQL_INCIDENTS_ALL),
    "actions": (ACTIONS, SQL_ACTIONS_ALL),
    "latest_stacks": (STACKS, SQL_LATEST_STACKS),
    "latest_processes": (PROCESSES, SQL_LATEST_PROCESSES),
    "health": (HEALTH, SQL_HEALTH),
}
"""The queries that read whole records back, with their table (checked against the schema)."""


def read_columns(table: Table) -> tuple[str, ...]:
    """The columns a record is read back from, in order: the table's, minus batch_id."""
    return tuple(name for name in table.column_names if name != "batch_id")


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

    def _sql(self, template: str, **names: str) -> str:
        sql = template.replace("{db}", self.database)
        for name, value in names.items():
            sql = sql.replace("{" + name + "}", value)
        return sql

    def ensure_schema(self) -> None:
        for statement in create_statements(self.database):
            self._query(statement, {})

    def insert(self, batch: Batch, *, maybe_duplicate: bool = False) -> InsertReport:
        tables = {t.name: t for t in RECORD_TABLES}
        inserted = skipped = 0
        with self._insert_lock:
            for name, rows in rows_by_table(batch).items():
                table = tables[name]
                todo = (
                    self._not_yet_stored(table, batch.batch_id, rows) if maybe_duplicate else rows
                )
                if todo:
                    self._insert(table, columns_of(todo, len(table.columns)))
                inserted += len(todo)
                skipped += len(rows) - len(todo)
        return InsertReport(inserted=inserted, skipped=skipped)

    def _not_yet_stored(
        self, table: Table, batch_id: str, rows: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        """The rows of a retried batch that an earlier try did not store in `table`."""
        count_rows = self._query(
            self._sql(SQL_BATCH_COUNT, table=table.name), {"batch_id": batch_id}
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
            self._sql(SQL_BATCH_KEYS, table=table.name, key=", ".join(table.key)),
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
        rows = self._query(self._sql(SQL_LATEST_HEARTBEATS),
                           {"job": job, "attempt": attempt, "until_us": max(until_us, 0)})
        return [_heartbeat(r) for r in rows]

    def exits(self, job: JobId, attempt: int) -> list[RankExit]:
        rows = self._query(self._sql(SQL_EXITS), {"job": job, "attempt": attempt})
        return [_exit(r) for r in rows]

    def groups(self, job: JobId, attempt: int) -> list[ProcessGroupInfo]:
        rows = self._query(self._sql(SQL_GROUPS), {"job": job, "attempt": attempt})
        return sorted((_group(r) for r in rows), key=lambda g: (g.time_us, g.group))

    def attempts(self, job: JobId) -> list[int]:
        return [int(r[0]) for r in self._query(self._sql(SQL_ATTEMPTS), {"job": job})]

    def jobs(self) -> list[JobId]:
        return [JobId(r[0]) for r in self._query(self._sql(SQL_JOBS), {})]

    def collective_keys(self, job: JobId) -> list[CollectiveKey]:
        rows = self._query(self._sql(SQL_COLLECTIVE_KEYS), {"job": job})
        return [
            CollectiveKey(attempt=int(a), rank=int(r), group=g, seq=int(s)) for a, r, g, s in rows
        ]

    def collectives(self, job: JobId, attempt: int) -> list[CollectiveEvent]:
        """Every stored collective row of an attempt, ordered by group, seq, rank (not part of
        the TraceStore port; used by tests and tools that read raw rows)."""
        rows = self._query(self._sql(SQL_COLLECTIVES), {"job": job, "attempt": attempt})
        return [collective_from_row(r) for r in rows]

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
                     "enqueue_us", "complete_us"):
            if getattr(cols, name).shape != (n,):
                raise ValueError(f"column {name!r} has shape {getattr(cols, name).shape}, "
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
            cols.complete_us,
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
        return {**_SUMMARY_CONSTANTS, "job": job, "attempt": attempt, "start_us": start,
                "end_us": end_us}

    def rank_stats(self, job: JobId, attempt: int, start_us: int, end_us: int) -> RankStats:
        params = self._window_params(job, attempt, start_us, end_us)
        rows = self._query(self._sql(SQL_RANK_STATS), params) if params else []
        rank, n, lateness, last, wait, span = columns_of(rows, 6)
        return RankStats(
            rank=np.array(rank, dtype=np.int64), n=np.array(n, dtype=np.int64),
            lateness_mean_us=np.array(lateness, dtype=np.float64),
            last_count=np.array(last, dtype=np.int64),
            wait_mean_us=np.array(wait, dtype=np.float64),
            span_us=np.array(span, dtype=np.int64),
        )

    def link_stats(self, job: JobId, attempt: int, start_us: int, end_us: int) -> LinkStats:
        params = self._window_params(job, attempt, start_us, end_us)
        rows = self._query(self._sql(SQL_LINK_STATS), params) if params else []
        src, dst, n, mean, most = columns_of(rows, 5)
        return LinkStats(
            src=np.array(src, dtype=np.int64), dst=np.array(dst, dtype=np.int64),
            n=np.array(n, dtype=np.int64), transfer_mean_us=np.array(mean, dtype=np.float64),
            transfer_max_us=np.array(most, dtype=np.float64),
        )

    def disagreements(
        self, job: JobId, attempt: int, start_us: int, end_us: int, limit: int = 100
    ) -> list[Disagreement]:
        params = self._window_params(job, attempt, start_us, end_us)
        if params is None or limit <= 0:
            return []
        rows = self._query(self._sql(SQL_DISAGREEMENTS), {**params, "limit": limit})
        return [
            Disagreement(
                group=g, seq=int(seq), ranks=tuple(int(r) for r in ranks), ops=tuple(ops),
                nbytes=tuple(int(b) for b in sizes), dtypes=tuple(dtypes), peer_op=peer_op,
                peer_nbytes=int(peer_nbytes), peer_dtype=peer_dtype,
                peer_groups=int(peer_groups),
            )
            for g, seq, ranks, ops, sizes, dtypes, peer_op, peer_nbytes, peer_dtype, peer_groups
            in rows
        ]

    def node_windows(
        self, job: JobId, attempt: int, start_us: int, end_us: int, window_us: int
    ) -> NodeWindows:
        buckets = summaries.bucket_count(start_us, end_us, window_us)
        params = self._window_params(job, attempt, start_us, end_us)
        rows: list[Row] = []
        if params is not None:
            params.update(origin_us=start_us, window_us=window_us)
            rows = self._query(self._sql(SQL_NODE_WINDOWS), params)
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

    def latest_stacks(self, job: JobId, attempt: int, since_us: int) -> list[StackSample]:
        rows = self._query(
            self._sql(SQL_LATEST_STACKS),
            {"job": job, "attempt": attempt, "since_us": max(since_us, 0)},
        )
        return [_stack(r) for r in rows]

    def latest_processes(self, job: JobId, attempt: int, since_us: int) -> list[ProcessSample]:
        rows = self._query(
            self._sql(SQL_LATEST_PROCESSES),
            {"job": job, "attempt": attempt, "since_us": max(since_us, 0)},
        )
        return [_process(r) for r in rows]

    def health(self, nodes: Sequence[str], start_us: int, end_us: int) -> list[HealthSample]:
        wanted = sorted(set(nodes))
        start = max(start_us, 0)
        if not wanted or end_us <= start:
            return []
        params: dict[str, Param] = {"start_us": start, "end_us": end_us}
        params.update({f"node_{i}": node for i, node in enumerate(wanted)})
        placeholders = ", ".join(f"{{node_{i}:String}}" for i in range(len(wanted)))
        rows = self._query(self._sql(SQL_HEALTH, nodes=placeholders), params)
        return [_health(r) for r in rows]

    def record_incident(self, incident: Incident) -> None:
        self._insert(INCIDENTS, columns_of([_incident_row(incident)], len(INCIDENTS.columns)))

    def record_action(self, action: Action) -> None:
        self._insert(ACTIONS, columns_of([_action_row(action)], len(ACTIONS.columns)))

    def incidents(self, job: JobId | None = None) -> list[Incident]:
        if job is None:
            incident_rows = self._query(self._sql(SQL_INCIDENTS_ALL), {})
            action_rows = self._query(self._sql(SQL_ACTIONS_ALL), {})
        else:
            incident_rows = self._query(self._sql(SQL_INCIDENTS_OF_JOB), {"job": job})
            action_rows = self._query(self._sql(SQL_ACTIONS_OF_JOB), {"job": job})
        actions: dict[tuple[str, str], list[Action]] = {}
        for row in action_rows:
            action = _action(row)
            actions.setdefault((action.job, action.incident_id), []).append(action)
        return [_incident(r, tuple(actions.get((r[0], r[1]), ()))) for r in incident_rows]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
