"""The node agent: receives records from the ranks of one node and ships them to the trace store.

    tracehound agent [--job J] [--node N] [--socket PATH] [--spool DIR] [--sink URL] [...]
    python -m tracehound.agent.node ...        (the same, as a module)

Ranks connect to the unix socket at PATH and write newline-delimited JSON records
(`tracing.wire`); after each read the agent tells the rank how many lines it has taken (and
spooled), so a rank writes again what an agent killed before taking it never had
(`agent.transport`). Each line is decoded and validated here, once; bad lines are counted and
logged with the reason, never fatal. Good lines are spooled as they came and shipped undecoded.
Good records go to the durable spool in DIR (`agent.spool`; default $TRACEHOUND_SPOOL_DIR), and
a shipper thread sends sealed segments to the sink URL (default $TRACEHOUND_SINK):
`clickhouse://...` writes straight into the ClickHouse server, `http://host:port` posts to the
ingest endpoint of the process that owns an embedded store. The agent also watches the ranks'
processes from outside (`agent.procwatch`): a `/proc` sample of each rank every --proc-interval
seconds (1; 0: off), and a py-spy stack of a rank stuck for --stack-after seconds (2; 0: off),
repeated every --stack-repeat seconds (30) while it stays stuck; with --launch-file, the ranks
its launcher started are watched from their launch, before (or without) their first heartbeat;
and it polls the node's health
sources (`agent.sources`): GPUs through NVML or simulated ones (`agent.gpu`, --gpu) and the host
(`agent.host`: NIC and InfiniBand links, disk space, memory pressure, load) every
--health-interval seconds (10; 0: off), and NCCL's own views where asked (`agent.nccl`: RAS
status, --nccl-ras; Inspector's collective logs, --nccl-inspector-dir). These records go to the
spool like the ranks' own. The spool seals a batch every --seal-interval seconds (1: one insert a
second, what ClickHouse wants), or --urgent-interval seconds (0.2) after an urgent record (`urgent`:
a rank's exit, a failed collective, a call pending for a second, a stack, a health warning), so
what the controller's detectors wait for still reaches the store within a fraction of a second.
With OTEL_EXPORTER_OTLP_ENDPOINT set, the agent's own counters go out
over OTLP (`agent.telemetry`), and with TRACEHOUND_OTEL_SPANS_EVERY=N as well, every Nth
collective of each group as spans. SIGTERM/SIGINT: stop accepting, ship what is left for at most
--drain-s seconds (10), exit 0; whatever could not be shipped stays in DIR for the next agent
started on it.

Every option has a TRACEHOUND_* variable (tracing.settings), so a Kubernetes sidecar, a DaemonSet
or a line in an srun/Ray script starts it with no arguments beyond the job's environment.

The agent must never crash on what a rank sends, and never lose a record it accepted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import FrameType
from typing import Any

from tracehound.agent.node.procwatch import Emit, ProcWatcher, PySpy, WatchStats, find_py_spy
from tracehound.agent.node.spool import (
    BatchSink,
    ClockTracker,
    HttpSink,
    Shipper,
    Spool,
    StoreSink,
)
from tracehound.agent.node.telemetry import CollectiveSpans, start_spans, start_telemetry
from tracehound.agent.sources import Source, SourcePoller
from tracehound.agent.sources.gpu import GpuHealthSource, NvmlUnavailable, open_backend
from tracehound.agent.sources.host import HostHealthSource
from tracehound.agent.sources.nccl import (
    NCCL_INSPECTOR_DUMP_DIR,
    LocalRanks,
    NcclInspectorSource,
    NcclRasSource,
)
from tracehound.tracing import logs
from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.events import (
    CollectiveEvent,
    CollectiveState,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    ProcessSample,
    ProcessState,
    RankExit,
    Record,
    StackSample,
)
from tracehound.tracing.settings import (
    DEFAULT_GPU,
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_NCCL_RAS,
    DEFAULT_SHIP_MAX_BACKOFF_S,
    DEFAULT_SIM_GPUS,
    GPU_BACKENDS,
    NCCL_RAS_MODES,
    TRACEHOUND_AGENT_SOCKET,
    TRACEHOUND_CHECKPOINT_DIR,
    TRACEHOUND_GPU,
    TRACEHOUND_HEALTH_INTERVAL_S,
    TRACEHOUND_JOB_ID,
    TRACEHOUND_NCCL_INSPECTOR_DIR,
    TRACEHOUND_NCCL_RAS,
    TRACEHOUND_NODE_ID,
    TRACEHOUND_SHIP_MAX_BACKOFF_S,
    TRACEHOUND_SIM_GPU_FAULTS,
    TRACEHOUND_SIM_GPUS,
    TRACEHOUND_SINK,
    TRACEHOUND_SPOOL_DIR,
    TRACEHOUND_STORE,
    SettingError,
    env_choice,
    env_float,
    env_int,
    env_str,
)
from tracehound.tracing.wire import InvalidRecord, decode_line, encode_line

log = logging.getLogger(__name__)

_MAX_LINE = 1 << 20
"""Longest line accepted from a rank; longer ones are rejected (and the connection resynced)."""


def make_sink(url: str) -> BatchSink:
    """The sink a URL names: clickhouse:// (a store) or http(s):// (an ingest endpoint)."""
    if url.startswith(("http://", "https://")):
        return HttpSink(url)
    if url.startswith("clickhouse://"):
        from tracehound.tracing.store import open_store, parse_server_url

        parse_server_url(url)  # a malformed URL fails now, not in the shipper thread
        return StoreSink(factory=lambda: open_store(url))
    from tracehound.tracing.store.urls import mask_url

    raise StoreConfigError(
        f"sink URL {mask_url(url)!r}: expected clickhouse://user:pass@host:9000/db or "
        "http://host:port"
    )


URGENT_PENDING_US = 1_000_000
"""A heartbeat whose rank has been in one call this long is urgent (the recorder's own in-flight
threshold, `DEFAULT_INFLIGHT_S`, after which it beats every 100 ms)."""

_QUIET_STATES = frozenset({ProcessState.RUNNING, ProcessState.SLEEPING, ProcessState.DISK_WAIT})


def urgent(record: Record) -> bool:
    """Whether the store should have `record` soon: it is, or may be, the start of an incident (a
    rank's exit, a failed collective, a call pending for `URGENT_PENDING_US`, a stack, a stopped
    or vanished process, a health warning). The rest (completed collectives, steady heartbeats,
    metrics) waits for the next one-second batch."""
    if isinstance(record, CollectiveEvent):
        return record.state is CollectiveState.FAILED
    if isinstance(record, Heartbeat):
        now = record.time_us
        return any(g.pending_op and now - g.last_enqueue_us >= URGENT_PENDING_US
                   for g in record.groups)
    if isinstance(record, ProcessSample):
        return record.state not in _QUIET_STATES
    if isinstance(record, HealthSample):
        return record.severity is not HealthSeverity.INFO
    return isinstance(record, RankExit | StackSample)


def _acknowledge(conn: socket.socket, lines: int) -> None:
    """Tell a rank's transport how many lines this agent has taken from its connection
    (`agent.transport`); never blocks: an acknowledgement the socket cannot take now is skipped
    (the next one covers it), one to a peer that is gone is dropped."""
    with contextlib.suppress(OSError):
        # os.write: the socket's own send would wait out its timeout for room
        os.write(conn.fileno(), b"%d\n" % lines)


def spool_writer(spool: Spool) -> Emit:
    """Appends records the agent makes itself to `spool`, in the ranks' wire form (compact JSON)."""

    def write(records: Sequence[Record]) -> None:
        spool.append([encode_line(r) for r in records], urgent=any(map(urgent, records)))

    return write


class NodeAgent:
    """The socket server, the spool and the shipper of one node."""

    def __init__(
        self,
        *,
        job: str,
        node: str,
        socket_path: str,
        spool: Spool,
        sink: BatchSink,
        stats_file: str | None = None,
        stats_interval_s: float = 10.0,
        watcher: ProcWatcher | None = None,
        sources: SourcePoller | None = None,
        heartbeat_observers: Sequence[Callable[[Heartbeat], None]] = (),
        spans: CollectiveSpans | None = None,
        retry_max_s: float = DEFAULT_SHIP_MAX_BACKOFF_S,
    ) -> None:
        """`watcher` (optional) is told every heartbeat, and started and stopped with the agent;
        `sources` (optional) polls the node's health, NCCL and other sources while the agent
        runs. Give both `spool_writer(spool)` as their emit so their records ship with the
        ranks'. `heartbeat_observers` are told every heartbeat too (an observer that raises is
        logged, never fatal). `spans` (optional) is handed every collective received, to export
        the sampled ones as OpenTelemetry spans. `retry_max_s` is the longest wait between tries
        of a sink that cannot be reached."""
        self.job = job
        self.node = node
        self.socket_path = socket_path
        self.spool = spool
        if isinstance(sink, HttpSink) and sink.on_clock is None:
            # each shipment measures this node's clock against the collector's
            sink.on_clock = ClockTracker(job=job, node=node, emit=spool.append)
        self.shipper = Shipper(spool, sink, max_backoff_s=retry_max_s)
        self.stats_file = stats_file
        self.stats_interval_s = stats_interval_s
        self.watcher = watcher
        self.sources = sources
        self._observers = ([watcher.observe] if watcher is not None else []) + list(
            heartbeat_observers)
        """Told every heartbeat, the process watcher first."""
        self.spans = spans
        self._dropped: dict[tuple[str, int, int], int] = {}
        """The latest `dropped` count each rank's heartbeats reported (records it could not
        hand to this agent)."""
        self.log = logs.JobLogger(log, job=job, node=node)
        self._server: socket.socket | None = None
        self._closing = threading.Event()
        self._stop_shipper = threading.Event()
        self._threads: list[threading.Thread] = []
        self._connections: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.connections = 0

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        path = Path(self.socket_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(self.socket_path)
        # ranks in other containers of a Kubernetes pod run as other users: they share the
        # agent's group there (the pod's fsGroup), so the group may connect, nobody else
        os.chmod(self.socket_path, 0o660)
        server.listen(128)
        server.settimeout(0.2)
        self._server = server
        for target, name in (
            (self._accept_loop, "accept"),
            (lambda: self.shipper.run(self._stop_shipper), "shipper"),
            (self._stats_loop, "stats"),
        ):
            thread = threading.Thread(target=target, name=f"tracehound-node-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.watcher is not None:
            self.watcher.start()
        if self.sources is not None:
            self.sources.start()
        self.log.info("listening on %s, spool %s (id %s), %d segments pending",
                      self.socket_path, self.spool.directory, self.spool.spool_id,
                      len(self.spool.sealed()))

    def stop(self, drain_s: float = 10.0) -> bool:
        """Stop accepting, read what connected ranks already sent, ship what is left within
        `drain_s` seconds. True when the spool is empty."""
        self._closing.set()
        server, self._server = self._server, None
        if server is not None:
            server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        if self.watcher is not None:
            if not self.watcher.stop(timeout_s=1.0):
                self.log.warning("the process watcher did not stop within 1s")
            self.watcher.last_look()  # ranks that ended since its last round: reported gone
        if self.sources is not None and not self.sources.stop(timeout_s=2.0):
            self.log.warning("the source poller did not stop within 2s")
        deadline = time.monotonic() + drain_s
        for thread in list(self._connections):
            thread.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        self._stop_shipper.set()
        for thread in self._threads:
            thread.join(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        empty = self.shipper.drain(max(0.0, deadline - time.monotonic()))
        self.write_stats()
        self.log_stats()
        if not empty:
            self.log.warning("%d segments left in %s for the next agent",
                             len(self.spool.sealed()), self.spool.directory)
        return empty

    # -- receiving ------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            server = self._server
            if server is None:
                return
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)
                continue
            self.connections += 1
            _acknowledge(conn, 0)  # tells the rank's transport that this agent acknowledges
            thread = threading.Thread(
                target=self._serve, args=(conn,), name="tracehound-node-conn", daemon=True
            )
            thread.start()
            with self._lock:
                self._connections = [t for t in self._connections if t.is_alive()]
                self._connections.append(thread)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        buffer = b""
        quiet_since_close = False
        taken = 0
        """Lines taken from this connection and spooled (or counted as rejected or dropped):
        acknowledged to the rank's transport after each read."""
        try:
            while True:
                try:
                    chunk = conn.recv(1 << 16)
                except TimeoutError:
                    if self._closing.is_set():
                        if quiet_since_close:
                            break
                        quiet_since_close = True
                    continue
                if not chunk:
                    break
                quiet_since_close = False
                buffer += chunk
                if b"\n" not in buffer:
                    if len(buffer) > _MAX_LINE:
                        self._reject(f"line longer than {_MAX_LINE} bytes")
                        buffer = b""
                    continue
                *lines, buffer = buffer.split(b"\n")
                self.receive(lines)
                taken += len(lines)
                _acknowledge(conn, taken)
            if buffer.strip():
                self.receive([buffer])
        except OSError as exc:
            self.log.debug("rank connection lost: %r", exc)
        except Exception as exc:
            self.log.exception("rank connection handler failed: %r", exc)
        finally:
            conn.close()

    def receive(self, lines: list[bytes]) -> None:
        """Validate lines from a rank and spool the good ones."""
        good: list[bytes] = []
        beats: list[Heartbeat] = []
        spans = self.spans
        collectives: list[CollectiveEvent] = []
        hurry = False
        for raw in lines:
            line = raw.strip()
            if not line:
                continue
            try:
                record = decode_line(line)
            except InvalidRecord as exc:
                self._reject(str(exc), line)
                continue
            good.append(line)
            hurry = hurry or urgent(record)
            if isinstance(record, Heartbeat):
                beats.append(record)
                self._dropped[(record.job, record.attempt, record.rank)] = record.dropped
            elif spans is not None and isinstance(record, CollectiveEvent):
                collectives.append(record)
        if good:
            self.spool.stats.received += len(good)
            self.spool.append(good, urgent=hurry)
        if spans is not None:
            for event in collectives:
                spans.observe(event)
        for beat in beats:
            for observe in self._observers:
                try:
                    observe(beat)
                except Exception as exc:
                    self.log.exception("a heartbeat observer failed: %r", exc)

    def _reject(self, reason: str, line: bytes = b"") -> None:
        self.spool.stats.rejected += 1
        count = self.spool.stats.rejected
        if count <= 20 or count % 1000 == 0:
            self.log.warning("rejected record #%d from a rank: %s: %r", count, reason, line[:200])

    # -- stats ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        values = asdict(self.spool.stats)
        values["pending_segments"] = len(self.spool.sealed())
        values["connections"] = self.connections
        values["dropped"] = sum(self._dropped.values())
        values.update(asdict(self.watcher.stats if self.watcher is not None else WatchStats()))
        if self.sources is not None:
            values.update(self.sources.flat_stats())
        if self.spans is not None:
            values["spans_exported"] = self.spans.exported
            values["spans_dropped"] = self.spans.dropped
        return values

    def log_stats(self) -> None:
        s = self.stats()
        self.log.info(
            "received %d, spooled %d, shipped %d, rejected %d, pending segments %d, retries %d, "
            "spool write errors %d (%d records dropped), process samples %d, stacks %d "
            "(%d failed)",
            s["received"], s["spooled"], s["shipped"], s["rejected"], s["pending_segments"],
            s["retries"], s["spool_write_errors"], s["spool_dropped"], s["process_samples"],
            s["stacks_captured"], s["stacks_failed"],
        )

    def write_stats(self) -> None:
        if not self.stats_file:
            return
        try:
            tmp = f"{self.stats_file}.tmp"
            with open(tmp, "w") as handle:
                json.dump(self.stats(), handle)
            os.replace(tmp, self.stats_file)
        except OSError as exc:
            self.log.warning("could not write stats file %s: %r", self.stats_file, exc)

    def _stats_loop(self) -> None:
        last_log = time.monotonic()
        while not self._stop_shipper.wait(min(1.0, self.stats_interval_s)):
            self.write_stats()
            if time.monotonic() - last_log >= self.stats_interval_s:
                last_log = time.monotonic()
                self.log_stats()


EPILOG = """\
examples:
  # a Kubernetes sidecar or an srun step: everything from the environment
  TRACEHOUND_JOB_ID=exp7 TRACEHOUND_SINK=clickhouse://default:@ch:9000/tracehound tracehound agent
  # simulated GPUs with a fault file, health every 2 s
  tracehound agent --job exp7 --sink http://10.0.0.5:8123 --gpu sim --health-interval 2 \\
      --sim-gpu-faults /tmp/faults.jsonl
"""


def add_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """The agent's options on `parser` (shared by this module's command and `tracehound agent`).
    Defaults come from the TRACEHOUND_* variables of `env` (default: the process environment);
    `check_args` then fills in the derived ones and rejects what cannot work."""
    job = env_str(TRACEHOUND_JOB_ID, env=env) or env_str("TORCHELASTIC_RUN_ID", env=env)
    parser.add_argument("--job", default=job or None,
                        help=f"job id every record is tagged with (default: ${TRACEHOUND_JOB_ID}, "
                             "else torchrun's run id)")
    parser.add_argument("--node", default=env_str(TRACEHOUND_NODE_ID, socket.gethostname(),
                                                  env=env),
                        help=f"this node's name (default: ${TRACEHOUND_NODE_ID}, else the host "
                             "name)")
    parser.add_argument("--socket", default=env_str(TRACEHOUND_AGENT_SOCKET, env=env) or None,
                        help="unix socket the ranks connect to (default: "
                             f"${TRACEHOUND_AGENT_SOCKET}, else /tmp/tracehound-JOB-NODE.sock)")
    parser.add_argument("--spool", default=env_str(TRACEHOUND_SPOOL_DIR, env=env),
                        help="durable spool directory (default: "
                             f"${TRACEHOUND_SPOOL_DIR}, else .tracehound/spool/JOB/NODE)")
    parser.add_argument("--sink", default=env_str(TRACEHOUND_SINK, env=env),
                        help="where batches go: clickhouse://... or http://host:port (default: "
                             f"${TRACEHOUND_SINK}, else ${TRACEHOUND_STORE} when it is a "
                             "clickhouse:// URL)")
    parser.add_argument("--retry-max", type=_seconds, metavar="S",
                        default=env_float(TRACEHOUND_SHIP_MAX_BACKOFF_S,
                                          DEFAULT_SHIP_MAX_BACKOFF_S, env=env, minimum=0.1),
                        help="longest wait between tries of a sink that cannot be reached; the "
                             "waits start at 0.2 s and double up to it (default: "
                             f"${TRACEHOUND_SHIP_MAX_BACKOFF_S}, else "
                             f"{DEFAULT_SHIP_MAX_BACKOFF_S:g})")
    parser.add_argument("--stats-file", default=None, help="JSON stats, rewritten every second")
    parser.add_argument("--stats-interval", type=float, default=10.0, help="seconds between logs")
    parser.add_argument("--drain-s", type=float, default=10.0, help="shipping budget at stop")
    parser.add_argument("--seal-interval", type=_seconds, default=1.0, metavar="S",
                        help="seconds between batches to the store (default 1: one insert a "
                             "second)")
    parser.add_argument("--urgent-interval", type=_seconds, default=0.2, metavar="S",
                        help="seconds before a batch holding an urgent record is shipped (a "
                             "rank's exit, a failed or long-pending collective, a stack, a "
                             "health warning; default 0.2)")
    parser.add_argument("--seal-records", type=int, default=5000)
    parser.add_argument("--proc-interval", type=_seconds, default=1.0,
                        help="seconds between /proc samples of each rank (0: off)")
    parser.add_argument("--stack-after", type=_seconds, default=2.0,
                        help="capture a rank's stack once it is stuck this long (0: off)")
    parser.add_argument("--stack-repeat", type=_seconds, default=30.0,
                        help="capture again every this many seconds while it stays stuck")
    parser.add_argument("--py-spy", default=None, metavar="PATH",
                        help="py-spy binary (default: on PATH, else beside this Python)")
    parser.add_argument("--launch-file", default=None, metavar="FILE",
                        help="JSON in which the launcher notes the ranks it started (job, "
                             "attempt, ranks: rank, pid, node), as `tracehound run` writes "
                             "in WORKDIR/JOB/attempts: this node's ranks are watched from "
                             "their launch, also one whose recorder never reports")
    health = parser.add_argument_group("health sources")
    health.add_argument("--gpu", default=None, choices=GPU_BACKENDS,
                        help=f"GPU health backend (default: ${TRACEHOUND_GPU}, else "
                             f"{DEFAULT_GPU}: NVML when it works); sim = simulated GPUs")
    health.add_argument("--health-interval", type=_seconds, default=None, metavar="S",
                        help="seconds between GPU and host health samples, 0: off (default: "
                             f"${TRACEHOUND_HEALTH_INTERVAL_S}, else "
                             f"{DEFAULT_HEALTH_INTERVAL_S:g})")
    health.add_argument("--sim-gpus", type=int, default=None, metavar="N",
                        help=f"simulated GPUs per node with --gpu sim (default: "
                             f"${TRACEHOUND_SIM_GPUS}, else {DEFAULT_SIM_GPUS})")
    health.add_argument("--sim-gpu-faults", default=None, metavar="FILE",
                        help="JSON lines of faults the simulated GPUs inject as the file grows "
                             f"(default: ${TRACEHOUND_SIM_GPU_FAULTS})")
    health.add_argument("--nccl-ras", default=None, choices=NCCL_RAS_MODES,
                        help=f"poll NCCL RAS on NCCL_RAS_ADDR (default: ${TRACEHOUND_NCCL_RAS}, "
                             "else auto: when the GPUs are read through NVML)")
    health.add_argument("--nccl-inspector-dir", default=None, metavar="DIR",
                        help="tail NCCL Inspector's JSON lines in DIR (default: "
                             f"${TRACEHOUND_NCCL_INSPECTOR_DIR}, else NCCL_INSPECTOR_DUMP_DIR)")
    health.add_argument("--disk-path", action="append", default=None, metavar="PATH",
                        help="report free space of PATH (repeatable; default: the spool and "
                             f"${TRACEHOUND_CHECKPOINT_DIR})")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
               env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """Fill the derived defaults of `args` and reject what cannot work (parser.error, naming the
    option or variable)."""
    if not args.job:
        parser.error(f"--job is required unless {TRACEHOUND_JOB_ID} (or torchrun's "
                     "TORCHELASTIC_RUN_ID) is set")
    if not args.socket:
        args.socket = f"/tmp/tracehound-{args.job}-{args.node}.sock"
    if not args.spool:
        args.spool = str(Path(".tracehound") / "spool" / args.job / args.node)
    if not args.sink:
        store = env_str(TRACEHOUND_STORE, env=env)
        if store.startswith("clickhouse://"):
            args.sink = store
        else:
            parser.error(f"--sink is required unless {TRACEHOUND_SINK} is set (or "
                         f"{TRACEHOUND_STORE} names a clickhouse:// server)")
    try:
        if args.gpu is None:
            args.gpu = env_choice(TRACEHOUND_GPU, DEFAULT_GPU, GPU_BACKENDS, env=env)
        if args.health_interval is None:
            args.health_interval = env_float(TRACEHOUND_HEALTH_INTERVAL_S,
                                             DEFAULT_HEALTH_INTERVAL_S, env=env)
        if args.sim_gpus is None:
            args.sim_gpus = env_int(TRACEHOUND_SIM_GPUS, DEFAULT_SIM_GPUS, env=env)
        if args.nccl_ras is None:
            args.nccl_ras = env_choice(TRACEHOUND_NCCL_RAS, DEFAULT_NCCL_RAS, NCCL_RAS_MODES,
                                       env=env)
    except SettingError as exc:
        parser.error(str(exc))
    if args.sim_gpus < 0:
        parser.error(f"--sim-gpus {args.sim_gpus}: expected a number of GPUs >= 0")
    if args.nccl_inspector_dir is None:
        args.nccl_inspector_dir = (env_str(TRACEHOUND_NCCL_INSPECTOR_DIR, env=env)
                                   or env_str(NCCL_INSPECTOR_DUMP_DIR, env=env) or None)
    if args.sim_gpu_faults is None:
        args.sim_gpu_faults = env_str(TRACEHOUND_SIM_GPU_FAULTS, env=env) or None
    if args.disk_path is None:
        args.disk_path = [args.spool]
        checkpoints = env_str(TRACEHOUND_CHECKPOINT_DIR, env=env)
        if checkpoints:
            args.disk_path.append(checkpoints)
    return args


def parse_args(argv: list[str] | None = None,
               env: Mapping[str, str] | None = None) -> argparse.Namespace:
    """The agent's options; see `add_arguments` for their defaults."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "python -m tracehound.agent.node"
    if argv[:1] == ["--prog"] and len(argv) > 1:  # `tracehound agent` runs this module
        prog, argv = argv[1], argv[2:]
    parser = argparse.ArgumentParser(
        prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tracehound node agent: receives the records of this node's ranks, watches "
                    "their processes, samples GPU and host health, and ships it all to the "
                    "trace store. Every option has a TRACEHOUND_* variable (shown with its "
                    "default); ranks reach the agent through TRACEHOUND_AGENT_SOCKET.",
        epilog=EPILOG,
    )
    add_arguments(parser, env)
    return check_args(parser, parser.parse_args(argv), env)


def health_sources(args: argparse.Namespace, ranks: LocalRanks | None = None) -> list[Source]:
    """The health and NCCL sources the options ask for: GPU and host health every
    --health-interval (none at 0), NCCL RAS and Inspector when asked (`ranks` maps Inspector's
    writers to ranks). NvmlUnavailable when --gpu nvml cannot run here."""
    out: list[Source] = []
    nvml = False
    if args.health_interval:
        backend = open_backend(args.gpu, node=args.node, sim_gpus=args.sim_gpus,
                               sim_faults=args.sim_gpu_faults)
        if backend is not None:
            nvml = backend.name == "nvml"
            out.append(GpuHealthSource(backend, job=args.job, node=args.node,
                                       interval_s=args.health_interval))
        out.append(HostHealthSource(job=args.job, node=args.node,
                                    interval_s=args.health_interval, disk_paths=args.disk_path))
    if args.nccl_ras == "on" or (args.nccl_ras == "auto" and nvml):
        out.append(NcclRasSource(job=args.job, node=args.node))
    if args.nccl_inspector_dir:
        out.append(NcclInspectorSource(args.nccl_inspector_dir, job=args.job, node=args.node,
                                       ranks=ranks))
    return out


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected seconds, e.g. 1.5") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds >= 0")
    return value


def run_agent(args: argparse.Namespace) -> int:
    """Run a node agent with `args` (from `parse_args` or `tracehound agent`) until SIGTERM or
    SIGINT; 0 after a clean stop, 2 when a source or sink cannot be used. A stop asked for
    while it is still setting up (opening a store can take seconds) is a clean stop too: the
    agent starts, ships what its spool holds and ends."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    ranks = LocalRanks(job=args.job)
    try:
        sink = make_sink(args.sink)
        sources = health_sources(args, ranks)
    except (StoreConfigError, NvmlUnavailable, ValueError) as exc:
        print(f"tracehound node agent: {exc}", file=sys.stderr)
        return 2
    spool = Spool(
        args.spool, node=args.node, seal_records=args.seal_records,
        seal_interval_s=args.seal_interval, urgent_interval_s=args.urgent_interval,
    )
    watcher = ProcWatcher(
        emit=spool_writer(spool), proc_interval_s=args.proc_interval,
        stack_after_s=args.stack_after, stack_repeat_s=args.stack_repeat,
        capturer=PySpy(find_py_spy(args.py_spy)), job=args.job, node=args.node,
        launch_file=args.launch_file,
    )
    poller = SourcePoller(sources, spool_writer(spool), job=args.job, node=args.node)
    agent = NodeAgent(
        job=args.job, node=args.node, socket_path=args.socket, spool=spool, sink=sink,
        stats_file=args.stats_file, stats_interval_s=args.stats_interval, watcher=watcher,
        sources=poller, heartbeat_observers=[ranks.observe], retry_max_s=args.retry_max,
    )
    try:
        # nothing starts unless OTEL_EXPORTER_OTLP_(METRICS_)ENDPOINT is set
        telemetry = start_telemetry(agent.stats, job=args.job, node=args.node,
                                    spool_dir=args.spool)
        # nor unless TRACEHOUND_OTEL_SPANS_EVERY is
        agent.spans = start_spans(args.job, args.node)
    except SettingError as exc:
        print(f"tracehound node agent: {exc}", file=sys.stderr)
        return 2
    if telemetry is not None:
        agent.shipper.sink = telemetry.timed_sink(agent.shipper.sink)
        agent.log.info("exporting the agent's own metrics over OTLP")
    agent.start()
    while not stop.wait(1.0):
        pass
    agent.log.info("stopping: shipping what is left (at most %.0fs)", args.drain_s)
    agent.stop(drain_s=args.drain_s)
    if telemetry is not None:
        telemetry.shutdown()
    if agent.spans is not None:
        agent.spans.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure()
    return run_agent(args)


if __name__ == "__main__":
    sys.exit(main())
