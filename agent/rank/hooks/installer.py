"""Wrapping torch.distributed: `install_distributed` and the `_Installer` every wrapper shares
(the recorder, torch's modules, the group-name cache, point-to-point pair groups)."""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections.abc import Callable
from typing import Any

from tracehound.agent.rank import backend
from tracehound.agent.rank.hooks import state
from tracehound.agent.rank.hooks.catalog import (
    _WRAPPED,
    COLLECTIVES,
    GROUP_FACTORIES,
    POINT_TO_POINT,
    _arg,
    _get_ident,
    _inside,
    _patch,
    _Spec,
    _spec,
)
from tracehound.agent.rank.hooks.ddp import _ddp_counts, _DdpCount, _read_before
from tracehound.agent.rank.hooks.wrappers import _collective_source, _is_leaf
from tracehound.agent.rank.recorder import Dtype, Recorder, Token


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
        elif token[0].device:
            # a device group's future completes when the work is enqueued; the Work's
            # is_completed() when the device has done it
            recorder.poll_later(result, token, ordered=ordered)
            return
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



def _wrap_op(installer: _Installer, op: str, original: Callable[..., Any]) -> Callable[..., Any]:
    return installer.wrap(op, original)


def install_distributed(recorder: Recorder, on_group: Callable[[], None] = lambda: None) -> int:
    """Wrap torch.distributed's operations and group creation; returns how many were wrapped.

    `on_group` is called once the default process group exists (to start sending)."""
    dist: Any = importlib.import_module("torch.distributed")

    if not dist.is_available():
        return 0
    installer = _Installer(recorder, dist, on_group)
    state.installer = installer
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
