"""Checkpoints for training scripts: the public import of `tracehound.agent.rank.checkpoint`.

    from tracehound.agent import checkpoint
    start = checkpoint.load(state) or 0
    ...
    checkpoint.save(state, step)
"""

from tracehound.agent.rank.checkpoint import (
    MARKER,
    CheckpointConfigError,
    latest_complete,
    load,
    save,
)

__all__ = ["MARKER", "CheckpointConfigError", "latest_complete", "load", "save"]
