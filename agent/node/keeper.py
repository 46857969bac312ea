"""The snapshot keeper of a node: training ranks' in-memory snapshots, held outside their processes.

    python -m tracehound.agent.node.keeper --node N [--port P] [--port-file F]
                                           [--budget-mb MB] [--keep K]

One keeper runs per node for as long as the node serves the job: across restarts, so that a
rank that died, or a whole attempt that was stopped, is restored from memory. It holds the
snapshots of its own node's ranks and the replicas that ranks of other nodes send it, so that
the ranks of a node that is lost are restored on a spare from another node's memory.

It speaks HTTP on one port (127.0.0.1 unless --host):
    PUT /v1/snapshots                  a snapshot container (`tracing.snapshots`) as the body
    GET /v1/snapshots?job=J            what it holds of job J: JSON, one object per snapshot
    GET /v1/snapshots/J/RANK/STEP      the container's bytes
    GET /v1/stats                      held, bytes, budget, counts of what it refused, and
                                       the port of its snapshot stream
and takes the snapshots ranks send every step on a kept connection to a second port, framed by
their length (`tracing.snapshots.FRAME`), without HTTP's cost per request.

Every snapshot is checked on arrival (a damaged one is refused: 400). Memory is bounded: it keeps
the newest --keep snapshots of each rank and at most --budget-mb MiB in all, dropping the oldest
snapshot that is not a rank's newest; a snapshot that cannot fit beside the newest of every rank
is refused (507) with the reason. Every refusal is counted and logged, never silent.

It must never lose a snapshot it acknowledged while it runs, and never answer with a copy whose
checksum it has not verified.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import socketserver
import sys
import threading
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from tracehound.tracing import logs
from tracehound.tracing import settings as env
from tracehound.tracing.durable import write_atomic
from tracehound.tracing.snapshots import FRAME, REPLY, SnapshotDamaged, SnapshotHeader, decode

log = logging.getLogger(__name__)

MIB = 1024 * 1024


class BudgetExceeded(RuntimeError):
    """A snapshot that cannot fit in the keeper's memory beside the newest of every rank."""


@dataclass(frozen=True)
class Held:
    header: SnapshotHeader
    data: bytes
    received_us: int


@dataclass
class KeeperStats:
    stored: int = 0
    replaced: int = 0
    evicted: int = 0
    refused_damaged: int = 0
    refused_budget: int = 0
    served: int = 0


@dataclass
class SnapshotKeeper:
    """The snapshots held in memory, bounded by count per rank and bytes in all. Thread-safe."""

    budget_bytes: int
    keep: int = env.DEFAULT_SNAPSHOT_KEEP
    stats: KeeperStats = field(default_factory=KeeperStats)
    _held: dict[tuple[str, int, int], Held] = field(default_factory=dict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, data: bytes, *, source: str = "snapshot") -> SnapshotHeader:
        """Hold a snapshot after checking it; SnapshotDamaged or BudgetExceeded refuse it."""
        try:
            header, _ = decode(data, source=source)
        except SnapshotDamaged:
            with self._lock:
                self.stats.refused_damaged += 1
            raise
        key = (header.job, header.rank, header.step)
        with self._lock:
            old = self._held.pop(key, None)
            if old is not None:
                self._bytes -= len(old.data)
                self.stats.replaced += 1
            try:
                self._make_room(header, len(data))
            except BudgetExceeded:
                if old is not None:  # a refused copy never costs the one already held
                    self._held[key] = old
                    self._bytes += len(old.data)
                self.stats.refused_budget += 1
                raise
            self._held[key] = Held(header, data, time.time_ns() // 1000)
            self._bytes += len(data)
            self.stats.stored += 1
            self._trim_rank(header.job, header.rank)
        return header

    def _steps_of(self, job: str, rank: int) -> list[int]:
        return sorted(s for (j, r, s) in self._held if j == job and r == rank)

    def _trim_rank(self, job: str, rank: int) -> None:
        steps = self._steps_of(job, rank)
        for step in steps[:max(0, len(steps) - self.keep)]:
            self._drop((job, rank, step))

    def _drop(self, key: tuple[str, int, int]) -> None:
        held = self._held.pop(key)
        self._bytes -= len(held.data)
        self.stats.evicted += 1

    def _make_room(self, header: SnapshotHeader, size: int) -> None:
        """Drop the oldest snapshots that are not their rank's newest until `size` fits."""
        while self._bytes + size > self.budget_bytes:
            newest = {(j, r): max(self._steps_of(j, r)) for (j, r, _) in self._held}
            droppable = [k for k in self._held if k[2] < newest[(k[0], k[1])]
                         or ((k[0], k[1]) == (header.job, header.rank) and k[2] < header.step)]
            if not droppable:
                raise BudgetExceeded(
                    f"{header.describe()} of {size / MIB:.1f} MiB does not fit: "
                    f"{self._bytes / MIB:.1f} MiB of {self.budget_bytes / MIB:.1f} MiB are held "
                    f"by the newest snapshot of every rank; raise "
                    f"{env.TRACEHOUND_SNAPSHOT_BUDGET_MB} or snapshot less state")
            self._drop(min(droppable, key=lambda k: self._held[k].received_us))

    def get(self, job: str, rank: int, step: int) -> bytes | None:
        with self._lock:
            held = self._held.get((job, rank, step))
            if held is not None:
                self.stats.served += 1
            return None if held is None else held.data

    def index(self, job: str) -> list[dict[str, Any]]:
        """What is held of `job`: one object per snapshot, oldest step first."""
        with self._lock:
            rows = [(k, h) for k, h in self._held.items() if k[0] == job]
        return [{"rank": h.header.rank, "step": h.header.step, "world": h.header.world,
                 "attempt": h.header.attempt, "node": h.header.node, "bytes": len(h.data)}
                for _, h in sorted(rows, key=lambda kh: (kh[0][2], kh[0][1]))]

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {"held": len(self._held), "bytes": self._bytes,
                    "budget_bytes": self.budget_bytes, "keep": self.keep,
                    **vars(self.stats)}


def _refuse_too_big(keeper: SnapshotKeeper, body: io.BufferedIOBase, length: int) -> str:
    """Count a snapshot over the whole budget, read and drop its body (so that the sender hears
    why, and the connection goes on), and say why it was refused."""
    keeper.stats.refused_budget += 1
    left = length
    while left > 0 and (chunk := body.read(min(left, MIB))):
        left -= len(chunk)
    return (f"a snapshot of {length / MIB:.1f} MiB exceeds the keeper's budget of "
            f"{keeper.budget_bytes / MIB:.1f} MiB; raise {env.TRACEHOUND_SNAPSHOT_BUDGET_MB}")


def _handler(keeper: SnapshotKeeper, node: str,
             stream_port: int) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "tracehound-keeper"
        protocol_version = "HTTP/1.1"  # a rank keeps one connection: every reply has a length
        disable_nagle_algorithm = True  # headers and body go apart: no delayed-ACK wait

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("node %s keeper: " + format, node, *args)  # noqa: G003

        def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, value: object) -> None:
            self._reply(status, json.dumps(value).encode())

        def do_PUT(self) -> None:
            length = int(self.headers.get("Content-Length") or -1)
            if length < 0:
                self.close_connection = True
                return self._json(411, {"error": "a snapshot needs a Content-Length"})
            if length > keeper.budget_bytes:
                return self._json(507, {"error": _refuse_too_big(keeper, self.rfile, length)})
            data = self.rfile.read(length)
            if self.path != "/v1/snapshots":
                return self._json(404, {"error": f"no such place {self.path!r}"})
            try:
                header = keeper.put(data, source=f"snapshot from {self.client_address[0]}")
            except SnapshotDamaged as exc:
                log.warning("node %s keeper refused a snapshot: %s", node, exc)
                return self._json(400, {"error": str(exc)})
            except BudgetExceeded as exc:
                log.error("node %s keeper refused a snapshot: %s", node, exc)
                return self._json(507, {"error": str(exc)})
            return self._json(201, {"stored": header.describe()})

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
            if parts == ["v1", "stats"]:
                return self._json(200, {**keeper.summary(), "stream_port": stream_port})
            if parts == ["v1", "snapshots"]:
                job = urllib.parse.parse_qs(url.query).get("job", [""])[0]
                if not job:
                    return self._json(400, {"error": "say which job: /v1/snapshots?job=J"})
                return self._json(200, keeper.index(job))
            if len(parts) == 5 and parts[:2] == ["v1", "snapshots"]:
                try:
                    rank, step = int(parts[3]), int(parts[4])
                except ValueError:
                    return self._json(400, {"error": "expected /v1/snapshots/JOB/RANK/STEP "
                                            "with whole numbers"})
                data = keeper.get(parts[2], rank, step)
                if data is None:
                    return self._json(404, {"error": f"no snapshot of job {parts[2]!r} rank "
                                            f"{rank} step {step} here"})
                return self._reply(200, data, "application/octet-stream")
            return self._json(404, {"error": f"no such place {url.path!r}"})

    return Handler


class _StreamHandler(socketserver.StreamRequestHandler):
    """Snapshots on one kept connection (`tracing.snapshots.FRAME`): no HTTP to parse, so a
    snapshot a step costs the keeper little more than its checksum."""

    disable_nagle_algorithm = True
    keeper: SnapshotKeeper
    node: str

    def handle(self) -> None:
        while True:
            head = self.rfile.read(FRAME.size)
            if len(head) < FRAME.size:
                return
            (length,) = FRAME.unpack(head)
            if length > self.keeper.budget_bytes:
                self._reply(_refuse_too_big(self.keeper, self.rfile, length))
                continue
            data = self.rfile.read(length)
            if len(data) < length:
                return
            try:
                self.keeper.put(data, source=f"snapshot from {self.client_address[0]}")
            except (SnapshotDamaged, BudgetExceeded) as exc:
                log.warning("node %s keeper refused a snapshot: %s", self.node, exc)
                self._reply(str(exc))
                continue
            self.wfile.write(REPLY.pack(0, 0))

    def _reply(self, error: str) -> None:
        reason = error.encode()
        self.wfile.write(REPLY.pack(1, len(reason)) + reason)


@dataclass
class KeeperServer:
    """The keeper's two listeners: HTTP (`port`) and the snapshot stream (`stream_port`)."""

    http: ThreadingHTTPServer
    stream: socketserver.ThreadingTCPServer

    @property
    def port(self) -> int:
        return int(self.http.server_address[1])

    @property
    def stream_port(self) -> int:
        return int(self.stream.server_address[1])

    def close(self) -> None:
        for server in (self.http, self.stream):
            server.shutdown()
            server.server_close()


def serve(keeper: SnapshotKeeper, *, host: str, port: int, node: str) -> KeeperServer:
    """Start the keeper's listeners on threads of their own: HTTP on `port` (0: any), the
    snapshot stream on any free port, which `GET /v1/stats` names (`stream_port`)."""
    handler = type("StreamHandler", (_StreamHandler,), {"keeper": keeper, "node": node})
    stream = socketserver.ThreadingTCPServer((host, 0), handler)
    stream.daemon_threads = True
    http = ThreadingHTTPServer((host, port), _handler(keeper, node,
                                                      int(stream.server_address[1])))
    http.daemon_threads = True
    for server, name in ((http, "keeper-http"), (stream, "keeper-stream")):
        threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return KeeperServer(http, stream)


def parse_args(argv: list[str] | None = None,
               environ: Mapping[str, str] | None = None) -> argparse.Namespace:
    source = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="python -m tracehound.agent.node.keeper", description=__doc__.splitlines()[0])
    parser.add_argument("--node", default=source.get(env.TRACEHOUND_NODE_ID, "") or "node",
                        help="this node's name, for logs (default $TRACEHOUND_NODE_ID)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port (0: any free one)")
    parser.add_argument("--port-file", type=Path,
                        help="write the bound address (host:port) here once listening")
    parser.add_argument("--budget-mb", type=float, default=None,
                        help=f"memory for snapshots, MiB (default "
                             f"${env.TRACEHOUND_SNAPSHOT_BUDGET_MB} or "
                             f"{env.DEFAULT_SNAPSHOT_BUDGET_MB:g})")
    parser.add_argument("--keep", type=int, default=None,
                        help=f"snapshots held per rank (default ${env.TRACEHOUND_SNAPSHOT_KEEP} "
                             f"or {env.DEFAULT_SNAPSHOT_KEEP})")
    args = parser.parse_args(argv)
    try:
        if args.budget_mb is None:
            args.budget_mb = env.env_float(env.TRACEHOUND_SNAPSHOT_BUDGET_MB,
                                           env.DEFAULT_SNAPSHOT_BUDGET_MB, env=source)
        if args.keep is None:
            args.keep = env.env_int(env.TRACEHOUND_SNAPSHOT_KEEP, env.DEFAULT_SNAPSHOT_KEEP,
                                    env=source, minimum=1)
    except env.SettingError as exc:
        parser.error(str(exc))
    if args.budget_mb <= 0:
        parser.error(f"--budget-mb {args.budget_mb:g}: expected a number of MiB above 0")
    if args.keep < 1:
        parser.error(f"--keep {args.keep}: expected at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs.configure()
    keeper = SnapshotKeeper(budget_bytes=int(args.budget_mb * MIB), keep=args.keep)
    server = serve(keeper, host=args.host, port=args.port, node=args.node)
    host, port = args.host, server.port
    if args.port_file is not None:
        write_atomic(args.port_file, f"{host}:{port}\n".encode())
    log.info("node %s keeper: holding snapshots at http://%s:%d (budget %.0f MiB, %d per rank)",
             args.node, host, port, args.budget_mb, args.keep)
    done = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    done.wait()
    server.close()
    log.info("node %s keeper: stopped (%s)", args.node, keeper.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
