"""The SQL texts both ClickHouse adapters run, and the placeholder syntax they share.

Texts are written once with `{name:Type}` placeholders; an adapter translates the placeholder
*syntax* for its client (never the values). Nothing here may format a value into SQL: the only
names formatted into texts are the validated database name and the schema's table and column
names. The window summaries are computed here per the definitions in `tracing.summaries`, so
only per-rank, per-link or per-node rows come back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from tracehound.tracing import shapes, summaries
from tracehound.tracing.events import CollectiveState
from tracehound.tracing.store.schema import (
    ACTIONS,
    CLOCK_READINGS,
    COLLECTIVES,
    HEALTH,
    HEARTBEATS,
    INCIDENTS,
    PROCESS_GROUPS,
    PROCESSES,
    RANK_EXITS,
    STACKS,
    Table,
    check_identifier,
)

Param = str | int | float
Params = Mapping[str, Param]

PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*):([A-Za-z0-9_(), ]+)\}")
"""A bound value in the shared SQL texts: `{job:String}`."""


def to_pyformat(sql: str) -> str:
    """`sql` with `{name:Type}` placeholders as `%(name)s` (clickhouse-driver's client-side
    binding), and literal % doubled so the driver's %-substitution leaves them alone."""
    return PLACEHOLDER.sub(lambda m: f"%({m.group(1)})s", sql.replace("%", "%%"))


# Written out in full, in the subset both ClickHouse 18.16 and chdb run. `{db}` (and `{table}`,
# `{key}`, `{time}`) are replaced by validated schema identifiers; `{columns}` by the table's
# read columns (its columns minus batch_id, in declaration order); `{name:Type}` are bound
# values.

SQL_LATEST_HEARTBEATS = """
SELECT {columns}
FROM {db}.heartbeats
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND time_us <= {until_us:UInt64}
ORDER BY rank, time_us DESC
LIMIT 1 BY rank
"""

SQL_EXITS = """
SELECT {columns}
FROM {db}.rank_exits
WHERE job = {job:String} AND attempt = {attempt:UInt32}
ORDER BY time_us, rank
"""

SQL_GROUPS = """
SELECT {columns}
FROM {db}.process_groups
WHERE job = {job:String} AND attempt = {attempt:UInt32}
ORDER BY group_id, time_us, rank
LIMIT 1 BY group_id
"""

SQL_COLLECTIVES = """
SELECT {columns}
FROM {db}.collectives
WHERE job = {job:String} AND attempt = {attempt:UInt32}
ORDER BY group_id, seq, rank
"""

SQL_RECORDED_REACH = """
SELECT rank, max(seq)
FROM {db}.collectives
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND group_id = {group:String}
  AND seq >= {from_seq:UInt64} AND enqueue_us <= {until_us:UInt64} AND rank IN ({ranks})
GROUP BY rank
ORDER BY rank
"""
"""Per rank asked for, its highest stored seq in one group from `from_seq` (the order key's
range: job, attempt, group_id, seq)."""

SQL_COLLECTIVE_KEYS = """
SELECT attempt, rank, group_id, seq
FROM {db}.collectives
WHERE job = {job:String}
ORDER BY attempt, group_id, seq, rank
"""

_SELECT_INCIDENTS = """
SELECT {columns}
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
SELECT {columns}
FROM {db}.actions
"""
SQL_ACTIONS_ALL = _SELECT_ACTIONS + "ORDER BY time_us"
SQL_ACTIONS_OF_JOB = _SELECT_ACTIONS + "WHERE job = {job:String} ORDER BY time_us"

SQL_LATEST_SINCE = """
SELECT {columns}
FROM {db}.{table}
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND time_us >= {since_us:UInt64}
ORDER BY rank, time_us DESC
LIMIT 1 BY rank
"""

# Per node the reading with the shortest round trip since `since_us` (the most exact one).
SQL_CLOCK_READINGS = """
SELECT {columns}
FROM {db}.clock_readings
WHERE job = {job:String} AND time_us >= {since_us:UInt64}
ORDER BY node, delay_us, time_us DESC
LIMIT 1 BY node
"""

# `{nodes}` becomes one `{node_<i>:String}` placeholder per node asked about.
# Every sample of [start_us, end_us), and the warning and critical ones (events, not plain
# metrics) from events_since_us (<= start_us) on.
SQL_HEALTH = """
SELECT {columns}
FROM {db}.health
WHERE node IN ({nodes}) AND time_us >= {events_since_us:UInt64} AND time_us < {end_us:UInt64}
  AND (time_us >= {start_us:UInt64} OR severity IN ('warning', 'critical'))
ORDER BY time_us, node, device, metric, source, job
"""

# --- window summaries (definitions: tracing/summaries.py) ---
# Each reads one job/attempt window [start_us, end_us) without FINAL: the exactly-once insert
# path keeps a row from being stored twice. Differences of times are taken as Int64 so they never
# wrap. RANK_STATS and NODE_WINDOWS share one subquery: per (group, seq) of the collective rows
# that count (completed, not p2p, members >= 2), the first and last arrival and the members' rows
# as parallel arrays, which ARRAY JOIN turns back into rows (no self-join needed).

_ARRIVALS = """(
    SELECT min({enq}) AS first_us, max({enq}) AS last_us,
           arrayElement(arrayReverseSort(groupArray({enq})), 2) AS second_us,
           groupArray(MEMBER) AS members, groupArray({enq}) AS enqueues,
           groupArray({cmp}) AS completes
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND state = {completed:String} AND position(group_id, {p2p:String}) = 0
    GROUP BY group_id, seq
    HAVING count() >= 2
)"""
"""Per (group, seq) of the collective rows that count: first, second latest and last arrival,
and each member's MEMBER (rank or node), arrival and completion as parallel arrays. `{enq}` and
`{cmp}` are the rows' enqueue and completion times as Int64, clock-corrected or not
(`aligned_time`)."""

SQL_RANK_STATS = """
SELECT rank, n, lateness_mean_us, last_count, wait_mean_us, span_us, blame_us,
       busy_us, busy_max_us, active_us
FROM (
    SELECT rank, count() AS n, avg(enqueue - first_us) AS lateness_mean_us,
           countIf(enqueue = last_us) AS last_count,
           avg(complete - enqueue) AS wait_mean_us,
           max(enqueue) - min(enqueue) AS span_us,
           sum(if(enqueue = last_us AND second_us < last_us, enqueue - second_us, 0))
               AS blame_us
    FROM """ + _ARRIVALS.replace("MEMBER", "rank") + """
    ARRAY JOIN members AS rank, enqueues AS enqueue, completes AS complete
    GROUP BY rank
) AS arrivals
ANY LEFT JOIN (
    SELECT rank, arraySum(gaps) AS busy_us,
           if(empty(gaps), toInt64(0), arrayReduce('max', gaps)) AS busy_max_us, active_us
    FROM (
        SELECT rank, arraySort(groupArray((toInt64(enqueue_us), toInt64(complete_us)))) AS ops,
               arrayMap((a, b) -> greatest(tupleElement(a, 1) - tupleElement(b, 2), toInt64(0)),
                        arrayPopFront(ops), arrayPopBack(ops)) AS gaps,
               toInt64(max(complete_us)) - toInt64(min(enqueue_us)) AS active_us
        FROM {db}.collectives
        WHERE job = {job:String} AND attempt = {attempt:UInt32}
          AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
          AND state = {completed:String}
        GROUP BY rank
    )
) AS own USING rank
ORDER BY rank
"""  # noqa: S608 (constant texts joined at import; values are bound)

SQL_NODE_WINDOWS = """
SELECT least(greatest(intDiv(enqueue - {origin_us:Int64}, {window_us:Int64}), 0),
             {last_bucket:Int64}) AS bucket, node,
       avg(enqueue - first_us) AS lateness_mean_us,
       countIf(enqueue = last_us) / count() AS last_fraction,
       avg(complete - enqueue) AS wait_mean_us
FROM """ + _ARRIVALS.replace("MEMBER", "node") + """
ARRAY JOIN members AS node, enqueues AS enqueue, completes AS complete
GROUP BY bucket, node
ORDER BY bucket, node
"""

SQL_LINK_STATS = """
SELECT src, dst, count() AS n, avg(transfer_us) AS transfer_mean_us,
       max(transfer_us) AS transfer_max_us
FROM (
    SELECT anyIf(rank, op IN ({send_op:String}, {isend_op:String})) AS src,
           anyIf(rank, op IN ({recv_op:String}, {irecv_op:String})) AS dst,
           greatest(min({cmp}) - max({enq}), 0) AS transfer_us
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

_SYMMETRIC = ", ".join(f"{{sym_op_{i}:String}}" for i in range(len(summaries.SYMMETRIC_OPS)))

SQL_CLOCK_SAMPLES = """
SELECT group_id, node, intDiv(toInt64(center) - {origin_us:Int64}, {width_us:Int64}) AS bucket,
       quantileExact(0.5)(toInt64(complete) - toInt64(center)) AS offset_us, count() AS n
FROM (
    SELECT group_id, seq, quantileExact(0.5)(complete_us) AS center,
           groupArray(node) AS nodes, groupArray(complete_us) AS completes
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND state = {completed:String}
      AND ((position(group_id, {p2p:String}) = 0 AND op IN (""" + _SYMMETRIC + """))
           OR (position(group_id, {p2p:String}) > 0
               AND op IN ({send_op:String}, {isend_op:String}, {recv_op:String},
                          {irecv_op:String})))
    GROUP BY group_id, seq
    HAVING uniqExact(node) >= 2 AND center >= {start_us:UInt64} AND center < {end_us:UInt64}
)
ARRAY JOIN nodes AS node, completes AS complete
GROUP BY group_id, node, bucket
ORDER BY group_id, node, bucket
"""  # noqa: S608 (constant texts joined at import; values are bound)
"""Per (group, node, bucket): how far the node's completions sit from its collectives' upper
median completion (definitions: tracing/summaries.py ClockSamples)."""


QUERY_LIMITS: dict[str, int] = {
    "max_query_size": 64 << 20,
    "max_ast_elements": 10_000_000,
    "max_expanded_ast_elements": 10_000_000,
}
"""Session settings of both adapters: a clock-corrected summary of a job on 1,280 nodes names
every node's offset and drift (`aligned_time`) in a query of about 300 KB, past the engines'
default 256 KiB and 50,000 AST elements."""


def aligned_time(column: str, nodes: int) -> str:
    """`column` (enqueue_us or complete_us) as Int64 on the common clock, with one
    `{clk_node_<i>:String}`, `{clk_off_<i>:Float64}` and `{clk_drift_<i>:Float64}` placeholder per
    corrected node and `{clk_ref:Int64}`; the column as it is when no node is corrected."""
    if column not in ("enqueue_us", "complete_us"):
        raise ValueError(f"cannot align column {column!r}")
    if nodes == 0:
        return f"toInt64({column})"
    names = ", ".join(f"{{clk_node_{i}:String}}" for i in range(nodes))
    offsets = ", ".join(f"{{clk_off_{i}:Float64}}" for i in range(nodes))
    drifts = ", ".join(f"{{clk_drift_{i}:Float64}}" for i in range(nodes))
    return (
        f"(toInt64({column}) - toInt64(floor("
        f"transform(node, [{names}], [{offsets}], toFloat64(0)) + "
        f"transform(node, [{names}], [{drifts}], toFloat64(0)) * "
        f"toFloat64(toInt64({column}) - {{clk_ref:Int64}}))))"
    )


# DISAGREEMENTS: the first `limit` disagreeing (group, seq) in group order (lengthUTF8, then
# bytes: see `summaries.group_order`), LEFT JOINed on (seq, members) with the siblings'
# reference: per (seq, members, key) the number of agreeing (group, seq), the top key per (seq,
# members) by LIMIT 1 BY (so ANY and ALL join alike). Without a sibling the LEFT JOIN gives the
# column defaults '' and 0 (join_use_nulls stays off on both engines). A (group, seq) of one op
# in `{uneven_ops}` and one dtype, whose sizes alone differ, is uneven by design and is left out
# before the limit. Shapes (`tracing.shapes`) disagree only where every row has one, and are
# compared as `shapes.comparable` says: without the root's side of a gather or scatter, and
# without sizes for an uneven op. `{uneven_ops}` becomes an array of one `{uneven_<i>:String}`
# placeholder per op, or `emptyArrayString()` without any (`has([], x)` is a type error on
# 18.16). `total` counts every disagreeing (group, seq) before the limit, in a scalar subquery
# over the same rows (`<disagreeing>`: one text for both; 18.16 has no window functions), so
# the caller can say how many the limit dropped.
SQL_DISAGREEMENTS = """
SELECT group_id, seq, ranks, ops, sizes, dtypes, shapes, peer_op, peer_nbytes, peer_dtype,
       peer_groups, (SELECT count() FROM (SELECT seq <disagreeing>)) AS total
FROM (
    SELECT group_id, seq, count() AS members, arraySort(groupArray(rank)) AS ranks,
           arraySort((x, r) -> r, groupArray(op), groupArray(rank)) AS ops,
           arraySort((x, r) -> r, groupArray(nbytes), groupArray(rank)) AS sizes,
           arraySort((x, r) -> r, groupArray(dtype), groupArray(rank)) AS dtypes,
           arraySort((x, r) -> r, groupArray(shape), groupArray(rank)) AS shapes
    <disagreeing>
    ORDER BY lengthUTF8(group_id), group_id, seq
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
          AND position(group_id, {p2p:String}) = 0 AND NOT endsWith(group_id, {counted:String})
        GROUP BY group_id, seq
        HAVING uniqExact(op) = 1 AND uniqExact(nbytes) = 1 AND uniqExact(dtype) = 1
           AND uniqExact(shape) = 1
    )
    GROUP BY seq, members, peer_op, peer_nbytes, peer_dtype
    ORDER BY seq, members, peer_groups DESC, peer_op, peer_nbytes, peer_dtype
    LIMIT 1 BY seq, members
) AS siblings USING (seq, members)
ORDER BY lengthUTF8(group_id), group_id, seq
""".replace("<disagreeing>", """
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND position(group_id, {p2p:String}) = 0 AND NOT endsWith(group_id, {counted:String})
    GROUP BY group_id, seq
    HAVING uniqExact(op) > 1 OR uniqExact(dtype) > 1
        OR (uniqExact(nbytes) > 1 AND NOT has({uneven_ops}, any(op)))
        OR (min(shape) != {unknown:String} AND uniqExact(<comparable>) > 1)""").replace(
    "<comparable>", """if(has({uneven_ops}, op),
                          replaceRegexpAll(<rooted>, {shape_sizes:String}, {unknown:String}),
                          <rooted>)""").replace(
    "<rooted>", """multiIf(op = {gather_op:String},
                           replaceRegexpAll(shape, {shape_outputs:String}, {unknown:String}),
                           op = {scatter_op:String},
                           replaceRegexpAll(shape, {shape_inputs:String}, {unknown:String}),
                           shape)""")

SUMMARY_QUERIES = (SQL_RANK_STATS, SQL_NODE_WINDOWS, SQL_LINK_STATS, SQL_DISAGREEMENTS,
                   SQL_CLOCK_SAMPLES)
"""The window summary texts (the schema tests check them for the portable subset)."""

SUMMARY_CONSTANTS: dict[str, Param] = {
    "p2p": summaries.P2P_MARK,
    "counted": summaries.COUNTED_SUFFIX,
    "shape_sizes": shapes.SIZES,
    "shape_outputs": shapes.OUTPUTS,
    "shape_inputs": shapes.INPUTS,
    "gather_op": "gather",
    "scatter_op": "scatter",
    "unknown": "",
    "completed": CollectiveState.COMPLETED.value,
    "send_op": summaries.SEND_OPS[0],
    "isend_op": summaries.SEND_OPS[1],
    "recv_op": summaries.RECV_OPS[0],
    "irecv_op": summaries.RECV_OPS[1],
    **{f"sym_op_{i}": op for i, op in enumerate(summaries.SYMMETRIC_OPS)},
}
"""The fixed values the summary queries compare with, bound like any other value."""

# --- the dashboard's views (definitions: tracing/summaries.py ProgressGrid, LatenessSeries) ---
# Every text reads one job and attempt through the plain tables (in cluster mode the Distributed
# ones) and keeps the outermost query off them (FROM a subquery or a JOIN of subqueries), so no
# subquery is ever sent to the shards inside another distributed one.

SQL_PROGRESS_EXTENT = """
SELECT count(), min(seq), max(seq), max(rank)
FROM {db}.collectives
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND group_id = {group:String}
"""
"""The group's collective rows of the attempt: how many, the lowest and highest seq, the highest
rank (the order key's prefix job, attempt, group_id picks the group's rows only)."""

SQL_PROGRESS_HEARTBEAT_RANKS = """
SELECT count(), max(rank)
FROM {db}.heartbeats
WHERE job = {job:String} AND attempt = {attempt:UInt32} AND has(group_ids, {group:String})
"""
"""The heartbeats of the attempt that report the group: how many, the highest rank."""

# Per seq of [seq_lo, seq_hi] (the order key's range: job, attempt, group_id, seq) the first
# arrival and the rows as parallel arrays, which ARRAY JOIN turns back into rows.
SQL_PROGRESS_CELLS = """
SELECT intDiv(rank, {width:UInt64}) * {width:UInt64} AS bucket, seq, count() AS ranks,
       countIf(row_state = {failed:String}) AS failed, max(enqueue - first_us) AS late_max_us,
       avg(enqueue - first_us) AS late_mean_us, min(row_op) AS op
FROM (
    SELECT seq, min(toInt64(enqueue_us)) AS first_us, groupArray(rank) AS members,
           groupArray(toInt64(enqueue_us)) AS enqueues, groupArray(state) AS states,
           groupArray(op) AS ops
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32} AND group_id = {group:String}
      AND seq >= {seq_lo:UInt64} AND seq <= {seq_hi:UInt64}
    GROUP BY seq
)
ARRAY JOIN members AS rank, enqueues AS enqueue, states AS row_state, ops AS row_op
GROUP BY bucket, seq
ORDER BY bucket, seq
"""

# Per rank its progress in the group from its latest heartbeat reporting the group (argMax by
# time), then per bucket of ranks.
SQL_PROGRESS_BUCKETS = """
SELECT intDiv(rank, {width:UInt64}) * {width:UInt64} AS bucket, count() AS ranks,
       min(completed) AS min_completed, max(completed) AS max_completed,
       max(enqueued) AS max_enqueued, countIf(enqueued > completed) AS pending
FROM (
    SELECT rank,
           argMax(group_last_enqueued[indexOf(group_ids, {group:String})], time_us) AS enqueued,
           argMax(group_last_completed[indexOf(group_ids, {group:String})], time_us)
               AS completed
    FROM {db}.heartbeats
    WHERE job = {job:String} AND attempt = {attempt:UInt32} AND has(group_ids, {group:String})
    GROUP BY rank
)
GROUP BY bucket
ORDER BY bucket
"""

# LATENESS: the window's collective rows (peer = -1), each JOINed with the first arrival of its
# (group, seq) among them; `<ranks>` narrows the rows (not the first arrivals) to some ranks.
# ALL, not ANY: the right side has one row per key, and chdb's ANY INNER JOIN would match each
# right row with one left row only.
_LATENESS_ROWS = """(
    SELECT rank, node, group_id, seq, toInt64(enqueue_us) AS enqueue
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND peer = {collective_peer:Int32} <ranks>
) AS arrivals
ALL INNER JOIN (
    SELECT group_id, seq, min(toInt64(enqueue_us)) AS first_us
    FROM {db}.collectives
    WHERE job = {job:String} AND attempt = {attempt:UInt32}
      AND enqueue_us >= {start_us:UInt64} AND enqueue_us < {end_us:UInt64}
      AND peer = {collective_peer:Int32}
    GROUP BY group_id, seq
) AS firsts USING (group_id, seq)"""

SQL_LATENESS_TOP = """
SELECT rank, min(node) AS rank_node, avg(enqueue - first_us) AS mean_us, count() AS n
FROM """ + _LATENESS_ROWS.replace("<ranks>", "") + """
GROUP BY rank
ORDER BY mean_us DESC, rank
LIMIT {top:UInt64}
"""

# `{ranks}` becomes one `{rank_<i>:UInt32}` placeholder per top rank.
SQL_LATENESS_SERIES = """
SELECT {origin_us:Int64}
           + intDiv(enqueue - {origin_us:Int64}, {width_us:Int64}) * {width_us:Int64} AS bucket_us,
       rank, avg(enqueue - first_us) AS mean_us, max(enqueue - first_us) AS max_us, count() AS n
FROM """ + _LATENESS_ROWS.replace("<ranks>", "AND rank IN ({ranks})") + """
GROUP BY bucket_us, rank
ORDER BY bucket_us, rank
"""

SQL_LATENESS_TYPICAL = """
SELECT {origin_us:Int64}
           + intDiv(enqueue - {origin_us:Int64}, {width_us:Int64}) * {width_us:Int64} AS bucket_us,
       quantileExact(0.5)(enqueue - first_us) AS typical_us, count() AS n
FROM """ + _LATENESS_ROWS.replace("<ranks>", "") + """
GROUP BY bucket_us
ORDER BY bucket_us
"""

UI_QUERIES = (SQL_PROGRESS_EXTENT, SQL_PROGRESS_HEARTBEAT_RANKS, SQL_PROGRESS_CELLS,
              SQL_PROGRESS_BUCKETS, SQL_LATENESS_TOP, SQL_LATENESS_SERIES, SQL_LATENESS_TYPICAL)
"""The dashboard's view texts (the schema tests check them for the portable subset)."""

UI_CONSTANTS: dict[str, Param] = {
    "failed": CollectiveState.FAILED.value,
    "collective_peer": -1,
}
"""The fixed values the view queries compare with, bound like any other value."""


SQL_TABLE_COLUMNS = """
SELECT name FROM system.columns WHERE database = {database:String} AND table = {table:String}
"""

SQL_PARTITIONS = """
SELECT DISTINCT partition FROM system.parts
WHERE database = {database:String} AND table = {table:String} AND active
"""

SQL_BATCH_COUNT = "SELECT count() FROM {db}.{table} WHERE batch_id = {batch_id:String}"
SQL_BATCH_KEYS = "SELECT {key} FROM {db}.{table} WHERE batch_id = {batch_id:String}"

SQL_RECORDS_OF_JOB = """
SELECT {columns}
FROM {db}.{table}
WHERE job = {job:String}
ORDER BY {time}
"""

SQL_RECORDS_OF_JOB_STORED_BY = """
SELECT {columns}
FROM {db}.{table}
WHERE job = {job:String} AND stored_us <= {stored_by:UInt64}
ORDER BY {time}
"""

READ_QUERIES: dict[str, tuple[Table, str]] = {
    "records": (COLLECTIVES, SQL_RECORDS_OF_JOB),
    "records_stored_by": (COLLECTIVES, SQL_RECORDS_OF_JOB_STORED_BY),
    "latest_heartbeats": (HEARTBEATS, SQL_LATEST_HEARTBEATS),
    "exits": (RANK_EXITS, SQL_EXITS),
    "groups": (PROCESS_GROUPS, SQL_GROUPS),
    "collectives": (COLLECTIVES, SQL_COLLECTIVES),
    "incidents": (INCIDENTS, SQL_INCIDENTS_ALL),
    "actions": (ACTIONS, SQL_ACTIONS_ALL),
    "latest_stacks": (STACKS, SQL_LATEST_SINCE),
    "latest_processes": (PROCESSES, SQL_LATEST_SINCE),
    "health": (HEALTH, SQL_HEALTH),
    "clock_readings": (CLOCK_READINGS, SQL_CLOCK_READINGS),
}
"""The queries that read whole records back, with their table (checked against the schema)."""


def attempts_query(tables: tuple[Table, ...]) -> str:
    """The attempts of `{job:String}` that left a record in any of `tables` (those with an
    attempt column), ascending."""
    parts = [  # table names are checked identifiers, never values
        f"SELECT DISTINCT attempt FROM {{db}}.{check_identifier(t.name)} "  # noqa: S608
        "WHERE job = {job:String}"
        for t in tables if "attempt" in t.column_names and "job" in t.column_names
    ]
    union = "\n    UNION ALL ".join(parts)
    return f"SELECT DISTINCT attempt FROM (\n    {union}\n)\nORDER BY attempt"  # noqa: S608


def jobs_query(tables: tuple[Table, ...]) -> str:
    """Every job named in any of `tables` (a node-wide health reading's "" is not a job)."""
    parts = [  # table names are checked identifiers, never values
        f"SELECT DISTINCT job FROM {{db}}.{check_identifier(t.name)} WHERE job != ''"  # noqa: S608
        for t in tables if "job" in t.column_names
    ]
    union = "\n    UNION ALL ".join(parts)
    return f"SELECT DISTINCT job FROM (\n    {union}\n)\nORDER BY job"  # noqa: S608
