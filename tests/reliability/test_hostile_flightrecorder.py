"""Hostile Flight Recorder dumps: the reader unpickles plain data only. A pickle that would run
code on load (os.system, builtins.eval, a class's constructor or __setstate__, an extension code,
a persistent id) is refused with an error naming the file and what it named, and nothing runs:
each payload would create a marker file, which must not exist afterwards. Random bytes and
arbitrary plain data give DumpError / NotADump or a parsed dump, never another exception, and
`import-fr` lists such files and imports the good dumps beside them.

Inputs that once broke the reader stay as explicit examples: pg_status that is a list
(AttributeError), ranks such as "{[]: 1}" (TypeError from literal_eval), input_dtypes that is
a dict or input_sizes that is a number (KeyError, TypeError), an infinite time_created_ns
(OverflowError), JSON nested past the recursion limit or holding an integer of more than 4300
digits (RecursionError, ValueError), a version that is such an integer, and a rank of 10**10
in pg_config, the `rank` key or the file name (the job's ranks were enumerated: all memory).
Dumps that parsed but made records no store takes (a negative time_created_ns, an empty op
name, a group name past the text limit, an empty pg_status key) are refused by name too: every
record of a dump that is read is checked against the wire schema."""

from __future__ import annotations

import argparse
import builtins
import io
import json
import os
import pickle
import pickletools
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from tracehound.controller.cli.importfr import cmd_import_fr
from tracehound.tracing.flightrecorder import (
    DumpError,
    FrDump,
    NotADump,
    read_dump_dir,
    read_dump_file,
    restricted_loads,
    to_records,
)
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store
from tracehound.tracing.wire import decode, encode

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

# -- pickles that would run code ------------------------------------------------------------


class _SystemCall:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


class _Eval:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').write('ran')",))


class Touching:
    """A class whose construction (and whose state being set) creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)
        Path(self.marker).touch()

    def __setstate__(self, state: dict[str, Any]) -> None:
        Path(state["marker"]).touch()
        self.__dict__.update(state)


class _Constructor:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Touching, (self.marker,))


def _dump_around(payload: object) -> dict[str, Any]:
    """A well-formed dump with the payload where torn would put an entry's field."""
    return {"version": "2.10", "rank": 0, "pg_config": {}, "pg_status": {},
            "entries": [{"profiling_name": "gloo:all_reduce", "collective_seq_id": 1,
                         "time_created_ns": 1, "state": payload}]}


def _hand_made(marker: Path) -> dict[str, bytes]:
    """Pickles written opcode by opcode: what a crafted file could hold beyond pickle.dumps."""
    command = f"touch {marker}".encode()
    proto2 = b"\x80\x02"
    return {
        # protocol 2 header, then protocol 0's INST: `os.system(command)` built by opcode i
        "inst": proto2 + b"(V" + command + b"\nios\nsystem\n.",
        # GLOBAL + REDUCE
        "global-reduce": proto2 + b"cos\nsystem\nX" + len(command).to_bytes(4, "little")
        + command + b"\x85R.",
        # STACK_GLOBAL (protocol 4) + REDUCE, the names from the memo
        "stack-global": b"\x80\x04\x8c\x08builtins\x94\x8c\x04eval\x94\x93\x94X"
        + len(f"open({str(marker)!r},'w')".encode()).to_bytes(4, "little")
        + f"open({str(marker)!r},'w')".encode() + b"\x85R.",
        # OBJ with a class from the test module
        "obj": proto2 + b"(c" + __name__.encode() + b"\nTouching\nV" + str(marker).encode()
        + b"\no.",
        # an extension code (copyreg's registry names a class)
        "ext1": proto2 + b"\x82\x01.",
        # a persistent id
        "persid": proto2 + b"Pos.system\n.",
        "binpersid": proto2 + b"X\x03\x00\x00\x00abcQ.",
    }


@pytest.mark.parametrize("make", [_SystemCall, _Eval, _Constructor, Touching],
                         ids=["os.system", "builtins.eval", "class-reduce", "class-instance"])
@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_a_pickle_that_names_code_is_refused_and_runs_nothing(
    tmp_path: Path, make: Any, protocol: int,
) -> None:
    marker = tmp_path / "pwned"
    payload = make(marker)
    marker.unlink(missing_ok=True)  # Touching's own construction, here, made one
    for name, doc in (("bare", payload), ("inside", _dump_around(payload))):
        dump = tmp_path / f"nccl_trace_rank_{name}_0"
        dump.write_bytes(pickle.dumps(doc, protocol=protocol))
        refused = rf"^{re.escape(str(dump))}: refused to unpickle \w+\.\w+"
        with pytest.raises(DumpError, match=refused):
            read_dump_file(dump)
        assert not marker.exists()
    report = read_dump_dir(tmp_path)
    assert report.dumps == []
    assert [Path(f).name for f, _ in report.errors] == ["nccl_trace_rank_bare_0",
                                                        "nccl_trace_rank_inside_0"]
    assert all("refused to unpickle" in reason for _, reason in report.errors)
    assert not marker.exists()


@pytest.mark.parametrize("kind", sorted(_hand_made(Path("x"))))
def test_a_hand_made_pickle_is_refused_and_runs_nothing(tmp_path: Path, kind: str) -> None:
    marker = tmp_path / "pwned"
    data = _hand_made(marker)[kind]
    pickletools.dis(data, out=io.StringIO())  # a well-formed pickle, not a parse error
    dump = tmp_path / "nccl_trace_rank_0"
    dump.write_bytes(data)
    with pytest.raises(DumpError, match=rf"^{re.escape(str(dump))}: (refused|corrupt pickle)"
                       ) as caught:
        read_dump_file(dump)
    if kind in ("persid", "binpersid"):
        assert "refused a pickle with persistent references" in str(caught.value)
    elif kind != "ext1":
        assert "refused to unpickle" in str(caught.value)
    assert not marker.exists()


def test_plain_data_is_unpickled_as_it_was() -> None:
    basic = {"a": [1, 2.5, "x", None, True, -(2**70)], "b": (1, (2,)), "c": {"d": ()}}
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        assert restricted_loads(pickle.dumps(basic, protocol=protocol)) == basic
    # protocol 4 has opcodes of its own for bytes and sets (2 builds them by naming
    # _codecs.encode and builtins.set, which are refused like any other name)
    more = {**basic, "e": b"\x00\xff", "f": {3, 4}, "g": frozenset({5})}
    for protocol in range(4, pickle.HIGHEST_PROTOCOL + 1):
        assert restricted_loads(pickle.dumps(more, protocol=protocol)) == more


# -- random bytes and arbitrary plain data --------------------------------------------------

plain = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.lists(inner, max_size=3).map(tuple)
    | st.dictionaries(st.text(max_size=8) | st.integers(), inner, max_size=4),
    max_leaves=16,
)
def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` nine times in ten, arbitrary plain data otherwise."""
    return st.one_of(*[valid] * 9, plain)


version = mostly(st.sampled_from(["2.3", "2.10", "2.7"])) | st.sampled_from(
    ["3.0", "2", "x.y", "", "2.3.1", " 2.3", "\u0662.\u0663"])
profiling = mostly(st.sampled_from(["gloo:all_reduce", "nccl:send 0->1", "nccl:recv 1<-0",
                                    "gloo:broadcast", "nccl:_allgather_base", "nccl:send x->",
                                    "send", ":", "nccl:recv 99999999999<-0"]))
entry = st.fixed_dictionaries(
    {"profiling_name": profiling, "collective_seq_id": mostly(st.integers(-5, 50)),
     "time_created_ns": mostly(st.integers(0, 2**62) | st.sampled_from([2**64, -1]))},
    optional={"process_group": mostly(st.tuples(st.sampled_from(["0", "1", ""]),
                                                st.sampled_from(["default_pg", "", "x"]))),
              "pg_id": mostly(st.integers(0, 3)), "p2p_seq_id": mostly(st.integers(0, 9)),
              "op_id": mostly(st.integers(0, 99)), "record_id": mostly(st.integers(0, 99)),
              "state": mostly(st.sampled_from(["scheduled", "started", "completed"])),
              "input_sizes": mostly(st.lists(st.lists(st.integers(0, 2**40), max_size=3),
                                             max_size=3)),
              "input_dtypes": mostly(st.lists(st.sampled_from(["Float", "Long", "Bool", "?"]),
                                              max_size=3)),
              "time_discovered_completed_ns": mostly(st.integers(0, 2**62) | st.none())},
)
dumps = st.fixed_dictionaries(
    {"version": version},
    optional={"rank": mostly(st.integers(0, 7)),
              "entries": mostly(st.lists(entry, max_size=6)),
              "pg_config": mostly(st.dictionaries(
                  st.sampled_from(["0", "1", ""]),
                  mostly(st.fixed_dictionaries({}, optional={
                      "name": mostly(st.sampled_from(["0", "1", ""])) | st.just("g" * 5000),
                      "desc": mostly(st.sampled_from(["default_pg", ""])),
                      "ranks": mostly(st.sampled_from(["[0, 1]", "[]", "[0, 1, 2, 3]", "[2]"]))
                      | st.sampled_from(["{[]: 1}", "[" * 5000, "1 +", "[-1]", "[1e3]",
                                         "[0, 10000000000]", "__import__('os')"])})),
                  max_size=3)),
              "pg_status": mostly(st.dictionaries(
                  st.sampled_from(["0", "1", "9", "s" * 5000]),
                  mostly(st.fixed_dictionaries({}, optional={
                      "last_enqueued_collective": mostly(st.integers(-1, 50)),
                      "last_started_collective": mostly(st.integers(-1, 50)),
                      "last_completed_collective": mostly(st.integers(-1, 50))})),
                  max_size=2))},
)


def _read(path: Path) -> FrDump | None:
    try:
        dump = read_dump_file(path)
    except NotADump as exc:
        event("not a dump")
        assert str(exc).startswith(f"{path}: ")
    except DumpError as exc:
        event("a bad dump")
        assert str(exc).startswith(f"{path}: ")
    else:
        event("a dump")
        return dump
    return None


@FUZZ
@given(data=st.binary(max_size=400), pickled=st.booleans())
@example(data=b'{"a":' + b"[" * 100_000, pickled=False)
@example(data=b'{"version": "2.3", "rank": ' + b"1" * 5000 + b"}", pickled=False)
@example(data=b'{"version": "2.3", "rank": Infinity, "entries": []}', pickled=False)
@example(data=b"\x00\xff", pickled=True)
def test_random_bytes_are_not_a_dump_or_a_named_error(tmp_path: Path, data: bytes,
                                                      pickled: bool) -> None:
    path = tmp_path / "nccl_trace_rank_3"
    path.write_bytes((b"\x80" if pickled else b"") + data)
    _read(path)


def _check_records(found: list[FrDump]) -> None:
    """The dumps' records, where they can be made, are valid records (what a store takes)."""
    try:
        conversion = to_records(found, job=JobId("fr-fuzz"), attempt=0)
    except ValueError as exc:
        assert "world size" in str(exc)
        return
    for record in conversion.records:
        assert decode(json.loads(json.dumps(encode(record)))) == record


@FUZZ
@given(doc=dumps, as_json=st.booleans())
@example(doc={"version": "2.3", "rank": 0, "entries": [], "pg_status": [1]}, as_json=False)
@example(doc={"version": "2.3", "rank": 0, "pg_config": {"0": {"ranks": "{[]: 1}"}}},
         as_json=False)
@example(doc={"version": "2.3", "rank": 0, "entries": [
    {"profiling_name": "a", "collective_seq_id": 1, "time_created_ns": 1, "input_sizes": [[1]],
     "input_dtypes": {"a": 1}}]}, as_json=False)
@example(doc={"version": "2.3", "rank": 0, "entries": [
    {"profiling_name": "a", "collective_seq_id": 1, "time_created_ns": 1, "input_sizes": 5}]},
    as_json=False)
@example(doc={"version": "2.3", "rank": 0, "entries": [
    {"profiling_name": "a", "collective_seq_id": 1, "time_created_ns": float("inf")}]},
    as_json=False)
@example(doc={"version": 10**5000, "rank": 0, "entries": []}, as_json=False)
@example(doc={"version": "2.3", "rank": 10**10, "entries": []}, as_json=True)
@example(doc={"version": "2.3", "entries": [
    {"profiling_name": "gloo:all_reduce", "collective_seq_id": 0, "time_created_ns": -1}]},
    as_json=False)
@example(doc={"version": "2.3", "entries": [
    {"profiling_name": ":", "collective_seq_id": 1, "time_created_ns": 1}]}, as_json=True)
@example(doc={"version": "2.3", "pg_status": {"s" * 5000: {}}, "entries": []}, as_json=False)
@example(doc={"version": "2.3", "pg_status": {"": {}}, "entries": []}, as_json=False)
@example(doc={"version": "2.3", "rank": 0,
              "pg_config": {"0": {"name": "0", "ranks": "[0, 10000000000]"}}}, as_json=False)
def test_arbitrary_plain_data_is_a_dump_or_a_named_error(tmp_path: Path, doc: dict[str, Any],
                                                         as_json: bool) -> None:
    path = tmp_path / "nccl_trace_rank_1"
    if as_json:
        try:
            data = json.dumps(doc).encode()
        except (TypeError, ValueError):  # bytes, tuple keys: a JSON writer could not make it
            return
    else:
        data = pickle.dumps(doc, protocol=4)
    path.write_bytes(data)
    dump = _read(path)
    if dump is not None:
        _check_records([dump])


def test_a_rank_past_any_job_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "nccl_trace_rank_99999999999"
    path.write_bytes(json.dumps({"version": "2.3", "entries": []}).encode())
    with pytest.raises(DumpError, match=r"rank 99999999999 \(from the file name\) is not below"):
        read_dump_file(path)


# -- import-fr over a directory with hostile files beside good dumps --------------------------

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "fr" / "hang" / "dumps"


def test_import_fr_lists_hostile_files_and_imports_the_good_dumps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    marker = tmp_path / "pwned"
    directory = tmp_path / "dumps"
    directory.mkdir()
    for good in GOLDEN.iterdir():
        (directory / good.name).write_bytes(good.read_bytes())
    (directory / "nccl_trace_rank_5").write_bytes(pickle.dumps(_SystemCall(marker), protocol=2))
    (directory / "nccl_trace_rank_6").write_bytes(b"\x80\x05junk")
    (directory / "nccl_trace_rank_7.json").write_bytes(b'{"version": "2.3", "rank": Infinity')
    (directory / "notes.txt").write_bytes(b"\xff\xfe random")
    store_url = f"chdb://{tmp_path / 'chdb'}"
    args = argparse.Namespace(directory=directory, job="fr-hostile", attempt=0, world_size=4,
                              exits=[], dumped_at=None, json=True, store=store_url)

    status = cmd_import_fr(args)

    summary = json.loads(capsys.readouterr().out)
    assert status == 1
    assert not marker.exists()
    assert summary["files_read"] == 2
    assert summary["ranks"] == [0, 2]
    assert sorted(Path(e["file"]).name for e in summary["errors"]) == [
        "nccl_trace_rank_5", "nccl_trace_rank_6", "nccl_trace_rank_7.json"]
    assert [Path(s["file"]).name for s in summary["skipped_files"]] == ["notes.txt"]
    with open_store(store_url) as store:
        assert store.jobs() == [JobId("fr-hostile")]
        assert summary["records_written"] == summary["records"] > 0
