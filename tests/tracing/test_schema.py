"""The schema and the shared SQL texts: the portable subset, and queries that match the tables."""

from __future__ import annotations

import re

import pytest

from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.store.schema import check_identifier, create_statements, tables
from tracehound.tracing.store.sql import (
    PLACEHOLDER,
    READ_QUERIES,
    SUMMARY_CONSTANTS,
    SUMMARY_QUERIES,
    to_pyformat,
)

TABLES = tables()
RECORD_TABLES = tables(batch=True)

NOT_ON_18_16 = ("DateTime64", "Map(", "JSON", "TTL", "CODEC", "LowCardinality", "OVER (")


def test_one_statement_per_table_in_the_portable_subset() -> None:
    statements = create_statements("tracehound")
    assert statements[0] == "CREATE DATABASE IF NOT EXISTS tracehound"
    assert len(statements) == 1 + len(TABLES)
    for table, ddl in zip(TABLES, statements[1:], strict=True):
        assert ddl.startswith(f"CREATE TABLE IF NOT EXISTS tracehound.{table.name} (")
        assert "PARTITION BY toYYYYMMDD(ts)" in ddl
        assert f"toDateTime(intDiv({table.time_column}, 1000000), 'UTC')" in ddl
        for banned in NOT_ON_18_16:
            assert banned not in ddl


def test_record_tables_carry_batch_id_and_a_key_of_their_columns() -> None:
    for table in RECORD_TABLES:
        assert table.column_names[0] == "batch_id"
        assert set(table.key) <= set(table.column_names)
    [collectives] = [t for t in TABLES if t.name == "collectives"]
    assert collectives.engine == "ReplacingMergeTree"
    assert collectives.order_by == ("job", "attempt", "group_id", "seq", "rank")


def test_the_derived_tables_keep_the_columns_stored_data_already_has() -> None:
    """Tables are derived from the record declarations; a store created before that must still
    fit, so the derived columns of the oldest tables are pinned here."""
    by_name = {t.name: t for t in TABLES}
    assert [f"{c.name} {c.type}" for c in by_name["collectives"].columns] == [
        "batch_id String", "job String", "attempt UInt32", "node String", "rank UInt32",
        "group_id String", "seq UInt64", "op String", "nbytes UInt64", "dtype String",
        "peer Int32", "state String", "enqueue_us UInt64", "complete_us UInt64",
        # added later, like the heartbeats' below
        "shape String",
    ]
    assert by_name["heartbeats"].column_names[-15:] == (
        "group_ids", "group_last_enqueued", "group_last_completed", "group_pending_op",
        "group_last_enqueue_us", "group_last_complete_us",
        # added later: ensure_schema adds them to an older store (test_store_contract)
        "group_pending_nbytes", "group_pending_dtype",
        "group_oldest_seq", "group_oldest_op", "group_oldest_nbytes", "group_oldest_dtype",
        "group_pending_shape", "group_oldest_shape", "resumed_us",
    )
    assert [f"{c.name} {c.type}" for c in by_name["incidents"].columns] == [
        "job String", "incident_id String", "attempt UInt32", "detected_at_us UInt64",
        "kind String", "culprit_ranks Array(Int64)", "culprit_nodes Array(String)",
        "confidence Float64", "summary String", "verdict_json String", "schema_version UInt32",
    ]
    assert [f"{c.name} {c.type}" for c in by_name["job_states"].columns] == [
        "job String", "time_us UInt64", "seq UInt32", "state String", "attempt UInt32",
        "incident_id String", "nodes Array(String)", "isolated Array(String)", "plan String",
        "detail String", "controller String",
    ]
    assert set(by_name) == {
        "collectives", "heartbeats", "process_groups", "rank_exits", "health", "stacks",
        "processes", "incidents", "actions", "clock_readings", "job_states",
    }


@pytest.mark.parametrize("name", list(READ_QUERIES))
def test_read_queries_select_the_declared_columns_of_their_table(name: str) -> None:
    """Record-reading queries select `{columns}` (the table's read columns, filled in from the
    declaration), so a new field cannot be forgotten in a SELECT."""
    table, sql = READ_QUERIES[name]
    match = re.search(r"SELECT(.*?)FROM", sql, re.S)
    assert match is not None
    assert match.group(1).strip() == "{columns}"
    assert f"{{db}}.{table.name}" in sql or "{db}.{table}" in sql
    for banned in NOT_ON_18_16:
        assert banned not in sql


def test_placeholders_become_driver_parameters_and_percent_is_kept_literal() -> None:
    sql = "SELECT '%' FROM t WHERE job = {job:String} AND a IN ({job:String}, {n:UInt32})"
    assert to_pyformat(sql) == (
        "SELECT '%%' FROM t WHERE job = %(job)s AND a IN (%(job)s, %(n)s)"
    )
    assert to_pyformat(sql) % {"job": "'x'", "n": 3} == (
        "SELECT '%' FROM t WHERE job = 'x' AND a IN ('x', 3)"
    )
    assert PLACEHOLDER.findall("{db}.t") == []


@pytest.mark.parametrize("bad", ["", "1abc", "a-b", "a b", "a;drop", "x" * 200, "é"])
def test_identifiers_are_checked(bad: str) -> None:
    with pytest.raises(StoreConfigError, match="not a usable database or table name"):
        check_identifier(bad)
    with pytest.raises(StoreConfigError):
        create_statements(bad)


@pytest.mark.parametrize("sql", SUMMARY_QUERIES,
                         ids=["rank", "node_windows", "link", "disagree", "clock"])
def test_summary_queries_keep_to_the_portable_subset_and_bind_every_value(sql: str) -> None:
    for banned in (*NOT_ON_18_16, "WITH ", "FINAL", "{p:"):
        assert not re.search(r"(?<![A-Za-z])" + re.escape(banned), sql), banned
    # the one literal allowed names an aggregate function, not a value
    assert "'" not in sql.replace("arrayReduce('max'", "")  # every value compared is bound
    names = {name for name, _ in PLACEHOLDER.findall(sql)}
    window = {"job", "attempt", "start_us", "end_us", "origin_us", "window_us", "limit",
              "last_bucket", "width_us"}
    assert names <= window | set(SUMMARY_CONSTANTS)
    assert {"job", "attempt", "start_us", "end_us"} <= names
