"""Functional collectives: the communication of DTensor, tensor parallelism, FSDP2's gradient
clipping and eager `torch.distributed._functional_collectives` calls, recorded like any other.

These collectives never pass through `torch.distributed.all_reduce` and its kin: the functions of
`torch.distributed._functional_collectives` (funcol) call the C++ ops
`torch.ops._c10d_functional.*` directly, which issue the work on the process group and return at
once; the result is an `AsyncCollectiveTensor` whose first use calls funcol's `wait_tensor`.
DTensor and tensor parallelism call them through the module (`funcol.all_reduce(...)`), so
`install_functional` wraps the module's entry points and its `wait_tensor`:

- a call is recorded in its process group (resolved from whatever funcol accepts: a group, its
  name, a DeviceMesh, `(mesh, dim)`) under the op name the `torch.distributed` function of the
  same collective is recorded under (all_reduce, all_gather_into_tensor, reduce_scatter_tensor,
  all_to_all_single, broadcast, and the coalesced forms), with the same per-group sequence ids:
  a rank that all-reduces through DTensor and through `dist.all_reduce` numbers both alike;
- it is entered when issued and completes when its result is first waited for (`wait_tensor` on
  the result's storage). On a CPU backend the wait returns once the work completed; on CUDA it
  orders the streams only, so the completion recorded is the wait's, not the GPU's. A result
  never waited for (c10d keeps it until a wait, so it is not even freed) completes, as seen
  from the heartbeat thread (`Functional.settle`), once a later call of its group completed on
  this rank: the calls of one group complete in order;
- a call made while torch.compile traces (`torch.compiler.is_compiling`) or on fake tensors
  (funcol's own `_are_we_tracing`) is passed on unrecorded: it issues nothing. (A proxy mode
  tracing plain tensors, `make_fx`, is not looked for.)

Not covered here: the ops a compiled graph or funcol's own autograd backward calls
(`torch.ops._c10d_functional.*` straight from C++ or generated code) do not pass through these
functions. Their ranks are still seen waiting by their stacks (`analysis.detect`), and a frozen
rank they wait on by the job's standstill.

Like `hooks`, nothing here may raise into the training process or change what it computes: the
original is called with the arguments it was given and its result returned as is; an error of
the recording itself is counted by the recorder.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import weakref
from collections.abc import Callable
from typing import Any

from tracehound.agent.rank import hooks
from tracehound.agent.rank.recorder import Recorder, Token

FUNCTIONAL_OPS: dict[str, str] = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast",
    "all_gather_single": "all_gather_into_tensor",
    "all_gather_tensor": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "all_to_all_single": "all_to_all_single",
    "all_reduce_coalesced": "all_reduce_coalesced",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
}
"""funcol entry point -> the op it is recorded under. Aliases call each other (the deprecated
`*_tensor` names call the `*_single` ones): the depth guard (`hooks.catalog._inside`) records the
outermost call only."""

MAX_PENDING = 4096
"""Results issued and not yet waited for or freed, at most: past it the oldest call is ended as
it stands (a program that keeps results without ever using them must not grow this without
end)."""

_Entry = tuple[list[Token | None], "weakref.ref[Any] | None"]
"""A result's pending call: a one-item list holding its token (None once ended: the results of
one coalesced call share it) and a weak reference to the result's tensor, whose death (where
c10d let it go unwaited) ends the call."""


class Functional:
    """The funcol wrappers' shared state: the recorder, funcol's module and the calls whose results
    are still pending, by their storage's address."""

    def __init__(self, recorder: Recorder, funcol: Any) -> None:
        self.recorder = recorder
        self.funcol = funcol
        self.resolve: Callable[[Any, str], str] = funcol._resolve_group_name
        self.tracing: Callable[[], bool] = getattr(funcol, "_are_we_tracing", _never)
        self.result_type: Any = getattr(funcol, "AsyncCollectiveTensor", None)
        self.plain_tensor: Any = importlib.import_module("torch").Tensor
        self.pending: dict[int, _Entry] = {}
        self.lock = threading.Lock()

    # -- issuing ------------------------------------------------------------------------------

    def begin(self, op: str, tensor: Any, group: Any, tag: Any) -> Token | None:
        """The call's token, or None when it is not to be recorded: funcol is tracing (a fake
        or proxy mode: looked up only for a tensor that is not a plain one, as a fake mode's
        are; 1.2 us a call otherwise)."""
        first = tensor[0] if isinstance(tensor, (list, tuple)) and tensor else tensor
        if type(first) is not self.plain_tensor and self.tracing():
            return None
        name = str(self.resolve(group, tag or ""))
        installer = hooks.state.installer
        if installer is not None and name not in installer.announced:
            c10d = installer.c10d
            installer.first_seen(c10d._resolve_process_group(name))
        if isinstance(tensor, (list, tuple)):
            nbytes = sum(t.numel() * t.element_size() for t in tensor)
            dtype = tensor[0].dtype if tensor else ""
        elif tensor is not None:
            nbytes, dtype = tensor.nbytes, tensor.dtype
        else:
            nbytes, dtype = 0, ""
        return self.recorder.begin(name, op, nbytes, dtype)

    def issued(self, token: Token, result: Any) -> None:
        """The call of `token` returned `result`: pending until a result is waited for or freed,
        or ended now when funcol already waited (it does while tracing)."""
        results = result if isinstance(result, (list, tuple)) else (result,)
        shared: list[Token | None] = [token]
        kept = False
        result_type = self.result_type
        for r in results:
            if result_type is None or type(r) is not result_type:
                continue
            elem = r.elem
            key = elem.untyped_storage().data_ptr()
            if not key:
                continue  # an empty result: nothing to tell it by
            ref = weakref.ref(elem, functools.partial(self._freed, key))
            with self.lock:
                self.pending[key] = (shared, ref)
                over = len(self.pending) > MAX_PENDING
                oldest = self.pending.pop(next(iter(self.pending))) if over else None
            kept = True
            if oldest is not None:
                self._end(oldest, True)
        if not kept:
            self._end((shared, None), True)

    def _freed(self, key: int, ref: weakref.ref[Any]) -> None:
        """A result's tensor died: its call ended (if no wait ended it) as it stands."""
        try:
            with self.lock:
                entry = self.pending.get(key)
                if entry is None or entry[1] is not ref:
                    return
                del self.pending[key]
            self._end(entry, True)
        except Exception as exc:
            self.recorder.note_error("functional result freed", exc)

    def settle(self) -> None:
        """End the pending calls that a later completed call of their group shows complete (the
        heartbeat thread, each training step, close): results never waited for."""
        if not self.pending:
            return
        with self.lock:
            done = [(key, entry) for key, entry in self.pending.items()
                    if entry[0][0] is None or entry[0][0][0].last_completed > entry[0][0][1]]
            for key, _ in done:
                del self.pending[key]
        for _, entry in done:
            self._end(entry, True)

    def _end(self, entry: _Entry, ok: bool) -> None:
        shared = entry[0]
        token = shared[0]
        if token is not None:
            shared[0] = None
            self.recorder.end(token, ok)

    # -- waiting -------------------------------------------------------------------------------

    def waiting(self, tensor: Any) -> _Entry | None:
        """The pending call whose result `tensor` is (by its storage), taken out; None if none."""
        key = tensor.untyped_storage().data_ptr()
        with self.lock:
            return self.pending.pop(key, None)

    def waited(self, entry: _Entry, ok: bool) -> None:
        self._end(entry, ok)


def _never() -> bool:
    return False


def _params(fn: Callable[..., Any]) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _wrap_call(state: Functional, op: str, original: Callable[..., Any],
               compiling: Callable[[], bool]) -> Callable[..., Any]:
    params = _params(original)
    group_pos = params.index("group") if "group" in params else len(params)
    tag_pos = params.index("tag") if "tag" in params else -1
    tensor_name = params[0] if params else "self"
    recorder = state.recorder
    inside = hooks.catalog._inside
    get_ident = threading.get_ident

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if compiling() or (inside and get_ident() in inside):
            return original(*args, **kwargs)
        token: Token | None = None
        counted = None
        try:
            n = len(args)
            tensor = args[0] if n else kwargs.get(tensor_name)
            group = args[group_pos] if group_pos < n else kwargs.get("group")
            tag = args[tag_pos] if 0 <= tag_pos < n else kwargs.get("tag", "")
            token = state.begin(op, tensor, group, tag)
            counted = token[0].counted if token is not None else None
        except Exception as exc:
            recorder.note_error(op, exc)
        if counted is not None:  # a group whose other traffic DDP counts (hooks.ddp._DdpCount)
            before = counted.enter()
        me = get_ident()
        inside.add(me)
        try:
            result = original(*args, **kwargs)
        except BaseException:
            inside.discard(me)
            if counted is not None:
                counted.around(before)
            if token is not None:
                try:
                    recorder.end(token, False)
                except Exception as exc:
                    recorder.note_error(op, exc)
            raise
        inside.discard(me)
        if counted is not None:
            counted.around(before)
        if token is not None:
            try:
                state.issued(token, result)
            except Exception as exc:
                recorder.note_error(op, exc)
        return result

    setattr(wrapper, hooks.catalog._WRAPPED, original)
    return wrapper


def _wrap_wait(state: Functional, original: Callable[..., Any],
               compiling: Callable[[], bool]) -> Callable[..., Any]:
    recorder = state.recorder
    pending = state.pending

    @functools.wraps(original)
    def wait_tensor(tensor: Any) -> Any:
        if not pending or compiling():
            return original(tensor)
        entry = None
        try:
            entry = state.waiting(tensor)
        except Exception as exc:
            recorder.note_error("wait_tensor", exc)
        if entry is None:
            return original(tensor)
        try:
            result = original(tensor)
        except BaseException:
            try:
                state.waited(entry, False)
            except Exception as exc:
                recorder.note_error("wait_tensor", exc)
            raise
        try:
            state.waited(entry, True)
        except Exception as exc:
            recorder.note_error("wait_tensor", exc)
        return result

    setattr(wait_tensor, hooks.catalog._WRAPPED, original)
    return wait_tensor


_state: Functional | None = None


def install_functional(recorder: Recorder) -> int:
    """Wrap funcol's entry points and its `wait_tensor`; how many were wrapped (0 when funcol is
    missing or already wrapped)."""
    global _state
    funcol: Any = importlib.import_module("torch.distributed._functional_collectives")
    if not hasattr(funcol, "_resolve_group_name"):
        return 0
    compiler = importlib.import_module("torch.compiler")
    compiling: Callable[[], bool] = getattr(compiler, "is_compiling", _never)
    state = _state if _state is not None and _state.recorder is recorder else None
    if state is None:
        state = Functional(recorder, funcol)
        recorder.add_settler(state.settle)
    count = 0
    for name, op in FUNCTIONAL_OPS.items():
        current = getattr(funcol, name, None)
        if current is None or hasattr(current, hooks.catalog._WRAPPED):
            continue
        setattr(funcol, name, _wrap_call(state, op, current, compiling))
        count += 1
    current = getattr(funcol, "wait_tensor", None)
    if current is not None and not hasattr(current, hooks.catalog._WRAPPED):
        funcol.wait_tensor = _wrap_wait(state, current, compiling)
        count += 1
    _state = state
    return count
