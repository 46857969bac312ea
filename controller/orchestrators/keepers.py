"""The snapshot keepers of a job run on this machine: one process per node, kept across attempts.

A keeper (`python -m tracehound.agent.node.keeper`) holds the in-memory snapshots of its node's
ranks and replicas of other nodes'. It must outlive restarts, or a restart would lose the memory
it restores from: `ensure` starts a keeper for each node of an attempt that has none and keeps
the live ones. A node that is isolated loses its keeper (`drop`), as a lost machine loses its
memory; its ranks are then restored from the replicas on other nodes. `close` stops them all.

Each keeper is noted in `<workdir>/keepers.json` (node, pid, address), so that a controller
started again uses the keepers the killed one left (a keeper is live if it answers); `close`
also stops keepers of this job that no controller noted (one killed between starting and
noting them). It never signals a process that is not a keeper: a pid is checked against its
command line first.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tracehound.tracing.durable import write_atomic
from tracehound.tracing.ids import NodeId

log = logging.getLogger(__name__)

KEEPER_MODULE = "tracehound.agent.node.keeper"
START_TIMEOUT_S = 30.0


class KeeperStartError(RuntimeError):
    """A keeper process that did not come up; the message says where its log is."""


@dataclass(frozen=True)
class Keeper:
    node: NodeId
    pid: int
    url: str


def answers(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/stats", timeout=timeout_s) as response:  # noqa: S310 - our own http URL
            return bool(response.status == 200)
    except OSError:
        return False


def _is_keeper(pid: int) -> bool:
    try:
        return KEEPER_MODULE.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


class NodeKeepers:
    """Starts, reuses and stops the keepers of one job's nodes."""

    def __init__(self, workdir: Path, *, env: Mapping[str, str] | None = None) -> None:
        self.dir = workdir / "keepers"
        self.file = workdir / "keepers.json"
        self._env = dict(env or {})
        self._keepers: dict[NodeId, Keeper] = {}
        self._procs: dict[NodeId, subprocess.Popen[bytes]] = {}
        self._noted = False

    def _read_noted(self) -> None:
        """Take over the live keepers a controller before this one noted (once)."""
        self._noted = True
        try:
            rows = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return
        for row in rows if isinstance(rows, list) else []:
            keeper = Keeper(NodeId(str(row["node"])), int(row["pid"]), str(row["url"]))
            if _is_keeper(keeper.pid) and answers(keeper.url):
                self._keepers[keeper.node] = keeper
                log.info("snapshot keeper of node %s taken over (pid %d, %s)", keeper.node,
                         keeper.pid, keeper.url)

    def _note(self) -> None:
        rows = [{"node": k.node, "pid": k.pid, "url": k.url} for k in self._keepers.values()]
        self.file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.file, json.dumps(rows, indent=1).encode())

    def ensure(self, nodes: Sequence[NodeId]) -> str:
        """A live keeper for each of `nodes`; returns them as TRACEHOUND_SNAPSHOT_KEEPERS."""
        if not self._noted:
            self._read_noted()
        started = {n: self._start(n) for n in nodes if not self._live(n)}
        for node, (proc, port_file) in started.items():
            self._keepers[node] = self._wait_started(node, proc, port_file)
        if started:
            self._note()
        return ",".join(f"{n}={self._keepers[n].url}" for n in nodes)

    def url(self, node: NodeId) -> str | None:
        keeper = self._keepers.get(node)
        return None if keeper is None else keeper.url

    def pid(self, node: NodeId) -> int | None:
        keeper = self._keepers.get(node)
        return None if keeper is None else keeper.pid

    def _live(self, node: NodeId) -> bool:
        keeper = self._keepers.get(node)
        if keeper is None:
            return False
        proc = self._procs.get(node)
        if proc is not None and proc.poll() is not None:
            return False
        return _is_keeper(keeper.pid) and answers(keeper.url)

    def _start(self, node: NodeId) -> tuple[subprocess.Popen[bytes], Path]:
        self.dir.mkdir(parents=True, exist_ok=True)
        port_file = self.dir / f"{node}.addr"
        port_file.unlink(missing_ok=True)
        with open(self.dir / f"{node}.log", "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", KEEPER_MODULE, "--node", node,
                 "--port-file", str(port_file)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self._env},
                start_new_session=True,
            )
        self._procs[node] = proc
        return proc, port_file

    def _wait_started(self, node: NodeId, proc: subprocess.Popen[bytes], port_file: Path) -> Keeper:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if port_file.is_file():
                address = port_file.read_text().strip()
                log.info("snapshot keeper of node %s at http://%s (pid %d)", node, address,
                         proc.pid)
                return Keeper(node, proc.pid, f"http://{address}")
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        proc.kill()
        raise KeeperStartError(f"the snapshot keeper of node {node} did not start "
                               f"(see {self.dir / f'{node}.log'})")

    def drop(self, node: NodeId) -> None:
        """Stop the keeper of a node that leaves the job: its memory goes with it."""
        keeper = self._keepers.pop(node, None)
        if keeper is not None:
            self._end(keeper)
            self._note()
            log.info("snapshot keeper of node %s stopped: the node left the job", node)

    def _end(self, keeper: Keeper, timeout_s: float = 5.0) -> None:
        proc = self._procs.pop(keeper.node, None)
        if not _is_keeper(keeper.pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(keeper.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _is_keeper(keeper.pid) and time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return
            time.sleep(0.05)
        if _is_keeper(keeper.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(keeper.pid, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=timeout_s)

    def _orphans(self) -> list[int]:
        """Keeper processes whose address file lies in this job's keeper directory."""
        mark = f"--port-file {self.dir}{os.sep}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if KEEPER_MODULE.encode() in cmdline and mark in cmdline:
                found.append(int(entry.name))
        return found

    def close(self) -> None:
        for keeper in list(self._keepers.values()):
            self._end(keeper)
        self._keepers = {}
        for pid in self._orphans():  # started by a controller killed before it noted them
            log.info("stopping a snapshot keeper no controller noted (pid %d)", pid)
            self._end(Keeper(NodeId("?"), pid, ""))
        with contextlib.suppress(OSError):
            self._note()
