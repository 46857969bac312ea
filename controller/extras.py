"""The optional parts of Tracehound (`pip install 'tracehound[ui]'`, `[kubernetes]`, `[all]`): a
command that needs one that is missing says which, and exits with status 2. The base install
(the recorder, the node agent, the CLI and both stores) needs none of them."""

from __future__ import annotations

import importlib.util


class MissingExtra(Exception):
    """A command needs an optional part of Tracehound that is not installed (exit status 2)."""

    def __init__(self, extra: str, module: str) -> None:
        super().__init__(f"needs the {extra!r} extra ({module} is not installed): "
                         f"pip install 'tracehound[{extra}]'")
        self.extra = extra


def require_extra(extra: str, *modules: str) -> None:
    """Raise MissingExtra naming `extra` when one of `modules` cannot be imported."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise MissingExtra(extra, module)
