"""What runs on a node and inside training processes: the recorder and the node agent.

Training processes get the recorder automatically (`tracehound.agent.rank.autoinstall`, loaded by
the `_bootstrap` sitecustomize); scripts need no change. The few public functions here let a script
or the checkpoint helper say which step it is at. Importing this package must stay cheap: no torch,
no threads.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracehound.agent.rank.recorder import Recorder

__all__ = ["current_recorder", "resume_from", "set_step"]


def current_recorder() -> Recorder | None:
    """The recorder of this process, or None when tracing is off (or not installed)."""
    module = sys.modules.get("tracehound.agent.rank.autoinstall")
    if module is None:
        return None
    found: Recorder | None = module.recorder()
    return found


def resume_from(step: int) -> None:
    """Tell the recorder this process resumed from a checkpoint of `step` (no-op when off)."""
    recorder = current_recorder()
    if recorder is not None:
        recorder.resume_from(step)


def set_step(step: int) -> None:
    """Tell the recorder the training has reached `step` now (no-op when off)."""
    recorder = current_recorder()
    if recorder is not None:
        recorder.set_step(step)
