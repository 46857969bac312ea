"""Snapshots of real torch state, held by real keepers (their HTTP servers on loopback in this
process), persisted to disk, and the restore that every rank agrees on.

The other ranks of a job are played by `Peers`, which answers each of the restore's gathers
with what the other ranks would say: the agreement is tested step by step without processes
(the e2e tests run it with real ranks).
"""

from __future__ import annotations

import errno
import logging
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tracehound.agent.node.keeper import SnapshotKeeper, serve
from tracehound.agent.rank import snapshot as snapshot_module
from tracehound.agent.rank.keepers import KeeperClient, Keepers
from tracehound.agent.rank.restore import Source, common_steps, restore
from tracehound.agent.rank.snapshot import (
    MARKER,
    Identity,
    SnapshotBudgetError,
    Snapshotter,
    snapshot_file,
    step_path,
)
from tracehound.tracing.snapshots import decode, encode


class Cluster:
    """Keepers on loopback, one per node name."""

    def __init__(self, nodes: list[str], budget: int = 10**8) -> None:
        self.keepers = {n: SnapshotKeeper(budget_bytes=budget, keep=2) for n in nodes}
        self.servers = {n: serve(k, host="127.0.0.1", port=0, node=n)
                        for n, k in self.keepers.items()}
        self.clients = [KeeperClient(node=n, url=f"http://127.0.0.1:{s.port}", timeout_s=2)
                        for n, s in self.servers.items()]

    def place(self, node: str) -> Keepers:
        return Keepers.place(self.clients, node)

    def lose(self, node: str) -> None:
        self.servers[node].close()
        for client in self.clients:
            if client.node == node:
                client.close()

    def close(self) -> None:
        for node in list(self.servers):
            self.lose(node)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    c = Cluster(["node-0", "node-1"])
    yield c
    c.close()


def who(rank: int = 0, node: str = "node-0", world: int = 1, job: str = "j") -> Identity:
    return Identity(job=job, rank=rank, world=world, node=node, attempt=0)


def model_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    return {"model": model.state_dict(), "optim": optim.state_dict(), "epoch": seed}


def alone(value: object) -> list[Any]:
    return [value]


class Peers:
    """Rank 1 of a two-rank job: its answers to the gathers, in order."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.asked: list[object] = []

    def __call__(self, value: object) -> list[Any]:
        self.asked.append(value)
        return [value, self.answers.pop(0)]


def test_the_snapshot_is_a_copy_taken_at_the_call(cluster: Cluster) -> None:
    state = model_state()
    before = state["model"]["weight"].clone()
    writer = Snapshotter(identity=who(), keepers=cluster.place("node-0"))
    writer.snapshot(state, 5)
    state["model"]["weight"].add_(100.0)  # training goes on at once
    assert writer.flush(10)
    target = model_state(seed=1)
    found = restore(target, who(), cluster.place("node-0"), None, alone)
    assert found is not None and found.step == 5 and found.source == Source("keeper", "node-0")
    assert torch.equal(target["model"]["weight"], before)
    assert target["epoch"] == 0
    assert writer.stats.sent_own == 1 and writer.stats.sent_replica == 1


def test_a_lost_node_is_restored_from_the_replica_on_another(cluster: Cluster) -> None:
    state = model_state()
    writer = Snapshotter(identity=who(node="node-1"), keepers=cluster.place("node-1"))
    for step in (1, 2, 3):
        writer.snapshot(state, step)
        writer.flush(10)
    cluster.lose("node-1")
    target = model_state(seed=1)
    found = restore(target, who(node="node-2"), cluster.place("node-2"), None, alone)
    assert found is not None
    assert found.describe() == "step 3 from the memory of node node-0"
    assert torch.equal(target["optim"]["state"][0]["momentum_buffer"],
                       state["optim"]["state"][0]["momentum_buffer"])


def test_a_replica_keeper_away_is_counted_and_training_goes_on(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    cluster.lose("node-1")
    writer = Snapshotter(identity=who(), keepers=cluster.place("node-0"))
    with caplog.at_level(logging.DEBUG):
        for step in (1, 2):
            writer.snapshot(model_state(), step)
            writer.flush(10)
    assert (writer.stats.sent_own, writer.stats.send_failed) == (2, 2)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "not held by node node-1" in warned[0].getMessage()


def test_a_state_larger_than_the_keepers_budget_is_refused_at_the_first_snapshot() -> None:
    small = Cluster(["node-0"], budget=1000)
    try:
        writer = Snapshotter(identity=who(), keepers=small.place("node-0"))
        with pytest.raises(SnapshotBudgetError, match="TRACEHOUND_SNAPSHOT_BUDGET_MB"):
            writer.snapshot({"w": torch.zeros(10_000)}, 1)
    finally:
        small.close()


def persist_steps(tmp_path: Path, world: int, steps: list[int]) -> list[Snapshotter]:
    writers = [Snapshotter(identity=who(rank=r, world=world), keepers=Keepers((), None, None))
               for r in range(world)]
    for step in steps:
        for rank, writer in enumerate(writers):
            writer.snapshot({"w": torch.full((4,), float(step * 10 + rank))}, step,
                            persist_dir=tmp_path)
            writer.flush(10)
    return writers


def test_the_marker_comes_with_the_last_ranks_file(tmp_path: Path) -> None:
    writers = [Snapshotter(identity=who(rank=r, world=2), keepers=Keepers((), None, None))
               for r in range(2)]
    writers[0].snapshot({"w": torch.zeros(2)}, 4, persist_dir=tmp_path)
    writers[0].flush(10)
    assert not (step_path(tmp_path, 4) / MARKER).exists()
    writers[1].snapshot({"w": torch.zeros(2)}, 4, persist_dir=tmp_path)
    writers[1].flush(10)
    assert (step_path(tmp_path, 4) / MARKER).read_text() == "4\n"


def test_a_damaged_file_is_refused_and_the_restore_falls_back(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    persist_steps(tmp_path, 1, [1, 2])
    damaged = snapshot_file(step_path(tmp_path, 2), 0)
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x40
    damaged.write_bytes(bytes(data))
    target: dict[str, Any] = {"w": torch.zeros(4)}
    found = restore(target, who(), Keepers((), None, None), tmp_path, alone)
    assert found is not None and found.step == 1
    assert torch.equal(target["w"], torch.full((4,), 10.0))
    assert any("not restoring step 2" in r.getMessage() and "fails its checksum" in r.getMessage()
               for r in caplog.records)


def test_a_snapshot_of_another_world_size_or_job_is_refused(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    persist_steps(tmp_path, 1, [1])
    step_dir = step_path(tmp_path, 2)
    step_dir.mkdir()
    snapshot_file(step_dir, 0).write_bytes(encode(
        job="j", rank=0, world=8, step=2, attempt=0, node="x", created_us=0, payload=b"x"))
    (step_dir / MARKER).write_text("2\n")
    found = restore({"w": torch.zeros(4)}, who(), Keepers((), None, None), tmp_path, alone)
    assert found is not None and found.step == 1
    assert any("refused, it is of world size 8, expected 1" in r.getMessage()
               for r in caplog.records)
    found = restore({"w": torch.zeros(4)}, who(job="other"), Keepers((), None, None), tmp_path,
                    alone)
    assert found is None
    assert any("refused, it is of job 'j', expected 'other'" in r.getMessage()
               for r in caplog.records)


def test_every_rank_resumes_from_the_newest_step_they_all_hold(cluster: Cluster) -> None:
    writer = Snapshotter(identity=who(world=2), keepers=cluster.place("node-0"))
    for step in (6, 7):
        writer.snapshot({"w": torch.full((2,), float(step))}, step)
        writer.flush(10)
    assert common_steps([[6, 7], [5, 6]]) == [6]
    # rank 1 holds 5 and 6 only, and then has its part of step 6
    peers = Peers([5, 6], True)
    target: dict[str, Any] = {"w": torch.zeros(2)}
    found = restore(target, who(world=2), cluster.place("node-0"), None, peers)
    assert found is not None and found.step == 6 and peers.asked == [[6, 7], True]
    assert torch.equal(target["w"], torch.full((2,), 6.0))


def test_a_step_one_rank_cannot_load_moves_every_rank_to_an_older_one(cluster: Cluster) -> None:
    writer = Snapshotter(identity=who(world=2), keepers=cluster.place("node-0"))
    for step in (6, 7):
        writer.snapshot({"w": torch.full((2,), float(step))}, step)
        writer.flush(10)
    # rank 1 lists step 7, but its copy turns out damaged: no DCP either, so both go to step 6
    peers = Peers([6, 7], False, False, True)
    target: dict[str, Any] = {"w": torch.zeros(2)}
    found = restore(target, who(world=2), cluster.place("node-0"), None, peers)
    assert found is not None and found.step == 6
    assert peers.asked == [[6, 7], True, False, True]
    assert torch.equal(target["w"], torch.full((2,), 6.0))


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A 64 KiB tmpfs (root may mount here); else a directory whose durable writes fail with
    ENOSPC at the same call."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                             check=False, capture_output=True).returncode == 0
    if not mounted:
        def full(path: Path, data: bytes, *, tmp: Path | None = None) -> None:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        monkeypatch.setattr(snapshot_module, "write_atomic", full)
    try:
        yield mount
    finally:
        if mounted:
            subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_leaves_the_step_incomplete_and_training_on(
        small_disk: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = Snapshotter(identity=who(), keepers=Keepers((), None, None))
    writer.snapshot({"w": torch.zeros(64 * 1024)}, 3, persist_dir=small_disk)  # 256 KiB
    assert writer.flush(10)
    assert (writer.stats.persisted, writer.stats.persist_failed) == (0, 1)
    step_dir = step_path(small_disk, 3)
    assert not (step_dir / MARKER).exists()
    assert [p.name for p in step_dir.iterdir()] == []  # the cut temporary file is gone
    assert any("No space left" in r.getMessage() for r in caplog.records)
    writer.snapshot({"w": torch.zeros(16)}, 4, persist_dir=small_disk)  # room again
    assert writer.flush(10) and writer.stats.persisted == 1
    assert (step_path(small_disk, 4) / MARKER).exists()


class SlowKeeper(KeeperClient):
    """A keeper that takes each snapshot only once `go` is set (a slow network)."""

    go: threading.Event = threading.Event()
    taken: list[int] = []

    def put(self, data: bytes) -> None:
        self.go.wait(10)
        self.taken.append(decode(data)[0].step)


def test_waiting_in_memory_snapshots_are_superseded_persisted_ones_kept(tmp_path: Path) -> None:
    slow = SlowKeeper(node="node-0", url="http://127.0.0.1:9")
    writer = Snapshotter(identity=who(), keepers=Keepers((slow,), slow, None))
    writer._checked_budget = True  # the slow keeper has no stats to ask
    writer.snapshot({"w": torch.zeros(2)}, 1)  # taken by the writer, which then waits
    deadline = time.monotonic() + 10
    while writer._waiting and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.snapshot({"w": torch.zeros(2)}, 2, persist_dir=tmp_path)
    writer.snapshot({"w": torch.zeros(2)}, 3)
    writer.snapshot({"w": torch.zeros(2)}, 4)
    slow.go.set()
    assert writer.flush(10)
    assert slow.taken == [1, 2, 4]
    assert writer.stats.superseded == 1 and writer.stats.sent_own == 3
    assert (step_path(tmp_path, 2) / MARKER).exists()


def test_without_a_keeper_in_memory_snapshots_cost_nothing_and_persisted_ones_still_land(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    writer = Snapshotter(identity=who(), keepers=Keepers((), None, None))
    writer.snapshot({"w": torch.zeros(2)}, 1)
    writer.snapshot({"w": torch.zeros(2)}, 2)
    writer.snapshot({"w": torch.zeros(2)}, 3, persist_dir=tmp_path)
    assert writer.flush(10)
    assert (writer.stats.unheld, writer.stats.staged, writer.stats.persisted) == (2, 1, 1)
    assert sum("no snapshot keeper for node node-0" in r.getMessage()
               for r in caplog.records) == 1
