"""The node agent's spool and shipper against a sink that fails for a while, then recovers; and the
agent's socket side fed by a real SocketTransport (in-process, no torch)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from tracehound.agent.node.daemon import URGENT_PENDING_US, NodeAgent, urgent
from tracehound.agent.node.spool import Shipper, ShipResult, Spool
from tracehound.agent.rank.recorder import Recorder
from tracehound.agent.rank.transport import SocketTransport
from tracehound.tracing import wire
from tracehound.tracing.errors import PermanentStoreError, TemporaryStoreError
from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    ProcessSample,
    RankExit,
    StackSample,
)


def event(seq: int, rank: int = 0) -> CollectiveEvent:
    return CollectiveEvent(
        job="j", attempt=0, node="n", rank=rank, group="0", seq=seq, op="all_reduce", nbytes=4,
        dtype="float32", peer=-1, state=CollectiveState.COMPLETED, enqueue_us=seq,
        complete_us=seq + 1,
    )


def line(record: CollectiveEvent) -> bytes:
    return json.dumps(wire.encode(record)).encode()


class FlakySink:
    """Fails the first `failures` sends (after storing the batch, on the `landed` ones, as a
    store that wrote but could not answer would), then accepts."""

    def __init__(self, failures: int = 0, *, landed: bool = False) -> None:
        self.failures = failures
        self.landed = landed
        self.calls: list[tuple[str, bool]] = []
        self.stored: dict[str, Batch] = {}

    def send(self, batch: Batch, *, maybe_duplicate: bool) -> None:
        self.calls.append((batch.batch_id, maybe_duplicate))
        if self.failures > 0:
            self.failures -= 1
            if self.landed:
                self.stored[batch.batch_id] = batch
            raise TemporaryStoreError("store down", retry_after=0.0)
        if batch.batch_id in self.stored and not maybe_duplicate:
            raise AssertionError(f"batch {batch.batch_id} stored twice without maybe_duplicate")
        self.stored[batch.batch_id] = batch

    def records(self) -> list[object]:
        return [r for b in self.stored.values() for r in b.records]


def spool(path: Path, **kwargs: object) -> Spool:
    return Spool(path, node="node-1", seal_interval_s=0.0, **kwargs)  # type: ignore[arg-type]


def test_outage_loses_nothing_and_retries_are_marked(tmp_path: Path) -> None:
    sp = spool(tmp_path)
    sink = FlakySink(failures=3, landed=True)
    shipper = Shipper(sp, sink, min_backoff_s=0.0)
    for start in (1, 11, 21):
        sp.append([line(event(s)) for s in range(start, start + 10)])
        sp.maybe_seal(force=True)
    results = [shipper.ship_once() for _ in range(8)]
    assert results == [ShipResult.RETRY] * 3 + [ShipResult.SHIPPED] * 3 + [ShipResult.IDLE] * 2
    ids = [bid for bid, _ in sink.calls]
    first = ids[0]
    assert ids[:4] == [first] * 4, "the same segment is retried with the same batch id"
    assert [dup for _, dup in sink.calls] == [False, True, True, True, False, False]
    assert first == f"node-1/{sp.spool_id}/1"
    seqs = sorted(r.seq for r in sink.records())  # type: ignore[attr-defined]
    assert seqs == list(range(1, 31))
    assert sp.sealed() == []
    assert sp.stats.shipped == 30 and sp.stats.retries == 3


def test_restart_with_in_flight_marker_ships_as_maybe_duplicate(tmp_path: Path) -> None:
    sp = spool(tmp_path)
    sp.append([line(event(1)), line(event(2))])
    sp.maybe_seal(force=True)
    sp.append([line(event(3))])  # left open: the agent "crashes" here
    number = sp.sealed()[0]
    sp.mark_in_flight(number)  # it crashed while sending the first segment
    batch_id = sp.batch_id(number)

    again = spool(tmp_path)
    assert again.spool_id == sp.spool_id
    assert again.sealed() == [1, 2], "the open segment is sealed at startup"
    sink = FlakySink()
    shipper = Shipper(again, sink)
    assert shipper.drain(5.0)
    assert sink.calls == [(batch_id, True), (f"node-1/{sp.spool_id}/2", False)]
    assert sorted(r.seq for r in sink.records()) == [1, 2, 3]  # type: ignore[attr-defined]
    # A new segment after the restart gets a new number: batch ids never repeat.
    again.append([line(event(4))])
    again.maybe_seal(force=True)
    assert again.sealed() == [3]


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    sp = spool(tmp_path)
    sp.append([line(event(1)), line(event(2))[:20]])
    sp.maybe_seal(force=True)
    sink = FlakySink()
    Shipper(sp, sink).drain(5.0)
    assert [r.seq for r in sink.records()] == [1]  # type: ignore[attr-defined]
    assert sp.stats.corrupt_lines == 1


def test_refused_batch_is_set_aside(tmp_path: Path) -> None:
    class Refusing:
        def send(self, batch: Batch, *, maybe_duplicate: bool) -> None:
            raise PermanentStoreError("bad batch")

    sp = spool(tmp_path)
    sp.append([line(event(1))])
    sp.maybe_seal(force=True)
    assert Shipper(sp, Refusing()).ship_once() is ShipResult.REFUSED
    assert sp.sealed() == []
    assert len(list((tmp_path / "rejected").iterdir())) == 1


def test_segments_seal_by_count(tmp_path: Path) -> None:
    sp = Spool(tmp_path, node="n", seal_records=3, seal_interval_s=3600)
    sp.append([line(event(s)) for s in range(1, 4)])
    sp.append([line(event(4))])
    assert sp.sealed() == [1]
    assert not sp.maybe_seal()
    assert sp.maybe_seal(force=True)
    assert sp.sealed() == [1, 2]


def test_segments_seal_after_a_second_or_sooner_when_urgent(tmp_path: Path) -> None:
    """A segment of routine lines is sealed `seal_interval_s` after it was opened; one holding an
    urgent line `urgent_interval_s` after it was opened, even if the urgent line came last."""
    clock = [100.0]  # steps of binary fractions: exact sums
    sp = Spool(tmp_path, node="n", seal_interval_s=1.0, urgent_interval_s=0.25,
               monotonic=lambda: clock[0])
    sp.append([line(event(1))])
    clock[0] += 0.5
    assert not sp.maybe_seal()
    clock[0] += 0.5
    assert sp.maybe_seal()
    assert sp.sealed() == [1]

    sp.append([line(event(2))])
    clock[0] += 0.125
    assert not sp.maybe_seal()
    sp.append([line(event(3))], urgent=True)
    assert not sp.maybe_seal()
    clock[0] += 0.125
    assert sp.maybe_seal()
    assert sp.sealed() == [1, 2]

    # the next segment is routine again
    sp.append([line(event(4))])
    clock[0] += 0.5
    assert not sp.maybe_seal()
    assert len(sp.read(2).lines) == 2


def test_urgent_interval_is_never_longer_than_the_seal_interval(tmp_path: Path) -> None:
    sp = Spool(tmp_path, node="n", seal_interval_s=0.05, urgent_interval_s=0.2)
    assert sp.urgent_interval_s == 0.05


def test_agent_seals_a_batch_holding_an_urgent_record_sooner(tmp_path: Path) -> None:
    """Real NodeAgent.receive on wire lines: a steady heartbeat and completed collectives leave
    the segment open for the full interval, a heartbeat stuck in a call for a second does not."""
    clock = [0.0]
    sp = Spool(tmp_path / "spool", node="n", seal_interval_s=1.0, urgent_interval_s=0.2,
               monotonic=lambda: clock[0])
    agent = NodeAgent(job="j", node="n", socket_path=str(tmp_path / "a.sock"), spool=sp,
                      sink=FlakySink())

    def beat(pending_for_us: int) -> bytes:
        progress = GroupProgress(group="0", last_enqueued=7, last_completed=6,
                                 pending_op="all_reduce",
                                 last_enqueue_us=50_000_000 - pending_for_us, last_complete_us=1)
        hb = Heartbeat(job="j", attempt=0, node="n", rank=0, time_us=50_000_000, pid=1, step=3,
                       step_us=1, start_step=0, first_step_us=1, dropped=0, groups=(progress,))
        return json.dumps(wire.encode(hb)).encode()

    agent.receive([line(event(1)), beat(300_000)])
    clock[0] = 0.5
    assert not sp.maybe_seal()  # routine: open for a second
    agent.receive([beat(URGENT_PENDING_US)])
    assert sp.maybe_seal()  # urgent, and open for more than 0.2 s already
    assert len(sp.read(sp.sealed()[0]).lines) == 3


@pytest.mark.parametrize(("record", "expected"), [
    (event(1), False),
    (CollectiveEvent(job="j", attempt=0, node="n", rank=0, group="0", seq=2, op="all_reduce",
                     nbytes=4, dtype="float32", peer=-1, state=CollectiveState.FAILED,
                     enqueue_us=1, complete_us=2), True),
    (RankExit(job="j", attempt=0, node="n", rank=0, pid=1, exit_code=-9, time_us=1), True),
    (StackSample(job="j", attempt=0, node="n", rank=0, time_us=1, frames=("a.py:1 f",)), True),
    (ProcessSample(job="j", attempt=0, node="n", rank=0, pid=1, time_us=1, state="S", cpu_s=1.0,
                   cpu_rate=0.5, read_bytes=0, write_bytes=0, io_rate=0.0), False),
    (ProcessSample(job="j", attempt=0, node="n", rank=0, pid=1, time_us=1, state="T", cpu_s=1.0,
                   cpu_rate=0.0, read_bytes=0, write_bytes=0, io_rate=0.0), True),
    (ProcessSample(job="j", attempt=0, node="n", rank=0, pid=1, time_us=1, state="gone",
                   cpu_s=1.0, cpu_rate=0.0, read_bytes=0, write_bytes=0, io_rate=0.0), True),
    (HealthSample(job="j", node="n", device="gpu0", time_us=1, source="simulated",
                  metric="temperature_c", value=60.0, severity=HealthSeverity.INFO), False),
    (HealthSample(job="j", node="n", device="gpu0", time_us=1, source="simulated",
                  metric="xid", value=79.0, severity=HealthSeverity.CRITICAL), True),
    (Heartbeat(job="j", attempt=0, node="n", rank=0, time_us=5_000_000, pid=1, step=3,
               step_us=1, start_step=0, first_step_us=1, dropped=0), False),
])
def test_urgent_records(record: object, expected: bool) -> None:
    assert urgent(record) is expected  # type: ignore[arg-type]


def test_agent_receives_from_transport_rejects_bad_lines_and_ships(tmp_path: Path) -> None:
    """A real SocketTransport started before the agent exists, reconnecting once it does."""
    socket_path = str(tmp_path / "agent.sock")
    transport = SocketTransport(socket_path, bound=100)
    rec = Recorder(job="j", attempt=0, node="n", rank=1, sink=transport)
    for _ in range(5):
        rec.end(rec.begin("0", "all_reduce", 4, "float32"), True)
    transport.start()
    time.sleep(0.2)  # the agent is not there yet: records wait in the queue

    sink = FlakySink(failures=2)
    sp = Spool(tmp_path / "spool", node="n", seal_interval_s=0.05)
    agent = NodeAgent(job="j", node="n", socket_path=socket_path, spool=sp, sink=sink,
                      stats_file=str(tmp_path / "stats.json"), stats_interval_s=0.2)
    agent.shipper.min_backoff_s = 0.01
    agent.start()
    try:
        assert transport.flush(10.0)
        import socket as socketlib

        with socketlib.socket(socketlib.AF_UNIX) as raw:
            raw.connect(socket_path)
            raw.sendall(b'{"type":"collective"}\nnot json\n')
        rec.heartbeat()
        assert transport.flush(10.0)
        deadline = time.monotonic() + 10
        while len(sink.records()) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        assert agent.stop(drain_s=5.0)
    records = sink.records()
    assert sorted(r.seq for r in records if isinstance(r, CollectiveEvent)) == [1, 2, 3, 4, 5]
    assert sum(isinstance(r, Heartbeat) for r in records) == 1
    stats = json.loads((tmp_path / "stats.json").read_text())
    assert stats["rejected"] == 2 and stats["received"] == 6 and stats["shipped"] == 6
    assert stats["pending_segments"] == 0


def test_transport_sends_at_its_interval_or_when_nudged(tmp_path: Path) -> None:
    """A real SocketTransport and node agent: with a send interval of an hour, what is offered
    after the transport went idle waits in its queue until `nudge` sends it."""
    socket_path = str(tmp_path / "agent.sock")
    sp = Spool(tmp_path / "spool", node="n", seal_interval_s=0.05)
    agent = NodeAgent(job="j", node="n", socket_path=socket_path, spool=sp, sink=FlakySink(0),
                      stats_file=str(tmp_path / "stats.json"), stats_interval_s=0.2)
    agent.start()
    transport = SocketTransport(socket_path, bound=100, poll_s=3600.0)
    try:
        rec = Recorder(job="j", attempt=0, node="n", rank=1, sink=transport)
        rec.heartbeat()
        transport.start()  # connects and sends what is queued, then waits for its next tick
        deadline = time.monotonic() + 30
        while not (transport.sent == 1 and transport._idle.is_set()) and (
                time.monotonic() < deadline):
            time.sleep(0.01)
        assert transport.sent == 1
        rec.end(rec.begin("0", "all_reduce", 4, "float32"), True)
        time.sleep(0.3)
        assert (transport.sent, transport.pending) == (1, 1)  # waits for the next tick
        transport.nudge()
        while transport.sent < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (transport.sent, transport.pending, transport.dropped) == (2, 0, 0)
    finally:
        transport.close(1.0)
        agent.stop()


@pytest.mark.parametrize("bound", [2])
def test_transport_drops_beyond_its_bound(bound: int, tmp_path: Path) -> None:
    transport = SocketTransport(str(tmp_path / "nobody.sock"), bound=bound)
    rec = Recorder(job="j", attempt=0, node="n", rank=0, sink=transport)
    for _ in range(5):
        rec.end(rec.begin("0", "barrier", 0, ""), True)
    assert len(transport) == 2 and rec.dropped == 3
    done = threading.Event()
    transport.start()
    assert not transport.flush(0.2)  # nobody listens: bounded wait, records kept
    assert len(transport) == 2
    done.set()


class RecordingSpans:
    """Stands in for telemetry.CollectiveSpans (whose export is tested in test_telemetry)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.exported = 0
        self.dropped = 0

    def observe(self, event: CollectiveEvent) -> None:
        self.seen.append(event.seq)
        self.exported += 1


def test_agent_hands_every_collective_it_accepts_to_the_span_exporter(tmp_path: Path) -> None:
    spans = RecordingSpans()
    sp = spool(tmp_path / "spool")
    agent = NodeAgent(job="j", node="n", socket_path=str(tmp_path / "agent.sock"), spool=sp,
                      sink=FlakySink(), spans=spans)  # type: ignore[arg-type]
    beat = Recorder(job="j", attempt=0, node="n", rank=0, sink=FlakySink()).heartbeat_record()
    agent.receive([line(event(1)), b"not json", json.dumps(wire.encode(beat)).encode(),
                   line(event(2, rank=1))])
    assert spans.seen == [1, 2]  # the heartbeat and the bad line are not collectives
    stats = agent.stats()
    assert (stats["spans_exported"], stats["spans_dropped"]) == (2, 0)
    assert stats["received"] == 3 and stats["rejected"] == 1
