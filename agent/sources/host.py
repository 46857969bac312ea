"""Host health of a node: NIC links, InfiniBand ports, disk space, memory pressure and load.

`HostHealthSource` is a `Source` (agent.sources) that reads Linux's own files each poll:

    what             read from                                    samples
    NIC links        /sys/class/net/<if>/operstate, carrier,      nic_link_down CRITICAL when a
                     carrier_changes, statistics/{rx,tx}_errors   link that was up goes down
                                                                  (a link down from the start is
                                                                  INFO: an unused port);
                                                                  link_flaps WARNING when
                                                                  carrier_changes grows;
                                                                  nic_errors WARNING when the
                                                                  error counters grow
    InfiniBand       /sys/class/infiniband/<dev>/ports/<p>/state, ib_link_down CRITICAL when an
                     counters/{symbol_error,link_downed,          ACTIVE port leaves ACTIVE or
                     port_rcv_errors,link_error_recovery}         link_downed grows; ib_errors /
                                                                  ib_symbol_errors WARNING when
                                                                  their counters grow
    disk space       statvfs of the checkpoint and spool paths    disk_free_pct INFO, WARNING
                                                                  below 10%, CRITICAL below 2%
    memory           /proc/meminfo MemAvailable, /proc/pressure/  mem_available_pct INFO
                     memory (PSI "some avg10")                    (WARNING below 5%),
                                                                  memory_pressure_pct INFO
                                                                  (WARNING at 20% or more)
    load             /proc/loadavg                                load1 INFO

Counters are reported as their increase since the previous poll; the first poll sets the
baseline. A source that is missing on this machine (no InfiniBand, no PSI, a path that does not
exist) is reported once, as one INFO sample `source_missing` with the reason and one log line,
and not read again. Loopback is skipped. The roots (`/sys`, `/proc`) are parameters so tests
read files of their own.

This runs in the node agent; it only reads files and never writes any.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tracehound.tracing.events import HealthSample, HealthSeverity, Record
from tracehound.tracing.ids import JobId, NodeId

log = logging.getLogger(__name__)

DISK_WARNING_PCT = 10.0
DISK_CRITICAL_PCT = 2.0
MEM_WARNING_PCT = 5.0
PRESSURE_WARNING_PCT = 20.0
_IB_COUNTERS = (
    ("symbol_error", "ib_symbol_errors"), ("port_rcv_errors", "ib_errors"),
    ("link_error_recovery", "ib_errors"),
)


@dataclass
class HostStats:
    samples: int = 0
    missing: list[str] = field(default_factory=list)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


class HostHealthSource:
    """A `Source` of the host's health samples (see the module docstring)."""

    def __init__(
        self,
        *,
        job: str,
        node: str,
        interval_s: float = 10.0,
        disk_paths: Sequence[str] = (),
        sys_root: str = "/sys",
        proc_root: str = "/proc",
    ) -> None:
        self.name = "host"
        self.job = JobId(job)
        self.node = NodeId(node)
        self.interval_s = interval_s
        self.disk_paths = list(dict.fromkeys(disk_paths))
        self.sys = Path(sys_root)
        self.proc = Path(proc_root)
        self.stats = HostStats()
        self._missing: set[str] = set()
        self._counters: dict[tuple[str, str], int] = {}
        self._states: dict[str, bool] = {}

    def close(self) -> None:
        return None

    def poll(self, now_us: int) -> list[Record]:
        out: list[Record] = []
        for reader in (self._nics, self._infiniband, self._disks, self._memory, self._load):
            out.extend(reader(now_us))
        self.stats.samples += len(out)
        return out

    # -- helpers --------------------------------------------------------------------------------

    def _sample(self, device: str, time_us: int, metric: str, value: float, *,
                severity: HealthSeverity = HealthSeverity.INFO, detail: str = "",
                source: str = "host") -> HealthSample:
        return HealthSample(job=self.job, node=self.node, device=device, time_us=time_us,
                            source=source, metric=metric, value=value, severity=severity,
                            detail=detail)

    def _gone(self, what: str, reason: str, now_us: int) -> Iterator[HealthSample]:
        """The one report of a missing source; nothing on later polls."""
        if what in self._missing:
            return
        self._missing.add(what)
        self.stats.missing.append(what)
        log.info("host health: no %s on node %s: %s (reported once)", what, self.node, reason)
        yield self._sample("host", now_us, "source_missing", 1.0, detail=f"{what}: {reason}")

    def _grew(self, key: tuple[str, str], value: int | None) -> int:
        """How much counter `key` grew since the previous poll (0 the first time)."""
        if value is None:
            return 0
        old = self._counters.get(key)
        self._counters[key] = value
        return value - old if old is not None and value > old else 0

    def _went_down(self, key: str, up: bool) -> bool:
        was = self._states.get(key)
        self._states[key] = up
        return bool(was) and not up

    # -- readers --------------------------------------------------------------------------------

    def _nics(self, now_us: int) -> Iterator[HealthSample]:
        if "nics" in self._missing:
            return
        root = self.sys / "class" / "net"
        try:
            names = sorted(p.name for p in root.iterdir())
        except OSError as exc:
            yield from self._gone("nics", f"{root} unreadable ({exc.strerror})", now_us)
            return
        crit, warn = HealthSeverity.CRITICAL, HealthSeverity.WARNING
        for name in names:
            if name == "lo":
                continue
            base = root / name
            state = _read(base / "operstate") or "unknown"
            carrier = _int(base / "carrier")
            up = state == "up" or (state == "unknown" and carrier == 1)
            if self._went_down(f"net:{name}", up):
                yield self._sample(name, now_us, "nic_link_down", 1.0, severity=crit,
                                   source="nic", detail=f"{name} went {state}")
            flaps = self._grew((name, "carrier_changes"), _int(base / "carrier_changes"))
            if flaps:
                yield self._sample(name, now_us, "link_flaps", float(flaps), severity=warn,
                                   source="nic", detail=f"{name}: carrier changed {flaps} times")
            errors = sum(self._grew((name, c), _int(base / "statistics" / c))
                         for c in ("rx_errors", "tx_errors"))
            if errors:
                yield self._sample(name, now_us, "nic_errors", float(errors), severity=warn,
                                   source="nic", detail=f"{name}: {errors} new rx/tx errors")

    def _infiniband(self, now_us: int) -> Iterator[HealthSample]:
        if "infiniband" in self._missing:
            return
        root = self.sys / "class" / "infiniband"
        if not root.is_dir():
            yield from self._gone("infiniband", f"{root} not present", now_us)
            return
        crit, warn = HealthSeverity.CRITICAL, HealthSeverity.WARNING
        for port in sorted(root.glob("*/ports/*")):
            device = f"{port.parent.parent.name}/{port.name}"
            state = _read(port / "state") or ""
            active = "ACTIVE" in state.upper()
            downed = self._grew((device, "link_downed"), _int(port / "counters" / "link_downed"))
            if self._went_down(f"ib:{device}", active) or downed:
                yield self._sample(device, now_us, "ib_link_down", 1.0, severity=crit,
                                   source="infiniband",
                                   detail=f"{device}: {state or 'no state'}"
                                          + (f", link_downed +{downed}" if downed else ""))
            for counter, metric in _IB_COUNTERS:
                grew = self._grew((device, counter), _int(port / "counters" / counter))
                if grew:
                    yield self._sample(device, now_us, metric, float(grew), severity=warn,
                                       source="infiniband", detail=f"{device}: {counter} +{grew}")

    def _disks(self, now_us: int) -> Iterator[HealthSample]:
        for path in self.disk_paths:
            what = f"disk {path}"
            if what in self._missing:
                continue
            try:
                st = os.statvfs(path)
            except OSError as exc:
                yield from self._gone(what, exc.strerror or str(exc), now_us)
                continue
            if not st.f_blocks:
                continue
            free = 100.0 * st.f_bavail / st.f_blocks
            severity = (HealthSeverity.CRITICAL if free < DISK_CRITICAL_PCT
                        else HealthSeverity.WARNING if free < DISK_WARNING_PCT
                        else HealthSeverity.INFO)
            yield self._sample("host", now_us, "disk_free_pct", round(free, 2),
                               severity=severity,
                               detail=f"{path}: {st.f_bavail * st.f_frsize / 2**30:.1f} GiB free")

    def _memory(self, now_us: int) -> Iterator[HealthSample]:
        if "meminfo" not in self._missing:
            info = _read(self.proc / "meminfo")
            fields: dict[str, int] = {}
            for line in (info or "").splitlines():
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    fields[key] = int(parts[0])
            total, available = fields.get("MemTotal"), fields.get("MemAvailable")
            if not total or available is None:
                yield from self._gone("meminfo", f"{self.proc / 'meminfo'} has no "
                                      "MemTotal/MemAvailable", now_us)
            else:
                pct = 100.0 * available / total
                yield self._sample("host", now_us, "mem_available_pct", round(pct, 2),
                                   severity=HealthSeverity.WARNING if pct < MEM_WARNING_PCT
                                   else HealthSeverity.INFO)
        if "memory pressure" not in self._missing:
            psi = _read(self.proc / "pressure" / "memory")
            some = None
            for line in (psi or "").splitlines():
                if line.startswith("some "):
                    for part in line.split()[1:]:
                        key, _, value = part.partition("=")
                        if key == "avg10":
                            try:
                                some = float(value)
                            except ValueError:
                                some = None
            if some is None:
                yield from self._gone("memory pressure",
                                      f"{self.proc / 'pressure' / 'memory'} not readable (PSI off)",
                                      now_us)
            else:
                yield self._sample("host", now_us, "memory_pressure_pct", some,
                                   severity=HealthSeverity.WARNING
                                   if some >= PRESSURE_WARNING_PCT else HealthSeverity.INFO)

    def _load(self, now_us: int) -> Iterator[HealthSample]:
        if "loadavg" in self._missing:
            return
        text = _read(self.proc / "loadavg")
        try:
            load1 = float((text or "").split()[0])
        except (ValueError, IndexError):
            yield from self._gone("loadavg", f"{self.proc / 'loadavg'} not readable", now_us)
            return
        yield self._sample("host", now_us, "load1", load1)
