"""Runs a job on this machine: every "node" is a node agent plus a group of local rank processes.

Ranks get the environment torchrun would give them (so any torchrun script runs unchanged) plus
the TRACEHOUND_* variables and the recorder's bootstrap directory on PYTHONPATH. Each rank's
output goes to `<workdir>/logs/attempt-<A>/rank-<R>.log`. Exits are timed by one waiter thread
per process, so the first failure is known to the millisecond.

With `warm_spares`, once the attempt trains (`warm_up`, called by the supervisor when every rank
made its first step; at the latest `spare_delay_s` after the launch) one warm spare per rank is
started (`agent.warmspare`: torch and the script's heavy modules imported, waiting on stdin), and
the next launch hands each rank to a spare instead of spawning a fresh interpreter. A command
that is not `<this python> script.py ...` always spawns fresh ranks. Spares cost memory (one
interpreter with torch per rank) and, while they import, CPU beside the running attempt.

It must never leave processes behind: `stop()` kills stopped (SIGSTOPped) ranks too, and
`close()` stops whatever is still running.

Ranks and node agents outlive a controller that is killed (ranks run in sessions of their own).
Each launch writes the attempt's process ids and start times to
`<workdir>/attempts/attempt-<A>.json`, so a controller started again can `adopt` a running
attempt (its ranks watched through /proc: not its children, so how one ended is not known,
`EXIT_UNKNOWN`) or `kill_leftovers` of an attempt it will not continue. A start time that does
not match means the pid now belongs to another process: it is left alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tracehound.agent.node.spool import waiting_segments
from tracehound.controller.orchestrators.keepers import NodeKeepers
from tracehound.controller.orchestrators.port import AttemptPlan, Launched
from tracehound.tracing import settings as env
from tracehound.tracing.durable import write_atomic
from tracehound.tracing.events import EXIT_UNKNOWN, RankExit, now_us
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


def start_time(pid: int) -> int | None:
    """When a process started (clock ticks since boot, /proc/PID/stat field 22); None when it
    is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


class _Adopted:
    """A process an earlier controller started: watched through /proc (it is not our child, so
    it cannot be waited for). How it ended comes from the status file a rank leaves
    (`agent.exitstatus`), where there is one; else it is not known (`EXIT_UNKNOWN`)."""

    stdin = None

    def __init__(self, pid: int, started: int, exit_file: str = "") -> None:
        self.pid = pid
        self.started = started
        self.exit_file = exit_file

    def poll(self) -> int | None:
        return None if start_time(self.pid) == self.started else self.status()

    def status(self) -> int:
        """How the process ended, as its status file says (`EXIT_UNKNOWN` without one)."""
        if self.exit_file:
            with contextlib.suppress(OSError, ValueError):
                return int(Path(f"{self.exit_file}.{self.pid}").read_text().strip() or "x")
        return EXIT_UNKNOWN

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_Process = subprocess.Popen[bytes] | _Adopted


@dataclass
class _Proc:
    rank: int
    node: NodeId
    popen: _Process
    output: IO[bytes] | None


WARM_SPARE_DELAY_S = 30.0
"""How long after a launch the spares for the next one start at the latest. They start as soon
as the supervisor says the attempt trains (`warm_up`: every rank made its first step), never
while the ranks just launched import torch and set up their process group on the same cores."""


@dataclass
class _Spare:
    popen: subprocess.Popen[bytes]
    script: str
    log: IO[bytes]


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
        warm_spares: bool = False,
        spare_delay_s: float = WARM_SPARE_DELAY_S,
        preload: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.sink = sink
        self.heartbeat_s = heartbeat_s
        self.checkpoint_dir = checkpoint_dir or workdir / "checkpoints"
        self._agent_env = dict(agent_env or {})
        # Unix socket paths are limited to ~100 bytes: keep them short, in /tmp.
        self._sockdir = Path(tempfile.mkdtemp(prefix="th-sock-"))
        self._ranks: list[_Proc] = []
        self._agents: dict[NodeId, _Process] = {}
        self._old_sockdirs: list[Path] = []
        """Socket directories of adopted node agents (removed on close)."""
        self._attempt_sockdir = self._sockdir
        """Where the current attempt's node agents have their sockets."""
        self._exits: queue.Queue[RankExit] = queue.Queue()
        self._exited = threading.Event()
        self._plan: AttemptPlan | None = None
        self._stopping = False
        self.isolated: dict[NodeId, str] = {}
        self.warm_spares = warm_spares
        self.spare_delay_s = spare_delay_s
        self.preload = preload
        self._spares: list[_Spare] = []
        self._spares_lock = threading.Lock()
        self._spare_timer: threading.Timer | None = None
        self._closed = False
        self.keepers = NodeKeepers(workdir, env=self._agent_env)
        """The nodes' snapshot keepers: kept across attempts, dropped with an isolated node."""

    # -- launching -------------------------------------------------------------------------
    def _start_agent(self, plan: AttemptPlan, node: NodeId, sockdir: Path | None = None) -> Path:
        sock = (sockdir or self._sockdir) / f"{node}.a{plan.attempt}.sock"
        spool = self.workdir / "spool" / node
        spool.mkdir(parents=True, exist_ok=True)
        logdir = self.workdir / "logs" / f"attempt-{plan.attempt}"
        logdir.mkdir(parents=True, exist_ok=True)
        out = open(logdir / f"agent-{node}.log", "ab")  # noqa: SIM115 - closed with the process
        cmd = [
            sys.executable, "-m", "tracehound.agent.node", "--job", plan.job, "--node", node,
            "--socket", str(sock), "--spool", str(spool),
            # the ranks' pids, once launched: a rank whose recorder never reaches this agent
            # is still watched (its process stopped or gone is seen)
            "--launch-file", str(self.pid_file(plan.attempt)),
        ]
        # the sink (a clickhouse:// URL may hold a password) goes in the environment, which only
        # the agent's user can read, not on the command line that `ps` shows everybody
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **self._agent_env, env.TRACEHOUND_SINK: self.sink},
        )
        out.close()
        self._agents[node] = proc
        return sock

    def launch(self, plan: AttemptPlan) -> Launched:
        self._plan = plan
        self._attempt_sockdir = self._sockdir
        self._stopping = False
        self._ranks = []
        started = time.monotonic()
        warm = cold = 0
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        master_port = free_port()
        logdir = self.workdir / "logs" / f"attempt-{plan.attempt}"
        logdir.mkdir(parents=True, exist_ok=True)
        self._exit_file(plan.attempt, 0).parent.mkdir(parents=True, exist_ok=True)
        world = plan.world_size
        keepers = self.keepers.ensure(plan.nodes)
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
                    env.TRACEHOUND_EXIT_FILE: str(self._exit_file(plan.attempt, rank)),
                    env.TRACEHOUND_HEARTBEAT_S: str(self.heartbeat_s),
                    env.TRACEHOUND_SNAPSHOT_KEEPERS: keepers,
                    **recorder_env(job=plan.job, node=node, socket_path=str(sock)),
                }
                log_path = logdir / f"rank-{rank}.log"
                proc = self._warm_rank(plan, rank, node, rank_env, log_path)
                if proc is None:
                    cold += 1
                    out = open(log_path, "ab")  # noqa: SIM115
                    popen = subprocess.Popen(
                        list(plan.command), stdout=out, stderr=subprocess.STDOUT, env=rank_env,
                        start_new_session=True,
                    )
                    proc = _Proc(rank=rank, node=node, popen=popen, output=out)
                else:
                    warm += 1
                self._ranks.append(proc)
                threading.Thread(
                    target=self._wait, args=(plan, proc), name=f"wait-rank-{rank}", daemon=True
                ).start()
        launched = Launched(warm=warm, cold=cold, seconds=time.monotonic() - started)
        self._write_pids(plan)
        JobLogger(log, job=plan.job).info(
            "attempt %d: started %d ranks on %s (%d from warm spares; logs in %s)",
            plan.attempt, world, ", ".join(plan.nodes), warm, logdir,
        )
        self._schedule_spares(plan)
        return launched

    # -- warm spares -------------------------------------------------------------------------
    def _warm_script(self, plan: AttemptPlan) -> str | None:
        """The script a spare can run for this plan's command, if a spare can run it."""
        command = plan.command
        if (len(command) < 2 or os.path.realpath(command[0]) != os.path.realpath(sys.executable)
                or command[1].startswith("-") or not command[1].endswith(".py")):
            return None
        return command[1]

    def _warm_rank(self, plan: AttemptPlan, rank: int, node: NodeId,
                   rank_env: dict[str, str], log_path: Path) -> _Proc | None:
        """Hand the rank to a waiting spare; None when none can take it."""
        script = self._warm_script(plan)
        if script is None:
            return None
        while True:
            with self._spares_lock:
                spare = next((s for s in self._spares if s.script == script), None)
                if spare is None:
                    return None
                self._spares.remove(spare)
            if spare.popen.poll() is not None or spare.popen.stdin is None:
                spare.log.close()
                continue  # died while waiting: try the next one
            assignment = {"argv": list(plan.command[2:]), "env": rank_env, "cwd": os.getcwd(),
                          "log": str(log_path)}
            try:
                spare.popen.stdin.write(json.dumps(assignment).encode() + b"\n")
                spare.popen.stdin.close()
            except OSError as exc:
                log.warning("warm spare %d could not take rank %d: %s", spare.popen.pid, rank,
                            exc)
                spare.log.close()
                continue
            return _Proc(rank=rank, node=node, popen=spare.popen, output=spare.log)

    def warm_up(self) -> None:
        """The attempt trains (every rank made its first step): start the next attempt's spares
        now rather than at the fallback delay."""
        if self._plan is not None:
            self._schedule_spares(self._plan, delay_s=0.0)

    def _schedule_spares(self, plan: AttemptPlan, *, delay_s: float | None = None) -> None:
        """Start `plan`'s spares after `delay_s` (default: the fallback `spare_delay_s`),
        instead of when an earlier call said."""
        if not self.warm_spares or self._warm_script(plan) is None:
            return
        if self._spare_timer is not None:
            self._spare_timer.cancel()
        delay = self.spare_delay_s if delay_s is None else delay_s
        self._spare_timer = threading.Timer(delay, self._top_up, args=(plan,))
        self._spare_timer.daemon = True
        self._spare_timer.start()

    def _top_up(self, plan: AttemptPlan) -> None:
        """Start spares until there is one per rank of `plan`."""
        script = self._warm_script(plan)
        if script is None:
            return
        spare_env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEHOUND_")}
        spare_env.update(plan.env)
        spare_env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
        spare_env["PYTHONUNBUFFERED"] = "1"
        logdir = self.workdir / "logs" / "spares"
        logdir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "tracehound.agent.rank.warmspare", "--script", script]
        if self.preload:
            cmd += ["--preload", ",".join(self.preload)]
        with self._spares_lock:
            while not self._closed and len(self._spares) < plan.world_size:
                out = open(logdir / f"spare-{len(os.listdir(logdir))}.log", "ab")  # noqa: SIM115
                popen = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out,
                                         stderr=subprocess.STDOUT, env=spare_env,
                                         start_new_session=True)
                self._spares.append(_Spare(popen=popen, script=script, log=out))

    def _close_spares(self) -> None:
        with self._spares_lock:
            self._closed = True
            spares, self._spares = self._spares, []
        if self._spare_timer is not None:
            self._spare_timer.cancel()
        for spare in spares:
            with contextlib.suppress(OSError):
                if spare.popen.stdin is not None:
                    spare.popen.stdin.close()  # end of input: the spare leaves by itself
        for spare in spares:
            try:
                spare.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _signal_group(spare.popen, signal.SIGKILL)
                spare.popen.wait()
            spare.log.close()

    def _wait(self, plan: AttemptPlan, proc: _Proc) -> None:
        code = proc.popen.wait()
        at = now_us()
        if proc.output is not None:
            proc.output.close()
        if self._stopping:
            return  # exits caused by our own stop are not the job's failures
        self._exits.put(
            RankExit(
                job=JobId(plan.job), attempt=plan.attempt, node=proc.node, rank=Rank(proc.rank),
                pid=proc.popen.pid, exit_code=code, time_us=at,
            )
        )
        self._exited.set()

    # -- what outlives this controller -------------------------------------------------------
    def pid_file(self, attempt: int) -> Path:
        return self.workdir / "attempts" / f"attempt-{attempt}.json"

    def _exit_file(self, attempt: int, rank: int) -> Path:
        """Where a rank leaves its exit status (`agent.exitstatus` adds `.<pid>`)."""
        return self.workdir / "attempts" / f"attempt-{attempt}" / f"rank-{rank}.exit"

    def _write_pids(self, plan: AttemptPlan) -> None:
        """Note the attempt's processes for a controller started after this one dies."""
        def entry(pid: int, **extra: object) -> dict[str, object]:
            return {"pid": pid, "start": start_time(pid), **extra}

        record = {
            "job": plan.job, "attempt": plan.attempt, "nodes": list(plan.nodes),
            "sockdir": str(self._attempt_sockdir),
            "ranks": [entry(p.popen.pid, rank=p.rank, node=p.node,
                            exit_file=str(self._exit_file(plan.attempt, p.rank)))
                      for p in self._ranks],
            "agents": [entry(a.pid, node=n) for n, a in self._agents.items()],
        }
        self._note(plan.attempt, record, "the processes of")

    def _note(self, attempt: int, record: Mapping[str, object], what: str) -> None:
        """Write the attempt's process file (`what` it notes, for the warning if it cannot)."""
        path = self.pid_file(attempt)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(record, indent=1).encode(),
                         tmp=path.with_name(path.name + ".tmp"))
        except OSError as exc:
            log.warning("could not note %s attempt %d in %s (a controller started again will "
                        "not find it): %s", what, attempt, path, exc)

    def _read_pids(self, attempt: int) -> dict[str, object] | None:
        path = self.pid_file(attempt)
        try:
            found: dict[str, object] = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("unreadable process file %s, ignored: %s", path, exc)
            return None
        return found

    @staticmethod
    def _finished_unwatched(plan: AttemptPlan, noted: Mapping[str, object]) -> bool:
        """Whether every rank of `plan` left exit status 0 in its file, in an attempt no
        controller stopped (`_note_stopped`)."""
        if noted.get("stopped"):
            return False
        entries = _noted_ranks(noted)
        return set(entries) == set(plan.rank_nodes()) and all(
            _noted_status(e) == 0 for e in entries.values())

    def _note_stopped(self, attempt: int) -> None:
        """Mark the attempt's process file: its ranks were stopped, not finished, whatever
        status they leave (a script may exit 0 on SIGTERM)."""
        noted = self._read_pids(attempt)
        if noted is not None:
            self._note(attempt, {**noted, "stopped": True}, "the stop of")

    @staticmethod
    def _live(entries: object) -> list[tuple[dict[str, object], _Adopted]]:
        """The noted processes still running as the same processes."""
        out = []
        for e in _entries(entries):
            pid, started = e.get("pid"), e.get("start")
            if isinstance(pid, int) and isinstance(started, int) and start_time(pid) == started:
                out.append((e, _Adopted(pid, started, str(e.get("exit_file", "")))))
        return out

    def adopt(self, plan: AttemptPlan) -> bool:
        """Watch the ranks of `plan`'s attempt that an earlier controller launched, as if this
        one had. Ranks that ended unwatched are reported as exits, with the status their files
        give (`EXIT_UNKNOWN` without one). When none is running any more, the attempt is
        adopted only if every rank left status 0 and no controller stopped it: it finished
        while no controller watched, and its exits say so (relaunching it would train again
        from its last checkpoint). Otherwise False: nothing adopted."""
        noted = self._read_pids(plan.attempt)
        if noted is None:
            return False
        ranks = self._live(noted.get("ranks"))
        if not ranks and not self._finished_unwatched(plan, noted):
            self.kill_leftovers(plan.attempt)  # its node agents, if any are left
            return False
        self._plan = plan
        self._stopping = False
        self._ranks = [_Proc(rank=int(str(e["rank"])), node=NodeId(str(e["node"])), popen=a,
                             output=None) for e, a in ranks]
        # The ranks' node agents ship to the dead controller's sink (its ingest endpoint, with
        # the embedded store): new ones take their sockets and spools (the ranks reconnect).
        # What they cannot ship stays in their spools.
        _end_agents({NodeId(str(e.get("node"))): a for e, a in self._live(noted.get("agents"))},
                    timeout_s=5.0)
        self._attempt_sockdir = Path(str(noted.get("sockdir", "")))
        self._old_sockdirs.append(self._attempt_sockdir)
        self._agents = {}
        for node in plan.nodes:
            self._start_agent(plan, node, self._attempt_sockdir)
        seen = {p.rank for p in self._ranks}
        noted_ranks = _noted_ranks(noted)
        for rank, where in plan.rank_nodes().items():
            if rank in seen:
                continue
            # ended before this controller looked: how, its status file may say
            e = noted_ranks.get(rank, {})
            pid = e.get("pid")
            self._exits.put(RankExit(
                job=JobId(plan.job), attempt=plan.attempt, node=NodeId(where), rank=Rank(rank),
                pid=pid if isinstance(pid, int) else 0, exit_code=_noted_status(e),
                time_us=now_us()))
            self._exited.set()
        for proc in self._ranks:
            threading.Thread(target=self._wait, args=(plan, proc), name=f"wait-rank-{proc.rank}",
                             daemon=True).start()
        self._write_pids(plan)
        if self._ranks:
            JobLogger(log, job=plan.job).info(
                "attempt %d: adopted %d running ranks of an earlier controller (their node "
                "agents restarted on the same sockets and spools)", plan.attempt, len(self._ranks))
        else:
            JobLogger(log, job=plan.job).info(
                "attempt %d: every rank ended with status 0 while no controller watched: adopted "
                "as it ended (its node agents restarted to ship what their spools hold)",
                plan.attempt)
        self._schedule_spares(plan)
        return True

    def kill_leftovers(self, attempt: int) -> int:
        """Kill what an earlier controller left running of an attempt this one will not
        continue (ranks SIGKILL; node agents SIGTERM: they ship what they hold); how many
        ranks."""
        noted = self._read_pids(attempt) or {}
        ranks = self._live(noted.get("ranks"))
        # and ranks spawned before the pid file was written (a launch cut short): found by the
        # exit-file path in their environment, which names this workdir and the attempt
        known = {proc.pid for _, proc in ranks}
        ranks += [({}, proc) for proc in self._spawned_ranks(attempt) if proc.pid not in known]
        for _, proc in ranks:
            _kill_group_of(proc.pid)
        agents = {NodeId(str(e.get("node"))): a for e, a in self._live(noted.get("agents"))}
        for _, proc in ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        _end_agents(agents)
        if noted.get("sockdir"):
            shutil.rmtree(str(noted["sockdir"]), ignore_errors=True)
        if ranks or agents:
            log.warning("%s attempt %d: killed %d ranks and %d node agents an earlier "
                        "controller left running", self.workdir, attempt, len(ranks),
                        len(agents))
        return len(ranks)

    def _spawned_ranks(self, attempt: int) -> list[_Adopted]:
        """Running processes started as ranks of `attempt` by a controller of this workdir
        (their TRACEHOUND_EXIT_FILE lies in the attempt's directory here)."""
        wanted = f"{env.TRACEHOUND_EXIT_FILE}={self._exit_file(attempt, 0).parent}{os.sep}"
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                variables = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(v.decode(errors="replace").startswith(wanted) for v in variables):
                started = start_time(int(entry.name))
                if started is not None:
                    found.append(_Adopted(int(entry.name), started))
        return found

    # -- watching --------------------------------------------------------------------------
    def poll_exits(self) -> list[RankExit]:
        out: list[RankExit] = []
        while True:
            try:
                out.append(self._exits.get_nowait())
            except queue.Empty:
                return sorted(out, key=lambda e: e.time_us)

    def wait_exit(self, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Wait up to `timeout_s` for a rank to exit (the supervisor's poll wakes at once on a
        crash instead of at its next tick); True if one did since the last call. (The ranks'
        exits wake it, so `sleep` is not used.)"""
        exited = self._exited.wait(timeout_s)
        self._exited.clear()
        return exited

    def pid_of(self, rank: int) -> int | None:
        for proc in self._ranks:
            if proc.rank == rank and proc.popen.poll() is None:
                return proc.popen.pid
        return None

    # -- stopping --------------------------------------------------------------------------
    def stop(self, *, grace_s: float = 3.0) -> None:
        self._stopping = True
        if self._plan is not None:
            self._note_stopped(self._plan.attempt)
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

    def _stop_agents(self) -> None:
        _end_agents(self._agents)
        self._agents = {}

    def finish(self) -> None:
        """The attempt ended by itself: let the node agents ship what they hold, then stop them."""
        self._stopping = True
        self._ship_spools()
        self._stop_agents()

    def _ship_spools(self, *, stalled_s: float = 10.0, limit_s: float = 300.0) -> None:
        """No later agent ships what a finished job's node agents still spool (a backlog piled
        up while the store or this controller was away; an agent given SIGTERM ships for 10 s
        only): keep them running while their spools shrink, up to `limit_s`, and give up once
        nothing shipped for `stalled_s` (the store is unreachable)."""
        root = self.workdir / "spool"
        left = waiting_segments(root)
        if not left:
            return
        log.info("job over: waiting for the node agents to ship %d spooled segment(s)", left)
        began = moved = time.monotonic()
        while left and time.monotonic() - moved < stalled_s and time.monotonic() - began < limit_s:
            time.sleep(0.2)
            now_left = waiting_segments(root)
            if now_left < left:
                moved = time.monotonic()
            left = now_left
        if left:
            log.warning("job over: %d spooled segment(s) not shipped after %.0f s; they stay in %s "
                        "for a node agent started on it", left, time.monotonic() - began, root)

    def isolate(self, node: NodeId, *, reason: str) -> None:
        self.isolated[node] = reason
        self.keepers.drop(node)

    def close(self) -> None:
        self._close_spares()
        if any(p.popen.poll() is None for p in self._ranks) or self._agents:
            self.stop(grace_s=1.0)
        self.keepers.close()
        shutil.rmtree(self._sockdir, ignore_errors=True)
        for old in self._old_sockdirs:
            shutil.rmtree(old, ignore_errors=True)


def _entries(value: object) -> list[dict[str, object]]:
    """The process entries of a pid file's list (whatever else it holds is ignored)."""
    return [e for e in value if isinstance(e, dict)] if isinstance(value, list) else []


def _noted_ranks(noted: Mapping[str, object]) -> dict[int, dict[str, object]]:
    """A pid file's rank entries by rank."""
    return {int(str(e.get("rank"))): e for e in _entries(noted.get("ranks"))}


def _noted_status(entry: Mapping[str, object]) -> int:
    """How a noted rank ended, as its status file says (`EXIT_UNKNOWN` without one)."""
    pid = entry.get("pid")
    if not isinstance(pid, int) or not pid:
        return EXIT_UNKNOWN
    return _Adopted(pid, 0, str(entry.get("exit_file", ""))).status()


def _end_agents(agents: Mapping[NodeId, _Process], timeout_s: float = 15.0) -> None:
    """SIGTERM node agents (they ship what they hold, or spool it) and wait for them together
    for up to `timeout_s`; kill those still running then."""
    for agent in agents.values():
        if agent.poll() is None:
            agent.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for node, agent in agents.items():
        try:
            agent.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("node agent %s did not finish shipping in %.0f s; killing it "
                        "(its spool keeps what it held)", node, timeout_s)
            agent.kill()
            agent.wait()


def _kill_group_of(pid: int) -> None:
    """SIGKILL the process group of `pid` (a rank leads its own), stopped members too; only the
    process itself if it shares this controller's group."""
    with contextlib.suppress(ProcessLookupError):
        group = os.getpgid(pid)
        if group == os.getpgid(0):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
        else:
            os.killpg(group, signal.SIGCONT)
            os.killpg(group, signal.SIGKILL)


def _signal_group(popen: _Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(popen.pid, sig)
