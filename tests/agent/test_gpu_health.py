"""GPU health: the simulated GPUs' faults become the samples the hardware analysis reads.

The NVML adapter is tested against a stand-in `pynvml` module (no NVIDIA driver can run on this
machine); the stand-in answers the way nvidia-ml-py does (values, NVMLError with its `value`
codes), so what is tested is the adapter's mapping, not NVML."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tracehound.agent.sources.gpu import (
    GpuHealthSource,
    GpuLostError,
    NvmlGpus,
    NvmlUnavailable,
    SimFault,
    SimulatedGpus,
    open_backend,
)
from tracehound.analysis.hardware import HealthKind, health_kind
from tracehound.tracing.events import HealthSample, HealthSeverity

T0 = 1_800_000_000_000_000


def source(count: int = 4, **kwargs: Any) -> tuple[SimulatedGpus, GpuHealthSource]:
    gpus = SimulatedGpus(count=count, node="node-1", **kwargs)
    return gpus, GpuHealthSource(gpus, job="j", node="node-1", interval_s=1.0)


def alarms(samples: list[Any]) -> list[tuple[str, str, float, HealthSeverity]]:
    return [(s.device, s.metric, s.value, s.severity) for s in samples
            if s.severity is not HealthSeverity.INFO]


def test_healthy_gpus_give_readings_only() -> None:
    _, src = source()
    first = src.poll(T0)
    second = src.poll(T0 + 1_000_000)
    assert alarms(first) == [] and alarms(second) == []
    for samples in (first, second):
        assert {s.device for s in samples} == {"gpu0", "gpu1", "gpu2", "gpu3"}
        assert all(isinstance(s, HealthSample) and s.node == "node-1" and s.source == "sim"
                   for s in samples)
        metrics = {s.metric for s in samples if s.device == "gpu2"}
        assert {"temperature_c", "power_w", "sm_clock_mhz", "clocks_event_reasons"} <= metrics
    # the routine clock event reasons of a busy GPU (software power cap) are no slowdown
    clocks = [s for s in first if s.metric == "clocks_event_reasons"]
    assert all(health_kind(s) is HealthKind.LOW_GRADE for s in clocks)


def test_xid_79_is_reported_then_the_gpu_is_lost_once() -> None:
    gpus, src = source()
    src.poll(T0)
    gpus.inject(SimFault.XID, 1, code=79, at_us=T0 + 500_000)
    samples = src.poll(T0 + 1_000_000)
    assert alarms(samples) == [("gpu1", "xid", 79.0, HealthSeverity.CRITICAL),
                               ("gpu1", "gpu_lost", 1.0, HealthSeverity.CRITICAL)]
    xid = next(s for s in samples if s.metric == "xid")
    assert xid.time_us == T0 + 500_000  # when it happened, not when it was read
    assert all(health_kind(s) is HealthKind.GPU_FAULT for s in samples
               if s.severity is not HealthSeverity.INFO)
    later = src.poll(T0 + 2_000_000)
    assert alarms(later) == []
    assert "gpu1" not in {s.device for s in later}  # a lost GPU is read no more
    assert src.stats.lost == 1 and src.stats.critical == 2


def test_double_bit_ecc_thermal_and_nvlink_faults() -> None:
    gpus, src = source()
    src.poll(T0)
    gpus.inject(SimFault.ECC_DBE, 0)
    gpus.inject(SimFault.THERMAL, 2)
    gpus.inject(SimFault.NVLINK_DOWN, 3, link=5)
    samples = src.poll(T0 + 1_000_000)
    found = alarms(samples)
    assert ("gpu0", "xid", 48.0, HealthSeverity.CRITICAL) in found
    assert ("gpu0", "ecc_uncorrectable", 1.0, HealthSeverity.CRITICAL) in found
    assert ("gpu3", "nvlink_down", 1.0, HealthSeverity.CRITICAL) in found
    assert ("gpu3", "nvlink_errors", 17.0, HealthSeverity.WARNING) in found
    thermal = {s.metric: s for s in samples
               if s.device == "gpu2" and s.severity is HealthSeverity.WARNING}
    assert set(thermal) == {"temperature_c", "clocks_event_reasons"}
    assert int(thermal["clocks_event_reasons"].value) & 0x60
    assert "thermal" in thermal["clocks_event_reasons"].detail
    kinds = {(s.device, s.metric): health_kind(s) for s in samples
             if s.severity is not HealthSeverity.INFO}
    assert kinds[("gpu0", "ecc_uncorrectable")] is HealthKind.GPU_FAULT
    assert kinds[("gpu2", "clocks_event_reasons")] is HealthKind.SLOWDOWN
    assert kinds[("gpu3", "nvlink_down")] is HealthKind.NVLINK_DOWN
    # a counter is reported as its increase: nothing new, nothing reported
    again = alarms(src.poll(T0 + 2_000_000))
    assert ("gpu0", "ecc_uncorrectable", 1.0, HealthSeverity.CRITICAL) not in again
    assert ("gpu3", "nvlink_down", 1.0, HealthSeverity.CRITICAL) not in again
    # a throttle lasts: the throttled GPU says so at every poll
    assert ("gpu2", "clocks_event_reasons") in {(d, m) for d, m, _, _ in again}


def test_fault_file_is_read_as_it_grows_for_this_node_only(tmp_path: Path) -> None:
    faults = tmp_path / "faults.jsonl"
    _, src = source(faults_file=str(faults))
    assert alarms(src.poll(T0)) == []  # no file yet: nothing injected
    faults.write_text('{"node": "node-0", "gpu": 1, "kind": "xid", "code": 79}\n'
                      '{"node": "node-1", "gpu": 2, "kind": "xid", "code": 94}\n'
                      '{"gpu": 0, "kind": "xid", "co')  # the last line is still being written
    found = alarms(src.poll(T0 + 1_000_000))
    assert found == [("gpu2", "xid", 94.0, HealthSeverity.CRITICAL),
                     ("gpu2", "ecc_uncorrectable", 1.0, HealthSeverity.CRITICAL)]
    with faults.open("a") as handle:
        handle.write('de": 63}\n')
    found = alarms(src.poll(T0 + 2_000_000))
    assert ("gpu0", "xid", 63.0, HealthSeverity.WARNING) in found
    assert ("gpu0", "remapped_rows", 1.0, HealthSeverity.WARNING) in found


def test_a_bad_fault_line_names_file_and_line_and_keeps_the_earlier_ones(tmp_path: Path) -> None:
    faults = tmp_path / "faults.jsonl"
    faults.write_text('{"gpu": 0, "kind": "gpu_lost"}\n{"gpu": 9, "kind": "xid", "code": 79}\n')
    gpus = SimulatedGpus(count=2, node="n", faults_file=str(faults))
    with pytest.raises(ValueError, match=r"faults.jsonl:2: gpu 9: expected 0 to 1"):
        gpus.xid_events()
    with pytest.raises(GpuLostError):
        gpus.read(0)  # line 1 was applied
    faults.write_text(faults.read_text() + "not json\n")
    with pytest.raises(ValueError, match=r"faults.jsonl:3: expected one JSON object per line"):
        gpus.xid_events()
    with pytest.raises(ValueError, match="fault kind 'melt'"):
        gpus.inject("melt", 0)


def test_open_backend_names_what_is_missing() -> None:
    assert isinstance(open_backend("sim", node="n", sim_gpus=2), SimulatedGpus)
    assert open_backend("off", node="n") is None
    with pytest.raises(ValueError, match="GPU backend 'cuda'"):
        open_backend("cuda", node="n")
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        # this machine has no NVIDIA driver: auto falls back to none, nvml says why
        assert open_backend("auto", node="n") is None
        with pytest.raises(NvmlUnavailable, match="NVML did not initialize"):
            open_backend("nvml", node="n")
    else:  # pragma: no cover - a GPU machine
        pynvml.nvmlShutdown()


# -- NVML adapter, against a stand-in pynvml ------------------------------------------------------


class _NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(lost: set[int], xids: list[tuple[int, int]]) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    consts = dict(
        NVML_ERROR_NOT_SUPPORTED=3, NVML_ERROR_TIMEOUT=10, NVML_ERROR_GPU_IS_LOST=15,
        NVML_TEMPERATURE_GPU=0, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN=1, NVML_CLOCK_SM=1,
        NVML_MEMORY_ERROR_TYPE_CORRECTED=0, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1,
        NVML_VOLATILE_ECC=0, NVML_NVLINK_MAX_LINKS=4, NVML_FEATURE_ENABLED=1,
        NVML_NVLINK_ERROR_DL_REPLAY=0, NVML_NVLINK_ERROR_DL_RECOVERY=1,
        NVML_NVLINK_ERROR_DL_CRC_FLIT=2, nvmlEventTypeXidCriticalError=8,
    )
    for k, v in consts.items():
        setattr(nv, k, v)
    nv.NVMLError = _NVMLError  # type: ignore[attr-defined]
    calls: dict[str, int] = {}

    def check(h: int, what: str) -> None:
        calls[what] = calls.get(what, 0) + 1
        if h in lost:
            raise _NVMLError(15)

    def unsupported(h: int, *a: Any) -> Any:
        check(h, "pcie")
        raise _NVMLError(3)

    def ecc(h: int, kind: int, where: int) -> int:
        check(h, "ecc")
        return 2 if kind == 1 and h == 1 else 0

    def event_wait(es: Any, timeout: int) -> Any:
        if not xids:
            raise _NVMLError(10)
        index, code = xids.pop(0)
        return types.SimpleNamespace(device=index, eventData=code)

    fns = dict(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetIndex=lambda h: h,
        nvmlDeviceGetTemperature=lambda h, s: (check(h, "temp"), 61)[1],
        nvmlDeviceGetTemperatureThreshold=lambda h, s: 90,
        nvmlDeviceGetPowerUsage=lambda h: 312_500,
        nvmlDeviceGetClockInfo=lambda h, c: 1_800,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97, memory=40),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=1 << 30),
        nvmlDeviceGetCurrentClocksEventReasons=lambda h: 0x4,
        nvmlDeviceGetTotalEccErrors=ecc,
        nvmlDeviceGetRemappedRows=lambda h: (0, 0, 0, 0),
        nvmlDeviceGetNvLinkState=lambda h, link: 1,
        nvmlDeviceGetNvLinkErrorCounter=lambda h, link, c: 0,
        nvmlDeviceGetPcieReplayCounter=unsupported,
        nvmlEventSetCreate=object, nvmlDeviceRegisterEvents=lambda h, t, es: None,
        nvmlEventSetWait_v2=event_wait, nvmlEventSetFree=lambda es: None,
    )
    for k, fn in fns.items():
        setattr(nv, k, fn)
    nv.calls = calls  # type: ignore[attr-defined]
    return nv


def test_nvml_adapter_maps_readings_events_and_a_lost_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    lost: set[int] = set()
    xids = [(1, 79)]
    nv = fake_pynvml(lost, xids)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    backend = NvmlGpus()
    src = GpuHealthSource(backend, job="j", node="gpu-node-7", interval_s=5.0)
    first = src.poll(T0)
    assert alarms(first) == [("gpu1", "xid", 79.0, HealthSeverity.CRITICAL)]
    temp = next(s for s in first if s.device == "gpu0" and s.metric == "temperature_c")
    power = next(s for s in first if s.device == "gpu0" and s.metric == "power_w")
    assert (temp.value, power.value, temp.source) == (61.0, 312.5, "nvml")
    reading = backend.read(1)
    assert reading.ecc_uncorrected == 2 and reading.nvlink_up == (True,) * 4
    assert reading.pcie_replays is None
    src.poll(T0 + 1)
    assert nv.calls["pcie"] == 2  # unsupported: asked once per GPU, never again
    lost.add(1)
    samples = src.poll(T0 + 2)
    assert alarms(samples) == [("gpu1", "gpu_lost", 1.0, HealthSeverity.CRITICAL)]
    src.close()
