"""Puts the recorder into a training process with no change to the training script.

Imported by `tracehound/agent/_bootstrap/sitecustomize.py` at interpreter start. When
TRACEHOUND_AGENT_SOCKET is set and TRACEHOUND_DISABLE is not, it creates the process's Recorder
(sending to the node agent through a SocketTransport) and registers post-import hooks: a
`sys.meta_path` finder wraps the loaders of `torch.distributed`, its functional collectives
(`torch.distributed._functional_collectives`, imported with DTensor),
`torch.nn.parallel.distributed`, `torch.optim.optimizer` and
`torch.distributed.checkpoint.state_dict`, so the patches are applied
right after those modules are imported. Modules already imported are patched at once.

It must never import torch itself (a Python process that never imports torch pays ~nothing) and
never raise: every failure is logged and the process runs on untraced. Nothing is sent before the
default process group exists, so helper processes that import torch but never join the job
(data-loader workers, tools) stay silent.
"""

from __future__ import annotations

import atexit
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from tracehound.tracing.settings import (
    DEFAULT_BUFFER_RECORDS,
    DEFAULT_DDP_SPAN_S,
    DEFAULT_DDP_TRACE_EVERY,
    DEFAULT_HEARTBEAT_S,
    DEFAULT_INFLIGHT_S,
    DEFAULT_SEND_S,
    MIN_BUFFER_RECORDS,
    MIN_HEARTBEAT_S,
    MIN_SEND_S,
    TRACEHOUND_AGENT_SOCKET,
    TRACEHOUND_BUFFER_RECORDS,
    TRACEHOUND_DDP_SPAN_S,
    TRACEHOUND_DDP_TRACE_EVERY,
    TRACEHOUND_DISABLE,
    TRACEHOUND_EXIT_FILE,
    TRACEHOUND_HEARTBEAT_S,
    TRACEHOUND_INFLIGHT_S,
    TRACEHOUND_SEND_S,
    env_flag,
    env_float,
    env_int,
    env_str,
)

if TYPE_CHECKING:
    from tracehound.agent.rank.recorder import Recorder
    from tracehound.agent.rank.transport import SocketTransport

log = logging.getLogger(__name__)

_recorder: Recorder | None = None
_transport: SocketTransport | None = None
_lock = threading.Lock()
_installed: set[str] = set()
_env: dict[str, str] | None = None


def recorder() -> Recorder | None:
    """The recorder of this process, or None when tracing is off."""
    return _recorder


def _patch_distributed() -> None:
    from tracehound.agent.rank import hooks

    if _recorder is not None:
        hooks.install_distributed(_recorder, on_group=_activate)


def _patch_functional() -> None:
    from tracehound.agent.rank import functional

    if _recorder is not None:
        functional.install_functional(_recorder)


def _patch_ddp() -> None:
    from tracehound.agent.rank import hooks

    if _recorder is not None and _env is not None:
        hooks.install_ddp(_recorder, every=_ddp_trace_every(_env), span_s=_ddp_span_s(_env))


def _patch_optimizer() -> None:
    from tracehound.agent.rank import hooks

    if _recorder is not None:
        hooks.install_optimizer(_recorder)


def _patch_checkpoint_state_dict() -> None:
    from tracehound.agent.rank import hooks

    if _recorder is not None:
        hooks.install_checkpoint_state_dict(_recorder)


PATCHES: dict[str, Callable[[], None]] = {
    "torch.distributed": _patch_distributed,
    "torch.distributed._functional_collectives": _patch_functional,
    "torch.nn.parallel.distributed": _patch_ddp,
    "torch.optim.optimizer": _patch_optimizer,
    "torch.distributed.checkpoint.state_dict": _patch_checkpoint_state_dict,
}
"""Module name -> the patch applied right after it is imported."""


def _buffer_records(env: Mapping[str, str]) -> int:
    """TRACEHOUND_BUFFER_RECORDS of `env`, checked (SettingError)."""
    return env_int(TRACEHOUND_BUFFER_RECORDS, DEFAULT_BUFFER_RECORDS, env=env,
                   minimum=MIN_BUFFER_RECORDS)


def _heartbeat_s(env: Mapping[str, str]) -> float:
    """TRACEHOUND_HEARTBEAT_S of `env`, checked (SettingError)."""
    return env_float(TRACEHOUND_HEARTBEAT_S, DEFAULT_HEARTBEAT_S, env=env,
                     minimum=MIN_HEARTBEAT_S)


def _ddp_trace_every(env: Mapping[str, str]) -> int:
    """TRACEHOUND_DDP_TRACE_EVERY of `env`, checked (SettingError)."""
    return env_int(TRACEHOUND_DDP_TRACE_EVERY, DEFAULT_DDP_TRACE_EVERY, env=env, minimum=0)


def _ddp_span_s(env: Mapping[str, str]) -> float:
    """TRACEHOUND_DDP_SPAN_S of `env`, checked (SettingError)."""
    return env_float(TRACEHOUND_DDP_SPAN_S, DEFAULT_DDP_SPAN_S, env=env, minimum=0.0)


def _send_s(env: Mapping[str, str]) -> float:
    """TRACEHOUND_SEND_S of `env`, checked (SettingError)."""
    return env_float(TRACEHOUND_SEND_S, DEFAULT_SEND_S, env=env, minimum=MIN_SEND_S)


def _inflight_s(env: Mapping[str, str]) -> float:
    """TRACEHOUND_INFLIGHT_S of `env`, checked (SettingError)."""
    return env_float(TRACEHOUND_INFLIGHT_S, DEFAULT_INFLIGHT_S, env=env, minimum=0.0)


def _ensure_recorder() -> None:
    """Create the recorder on first need: a process that never imports torch never pays for it."""
    global _recorder, _transport
    if _recorder is not None or _env is None:
        return
    from tracehound.agent.rank.recorder import Recorder, identity_from_env
    from tracehound.agent.rank.transport import SocketTransport

    job, attempt, node, rank = identity_from_env(_env)
    transport = SocketTransport(
        env_str(TRACEHOUND_AGENT_SOCKET, env=_env),
        bound=_buffer_records(_env), poll_s=_send_s(_env),
    )
    _recorder = Recorder(
        job=job, attempt=attempt, node=node, rank=rank, sink=transport,
        heartbeat_s=_heartbeat_s(_env), inflight_s=_inflight_s(_env),
    )
    _transport = transport
    atexit.register(_at_exit)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _apply(name: str) -> None:
    with _lock:
        if name in _installed:
            return
        _installed.add(name)
    try:
        _ensure_recorder()
        PATCHES[name]()
        log.debug("tracehound patched %s", name)
    except Exception as exc:
        if _recorder is not None:
            _recorder.note_error(f"patch {name}", exc)
        log.warning("tracehound could not patch %s: %r", name, exc)


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch; puts the real loader back on the module."""

    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create: Callable[[importlib.machinery.ModuleSpec], ModuleType | None] | None = getattr(
            self.inner, "create_module", None
        )
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is not None:
            spec.loader = self.inner
        module.__loader__ = self.inner
        self.inner.exec_module(module)
        _apply(self.name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: it wraps the loader other finders return for the patched modules."""

    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in PATCHES or fullname in _installed or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.on = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, fullname)
        return spec


_transport_started = False


def _activate() -> None:
    """The default process group exists: start sending and heartbeats (idempotent)."""
    global _transport_started
    if _recorder is None or _transport is None:
        return
    if not _transport_started:
        _transport_started = True
        _transport.start()
    _recorder.start()


def _at_exit() -> None:
    if _recorder is not None and _recorder.started:
        _recorder.close(timeout=2.0)


def _after_fork_in_child() -> None:
    if _recorder is not None:
        _recorder.disable()
    if _transport is not None:
        _transport.forget_thread()


def install(env: dict[str, str] | None = None) -> bool:
    """Set up recording for this process if the environment asks for it; True if it did.

    Only the import hook is installed here; the recorder is created when torch.distributed, DDP or
    the optimizer module is imported (or at once if one already is)."""
    global _env
    source = dict(os.environ) if env is None else env
    exit_file = source.get(TRACEHOUND_EXIT_FILE, "")
    if exit_file:
        from tracehound.agent.rank import exitstatus

        exitstatus.install(exit_file)
    socket_path = env_str(TRACEHOUND_AGENT_SOCKET, env=source)
    if not socket_path or env_flag(TRACEHOUND_DISABLE, env=source) or _env is not None:
        return False
    # Bad values fail here, at start, with the variable's name, rather than inside an import.
    _buffer_records(source)
    _heartbeat_s(source)
    _inflight_s(source)
    _send_s(source)
    _ddp_trace_every(source)
    _ddp_span_s(source)
    _env = source
    sys.meta_path.insert(0, PostImportFinder())
    for name in PATCHES:
        if name in sys.modules:
            _apply(name)
    return True


try:
    install()
except Exception as exc:  # a bad setting must not stop the training process
    log.warning("tracehound recorder not installed: %r", exc)
