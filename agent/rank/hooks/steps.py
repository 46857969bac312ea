"""Training steps: a global optimizer step post-hook counts them; DCP's optimizer-state
initialization (a zero-lr step) is not counted."""

from __future__ import annotations

import functools
import importlib
from typing import Any

from tracehound.agent.rank.hooks.catalog import _WRAPPED
from tracehound.agent.rank.recorder import Recorder


def install_optimizer(recorder: Recorder) -> Any:
    """Count training steps with a global optimizer step post-hook; returns its handle."""
    optimizer_module: Any = importlib.import_module("torch.optim.optimizer")

    def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            recorder.optimizer_stepped(optimizer)
        except Exception as exc:
            recorder.note_error("optimizer step hook", exc)

    return optimizer_module.register_optimizer_step_post_hook(stepped)


def install_checkpoint_state_dict(recorder: Recorder) -> bool:
    """DCP's `_init_optim_state` runs a zero-lr optimizer step to create the optimizer's state;
    that is not a training step, so steps are not counted while it runs."""
    module: Any = importlib.import_module("torch.distributed.checkpoint.state_dict")
    original = getattr(module, "_init_optim_state", None)
    if original is None or hasattr(original, _WRAPPED):
        return False

    @functools.wraps(original)
    def _init_optim_state(*args: Any, **kwargs: Any) -> Any:
        recorder.pause_steps(True)
        try:
            return original(*args, **kwargs)
        finally:
            recorder.pause_steps(False)

    setattr(_init_optim_state, _WRAPPED, original)
    module._init_optim_state = _init_optim_state
    return True
