"""Garbled spool files: a node agent reading segments with torn lines, binary junk, huge lines,
JSON that is not a record, JSON nested past any parser, and stray files that look like segments
ships every good record in order, skips and counts every bad line exactly, and never gets stuck
retrying a segment it cannot read.

Inputs that once broke it stay as explicit cases: a line nested deeper than the recursion limit
(RecursionError escaped `Spool.read`, and the shipper retried the segment for ever), and stray
files such as `seg-1.seg` or `seg-٣.seg` (listed as segments whose file `read` then could not
find, retried for ever, blocking every later segment)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tracehound.agent.node.spool import Shipper, ShipResult, Spool, SpooledBatch, StoreSink
from tracehound.tracing.events import RankExit
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.kinds import MAX_TEXT
from tracehound.tracing.store import open_store
from tracehound.tracing.wire import encode_line

FUZZ = settings(max_examples=80, deadline=None)


class CollectingSink:
    """A sink that decodes each batch as the store's does and keeps what it would store."""

    def __init__(self) -> None:
        self.records: list[Any] = []
        self.batches: list[str] = []

    def send(self, batch: SpooledBatch, *, maybe_duplicate: bool) -> int:
        decoded = batch.decoded()
        self.records.extend(decoded.batch.records)
        self.batches.append(batch.batch_id)
        return len(decoded.rejected)


def exit_record(rank: int, job: str = "job") -> RankExit:
    return RankExit(job=JobId(job), attempt=0, node=NodeId("node-0"), rank=Rank(rank), pid=7,
                    exit_code=1, time_us=1_700_000_000_000_000 + rank)


# A line of a segment: ("good", record) | ("corrupt", bytes) | ("not a record", bytes) |
# ("blank", bytes). Corrupt lines are never JSON: a proper prefix of a JSON object, bytes that
# start with one that UTF-8 never uses, nesting past any parser, or a lone UTF-16 surrogate.


@st.composite
def segment_lines(draw: st.DrawFn) -> list[tuple[str, Any]]:
    lines: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(min_value=0, max_value=10))):
        what = draw(st.sampled_from(["good", "good", "torn", "junk", "json", "blank", "huge",
                                          "surrogate"]))
        if what == "good":
            lines.append(("good", exit_record(draw(st.integers(0, 10_000)))))
        elif what == "torn":
            line = encode_line(exit_record(draw(st.integers(0, 10_000))))
            cut = draw(st.integers(min_value=1, max_value=len(line) - 1))
            lines.append(("corrupt", line[:cut]))
        elif what == "junk":
            junk = draw(st.binary(max_size=200)).replace(b"\n", b"")
            lines.append(("corrupt", b"\xff" + junk))
        elif what == "json":
            lines.append(("not a record", draw(st.sampled_from([
                b"0", b"[]", b'"text"', b"{}", b'{"type": "exit"}', b"null",
                b'{"type": "no-such-kind", "job": "j"}', b"[" * 500 + b"]" * 500,
                encode_line(exit_record(1)).replace(b'"job":"job"',
                                                    b'"job":"' + b"j" * (MAX_TEXT + 1) + b'"'),
            ]))))
        elif what == "surrogate":  # not JSON to msgspec: a lone UTF-16 surrogate is not text
            lines.append(("corrupt", encode_line(exit_record(1)).replace(
                b'"job":"job"', b'"job":"' + draw(st.sampled_from(
                    [b"\\udc00", b"\\ud800", b"x\\uDBFF y", b"\\ud800\\u0041"])) + b'"')))
        elif what == "huge":
            size = draw(st.sampled_from([100_000, 3_000_000]))
            lines.append(draw(st.sampled_from([
                ("corrupt", b"\xfe" + b"x" * size),
                ("corrupt", b"[" * size),  # nested past any parser
                ("not a record", b'"' + b"y" * size + b'"'),
            ])))
        else:
            lines.append(("blank", draw(st.sampled_from([b"", b"   ", b"\t \r"]))))
    return lines


def write_segment(path: Path, lines: list[tuple[str, Any]], *, torn_end: bool) -> None:
    texts = [encode_line(v) if kind == "good" else v for kind, v in lines]
    data = b"\n".join(texts)
    path.write_bytes(data if torn_end else data + b"\n")


def ship_all(spool: Spool, sink: Any) -> list[ShipResult]:
    shipper = Shipper(spool, sink)
    results = []
    for _ in range(100):
        result = shipper.ship_once()
        results.append(result)
        if result is ShipResult.IDLE:
            break
    return results


@FUZZ
@given(segments=st.lists(segment_lines(), min_size=1, max_size=4), torn_end=st.booleans())
@example(segments=[[("good", exit_record(0)), ("corrupt", b"[" * 100_000),
                    ("good", exit_record(1))]], torn_end=False)
def test_garbled_segments_ship_their_good_records_and_count_every_bad_line(
    tmp_path_factory: Any, segments: list[list[tuple[str, Any]]], torn_end: bool,
) -> None:
    directory = tmp_path_factory.mktemp("spool")
    for number, lines in enumerate(segments, start=1):
        write_segment(directory / f"seg-{number:010d}.seg", lines,
                      torn_end=torn_end and number == len(segments))
    spool = Spool(directory, node="node-0")
    sink = CollectingSink()

    results = ship_all(spool, sink)

    everything = [line for lines in segments for line in lines]
    goods = [v for kind, v in everything if kind == "good"]
    bad = sum(kind in ("corrupt", "not a record") for kind, _ in everything)
    parsed = sum(kind in ("good", "not a record") for kind, _ in everything)
    with_lines = sum(any(kind in ("good", "not a record") for kind, _ in lines)
                     for lines in segments)
    assert results[-1] is ShipResult.IDLE
    assert ShipResult.RETRY not in results and ShipResult.REFUSED not in results
    assert sink.records == goods
    assert len(sink.batches) == with_lines
    assert spool.stats.corrupt_lines == bad
    assert spool.stats.shipped == parsed
    assert spool.sealed() == []


@FUZZ
@given(names=st.lists(st.one_of(
    st.sampled_from(["seg-1.seg", "seg-\u0663.seg", "seg-0000000001.x.seg", "seg-.seg",
                     "seg-00000000001.seg", "seg-0000000002.seg.bak", "seg-0000000009.inflight",
                     "seg-\uff11\uff12.open", "seg-0099999999999999999999.seg"]),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
            min_size=1, max_size=20).map(lambda t: "seg-" + t),
), max_size=5, unique=True))
def test_stray_files_beside_the_segments_neither_block_nor_ship(
    tmp_path_factory: Any, names: list[str],
) -> None:
    directory = tmp_path_factory.mktemp("spool")
    real = {f"seg-{n:010d}.seg" for n in (1, 2)}
    strays = [n for n in names if n not in real]
    for name in strays:
        (directory / name).write_bytes(encode_line(exit_record(99)) + b"\n")
    for n in (1, 2):
        (directory / f"seg-{n:010d}.seg").write_bytes(encode_line(exit_record(n)) + b"\n")
    spool = Spool(directory, node="node-0")
    sink = CollectingSink()

    results = ship_all(spool, sink)

    assert results == [ShipResult.SHIPPED, ShipResult.SHIPPED, ShipResult.IDLE]
    assert sink.records == [exit_record(1), exit_record(2)]
    assert all((directory / name).exists() for name in strays)


def test_a_garbled_segment_into_a_real_store_keeps_the_good_records(tmp_path: Path) -> None:
    """The same through StoreSink into the embedded store: hostile lines counted, good records
    stored once, nothing retried."""
    directory = tmp_path / "spool"
    directory.mkdir()
    lines: list[tuple[str, Any]] = [
        ("good", exit_record(0, "garbled")), ("corrupt", b"\xff\x00\x01junk"),
        ("corrupt", encode_line(exit_record(5))[:17]), ("not a record", b'{"type": "exit"}'),
        ("corrupt", b"[" * 200_000), ("good", exit_record(1, "garbled")),
        ("corrupt", encode_line(exit_record(2, "garbled")).replace(
            b'"node":"node-0"', b'"node":"\\ud800"')),
        ("good", exit_record(3, "garbled")),
    ]
    write_segment(directory / "seg-0000000001.seg", lines, torn_end=False)
    (directory / "seg-0000000002.seg").write_bytes(encode_line(exit_record(4, "garbled"))[:30])
    store = open_store(f"chdb://{tmp_path / 'chdb'}")
    try:
        spool = Spool(directory, node="node-0")
        results = ship_all(spool, StoreSink(store))
        # segment 2 holds no whole line: nothing is sent, and it is done with
        assert results == [ShipResult.SHIPPED, ShipResult.SHIPPED, ShipResult.IDLE]
        assert spool.stats.corrupt_lines == 6
        assert spool.stats.shipped == 4
        assert store.exits(JobId("garbled"), 0) == [
            exit_record(0, "garbled"), exit_record(1, "garbled"), exit_record(3, "garbled")]
    finally:
        store.close()
