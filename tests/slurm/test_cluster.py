"""The test cluster itself (tests/slurm_harness.py): its two nodes are two hosts, with a name and
an address each, one job spans both, its tasks reach a service of the test at the host's bridge
address (and not at the host's loopback), and a stopped cluster leaves no daemon, job process,
namespace or link behind."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
from slurm_harness import SlurmCluster, start_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.slurm]

REPORT = """#!/bin/bash
# every task says where it runs, then connects to the test's service and to one on the host's
# loopback, and says how that went
srun --ntasks=4 --ntasks-per-node=2 python3 -c '
import os, socket
me = os.environ["SLURM_PROCID"] + " " + socket.gethostname()
for name, port in (("bridge", int(os.environ["BRIDGE_PORT"])),
                   ("loopback", int(os.environ["LOOPBACK_PORT"]))):
    host = os.environ["BRIDGE_HOST"] if name == "bridge" else "127.0.0.1"
    try:
        with socket.create_connection((host, port), timeout=20) as conn:
            conn.sendall(me.encode())
        print(me, name, "reached", flush=True)
    except OSError as exc:
        print(me, name, type(exc).__name__, flush=True)
'
"""


class Listener:
    """A TCP service on one address that keeps what each connection sent, with its peer."""

    def __init__(self, host: str) -> None:
        self.sock = socket.create_server((host, 0))
        self.port = self.sock.getsockname()[1]
        self.got: list[tuple[str, str]] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return
            with conn:
                self.got.append((peer[0], conn.recv(200).decode()))

    def close(self) -> None:
        self.sock.close()


def test_one_job_spans_both_nodes_and_reaches_the_host_at_the_bridge_address(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    bridge, loopback = Listener(slurm_cluster.host_address), Listener("127.0.0.1")
    try:
        job = slurm_cluster.sbatch(
            REPORT, "--ntasks=4", "--ntasks-per-node=2", f"--output={tmp_path / 'out'}",
            env={"BRIDGE_HOST": slurm_cluster.host_address, "BRIDGE_PORT": str(bridge.port),
                 "LOOPBACK_PORT": str(loopback.port)})
        assert slurm_cluster.wait_job_state(job, {"COMPLETED", "FAILED"}) == "COMPLETED", \
            (tmp_path / "out").read_text()
    finally:
        bridge.close()
        loopback.close()
    lines = sorted((tmp_path / "out").read_text().splitlines())
    assert lines == [
        "0 node-1 bridge reached", "0 node-1 loopback ConnectionRefusedError",
        "1 node-1 bridge reached", "1 node-1 loopback ConnectionRefusedError",
        "2 node-2 bridge reached", "2 node-2 loopback ConnectionRefusedError",
        "3 node-2 bridge reached", "3 node-2 loopback ConnectionRefusedError",
    ]
    # each connection came from its node's own address
    address = {n.name: n.address for n in slurm_cluster.nodes}
    assert all(peer == address[said.split()[1]] for peer, said in bridge.got)
    assert sorted(said for _, said in bridge.got) == ["0 node-1", "1 node-1", "2 node-2",
                                                      "3 node-2"]
    assert loopback.got == []


def test_a_stopped_cluster_leaves_nothing_behind(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # a cluster of its own beside the session's (its own ports, subnet and munged), with a job
    # still running when it stops
    own = start_cluster(tmp_path / "own", nodes=1)
    try:
        assert own.host_address != slurm_cluster.host_address
        job = own.sbatch("#!/bin/bash\nsleep 600\n", "--ntasks=1", "--output=/dev/null")
        own.wait_job_state(job, {"RUNNING"})
        netns = own.nodes[0].netns

        def job_sleeps() -> list[int]:
            inside = [int(p) for p in subprocess.run(
                ["ip", "netns", "pids", netns], capture_output=True, text=True,
                check=True).stdout.split()]
            return inside if "sleep" in [_name(p) for p in inside] else []

        inside = own.wait_for("the job's sleep in node-1", job_sleeps)
        daemons = [p.pid for p in own._processes.values()]
        assert len(daemons) == 3  # munged, slurmctld, slurmd
        assert {"slurmd", "slurmstepd", "sleep"} <= {_name(p) for p in inside}
    finally:
        own.stop()
    still = [pid for pid in [*daemons, *inside] if _running(pid)]
    assert still == []
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                check=True).stdout
    assert own.nodes[0].netns not in namespaces
    assert slurm_cluster.nodes[0].netns in namespaces
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           check=True).stdout
    tag = own.nodes[0].netns.split("-")[1]
    assert f"th{tag}" not in links
    # the session's cluster did not notice
    assert set(slurm_cluster.node_states().values()) == {"idle"}


def _name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z" and os.path.exists(f"/proc/{pid}")
