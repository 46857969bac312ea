"""Runs a scenario of coverage_job.py on real gloo ranks with the recorder auto-installed, and
checks what the analysis relies on in what they recorded.

The records are taken from the ranks' unix socket by `SocketCollector`, which stands in for the
node agent's socket end only (it decodes the lines with the same `tracing.wire.decode_line`); the
ranks, their recorder and its transport are the real ones. The node agent itself is tested in
test_agent_end_to_end.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_harness import PYTHON, collect, free_port, rank_env

from tracehound.agent.rank.backend import BACKEND_SUFFIX
from tracehound.tracing.events import (
    CollectiveEvent,
    CollectiveState,
    Heartbeat,
    ProcessGroupInfo,
    Record,
)
from tracehound.tracing.summaries import COUNTED_SUFFIX, P2P_MARK, RECV_OPS, SEND_OPS
from tracehound.tracing.wire import decode_line

JOB = str(Path(__file__).resolve().parent / "coverage_job.py")
SEND_SIDE = (*SEND_OPS, "send_object_list")
RECV_SIDE = (*RECV_OPS, "recv_object_list")


class SocketCollector:
    """Listens on a unix socket like a node agent and keeps every record its ranks send."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[Record] = []
        self.bad_lines = 0
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(path))
        self._server.listen(16)
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> SocketCollector:
        self._accepting.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buffer = b""
        with conn:
            while chunk := conn.recv(1 << 16):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                self._keep(lines)
        self._keep([buffer])

    def _keep(self, lines: Iterable[bytes]) -> None:
        for line in lines:
            if not line.strip():
                continue
            try:
                record = decode_line(line)
            except ValueError:
                with self._lock:
                    self.bad_lines += 1
                continue
            with self._lock:
                self.records.append(record)

    def drain(self, timeout: float = 10.0) -> None:
        """Wait until every rank's connection is closed (the ranks flush at exit)."""
        deadline = time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))

    def of(self, kind: type) -> list[Any]:
        with self._lock:
            return [r for r in self.records if isinstance(r, kind)]


@dataclass
class Run:
    """What one scenario run left: the records, and each rank's `fact` lines and output."""

    collector: SocketCollector
    outputs: list[str]
    facts: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def events(self) -> list[CollectiveEvent]:
        return self.collector.of(CollectiveEvent)

    @property
    def infos(self) -> list[ProcessGroupInfo]:
        return self.collector.of(ProcessGroupInfo)

    @property
    def beats(self) -> list[Heartbeat]:
        return self.collector.of(Heartbeat)

    def fact(self, rank: int, kind: str) -> dict[str, Any]:
        return next(f for f in self.facts[rank] if f["kind"] == kind)


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def run_scenario(
    scenario: str, world: int, tmp_path: Path, *, heartbeat_s: float = 0.1,
    env: dict[str, str] | None = None, timeout: float = 180.0,
) -> Run:
    """Run `scenario` on `world` gloo ranks with the recorder on; every rank must succeed."""
    socket_path = tmp_path / "agent.sock"
    port = free_port()
    with SocketCollector(socket_path) as collector:
        procs = []
        for rank in range(world):
            rank_environ = rank_env(
                rank=rank, world=world, port=port, job=f"cov-{scenario}", attempt=0,
                node="node-0", socket_path=socket_path, checkpoint_dir=tmp_path / "ckpt",
                heartbeat_s=heartbeat_s,
            )
            rank_environ.update(env or {})
            procs.append(subprocess.Popen(
                [PYTHON, JOB, scenario], env=rank_environ,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            ))
        done = collect(procs, timeout)
        outputs = [output for _, output in done]
        failed = [(rank, code, output) for rank, (code, output) in enumerate(done) if code]
        # the first line names every failed rank and its last words (the short summary of a
        # run shows that line only; one rank's crash makes its peers fail after it)
        assert not failed, "; ".join(
            f"rank {rank} exit {code}: {last_line(output)}" for rank, code, output in failed
        ) + "".join(f"\n--- rank {rank}:\n{output}" for rank, _, output in failed)
        for _, output in done:
            assert "tracehound recorder error" not in output, output
            assert "tracehound could not patch" not in output, output
        collector.drain()
    assert collector.bad_lines == 0
    facts = [
        [json.loads(line[5:]) for line in out.splitlines() if line.startswith("fact ")]
        for out in outputs
    ]
    return Run(collector=collector, outputs=outputs, facts=facts)


# -- the properties the analysis relies on -------------------------------------------------------


def group_ranks(run: Run) -> dict[str, tuple[int, ...]]:
    """Group -> its global ranks, checked: every member announced it once, with the same ranks,
    and no other rank did."""
    announced: dict[str, dict[int, list[tuple[int, ...]]]] = defaultdict(lambda: defaultdict(list))
    for info in run.infos:
        announced[info.group][info.rank].append(tuple(info.ranks))
    out: dict[str, tuple[int, ...]] = {}
    for group, by_rank in announced.items():
        seen = {r for lists in by_rank.values() for r in lists}
        assert len(seen) == 1, f"group {group} announced with different ranks: {seen}"
        ranks = seen.pop()
        assert all(len(lists) == 1 for lists in by_rank.values()), f"{group} announced twice"
        if (P2P_MARK in group and group.endswith(":any")) or group.endswith(BACKEND_SUFFIX):
            # a receive from any source; a backend's progress, announced by the members that
            # were seen waiting in it (agent/backend.py)
            out[group] = ranks
            continue
        assert sorted(by_rank) == sorted(ranks), (
            f"group {group} of ranks {ranks} announced by ranks {sorted(by_rank)}")
        out[group] = ranks
    return out


def assert_same_calls(run: Run) -> dict[str, list[tuple[int, str]]]:
    """Every collective group (not the counted ones, whose ids skip: `<group>:ddp`): each member
    recorded the same sequence ids 1..n with the same op at each id, all completed. Returns
    group -> [(seq, op)]."""
    groups = group_ranks(run)
    calls: dict[str, dict[int, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
    for e in run.events:
        assert e.state is CollectiveState.COMPLETED, e
        assert e.complete_us >= e.enqueue_us > 0, e
        if P2P_MARK not in e.group and not e.group.endswith(COUNTED_SUFFIX):
            calls[e.group][e.rank].append((e.seq, e.op))
    out: dict[str, list[tuple[int, str]]] = {}
    for group, by_rank in calls.items():
        assert group in groups, f"events of group {group}, which nobody announced"
        assert sorted(by_rank) == sorted(groups[group]), (
            f"group {group}: events from {sorted(by_rank)}, members {groups[group]}")
        lists = {rank: sorted(seqs) for rank, seqs in by_rank.items()}
        first = next(iter(lists.values()))
        assert [seq for seq, _ in first] == list(range(1, len(first) + 1)), (group, first)
        for rank, seqs in lists.items():
            assert seqs == first, f"group {group}: rank {rank} recorded {seqs}, not {first}"
        out[group] = first
    return out


def assert_transfers(run: Run) -> dict[str, list[tuple[int, int, int]]]:
    """Every point-to-point pair group: each seq is one transfer, recorded by the sender (a send
    op naming the receiver) and the receiver (a recv op naming the sender) with the same size.
    Returns group -> [(src, dst, nbytes)] by seq."""
    groups = group_ranks(run)
    rows: dict[str, dict[int, list[CollectiveEvent]]] = defaultdict(lambda: defaultdict(list))
    for e in run.events:
        if P2P_MARK in e.group:
            rows[e.group][e.seq].append(e)
    out: dict[str, list[tuple[int, int, int]]] = {}
    for group, by_seq in rows.items():
        assert sorted(by_seq) == list(range(1, len(by_seq) + 1)), (group, sorted(by_seq))
        transfers = []
        for seq in sorted(by_seq):
            sends = [e for e in by_seq[seq] if e.op in SEND_SIDE]
            recvs = [e for e in by_seq[seq] if e.op in RECV_SIDE]
            assert len(sends) == 1 and len(recvs) == 1 and len(by_seq[seq]) == 2, (
                f"{group} #{seq}: {[(e.rank, e.op, e.peer) for e in by_seq[seq]]}")
            s, r = sends[0], recvs[0]
            assert (s.peer, r.peer) == (r.rank, s.rank), (group, seq, s, r)
            assert s.nbytes == r.nbytes and s.dtype == r.dtype, (group, seq, s, r)
            assert sorted(groups[group]) == sorted((s.rank, r.rank)), (group, groups[group])
            transfers.append((s.rank, r.rank, s.nbytes))
        out[group] = transfers
    return out
