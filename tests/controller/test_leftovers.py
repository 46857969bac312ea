"""What an earlier controller left running of an attempt is found and killed, also ranks its
launch spawned before it could note them (real processes; no pid file)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tracehound.controller.orchestrators.local import LocalOrchestrator, start_time
from tracehound.tracing.settings import TRACEHOUND_EXIT_FILE

SLEEPER = "import time\nwhile True: time.sleep(1)\n"


def spawn(exit_file: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", SLEEPER], start_new_session=True,
                            env={**os.environ, TRACEHOUND_EXIT_FILE: str(exit_file)})


def test_unnoted_ranks_of_the_attempt_are_killed_and_no_other(tmp_path: Path) -> None:
    orch = LocalOrchestrator(workdir=tmp_path / "job", sink="http://127.0.0.1:9/")
    try:
        ours = [spawn(tmp_path / "job" / "attempts" / "attempt-1" / f"rank-{r}.exit")
                for r in range(2)]
        other_attempt = spawn(tmp_path / "job" / "attempts" / "attempt-2" / "rank-0.exit")
        other_job = spawn(tmp_path / "job2" / "attempts" / "attempt-1" / "rank-0.exit")
        deadline = time.monotonic() + 30
        while not all(start_time(p.pid) for p in (*ours, other_attempt, other_job)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert orch.kill_leftovers(1) == 2
        assert [p.wait(timeout=10) for p in ours] == [-9, -9]
        assert other_attempt.poll() is None and other_job.poll() is None
        assert orch.kill_leftovers(1) == 0
    finally:
        for p in (*ours, other_attempt, other_job):
            p.kill()
            p.wait()
        orch.close()
