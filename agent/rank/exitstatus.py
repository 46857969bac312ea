"""Leaves a rank's exit status in a file as the rank ends, for a controller that is not its parent.

A controller that was killed and started again adopts the ranks still running, but it cannot
wait for them: only their parent could. So each rank, when its interpreter ends, writes its
exit status (the `sys.exit` status of the main thread, 1 after an uncaught exception, else 0)
to `<TRACEHOUND_EXIT_FILE>.<pid>`; its children, forked or spawned with the same environment,
write a file of their own or (forked) none. A rank killed by a signal, or leaving through
`os._exit`, writes nothing, and the controller reports its end as unknown. `raise SystemExit(n)`
that bypasses `sys.exit` is seen as 0.

Runs inside the training process: it never raises, and costs one small write at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

_path: str | None = None
_pid = 0
_code = 0


def _status_code(status: object) -> int:
    """The process exit status `sys.exit(status)` gives."""
    if status is None:
        return 0
    if isinstance(status, int):
        return status & 0xFF
    return 1  # a message: printed to stderr, status 1


def _note(code: int) -> None:
    global _code
    if threading.current_thread() is threading.main_thread():
        _code = code


def status_path(path: str, pid: int) -> str:
    """Where the process `pid` leaves its status, given TRACEHOUND_EXIT_FILE's `path`."""
    return f"{path}.{pid}"


def _write() -> None:
    if _path is None or os.getpid() != _pid:  # a forked child inherits the handler
        return
    with contextlib.suppress(Exception):
        final = status_path(_path, _pid)
        tmp = f"{final}.tmp"
        with open(tmp, "w") as handle:
            handle.write(f"{_code}\n")
        os.replace(tmp, final)


def install(path: str) -> None:
    """Record this process's exit status in `path` when it ends (once per process)."""
    global _path, _pid
    if _path is not None or not path:
        return
    _path, _pid = path, os.getpid()
    exit_: Callable[..., Any] = sys.exit
    hook = sys.excepthook

    def traced_exit(status: object = None) -> Any:
        _note(_status_code(status))
        return exit_(status)

    def traced_hook(kind: type[BaseException], value: BaseException,
                    tb: TracebackType | None) -> Any:
        _note(1)
        return hook(kind, value, tb)

    sys.exit = traced_exit
    sys.excepthook = traced_hook
    atexit.register(_write)
