"""The patches that feed the recorder: torch.distributed collectives, process groups, DDP, steps.

`install_distributed` wraps the collective and point-to-point functions of `torch.distributed`
(in both `torch.distributed` and `torch.distributed.distributed_c10d`) and `init_process_group` /
`new_group`; `install_ddp` gives every DistributedDataParallel model one trampoline comm hook whose
default is the standard all-reduce (DDP's own gradient all-reduce otherwise bypasses
`dist.all_reduce`); `install_optimizer` counts training steps with a global optimizer step
post-hook.

A wrapper calls the original exactly as given and returns exactly what it returned; a user's
exception is re-raised unchanged (after recording the operation as failed). Errors of the
recording itself are swallowed and counted by the recorder. Nothing here may change what the
training program computes or sees.

Sequence ids: every collective (including barrier) takes the next id of its process group.
Point-to-point operations would break the "same id on every member" rule, so they count in a
pseudo group per pair of ranks, named `<group>:p2p:<low>-<high>` (announced with a
ProcessGroupInfo of backend "p2p"), or `<group>:p2p:any` for a receive from any source.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracehound.agent.recorder import Recorder, Token

log = logging.getLogger(__name__)

COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter_tensor", "all_to_all_single", "gather", "scatter", "barrier",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")
_ALWAYS_ASYNC = ("isend", "irecv")
_TENSOR_PARAMS = ("input_tensor", "input", "tensor")

_WRAPPED = "__tracehound_wrapped__"


class _Local(threading.local):
    depth = 0


_local = _Local()


@dataclass(frozen=True, slots=True)
class _Spec:
    op: str
    group_pos: int
    async_pos: int
    tensor_pos: int
    tensor_name: str
    peer_pos: int
    peer_name: str
    group_peer_pos: int
    group_peer_name: str
    p2p: bool
    always_async: bool


def _position(params: list[str], name: str) -> int:
    return params.index(name) if name in params else -1


def _spec(op: str, fn: Callable[..., Any]) -> _Spec:
    params = list(inspect.signature(fn).parameters)
    tensor_name = next((n for n in _TENSOR_PARAMS if n in params), "")
    p2p = op in POINT_TO_POINT
    peer_name = ("dst" if "send" in op else "src") if p2p else ""
    group_peer_name = ("group_dst" if "send" in op else "group_src") if p2p else ""
    return _Spec(
        op=op, group_pos=_position(params, "group"), async_pos=_position(params, "async_op"),
        tensor_pos=_position(params, tensor_name), tensor_name=tensor_name,
        peer_pos=_position(params, peer_name), peer_name=peer_name,
        group_peer_pos=_position(params, group_peer_name), group_peer_name=group_peer_name,
        p2p=p2p, always_async=op in _ALWAYS_ASYNC,
    )


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    if name and name in kwargs:
        return kwargs[name]
    if 0 <= pos < len(args):
        return args[pos]
    return None


class _Groups:
    """Names of process groups, cached; the cache is cleared when groups are destroyed."""

    def __init__(self, c10d: Any) -> None:
        self.c10d = c10d
        self.default: tuple[Any, str] | None = None
        self.by_id: dict[int, tuple[Any, str]] = {}
        self.dtypes: dict[Any, str] = {}

    def clear(self) -> None:
        self.default = None
        self.by_id.clear()

    def name(self, group: Any) -> str:
        if group is None:
            if self.default is None:
                pg = self.c10d._get_default_group()
                self.default = (pg, str(pg.group_name))
            return self.default[1]
        hit = self.by_id.get(id(group))
        if hit is None or hit[0] is not group:
            hit = (group, str(group.group_name))
            self.by_id[id(group)] = hit
        return hit[1]

    def dtype(self, tensor: Any) -> str:
        key = tensor.dtype
        text = self.dtypes.get(key)
        if text is None:
            text = self.dtypes[key] = str(key).removeprefix("torch.")
        return text


class _Installer:
    """Holds what the wrappers share: the recorder, torch's modules, the group-name cache."""

    def __init__(self, recorder: Recorder, dist: Any, on_group: Callable[[], None]) -> None:
        self.recorder = recorder
        self.dist = dist
        self.c10d = dist.distributed_c10d
        self.groups = _Groups(self.c10d)
        self.on_group = on_group
        self.pairs: set[str] = set()

    # -- collective wrappers ----------------------------------------------------------------------

    def begin(
        self, spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Token | None, bool]:
        group = _arg(args, kwargs, spec.group_pos, "group")
        if group is not None and group is self.c10d.GroupMember.NON_GROUP_MEMBER:
            return None, False
        is_async = spec.always_async or bool(_arg(args, kwargs, spec.async_pos, "async_op"))
        name = self.groups.name(group)
        nbytes, dtype = 0, ""
        if spec.tensor_pos >= 0:
            tensor = _arg(args, kwargs, spec.tensor_pos, spec.tensor_name)
            if tensor is not None:
                nbytes = tensor.numel() * tensor.element_size()
                dtype = self.groups.dtype(tensor)
        peer = -1
        if spec.p2p:
            peer = self.peer(spec, group, args, kwargs)
            name = self.pair(name, peer)
        return self.recorder.begin(name, spec.op, nbytes, dtype, peer), is_async

    def peer(self, spec: _Spec, group: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        peer = _arg(args, kwargs, spec.peer_pos, spec.peer_name)
        if peer is not None:
            return int(peer)
        group_peer = _arg(args, kwargs, spec.group_peer_pos, spec.group_peer_name)
        if group_peer is not None:
            pg = group if group is not None else self.c10d._get_default_group()
            return int(self.dist.get_global_rank(pg, group_peer))
        return -1

    def pair(self, group_name: str, peer: int) -> str:
        me = self.recorder.rank
        if peer < 0:
            name = f"{group_name}:p2p:any"
            ranks: tuple[int, ...] = (me,)
        else:
            low, high = min(me, peer), max(me, peer)
            name = f"{group_name}:p2p:{low}-{high}"
            ranks = (low, high)
        if name not in self.pairs:
            self.pairs.add(name)
            self.recorder.group_created(name, ranks, "p2p")
        return name

    def finish(self, spec: _Spec, token: Token, is_async: bool, result: Any) -> None:
        recorder = self.recorder
        if not is_async:
            peer = result if spec.op == "recv" and isinstance(result, int) else None
            recorder.end(token, True, peer=peer)
            return
        if result is None:
            recorder.end(token, True)
            return
        try:
            future = result.get_future()
        except RuntimeError:
            recorder.poll_later(result, token)
            return

        def completed(fut: Any) -> None:
            ok = True
            try:
                fut.value()
            except Exception:
                ok = False
            try:
                recorder.end(token, ok)
            except Exception as exc:
                recorder.note_error(spec.op, exc)

        future.then(completed)

    def wrap(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        spec = _spec(op, original)
        recorder = self.recorder
        local = _local

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if local.depth:
                return original(*args, **kwargs)
            token: Token | None = None
            is_async = False
            try:
                token, is_async = self.begin(spec, args, kwargs)
            except Exception as exc:
                recorder.note_error(op, exc)
            local.depth += 1
            try:
                result = original(*args, **kwargs)
            except BaseException:
                local.depth -= 1
                if token is not None:
                    try:
                        recorder.end(token, False)
                    except Exception as exc:
                        recorder.note_error(op, exc)
                raise
            local.depth -= 1
            if token is not None:
                try:
                    self.finish(spec, token, is_async, result)
                except Exception as exc:
                    recorder.note_error(op, exc)
            return result

        setattr(wrapper, _WRAPPED, original)
        return wrapper

    # -- process groups -----------------------------------------------------------------------

    def announce(self, pg: Any) -> None:
        dist = self.dist
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        try:
            backend = str(dist.get_backend(pg))
        except Exception:
            backend = ""
        self.recorder.group_created(str(pg.group_name), ranks, backend)

    def wrap_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                self.groups.clear()
                self.recorder.set_rank(int(self.dist.get_rank()))
                self.announce(self.c10d._get_default_group())
                self.on_group()
            except Exception as exc:
                self.recorder.note_error("init_process_group", exc)
            return result

        setattr(init_process_group, _WRAPPED, original)
        return init_process_group

    def wrap_new_group(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def new_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                if result is not None and result is not self.c10d.GroupMember.NON_GROUP_MEMBER:
                    self.announce(result)
            except Exception as exc:
                self.recorder.note_error("new_group", exc)
            return result

        setattr(new_group, _WRAPPED, original)
        return new_group

    def wrap_destroy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            try:
                self.groups.clear()
            except Exception as exc:
                self.recorder.note_error("destroy_process_group", exc)
            return original(*args, **kwargs)

        setattr(destroy_process_group, _WRAPPED, original)
        return destroy_process_group


def _patch(modules: tuple[Any, ...], name: str, make: Callable[[Any], Any]) -> bool:
    current = getattr(modules[-1], name, None)
    if current is None or hasattr(current, _WRAPPED):
        return False
    wrapper = make(current)
    for module in modules:
        if getattr(module, name, None) in (current, None) or module is modules[-1]:
            setattr(module, name, wrapper)
    return True


def _wrap_op(installer: _Installer, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    return installer.wrap(op, original)


def install_distributed(recorder: Recorder, on_group: Callable[[], None] = lambda: None) -> int:
    """Wrap torch.distributed's operations and group creation; returns how many were wrapped.

    `on_group` is called once the default process group exists (to start sending)."""
    dist: Any = importlib.import_module("torch.distributed")

    if not dist.is_available():
        return 0
    installer = _Installer(recorder, dist, on_group)
    modules = (dist, dist.distributed_c10d)
    count = 0
    for op in COLLECTIVES + POINT_TO_POINT:
        count += _patch(modules, op, functools.partial(_wrap_op, installer, op))
    count += _patch(modules, "init_process_group", installer.wrap_init)
    count += _patch(modules, "new_group", installer.wrap_new_group)
    count += _patch(modules, "destroy_process_group", installer.wrap_destroy)
    if dist.is_initialized():
        try:
            recorder.set_rank(int(dist.get_rank()))
            installer.announce(dist.distributed_c10d._get_default_group())
            on_group()
        except Exception as exc:
            recorder.note_error("install_distributed", exc)
    return count


# -- DDP -----------------------------------------------------------------------------------------


class _Trampoline:
    """State of the one comm hook tracehound registers on a DDP model."""

    def __init__(self, process_group: Any) -> None:
        self.process_group = process_group
        self.hook: Callable[[Any, Any], Any] | None = None
        self.state: Any = None


def tracehound_trampoline_hook(trampoline: _Trampoline, bucket: Any) -> Any:
    """Default: torch's allreduce_hook (whose dist.all_reduce is traced); else the user's hook."""
    hook = trampoline.hook
    if hook is None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        return default_hooks.allreduce_hook(trampoline.process_group, bucket)
    return hook(trampoline.state, bucket)


# DDP checks the hook's annotations against torch's own types; with postponed annotations ours
# are strings, so the hook carries none at run time.
tracehound_trampoline_hook.__annotations__ = {}


@dataclass
class DdpStats:
    hooked: int = 0
    skipped: int = 0


ddp_stats = DdpStats()
"""How many DDP models got the trampoline, and how many were left alone (see the log)."""


def _unsafe_reason(model: Any) -> str:
    if getattr(model, "_comm_hooks", None):
        return "it already has a comm hook"
    if getattr(model, "static_graph", False):
        return "static_graph=True"
    if getattr(model, "_use_python_reducer", False):
        return "it uses the python reducer (compiled autograd)"
    if getattr(model, "_delay_all_reduce_all_params", False):
        return "all its all-reduces are delayed"
    if getattr(model, "mixed_precision", None) is not None:
        return "mixed_precision is set"
    if getattr(model, "reducer", None) is None:
        return "it has no reducer"
    return ""


def install_ddp(recorder: Recorder) -> bool:
    """Give each new DDP model a trampoline comm hook; let a user's hook replace its inside."""
    ddp_module: Any = importlib.import_module("torch.nn.parallel.distributed")

    ddp = ddp_module.DistributedDataParallel
    if hasattr(ddp.__init__, _WRAPPED):
        return False
    original_init = ddp.__init__
    original_register = ddp.register_comm_hook
    original_builtin = ddp._register_builtin_comm_hook

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        try:
            reason = _unsafe_reason(self)
            if reason:
                ddp_stats.skipped += 1
                log.info("tracehound leaves this DDP model's gradient all-reduce untraced: %s",
                         reason)
                return
            trampoline = _Trampoline(self.process_group)
            original_register(self, trampoline, tracehound_trampoline_hook)
            self._tracehound_trampoline = trampoline
            ddp_stats.hooked += 1
        except Exception as exc:
            ddp_stats.skipped += 1
            recorder.note_error("DistributedDataParallel.__init__", exc)

    @functools.wraps(original_register)
    def register_comm_hook(self: Any, state: object, hook: Callable[..., Any]) -> None:
        trampoline: _Trampoline | None = getattr(self, "_tracehound_trampoline", None)
        if trampoline is None or trampoline.hook is not None:
            return original_register(self, state, hook)  # type: ignore[no-any-return]
        self._check_comm_hook(hook)
        trampoline.state, trampoline.hook = state, hook
        try:
            self.logger._set_comm_hook_name(hook.__qualname__)
        except Exception as exc:
            recorder.note_error("register_comm_hook", exc)
        return None

    @functools.wraps(original_builtin)
    def _register_builtin_comm_hook(self: Any, comm_hook_type: Any) -> None:
        trampoline: _Trampoline | None = getattr(self, "_tracehound_trampoline", None)
        if trampoline is None or trampoline.hook is not None:
            return original_builtin(self, comm_hook_type)  # type: ignore[no-any-return]
        dist: Any = importlib.import_module("torch.distributed")
        default_hooks: Any = importlib.import_module(
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"
        )
        python_hooks = {
            dist.BuiltinCommHookType.ALLREDUCE: default_hooks.allreduce_hook,
            dist.BuiltinCommHookType.FP16_COMPRESS: default_hooks.fp16_compress_hook,
        }
        hook = python_hooks.get(comm_hook_type)
        if hook is None:
            return original_builtin(self, comm_hook_type)  # type: ignore[no-any-return]
        trampoline.state, trampoline.hook = self.process_group, hook
        return None

    setattr(__init__, _WRAPPED, original_init)
    ddp.__init__ = __init__
    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = _register_builtin_comm_hook
    return True


# -- steps ---------------------------------------------------------------------------------------


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
