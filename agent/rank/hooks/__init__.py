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

`install_ddp` watches every DistributedDataParallel model's gradient all-reduces, which bypass
`dist.all_reduce`. With `every` 0 (what a training process gets by default,
TRACEHOUND_DDP_TRACE_EVERY) they stay on DDP's own C++ path and are counted from c10d's own
sequence counter (`_DdpCount`: the group `<group>:ddp`, in heartbeats on every step, and its
steps recorded about one per TRACEHOUND_DDP_SPAN_S), so who waits on whom and who arrives last
stay visible without a Python call in the backward pass. With `every` N > 0 the C++ reducer gets,
one training step in N, a process group of its own (`_reducer_group`: a Python subclass of
c10d's ProcessGroup that forwards to the model's real group and its backends), so each bucket is
recorded as an all_reduce call of the real group whatever comm hook the user registers (a
Python hook that calls `dist.all_reduce` is recorded by that wrapper instead); DDP keeps its own
gradient division and hook-less path, and a bucket's completion is seen without a callback on
the work (`_Reducer.settle`). The other steps are counted as with 0.
`install_optimizer` counts training steps with a global optimizer step post-hook.

A wrapper calls the original with the arguments it was given, each bound to the same parameter
(a one-tensor collective's wrapper passes them all explicitly, `_collective_source`), and
returns exactly what it returned; a user's exception is re-raised unchanged (after recording the
operation as failed). Errors of the recording itself are swallowed and counted by the recorder.
Nothing here may change what the training program computes or sees, block it, or add work per
call that a record does not need.

Sequence ids: every collective (including barrier) takes the next id of its process group, so the
same (group, seq) is the same call on every member. A wrapped function called from inside another
(torch's object collectives run two or three tensor collectives; send runs isend; the aliases call
each other) is not recorded again: a per-thread depth guard (`_inside`) lets only the outermost
call count.
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

Functional collectives (`torch.distributed._functional_collectives`: DTensor redistribution,
tensor parallelism, FSDP2's gradient clipping) run as C++ ops without these Python functions:
`tracehound.agent.rank.functional` wraps their own entry points. Not covered: what a compiled graph
or funcol's autograd backward issues straight through `torch.ops._c10d_functional` (seen only
by the ranks' stacks and the job's standstill, `analysis.standstill`); DDP's own C++
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tracehound.agent.rank import backend
from tracehound.agent.rank.recorder import Dtype, Recorder, Token

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


_inside: set[int] = set()
"""The threads (idents) inside a wrapped call that guards against nested ones (the depth guard,
`_guard_expression`): a call made while its thread is in here is passed on unrecorded. A set
read as a global rather than a thread-local attribute: the common call (no thread is inside)
checks only that it is empty (0.01 us against 0.04 for the attribute)."""

_get_ident = threading.get_ident

_installer: _Installer | None = None
"""The installer of `install_distributed`, once it ran: DDP names its groups alike."""


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


class _Installer:
    """Holds what the wrappers share: the recorder, torch's modules, the group-name cache."""

    def __init__(self, recorder: Recorder, dist: Any, on_group: Callable[[], None]) -> None:
        self.recorder = recorder
        self.dist = dist
        self.c10d = dist.distributed_c10d
        self.groups = _Groups(self.c10d, self.first_seen)
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
                    nbytes, dtype = tensor.nbytes, tensor.dtype
        peer = -1
        if spec.p2p:
            peer = self.peer(spec, group, args, kwargs)
            name = self.pair(name, peer)
        return self.recorder.begin(name, spec.op, nbytes, dtype, peer), is_async

    def list_size(self, tensors: Any) -> tuple[int, Dtype]:
        """(bytes, dtype) of a list of tensors (or of one tensor, which torch accepts too)."""
        if hasattr(tensors, "element_size"):
            return tensors.numel() * tensors.element_size(), tensors.dtype
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return nbytes, (tensors[0].dtype if len(tensors) else "")

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
        count = _ddp_counts.get(group_name)
        if count is not None:
            count.attach(self.recorder.group_state(name))
        if name not in self.announced:
            self.announced.add(name)
            self.recorder.group_created(name, ranks, "p2p")
        return name

    def count_pairs(self, group_name: str, count: _DdpCount) -> None:
        """`count` reads around the point-to-point calls of `group_name`'s pairs too."""
        for (base, _), name in self.pairs.items():
            if base == group_name:
                count.attach(self.recorder.group_state(name))

    def failed(self, token: Token | None, where: str) -> None:
        """The wrapped call of `token` raised: record it as failed (never raises)."""
        if token is not None:
            try:
                self.recorder.end(token, False)
            except Exception as exc:
                self.recorder.note_error(where, exc)

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
        if not (spec.p2p or spec.tensor_list or spec.returns_peer or spec.always_async):
            return self.wrap_collective(spec, original, leaf=_is_leaf(original))
        recorder = self.recorder
        inside = _inside
        returns_peer = spec.returns_peer

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if inside and _get_ident() in inside:
                return original(*args, **kwargs)
            token: Token | None = None
            is_async = False
            try:
                token, is_async = self.begin(spec, args, kwargs)
            except Exception as exc:
                recorder.note_error(op, exc)
            counted = token[0].counted if token is not None else None
            if counted is not None:
                before = counted.enter()
            me = _get_ident()
            inside.add(me)  # the outermost call only: added and discarded, not counted
            try:
                result = original(*args, **kwargs)
            except BaseException:
                inside.discard(me)
                if counted is not None:
                    counted.around(before)
                self.failed(token, op)
                raise
            inside.discard(me)
            if counted is not None:
                counted.around(before)
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

    def wrap_collective(self, spec: _Spec, original: Callable[..., Any], *, leaf: bool
                        ) -> Callable[..., Any]:
        """`wrap` for a collective of one tensor or none (all_reduce, broadcast, barrier, ...):
        the hot path of most jobs. The wrapper is compiled for `original`'s own parameters
        (`_collective_source`): the interpreter binds them as it would for the original, the
        group, async flag and tensor are plain names and the original is called with them
        again, without packing the call into `*args, **kwargs` and looking into it (0.25 us of
        about 1.7 a call on this project's machines). A synchronous call does what the
        recorder's lock-free `Recorder.enter` and `Recorder.returned` do, inline;
        tests/agent/test_hot_path.py holds the two to the same records. A `leaf` (whose code
        calls no other wrapped function, `_is_leaf`) only reads the depth guard: nothing it
        calls could be counted twice."""
        recorder = self.recorder
        namespace: dict[str, Any] = {
            "_original": original, "_recorder": recorder, "_begin": recorder.begin,
            "_states": recorder.groups, "_group_state": recorder.group_state,
            "_clock": recorder.clock, "_time_ns": time.time_ns,
            "_groups": self.groups, "_non_member": self.non_member,
            "_op": spec.op, "_inside": _inside, "_get_ident": _get_ident,
            "_plain_tensor": importlib.import_module("torch").Tensor,
            "_failed": self.failed, "_finish_work": self.finish_work,
        }
        recorder.share_queue(namespace)  # `_queue` and `_bound`, kept current by the recorder
        source = _collective_source(original, spec, namespace, leaf=leaf,
                                    wall_clock=recorder.wall_clock)
        # the source is this module's template and the names of the function's own parameters
        exec(compile(source, f"<tracehound wrapper of {spec.op}>", "exec"), namespace)  # noqa: S102
        wrapper = functools.wraps(original)(namespace["wrapper"])
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
        for pair, _, index, op, peer, tensor in sorted(keyed, key=lambda k: k[:3]):
            tokens[index] = self.recorder.begin(
                pair, op, tensor.numel() * tensor.element_size(), tensor.dtype, peer,
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
        inside = _inside

        @functools.wraps(original)
        def batch_isend_irecv(*args: Any, **kwargs: Any) -> Any:
            if inside and _get_ident() in inside:
                return original(*args, **kwargs)
            tokens: list[Token | None] = []
            try:
                ops = args[0] if args else kwargs.get("p2p_op_list")
                tokens = self.begin_batch(ops)
            except Exception as exc:
                recorder.note_error("batch_isend_irecv", exc)
            before = _read_before(tokens) if _ddp_counts else {}
            me = _get_ident()
            inside.add(me)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                inside.discard(me)
                for c, at in before.values():
                    c.around(at)
                for token in tokens:
                    self.failed(token, "batch_isend_irecv")
                raise
            inside.discard(me)
            for c, at in before.values():
                c.around(at)
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
                self.watch_backends()
                self.on_group()
            except Exception as exc:
                self.recorder.note_error("init_process_group", exc)
            return result

        setattr(init_process_group, _WRAPPED, original)
        return init_process_group

    def watch_backends(self) -> None:
        """Have the heartbeat thread read the backends' own progress (`agent.backend`)."""
        backend.install_backend_progress(self.recorder, self.dist,
                                         counted=_ddp_counts.__contains__)

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
                group = args[0] if args else kwargs.get("group")
                if group is None:
                    # every group goes: a later init may reuse their names
                    for count in _ddp_counts.values():
                        count.detach()
                    _ddp_counts.clear()
                else:
                    gone = _ddp_counts.pop(str(group.group_name), None)
                    if gone is not None:
                        gone.detach()
                self.groups.clear()
                if group is None:
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


_WRAPPED_NAMES = frozenset(COLLECTIVES + POINT_TO_POINT + ("batch_isend_irecv",))


_COLLECTIVE_WRAPPER = '''
    if _inside and _get_ident() in _inside:
        return _original(CALL)
    _token = _counted = None
    try:
        if _group is None:
            _default = _groups.default
            _name = _default[1] if _default is not None else _groups.name(None)
        elif _group is _non_member:
            _name = ""
        else:
            _name = _groups.name(_group)
        if _name:
            if _tensor is None:
                _nbytes, _dtype = 0, ""
            else:
                _nbytes = _tensor.nbytes
                _dtype = _tensor.dtype  # named off the training thread (`dtype_name`)
            if _async:
                _token = _begin(_name, _op, _nbytes, _dtype)
                _counted = _token[0].counted
            else:  # Recorder.enter, inline: no lock (a new group is added under it)
                _state = _states.get(_name) or _group_state(_name)
                _seq = next(_state.seqs)
                _entered = NOW
                _state.last = _token = (_state, _seq, _op, _nbytes, _dtype, -1, _entered)
                _counted = _state.counted
    except Exception as _exc:
        _recorder.note_error(_op, _exc)
    if _counted is not None:  # DDP's group, its steps counted (_DdpCount)
        _before = _counted.enter()
    _guard = GUARD
    if _guard:
        _me = _get_ident()
        _inside.add(_me)
    try:
        _result = _original(CALL)
    except BaseException:
        if _guard:
            _inside.discard(_me)
        if _counted is not None:
            _counted.around(_before)
        _failed(_token, _op)
        raise
    if _guard:
        _inside.discard(_me)
    if _counted is not None:
        _counted.around(_before)
    if _token is not None:
        try:
            if _async:
                _finish_work(_op, _token, _result, ordered=True)
            else:  # Recorder.returned, inline (its _offer too)
                _now = NOW
                if _seq > _state.returned[0]:
                    _state.returned = (_seq, _now)
                _item = (_recorder.ident, _name, _seq, _op, _nbytes, _dtype, -1, False,
                         _entered, _now)
                if _queue is not None and len(_queue) < _bound:
                    _queue.append(_item)
                elif not _recorder.disabled and not _recorder.sink.offer(_item):
                    _recorder.count_dropped()
        except Exception as _exc:
            _recorder.note_error(_op, _exc)
    return _result
'''
"""The body of a one-tensor collective's wrapper (`_Installer.wrap_collective`), after one of
two headers, which bind `_group`, `_async` and `_tensor`. Replaced in it when it is compiled:
`CALL`, the arguments that call the original again as it was called; `NOW`, the recorder's clock
in ns; `GUARD`, whether the call sets the depth guard (`_guard_expression`). Every name the body
uses itself starts with `_`."""

_ANY_HEADER = '''def wrapper(*args, **kwargs):
    _n = len(args)
    if kwargs:
        _group = kwargs.get("group", args[{group_pos}] if {group_pos} < _n else None)
        _async = kwargs.get("async_op", args[{async_pos}] if {async_pos} < _n else False)
        _tensor = (kwargs.get({tensor_name}, args[{tensor_pos}] if {tensor_pos} < _n else None)
                   if {tensor_name} else None)
    else:
        _group = args[{group_pos}] if {group_pos} < _n else None
        _async = args[{async_pos}] if {async_pos} < _n else False
        _tensor = args[{tensor_pos}] if {tensor_pos} < _n else None'''
"""The header for a function whose parameters cannot be written out: the three are read from
the call as given (a parameter the function lacks is at a position no call reaches)."""


def _guard_expression(spec: _Spec, leaf: bool) -> str:
    """When a call sets the depth guard: always, unless `leaf` (its code calls no wrapped
    function, `_is_leaf`); a leaf's call with a tensor subclass too, which may dispatch back
    into the same function (`__torch_function__`: all_reduce does)."""
    if not leaf:
        return "True"
    if spec.tensor_pos < 0:
        return "False"
    return "type(_tensor) is not _plain_tensor and _tensor is not None"


def _collective_source(original: Callable[..., Any], spec: _Spec, namespace: dict[str, Any],
                       *, leaf: bool, wall_clock: bool) -> str:
    """The source of the wrapper of `original`: with `original`'s own parameters and their
    defaults (put in `namespace` as `_default_<i>`) when they can be written out, else with
    `*args, **kwargs` (`*args`, `**kwargs`, positional-only parameters, a name starting with
    `_`, the body's own, or a decorator with parameters of its own). The original then gets
    every argument explicitly, bound to the parameter it was given for (a default as the
    default object itself). `leaf`: see `_guard_expression`; `wall_clock`: the recorder's clock
    is `time.time_ns` (else its `clock()`, in us, times 1000)."""
    body = (_COLLECTIVE_WRAPPER.replace("NOW", "_time_ns()" if wall_clock else "_clock() * 1000")
            .replace("GUARD", _guard_expression(spec, leaf)))
    try:
        signature = inspect.signature(original)
        outer = inspect.signature(original, follow_wrapped=False)
    except (TypeError, ValueError):
        parameters = []
        fixed = False
    else:
        parameters = list(signature.parameters.values())
        # a decorator (torch's loggers) takes *args, **kwargs and passes them on: the inner
        # signature is what it accepts. One that declares parameters of its own may accept
        # more than the inner one.
        forwards = [p.kind for p in outer.parameters.values()] == [
            inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
        fixed = (outer == signature or forwards) and all(
            p.name.isidentifier() and not p.name.startswith("_")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters)
    if not fixed:
        group_pos, async_pos, tensor_pos = (pos if pos >= 0 else sys.maxsize for pos in (
            spec.group_pos, spec.async_pos, spec.tensor_pos))
        header = _ANY_HEADER.format(
            group_pos=group_pos, async_pos=async_pos, tensor_pos=tensor_pos,
            tensor_name=repr(spec.tensor_name if spec.tensor_pos >= 0 else ""))
        return header + body.replace("CALL", "*args, **kwargs")
    declared: list[str] = []
    passed: list[str] = []
    for index, p in enumerate(parameters):
        if p.kind is p.KEYWORD_ONLY and "*" not in declared:
            declared.append("*")
        if p.default is p.empty:
            declared.append(p.name)
        else:
            namespace[f"_default_{index}"] = p.default
            declared.append(f"{p.name}=_default_{index}")
        passed.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
    names = [p.name for p in parameters]

    def read(pos: int, absent: str) -> str:
        return names[pos] if pos >= 0 else absent

    header = (f"def wrapper({', '.join(declared)}):\n"
              f"    _group, _async, _tensor = {read(spec.group_pos, 'None')}, "
              f"{read(spec.async_pos, 'False')}, {read(spec.tensor_pos, 'None')}")
    return header + body.replace("CALL", ", ".join(passed))


def _is_leaf(fn: Callable[..., Any], depth: int = 3) -> bool:
    """Whether `fn` cannot call another wrapped function: no name its code uses is one, nor is
    one used by the code of a function of its module it calls, `depth` levels down (through
    decorators and what they close over). Anything that cannot be looked into (no code, no
    module) counts as a call that could."""
    fn = inspect.unwrap(fn)  # torch's logging decorators: the function they call
    code = getattr(fn, "__code__", None)
    module = sys.modules.get(getattr(fn, "__module__", "") or "")
    if code is None or module is None:
        return False
    for cell in fn.__closure__ or ():  # a function it closes over may be the one it calls
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if hasattr(inner, _WRAPPED):
            return False
        if inspect.isfunction(inner):
            if depth <= 0 or not _is_leaf(inner, depth - 1):
                return False
        elif callable(inner) and not (inspect.isclass(inner) or inspect.isbuiltin(inner)):
            return False  # a partial, a bound method, ...: not looked into
    names: set[str] = set()
    todo = [code]
    while todo:
        current = todo.pop()
        names.update(current.co_names)
        todo.extend(c for c in current.co_consts if inspect.iscode(c))
    # its own name: the `__torch_function__` dispatch of tensor subclasses calls it again (the
    # wrapper takes the leaf path for plain tensors only)
    own = fn.__name__
    if names & (_WRAPPED_NAMES - {own}):
        return False
    for name in names - {own}:
        target = getattr(module, name, None)
        if target is None or inspect.isclass(target) or inspect.ismodule(target):
            continue
        if hasattr(target, _WRAPPED):
            return False
        if inspect.isfunction(target) and (depth <= 0 or not _is_leaf(target, depth - 1)):
            return False
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
    global _installer
    _installer = installer
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
            installer.watch_backends()
            on_group()
        except Exception as exc:
            recorder.note_error("install_distributed", exc)
    return count


# -- DDP -----------------------------------------------------------------------------------------

_BACKEND_TYPES = {"gloo": "GLOO", "nccl": "NCCL", "ucc": "UCC", "mpi": "MPI", "xccl": "XCCL"}
_OPEN_CAP = 1024
"""All-reduces of one DDP model whose completion is not seen yet, at most; past it the oldest is
ended as it stands (a model whose works are never waited for must not grow this without end)."""


class _Reducer:
    """What the process group a DDP reducer all-reduces through knows: where to record, the
    real group, and the all-reduces issued and not yet seen complete."""

    __slots__ = ("__weakref__", "cpp", "every", "group", "inner", "name", "open", "recorder",
                 "routed", "settling", "steps")

    def __init__(self, inner: Any, name: str, recorder: Recorder) -> None:
        self.inner = inner
        self.name = name
        self.recorder = recorder
        self.open: list[tuple[Any, Token]] = []
        self.settling = threading.Lock()
        """Held by the thread settling (the training thread or the heartbeat thread); the other
        one skips its turn rather than wait."""
        self.group: Any = None
        """The group the reducer calls (`_reducer_group`). Held here, by the model: the C++
        reducer holds the C++ object only, and without its Python object the calls would go
        straight to the backend, untraced."""
        self.every = 1
        """Buckets are routed through `group` one training step in this many (`stepped`)."""
        self.cpp: Any = None
        """The model's C++ reducer, when `every` > 1."""
        self.steps = 0
        self.routed = True

    def stepped(self) -> None:
        """A training step ended (the recorder's step hook, on the training thread, only when
        `every` > 1): the next step's buckets go through the traced group if it is one of every
        `every`, straight to the real group otherwise. Every rank counts the same optimizer
        steps, so all switch alike; between steps no bucket is in flight on this side (DDP
        waited for them at the end of the backward pass; on CUDA a running one keeps the group
        it was issued on)."""
        self.steps += 1
        traced = self.steps % self.every == 0
        if traced != self.routed:
            self.cpp._update_process_group(self.group if traced else self.inner)
            self.routed = traced

    def allreduce(self, tensors: Any, opts: Any) -> Any:
        """One bucket (or DDP's used-parameter map): recorded as an all_reduce of the real group,
        issued on it, its completion seen later (`settle`) rather than through a callback on the
        work's future, which would cost a trip of gloo's thread through the GIL per bucket."""
        recorder = self.recorder
        token: Token | None = None
        try:
            if len(tensors) == 1:  # a bucket is one flat tensor
                tensor = tensors[0]
                nbytes = tensor.nbytes
            else:
                tensor = tensors[0] if len(tensors) else None
                nbytes = sum(t.nbytes for t in tensors)
            dtype = tensor.dtype if tensor is not None else ""
            token = recorder.begin(self.name, "all_reduce", nbytes, dtype)
        except Exception as exc:
            recorder.note_error("DDP all_reduce", exc)
        try:
            work = self.inner.allreduce(tensors, opts)
        except BaseException:
            if token is not None:
                with contextlib.suppress(Exception):
                    recorder.end(token, False)
            raise
        if token is None:
            return work
        try:
            if self.open:
                self.settle()
            self.open.append((work, token))
            if len(self.open) > _OPEN_CAP:
                _, oldest = self.open.pop(0)
                recorder.end(oldest, True)
        except Exception as exc:
            recorder.note_error("DDP all_reduce", exc)
        return work

    def settle(self) -> None:
        """End the all-reduces that have completed, in order, at the time they are seen to be.
        Called on the training thread at the next bucket and at every optimizer step (the
        recorder's step hook), and from the heartbeat thread (a rank that stops after its last
        bucket, a loop without a torch optimizer).

        So a bucket's end time is an upper bound: late by the compute up to the next bucket, or
        for the last bucket of a step by what runs between DDP's wait at the end of the backward
        pass and the optimizer step (gradient clipping, say). On CUDA DDP's wait only orders the
        streams; a bucket still running on the GPU is seen at the next one of those. (Final
        callbacks of the autograd engine, queued behind DDP's own wait, would end the last
        bucket a little earlier; measured beside this, they cost the training thread as much,
        +45.1 against +44.7 us a step over DDP's C++ all-reduce, and they rest on the engine's
        private callback queue and on the order DDP queues its own.)"""
        if not self.settling.acquire(blocking=False):
            return
        try:
            items, self.open = self.open, []
            still: list[tuple[Any, Token]] = []
            recorder = self.recorder
            for item in items:
                work, token = item
                if still or not work.is_completed():
                    still.append(item)
                    continue
                recorder.end(token, _succeeded(work))
            if still:
                self.open[:0] = still
        finally:
            self.settling.release()


class _DdpCount:
    """DDP's own communication on one process group, for the training steps whose buckets are
    not recorded one by one (`TRACEHOUND_DDP_TRACE_EVERY` other than 1), without a Python call
    per bucket: the group `<group>:ddp`, op `ddp_comm`.

    c10d numbers every backend op of a group alike on every member. Less the ops of the calls
    the wrappers record (read around each of them: they are recorded as themselves) and less
    where the counter stood when the group's first DDP model was traced, what is left are the
    ops of the DDP models on the group: gradient buckets and buffer broadcasts, the same on
    every rank. Their count is this group's sequence id.

    Heartbeats: entered = the ops issued so far (read by the heartbeat thread, so seen up to one
    heartbeat interval late, and entered then); completed = as of the last point at which all
    of them are known done: a forward of the model starts (DDP waited for its buffer broadcast)
    or a training step ends (DDP waited for its buckets at the end of the backward pass). So
    while a step's buckets (or the next forward's broadcast) are in flight the ranks that
    issued them are inside the group's next op, and a rank that has not reached them, busy
    outside collectives, lags behind: the dependency the hang detector follows.

    Events: a training step with a forward of the group's models is one completed `ddp_comm`
    whose seq is the count at the step's end, from the end of the step's last forward (DDP has
    prepared its backward pass: what follows is the backward, its buckets and their wait, and
    the optimizer) to the end of the step. So the time from a step's end to the next forward's
    end (data, forward: where a straggler takes longer) is a gap between operations, the peers
    that wait for it wait inside one, and who arrives last is seen on each recorded step. With
    `span_us` the steps recorded are about one per span, the same on every rank (`done`,
    `_pace`); with 0 every one.

    Counted by the group's default backend: where DDP's tensors go to another one (a group with
    a CPU and a CUDA backend) the count does not move, no rank is shown inside the group and no
    step is recorded. On CUDA a step's end orders the streams only, so a bucket still running
    on the GPU counts as completed there. Calls that bypass the wrappers (a process group's own
    methods) count as DDP's."""

    __slots__ = ("__weakref__", "base", "begun", "count", "ended", "forward_us", "groups",
                 "mark", "name", "outside", "recorded", "recorder", "shift", "span_us")

    def __init__(self, recorder: Recorder, name: str, count: Callable[[], int],
                 span_s: float = 0.0) -> None:
        self.recorder = recorder
        self.name = name
        """The reported group: `<group>:ddp`."""
        self.count = count
        self.base = int(count())
        self.outside = 0
        """Backend ops of the calls the wrappers recorded since `base`."""
        self.begun = 0
        """Recorded calls of the group begun (`enter`); while more than have `ended`, their ops
        are not told apart from DDP's yet. Two counters that only grow, written by the
        training thread alone: the heartbeat thread sees whether a call began (and maybe ended)
        while it read the counter (`seen`)."""
        self.ended = 0
        self.groups: list[Any] = []
        """The recorder's groups whose calls are read around (the real one, its p2p pairs)."""
        self.forward_us = 0
        """When the last forward of this step ended; 0 before one did."""
        self.recorded = 0
        """The seq of the last step counted (recorded or not)."""
        self.span_us = int(span_s * 1e6)
        """Steps are recorded no closer than this, on average (0: every step)."""
        self.shift = 0
        """A step is recorded when its seq crosses a multiple of 2**shift (`done`)."""
        self.mark = (0, 0)
        """(time, seq) of the last step recorded, for `_pace`."""

    def attach(self, group: Any) -> None:
        """Have the wrappers read the counter around the calls recorded in `group`."""
        group.counted = self
        self.groups.append(group)

    def detach(self) -> None:
        """The process group goes (destroy_process_group, on the training thread): what it
        issued is counted one last time, as completed (nothing of the group is pending once
        it is gone; the heartbeat thread may not have looked since the last ops), then its
        counter is no longer read."""
        try:
            self._all_complete()
        except Exception as exc:
            self.recorder.note_error("DDP count at destroy_process_group", exc)
        for group in self.groups:
            if group.counted is self:
                group.counted = None
        self.groups = []
        self.count = _no_count

    def enter(self) -> int:
        """A recorded call of the group begins: the counter before it (for `around`)."""
        self.begun += 1
        return int(self.count())

    def around(self, before: int) -> None:
        """A recorded call that began with the counter at `before` (`enter`) returned or
        raised."""
        self.outside += int(self.count()) - before
        self.ended += 1

    def ops(self) -> int:
        return int(self.count()) - self.base - self.outside

    def _all_complete(self) -> int | None:
        """Everything issued so far is complete (on the training thread: a forward's start, a
        step's end, the group's end): counted so, unless a recorded call is in progress (its
        ops are not told apart yet). The count, or None when nothing was counted."""
        if self.begun != self.ended:
            return None
        n = self.ops()
        self.recorder.counted(self.name, "ddp_comm", n, n)
        return n

    def seen(self) -> None:
        """What has been issued (a watcher: the heartbeat thread, before each heartbeat; a
        training step's end and a forward's start tell it on the training thread)."""
        begun = self.begun
        if begun != self.ended or self.count is _no_count:  # busy, or the group is gone
            return
        n = self.ops()
        # again: a recorded call may have begun, issued its op and even ended on the training
        # thread while the counter was read (the count would then include its op for good)
        if self.begun == begun and self.ended == begun:
            self.recorder.counted(self.name, "ddp_comm", n)

    def started(self, *_: Any) -> None:
        """A forward of the model starts (after DDP's `_pre_forward`, which waited for its
        buffer broadcast: the training thread): all issued so far is done. Nothing while
        torch.compile traces the model (it would break its graph; a compiled forward goes
        without)."""
        if not _compiling():
            self._all_complete()

    def forwarded(self, *_: Any) -> None:
        """A forward of the model ended (after DDP's `_post_forward`; nothing while
        torch.compile traces it)."""
        if not _compiling():
            self.forward_us = self.recorder.now_us()

    def done(self) -> None:
        """A training step ended (a step hook: the training thread): all issued is done, and
        the step is recorded if it had a forward and issued something."""
        n = self._all_complete()
        if n is None:
            return
        recorder = self.recorder
        since, self.forward_us = self.forward_us, 0
        last = self.recorded
        if since and n > last:
            self.recorded = n
            shift = self.shift
            paced = False
            if n >> shift <= last >> shift:
                # not one to record at the pace last seen; unless the pace fell (a slowed
                # step, a pause): then at the pace since the last recorded step
                if not self.span_us or since - self.mark[0] <= 2 * self.span_us:
                    return
                shift = self.shift = self._pace(since, n)
                if n >> shift <= last >> shift:
                    return
                paced = True  # the pace just taken is the one to go on with
            recorder.record_span(self.name, n, "ddp_comm", since)
            if self.span_us:
                if not paced:
                    self.shift = self._pace(since, n)
                self.mark = (since, n)

    def _pace(self, now_us: int, n: int) -> int:
        """The shift for a step whose forward ended at `now_us`, seq `n`: the least power of two
        at least the ops the group issues in `span_us` at the pace since the last recorded step.
        A step is recorded when its seq crosses a multiple of that power: the seqs are the same
        on every rank, and a multiple of a larger power is one of every smaller, so ranks that
        judge the pace a little apart still record the same steps at the larger one."""
        then, seq = self.mark
        if not then or now_us <= then:
            return self.shift
        wanted = -(-(n - seq) * self.span_us // (now_us - then))
        return min(max(wanted - 1, 0).bit_length(), _MAX_SPAN_SHIFT)


_MAX_SPAN_SHIFT = 16
"""A counted group records at least a step in 65536 of its ops."""


def _no_count() -> int:
    return 0


def _never() -> bool:
    return False


_compiling: Callable[[], bool] = _never
"""torch.compiler.is_compiling once a DDP model is counted (`_count_ddp`): whether torch.compile
is tracing the code that calls it."""


def _read_before(tokens: list[Token | None]) -> dict[int, tuple[_DdpCount, int]]:
    """For a batch: each `_DdpCount` its calls are read around, with the counter before."""
    before: dict[int, tuple[_DdpCount, int]] = {}
    for token in tokens:
        count = token[0].counted if token is not None else None
        if count is not None and id(count) not in before:
            before[id(count)] = (count, count.enter())
    return before


_ddp_counts: dict[str, _DdpCount] = {}
"""The `_DdpCount` of each process group (by name) whose DDP models are counted."""


def _count_ddp(model: Any, recorder: Recorder, name: str,
               span_s: float = 0.0) -> _DdpCount | None:
    """The `_DdpCount` of `model`'s process group, made and announced with its first model;
    None (logged) where c10d cannot tell the group's sequence counter."""
    inner = model.process_group
    count = _ddp_counts.get(name)
    if count is None:
        read = getattr(inner, "_get_sequence_number_for_group", None)
        if read is None:
            log.info("tracehound: this torch's process groups have no sequence counter; the "
                     "DDP steps whose all-reduces are not recorded are not counted either")
            return None
        global _compiling
        _compiling = getattr(importlib.import_module("torch.compiler"), "is_compiling", _never)
        dist: Any = importlib.import_module("torch.distributed")
        count = _DdpCount(recorder, f"{name}:ddp", read, span_s)
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(inner))
        recorder.group_created(count.name, ranks, "ddp")
        recorder.add_watcher(count.seen)
        recorder.add_step_hook(count.done)
        count.attach(recorder.group_state(name))
        if _installer is not None:
            _installer.count_pairs(name, count)
        _ddp_counts[name] = count
    count.started()
    model._tracehound_count = count
    _around_forward(model, count)
    return count


def _around_forward(model: Any, count: _DdpCount) -> None:
    """Tell `count` when each forward of the DDP `model` starts and ends.

    Through the model's own `_pre_forward` and `_post_forward` (DDP's forward calls both on
    `self`), each wrapped on the instance: one Python call more per forward. Module hooks would
    do the same through nn.Module's slow call path, taken by both modules on every forward:
    measured on this torch and a small CPU model, a forward of the DDP model cost +20 us with
    the hooks against +6 us with the wrappers. A torch without those methods gets the hooks."""
    pre = getattr(model, "_pre_forward", None)
    post = getattr(model, "_post_forward", None)
    if not (callable(pre) and callable(post)):
        model.module.register_forward_pre_hook(count.started)
        model.register_forward_hook(count.forwarded)
        return
    note = count.recorder.note_error

    def _pre_forward(*inputs: Any, **kwargs: Any) -> Any:
        result = pre(*inputs, **kwargs)
        try:
            count.started()
        except Exception as exc:
            note("DDP forward start", exc)
        return result

    def _post_forward(output: Any) -> Any:
        result = post(output)
        try:
            count.forwarded()
        except Exception as exc:
            note("DDP forward end", exc)
        return result

    model._pre_forward = _pre_forward
    model._post_forward = _post_forward


def _succeeded(work: Any) -> bool:
    """Whether a completed work succeeded, through its future (`Work.exception()` warns that it
    is deprecated, once per process, into the user's log)."""
    try:
        work.get_future().value()
    except Exception:
        return False
    return True


def _reducer_group(dist: Any, reducer: _Reducer) -> Any:
    """A process group that forwards everything to `reducer.inner`'s own backends and routes
    `allreduce` through `reducer` (a Python subclass of c10d's ProcessGroup: DDP's C++ reducer
    calls it like any group)."""
    base = dist.ProcessGroup
    inner = reducer.inner

    class TracedReducerGroup(base):  # type: ignore[misc, valid-type]
        def allreduce(self, *args: Any) -> Any:
            if len(args) == 2 and type(args[0]) is list:
                return reducer.allreduce(*args)
            return inner.allreduce(*args)

    group = TracedReducerGroup(inner.rank(), inner.size())
    kinds = base.BackendType
    default = _BACKEND_TYPES.get(str(inner._get_backend_name()), "CUSTOM")
    group._set_default_backend(getattr(kinds, default))
    for device in inner._device_types:
        backend = inner._get_backend(device)
        kind = _BACKEND_TYPES.get(str(backend.name()), "CUSTOM")
        group._register_backend(device, getattr(kinds, kind), backend)
    return group


@dataclass
class DdpStats:
    hooked: int = 0
    skipped: int = 0


ddp_stats = DdpStats()
"""How many DDP models have their all-reduces traced, and how many were left alone (see the
log)."""

_untraced_ddp = threading.local()


@contextlib.contextmanager
def untraced_ddp() -> Iterator[None]:
    """DDP models constructed in this block (on this thread) are left as they are: their gradient
    all-reduces are not traced (what bench/overhead.py compares against). Counted in
    `ddp_stats.skipped`."""
    before = getattr(_untraced_ddp, "on", False)
    _untraced_ddp.on = True
    try:
        yield
    finally:
        _untraced_ddp.on = before


def _unsafe_reason(model: Any) -> str:
    if getattr(model, "_use_python_reducer", False):
        return "it uses the python reducer (compiled autograd)"
    reducer = getattr(model, "reducer", None)
    if reducer is None:
        return "it has no reducer"
    if not hasattr(reducer, "_update_process_group"):
        return "this torch's reducer cannot change its process group"
    return ""


def _trace_ddp(model: Any, recorder: Recorder, every: int = 1, span_s: float = 0.0) -> Any:
    """Give `model`'s reducer a process group that records its all-reduces (the model's own
    `process_group` stays the real one), one training step in `every` (the first is one), and
    count its communication on every step when that is not every step (`_DdpCount`); with
    `every` 0 the reducer keeps DDP's C++ path on every step, counted only. Returns the
    `_Reducer`."""
    dist: Any = importlib.import_module("torch.distributed")
    inner = model.process_group
    if _installer is not None:
        name = _installer.groups.name(inner)
        _installer.first_seen(inner)
    else:
        name = str(inner.group_name)
    reducer = _Reducer(inner, name, recorder)
    if every != 0:
        reducer.group = _reducer_group(dist, reducer)
        model.reducer._update_process_group(reducer.group)
        recorder.add_settler(reducer.settle)
    else:
        reducer.routed = False
    if every != 1:
        if every > 1:
            reducer.every = every
            reducer.cpp = model.reducer
            recorder.add_step_hook(reducer.stepped)
        try:
            _count_ddp(model, recorder, name, span_s)
        except Exception as exc:
            recorder.note_error("DDP count", exc)
    return reducer


def install_ddp(recorder: Recorder, every: int = 1, span_s: float = 0.0) -> bool:
    """Trace the gradient all-reduces of each new DDP model, one training step in `every`, 0:
    counted only (see `_trace_ddp`); the counted steps recorded about one per `span_s` seconds
    (0: each one; `_DdpCount`)."""
    ddp_module: Any = importlib.import_module("torch.nn.parallel.distributed")

    ddp = ddp_module.DistributedDataParallel
    if hasattr(ddp.__init__, _WRAPPED):
        return False
    original_init = ddp.__init__

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
            self._tracehound_reducer = _trace_ddp(self, recorder, every, span_s)
            ddp_stats.hooked += 1
        except Exception as exc:
            ddp_stats.skipped += 1
            recorder.note_error("DistributedDataParallel.__init__", exc)

    setattr(__init__, _WRAPPED, original_init)
    ddp.__init__ = __init__
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
