"""The node agent's own telemetry as OpenTelemetry metrics, exported over OTLP/HTTP.

The node agent counts what it does (`NodeAgent.stats()`: records received, rejected, spooled,
shipped, retries, pending segments, its process watcher and health sources). `start_telemetry`
turns those counts into observable OpenTelemetry instruments, each data point tagged with the
job and the node, and exports them with OTLP/HTTP (protobuf) every OTEL_METRIC_EXPORT_INTERVAL
milliseconds, to OTEL_EXPORTER_OTLP_METRICS_ENDPOINT (used as it is) or
OTEL_EXPORTER_OTLP_ENDPOINT (`/v1/metrics` appended). With neither set, or OTEL_SDK_DISABLED=true,
nothing is started and nothing is imported. `TelemetryHandle.timed_sink` wraps the shipper's sink
so each shipment's duration lands in a histogram.

Only the node agent may use this module: opentelemetry is imported lazily, inside
`start_telemetry`, and never in a training process. Telemetry must never break the agent: a
failing `stats()` is logged and skipped, a collector that is down only costs a failed export, and
only bad OTEL_* values (SettingError naming the variable) raise, at start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from tracehound.tracing.settings import SettingError

if TYPE_CHECKING:
    from tracehound.agent.spool import BatchSink, SpooledBatch

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
    Metric("pending_segments", "tracehound.agent.spool.pending_segments", "gauge", "{segment}",
           "Sealed spool segments not shipped yet."),
    Metric("spool_bytes", "tracehound.agent.spool.size", "gauge", "By",
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


def telemetry_settings(env: Mapping[str, str] | None = None) -> TelemetrySettings | None:
    """The telemetry `env` (default: the process environment) asks for; None when it asks for
    none. SettingError, naming the variable, for a value that cannot be used."""
    source = os.environ if env is None else env
    if _flag(OTEL_SDK_DISABLED, source):
        return None
    metrics_url = source.get(OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, "").strip()
    base_url = source.get(OTEL_EXPORTER_OTLP_ENDPOINT, "").strip()
    if metrics_url:
        endpoint = _url(OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, metrics_url)
    elif base_url:
        endpoint = _url(OTEL_EXPORTER_OTLP_ENDPOINT, base_url).rstrip("/") + METRICS_PATH
    else:
        return None
    for name in (OTEL_EXPORTER_OTLP_METRICS_PROTOCOL, OTEL_EXPORTER_OTLP_PROTOCOL):
        protocol = source.get(name, "").strip()
        if protocol:
            if protocol != PROTOCOL:
                raise SettingError(f"{name}={protocol!r}: only {PROTOCOL} is supported here")
            break
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
