"""Runs a job on this machine: every "node" is a node agent plus a group of local rank processes.

Ranks get the environment torchrun would give them (so any torchrun script runs unchanged) plus
the TRACEHOUND_* variables and the recorder's bootstrap directory on PYTHONPATH. Each rank's
output goes to `<workdir>/logs/attempt-<A>/rank-<R>.log`. Exits are timed by one waiter thread
per process, so the first failure is known to the millisecond.

It must never leave processes behind: `stop()` kills stopped (SIGSTOPped) ranks too, and
`close()` stops whatever is still running.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tracehound.controller.orchestrator import AttemptPlan
from tracehound.tracing import settings as env
from tracehound.tracing.events import RankExit, now_us
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.logs import JobLogger

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bootstrap_dir() -> str:
    """The directory whose sitecustomize installs the recorder into a Python process."""
    spec = importlib.util.find_spec("tracehound.agent._bootstrap")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("tracehound.agent._bootstrap is not installed")
    return str(next(iter(spec.submodule_search_locations)))


def recorder_env(*, job: str, node: str, socket_path: str,
                 base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that put the recorder into every Python process started with them: the
    job, the node, the node agent's socket, and the bootstrap directory first on PYTHONPATH
    (`base`'s PYTHONPATH after it; default: this process's environment)."""
    base = os.environ if base is None else base
    return {
        env.TRACEHOUND_JOB_ID: job,
        env.TRACEHOUND_NODE_ID: node,
        env.TRACEHOUND_AGENT_SOCKET: socket_path,
        "PYTHONPATH": os.pathsep.join(p for p in (bootstrap_dir(), base.get("PYTHONPATH", ""))
                                      if p),
    }


@dataclass
class _Proc:
    rank: int
    node: NodeId
    popen: subprocess.Popen[bytes]
    output: IO[bytes]


class LocalOrchestrator:
    """The Orchestrator port for processes on this machine."""

    def __init__(
        self,
        *,
        workdir: Path,
        sink: str,
        heartbeat_s: float = env.DEFAULT_HEARTBEAT_S,
        checkpoint_dir: Path | None = None,
        agent_env: Mapping[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        self.sink = sink
        self.heartbeat_s = heartbeat_s
        self.checkpoint_dir = checkpoint_dir or workdir / "checkpoints"
        self._agent_env = dict(agent_env or {})
        # Unix socket paths are limited to ~100 bytes: keep them short, in /tmp.
        self._sockdir = Path(tempfile.mkdtemp(prefix="th-sock-"))
        self._ranks: list[_Proc] = []
        self._agents: dict[NodeId, subprocess.Popen[bytes]] = {}
        self._exits: queue.Queue[RankExit] = queue.Queue()
        self._plan: AttemptPlan | None = None
        self._stopping = False
        self.isolated: dict[NodeId, str] = {}

    # -- launching -------------------------------------------------------------------------
    def _start_agent(self, plan: AttemptPlan, node: NodeId) -> Path:
        sock = self._sockdir / f"{node}.a{plan.attempt}.sock"
        spool = self.workdir / "spool" / node
        spool.mkdir(parents=True, exist_ok=True)
        logdir = self.workdir / "logs" / f"attempt-{plan.attempt}"
        logdir.mkdir(parents=True, exist_ok=True)
        out = open(logdir / f"agent-{node}.log", "ab")  # noqa: SIM115 - closed with the process
        cmd = [
            sys.executable, "-m", "tracehound.agent.node", "--job", plan.job, "--node", node,
            "--socket", str(sock), "--spool", str(spool), "--sink", self.sink,
        ]
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self._agent_env}
        )
        out.close()
        self._agents[node] = proc
        return sock

    def launch(self, plan: AttemptPlan) -> None:
        self._plan = plan
        self._stopping = False
        self._ranks = []
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        master_port = free_port()
        logdir = self.workdir / "logs" / f"attempt-{plan.attempt}"
        logdir.mkdir(parents=True, exist_ok=True)
        world = plan.world_size
        for node_rank, node in enumerate(plan.nodes):
            sock = self._start_agent(plan, node)
            for local in range(plan.nproc_per_node):
                rank = node_rank * plan.nproc_per_node + local
                rank_env = {
                    **os.environ,
                    **plan.env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(local),
                    "WORLD_SIZE": str(world),
                    "LOCAL_WORLD_SIZE": str(plan.nproc_per_node),
                    "GROUP_RANK": str(node_rank),
                    "GROUP_WORLD_SIZE": str(len(plan.nodes)),
                    "ROLE_NAME": "default",
                    "ROLE_RANK": str(rank),
                    "ROLE_WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(master_port),
                    "TORCHELASTIC_RESTART_COUNT": str(plan.attempt),
                    "TORCHELASTIC_RUN_ID": plan.job,
                    "TORCHELASTIC_USE_AGENT_STORE": "False",
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                    "PYTHONUNBUFFERED": "1",
                    env.TRACEHOUND_ATTEMPT: str(plan.attempt),
                    env.TRACEHOUND_CHECKPOINT_DIR: str(self.checkpoint_dir),
                    env.TRACEHOUND_HEARTBEAT_S: str(self.heartbeat_s),
                    **recorder_env(job=plan.job, node=node, socket_path=str(sock)),
                }
                out = open(logdir / f"rank-{rank}.log", "ab")  # noqa: SIM115
                popen = subprocess.Popen(
                    list(plan.command), stdout=out, stderr=subprocess.STDOUT, env=rank_env,
                    start_new_session=True,
                )
                proc = _Proc(rank=rank, node=node, popen=popen, output=out)
                self._ranks.append(proc)
                threading.Thread(
                    target=self._wait, args=(plan, proc), name=f"wait-rank-{rank}", daemon=True
                ).start()
        JobLogger(log, job=plan.job).info(
            "attempt %d: started %d ranks on %s (logs in %s)",
            plan.attempt, world, ", ".join(plan.nodes), logdir,
        )

    def _wait(self, plan: AttemptPlan, proc: _Proc) -> None:
        code = proc.popen.wait()
        at = now_us()
        proc.output.close()
        if self._stopping:
            return  # exits caused by our own stop are not the job's failures
        self._exits.put(
            RankExit(
                job=JobId(plan.job), attempt=plan.attempt, node=proc.node, rank=Rank(proc.rank),
                pid=proc.popen.pid, exit_code=code, time_us=at,
            )
        )

    # -- watching --------------------------------------------------------------------------
    def poll_exits(self) -> list[RankExit]:
        out: list[RankExit] = []
        while True:
            try:
                out.append(self._exits.get_nowait())
            except queue.Empty:
                return sorted(out, key=lambda e: e.time_us)

    def pid_of(self, rank: int) -> int | None:
        for proc in self._ranks:
            if proc.rank == rank and proc.popen.poll() is None:
                return proc.popen.pid
        return None

    # -- stopping --------------------------------------------------------------------------
    def stop(self, *, grace_s: float = 3.0) -> None:
        self._stopping = True
        live = [p for p in self._ranks if p.popen.poll() is None]
        for p in live:
            _signal_group(p.popen, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            _signal_group(p.popen, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p.popen, signal.SIGKILL)
        for p in live:
            try:
                p.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.error("rank %d (pid %d) survived SIGKILL", p.rank, p.popen.pid)
        self._stop_agents()

    def _stop_agents(self, timeout_s: float = 15.0) -> None:
        for agent in self._agents.values():
            if agent.poll() is None:
                agent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node, agent in self._agents.items():
            try:
                agent.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("node agent %s did not finish shipping in %.0f s; killing it "
                            "(its spool keeps what it held)", node, timeout_s)
                agent.kill()
                agent.wait()
        self._agents = {}

    def finish(self) -> None:
        """The attempt ended by itself: let the node agents ship what they hold, then stop them."""
        self._stopping = True
        self._stop_agents()

    def isolate(self, node: NodeId, *, reason: str) -> None:
        self.isolated[node] = reason

    def close(self) -> None:
        if any(p.popen.poll() is None for p in self._ranks) or self._agents:
            self.stop(grace_s=1.0)
        shutil.rmtree(self._sockdir, ignore_errors=True)


def _signal_group(popen: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, sig)
