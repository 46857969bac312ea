"""Checkpoints for training scripts: in-memory snapshots, disk checkpoints, and the agreed restore.

    start = checkpoint.load(state) or 0                  # newest step every rank holds
    checkpoint.snapshot(state, step)                     # every step: memory + a replica
    checkpoint.snapshot(state, step, persist=True)       # now and then: to disk, in the background
    checkpoint.save(state, step)                         # a synchronous DCP checkpoint

`snapshot` (`agent.rank.snapshot`) costs the training thread a copy of the state; the rest is
done by a writer thread. `save` is collective (every rank calls it): DCP writes
`DIR/step-<08d>/`, all ranks meet at a barrier, then rank 0 writes the completion marker
atomically. A step directory without the marker is incomplete (a rank died while saving, or the
disk filled) and is never loaded. `load` restores the newest step that every rank holds in a
keeper's memory, as a persisted snapshot or as a DCP checkpoint (`agent.rank.restore`), and tells
the recorder which step the process resumed from. `latest_complete` is pure filesystem work and
imports no torch, so the controller can call it.

The directory defaults to TRACEHOUND_CHECKPOINT_DIR; the keepers come from
TRACEHOUND_SNAPSHOT_KEEPERS (both set by `tracehound run`).
"""

from __future__ import annotations

import importlib
import os
import socket
from pathlib import Path
from typing import Any

from tracehound.agent.rank.keepers import Keepers
from tracehound.agent.rank.restore import Restored, complete_steps, restore
from tracehound.agent.rank.snapshot import (
    MARKER,
    Identity,
    SnapshotStats,
    Snapshotter,
    step_path,
)
from tracehound.tracing import settings as env
from tracehound.tracing.durable import write_atomic

__all__ = ["MARKER", "CheckpointConfigError", "latest_complete", "load", "save", "snapshot",
           "snapshot_stats", "step_path"]


class CheckpointConfigError(ValueError):
    """No checkpoint directory was given and TRACEHOUND_CHECKPOINT_DIR is not set."""


def _directory(directory: str | os.PathLike[str] | None) -> Path:
    if directory is not None:
        return Path(directory)
    value = env.env_str(env.TRACEHOUND_CHECKPOINT_DIR)
    if not value:
        raise CheckpointConfigError(
            f"no checkpoint directory: pass directory= or set {env.TRACEHOUND_CHECKPOINT_DIR}"
        )
    return Path(value)


def latest_complete(directory: str | os.PathLike[str] | None = None) -> tuple[int, Path] | None:
    """(step, path) of the newest checkpoint with a completion marker, or None."""
    steps = complete_steps(_directory(directory))
    if not steps:
        return None
    newest = max(steps)
    return newest, steps[newest]


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
        write_atomic(path / MARKER, f"{step}\n".encode())
    return path


def _identity() -> Identity:
    dist = _distributed()
    rank = dist.get_rank() if dist else env.env_int("RANK", 0)
    world = dist.get_world_size() if dist else env.env_int("WORLD_SIZE", 1, minimum=1)
    return Identity(job=env.env_str(env.TRACEHOUND_JOB_ID), rank=rank, world=world,
                    node=env.env_str(env.TRACEHOUND_NODE_ID) or socket.gethostname(),
                    attempt=env.env_int(env.TRACEHOUND_ATTEMPT,
                                        env.env_int("TORCHELASTIC_RESTART_COUNT", 0)))


_snapshotter: list[Snapshotter] = []
"""This process's snapshot writer, made at the first `snapshot` (one per process, as a rank's
identity is)."""


def snapshot(state_dict: dict[str, Any], step: int, *, persist: bool = False,
             directory: str | os.PathLike[str] | None = None) -> None:
    """Snapshot `state_dict` as the state after `step` steps: in this node's keeper, with a
    replica on another node's; with `persist`, also to disk. Returns once the state is copied."""
    if not _snapshotter:
        who = _identity()
        _snapshotter.append(Snapshotter(identity=who, keepers=Keepers.from_env(who.node)))
    persist_dir = _directory(directory) if persist else None
    _snapshotter[0].snapshot(state_dict, step, persist_dir=persist_dir)


def snapshot_stats() -> SnapshotStats | None:
    """What this process's snapshots cost and where they went (None before the first)."""
    return _snapshotter[0].stats if _snapshotter else None


def flush_snapshots(timeout_s: float = 30.0) -> bool:
    """Wait for this process's snapshots to be sent and persisted; False at the timeout."""
    return _snapshotter[0].flush(timeout_s) if _snapshotter else True


def load(state_dict: dict[str, Any], directory: str | os.PathLike[str] | None = None) -> int | None:
    """Load into `state_dict`, in place, the newest step that every rank holds (in a keeper's
    memory, a persisted snapshot or a DCP checkpoint); returns its step, or None when there is
    none (a fresh start). Collective when torch.distributed is initialized. Tells the recorder
    the step this process resumed from."""
    found = load_from(state_dict, directory)
    return None if found is None else found.step


def load_from(state_dict: dict[str, Any],
              directory: str | os.PathLike[str] | None = None) -> Restored | None:
    """`load`, saying where the step came from."""
    root: Path | None
    try:
        root = _directory(directory)
    except CheckpointConfigError:
        root = None
    who = _identity()
    keepers = Keepers.from_env(who.node)
    if root is None and not keepers.all:
        raise CheckpointConfigError(
            f"nothing to load from: pass directory=, or set {env.TRACEHOUND_CHECKPOINT_DIR} "
            f"or {env.TRACEHOUND_SNAPSHOT_KEEPERS}")
    dist = _distributed()

    def gather(value: object) -> list[Any]:
        if dist is None:
            return [value]
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, value)
        return every

    found = restore(state_dict, who, keepers, root, gather)
    if found is not None:
        from tracehound.agent import resume_from

        resume_from(found.step)
    return found
