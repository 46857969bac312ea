"""A rank leaves its exit status for a controller that is not its parent (real interpreters)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tracehound.tracing.settings import TRACEHOUND_EXIT_FILE

PROLOGUE = "import tracehound.agent.rank.autoinstall\n"


def run(tmp_path: Path, body: str) -> tuple[int, dict[str, str]]:
    """Run `body` in a fresh interpreter that has TRACEHOUND_EXIT_FILE set; its exit status
    and the status files found (name -> content)."""
    exit_file = tmp_path / "rank-0.exit"
    proc = subprocess.run([sys.executable, "-c", PROLOGUE + body],
                          env={**os.environ, TRACEHOUND_EXIT_FILE: str(exit_file)},
                          capture_output=True, text=True, timeout=60, check=False)
    found = {p.name.replace(str(proc_pid(p)), "PID"): p.read_text().strip()
             for p in tmp_path.glob("rank-0.exit.*")}
    return proc.returncode, found


def proc_pid(path: Path) -> int:
    return int(path.name.rsplit(".", 1)[1])


@pytest.mark.parametrize(("body", "code"), [
    ("pass", 0),
    ("import sys\nsys.exit(3)", 3),
    ("import sys\nsys.exit('bad config')", 1),
    ("raise RuntimeError('boom')", 1),
    ("import argparse\nargparse.ArgumentParser().parse_args(['--nope'])", 2),
    ("import sys, threading\nt = threading.Thread(target=sys.exit, args=(5,))\nt.start()\n"
     "t.join()", 0),
])
def test_the_status_the_interpreter_ends_with_is_left_in_the_file(
    tmp_path: Path, body: str, code: int
) -> None:
    returncode, found = run(tmp_path, body)
    assert returncode == code
    assert found == {"rank-0.exit.PID": str(code)}


def test_a_killed_rank_leaves_nothing_and_a_forked_child_writes_no_file(tmp_path: Path) -> None:
    returncode, found = run(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert returncode == -signal.SIGKILL and found == {}
    returncode, found = run(
        tmp_path, "import os, sys\npid = os.fork()\nif pid == 0:\n    sys.exit(7)\n"
                  "os.waitpid(pid, 0)\nsys.exit(4)")
    assert returncode == 4
    assert found == {"rank-0.exit.PID": "4"}, "the child's exit is not the rank's"
