"""GPU health of a node: one port (`GpuBackend`), an NVML adapter and a simulated one, and the
`GpuHealthSource` that turns their readings into the store's health samples.

The backend reads what the driver knows, as the driver reports it: gauges (temperature, power, SM
clock, utilization, memory), running counters (ECC errors since the driver loaded, PCIe replays,
NVLink error counters), states (remapped rows pending or failed, NVLink links up) and Xid events.
The source keeps the previous reading of every GPU and decides what each means:

    metric                  severity   when
    temperature_c, power_w, INFO       every poll (readings; the analysis never counts INFO)
    sm_clock_mhz, utilization_pct, memory_used_bytes
    temperature_c           WARNING    at or above the GPU's slowdown threshold
    clocks_event_reasons    WARNING    a slowdown bit set (0x8 hw slowdown, 0x20 sw thermal,
                                       0x40 hw thermal, 0x80 power brake); INFO otherwise
    xid                     CRITICAL   an Xid of a GPU that lost itself or its memory (48, 62,
                                       64, 74, 79, 94, 95, 119, 120, 140); WARNING for others
    ecc_uncorrectable       CRITICAL   the volatile uncorrected count went up
    ecc_correctable         WARNING    the volatile corrected count went up
    remapped_rows           CRITICAL   row remapping failed; WARNING while a remap is pending
    nvlink_down             CRITICAL   a link that was up is down
    nvlink_errors           WARNING    an NVLink replay/recovery/CRC counter went up
    pcie_replays            WARNING    the PCIe replay counter went up
    gpu_lost                CRITICAL   the GPU stopped answering (NVML: GPU is lost); once

Counters are reported as the increase since the previous poll, so a sample means "this happened
now", never "this happened some time since boot". The first reading of a GPU sets the baseline.
A metric the GPU does not support is skipped from then on (no error per poll).

The simulated adapter stands in for NVML on machines without GPUs and injects faults: it reads
plausible values and applies faults from its `inject` method or from a file of JSON lines that
grows while the agent runs (`TRACEHOUND_SIM_GPU_FAULTS`), each line one fault:

    {"node": "node-1", "gpu": 1, "kind": "xid", "code": 79}
    kinds: xid (code), ecc_dbe, thermal, nvlink_down (link), gpu_lost, clear

This runs in the node agent, never in a training process. pynvml is imported only when the NVML
adapter is created.
"""

from __future__ import annotations

import enum
import json
import logging
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from tracehound.tracing.events import HealthSample, HealthSeverity, Record
from tracehound.tracing.ids import JobId, NodeId

log = logging.getLogger(__name__)

XID_CRITICAL = frozenset({48, 62, 64, 74, 79, 94, 95, 119, 120, 140})
"""Xids of a GPU that lost its memory contents, an NVLink, or itself (see analysis.hardware)."""

CLOCK_SLOWDOWN_BITS = 0x8 | 0x20 | 0x40 | 0x80
"""NVML clock event reasons that slow a GPU below its peers (the others are routine)."""


class GpuLostError(Exception):
    """The GPU no longer answers (fallen off the bus, Xid 79)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuReading:
    """One GPU at one moment; None where the GPU does not report the value."""

    index: int
    temperature_c: float | None = None
    slowdown_temp_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    utilization_pct: float | None = None
    memory_used_bytes: float | None = None
    clocks_event_reasons: int | None = None
    ecc_corrected: int | None = None
    """Volatile corrected ECC errors since the driver loaded (a running counter)."""
    ecc_uncorrected: int | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    nvlink_up: tuple[bool, ...] | None = None
    """Per NVLink of the GPU: up or not."""
    nvlink_errors: int | None = None
    """Sum of the NVLink replay, recovery and CRC counters (running)."""
    pcie_replays: int | None = None


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An Xid the driver reported for GPU `index` (`time_us` 0: when it was read)."""

    index: int
    code: int
    time_us: int = 0


class GpuBackend(Protocol):
    """What a node's GPUs report. Reads may raise GpuLostError for a GPU that is gone."""

    name: str
    """`nvml` or `sim`: the health samples' source."""

    def device_count(self) -> int: ...

    def read(self, index: int) -> GpuReading: ...

    def xid_events(self) -> list[XidEvent]:
        """The Xid events since the last call, without waiting."""
        ...

    def close(self) -> None: ...


# -- the source -----------------------------------------------------------------------------------


@dataclass
class _Seen:
    reading: GpuReading | None = None
    lost: bool = False


@dataclass
class GpuStats:
    """Samples by severity, and GPUs found lost."""

    info: int = 0
    warning: int = 0
    critical: int = 0
    lost: int = 0


class GpuHealthSource:
    """A `Source` (agent.sources) of the node's GPU health samples."""

    def __init__(self, backend: GpuBackend, *, job: str, node: str,
                 interval_s: float = 10.0) -> None:
        self.name = "gpu"
        self.backend = backend
        self.job = JobId(job)
        self.node = NodeId(node)
        self.interval_s = interval_s
        self.count = backend.device_count()
        self.seen = [_Seen() for _ in range(self.count)]
        self.stats = GpuStats()

    def close(self) -> None:
        self.backend.close()

    def poll(self, now_us: int) -> list[Record]:
        out: list[HealthSample] = []
        for event in self.backend.xid_events():
            severity = (HealthSeverity.CRITICAL if event.code in XID_CRITICAL
                        else HealthSeverity.WARNING)
            out.append(self._sample(event.index, event.time_us or now_us, "xid",
                                    float(event.code), severity=severity,
                                    detail=f"Xid {event.code}"))
        for index, seen in enumerate(self.seen):
            if seen.lost:
                continue
            try:
                reading = self.backend.read(index)
            except GpuLostError as exc:
                seen.lost = True
                self.stats.lost += 1
                out.append(self._sample(index, now_us, "gpu_lost", 1.0,
                                        severity=HealthSeverity.CRITICAL,
                                        detail=str(exc) or "GPU is lost"))
                continue
            out.extend(self._judge(index, seen.reading, reading, now_us))
            seen.reading = reading
        for s in out:
            if s.severity is HealthSeverity.CRITICAL:
                self.stats.critical += 1
            elif s.severity is HealthSeverity.WARNING:
                self.stats.warning += 1
            else:
                self.stats.info += 1
        return list(out)

    def _sample(self, index: int, time_us: int, metric: str, value: float, *,
                severity: HealthSeverity, detail: str = "") -> HealthSample:
        return HealthSample(job=self.job, node=self.node, device=f"gpu{index}", time_us=time_us,
                            source=self.backend.name, metric=metric, value=value,
                            severity=severity, detail=detail)

    def _judge(self, index: int, before: GpuReading | None, now: GpuReading,
               time_us: int) -> Iterable[HealthSample]:
        info, warn, crit = HealthSeverity.INFO, HealthSeverity.WARNING, HealthSeverity.CRITICAL
        sample = self._sample
        for metric in ("power_w", "sm_clock_mhz", "utilization_pct", "memory_used_bytes"):
            value = getattr(now, metric)
            if value is not None:
                yield sample(index, time_us, metric, float(value), severity=info)
        if now.temperature_c is not None:
            hot = now.slowdown_temp_c is not None and now.temperature_c >= now.slowdown_temp_c
            yield sample(index, time_us, "temperature_c", float(now.temperature_c),
                         severity=warn if hot else info,
                         detail=f"at or above the slowdown threshold {now.slowdown_temp_c:g} C"
                         if hot else "")
        if now.clocks_event_reasons is not None:
            bits = now.clocks_event_reasons
            yield sample(index, time_us, "clocks_event_reasons", float(bits),
                         severity=warn if bits & CLOCK_SLOWDOWN_BITS else info,
                         detail=_reasons(bits) if bits & CLOCK_SLOWDOWN_BITS else "")
        if now.remap_failed:
            yield sample(index, time_us, "remapped_rows", 1.0, severity=crit,
                         detail="row remapping failed")
        elif now.remap_pending and not (before and before.remap_pending):
            yield sample(index, time_us, "remapped_rows", 1.0, severity=warn,
                         detail="a row remap is pending (takes effect at the next GPU reset)")
        if before is None:
            return
        for metric, attr, severity, what in (
            ("ecc_uncorrectable", "ecc_uncorrected", crit, "uncorrectable ECC errors"),
            ("ecc_correctable", "ecc_corrected", warn, "corrected ECC errors"),
            ("nvlink_errors", "nvlink_errors", warn, "NVLink replay/recovery/CRC errors"),
            ("pcie_replays", "pcie_replays", warn, "PCIe replays"),
        ):
            old, new = getattr(before, attr), getattr(now, attr)
            if old is not None and new is not None and new > old:
                yield sample(index, time_us, metric, float(new - old), severity=severity,
                             detail=f"{new - old} new {what} since the last poll (total {new})")
        if before.nvlink_up is not None and now.nvlink_up is not None:
            down = [i for i, (was, up) in enumerate(zip(before.nvlink_up, now.nvlink_up,
                                                        strict=False)) if was and not up]
            if down:
                yield sample(index, time_us, "nvlink_down", float(len(down)), severity=crit,
                             detail="NVLink " + ", ".join(map(str, down)) + " went down")


_REASON_NAMES = ((0x8, "hardware slowdown"), (0x20, "software thermal slowdown"),
                 (0x40, "hardware thermal slowdown"), (0x80, "power brake"))


def _reasons(bits: int) -> str:
    return ", ".join(name for bit, name in _REASON_NAMES if bits & bit)


# -- simulated GPUs -------------------------------------------------------------------------------


class SimFault(enum.StrEnum):
    """Faults the simulated adapter injects."""

    XID = "xid"
    ECC_DBE = "ecc_dbe"
    THERMAL = "thermal"
    NVLINK_DOWN = "nvlink_down"
    GPU_LOST = "gpu_lost"
    CLEAR = "clear"


@dataclass
class _SimGpu:
    reading: GpuReading
    lost: bool = False
    thermal: bool = False


@dataclass
class SimulatedGpus:
    """A `GpuBackend` of `count` healthy GPUs with injectable faults (see the module docstring).

    `faults_file` (optional) is read from where the last read stopped at every `xid_events`
    call; a bad line is an error naming the file and line, and the lines before it stay applied.
    `node` keeps the faults of this node only (lines without "node" apply to every node)."""

    count: int = 8
    node: str = ""
    faults_file: str | None = None
    seed: int = 0
    name: str = "sim"
    _gpus: list[_SimGpu] = field(default_factory=list)
    _events: list[XidEvent] = field(default_factory=list)
    _offset: int = 0
    _line: int = 0
    _rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"simulated GPUs: expected a count >= 0, got {self.count}")
        self._rng.seed(f"{self.seed}:{self.node}")
        self._gpus = [
            _SimGpu(GpuReading(
                index=i, temperature_c=55.0, slowdown_temp_c=87.0, power_w=300.0,
                sm_clock_mhz=1980.0, utilization_pct=95.0, memory_used_bytes=60e9,
                clocks_event_reasons=0x4, ecc_corrected=0, ecc_uncorrected=0,
                remap_pending=False, remap_failed=False, nvlink_up=(True,) * 12,
                nvlink_errors=0, pcie_replays=0,
            ))
            for i in range(self.count)
        ]

    def device_count(self) -> int:
        return self.count

    def read(self, index: int) -> GpuReading:
        gpu = self._gpus[index]
        if gpu.lost:
            raise GpuLostError(f"gpu{index} is lost (simulated)")
        jitter = self._rng.uniform
        r = gpu.reading
        if gpu.thermal:
            return replace(r, temperature_c=round(91.0 + jitter(0, 2), 1),
                           sm_clock_mhz=round(1150.0 + jitter(-20, 20)),
                           power_w=round(240.0 + jitter(-5, 5), 1))
        return replace(r, temperature_c=round(55.0 + jitter(-3, 3), 1),
                       power_w=round(300.0 + jitter(-15, 15), 1),
                       sm_clock_mhz=round(1980.0 + jitter(-15, 0)),
                       utilization_pct=round(95.0 + jitter(-5, 5), 1))

    def xid_events(self) -> list[XidEvent]:
        if self.faults_file:
            self._read_faults(self.faults_file)
        events, self._events = self._events, []
        return events

    def close(self) -> None:
        return None

    def inject(self, kind: SimFault | str, gpu: int, *, code: int = 0, link: int = 0,
               at_us: int = 0) -> None:
        """Apply one fault to GPU `gpu` now (ValueError naming what is wrong)."""
        try:
            fault = SimFault(kind)
        except ValueError:
            raise ValueError(f"fault kind {kind!r}: expected one of "
                             f"{', '.join(k.value for k in SimFault)}") from None
        if not 0 <= gpu < self.count:
            raise ValueError(f"gpu {gpu}: expected 0 to {self.count - 1}")
        g = self._gpus[gpu]
        r = g.reading
        if fault is SimFault.XID:
            if code <= 0:
                raise ValueError(f"xid fault: expected a positive Xid code, got {code}")
            self._events.append(XidEvent(gpu, code, at_us))
            if code == 79:
                g.lost = True
            elif code in (48, 94, 95):
                g.reading = replace(r, ecc_uncorrected=(r.ecc_uncorrected or 0) + 1)
            elif code == 63:
                g.reading = replace(r, remap_pending=True)
            elif code == 64:
                g.reading = replace(r, remap_failed=True)
        elif fault is SimFault.ECC_DBE:
            self._events.append(XidEvent(gpu, 48, at_us))
            g.reading = replace(r, ecc_uncorrected=(r.ecc_uncorrected or 0) + 1)
        elif fault is SimFault.THERMAL:
            g.thermal = True
            g.reading = replace(r, clocks_event_reasons=0x4 | 0x20 | 0x40)
        elif fault is SimFault.NVLINK_DOWN:
            links = list(r.nvlink_up or ())
            if not 0 <= link < len(links):
                raise ValueError(f"nvlink_down: link {link}: expected 0 to {len(links) - 1}")
            links[link] = False
            g.reading = replace(r, nvlink_up=tuple(links),
                                nvlink_errors=(r.nvlink_errors or 0) + 17)
        elif fault is SimFault.GPU_LOST:
            g.lost = True
        else:
            g.lost = g.thermal = False
            g.reading = replace(r, clocks_event_reasons=0x4, remap_pending=False,
                                remap_failed=False, nvlink_up=(True,) * len(r.nvlink_up or ()))

    def _read_faults(self, path: str) -> None:
        try:
            with open(path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        for raw in data[:end].splitlines():
            self._offset += len(raw) + 1
            self._line += 1
            if not raw.strip():
                continue
            self._apply_line(path, self._line, raw)

    def _apply_line(self, path: str, line: int, raw: bytes) -> None:
        where = f"{path}:{line}"
        try:
            spec = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"{where}: expected one JSON object per line ({exc})") from None
        if not isinstance(spec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(spec).__name__}")
        node = spec.get("node")
        if node is not None and self.node and str(node) != self.node:
            return
        gpu, code, link, at_us = (spec.get(k, 0) for k in ("gpu", "code", "link", "at_us"))
        if not all(isinstance(v, int) for v in (gpu, code, link, at_us)):
            raise ValueError(f"{where}: gpu, code, link and at_us must be whole numbers")
        try:
            self.inject(str(spec.get("kind", "")), gpu, code=code, link=link, at_us=at_us)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


# -- NVML -----------------------------------------------------------------------------------------


class NvmlUnavailable(Exception):
    """NVML cannot be used on this machine (no driver, no library); says why."""


class NvmlGpus:
    """A `GpuBackend` over NVML (nvidia-ml-py). Unsupported metrics are asked once only."""

    name = "nvml"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise NvmlUnavailable(f"nvidia-ml-py is not installed ({exc})") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML did not initialize: {exc}") from exc
        self.nv: Any = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]
        self._unsupported: set[tuple[int, str]] = set()
        self._events: Any = None
        try:
            self._events = pynvml.nvmlEventSetCreate()
            for handle in self.handles:
                try:
                    pynvml.nvmlDeviceRegisterEvents(
                        handle, pynvml.nvmlEventTypeXidCriticalError, self._events)
                except pynvml.NVMLError as exc:
                    log.warning("no Xid events from a GPU: %s", exc)
        except pynvml.NVMLError as exc:
            log.warning("no Xid events on this node: %s", exc)

    def device_count(self) -> int:
        return len(self.handles)

    def _get(self, index: int, what: str, call: Callable[[], Any]) -> Any:
        if (index, what) in self._unsupported:
            return None
        nv = self.nv
        try:
            return call()
        except nv.NVMLError as exc:
            if getattr(exc, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                raise GpuLostError(f"gpu{index}: {exc}") from exc
            self._unsupported.add((index, what))
            log.info("gpu%d does not report %s: %s", index, what, exc)
            return None

    def read(self, index: int) -> GpuReading:
        nv, h = self.nv, self.handles[index]

        def get(what: str, call: Callable[[], Any]) -> Any:
            return self._get(index, what, call)

        power = get("power", lambda: nv.nvmlDeviceGetPowerUsage(h))
        util = get("utilization", lambda: nv.nvmlDeviceGetUtilizationRates(h))
        memory = get("memory", lambda: nv.nvmlDeviceGetMemoryInfo(h))
        reasons_fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        remap = get("remapped rows", lambda: nv.nvmlDeviceGetRemappedRows(h))
        links = self._nvlinks(index, h)
        return GpuReading(
            index=index,
            temperature_c=get("temperature",
                              lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
            slowdown_temp_c=get("slowdown threshold", lambda: nv.nvmlDeviceGetTemperatureThreshold(
                h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)),
            power_w=None if power is None else power / 1000.0,
            sm_clock_mhz=get("SM clock", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            utilization_pct=None if util is None else float(util.gpu),
            memory_used_bytes=None if memory is None else float(memory.used),
            clocks_event_reasons=get("clock event reasons", lambda: reasons_fn(h)),
            ecc_corrected=get("corrected ECC", lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC)),
            ecc_uncorrected=get("uncorrected ECC", lambda: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC)),
            remap_pending=None if remap is None else bool(remap[2]),
            remap_failed=None if remap is None else bool(remap[3]),
            nvlink_up=links[0] if links else None,
            nvlink_errors=links[1] if links else None,
            pcie_replays=get("PCIe replays", lambda: nv.nvmlDeviceGetPcieReplayCounter(h)),
        )

    def _nvlinks(self, index: int, h: Any) -> tuple[tuple[bool, ...], int] | None:
        nv = self.nv
        if (index, "nvlink") in self._unsupported:
            return None
        up: list[bool] = []
        errors = 0
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                state = nv.nvmlDeviceGetNvLinkState(h, link)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) == nv.NVML_ERROR_GPU_IS_LOST:
                    raise GpuLostError(f"gpu{index}: {exc}") from exc
                break
            up.append(state == nv.NVML_FEATURE_ENABLED)
            for counter in (nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                            nv.NVML_NVLINK_ERROR_DL_CRC_FLIT):
                try:
                    errors += int(nv.nvmlDeviceGetNvLinkErrorCounter(h, link, counter))
                except nv.NVMLError:
                    continue
        if not up:
            self._unsupported.add((index, "nvlink"))
            return None
        return tuple(up), errors

    def xid_events(self) -> list[XidEvent]:
        nv = self.nv
        if self._events is None:
            return []
        out: list[XidEvent] = []
        for _ in range(1000):
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                break  # a timeout: no more events
            try:
                key = int(nv.nvmlDeviceGetIndex(data.device))
            except nv.NVMLError:
                key = -1
            out.append(XidEvent(max(key, 0), int(data.eventData)))
        return out

    def close(self) -> None:
        nv = self.nv
        try:
            if self._events is not None:
                nv.nvmlEventSetFree(self._events)
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("NVML shutdown: %s", exc)


def open_backend(kind: str, *, node: str, sim_gpus: int = 8,
                 sim_faults: str | None = None) -> GpuBackend | None:
    """The GPU backend named by `kind`: `nvml`, `sim`, `off`, or `auto` (NVML when it works,
    else none, logged). ValueError for another kind; NvmlUnavailable when `nvml` cannot run."""
    if kind == "off":
        return None
    if kind == "sim":
        return SimulatedGpus(count=sim_gpus, node=node, faults_file=sim_faults)
    if kind in ("nvml", "auto"):
        try:
            return NvmlGpus()
        except NvmlUnavailable as exc:
            if kind == "nvml":
                raise
            log.info("no GPU health on this node: %s", exc)
            return None
    raise ValueError(f"GPU backend {kind!r}: expected auto, nvml, sim or off")

