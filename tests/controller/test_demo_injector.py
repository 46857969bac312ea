"""The demo's fault injector: it strikes once attempt 0 reached the fault's step, by the stored
heartbeats or, when those lag, by the job's newest complete checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tracehound.controller.cli.demo import FaultInjector


def _view(attempt: int, steps: list[int], pid: int) -> Any:
    beats = [SimpleNamespace(step=s, rank=r, node=f"node-{r // 2}") for r, s in enumerate(steps)]
    return SimpleNamespace(attempt=attempt, snapshot=SimpleNamespace(heartbeats=beats),
                           orchestrator=SimpleNamespace(pid_of=lambda rank: pid))


def _checkpoint(root: Path, step: int, *, complete: bool = True) -> None:
    where = root / f"step-{step:08d}"
    where.mkdir(parents=True)
    if complete:
        (where / "COMPLETE").write_text(str(step))


def test_stored_steps_behind_a_complete_checkpoint_past_the_fault_step_strike(
        tmp_path: Path) -> None:
    target = subprocess.Popen(["sleep", "300"])
    try:
        injector = FaultInjector(fault="hang", rank=3, at_step=60, checkpoints=tmp_path)
        injector(_view(0, [12, 12, 11, 12], target.pid))
        _checkpoint(tmp_path, 75, complete=False)  # being written: not a step reached yet
        injector(_view(0, [12, 12, 11, 12], target.pid))
        _checkpoint(tmp_path, 50)
        injector(_view(0, [12, 12, 11, 12], target.pid))
        _checkpoint(tmp_path, 100, complete=True)
        injector(_view(1, [12, 12, 11, 12], target.pid))  # only attempt 0 is struck
        assert injector.injected_us == 0 and target.poll() is None
        injector(_view(0, [12, 12, 11, 12], target.pid))
        assert injector.injected_step == 100 and injector.pid == target.pid
        assert "at step 100" in injector.log[-1]
        _, status = os.waitpid(target.pid, os.WUNTRACED)  # it was stopped (SIGSTOP)
        assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
        injector(_view(0, [100, 100, 100, 100], target.pid))  # once
        assert len(injector.log) == 1
    finally:
        target.send_signal(signal.SIGKILL)
        target.wait()


def test_stored_steps_alone_strike_without_a_checkpoint_directory(tmp_path: Path) -> None:
    target = subprocess.Popen(["sleep", "300"])
    try:
        injector = FaultInjector(fault="hang", rank=1, at_step=60)
        injector(_view(0, [59, 59, 59, 59], target.pid))
        assert injector.injected_us == 0
        injector(_view(0, [61, 60, 60, 60], target.pid))
        assert injector.injected_step == 61
    finally:
        target.send_signal(signal.SIGKILL)
        target.wait()
