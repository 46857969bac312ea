"""Interpreter-start hook for training processes launched by Tracehound.

The controller puts this directory first on PYTHONPATH, so Python's `site` imports this file as
`sitecustomize` when a rank starts. It imports `tracehound.agent.rank.autoinstall` (which decides
from the environment whether to record) and then runs the next `sitecustomize` on sys.path, if any,
as opentelemetry-instrument does, so a site's own customization still happens.

It must never raise (a failure here would stop the training process before it starts) and never
import torch.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import tracehound.agent.rank.autoinstall  # noqa: F401
except Exception as _exc:  # pragma: no cover - reported, never raised
    sys.stderr.write(f"tracehound: recorder not installed: {_exc!r}\n")


def _chain() -> None:
    """Run the `sitecustomize` that this one shadows."""
    import importlib.machinery
    import importlib.util

    paths = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", paths)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _chain()
except Exception as _exc:  # pragma: no cover - reported, never raised
    sys.stderr.write(f"tracehound: the next sitecustomize failed: {_exc!r}\n")
