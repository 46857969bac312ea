"""The store port's calls as bytes (`tracing.store.calls`): every method crosses, the client
implements each as the port declares it, and values come out as they went in (numpy columns bit
for bit, records with the full range their columns keep, the disagreements' cut), while what
cannot be a value of its type is refused."""

from __future__ import annotations

import inspect
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tracehound.tracing.errors import PermanentStoreError, StoreConfigError, TemporaryStoreError
from tracehound.tracing.events import Batch, CollectiveEvent, CollectiveState, Incident
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.settings import SettingError
from tracehound.tracing.store import BulkStore, calls
from tracehound.tracing.store.client import SharedStoreClient
from tracehound.tracing.summaries import Disagreement, Disagreements, NodeWindows

DTYPES = st.sampled_from(["?", "i1", "i2", "<i4", "<i8", "u1", "<u2", "<u4", "<u8", "<f4", "<f8",
                          ">i8", ">f8"])


def same_array(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_every_method_of_the_port_crosses_and_the_client_declares_it_alike() -> None:
    methods = {name for name, member in inspect.getmembers(BulkStore)
               if not name.startswith("_") and callable(member)}
    assert set(calls.calls()) == methods - {"close"}
    for name in methods:
        ours = inspect.signature(getattr(SharedStoreClient, name))
        theirs = inspect.signature(getattr(BulkStore, name))
        assert [(p.name, p.kind, p.default) for p in ours.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()], name
        assert ours.return_annotation == theirs.return_annotation, name


@given(hnp.arrays(DTYPES, hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6),
                  elements={"allow_nan": True, "allow_infinity": True}))
def test_numeric_columns_cross_bit_for_bit(array: np.ndarray[Any, Any]) -> None:
    assert same_array(calls.decode(calls.encode(array), np.ndarray), array)


@given(hnp.arrays(np.dtype("<U8"),
                  hnp.array_shapes(min_dims=1, max_dims=2, min_side=0, max_side=8),
                  # what a store's string column can hold: UTF-8, so no lone surrogate
                  elements=st.text(st.characters(exclude_categories=("Cs",),
                                                 exclude_characters="\x00"), max_size=8)))
def test_string_columns_cross_whole(array: np.ndarray[Any, Any]) -> None:
    back = calls.decode(calls.encode(array), np.ndarray)
    assert back.dtype == array.dtype and back.shape == array.shape
    assert back.tolist() == array.tolist()


def test_a_summary_with_nan_windows_crosses_whole() -> None:
    windows = NodeWindows(nodes=("n0", "n1"), window_start_us=np.array([0, 10], dtype=np.int64),
                          features=np.array([[[1.5, np.nan, 2.0], [np.nan] * 3]] * 2))
    back = calls.decode(calls.encode(windows), NodeWindows)
    assert back.nodes == windows.nodes
    assert same_array(back.window_start_us, windows.window_start_us)
    assert same_array(back.features, windows.features)


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1), st.integers(-1, 2**31 - 1))
def test_records_cross_with_the_full_range_their_columns_keep(nbytes: int, time_us: int,
                                                              peer: int) -> None:
    """The wire refuses a UInt64 above 2**63 - 1 (`tracing.kinds`); a store keeps it, so a
    client must carry it unchanged."""
    event = CollectiveEvent(job=JobId("j"), attempt=0, node=NodeId("n"), rank=Rank(0),
                            group=GroupId("0"), seq=1, op="all_reduce", nbytes=nbytes,
                            dtype="float32", peer=peer, state=CollectiveState.COMPLETED,
                            enqueue_us=time_us, complete_us=time_us)
    batch = Batch(batch_id="b", records=(event,))
    assert calls.decode(calls.encode(batch), Batch) == batch
    assert calls.decode(calls.encode([event]), list[CollectiveEvent]) == [event]


def test_a_kind_a_batch_may_not_carry_still_reaches_the_store_to_be_refused() -> None:
    incident = Incident(job=JobId("j"), incident_id="i", attempt=0, detected_at_us=1,
                        kind="hang", culprit_ranks=(), culprit_nodes=(), confidence=0.5,
                        summary="", verdict_json="{}")
    batch = calls.decode(calls.encode(Batch(batch_id="b", records=(incident,))),  # type: ignore[arg-type]
                         Batch)
    assert batch.records == (incident,)


def test_disagreements_keep_their_cut() -> None:
    rows = Disagreements([Disagreement(group="0", seq=3, ranks=(0, 1), ops=("a", "b"),
                                       nbytes=(4, 4), dtypes=("f", "f"))], dropped=7)
    back = calls.decode(calls.encode(rows), Disagreements)
    assert back == rows and back.dropped == 7


@pytest.mark.parametrize(("wire", "complaint"), [
    ({"dtype": "|O", "shape": [1], "data": b"\0" * 8}, "cannot cross"),
    ({"dtype": "<i8", "shape": [2], "data": b"\0" * 8}, "do not fit 8 bytes"),
    ({"dtype": "<U2", "shape": [2], "values": ["a"], "codes": b"\0\0\0\0\1\0\0\0"},
     "its codes do not fit its values"),
    ({"shape": [1]}, "malformed numpy column"),
])
def test_columns_that_are_no_columns_are_refused(wire: dict[str, Any], complaint: str) -> None:
    with pytest.raises(TypeError, match=complaint):
        calls.decode(msgspec.msgpack.encode(wire), np.ndarray)


def test_an_object_column_never_leaves() -> None:
    with pytest.raises(TypeError, match="dtype object cannot cross"):
        calls.encode(np.array([object()]))


def test_a_value_of_the_wrong_type_is_refused_naming_where() -> None:
    body = msgspec.msgpack.encode({"job": "j", "attempt": "zero"})
    with pytest.raises(TypeError, match=r"\$\.attempt: expected a whole number, got str"):
        calls.decode(body, calls.call("exits").args)
    with pytest.raises(TypeError, match="no method 'drop_everything'"):
        calls.call("drop_everything")


@pytest.mark.parametrize("raised", [
    ValueError("day: expected a date"), SettingError("X=1: expected 2"), TypeError("bad kind"),
    StoreConfigError("wrong"), PermanentStoreError("refused"),
    TemporaryStoreError("busy", retry_after=7.0), RuntimeError("a bug"),
])
def test_errors_cross_by_class(raised: Exception) -> None:
    wire = calls.decode_error(calls.encode_error(raised))
    assert wire is not None
    crossed = calls.error_of(wire, "embedded store chdb:///s (held by pid 1)")
    expected = {SettingError: ValueError, RuntimeError: PermanentStoreError}.get(
        type(raised), type(raised))
    assert type(crossed) is expected
    if isinstance(raised, (ValueError, TypeError)):
        assert str(crossed) == str(raised)  # it names the bad argument: kept as is
    else:
        assert str(crossed) == f"embedded store chdb:///s (held by pid 1): {raised}"
    if isinstance(crossed, TemporaryStoreError):
        assert crossed.retry_after == 7.0
