"""The node agent's own telemetry as OpenTelemetry metrics, exported over OTLP/HTTP.

The node agent counts what it does (`NodeAgent.stats()`: records received, rejected, spooled,
shipped, retries, pending segments, its process watcher and health sources). `start_telemetry`
turns those counts into observable OpenTelemetry instruments, each data point tagged with the
job and the node, and exports them with OTLP/HTTP (protobuf) every OTEL_METRIC_EXPORT_INTERVAL
milliseconds, to OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (used as it is) or
OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/metrics` appended). With neither set, or OTEL_SDK_DISABLED=true,
nothing is started and nothing is imported. `TelemetryHandle.timed_sink` wraps the shipper's sink
so each shipment's duration lands in a histogram.

Sampled collectives as spans (`start_spans`): with TRACEHOUND_OTEL_SPANS_EVERY=N the agent
exports every Nth collective (by sequence id, per process group) its ranks report as one span per
rank, from the rank's entry to its completion, over OTLP/HTTP to
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (as it is) or OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces. The
spans of one collective on all ranks share a trace id made from (job, attempt, group, sequence
id), so a trace viewer shows the collective across the job as one trace, under a parent that is
never exported. Spans the exporter's queue cannot take are counted (`spans_dropped`).

Only the node agent may use this module: opentelemetry is imported lazily, inside
`start_telemetry`, and never in a training process. Telemetry must never break the agent: a
failing `stats()` is logged and skipped, a collector that is down only costs a failed export, and
only bad OTEL_* values (SettingError naming the variable) raise, at start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast
from urllib.parse import urlsplit

from tracehound.tracing.events import CollectiveEvent, CollectiveState
from tracehound.tracing.settings import (
    DEFAULT_OTEL_SPANS_EVERY,
    TRACEHOUND_OTEL_SPANS_EVERY,
    SettingError,
    env_int,
)

if TYPE_CHECKING:
    from tracehound.agent.node.spool import BatchSink, SpooledBatch

log = logging.getLogger(__name__)

OTEL_EXPORTER_OTLP_ENDPOINT = "OTEL_EXPORTER_OTLP_ENDPOINT"
"""Base URL of an OTLP/HTTP collector, e.g. http://collector:4318; metrics go to its
/v1/metrics. Unset (and no metrics endpoint either): no telemetry."""

OTEL_EXPORTER_OTLP_METRICS_ENDPOINT = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"
"""Full URL metrics are posted to, e.g. http://collector:4318/v1/metrics (wins over the base)."""

OTEL_EXPORTER_OTLP_PROTOCOL = "OTEL_EXPORTER_OTLP_PROTOCOL"
OTEL_EXPORTER_OTLP_METRICS_PROTOCOL = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL"
"""Only http/protobuf is supported (the default); anything else is an error."""

OTEL_METRIC_EXPORT_INTERVAL = "OTEL_METRIC_EXPORT_INTERVAL"
"""Milliseconds between exports (default DEFAULT_EXPORT_INTERVAL_MS)."""

DEFAULT_EXPORT_INTERVAL_MS = 60000
"""The OpenTelemetry default."""

OTEL_SDK_DISABLED = "OTEL_SDK_DISABLED"
"""true: no telemetry even with an endpoint set."""

PROTOCOL = "http/protobuf"
METRICS_PATH = "/v1/metrics"
SCOPE = "tracehound.agent"
SERVICE_NAME = "tracehound-node-agent"
JOB_ATTRIBUTE = "tracehound.job"
NODE_ATTRIBUTE = "tracehound.node"

Stats = Callable[[], Mapping[str, float]]
"""The node agent's counts (`NodeAgent.stats()`), read at each export."""

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True, slots=True)
class Metric:
    """One instrument fed by one key of the stats."""

    key: str
    name: str
    kind: Kind
    unit: str
    description: str


METRICS: tuple[Metric, ...] = (
    Metric("received", "tracehound.agent.records.received", "counter", "{record}",
           "Valid records received from the ranks."),
    Metric("rejected", "tracehound.agent.records.rejected", "counter", "{record}",
           "Lines from ranks that were not valid records."),
    Metric("dropped", "tracehound.agent.records.dropped", "gauge", "{record}",
           "Records the ranks dropped before sending them (sum of the latest count in each "
           "rank's heartbeat)."),
    Metric("spooled", "tracehound.agent.records.spooled", "counter", "{record}",
           "Records written to the spool."),
    Metric("shipped", "tracehound.agent.records.shipped", "counter", "{record}",
           "Records in batches the store accepted."),
    Metric("shipped_batches", "tracehound.agent.batches.shipped", "counter", "{batch}",
           "Batches the store accepted."),
    Metric("retries", "tracehound.agent.store.retries", "counter", "{try}",
           "Failed tries to ship a batch (each retried later)."),
    Metric("refused_batches", "tracehound.agent.store.refused", "counter", "{batch}",
           "Batches the store refused for good (kept in rejected/)."),
    Metric("corrupt_lines", "tracehound.agent.records.corrupt", "counter", "{record}",
           "Spooled lines that could not be read back or that the store could not decode."),
    Metric("pending_segments", "tracehound.agent.node.spool.pending_segments", "gauge", "{segment}",
           "Sealed spool segments not shipped yet."),
    Metric("spool_bytes", "tracehound.agent.node.spool.size", "gauge", "By",
           "Bytes of spool segments on disk."),
    Metric("connections", "tracehound.agent.connections", "counter", "{connection}",
           "Rank connections accepted."),
    Metric("process_samples", "tracehound.agent.process_samples", "counter", "{record}",
           "/proc samples of ranks taken."),
    Metric("stacks_captured", "tracehound.agent.stacks.captured", "counter", "{record}",
           "Stacks of stuck ranks captured."),
    Metric("stacks_failed", "tracehound.agent.stacks.failed", "counter", "{capture}",
           "Stack captures that gave no stack."),
    Metric("source_polls", "tracehound.agent.sources.polls", "counter", "{poll}",
           "Polls of the node's health sources."),
    Metric("source_records", "tracehound.agent.sources.records", "counter", "{record}",
           "Records the health sources emitted."),
    Metric("source_errors", "tracehound.agent.sources.errors", "counter", "{poll}",
           "Polls of health sources that failed."),
    Metric("source_emit_failed", "tracehound.agent.sources.emit_failed", "counter", "{record}",
           "Records of health sources the spool refused."),
)
"""What is exported, by stats key. A key missing from the stats is left out of that export."""

SHIP_DURATION = "tracehound.agent.ship.duration"
"""Histogram of the time one shipment (one batch to the store) took, in seconds, with an
`outcome` attribute: ok or error."""


# -- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """What the OTEL_* variables ask for."""

    endpoint: str
    """URL metrics are posted to (…/v1/metrics)."""
    interval_ms: int
    """Milliseconds between exports."""


def _flag(name: str, env: Mapping[str, str]) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in ("", "false", "0"):
        return False
    if raw in ("true", "1"):
        return True
    raise SettingError(f"{name}={raw!r}: expected true or false")


def _url(name: str, raw: str) -> str:
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingError(f"{name}={raw!r}: expected an http(s) URL, e.g. http://collector:4318")
    try:
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: the port is not a number in 1-65535") from None
    return raw


def _endpoint(source: Mapping[str, str], signal_url: str, signal_protocol: str,
              path: str) -> str | None:
    """Where one signal goes: its own endpoint variable as it is, else the base endpoint plus
    `path`; None when neither is set. Checks the protocol (the signal's own variable first)."""
    own = source.get(signal_url, "").strip()
    base = source.get(OTEL_EXPORTER_OTLP_ENDPOINT, "").strip()
    if own:
        endpoint = _url(signal_url, own)
    elif base:
        endpoint = _url(OTEL_EXPORTER_OTLP_ENDPOINT, base).rstrip("/") + path
    else:
        return None
    for name in (signal_protocol, OTEL_EXPORTER_OTLP_PROTOCOL):
        protocol = source.get(name, "").strip()
        if protocol:
            if protocol != PROTOCOL:
                raise SettingError(f"{name}={protocol!r}: only {PROTOCOL} is supported here")
            break
    return endpoint


def telemetry_settings(env: Mapping[str, str] | None = None) -> TelemetrySettings | None:
    """The telemetry `env` (default: the process environment) asks for; None when it asks for
    none. SettingError, naming the variable, for a value that cannot be used."""
    source = os.environ if env is None else env
    if _flag(OTEL_SDK_DISABLED, source):
        return None
    endpoint = _endpoint(source, OTEL_EXPORTER_OTLP_METRICS_ENDPOINT,
                         OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, METRICS_PATH)
    if endpoint is None:
        return None
    raw = source.get(OTEL_METRIC_EXPORT_INTERVAL, "").strip()
    interval_ms = DEFAULT_EXPORT_INTERVAL_MS
    if raw:
        try:
            interval_ms = int(raw)
        except ValueError:
            raise SettingError(
                f"{OTEL_METRIC_EXPORT_INTERVAL}={raw!r}: expected whole milliseconds, e.g. "
                f"{DEFAULT_EXPORT_INTERVAL_MS}"
            ) from None
        if interval_ms <= 0:
            raise SettingError(f"{OTEL_METRIC_EXPORT_INTERVAL}={raw!r}: expected milliseconds > 0")
    return TelemetrySettings(endpoint=endpoint, interval_ms=interval_ms)


OTEL_EXPORTER_OTLP_TRACES_ENDPOINT = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
"""Full URL spans are posted to, e.g. http://collector:4318/v1/traces (wins over the base)."""

OTEL_EXPORTER_OTLP_TRACES_PROTOCOL = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"

TRACES_PATH = "/v1/traces"

SPAN_QUEUE = 4096
"""Spans waiting for export at most; past it new ones are dropped and counted."""


@dataclass(frozen=True, slots=True)
class SpanSettings:
    """What TRACEHOUND_OTEL_SPANS_EVERY and the OTEL_* variables ask for."""

    endpoint: str
    """URL spans are posted to (…/v1/traces)."""
    every: int
    """Every how many sequence ids of a group a collective is exported."""


def span_settings(env: Mapping[str, str] | None = None) -> SpanSettings | None:
    """The span export `env` (default: the process environment) asks for; None when
    TRACEHOUND_OTEL_SPANS_EVERY is unset or 0 (or OTEL_SDK_DISABLED). SettingError, naming the
    variable, for a value that cannot be used or spans asked for without an endpoint."""
    source = os.environ if env is None else env
    every = env_int(TRACEHOUND_OTEL_SPANS_EVERY, DEFAULT_OTEL_SPANS_EVERY, env=source)
    if every == 0 or _flag(OTEL_SDK_DISABLED, source):
        return None
    endpoint = _endpoint(source, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
                         OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, TRACES_PATH)
    if endpoint is None:
        raise SettingError(
            f"{TRACEHOUND_OTEL_SPANS_EVERY}={every}: spans need somewhere to go; set "
            f"{OTEL_EXPORTER_OTLP_ENDPOINT} (or {OTEL_EXPORTER_OTLP_TRACES_ENDPOINT})"
        )
    return SpanSettings(endpoint=endpoint, every=every)


def trace_id_of(job: str, attempt: int, group: str, seq: int) -> int:
    """The trace id every rank's span of one collective carries (128 bits, never 0)."""
    digest = hashlib.blake2b(f"{job}\0{attempt}\0{group}\0{seq}".encode(),
                             digest_size=16).digest()
    return int.from_bytes(digest, "big") or 1


class CollectiveSpans:
    """Exports sampled collectives as spans; `observe` is handed every collective the agent
    receives and never raises."""

    def __init__(self, settings: SpanSettings, *, job: str, node: str) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            SpanKind,
            Status,
            StatusCode,
            TraceFlags,
        )

        self.settings = settings
        self.every = settings.every
        self.exported = 0
        """Spans handed to the exporter."""
        self.dropped = 0
        """Sampled collectives not exported: the exporter's queue was full, or making the span
        failed."""
        self._queue = 0
        self._lock = threading.Lock()
        resource = Resource.create({
            "service.name": SERVICE_NAME, "service.instance.id": node,
            JOB_ATTRIBUTE: job, NODE_ATTRIBUTE: node,
        })
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        # duck-typed: opentelemetry is imported here only, so the class cannot subclass its
        # SpanExporter
        self._exporter = cast(Any, _CountingExporter(
            OTLPSpanExporter(endpoint=settings.endpoint), self))
        self._provider.add_span_processor(BatchSpanProcessor(
            self._exporter, max_queue_size=SPAN_QUEUE, schedule_delay_millis=1000,
        ))
        self._tracer = self._provider.get_tracer(SCOPE)
        self._trace = trace
        self._parent = (NonRecordingSpan, SpanContext, TraceFlags(TraceFlags.SAMPLED))
        self._kind = SpanKind.INTERNAL
        self._error = Status(StatusCode.ERROR, "the collective failed on this rank")
        log.info("telemetry: exporting every %d-th collective of each group as spans to %s",
                 settings.every, settings.endpoint)

    def observe(self, event: CollectiveEvent) -> None:
        if event.seq % self.every:
            return
        with self._lock:
            if self._queue >= SPAN_QUEUE:
                self.dropped += 1
                return
            self._queue += 1
        try:
            non_recording, span_context, flags = self._parent
            trace_id = trace_id_of(event.job, event.attempt, event.group, event.seq)
            parent = non_recording(span_context(
                trace_id=trace_id, span_id=(trace_id & 0xFFFFFFFFFFFFFFFF) or 1, is_remote=True,
                trace_flags=flags,
            ))
            span = self._tracer.start_span(
                f"{event.op} #{event.seq}", context=self._trace.set_span_in_context(parent),
                kind=self._kind, start_time=event.enqueue_us * 1000, attributes={
                    JOB_ATTRIBUTE: event.job, NODE_ATTRIBUTE: event.node,
                    "tracehound.attempt": event.attempt, "tracehound.rank": int(event.rank),
                    "tracehound.group": event.group, "tracehound.seq": event.seq,
                    "tracehound.op": event.op, "tracehound.bytes": event.nbytes,
                    "tracehound.dtype": event.dtype, "tracehound.peer": event.peer,
                },
            )
            if event.state is CollectiveState.FAILED:
                span.set_status(self._error)
            span.end(end_time=max(event.complete_us, event.enqueue_us) * 1000)
        except Exception as exc:
            with self._lock:
                self._queue -= 1
                self.dropped += 1
            log.debug("telemetry could not make a span: %r", exc)
            return
        with self._lock:
            self.exported += 1

    def _sent(self, count: int, *, ok: bool) -> None:
        with self._lock:
            self._queue = max(0, self._queue - count)
            if not ok:
                self.dropped += count

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        try:
            return bool(self._provider.force_flush(timeout_millis=int(timeout_s * 1000)))
        except Exception as exc:
            log.warning("span flush failed: %r", exc)
            return False

    def shutdown(self) -> None:
        """Export what is queued and stop; never raises."""
        try:
            self._provider.shutdown()
        except Exception as exc:
            log.warning("span export shutdown failed: %r", exc)


class _CountingExporter:
    """The OTLP exporter, telling CollectiveSpans how many spans left its queue."""

    def __init__(self, inner: Any, spans: CollectiveSpans) -> None:
        self.inner = inner
        self.spans = spans

    def export(self, spans: Any) -> Any:
        ok = False
        try:
            result = self.inner.export(spans)
            ok = getattr(result, "name", "") == "SUCCESS"
            return result
        finally:
            self.spans._sent(len(spans), ok=ok)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def start_spans(job: str, node: str, env: Mapping[str, str] | None = None
                ) -> CollectiveSpans | None:
    """Span export as `env` asks (see `span_settings`); None when it asks for none."""
    settings = span_settings(env)
    return None if settings is None else CollectiveSpans(settings, job=job, node=node)


# -- reading the stats -----------------------------------------------------------------------------


class StatsReader:
    """Reads the stats at most once per `max_age_s` (one export observes every instrument from
    one reading) and never raises: a failing `stats()` is logged and gives nothing."""

    def __init__(self, stats: Stats, *, spool_dir: str | os.PathLike[str] | None = None,
                 max_age_s: float = 0.5,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.stats = stats
        self.spool_dir = None if spool_dir is None else Path(spool_dir)
        self.max_age_s = max_age_s
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._at: float | None = None
        self._values: dict[str, float] = {}
        self.failures = 0

    def values(self) -> dict[str, float]:
        with self._lock:
            now = self.monotonic()
            if self._at is None or now - self._at >= self.max_age_s:
                self._at = now
                self._values = self._read()
            return self._values

    def _read(self) -> dict[str, float]:
        values: dict[str, float] = {}
        try:
            for key, value in self.stats().items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    values[key] = value
        except Exception as exc:
            self.failures += 1
            if self.failures <= 5:
                log.warning("telemetry could not read the agent's stats: %r", exc)
            return {}
        if self.spool_dir is not None and "spool_bytes" not in values:
            values["spool_bytes"] = spool_bytes(self.spool_dir)
        return values


def spool_bytes(directory: Path) -> int:
    """Bytes of the files directly in `directory` (0 when it cannot be read)."""
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_size
                except OSError:
                    continue
    except OSError:
        return 0
    return total


# -- the handle ------------------------------------------------------------------------------------


class TelemetryHandle:
    """Running telemetry: flush it, time shipments with it, shut it down."""

    def __init__(self, provider: Any, reader: StatsReader, histogram: Any,
                 attributes: Mapping[str, str], settings: TelemetrySettings) -> None:
        self._provider = provider
        self.reader = reader
        self._histogram = histogram
        self.attributes = dict(attributes)
        self.settings = settings
        self._closed = False

    def record_ship(self, seconds: float, *, ok: bool) -> None:
        """One shipment took `seconds`; never raises."""
        try:
            self._histogram.record(seconds, {**self.attributes, "outcome": "ok" if ok else "error"})
        except Exception as exc:
            log.debug("telemetry could not record a shipment: %r", exc)

    def timed_sink(self, sink: BatchSink) -> BatchSink:
        """`sink`, with each `send` timed into the ship duration histogram."""
        return _TimedSink(sink, self)

    def force_flush(self, timeout_s: float = 10.0) -> bool:
        """Export now; True when the export finished in time."""
        try:
            return bool(self._provider.force_flush(timeout_millis=timeout_s * 1000))
        except Exception as exc:
            log.warning("telemetry flush failed: %r", exc)
            return False

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Export a last time and stop (idempotent); never raises."""
        if self._closed:
            return
        self._closed = True
        try:
            self._provider.shutdown(timeout_millis=timeout_s * 1000)
        except Exception as exc:
            log.warning("telemetry shutdown failed: %r", exc)


class _TimedSink:
    """A BatchSink that times each send of the sink inside it."""

    def __init__(self, inner: BatchSink, handle: TelemetryHandle) -> None:
        self.inner = inner
        self.handle = handle

    def send(self, batch: SpooledBatch, *, maybe_duplicate: bool) -> int | None:
        start = time.perf_counter()
        ok = False
        try:
            result = self.inner.send(batch, maybe_duplicate=maybe_duplicate)
            ok = True
            return result
        finally:
            self.handle.record_ship(time.perf_counter() - start, ok=ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def start_telemetry(
    stats: Stats,
    *,
    job: str,
    node: str,
    env: Mapping[str, str] | None = None,
    spool_dir: str | os.PathLike[str] | None = None,
) -> TelemetryHandle | None:
    """Export the agent's `stats` as OpenTelemetry metrics when `env` (default: the process
    environment) names an OTLP endpoint; None (and nothing started) when it does not.
    `spool_dir` (optional) adds the spool's size on disk when the stats do not carry
    `spool_bytes`. SettingError for bad OTEL_* values."""
    settings = telemetry_settings(env)
    if settings is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource

    attributes = {JOB_ATTRIBUTE: job, NODE_ATTRIBUTE: node}
    reader = StatsReader(stats, spool_dir=spool_dir)
    exporter = OTLPMetricExporter(endpoint=settings.endpoint)
    metric_reader = PeriodicExportingMetricReader(
        exporter, export_interval_millis=settings.interval_ms,
    )
    resource = Resource.create({
        "service.name": SERVICE_NAME, "service.instance.id": node, **attributes,
    })
    provider = MeterProvider(
        metric_readers=[metric_reader], resource=resource, shutdown_on_exit=False,
    )
    meter = provider.get_meter(SCOPE)

    def observe(key: str) -> Callable[[CallbackOptions], Iterator[Observation]]:
        def callback(options: CallbackOptions) -> Iterator[Observation]:
            value = reader.values().get(key)
            if value is not None:
                yield Observation(value, attributes)

        return callback

    for metric in METRICS:
        make = (meter.create_observable_counter if metric.kind == "counter"
                else meter.create_observable_gauge)
        make(metric.name, callbacks=[observe(metric.key)], unit=metric.unit,
             description=metric.description)
    histogram = meter.create_histogram(
        SHIP_DURATION, unit="s", description="Time one shipment of a batch to the store took.",
    )
    log.info("telemetry: exporting the agent's metrics to %s every %d ms",
             settings.endpoint, settings.interval_ms)
    return TelemetryHandle(provider, reader, histogram, attributes, settings)
