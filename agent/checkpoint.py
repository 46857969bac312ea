"""Checkpoints for training scripts: the public import of `tracehound.agent.rank.checkpoint`.

    from tracehound.agent import checkpoint
    start = checkpoint.load(state) or 0
    for step in range(start, steps):
        ...
        checkpoint.snapshot(state, step + 1, persist=(step + 1) % 50 == 0)

`snapshot` keeps the state in memory on this node and another (and on disk when persisted), for
the cost of a copy; `save` writes a synchronous DCP checkpoint; `load` restores the newest step
every rank holds.
"""

from tracehound.agent.rank.checkpoint import (
    MARKER,
    CheckpointConfigError,
    flush_snapshots,
    latest_complete,
    load,
    load_from,
    save,
    snapshot,
    snapshot_stats,
)
from tracehound.agent.rank.snapshot import SnapshotBudgetError

__all__ = ["MARKER", "CheckpointConfigError", "SnapshotBudgetError", "flush_snapshots",
           "latest_complete", "load", "load_from", "save", "snapshot", "snapshot_stats"]
