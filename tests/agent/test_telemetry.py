"""The node agent's telemetry, exported over OTLP/HTTP to a real HTTP receiver on loopback that
decodes each POST (metrics, or spans when the path ends in /traces) with the OTLP protobuf schema
(opentelemetry.proto)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from tracehound.agent.node.telemetry import (
    JOB_ATTRIBUTE,
    NODE_ATTRIBUTE,
    SHIP_DURATION,
    TelemetryHandle,
    span_settings,
    start_spans,
    start_telemetry,
    telemetry_settings,
    trace_id_of,
)
from tracehound.tracing.events import CollectiveEvent, CollectiveState
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.settings import SettingError


class Receiver:
    """An OTLP/HTTP receiver: keeps every decoded export request and its path."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        requests, lock = self.requests, self.lock

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(415)
                    self.end_headers()
                    return
                request: Any = (ExportTraceServiceRequest() if self.path.endswith("/traces")
                                else ExportMetricsServiceRequest())
                request.ParseFromString(body)
                with lock:
                    requests.append((self.path, request))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def paths(self) -> list[str]:
        with self.lock:
            return [path for path, _ in self.requests]

    def spans(self) -> list[tuple[Any, dict[str, str]]]:
        """Every exported span with its resource's attributes."""
        with self.lock:
            requests = [r for _, r in self.requests if isinstance(r, ExportTraceServiceRequest)]
        return [(span, attrs(rs.resource.attributes))
                for request in requests for rs in request.resource_spans
                for ss in rs.scope_spans for span in ss.spans]

    def latest(self) -> dict[str, Any]:
        """The latest exported point of each metric: name -> (metric, point, resource attrs)."""
        out: dict[str, Any] = {}
        with self.lock:
            requests = [r for _, r in self.requests if isinstance(r, ExportMetricsServiceRequest)]
        for request in requests:
            for rm in request.resource_metrics:
                resource = attrs(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        data = metric.WhichOneof("data")
                        points = getattr(metric, data).data_points
                        for point in points:
                            out[metric.name] = (metric, point, resource, sm.scope.name)
        return out


def attrs(values: Iterator[KeyValue] | Any) -> dict[str, str]:
    return {kv.key: kv.value.string_value for kv in values}


class Stats:
    """What a node agent's `stats()` returns, changeable by the test."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {
            "received": 120, "rejected": 3, "spooled": 117, "shipped": 100,
            "shipped_batches": 4, "retries": 2, "refused_batches": 1, "corrupt_lines": 0,
            "pending_segments": 5, "connections": 2, "process_samples": 7,
            "stacks_captured": 1, "stacks_failed": 0, "source_polls": 9, "source_records": 8,
            "source_errors": 1, "source_emit_failed": 0, "dropped": 42,
        }

    def __call__(self) -> Mapping[str, float]:
        return dict(self.values)


class Batch:
    batch_id = "node-0/spool/1"
    lines = (b"{}",)


class Sink:
    """A stand-in for the shipper's store sink: fails when told to."""

    def __init__(self) -> None:
        self.fail = False
        self.sent = 0

    def send(self, batch: Any, *, maybe_duplicate: bool) -> int | None:
        if self.fail:
            raise OSError("store down")
        self.sent += 1
        return 0


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def started(stats: Any, env: Mapping[str, str], **kwargs: Any) -> TelemetryHandle:
    handle = start_telemetry(stats, job="job-7", node="node-3", env=env, **kwargs)
    assert handle is not None
    return handle


def test_metrics_arrive_with_their_values_and_job_and_node(receiver: Receiver) -> None:
    stats = Stats()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url + "/",
           "OTEL_METRIC_EXPORT_INTERVAL": "3600000"}
    handle = started(stats, env)
    try:
        sink = handle.timed_sink(Sink())
        assert sink.send(Batch(), maybe_duplicate=False) == 0  # type: ignore[arg-type]
        assert handle.force_flush()
        wait_for(lambda: receiver.requests)
    finally:
        handle.shutdown()
    assert set(receiver.paths()) == {"/v1/metrics"}
    got = receiver.latest()
    expected = {
        "tracehound.agent.records.received": 120, "tracehound.agent.records.rejected": 3,
        "tracehound.agent.records.dropped": 42, "tracehound.agent.records.shipped": 100,
        "tracehound.agent.node.spool.pending_segments": 5, "tracehound.agent.store.retries": 2,
        "tracehound.agent.store.refused": 1, "tracehound.agent.sources.errors": 1,
        "tracehound.agent.stacks.captured": 1, "tracehound.agent.connections": 2,
    }
    for name, value in expected.items():
        _, point, resource, scope = got[name]
        assert point.as_int == value or point.as_double == value, name
        assert attrs(point.attributes) == {JOB_ATTRIBUTE: "job-7", NODE_ATTRIBUTE: "node-3"}
        assert resource["service.name"] == "tracehound-node-agent"
        assert resource[NODE_ATTRIBUTE] == "node-3" and resource[JOB_ATTRIBUTE] == "job-7"
        assert scope == "tracehound.agent"
    received, _, _, _ = got["tracehound.agent.records.received"]
    assert received.WhichOneof("data") == "sum" and received.sum.is_monotonic
    assert received.unit == "{record}"
    pending, _, _, _ = got["tracehound.agent.node.spool.pending_segments"]
    assert pending.WhichOneof("data") == "gauge"
    assert "tracehound.agent.node.spool.size" not in got  # no spool_bytes and no spool_dir
    ship, point, _, _ = got[SHIP_DURATION]
    assert ship.WhichOneof("data") == "histogram" and ship.unit == "s"
    assert point.count == 1 and point.sum > 0
    assert attrs(point.attributes)["outcome"] == "ok"


def test_later_exports_follow_the_stats_and_time_failed_shipments(
    receiver: Receiver, tmp_path: Any
) -> None:
    stats = Stats()
    (tmp_path / "00000001.seg").write_bytes(b"x" * 1000)
    (tmp_path / "00000002.open").write_bytes(b"y" * 234)
    env = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": receiver.url + "/custom/metrics",
           "OTEL_METRIC_EXPORT_INTERVAL": "100"}
    handle = started(stats, env, spool_dir=tmp_path)
    try:
        wait_for(lambda: "tracehound.agent.records.received" in receiver.latest())
        stats.values["received"] = 5000
        stats.values["pending_segments"] = 0
        inner = Sink()
        sink = handle.timed_sink(inner)
        inner.fail = True
        with pytest.raises(OSError, match="store down"):
            sink.send(Batch(), maybe_duplicate=True)  # type: ignore[arg-type]
        # the periodic export (every 100 ms) carries the new values without a flush
        wait_for(lambda: receiver.latest()["tracehound.agent.records.received"][1].as_int
                 == 5000)
    finally:
        handle.shutdown()
    assert set(receiver.paths()) == {"/custom/metrics"}
    got = receiver.latest()
    assert got["tracehound.agent.node.spool.pending_segments"][1].as_int == 0
    assert got["tracehound.agent.node.spool.size"][1].as_int == 1234
    _, point, _, _ = got[SHIP_DURATION]
    assert point.count == 1 and attrs(point.attributes)["outcome"] == "error"


def test_a_failing_stats_function_exports_what_it_can_and_never_raises(
    receiver: Receiver,
) -> None:
    calls = 0

    def broken() -> Mapping[str, float]:
        nonlocal calls
        calls += 1
        raise RuntimeError("spool directory gone")

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_METRIC_EXPORT_INTERVAL": "3600000"}
    handle = started(broken, env)
    try:
        handle.record_ship(0.25, ok=True)
        assert handle.force_flush()
        wait_for(lambda: receiver.requests)
    finally:
        handle.shutdown()
    assert calls >= 1
    got = receiver.latest()
    assert set(got) == {SHIP_DURATION}
    assert got[SHIP_DURATION][1].sum == pytest.approx(0.25)


def test_nothing_is_started_or_sent_without_an_endpoint(receiver: Receiver) -> None:
    stats = Stats()
    assert start_telemetry(stats, job="j", node="n", env={}) is None
    assert start_telemetry(stats, job="j", node="n", env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SDK_DISABLED": "true",
    }) is None
    assert start_telemetry(stats, job="j", node="n", env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": "", "OTEL_METRIC_EXPORT_INTERVAL": "10",
    }) is None
    time.sleep(0.3)
    assert receiver.requests == []


def test_importing_the_agent_or_its_telemetry_does_not_import_opentelemetry() -> None:
    code = (
        "import sys, tracehound.agent, tracehound.agent.node.telemetry as t\n"
        "assert t.start_telemetry(dict, job='j', node='n', env={}) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(("env", "variable"), [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4318"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "ftp://x/v1/metrics"},
     "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:99999"}, "OTEL_EXPORTER_OTLP_ENDPOINT"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_METRIC_EXPORT_INTERVAL": "1s"},
     "OTEL_METRIC_EXPORT_INTERVAL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_METRIC_EXPORT_INTERVAL": "0"},
     "OTEL_METRIC_EXPORT_INTERVAL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
     "OTEL_EXPORTER_OTLP_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
      "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/json"}, "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318", "OTEL_SDK_DISABLED": "maybe"},
     "OTEL_SDK_DISABLED"),
])
def test_bad_settings_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(SettingError, match=variable):
        start_telemetry(Stats(), job="j", node="n", env=env)


def test_settings_pick_the_metrics_endpoint_over_the_base() -> None:
    settings = telemetry_settings({
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://m:443/x",
        "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",  # the signal's own setting wins
    })
    assert settings is not None and settings.endpoint == "https://m:443/x"
    assert settings.interval_ms == 60000
    base = telemetry_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://base:4318/otlp/"})
    assert base is not None and base.endpoint == "http://base:4318/otlp/v1/metrics"


# -- sampled collectives as spans ------------------------------------------------------------------


def collective(rank: int, seq: int, *, failed: bool = False) -> CollectiveEvent:
    start = 1_795_000_000_000_000 + 1000 * seq + rank
    return CollectiveEvent(
        job=JobId("job-7"), attempt=1, node=NodeId(f"node-{rank // 2}"), rank=Rank(rank),
        group=GroupId("dp-0"), seq=seq, op="all_reduce", nbytes=4096, dtype="float32", peer=-1,
        state=CollectiveState.FAILED if failed else CollectiveState.COMPLETED,
        enqueue_us=start, complete_us=start + 250,
    )


def test_every_nth_collective_becomes_one_span_per_rank_sharing_a_trace(
    receiver: Receiver,
) -> None:
    spans = start_spans("job-7", "node-0", env={
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "TRACEHOUND_OTEL_SPANS_EVERY": "5",
    })
    assert spans is not None
    try:
        for seq in range(1, 11):
            for rank in (0, 1):
                spans.observe(collective(rank, seq, failed=(rank, seq) == (1, 10)))
        assert spans.force_flush()
        wait_for(lambda: len(receiver.spans()) == 4)
    finally:
        spans.shutdown()
    assert set(receiver.paths()) == {"/v1/traces"}
    assert (spans.exported, spans.dropped) == (4, 0)
    got = {}
    for span, resource in receiver.spans():
        a = {kv.key: kv.value for kv in span.attributes}
        got[(a["tracehound.rank"].int_value, a["tracehound.seq"].int_value)] = (span, a)
        assert resource["service.name"] == "tracehound-node-agent"
        assert resource[JOB_ATTRIBUTE] == "job-7"
    assert sorted(got) == [(0, 5), (0, 10), (1, 5), (1, 10)]
    for (rank, seq), (span, a) in got.items():
        event = collective(rank, seq)
        assert span.name == f"all_reduce #{seq}"
        assert span.start_time_unix_nano == event.enqueue_us * 1000
        assert span.end_time_unix_nano == event.complete_us * 1000
        # both ranks' spans of one collective are one trace
        assert int.from_bytes(span.trace_id, "big") == trace_id_of("job-7", 1, "dp-0", seq)
        assert a["tracehound.group"].string_value == "dp-0"
        assert a["tracehound.bytes"].int_value == 4096
        assert a[NODE_ATTRIBUTE].string_value == f"node-{rank // 2}"
        # the failed one is marked an error (STATUS_CODE_ERROR = 2), the others are not
        assert span.status.code == (2 if (rank, seq) == (1, 10) else 0)
    assert got[(0, 5)][0].trace_id == got[(1, 5)][0].trace_id != got[(0, 10)][0].trace_id


def test_spans_lost_to_a_collector_that_is_down_are_counted() -> None:
    spans = start_spans("job-7", "node-0", env={
        # nothing listens on port 9 of loopback
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
        "TRACEHOUND_OTEL_SPANS_EVERY": "1",
    })
    assert spans is not None
    try:
        for seq in range(1, 4):
            spans.observe(collective(0, seq))
        spans.force_flush(timeout_s=30)
    finally:
        spans.shutdown()
    assert (spans.exported, spans.dropped) == (3, 3)


@pytest.mark.parametrize(("env", "variable"), [
    ({"TRACEHOUND_OTEL_SPANS_EVERY": "often", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"},
     "TRACEHOUND_OTEL_SPANS_EVERY"),
    ({"TRACEHOUND_OTEL_SPANS_EVERY": "-2", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"},
     "TRACEHOUND_OTEL_SPANS_EVERY"),
    ({"TRACEHOUND_OTEL_SPANS_EVERY": "10"}, "TRACEHOUND_OTEL_SPANS_EVERY"),  # nowhere to go
    ({"TRACEHOUND_OTEL_SPANS_EVERY": "10", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "x:1"},
     "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
    ({"TRACEHOUND_OTEL_SPANS_EVERY": "10", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
])
def test_bad_span_settings_name_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(SettingError, match=variable):
        span_settings(env)


def test_spans_are_off_unless_asked_for() -> None:
    assert span_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}) is None
    assert span_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318",
                          "TRACEHOUND_OTEL_SPANS_EVERY": "0"}) is None
    settings = span_settings({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318/",
                              "TRACEHOUND_OTEL_SPANS_EVERY": "100"})
    assert settings is not None and settings.endpoint == "http://x:4318/v1/traces"
    assert settings.every == 100
