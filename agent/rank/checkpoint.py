"""Checkpoints for training scripts, on torch.distributed.checkpoint (DCP), with completion markers.

`save` is collective (every rank calls it): DCP writes `DIR/step-<08d>/`, all ranks meet at a
barrier, then rank 0 writes the completion marker atomically (temp file, fsync, rename, fsync of
the directory). A checkpoint without the marker is incomplete (a rank died while saving) and is
never loaded. `latest_complete` is pure filesystem work and imports no torch, so the controller
can call it. `load` loads the newest complete checkpoint in place and tells the recorder which
step the process resumed from.

The directory defaults to TRACEHOUND_CHECKPOINT_DIR. Nothing here talks to the node agent.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from typing import Any

from tracehound.tracing.settings import TRACEHOUND_CHECKPOINT_DIR, env_str

MARKER = "COMPLETE"
"""File written in a checkpoint directory once every rank has finished saving it."""

_STEP_DIR = re.compile(r"^step-(\d{8,})$")


class CheckpointConfigError(ValueError):
    """No checkpoint directory was given and TRACEHOUND_CHECKPOINT_DIR is not set."""


def _directory(directory: str | os.PathLike[str] | None) -> Path:
    if directory is not None:
        return Path(directory)
    value = env_str(TRACEHOUND_CHECKPOINT_DIR)
    if not value:
        raise CheckpointConfigError(
            f"no checkpoint directory: pass directory= or set {TRACEHOUND_CHECKPOINT_DIR}"
        )
    return Path(value)


def step_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(directory) / f"step-{step:08d}"


def latest_complete(directory: str | os.PathLike[str] | None = None) -> tuple[int, Path] | None:
    """(step, path) of the newest checkpoint with a completion marker, or None."""
    root = _directory(directory)
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return None
    best: tuple[int, Path] | None = None
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match is None or not entry.is_dir():
            continue
        step = int(match.group(1))
        if (best is None or step > best[0]) and os.path.isfile(os.path.join(entry.path, MARKER)):
            best = (step, Path(entry.path))
    return best


def _write_marker(path: Path, step: int) -> None:
    tmp = path / f".{MARKER}.tmp"
    with open(tmp, "w") as handle:
        handle.write(f"{step}\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path / MARKER)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _distributed() -> Any:
    dist: Any = importlib.import_module("torch.distributed")
    return dist if dist.is_available() and dist.is_initialized() else None


def save(
    state_dict: dict[str, Any], step: int, directory: str | os.PathLike[str] | None = None
) -> Path:
    """Save `state_dict` as the checkpoint of `step` (every rank must call); returns its path."""
    dcp: Any = importlib.import_module("torch.distributed.checkpoint")
    path = step_path(_directory(directory), step)
    path.mkdir(parents=True, exist_ok=True)
    dcp.save(state_dict, checkpoint_id=str(path))
    dist = _distributed()
    if dist is not None:
        dist.barrier()
    if dist is None or dist.get_rank() == 0:
        _write_marker(path, step)
    return path


def load(state_dict: dict[str, Any], directory: str | os.PathLike[str] | None = None) -> int | None:
    """Load the newest complete checkpoint into `state_dict` in place; returns its step, or None
    when there is none (a fresh start). Tells the recorder the step this process resumed from."""
    found = latest_complete(directory)
    if found is None:
        return None
    step, path = found
    dcp: Any = importlib.import_module("torch.distributed.checkpoint")
    dcp.load(state_dict, checkpoint_id=str(path))
    from tracehound.agent import resume_from

    resume_from(step)
    return step
