"""Real processes for the agent tests: a node agent, a multi-rank gloo job launched with the
controller's env contract, and a small ingest endpoint that keeps what it is sent.

The ingest endpoint here is a stand-in for the controller's (it answers like
`tracing.store.ingest`: 200 {"inserted", "skipped", "rejected"}), so these tests need no store.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tracehound.tracing.events import Batch, CollectiveEvent, Heartbeat, ProcessGroupInfo, Record
from tracehound.tracing.wire import decode_batch

PYTHON = sys.executable
EXAMPLE = str(Path(__file__).resolve().parents[2] / "agent" / "examples" / "train_ddp.py")


def bootstrap_dir() -> str:
    spec = importlib.util.find_spec("tracehound.agent._bootstrap")
    assert spec is not None and spec.submodule_search_locations is not None
    return str(spec.submodule_search_locations[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Received:
    batches: list[tuple[Batch, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def records(self) -> list[Record]:
        with self.lock:
            seen: set[str] = set()
            out: list[Record] = []
            for batch, _ in self.batches:
                if batch.batch_id in seen:
                    continue
                seen.add(batch.batch_id)
                out.extend(batch.records)
            return out

    def of(self, kind: type) -> list[Any]:
        return [r for r in self.records() if isinstance(r, kind)]


class CollectingIngest:
    """A tiny ingest endpoint: decodes batches with tracing.wire.decode_batch and keeps them."""

    def __init__(self) -> None:
        self.received = Received()
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                decoded = decode_batch(body)
                with received.lock:
                    received.batches.append(
                        (decoded.batch, "maybe_duplicate=1" in self.path)
                    )
                payload = json.dumps({
                    "inserted": len(decoded.batch.records), "skipped": 0,
                    "rejected": [{"index": r.index, "reason": r.reason} for r in decoded.rejected],
                }).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> CollectingIngest:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_node_agent(
    *, job: str, node: str, socket_path: Path, spool: Path, sink: str, stats_file: Path,
    drain_s: float = 10.0,
) -> subprocess.Popen[bytes]:
    """A node agent; asked to stop, it ships what is left for at most `drain_s` seconds."""
    return subprocess.Popen(
        [PYTHON, "-m", "tracehound.agent.node", "--job", job, "--node", node,
         "--socket", str(socket_path), "--spool", str(spool), "--sink", sink,
         "--stats-file", str(stats_file), "--stats-interval", "2", "--drain-s", str(drain_s)],
    )


def stop(process: subprocess.Popen[bytes], timeout: float = 30.0) -> int:
    process.send_signal(signal.SIGTERM)
    return process.wait(timeout=timeout)


def rank_env(
    *, rank: int, world: int, port: int, job: str, attempt: int, node: str,
    socket_path: Path | None, checkpoint_dir: Path, heartbeat_s: float = 0.1,
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEHOUND_")}
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_RUN_ID": job, "OMP_NUM_THREADS": "1",
        "TRACEHOUND_JOB_ID": job, "TRACEHOUND_ATTEMPT": str(attempt),
        "TRACEHOUND_NODE_ID": node, "TRACEHOUND_CHECKPOINT_DIR": str(checkpoint_dir),
        "TRACEHOUND_HEARTBEAT_S": str(heartbeat_s),
        "PYTHONPATH": os.pathsep.join(
            [bootstrap_dir(), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
    })
    if socket_path is not None:
        env["TRACEHOUND_AGENT_SOCKET"] = str(socket_path)
    return env


def run_job(
    *, world: int, args: Sequence[str], job: str, node: str, socket_path: Path | None,
    checkpoint_dir: Path, attempt: int = 0, timeout: float = 120.0,
    env: Mapping[str, str] | None = None,
) -> list[tuple[int, str]]:
    """Run train_ddp.py on `world` ranks, `env` added to each one's environment; (exit code,
    output) per rank."""
    port = free_port()
    procs = [
        subprocess.Popen(
            [PYTHON, EXAMPLE, *args],
            env={**rank_env(rank=r, world=world, port=port, job=job, attempt=attempt, node=node,
                            socket_path=socket_path, checkpoint_dir=checkpoint_dir),
                 **(env or {})},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    return collect(procs, timeout)


def collect(procs: Sequence[subprocess.Popen[bytes]], timeout: float
            ) -> list[tuple[int, str]]:
    """(exit code, output) of each process; all are killed once `timeout` seconds passed (a
    hung job fails its test instead of hanging the suite)."""
    out: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            text, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            text, _ = proc.communicate()
        out.append((proc.returncode, text.decode(errors="replace")))
    return out


def collectives(received: Received) -> list[CollectiveEvent]:
    return received.of(CollectiveEvent)


def heartbeats(received: Received) -> list[Heartbeat]:
    return received.of(Heartbeat)


def groups(received: Received) -> list[ProcessGroupInfo]:
    return received.of(ProcessGroupInfo)
