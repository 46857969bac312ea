"""The patches that feed the recorder: torch.distributed collectives, process groups, DDP, steps.

`install_distributed` wraps the functions of `torch.distributed` a training job communicates with
(in `torch.distributed.distributed_c10d`, and wherever `torch.distributed` or
`torch.distributed.device_mesh` hold the same function):

- collectives: all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor /
  all_gather_single / _all_gather_base, reduce_scatter, reduce_scatter_tensor /
  reduce_scatter_single / _reduce_scatter_base, all_to_all, all_to_all_single, gather, scatter,
  barrier, monitored_barrier, all_reduce_coalesced, all_gather_coalesced. The aliases of one
  collective are recorded under one op name (all_gather_into_tensor, reduce_scatter_tensor), so
  members that call it by different names still agree. FSDP2 (`fully_shard`) all-gathers and
  reduce-scatters through all_gather_single / reduce_scatter_single, so it is covered.
- object collectives: all_gather_object, gather_object, broadcast_object_list,
  scatter_object_list, each recorded as ONE operation of its group under its own name, nbytes 0
  (their size is that of pickles made inside torch).
- point-to-point: send, recv, isend, irecv, send_object_list, recv_object_list, and
  batch_isend_irecv (each op of the batch recorded as its isend / irecv).
- process groups: init_process_group, new_group (and so new_subgroups,
  new_subgroups_by_enumeration), the `_new_group_with_tag` they and DeviceMesh go through,
  split_group, shrink_group, destroy_process_group.

`install_ddp` gives every DistributedDataParallel model one trampoline comm hook whose default is
the standard all-reduce (DDP's own gradient all-reduce otherwise bypasses `dist.all_reduce`);
`install_optimizer` counts training steps with a global optimizer step post-hook.

A wrapper calls the original exactly as given and returns exactly what it returned; a user's
exception is re-raised unchanged (after recording the operation as failed). Errors of the
recording itself are swallowed and counted by the recorder. Nothing here may change what the
training program computes or sees, block it, or add work per call that a record does not need.

Sequence ids: every collective (including barrier) takes the next id of its process group, so the
same (group, seq) is the same call on every member. A wrapped function called from inside another
(torch's object collectives run two or three tensor collectives; send runs isend; the aliases call
each other) is not recorded again: a thread-local depth guard lets only the outermost call count.
Every member of an object collective runs the same internal calls (gather_object all-gathers the
sizes and gathers on every member, scatter_object_list broadcasts the size and scatters twice on
every member, ...), so counting the outer call alone keeps the ids aligned on all members.

Point-to-point operations would break the "same id on every member" rule, so they count in a
pseudo group per pair of ranks, named `<group>:p2p:<low>-<high>` (announced with a
ProcessGroupInfo of backend "p2p"), or `<group>:p2p:any` for a receive from any source; peers
given as group ranks (`group_dst` / `group_src`, P2POp's `group_peer`) are recorded as global
ranks. Calls outside a batch take their ids in the order each end makes them: blocking
send/recv pair up in program order on both ends; isend/irecv agree when both ends issue a pair's
transfers in the same order (not checked: a program may issue them in any order). The ops of one
batch_isend_irecv may be listed in any order, so they take their ids in a canonical order: per
pair, the transfers from the lower rank to the higher first, then the others, list order within
one direction (the order torch matches them in). Both ends then number a transfer alike.

Groups: a ProcessGroupInfo (the group's global ranks) is recorded once per group this rank is a
member of, when the group is created, and otherwise when it is first used (groups created before
the recorder was installed, or by a path not wrapped).

Not covered: functional collectives (`torch.distributed._functional_collectives`, DTensor
redistribution, torch.compile) run as C++ ops without these Python functions; DDP's own C++
collectives (parameter broadcast and shape check at construction); the communication of a
`_coalescing_manager` block, whose ops are recorded when they are queued (they end at once).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

from tracehound.agent.recorder import Recorder, Token

log = logging.getLogger(__name__)

COLLECTIVES = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single", "gather",
    "scatter", "barrier", "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
    "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv", "send_object_list", "recv_object_list")
GROUP_FACTORIES = ("new_group", "_new_group_with_tag", "split_group", "shrink_group")
"""Functions that return a new process group, announced with a ProcessGroupInfo."""

OP_NAMES = {
    "all_gather_single": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "reduce_scatter_single": "reduce_scatter_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
}
"""Aliases of one collective -> the op name it is recorded under."""

_ALWAYS_ASYNC = ("isend", "irecv")
_RETURNS_PEER = ("recv", "recv_object_list")
_TENSOR_PARAMS = ("input_tensor", "input", "tensor")
_TENSOR_LIST_PARAMS = ("input_tensor_list", "input_list", "tensors")

_WRAPPED = "__tracehound_wrapped__"


class _Local(threading.local):
    depth = 0
    claim: bool = False
    """Set by the DDP trampoline around its all_reduce: the wrapper then leaves the call's end to
    the trampoline (`claimed`) instead of adding a completion callback of its own."""
    claimed: Token | None = None


_local = _Local()


@dataclass(frozen=True, slots=True)
class _Spec:
    op: str
    group_pos: int
    async_pos: int
    tensor_pos: int
    tensor_name: str
    tensor_list: bool
    peer_pos: int
    peer_name: str
    group_peer_pos: int
    group_peer_name: str
    p2p: bool
    always_async: bool
    returns_peer: bool


def _position(params: list[str], name: str) -> int:
    return params.index(name) if name in params else -1


def _spec(op: str, fn: Callable[..., Any]) -> _Spec:
    params = list(inspect.signature(fn).parameters)
    tensor_name = next((n for n in _TENSOR_PARAMS if n in params), "")
    tensor_list = not tensor_name
    if tensor_list:
        tensor_name = next((n for n in _TENSOR_LIST_PARAMS if n in params), "")
    p2p = op in POINT_TO_POINT
    peer_name = ("dst" if "send" in op else "src") if p2p else ""
    group_peer_name = ("group_dst" if "send" in op else "group_src") if p2p else ""
    return _Spec(
        op=OP_NAMES.get(op, op), group_pos=_position(params, "group"),
        async_pos=_position(params, "async_op"),
        tensor_pos=_position(params, tensor_name), tensor_name=tensor_name,
        tensor_list=tensor_list and bool(tensor_name),
        peer_pos=_position(params, peer_name), peer_name=peer_name,
        group_peer_pos=_position(params, group_peer_name), group_peer_name=group_peer_name,
        p2p=p2p, always_async=op in _ALWAYS_ASYNC, returns_peer=op in _RETURNS_PEER,
    )


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: int, name: str) -> Any:
    if name and name in kwargs:
        return kwargs[name]
    if 0 <= pos < len(args):
        return args[pos]
    return None


class _Groups:
    """Names of process groups, cached; the cache is cleared when groups are destroyed.

    `first_seen` is called with a group (never the default one) the first time its name is
    looked up after creation or a clear."""

    def __init__(self, c10d: Any, first_seen: Callable[[Any], None] = lambda pg: None) -> None:
        self.c10d = c10d
        self.first_seen = first_seen
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
            self.first_seen(group)
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
        self.groups = _Groups(self.c10d, self.first_seen)
        self.dtypes = self.groups.dtypes
        self.non_member: Any = self.c10d.GroupMember.NON_GROUP_MEMBER
        self.on_group = on_group
        self.pairs: dict[tuple[str, int], str] = {}
        self.announced: set[str] = set()
        self.illegal_work: Any = getattr(self.c10d, "_IllegalWork", None)
        # torch._C: torch.distributed is imported while torch itself is still initializing
        self.future_type: Any = importlib.import_module("torch._C").Future

    # -- collective wrappers ----------------------------------------------------------------------

    def begin(
        self, spec: _Spec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Token | None, bool]:
        # the hot path: arguments read inline (no helper calls), one C call for the size
        n = len(args)
        pos = spec.group_pos
        group = kwargs["group"] if "group" in kwargs else (args[pos] if 0 <= pos < n else None)
        if group is None:
            default = self.groups.default
            name = default[1] if default is not None else self.groups.name(None)
        elif group is self.non_member:
            return None, False
        else:
            name = self.groups.name(group)
        pos = spec.async_pos
        is_async = spec.always_async or bool(
            kwargs["async_op"] if "async_op" in kwargs else (args[pos] if 0 <= pos < n else False)
        )
        nbytes, dtype = 0, ""
        pos = spec.tensor_pos
        if pos >= 0:
            key = spec.tensor_name
            tensor = kwargs[key] if key in kwargs else (args[pos] if pos < n else None)
            if tensor is not None:
                if spec.tensor_list:
                    nbytes, dtype = self.list_size(tensor)
                else:
                    nbytes = tensor.nbytes
                    dtype = self.dtypes.get(tensor.dtype) or self.groups.dtype(tensor)
        peer = -1
        if spec.p2p:
            peer = self.peer(spec, group, args, kwargs)
            name = self.pair(name, peer)
        return self.recorder.begin(name, spec.op, nbytes, dtype, peer), is_async

    def list_size(self, tensors: Any) -> tuple[int, str]:
        """(bytes, dtype) of a list of tensors (or of one tensor, which torch accepts too)."""
        if hasattr(tensors, "element_size"):
            return tensors.numel() * tensors.element_size(), self.groups.dtype(tensors)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return nbytes, (self.groups.dtype(tensors[0]) if len(tensors) else "")

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
        name = self.pairs.get((group_name, peer))
        if name is not None:
            return name
        me = self.recorder.rank
        if peer < 0:
            name = f"{group_name}:p2p:any"
            ranks: tuple[int, ...] = (me,)
        else:
            low, high = min(me, peer), max(me, peer)
            name = f"{group_name}:p2p:{low}-{high}"
            ranks = (low, high)
        self.pairs[(group_name, peer)] = name
        if name not in self.announced:
            self.announced.add(name)
            self.recorder.group_created(name, ranks, "p2p")
        return name

    def finish(self, spec: _Spec, token: Token, is_async: bool, result: Any) -> None:
        recorder = self.recorder
        if not is_async:
            peer = result if spec.returns_peer and isinstance(result, int) else None
            recorder.end(token, True, peer=peer)
            return
        self.finish_work(spec.op, token, result, ordered=not spec.p2p)

    def finish_work(self, op: str, token: Token, result: Any, *, ordered: bool) -> None:
        """End `token` when the async `result` (a Work, a Future or nothing) completes
        (`ordered`: a collective's, see `Recorder.poll_later`)."""
        recorder = self.recorder
        if result is None or type(result) is self.illegal_work:
            # nothing to wait for; an _IllegalWork: the op was queued into a coalescing block
            recorder.end(token, True)
            return
        if _local.claim:
            _local.claimed = token  # the DDP trampoline ends it in its own callback
            return
        if isinstance(result, self.future_type):
            future = result  # all_reduce_coalesced / all_gather_coalesced return a Future
        else:
            try:
                future = result.get_future()
            except RuntimeError:
                recorder.poll_later(result, token, ordered=ordered)
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
                recorder.note_error(op, exc)

        future.then(completed)

    def wrap(self, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
        spec = _spec(op, original)
        recorder = self.recorder
        local = _local
        returns_peer = spec.returns_peer

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
            # the outermost call only: set and cleared, not counted (0.07 us less than += / -=)
            local.depth = 1
            try:
                result = original(*args, **kwargs)
            except BaseException:
                local.depth = 0
                if token is not None:
                    try:
                        recorder.end(token, False)
                    except Exception as exc:
                        recorder.note_error(op, exc)
                raise
            local.depth = 0
            if token is not None:
                try:
                    if is_async or returns_peer:
                        self.finish(spec, token, is_async, result)
                    else:  # the common case, without a call in between
                        recorder.end(token, True)
                except Exception as exc:
                    recorder.note_error(op, exc)
            return result

        setattr(wrapper, _WRAPPED, original)
        return wrapper

    # -- batch_isend_irecv ----------------------------------------------------------------------

    def begin_batch(self, ops: Any) -> list[Token | None]:
        """Begin the ops of a batch (P2POps) in the canonical order; their tokens in list order."""
        me = self.recorder.rank
        keyed: list[tuple[str, int, int, str, int, Any]] = []
        for index, p2p in enumerate(ops):
            peer = int(p2p.peer)
            is_send = "send" in getattr(p2p.op, "__name__", "")
            pair = self.pair(self.groups.name(p2p.group), peer)
            # lower rank -> higher rank transfers first, then the others
            upward = (me < peer) if is_send else (peer < me)
            keyed.append((pair, 0 if upward else 1, index, "isend" if is_send else "irecv",
                          peer, p2p.tensor))
        tokens: list[Token | None] = [None] * len(keyed)
        groups = self.groups
        for pair, _, index, op, peer, tensor in sorted(keyed, key=lambda k: k[:3]):
            tokens[index] = self.recorder.begin(
                pair, op, tensor.numel() * tensor.element_size(), groups.dtype(tensor), peer,
            )
        return tokens

    def finish_batch(self, tokens: list[Token | None], works: Any) -> None:
        """Tie each op's token to its work: one per op, or the one work of a coalesced batch."""
        recorder = self.recorder
        works = list(works or ())
        for index, token in enumerate(tokens):
            if token is None:
                continue
            if len(works) == len(tokens):
                self.finish_work("batch_isend_irecv", token, works[index], ordered=False)
            elif len(works) == 1:
                self.finish_work("batch_isend_irecv", token, works[0], ordered=False)
            else:
                recorder.end(token, True)

    def wrap_batch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self.recorder
        local = _local

        @functools.wraps(original)
        def batch_isend_irecv(*args: Any, **kwargs: Any) -> Any:
            if local.depth:
                return original(*args, **kwargs)
            tokens: list[Token | None] = []
            try:
                ops = args[0] if args else kwargs.get("p2p_op_list")
                tokens = self.begin_batch(ops)
            except Exception as exc:
                recorder.note_error("batch_isend_irecv", exc)
            local.depth += 1
            try:
                result = original(*args, **kwargs)
            except BaseException:
                local.depth -= 1
                for token in tokens:
                    if token is not None:
                        try:
                            recorder.end(token, False)
                        except Exception as exc:
                            recorder.note_error("batch_isend_irecv", exc)
                raise
            local.depth -= 1
            if tokens:
                try:
                    self.finish_batch(tokens, result)
                except Exception as exc:
                    recorder.note_error("batch_isend_irecv", exc)
            return result

        setattr(batch_isend_irecv, _WRAPPED, original)
        return batch_isend_irecv

    # -- process groups -----------------------------------------------------------------------

    def announce(self, pg: Any) -> None:
        """Record the group's global ranks, once per group name."""
        name = str(pg.group_name)
        if name in self.announced:
            return
        dist = self.dist
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        try:
            backend = str(dist.get_backend(pg))
        except Exception:
            backend = ""
        self.announced.add(name)
        self.recorder.group_created(name, ranks, backend)

    def first_seen(self, pg: Any) -> None:
        """A group used for the first time: announce it unless it already was (never raises:
        the call that uses the group is recorded either way)."""
        try:
            self.announce(pg)
        except Exception as exc:
            self.recorder.note_error("announce group", exc)

    def wrap_init(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                self.groups.clear()
                self.announced.clear()
                self.pairs.clear()
                self.recorder.set_rank(int(self.dist.get_rank()))
                self.announce(self.c10d._get_default_group())
                self.on_group()
            except Exception as exc:
                self.recorder.note_error("init_process_group", exc)
            return result

        setattr(init_process_group, _WRAPPED, original)
        return init_process_group

    def wrap_factory(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap a function that creates a process group: announce the group it returns."""

        @functools.wraps(original)
        def factory(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            try:
                if isinstance(result, self.c10d.ProcessGroup) and (
                    result is not self.c10d.GroupMember.NON_GROUP_MEMBER
                ):
                    self.announce(result)
            except Exception as exc:
                self.recorder.note_error(name, exc)
            return result

        setattr(factory, _WRAPPED, original)
        return factory

    def wrap_destroy(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
            try:
                self.groups.clear()
                if not args and kwargs.get("group") is None:
                    # every group goes: a later init may reuse their names
                    self.announced.clear()
                    self.pairs.clear()
            except Exception as exc:
                self.recorder.note_error("destroy_process_group", exc)
            return original(*args, **kwargs)

        setattr(destroy_process_group, _WRAPPED, original)
        return destroy_process_group


def _patch(modules: tuple[Any, ...], name: str, make: Callable[[Any], Any]) -> bool:
    """Replace `name` of the last module (torch's c10d) with `make(original)`, and of every other
    module that holds the same original; False when absent or already wrapped."""
    current = getattr(modules[-1], name, None)
    if current is None or hasattr(current, _WRAPPED):
        return False
    wrapper = make(current)
    for module in modules:
        if module is modules[-1] or getattr(module, name, None) is current:
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
    # device_mesh binds new_group / split_group at its import, inside torch.distributed's own
    mesh = sys.modules.get("torch.distributed.device_mesh")
    modules = (dist, *([mesh] if mesh is not None else []), dist.distributed_c10d)
    count = 0
    for op in COLLECTIVES + POINT_TO_POINT:
        count += _patch(modules, op, functools.partial(_wrap_op, installer, op))
    count += _patch(modules, "batch_isend_irecv", installer.wrap_batch)
    count += _patch(modules, "init_process_group", installer.wrap_init)
    for factory in GROUP_FACTORIES:
        count += _patch(modules, factory, functools.partial(installer.wrap_factory, factory))
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

    def __init__(self, process_group: Any, recorder: Recorder) -> None:
        self.process_group = process_group
        self.recorder = recorder
        self.hook: Callable[[Any, Any], Any] | None = None
        self.state: Any = None
        self.dist: Any = importlib.import_module("torch.distributed")
        self.futures: Any = importlib.import_module("torch.futures")


def _first_of(fut: Any) -> Any:
    return fut.value()[0]


def _averaged(trampoline: _Trampoline, bucket: Any) -> Any:
    """What torch's `allreduce_hook` does (divide by the group's size, all_reduce, the first tensor
    of the result), traced.

    A bucket's all_reduce ends in the one completion callback the hook needs anyway (each Python
    callback on a future is a trip of gloo's thread through the GIL). The last bucket of a step on
    CPU tensors makes none: its hook waits for the all_reduce itself (`_waited`), as DDP would
    right after it. One DDP step of a small model on gloo costs ~90 us more with a Python hook and
    its callback than with DDP's C++ all-reduce, and ~25 us more when the hook waits; on 4 ranks
    sharing 2 cores that was 4-6% of the step."""
    dist = trampoline.dist
    group = trampoline.process_group
    if group is None:
        group = dist.group.WORLD
    tensor = bucket.buffer()
    tensor.div_(group.size())
    local = _local
    local.claim, local.claimed = True, None
    try:
        work = dist.all_reduce(tensor, group=group, async_op=True)
    finally:
        # (set by the wrapper's finish_work in between, which the type checker cannot see)
        token = cast("Token | None", local.claimed)
        local.claim, local.claimed = False, None
    recorder = trampoline.recorder
    if token is not None and tensor.device.type == "cpu" and bucket.is_last():
        return _waited(trampoline, work, token)
    future = work.get_future()
    if token is None:  # not recorded (the recorder failed, or tracing is off)
        return future.then(_first_of)

    def reduced(fut: Any) -> Any:
        try:
            value = _first_of(fut)
        except BaseException:
            with contextlib.suppress(Exception):
                recorder.end(token, False)
            raise
        try:
            recorder.end(token, True)
        except Exception as exc:
            recorder.note_error("DDP all_reduce", exc)
        return value

    return future.then(reduced)


def _waited(trampoline: _Trampoline, work: Any, token: Token) -> Any:
    """The last bucket's all_reduce, waited for here (the GIL released meanwhile) and ended with
    its own completion time: a future already done, holding the reduced bucket (or the error,
    which DDP raises when it reads the bucket's result, as it would have without the hook).

    All the step's gradients are computed by the time the last bucket is ready, and DDP waits
    for every bucket right after the backward pass, so waiting here costs no overlap worth
    having; it saves the callback's trip through the GIL. CPU tensors only: a CUDA work's wait
    would only order the streams."""
    recorder = trampoline.recorder
    result = trampoline.futures.Future()
    try:
        work.wait()
        value = work.result()[0]
    except Exception as exc:
        with contextlib.suppress(Exception):
            recorder.end(token, False)
        result.set_exception(exc)
        return result
    try:
        recorder.end(token, True)
    except Exception as exc:
        recorder.note_error("DDP all_reduce", exc)
    result.set_result(value)
    return result


def tracehound_trampoline_hook(trampoline: _Trampoline, bucket: Any) -> Any:
    """Default: torch's allreduce_hook, traced (`_averaged`); else the user's hook."""
    hook = trampoline.hook
    if hook is None:
        return _averaged(trampoline, bucket)
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

_untraced_ddp = threading.local()


@contextlib.contextmanager
def untraced_ddp() -> Iterator[None]:
    """DDP models constructed in this block (on this thread) keep DDP's own C++ gradient
    all-reduce: no trampoline, their buckets are not traced (what bench/overhead.py compares
    against). Counted in `ddp_stats.skipped`."""
    before = getattr(_untraced_ddp, "on", False)
    _untraced_ddp.on = True
    try:
        yield
    finally:
        _untraced_ddp.on = before


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
            reason = ("asked for (untraced_ddp)" if getattr(_untraced_ddp, "on", False)
                      else _unsafe_reason(self))
            if reason:
                ddp_stats.skipped += 1
                log.info("tracehound leaves this DDP model's gradient all-reduce untraced: %s",
                         reason)
                return
            trampoline = _Trampoline(self.process_group, recorder)
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
