"""`tracehound stacks` (controller/stacks_cli.py) against real processes.

The ranks are plain Python processes with the environment a Tracehound rank has
(TRACEHOUND_JOB_ID, RANK, TRACEHOUND_ATTEMPT, TRACEHOUND_NODE_ID): two wait in one function, the
odd one out is stuck in another. Their stacks are taken by the real py-spy, and the command runs
as a user runs it (`python -m tracehound.controller.cli stacks ...`).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tracehound.agent.node.procwatch import find_py_spy
from tracehound.controller.cli.stacks import Captured, LocalRank, group_stacks
from tracehound.tracing.events import Batch, Heartbeat, now_us
from tracehound.tracing.ids import JobId, NodeId, Rank

pytestmark = pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")

RANK_SCRIPT = textwrap.dedent("""\
    import os, subprocess, sys, time

    def wait_in_collective():
        while True:
            time.sleep(0.05)

    def write_checkpoint():
        while True:
            time.sleep(0.05)

    if os.environ.get("SPAWN_WORKER"):
        # a data loader worker: a child with the rank's whole environment
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("ready", flush=True)
    if os.environ["RANK"] == os.environ.get("ODD_RANK"):
        write_checkpoint()
    else:
        wait_in_collective()
""")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TRACEHOUND_") and k not in ("RANK", "TORCHELASTIC_RESTART_COUNT")}
    env.update(extra)
    return env


class Ranks:
    """Real processes standing in for a job's local ranks."""

    def __init__(self, tmp: Path) -> None:
        self.script = tmp / "rank.py"
        self.script.write_text(RANK_SCRIPT)
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, n: int, *, odd: int, **env: str) -> list[int]:
        pids = []
        for rank in range(n):
            extra = {k: v.format(rank=rank) for k, v in env.items()}
            proc = subprocess.Popen(
                [sys.executable, str(self.script)], stdout=subprocess.PIPE,
                env=clean_env(RANK=str(rank), ODD_RANK=str(odd), **extra),
                start_new_session=True,
            )
            self.procs.append(proc)
            pids.append(proc.pid)
        for proc in self.procs[-n:]:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        return pids

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 9)  # the rank and any worker it started
            proc.wait()


@pytest.fixture
def ranks(tmp_path: Path) -> Iterator[Ranks]:
    r = Ranks(tmp_path)
    yield r
    r.stop()


def stacks(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracehound.controller.cli", "stacks", *args],
        check=False, capture_output=True, text=True, timeout=120, cwd=cwd,
        env=clean_env(),
    )


def test_groups_name_the_rank_stuck_elsewhere(ranks: Ranks, tmp_path: Path) -> None:
    job = f"stacks-{uuid.uuid4().hex[:8]}"
    pids = ranks.start(3, odd=1, TRACEHOUND_JOB_ID=job, TRACEHOUND_ATTEMPT="0",
                       TRACEHOUND_NODE_ID="node-t", SPAWN_WORKER="1")
    done = stacks("--job", job, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["found_by"] == "process environments"
    # each rank is its own process, not the worker child that inherited its environment
    assert [(r["rank"], r["pid"]) for r in report["ranks"]] == list(enumerate(pids))
    assert report["nodes"] == ["node-t"] and report["attempt"] == 0
    assert [(g["ranks"], g["suspect"]) for g in report["groups"]] == [([0, 2], False),
                                                                      ([1], True)]
    assert report["suspects"] == [1] and report["failed"] == []
    assert report["groups"][0]["signature"][-1].endswith("wait_in_collective")
    assert report["groups"][1]["signature"][-1].endswith("write_checkpoint")
    assert report["groups"][1]["stack"][0].endswith("<module>")

    text = stacks("--job", job, cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    assert "2 distinct stacks" in text.stdout
    assert "1 rank [1]" in text.stdout and "suspect" in text.stdout
    assert "suspects: ranks [1]" in text.stdout


def test_a_job_with_no_rank_here_exits_1_and_says_why(tmp_path: Path) -> None:
    job = f"absent-{uuid.uuid4().hex[:8]}"
    done = stacks("--job", job, cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout == ""
    assert f"no rank of job {job} runs on this machine" in done.stderr
    assert f"TRACEHOUND_JOB_ID={job}" in done.stderr and "give --store" in done.stderr


def test_help_explains_and_gives_examples(tmp_path: Path) -> None:
    done = stacks("--help", cwd=tmp_path)
    assert done.returncode == 0
    assert "--nonblocking" in done.stdout and "tracehound stacks --job exp7" in done.stdout
    assert "--save" in done.stdout and "--store URL" in done.stdout


def test_ranks_found_by_heartbeats_and_stacks_saved(ranks: Ranks, tmp_path: Path) -> None:
    """Ranks whose environment does not name the job: their pids come from the store's newest
    heartbeats (a stale heartbeat whose pid now belongs to a younger process is ignored), and
    --save writes the stacks back as stack samples."""
    from tracehound.tracing.store import open_store

    job = f"beats-{uuid.uuid4().hex[:8]}"
    url = f"chdb://{tmp_path / 'store'}"
    pids = ranks.start(3, odd=2)
    (younger,) = ranks.start(1, odd=9)  # will claim to be rank 3 of an hour ago

    def beat(rank: int, pid: int, time_us: int) -> Heartbeat:
        return Heartbeat(job=JobId(job), attempt=1, node=NodeId("node-h"), rank=Rank(rank),
                         time_us=time_us, pid=pid, step=5, step_us=0, start_step=0,
                         first_step_us=0, dropped=0)

    now = now_us()
    store = open_store(url)
    try:
        store.insert(Batch(batch_id="hb", records=(
            *(beat(r, pid, now) for r, pid in enumerate(pids)),
            beat(3, younger, now - 3_600_000_000),
        )))
    finally:
        store.close()

    done = stacks("--job", job, "--store", url, "--save", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["found_by"].startswith("heartbeats in")
    assert [(r["rank"], r["pid"], r["node"]) for r in report["ranks"]] == [
        (0, pids[0], "node-h"), (1, pids[1], "node-h"), (2, pids[2], "node-h")]
    assert report["attempt"] == 1
    assert report["suspects"] == [2] and report["saved"] == 3

    since = now - 60_000_000
    store = open_store(url)
    try:
        saved = store.latest_stacks(JobId(job), 1, since)
    finally:
        store.close()
    assert [(s.rank, s.node) for s in saved] == [(0, "node-h"), (1, "node-h"), (2, "node-h")]
    assert saved[2].frames[-1].endswith("write_checkpoint")
    assert all(s.time_us >= since for s in saved)


def test_grouping_is_by_innermost_frames_largest_first() -> None:
    def cap(rank: int, *frames: str, error: str = "") -> Captured:
        return Captured(rank=LocalRank(rank=rank, pid=100 + rank, attempt=0, node="n"),
                        frames=frames, error=error, time_us=1)

    captured = [
        cap(0, "main", "step", "wait"), cap(1, "main", "eval", "wait"),
        cap(2, "main", "step", "save"), cap(3, "main", "step", "wait"),
        cap(4, error="py-spy exited with 1"),
    ]
    one = group_stacks(captured, 1)
    assert [(g.ranks, g.suspect) for g in one] == [([0, 1, 3], False), ([2], True)]
    two = group_stacks(captured, 2)
    assert [(g.ranks, g.suspect) for g in two] == [([0, 3], False), ([1], True), ([2], True)]
    even = group_stacks(captured[:2], 3)
    assert [g.suspect for g in even] == [False, False]  # two alone: nobody is the odd one
    assert group_stacks([], 3) == []
