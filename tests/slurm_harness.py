"""A real Slurm cluster on this one machine, for tests: munged and slurmctld on the host, and one
slurmd per "node", each in its own network and UTS namespace.

Debian's slurmd (22.05) is not built with `--enable-multiple-slurmd`, so two slurmds on one host
would be one node. Here each slurmd runs in namespaces of its own and is a host of its own:

    this machine                                  node-1: netns th-<id>-node-1
      munged (its own key and socket)               host name node-1, address 10.A.B.11
      slurmctld (SlurmctldHost=<host>(10.A.B.1))    slurmd -D and the job steps it starts
      bridge th<id>b 10.A.B.1/24 ---- veth ----   node-2: ... address 10.A.B.12

- Every node's veth hangs on one bridge whose host end has the address `host_address`
  (10.A.B.1; a /24 of 10/8 that no interface or route of the machine uses). Nodes reach each
  other over the bridge (gloo's ranks of one job on two nodes, srun's step traffic) and the
  host's daemons at `host_address`; slurmctld reaches each slurmd at its `NodeAddr`.
- **A service the test runs on the host for jobs to reach (a trace store's ingest endpoint)
  must listen on `host_address` (or on every address), and the job must be given that address.**
  127.0.0.1 inside a node is the node's own loopback, not the host's: a service bound to the
  host's 127.0.0.1 cannot be reached from a job (connection refused).
- Each slurmd runs under `nsenter --net` (not `ip netns exec`, which mounts a fresh /sys without
  /sys/fs/cgroup, and slurmd 22.05 then fails "Unable to initialize cgroup plugin") and
  `unshare --uts --mount`, which gives it its host name and private bind mounts of /etc/hosts
  (every node's and the controller's name and address) and /etc/nsswitch.conf (`hosts: files`:
  the namespaces have no DNS server, and a lookup that falls through to DNS waits 10 s).
  Everything else of the file system is shared, as on a cluster with one shared file system:
  /tmp too, so per-node paths (a node agent's socket) must carry the node's name.
- munged gets its own key and socket under the work directory (`AuthInfo=socket=...`), and the
  daemons their own ports, so the cluster never meets another one on this machine, nor a munged
  or slurmd of the system's.
- The job credential lifetime is `cred_expire=10` s: Slurm keeps a requeued job pending for that
  long plus a second (the default 120 s would make every requeue test wait two minutes), and the
  scheduler looks at pending jobs every 2 s (`sched_interval`, `bf_interval`; by default a job
  that became eligible waited up to 30 s for the backfill pass here).
- Each node has `CPUs=2` (`SlurmdParameters=config_overrides`: what the machine has does not
  matter), and the partition says `OverSubscribe=YES`: a 4-task job gets 2 tasks on each of 2
  nodes.

Every daemon is a child of this process, started with a parent-death signal (`setpriv
--pdeathsig TERM`), so they die with it even when it is killed. `stop()` cancels the cluster's
jobs, ends the daemons, kills whatever is still inside a node's namespace (job steps are not
slurmd's children) and deletes the namespaces and links. Namespaces and links that a dead
process left behind are deleted at the next start.

Needs root, `ip`, `nsenter`, `unshare` and `setpriv` (util-linux), and Debian's slurmctld, slurmd,
slurm-client and munge (`bash scripts/install-slurm.sh`).

    python tests/slurm_harness.py start --dir /tmp/slurm    # prints SLURM_CONF=..., until SIGTERM
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import itertools
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from clickhouse_harness import pid_runs

T = TypeVar("T")

INSTALL_HINT = ("bash scripts/install-slurm.sh (apt-get install -y slurmctld slurmd slurm-client "
                "munge)")
PARTITION = "batch"
CPUS_PER_NODE = 2
CRED_EXPIRE_S = 10
"""Job credential lifetime; a requeued job stays pending this long plus one second."""
STARTUP_TIMEOUT_S = 180.0
"""How long the daemons may take until every node is IDLE (about 2 s here; generous for a
loaded machine)."""
COMMAND_TIMEOUT_S = 60.0
"""How long one Slurm client command may take."""
_NAME = re.compile(r"^th-(\d+)([a-z])-")
_LINK = re.compile(r"^th(\d+)([a-z])[bh]\d*$")
_counter = itertools.count()


class HarnessError(RuntimeError):
    """The test cluster could not be started, used or stopped."""


_PACKAGE_OF = {"ip": "iproute2", "nsenter": "util-linux", "unshare": "util-linux",
               "setpriv": "util-linux"}


def _need(binary: str) -> str:
    found = shutil.which(binary) or next(
        (p for p in (f"/usr/sbin/{binary}", f"/sbin/{binary}") if os.path.exists(p)), None)
    if found is None:
        package = _PACKAGE_OF.get(binary)
        hint = f"apt-get install -y {package}" if package else INSTALL_HINT
        raise HarnessError(f"{binary} is not installed: {hint}")
    return found


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise HarnessError(f"ip {' '.join(argv)} exited with {done.returncode}: "
                           f"{done.stderr.strip()}")
    return done


def _netns_pids(netns: str) -> list[int]:
    done = _ip("netns", "pids", netns, check=False)
    return [int(p) for p in done.stdout.split() if p.isdigit()]


def _kill_netns(netns: str) -> None:
    """SIGKILL every process inside `netns` until none is left (job steps are reparented to
    init, so no daemon of ours can be asked to end them)."""
    for _ in range(50):
        pids = [p for p in _netns_pids(netns) if pid_runs(p)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def sweep_stale() -> list[str]:
    """Delete the namespaces and links of clusters whose process is gone (killed before its
    `stop()`), ending whatever still runs in them; returns what was deleted."""
    removed = []
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    for line in listed:
        name = line.split(" ", 1)[0]
        match = _NAME.match(name)
        if match and not pid_runs(int(match.group(1))):
            _kill_netns(name)
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        name = parts[1].strip().split("@", 1)[0]
        match = _LINK.match(name)
        if match and not pid_runs(int(match.group(1))):
            _ip("link", "delete", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.0.0.0/8 that no address or route of this machine overlaps."""
    used = []
    for line in _ip("-4", "-o", "addr", "show", check=False).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            used.append(ipaddress.ip_network(words[words.index("inet") + 1], strict=False))
    for line in _ip("-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        try:
            if first not in ("default", "broadcast", "local", "unreachable"):
                used.append(ipaddress.ip_network(first, strict=False))
        except ValueError:
            continue
    chooser = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        second, third = chooser.randrange(64, 250), chooser.randrange(1, 255)
        net = ipaddress.ip_network(f"10.{second}.{third}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise HarnessError("no free /24 in 10.0.0.0/8 for the test cluster's bridge")


def _tail(path: Path, lines: int = 25) -> str:
    if not path.exists():
        return f"--- {path}: (not written)"
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return f"--- {path} (last {len(text)} lines)\n" + "\n".join(text)


@dataclass(frozen=True, slots=True)
class SlurmNode:
    name: str
    """Its host name inside its namespace, and its NodeName."""
    address: str
    """Its address on the bridge (NodeAddr)."""
    netns: str


@dataclass
class SlurmCluster:
    """A running test cluster. `env` is the whole environment for Slurm's client commands
    against it (this process's with SLURM_CONF); `run`, `sbatch` and the `wait_*` helpers use
    it."""

    workdir: Path
    conf: Path
    nodes: tuple[SlurmNode, ...]
    host_address: str
    """The host's address on the nodes' bridge: where a job reaches a service of the test's."""
    partition: str
    env: dict[str, str]
    _processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _links: list[str] = field(default_factory=list, repr=False)

    @property
    def node_names(self) -> list[str]:
        return [n.name for n in self.nodes]

    # -- commands ---------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True, env: Mapping[str, str] | None = None,
            timeout: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (`sinfo`, `scontrol ...`) against this cluster; with
        `check`, HarnessError naming the command, its status and stderr when it fails. `env`
        is added to the cluster's."""
        done = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                              env={**self.env, **(env or {})}, timeout=timeout)
        if check and done.returncode != 0:
            raise HarnessError(f"{' '.join(argv)} exited with {done.returncode}: "
                               f"{done.stderr.strip() or done.stdout.strip()}")
        return done

    def sbatch(self, script: Path | str, *options: str, args: Sequence[str] = (),
               env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
        """Submit `script` (a file, or the text of one) with sbatch's `options` and the
        script's own `args` (a file's only), with `env` added to the cluster's; the job id."""
        argv = ["sbatch", "--parsable", *options]
        stdin = None
        if isinstance(script, Path):
            argv += [str(script), *args]
        elif args:
            raise HarnessError("a script given as text takes no arguments: write it to a file")
        else:
            stdin = script
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False,
                              env={**self.env, **(env or {})}, cwd=cwd,
                              timeout=COMMAND_TIMEOUT_S)
        if done.returncode != 0:
            raise HarnessError(f"{' '.join(argv)} exited with {done.returncode}: "
                               f"{done.stderr.strip()}")
        return done.stdout.strip().split(";", 1)[0]

    def job_state(self, job_id: str) -> str:
        """The job's state as squeue prints it (RUNNING, PENDING, COMPLETED, ...)."""
        return self.run("squeue", "-h", "-j", job_id, "-t", "all", "-o", "%T").stdout.strip()

    def job_field(self, job_id: str, key: str) -> str:
        """One `Key=value` of `scontrol show job` ("" when absent)."""
        text = self.run("scontrol", "show", "job", job_id, "--oneliner").stdout
        match = re.search(rf"(?:^|\s){re.escape(key)}=(\S*)", text)
        return match.group(1) if match else ""

    def node_states(self) -> dict[str, str]:
        """Every node's state as sinfo prints it (idle, allocated, drained, draining, ...)."""
        out = self.run("sinfo", "-h", "-N", "-p", self.partition, "-o", "%N %T").stdout
        return dict(line.split(None, 1) for line in out.splitlines() if line.strip())

    def wait_for(self, what: str, probe: Callable[[], T], timeout: float = 300.0) -> T:
        """Poll `probe` until it returns something true; HarnessError naming `what` and the
        last value after `timeout` seconds (a guard against hanging, not a time limit)."""
        deadline = time.monotonic() + timeout
        last: T | None = None
        while time.monotonic() < deadline:
            last = probe()
            if last:
                return last
            time.sleep(0.2)
        raise HarnessError(f"{what}: not within {timeout:.0f} s (last seen: {last!r})\n"
                           + self.logs())

    def wait_job_state(self, job_id: str, states: Collection[str],
                       timeout: float = 300.0) -> str:
        """Wait until job `job_id` is in one of `states` (squeue's words); returns it."""
        wanted = set(states)

        def probe() -> str:
            state = self.job_state(job_id)
            return state if state in wanted else ""

        return self.wait_for(f"job {job_id} in {sorted(wanted)}", probe, timeout)

    def wait_nodes_idle(self, timeout: float = 300.0) -> None:
        """Wait until every node is idle (no job, not drained)."""
        self.wait_for("every node idle",
                      lambda: all(s == "idle" for s in self.node_states().values()), timeout)

    def reset(self) -> None:
        """Back to a fresh cluster for the next test: cancel every job, resume every node that
        is drained or down, and wait until all are idle."""
        self.run("scancel", "--partition", self.partition, check=False)
        self.wait_for("no job left", lambda: not self.run(
            "squeue", "-h", "-o", "%i").stdout.strip())
        states = self.node_states()
        busy = [n for n, s in states.items() if s not in ("idle", "allocated", "mixed",
                                                          "completing")]
        if busy:
            self.run("scontrol", "update", f"NodeName={','.join(busy)}", "State=RESUME",
                     check=False)
        self.wait_nodes_idle()

    def logs(self, lines: int = 25) -> str:
        """The tails of the daemons' logs: each one's log file, else what it printed
        (`<daemon>.out`: munged's only log, and a daemon's words before its log was open)."""
        log = self.workdir / "log"
        parts = []
        for name in ["munged", "slurmctld", *(f"slurmd-{n.name}" for n in self.nodes)]:
            own = log / f"{name}.log"
            parts.append(_tail(own if own.exists() and own.stat().st_size else
                               log / f"{name}.out", lines))
        return "\n".join(parts)

    # -- stop -------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel every job, end the daemons, kill what is left inside the nodes' namespaces,
        delete the namespaces and links. Safe to call twice."""
        if self._processes.get("slurmctld") is not None and self._processes[
                "slurmctld"].poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run("scancel", "--partition", self.partition, check=False, timeout=5)
        for name in [*(f"slurmd-{n.name}" for n in self.nodes), "slurmctld", "munged"]:
            process = self._processes.pop(name, None)
            if process is not None:
                _end(process)
        for node in self.nodes:
            _kill_netns(node.netns)
            _ip("netns", "delete", node.netns, check=False)
        for link in self._links:
            _ip("link", "delete", link, check=False)
        self._links.clear()

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class JobStore:
    """A store a test holds for the jobs it submits to a cluster (`job_store`)."""

    store: Any
    """The `TraceStore`, an embedded one this process holds."""
    server: Any
    """Its ingest endpoint (`IngestServer`) on the cluster's bridge, for the jobs' node agents."""
    env: dict[str, str]
    """What a job is submitted with: the sink, its token, this venv's commands on PATH."""


@contextlib.contextmanager
def job_store(cluster: SlurmCluster, directory: Path) -> Iterator[JobStore]:
    """An embedded store in `directory` whose ingest endpoint the cluster's jobs ship to: the
    test server listens on the host's loopback only, which a node in its own network namespace
    cannot reach, so the test holds the store and serves its ingest on the bridge address, with
    a token, as `tracehound run` does for remote agents."""
    from tracehound.tracing.store import open_store
    from tracehound.tracing.store.ingest import IngestServer

    store = open_store(f"chdb://{directory}")
    token = secrets.token_hex(16)
    server = IngestServer(store, host=cluster.host_address, token=token).start()
    env = {"TRACEHOUND_SINK": server.url, "TRACEHOUND_INGEST_TOKEN": token,
           "PATH": os.pathsep.join([str(Path(sys.executable).parent),
                                    cluster.env.get("PATH", os.defpath)]),
           "OMP_NUM_THREADS": "1"}
    try:
        yield JobStore(store, server, env)
    finally:
        server.stop()
        store.close()


def _end(process: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _slurm_conf(*, workdir: Path, host: str, host_address: str, ctld_port: int,
                slurmd_port: int, munge_socket: Path, nodes: Sequence[SlurmNode]) -> str:
    node_lines = "\n".join(
        f"NodeName={n.name} NodeAddr={n.address} NodeHostname={n.name} CPUs={CPUS_PER_NODE} "
        "State=UNKNOWN" for n in nodes)
    names = ",".join(n.name for n in nodes)
    return f"""\
# Written by tests/slurm_harness.py for one test session.
ClusterName=tracehound
SlurmctldHost={host}({host_address})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={CRED_EXPIRE_S}
SlurmUser=root
SlurmdUser=root
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=2
ReturnToService=2
JobRequeue=1
MinJobAge=600
KillWait=5
InactiveLimit=0
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation={workdir / "state"}
SlurmdSpoolDir={workdir / "spool"}/%n
SlurmctldPidFile={workdir / "run" / "slurmctld.pid"}
SlurmdPidFile={workdir / "run"}/slurmd-%n.pid
SlurmctldLogFile={workdir / "log" / "slurmctld.log"}
SlurmdLogFile={workdir / "log"}/slurmd-%n.log
{node_lines}
PartitionName={PARTITION} Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


def start_cluster(workdir: Path, *, nodes: int = 2,
                  startup_timeout: float = STARTUP_TIMEOUT_S) -> SlurmCluster:
    """Start a cluster of `nodes` nodes (node-1, node-2, ...) with its files under `workdir`;
    returns once every node is IDLE. HarnessError with the daemons' log tails when it does not
    get there within `startup_timeout` seconds, or saying what to install."""
    if nodes < 1:
        raise ValueError(f"nodes {nodes!r}: expected a number of nodes >= 1")
    if os.geteuid() != 0:
        raise HarnessError("the Slurm test cluster needs root (network namespaces, slurmd)")
    binaries = {b: _need(b) for b in ("munged", "slurmctld", "slurmd", "sinfo", "nsenter",
                                       "unshare", "setpriv", "ip")}
    sweep_stale()
    workdir = Path(workdir).resolve()
    for sub in ("munge", "state", "spool", "run", "log", "etc"):
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    (workdir / "munge").chmod(0o700)
    tag = f"{os.getpid()}{'abcdefghijklmnopqrstuvwxyz'[next(_counter) % 26]}"
    subnet = _free_subnet()
    host_address = str(subnet.network_address + 1)
    members = tuple(SlurmNode(name=f"node-{i}", address=str(subnet.network_address + 10 + i),
                              netns=f"th-{tag}-node-{i}") for i in range(1, nodes + 1))
    # this process's environment without Slurm's variables (a test run from inside a job) and
    # Tracehound's settings: a job gets only what its test gives it
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SQUEUE_", "TRACEHOUND_"))}
    env["SLURM_CONF"] = str(workdir / "slurm.conf")
    cluster = SlurmCluster(workdir=workdir, conf=workdir / "slurm.conf", nodes=members,
                           host_address=host_address, partition=PARTITION, env=env)
    try:
        _network(cluster, tag, subnet)
        host = socket.gethostname()
        _node_files(workdir, host, host_address, members)
        munge_socket = workdir / "munge" / "munge.socket"
        cluster.conf.write_text(_slurm_conf(
            workdir=workdir, host=host, host_address=host_address, ctld_port=_free_port(),
            slurmd_port=_free_port(), munge_socket=munge_socket, nodes=members))
        key = workdir / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        _spawn(cluster, "munged", [
            binaries["munged"], "--foreground", "--force", f"--key-file={key}",
            f"--socket={munge_socket}", f"--pid-file={workdir / 'run' / 'munged.pid'}",
            f"--seed-file={workdir / 'munge' / 'seed'}"])
        cluster.wait_for("munged's socket", munge_socket.exists, startup_timeout)
        _spawn(cluster, "slurmctld", [binaries["slurmctld"], "-D", "-i", "-f", str(cluster.conf)])
        for node in members:
            script = ('hostname "$1" && mount --bind "$2/hosts" /etc/hosts && '
                      'mount --bind "$2/nsswitch.conf" /etc/nsswitch.conf && '
                      'exec "$3" -D -f "$4"')
            _spawn(cluster, f"slurmd-{node.name}", [
                binaries["nsenter"], f"--net=/run/netns/{node.netns}", "--",
                binaries["unshare"], "--uts", "--mount", "--propagation", "private", "--",
                "/bin/sh", "-c", script, "sh", node.name, str(workdir / "etc"),
                binaries["slurmd"], str(cluster.conf)])
        deadline = time.monotonic() + startup_timeout

        def idle() -> bool:
            for name, process in cluster._processes.items():
                if process.poll() is not None:
                    raise HarnessError(f"{name} exited with {process.returncode} during start\n"
                                       + cluster.logs())
            done = cluster.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=15)
            states = dict(line.split(None, 1) for line in done.stdout.splitlines()
                          if line.strip())
            return done.returncode == 0 and sorted(states) == sorted(cluster.node_names) \
                and all(s == "idle" for s in states.values())

        cluster.wait_for("every node IDLE after the start", idle,
                         max(1.0, deadline - time.monotonic()))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _network(cluster: SlurmCluster, tag: str, subnet: ipaddress.IPv4Network) -> None:
    bridge = f"th{tag}b"
    _ip("link", "add", bridge, "type", "bridge")
    cluster._links.append(bridge)
    _ip("addr", "add", f"{cluster.host_address}/{subnet.prefixlen}", "dev", bridge)
    _ip("link", "set", bridge, "up")
    for i, node in enumerate(cluster.nodes, start=1):
        outer, inner = f"th{tag}h{i}", f"th{tag}n{i}"
        _ip("netns", "add", node.netns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        cluster._links.append(outer)
        _ip("link", "set", outer, "master", bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "netns", node.netns)
        _ip("-n", node.netns, "link", "set", "lo", "up")
        _ip("-n", node.netns, "addr", "add", f"{node.address}/{subnet.prefixlen}", "dev", inner)
        _ip("-n", node.netns, "link", "set", inner, "up")
        _ip("-n", node.netns, "route", "add", "default", "via", cluster.host_address)


def _node_files(workdir: Path, host: str, host_address: str,
                nodes: Sequence[SlurmNode]) -> None:
    """The /etc/hosts and /etc/nsswitch.conf every node sees (bind-mounted in its namespace)."""
    lines = ["127.0.0.1 localhost", f"{host_address} {host}",
             *(f"{n.address} {n.name}" for n in nodes)]
    (workdir / "etc" / "hosts").write_text("\n".join(lines) + "\n")
    try:
        nsswitch = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        nsswitch = []
    kept = [line for line in nsswitch if not line.startswith("hosts:")]
    (workdir / "etc" / "nsswitch.conf").write_text("\n".join([*kept, "hosts: files"]) + "\n")


def _spawn(cluster: SlurmCluster, name: str, argv: list[str]) -> None:
    """Start a daemon in the foreground, as this process's child, which the kernel sends SIGTERM
    when this process dies (`setpriv --pdeathsig`, kept through the execs that follow)."""
    with open(cluster.workdir / "log" / f"{name}.out", "ab") as out:
        cluster._processes[name] = subprocess.Popen(
            ["setpriv", "--pdeathsig", "TERM", "--", *argv], stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, env=cluster.env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a cluster, print its SLURM_CONF, stop it on "
                                         "SIGTERM/SIGINT")
    start.add_argument("--dir", required=True, type=Path, help="work directory of the cluster")
    start.add_argument("--nodes", type=int, default=2)
    args = parser.parse_args(argv)
    began = time.monotonic()
    cluster = start_cluster(args.dir, nodes=args.nodes)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"SLURM_CONF={cluster.conf}", flush=True)
    print(f"# {len(cluster.nodes)} nodes idle after {time.monotonic() - began:.1f} s: "
          + ", ".join(f"{n.name} {n.address}" for n in cluster.nodes)
          + f"; host address {cluster.host_address}", flush=True)
    try:
        done.wait()
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
