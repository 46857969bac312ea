"""The node agent's socket and spool are its user's (and the socket its group's) only.

- The socket is 0660: in a Kubernetes pod the ranks run in another container as another user
  and reach the agent through the pod's fsGroup; nobody else may connect.
- The spool directory is 0700 and every file in it 0600 (the spool id, open, sealed and
  in-flight segments, `rejected/` and what is set aside there): the job's records, its names
  and stacks, are nobody else's to read. A spool directory left with looser modes is tightened
  when an agent opens it.

Both are checked under umask 000, so the modes come from the agent, not from a careful umask:
a real node agent process (`python -m tracehound.agent.node`, its sink a port where nothing
listens) for the socket and the directory, and the `Spool` itself for each kind of file.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from clickhouse_harness import free_port

from tracehound.agent.node.spool import Spool


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.e2e
def test_a_node_agents_socket_and_spool(tmp_path: Path) -> None:
    sock = tmp_path / "a.sock"
    spool = tmp_path / "spool" / "n0"
    spool.mkdir(parents=True, mode=0o777)
    os.chmod(spool, 0o755)  # an older agent's, or made by hand
    env = {**os.environ, "TRACEHOUND_SINK": f"http://127.0.0.1:{free_port()}"}
    agent = subprocess.Popen(
        [sys.executable, "-m", "tracehound.agent.node", "--job", "modes", "--node", "n0",
         "--socket", str(sock), "--spool", str(spool), "--gpu", "off",
         "--health-interval", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.umask(0),  # noqa: PLW1509 - only a umask, before exec
    )
    try:
        for _ in range(600):  # a hang guard: the agent listens within a second or two
            if sock.exists() and mode(sock) == 0o660:
                break
            assert agent.poll() is None, "the node agent ended"
            time.sleep(0.05)
        assert stat.S_ISSOCK(sock.lstat().st_mode)
        assert mode(sock) == 0o660
        assert mode(spool) == 0o700
        files = {p.name: mode(p) for p in spool.iterdir() if p.is_file()}
        assert files["spool-id"] == 0o600
        assert {name: m for name, m in files.items() if m != 0o600} == {}
    finally:
        agent.terminate()
        agent.wait(timeout=60)


def test_every_spool_file_is_the_agents_only(tmp_path: Path, open_umask: None) -> None:
    spool = Spool(tmp_path / "spool", node="n0", seal_records=2)
    assert mode(spool.directory) == 0o700
    spool.append([b'{"a":1}'])  # an open segment
    opened = sorted(spool.directory.glob("seg-*"))
    assert len(opened) == 1 and mode(opened[0]) == 0o600
    spool.append([b'{"a":2}'])  # full: sealed
    spool.append([b'{"a":3}', b'{"a":4}'])  # a second, sealed at once
    sealed = spool.sealed()
    assert len(sealed) == 2
    spool.mark_in_flight(sealed[0])
    spool.mark_in_flight(sealed[1])
    target = spool.set_aside(sealed[1])
    assert mode(target.parent) == 0o700
    everything = sorted(p for p in spool.directory.rglob("*"))
    assert len(everything) == 5  # spool id, a sealed segment, its in-flight marker, rejected/
    assert {p.relative_to(spool.directory).as_posix(): mode(p) for p in everything} == {
        **{p.relative_to(spool.directory).as_posix(): 0o600
           for p in everything if p.is_file()},
        "rejected": 0o700,
    }
    assert len([p for p in everything if p.is_file()]) == 4
