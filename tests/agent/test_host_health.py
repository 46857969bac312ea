"""Host health from Linux's own files: link changes, InfiniBand ports, disks, memory, load; a
missing source is reported once. Most tests read a /sys and /proc tree of their own (the states
under test cannot be produced on this machine: taking its NIC down would cut it off); one reads
this machine's real /proc and /sys."""

from __future__ import annotations

from pathlib import Path

from tracehound.agent.sources.host import HostHealthSource
from tracehound.analysis.hardware import HealthKind, health_kind
from tracehound.tracing.events import HealthSample, HealthSeverity

T0 = 1_800_000_000_000_000


def write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def tree(tmp_path: Path) -> tuple[Path, Path]:
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    write(sys_root, "class/net/lo/operstate", "unknown\n")
    for nic in ("eth0", "ib0"):
        write(sys_root, f"class/net/{nic}/operstate", "up\n")
        write(sys_root, f"class/net/{nic}/carrier", "1\n")
        write(sys_root, f"class/net/{nic}/carrier_changes", "2\n")
        write(sys_root, f"class/net/{nic}/statistics/rx_errors", "0\n")
        write(sys_root, f"class/net/{nic}/statistics/tx_errors", "0\n")
    port = "class/infiniband/mlx5_0/ports/1"
    write(sys_root, f"{port}/state", "4: ACTIVE\n")
    for counter in ("symbol_error", "link_downed", "port_rcv_errors", "link_error_recovery"):
        write(sys_root, f"{port}/counters/{counter}", "0\n")
    write(proc, "meminfo", "MemTotal:       1000000 kB\nMemFree: 1 kB\n"
                           "MemAvailable:    400000 kB\n")
    write(proc, "pressure/memory", "some avg10=1.50 avg60=0.00 avg300=0.00 total=1\n"
                                   "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    write(proc, "loadavg", "3.25 2.00 1.00 2/300 4242\n")
    return sys_root, proc


def alarms(samples: list[object]) -> list[tuple[str, str, float, HealthSeverity]]:
    out = []
    for s in samples:
        assert isinstance(s, HealthSample)
        if s.severity is not HealthSeverity.INFO:
            out.append((s.device, s.metric, s.value, s.severity))
    return out


def test_readings_then_link_down_flaps_and_errors(tmp_path: Path) -> None:
    sys_root, proc = tree(tmp_path)
    src = HostHealthSource(job="j", node="n1", sys_root=str(sys_root), proc_root=str(proc),
                           disk_paths=[str(tmp_path)])
    first = src.poll(T0)
    assert alarms(first) == []
    values = {s.metric: s.value for s in first if isinstance(s, HealthSample)}
    assert values["mem_available_pct"] == 40.0
    assert values["memory_pressure_pct"] == 1.5
    assert values["load1"] == 3.25
    assert 0 < values["disk_free_pct"] <= 100
    assert all(isinstance(s, HealthSample) and s.device != "lo" for s in first)

    write(sys_root, "class/net/eth0/operstate", "down\n")
    write(sys_root, "class/net/eth0/carrier_changes", "3\n")
    write(sys_root, "class/net/ib0/statistics/rx_errors", "5\n")
    write(sys_root, "class/infiniband/mlx5_0/ports/1/counters/symbol_error", "7\n")
    second = src.poll(T0 + 10_000_000)
    assert alarms(second) == [
        ("eth0", "nic_link_down", 1.0, HealthSeverity.CRITICAL),
        ("eth0", "link_flaps", 1.0, HealthSeverity.WARNING),
        ("ib0", "nic_errors", 5.0, HealthSeverity.WARNING),
        ("mlx5_0/1", "ib_symbol_errors", 7.0, HealthSeverity.WARNING),
    ]
    kinds = {s.metric: health_kind(s) for s in second
             if isinstance(s, HealthSample) and s.severity is not HealthSeverity.INFO}
    assert kinds["nic_link_down"] is HealthKind.NETWORK_DOWN
    assert kinds["nic_errors"] is HealthKind.NETWORK
    # a link that stays down is reported when it went down, not at every poll
    assert alarms(src.poll(T0 + 20_000_000)) == []

    write(sys_root, "class/infiniband/mlx5_0/ports/1/state", "1: DOWN\n")
    third = alarms(src.poll(T0 + 30_000_000))
    assert third == [("mlx5_0/1", "ib_link_down", 1.0, HealthSeverity.CRITICAL)]


def test_a_link_down_from_the_start_is_no_alarm(tmp_path: Path) -> None:
    sys_root, proc = tree(tmp_path)
    write(sys_root, "class/net/eth1/operstate", "down\n")
    src = HostHealthSource(job="j", node="n1", sys_root=str(sys_root), proc_root=str(proc))
    assert alarms(src.poll(T0)) == []
    assert alarms(src.poll(T0 + 1)) == []


def test_missing_sources_are_reported_once(tmp_path: Path) -> None:
    sys_root, proc = tmp_path / "sys", tmp_path / "proc"
    write(sys_root, "class/net/eth0/operstate", "up\n")
    src = HostHealthSource(job="j", node="n1", sys_root=str(sys_root), proc_root=str(proc),
                           disk_paths=[str(tmp_path / "no-such-dir")])
    first = [s for s in src.poll(T0) if isinstance(s, HealthSample)]
    missing = sorted(s.detail.split(":")[0] for s in first if s.metric == "source_missing")
    assert missing == ["disk " + str(tmp_path / "no-such-dir"), "infiniband", "loadavg",
                       "meminfo", "memory pressure"]
    assert all(s.severity is HealthSeverity.INFO for s in first)
    for t in range(1, 4):
        again = [s for s in src.poll(T0 + t) if isinstance(s, HealthSample)]
        assert not [s for s in again if s.metric == "source_missing"]
    assert len(src.stats.missing) == 5


def test_disk_space_severity(tmp_path: Path) -> None:
    src = HostHealthSource(job="j", node="n1", sys_root=str(tmp_path), proc_root=str(tmp_path),
                           disk_paths=[str(tmp_path)])
    disk = [s for s in src.poll(T0) if isinstance(s, HealthSample)
            and s.metric == "disk_free_pct"]
    assert len(disk) == 1 and str(tmp_path) in disk[0].detail and "GiB free" in disk[0].detail
    expected = (HealthSeverity.CRITICAL if disk[0].value < 2 else HealthSeverity.WARNING
                if disk[0].value < 10 else HealthSeverity.INFO)
    assert disk[0].severity is expected


def test_this_machine(tmp_path: Path) -> None:
    src = HostHealthSource(job="j", node="n1", disk_paths=[str(tmp_path)])
    samples = [s for s in src.poll(T0) if isinstance(s, HealthSample)]
    metrics = {s.metric for s in samples}
    assert {"mem_available_pct", "load1", "disk_free_pct"} <= metrics
    assert all(s.job == "j" and s.node == "n1" and s.time_us == T0 for s in samples)
