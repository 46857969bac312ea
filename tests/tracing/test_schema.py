"""The schema and the shared SQL texts: the portable subset, and queries that match the tables."""

from __future__ import annotations

import re

import pytest

from tracehound.tracing._sqlstore import (
    _SUMMARY_CONSTANTS,
    PLACEHOLDER,
    READ_QUERIES,
    SUMMARY_QUERIES,
    read_columns,
    to_pyformat,
)
from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.schema import RECORD_TABLES, TABLES, check_identifier, create_statements

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


@pytest.mark.parametrize("name", list(READ_QUERIES))
def test_read_queries_select_the_schema_columns_in_order(name: str) -> None:
    table, sql = READ_QUERIES[name]
    match = re.search(r"SELECT(.*?)FROM", sql, re.S)
    assert match is not None
    selected = tuple(c.strip() for c in match.group(1).split(","))
    assert selected == read_columns(table)
    assert f"{{db}}.{table.name}" in sql
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


@pytest.mark.parametrize("sql", SUMMARY_QUERIES, ids=["rank", "node_windows", "link", "disagree"])
def test_summary_queries_keep_to_the_portable_subset_and_bind_every_value(sql: str) -> None:
    for banned in (*NOT_ON_18_16, "WITH ", "FINAL", "{p:"):
        assert banned not in sql
    assert "'" not in sql  # no literal values: everything compared with is bound
    names = {name for name, _ in PLACEHOLDER.findall(sql)}
    window = {"job", "attempt", "start_us", "end_us", "origin_us", "window_us", "limit"}
    assert names <= window | set(_SUMMARY_CONSTANTS)
    assert {"job", "attempt", "start_us", "end_us"} <= names
