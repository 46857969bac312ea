"""The embedded adapter's parameter escaping, checked against chdb itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracehound.tracing.store.embedded import EmbeddedClickHouseStore, param_text
from tracehound.tracing.store.engine import SqlTraceStore


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SqlTraceStore]:
    store = EmbeddedClickHouseStore(f"chdb://{tmp_path_factory.mktemp('escape')}")
    try:
        yield store
    finally:
        store.close()


def test_param_text_escapes_exactly_what_chdb_unescapes() -> None:
    assert param_text("plain") == "plain"
    assert param_text("a\\nb") == "a\\\\nb"
    assert param_text("tab\tnew\nline") == "tab\\tnew\\nline"
    assert param_text("quote ' \"") == "quote ' \""
    assert param_text(-12) == "-12"
    assert param_text(2**64 - 1) == "18446744073709551615"
    assert param_text(0.5) == "0.5"
    with pytest.raises(TypeError):
        param_text(True)


@settings(max_examples=150, deadline=None)
@given(value=st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40))
def test_any_text_comes_back_unchanged_from_chdb(embedded: SqlTraceStore, value: str) -> None:
    rows = embedded._query("SELECT {v:String} AS v, length({v:String}) AS n", {"v": value})
    assert rows == [(value, len(value.encode()))]


@given(value=st.integers(min_value=0, max_value=2**64 - 1))
@settings(max_examples=50, deadline=None)
def test_integers_come_back_unchanged_from_chdb(embedded: SqlTraceStore, value: int) -> None:
    assert embedded._query("SELECT {n:UInt64}", {"n": value}) == [(value,)]
