"""Shared pieces of the fault tests: real node agents (`tracehound agent`) and real gloo ranks,
a fresh database per test on a real ClickHouse server, and the counting every fault test ends
with.

Counting is by collective key (job, attempt, rank, group, seq): what each rank says it
completed (its final heartbeat: `last_completed` of every group, sequence ids starting at 1)
against the rows the store holds, raw (no FINAL, no DISTINCT), so a row stored twice shows.
Whether training was blocked is read from the ranks' own heartbeats, which carry the step each
rank had reached and when.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))  # agent_harness


from agent_harness import free_port, rank_env

from tracehound.agent.rank.backend import BACKEND_SUFFIX
from tracehound.tracing.events import Heartbeat
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store
from tracehound.tracing.store.port import CollectiveKey

PYTHON = sys.executable
Key = tuple[int, int, str, int]
"""(attempt, rank, group, seq) of one collective of a job."""


# -- a database of its own on a real server ------------------------------------------------------

def fresh_database_url(server_url: str) -> str:
    """The server's URL with a new database `tracehound_r<random>` (created on first use)."""
    return urlsplit(server_url)._replace(path=f"/tracehound_r{uuid.uuid4().hex[:12]}").geturl()


def drop_database(url: str) -> None:
    """Drop a test's own database after it. A server too busy to answer in time (a CI run: the
    DROP timed out while both lanes loaded it) leaves the database behind, with a warning that
    names it; the test's result stands."""
    from tracehound.tracing.errors import TemporaryStoreError
    from tracehound.tracing.store.server import ClickHouseServerStore

    store = ClickHouseServerStore(url)
    try:
        store.drop_database()
    except TemporaryStoreError as exc:
        warnings.warn(f"test database left behind: {exc}", stacklevel=2)
    finally:
        store.close()


# -- processes -------------------------------------------------------------------------------------

def agent_command(*, job: str, node: str, socket_path: Path, spool: Path, sink: str,
                  stats_file: Path, extra: Sequence[str] = ()) -> list[str]:
    """`tracehound agent` with its records going to `sink`; stats rewritten every second."""
    return [PYTHON, "-m", "tracehound.controller.cli", "agent", "--job", job, "--node", node,
            "--socket", str(socket_path), "--spool", str(spool), "--sink", sink,
            "--stats-file", str(stats_file), "--stats-interval", "2", *extra]


def start_agent(command: Sequence[str], log_file: Path) -> subprocess.Popen[bytes]:
    """Run a node agent, its output appended to `log_file`."""
    with open(log_file, "ab") as out:
        return subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT)


def stop_agent(process: subprocess.Popen[bytes], timeout: float = 120.0) -> int:
    """SIGTERM (the agent ships what it holds) and wait; a hang guard kills it after `timeout`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"the node agent did not stop within {timeout:.0f} s") from None


def read_stats(stats_file: Path) -> dict[str, Any]:
    """The agent's latest stats file ({} before the first one)."""
    try:
        loaded: dict[str, Any] = json.loads(stats_file.read_text())
        return loaded
    except (FileNotFoundError, ValueError):
        return {}


def launch_ranks(
    *, world: int, command: Sequence[str], job: str, node: str, socket_path: Path,
    checkpoint_dir: Path, logs: Path, env: dict[str, str] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """Start `world` gloo ranks of `command` with the controller's env contract (the recorder
    auto-installed, reporting to the node agent at `socket_path`); rank R's output goes to
    `logs/rank-R.log`."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        rank_vars = rank_env(rank=rank, world=world, port=port, job=job, attempt=0, node=node,
                             socket_path=socket_path, checkpoint_dir=checkpoint_dir)
        rank_vars["PYTHONUNBUFFERED"] = "1"
        rank_vars.update(env or {})
        with open(logs / f"rank-{rank}.log", "wb") as out:
            procs.append(subprocess.Popen(list(command), env=rank_vars, stdout=out,
                                          stderr=subprocess.STDOUT))
    return procs


def wait_ranks(procs: Sequence[subprocess.Popen[bytes]], logs: Path,
               timeout: float = 600.0) -> None:
    """Wait for every rank to exit 0 (a hang guard kills them all after `timeout`)."""
    deadline = time.monotonic() + timeout
    try:
        for rank, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} did not finish within {timeout:.0f} s") from None
            output = (logs / f"rank-{rank}.log").read_text(errors="replace")
            assert proc.returncode == 0, f"rank {rank} exited {proc.returncode}:\n{output[-3000:]}"
            assert "tracehound recorder error" not in output, output[-3000:]
    finally:
        kill_all(procs)


def kill_all(procs: Iterable[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def end_run(proc: subprocess.Popen[str], job_dir: Path, timeout: float = 60.0) -> None:
    """Make sure a `tracehound run` and what it started are gone: SIGTERM the controller (it
    stops its ranks and node agents), then SIGKILL any rank or agent its attempt files still
    name (ranks and agents outlive a killed controller), if it is the process it names."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    for noted in job_dir.glob("attempts/attempt-*.json"):
        try:
            entries = json.loads(noted.read_text())
        except (OSError, ValueError):
            continue
        for entry in [*entries.get("ranks", []), *entries.get("agents", [])]:
            pid, start = entry.get("pid"), entry.get("start")
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(stat[19]) == start:
                os.kill(pid, signal.SIGKILL)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    """Resident set size of a process, in kB (/proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


# -- the store -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """What the store holds of a job, read back raw."""

    keys: list[CollectiveKey]
    heartbeats: list[Heartbeat]
    final: list[Heartbeat]
    """The latest heartbeat of each rank of attempt 0."""

    def counts(self) -> collections.Counter[Key]:
        return collections.Counter((k.attempt, k.rank, k.group, k.seq) for k in self.keys)


def read_store(url: str, job: str) -> Stored:
    store: Any = open_store(url)
    try:
        return Stored(
            keys=store.collective_keys(JobId(job)),
            heartbeats=store.records(Heartbeat, JobId(job)),
            final=store.latest_heartbeats(JobId(job), 0),
        )
    finally:
        store.close()


def completed_keys(final: Iterable[Heartbeat]) -> set[Key]:
    """Every collective the ranks say they completed, by their final heartbeats: sequence ids
    1..last_completed of each group (nothing may still be pending at the end)."""
    expected: set[Key] = set()
    for hb in final:
        for g in hb.groups:
            # a counted group (DDP's steps, `<group>:ddp`) records some of its seqs only: run
            # these jobs with every bucket recorded (TRACEHOUND_DDP_TRACE_EVERY=1)
            assert not g.group.endswith(":ddp"), f"rank {hb.rank}: counted group {g.group}"
            if g.group.endswith(BACKEND_SUFFIX):
                # the backend's own count of a group (`agent.rank.backend`), in heartbeats
                # only: reported once a call of it stayed in flight with none of its traced
                # calls pending (a starved rank, seen in CI); its traced calls are the group's
                continue
            assert g.last_completed == g.last_enqueued, (
                f"rank {hb.rank} group {g.group}: {g.last_enqueued} enqueued, "
                f"{g.last_completed} completed at its last heartbeat")
            expected |= {(int(hb.attempt), int(hb.rank), g.group, s)
                         for s in range(1, g.last_completed + 1)}
    return expected


@dataclass(frozen=True)
class Tally:
    """Stored collectives against completed ones."""

    expected: int
    stored_rows: int
    missing: list[Key]
    duplicated: dict[Key, int]
    unexpected: list[Key]

    def describe(self) -> str:
        return (f"{self.expected} completed, {self.stored_rows} rows stored, "
                f"{len(self.missing)} missing, {len(self.duplicated)} stored more than once, "
                f"{len(self.unexpected)} never completed")


def tally(stored: Stored) -> Tally:
    counts = stored.counts()
    expected = completed_keys(stored.final)
    return Tally(
        expected=len(expected), stored_rows=sum(counts.values()),
        missing=sorted(expected - set(counts)),
        duplicated={k: n for k, n in sorted(counts.items()) if n > 1},
        unexpected=sorted(set(counts) - expected),
    )


def duplicated_heartbeats(beats: Iterable[Heartbeat]) -> int:
    """Heartbeat rows beyond the first of each (attempt, rank, time_us)."""
    counts = collections.Counter((hb.attempt, hb.rank, hb.time_us) for hb in beats)
    return sum(n - 1 for n in counts.values())


def steps_in_slices(beats: Iterable[Heartbeat], *, rank: int, start_us: int, end_us: int,
                    slices: int) -> list[int]:
    """Steps a rank made in each of `slices` equal parts of [start_us, end_us], by its own
    heartbeats: the highest step reported in a part minus the highest reported before it."""
    mine = sorted((hb.time_us, hb.step) for hb in beats if hb.rank == rank)
    bounds = [start_us + (end_us - start_us) * i // slices for i in range(slices + 1)]

    def reached(until_us: int) -> int:
        return max((step for t, step in mine if t <= until_us), default=0)

    return [reached(b) - reached(a) for a, b in itertools.pairwise(bounds)]
