"""DDP's gradient all-reduces, which bypass `dist.all_reduce`: counted from c10d's own sequence
counter on most steps (`_DdpCount`), routed through a process group of the recorder's one step in
N (`_Reducer`, `_reducer_group`); `install_ddp` hooks every new DistributedDataParallel model."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tracehound.agent.rank.hooks import state
from tracehound.agent.rank.hooks.catalog import _WRAPPED
from tracehound.agent.rank.recorder import Recorder, Token

log = logging.getLogger(__name__)

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
        if state.installer is not None:
            state.installer.count_pairs(name, count)
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
    if state.installer is not None:
        name = state.installer.groups.name(inner)
        state.installer.first_seen(inner)
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
