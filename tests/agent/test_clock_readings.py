"""The node agent measures its clock against the collector's on every shipment (a real ingest
endpoint on loopback, a real store), records the readings, and the analysis uses them for
nodes the trace says nothing about."""

from __future__ import annotations

import numpy as np

from tracehound.agent.node.spool import ClockTracker, HttpSink, SpooledBatch
from tracehound.analysis.clocks import NO_CLOCKS, ClockEstimate, with_readings
from tracehound.tracing.events import ClockReading, CollectiveEvent, CollectiveState
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore
from tracehound.tracing.store.ingest import ClockExchange, IngestServer
from tracehound.tracing.wire import decode_line, encode_line

JOB = JobId("clock-job")


def a_batch(batch_id: str, seq: int) -> SpooledBatch:
    event = CollectiveEvent(
        job=JOB, attempt=0, node=NodeId("n1"), rank=Rank(0), group=GroupId("0"), seq=seq,
        op="all_reduce", nbytes=8, dtype="float32", peer=-1, state=CollectiveState.COMPLETED,
        enqueue_us=1_800_000_000_000_000 + seq, complete_us=1_800_000_000_000_100 + seq)
    return SpooledBatch(batch_id, (encode_line(event),))


def test_shipments_measure_the_clock_and_the_readings_reach_the_store(
        store: TraceStore) -> None:
    emitted: list[bytes] = []
    now = [0.0]
    tracker = ClockTracker(job=JOB, node="n1", emit=emitted.extend, every_s=30.0,
                           monotonic=lambda: now[0])
    server = IngestServer(store).start()
    try:
        sink = HttpSink(server.url, on_clock=tracker)
        sink.send(a_batch("b1", 1), maybe_duplicate=False)
        assert len(emitted) == 1  # the first exchange is recorded at once
        now[0] = 10.0
        sink.send(a_batch("b2", 2), maybe_duplicate=False)
        assert len(emitted) == 1  # within the period: only kept if it is the best so far
        now[0] = 31.0
        sink.send(a_batch("b3", 3), maybe_duplicate=False)
        assert len(emitted) == 2
        readings = [decode_line(line) for line in emitted]
        assert all(isinstance(r, ClockReading) for r in readings)
        for reading in readings:
            assert isinstance(reading, ClockReading)
            # one machine, one clock: the offset is within the measurement's own error
            assert abs(reading.offset_us) <= reading.delay_us / 2 + 2_000
            assert reading.node == "n1" and reading.job == JOB
        # the agent ships its readings like any record
        sink.send(SpooledBatch("b4", tuple(emitted)), maybe_duplicate=False)
    finally:
        server.stop()
    stored = store.clock_readings(JOB, 0)
    assert [r.node for r in stored] == ["n1"]
    best = min(readings, key=lambda r: r.delay_us)  # type: ignore[union-attr]
    assert stored[0].delay_us == best.delay_us  # type: ignore[union-attr]


def test_the_exchange_arithmetic_is_ntps() -> None:
    # the sender's clock is 5 ms ahead; 1 ms each way; 0.2 ms inside the endpoint
    t1 = 1_000_000 + 5_000
    exchange = ClockExchange(sent_us=t1, received_us=1_001_000, replied_us=1_001_200,
                             answered_us=t1 + 2_200)
    assert exchange.offset_us == 5_000
    assert exchange.delay_us == 2_000


def reading(node: str, offset_us: int, delay_us: int = 400) -> ClockReading:
    return ClockReading(job=JOB, node=NodeId(node), time_us=1, offset_us=offset_us,
                        delay_us=delay_us)


def test_readings_fill_in_nodes_the_trace_does_not_link() -> None:
    trace = ClockEstimate(ref_us=10, nodes=("a", "b"), offset_us=(-1_000.0, 1_000.0),
                          drift_ppm=(0.0, 0.0), uncertainty_us=(5.0, 5.0), samples=(50, 50))
    # the agents measured against the collector: everyone 7 ms ahead of it, c 3 ms more
    merged = with_readings(trace, [reading("a", 6_000), reading("b", 8_000),
                                   reading("c", 10_000)], now_us=99)
    assert merged.nodes == ("a", "b", "c")
    assert merged.offset_us[:2] == trace.offset_us
    assert merged.offset_us[2] == 3_000.0  # in the trace's frame
    assert merged.samples[2] == 0 and merged.uncertainty_us[2] == 300.0
    assert "by its agent" in merged.words("c")
    alone = with_readings(NO_CLOCKS, [reading("a", 6_000), reading("b", 8_000),
                                      reading("c", 13_000)], now_us=99)
    assert np.median(alone.offset_us) == 0.0 and alone.ref_us == 99
    assert with_readings(trace, [reading("a", 6_000)], now_us=99) is trace
