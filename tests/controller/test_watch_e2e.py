"""`tracehound watch` on a real job it did not launch: a 2x2 gloo job, each "node" a `tracehound
instrument --node N -- torchrun --nnodes 2 --node-rank I ...` of its own, with ranks stopped from
outside by SIGSTOP. One job run holds every scenario (CI time is short):

1. A first watcher is stopped dead between detecting and acting: a FIFO stands where it writes
   the evidence of its first incident. That write comes after the incident is stored and before
   any action, and the FIFO holds the watcher there until the test SIGKILLs it.
2. A second watcher, on the same journal and store, takes the rest of that incident's plan: its
   command runs once, and the incident is not recorded again.
3. The stopped rank goes on; once the job trains again, another rank is SIGSTOPped. Its
   incident reaches the command as JSON naming it. The time from
   the SIGSTOP to the command's line is printed, not asserted (the machine is shared).
4. The job is told to stop and every rank exits. The watcher says so, ends the job `finished`,
   and exits 0.

Every incident has exactly one command action and one line of the command's output: no incident
and no action twice.

It runs on the default embedded store (`STORES`), which one `instrument` holds and shares with
the machine's other processes (and which the test or a watcher takes over, in turn, when the
`instrument`s end with the job). The watcher on a ClickHouse server is tests/slurm's and
test_watcher.py's (CI time is short: one real job here).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from evidence_check import check_incidents
from store_urls import store_url_of

from tracehound.controller.journal import JOURNAL_FILE
from tracehound.controller.orchestrators.local import free_port
from tracehound.tracing.events import ActionKind, JobPhase
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.store.sharing import read_endpoint

pytestmark = pytest.mark.e2e

SCRIPT = str(Path(__file__).parent / "scripts" / "watched_job.py")
JOB = "watched"
KEYS = ["job", "incident", "kind", "culprit_ranks", "culprit_nodes", "confidence", "summary"]

STORES = ["embedded"]
"""The stores the test runs on (`watched_store`)."""


@pytest.fixture(params=STORES)
def watched_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store URL that every process of the test can open at once."""
    yield from store_url_of(request.param, request, tmp_path)


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEHOUND_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def tracehound(*args: str) -> list[str]:
    return [sys.executable, "-m", "tracehound.controller.cli", *args]


class Procs:
    """The processes of the test, stopped at its end however it ends."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.started: list[tuple[str, subprocess.Popen[bytes], Path]] = []

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        out = self.tmp_path / f"{name}.out"
        with open(out, "wb") as sink, open(self.tmp_path / f"{name}.err", "wb") as err:
            proc = subprocess.Popen(argv, stdout=sink, stderr=err, env=clean_env(),
                                    start_new_session=True)
        self.started.append((name, proc, out))
        return proc

    def check_alive(self, *names: str) -> None:
        for name, proc, _ in self.started:
            if name in names and proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}:\n"
                                     f"{self.tail(name)}")

    def tail(self, name: str) -> str:
        err = (self.tmp_path / f"{name}.err").read_text(errors="replace")[-4000:]
        out = (self.tmp_path / f"{name}.out").read_text(errors="replace")[-2000:]
        return f"--- stdout\n{out}\n--- stderr\n{err}"

    def stop_all(self) -> None:
        for _, proc, _ in self.started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT)
        for _, proc, _ in self.started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # the node agents run in sessions of their own: ours are those of our workdir
        for pid in _pids_mentioning(str(self.tmp_path)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _pids_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def wait_for(what: str, ok: Callable[[], bool], procs: Procs, *alive: str) -> None:
    """Poll until `ok()`; fail at once (with their output) if one of the `alive` processes
    ended first. No time limit: the test command's own timeout stops a test that hangs."""
    while not ok():
        procs.check_alive(*alive)
        time.sleep(0.2)


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text()
    complete = text[:text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


def pid_of(store: TraceStore, rank: int) -> int:
    return next(hb.pid for hb in store.latest_heartbeats(JOB, 0) if hb.rank == rank)


def test_a_watched_job_stopped_rank_reaches_the_command_once_also_across_a_watcher_kill(
        watched_store: str, tmp_path: Path) -> None:
    procs = Procs(tmp_path)
    stop_file = tmp_path / "stop"
    runs = tmp_path / "cmd-runs.jsonl"
    workdir = tmp_path / "watch"
    port = free_port()
    store: TraceStore | None = None
    try:
        for node_rank, node in enumerate(("node-a", "node-b")):
            procs.start(node, tracehound(
                "instrument", "--job", JOB, "--node", node, "--gpu", "off",
                "--store", watched_store, "--workdir", str(tmp_path / node), "--",
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(node_rank), "--nproc-per-node", "2",
                "--master-addr", "127.0.0.1", "--master-port", str(port),
                SCRIPT, "--stop-file", str(stop_file)))
        job = ("node-a", "node-b")
        # an embedded store: one `instrument` holds it and shares it with the machine, and this
        # test reads it through that one, as the watchers do (opened first here, it would be
        # this process's, shared with nobody)
        wait_for("the store is open", lambda: _sharing(watched_store), procs, *job)
        store = open_store(watched_store)
        wait_for("every rank reports", lambda: len(store.latest_heartbeats(JOB, 0)) == 4,
                 procs, *job)
        nodes = {hb.rank: hb.node for hb in store.latest_heartbeats(JOB, 0)}
        assert nodes == {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-b"}

        watch = tracehound("watch", "--job", JOB, "--store", watched_store,
                           "--on-incident", f"cat >> {runs}", "--workdir", str(workdir),
                           "--json", "--poll", "0.5", "--end-grace", "3")
        # 1. a first watcher, held between recording its first incident and acting on it
        evidence = workdir / JOB / "incidents"
        evidence.mkdir(parents=True)
        traps = [evidence / f"{JOB}_0_{n}.snapshot.json" for n in range(1, 4)]
        for trap in traps:
            os.mkfifo(trap)
        first = procs.start("watch-1", watch)
        wait_for("the first watcher watches",
                 lambda: any(e["event"] == "watching" for e in lines(tmp_path / "watch-1.out")),
                 procs, "watch-1", *job)
        os.kill(pid_of(store, 3), signal.SIGSTOP)
        wait_for("an incident is stored", lambda: bool(store.incidents(JOB)), procs,
                 "watch-1", *job)
        (held,) = store.incidents(JOB)
        first.send_signal(signal.SIGKILL)
        first.wait()
        assert not runs.exists(), "the first watcher acted before it was killed"
        assert [a.kind for a in held.actions if a.kind is ActionKind.COMMAND] == []
        assert store.job_states(JOB)[-1].state is JobPhase.DIAGNOSING
        assert (workdir / JOB / JOURNAL_FILE).exists()
        for trap in traps:
            trap.unlink()

        # 2. a second watcher takes the rest of its plan: the command, once
        procs.start("watch-2", watch)
        wait_for("the command ran for the held incident",
                 lambda: any(r["incident"] == held.incident_id for r in lines(runs)),
                 procs, "watch-2", *job)
        if held.kind == "hang":
            assert held.culprit_ranks == (3,) and held.culprit_nodes == ("node-b",)
        else:  # a soft fault seen before the stop was the first incident: the stop comes next
            wait_for("the stopped rank's incident", lambda: any(
                3 in r["culprit_ranks"] and r["kind"] == "hang" for r in lines(runs)),
                procs, "watch-2", *job)
        os.kill(pid_of(store, 3), signal.SIGCONT)
        wait_for("the job trains again", lambda: store.job_states(JOB)[-1].state
                 is JobPhase.RUNNING, procs, "watch-2", *job)

        # 3. another rank stopped: its incident reaches the command as JSON naming it
        stopped = time.monotonic()
        os.kill(pid_of(store, 1), signal.SIGSTOP)
        wait_for("the command names rank 1", lambda: any(
            r["culprit_ranks"] == [1] for r in lines(runs)), procs, "watch-2", *job)
        took = time.monotonic() - stopped
        print(f"SIGSTOP of rank 1 to the command's JSON naming it: {took:.1f} s")
        named = next(r for r in lines(runs) if r["culprit_ranks"] == [1])
        assert list(named) == KEYS
        assert (named["job"], named["kind"], named["culprit_nodes"]) == (JOB, "hang",
                                                                           ["node-a"])
        assert named["confidence"] > 0.8 and "rank 1" in named["summary"]
        os.kill(pid_of(store, 1), signal.SIGCONT)
        wait_for("the job trains again", lambda: store.job_states(JOB)[-1].state
                 is JobPhase.RUNNING, procs, "watch-2", *job)

        # 4. the job ends: every rank exits, and the watcher with it
        stop_file.touch()
        second = procs.started[-1][1]
        wait_for("the watcher ends with the job", lambda: second.poll() is not None, procs)
        events = lines(tmp_path / "watch-2.out")
        assert second.returncode == 0, procs.tail("watch-2")
        ended = events[-1]
        assert (ended["event"], ended["how"], ended["state"], ended["ranks"]) == (
            "ended", "exited", "finished", 4)
        assert [e["picked_up"] for e in events if e["event"] == "watching"] == [True]
        for _, proc, _ in procs.started[:2]:
            assert proc.wait() == 0

        # no incident and no action twice
        incidents = store.incidents(JOB)
        ids = [i.incident_id for i in incidents]
        assert len(ids) == len(set(ids))
        for incident in incidents:
            commands = [a for a in incident.actions if a.kind is ActionKind.COMMAND]
            assert len(commands) == 1 and commands[0].ok, (incident.incident_id,
                                                           incident.actions)
        run_ids = [r["incident"] for r in lines(runs)]
        assert sorted(run_ids) == sorted(ids)
        hangs = [i for i in incidents if i.kind == "hang"]
        assert sorted(i.culprit_ranks for i in hangs) == [(1,), (3,)]
        assert store.job_states(JOB)[-1].state is JobPhase.FINISHED
        # every fact of every incident agrees with what the store held when it was read
        assert check_incidents(store, JOB, as_stored=True) >= 1
    finally:
        with contextlib.suppress(OSError):
            stop_file.touch()
        for rank in range(4 if store is not None else 0):
            with contextlib.suppress(Exception):
                os.kill(pid_of(store, rank), signal.SIGCONT)
        procs.stop_all()
        if store is not None:
            store.close()


def _sharing(url: str) -> bool:
    """Whether a process holds the store of `url` and shares it (always, for a server)."""
    if not url.startswith("chdb://"):
        return True
    return read_endpoint(url.removeprefix("chdb://")) is not None
