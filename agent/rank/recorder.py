"""The per-process recorder: per-group sequence counters, step counting and heartbeats of one rank.

One Recorder lives in each training process (created by `tracehound.agent.rank.autoinstall`). The
hooks tell it when a collective starts and ends, when a process group is created and when the
optimizer stepped; it keeps the per-group progress, queues records for the node agent and sends a
heartbeat every few hundred milliseconds from a daemon thread, so heartbeats keep coming while the
main thread is blocked inside a collective. While a call has been in flight for longer than
`inflight_s`, that thread sends them every `inflight_heartbeat_s` (100 ms) instead, so the pending
op and oldest sequence id of each group are seen at that resolution while something is stuck; it
goes back to the normal interval once nothing is pending that long.

It must never raise into the training process and never block it: every entry point swallows and
counts its own errors, queueing never waits (a full queue drops and counts), and the only waits
are in the heartbeat thread and the bounded flush at exit. The hot path (`enter`/`returned` for
a call that returns complete, without the lock; `begin`/`end` for one that may end on another
thread) builds plain tuples, not dataclasses or JSON: `materialize` turns them into records on
the sender's thread.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from tracehound.tracing.events import (
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    Heartbeat,
    ProcessGroupInfo,
    Record,
    now_us,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.settings import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_INFLIGHT_S,
    DEFAULT_JOB_ID,
    TRACEHOUND_ATTEMPT,
    TRACEHOUND_JOB_ID,
    TRACEHOUND_NODE_ID,
    env_int,
    env_str,
)

log = logging.getLogger(__name__)

Clock = Callable[[], int]
"""Returns the current time in microseconds since the epoch."""

Dtype = Any
"""A tensor's dtype as the hooks keep it: its name (str), or the torch dtype itself, which
`dtype_name` names off the training thread."""

Identity = tuple[str, int, str, int]
"""(job, attempt, node, rank) of a recorder (`Recorder.ident`)."""

RawCollective = tuple[Identity, str, int, str, int, Dtype, int, bool, int, int]
"""A collective event before it becomes a record: (ident, group, seq, op, nbytes, dtype, peer,
failed, enqueue_ns, complete_ns), `ident` the recorder's (job, attempt, node, rank), one tuple
shared by all its events. Tuples cost ~0.04 us to build on the training thread; the frozen
dataclass costs ~5 us, so it is built on the sender's thread. Its times are nanoseconds, as
read (`time.time_ns()`): the division to microseconds (0.08 us a clock read here) is left to the
sender too."""

Pending = Record | RawCollective
"""What the recorder hands to its sink."""

_time_ns = time.time_ns

_MAX_LOGGED_ERRORS = 5
_MAX_IN_FLIGHT = 4096
"""Calls in flight per group the recorder remembers (for the oldest one's op and size)."""

_MAX_POLLED = 4096
"""Async works watched by polling at once; past it a work's call is ended when handed over."""

INFLIGHT_HEARTBEAT_S = 0.1
"""Heartbeat interval while a call has been in flight for longer than `inflight_s`."""

DEVICE_BACKENDS = ("nccl", "xccl")
"""Backends whose calls return to the CPU once their work is enqueued on an accelerator's
stream, and complete later, when the device has done it. A call of such a group is complete when
its work is (`Recorder.device_marker`), not when it returns."""


class _DeviceDone:
    """Whether the work enqueued on the current CUDA stream so far has run: a CUDA event
    recorded there, read like a Work (`is_completed`, `exception`) by the poller."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def exception(self) -> None:
        return None


def cuda_marker() -> _DeviceDone:
    """A marker of the work enqueued on the current CUDA stream (the default `device_marker`
    where CUDA is available). After a synchronous collective returns, the current stream waits
    for the collective's own stream, so the marker completes when the collective has."""
    import torch

    event: Any = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return _DeviceDone(event)


_DTYPE_NAMES: dict[Any, str] = {}
"""dtype -> its name without "torch." (what records carry), filled as dtypes are met."""


def dtype_name(dtype: Any) -> str:
    """What a record says of `dtype`: a name as it is, a torch dtype (what the hooks' hot path
    keeps, 0.05 us less than looking its name up there) by its name without "torch."."""
    if dtype.__class__ is str:
        return str(dtype)
    text = _DTYPE_NAMES.get(dtype)
    if text is None:
        text = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return text


def materialize(item: Pending) -> Record:
    """The record a queued item stands for (called off the training thread)."""
    if isinstance(item, tuple):
        (job, attempt, node, rank), group, seq, op, nbytes, dtype, peer, failed, enq, comp = item
        return CollectiveEvent(
            job=JobId(job), attempt=attempt, node=NodeId(node), rank=Rank(rank),
            group=GroupId(group), seq=seq, op=op, nbytes=nbytes, dtype=dtype_name(dtype),
            peer=peer,
            state=CollectiveState.FAILED if failed else CollectiveState.COMPLETED,
            enqueue_us=enq // 1000, complete_us=comp // 1000,
        )
    return item


class RecordSink(Protocol):
    """Where a recorder puts its records; `offer` must return at once.

    A sink whose queue is a deque may also have `direct_queue()` -> (deque, bound): the
    recorder then appends its collectives' items to that deque itself while it holds fewer
    than `bound` (no call to `offer`: 0.08 us of a record), and calls `offer` only when it is
    full (to have the refusal counted)."""

    def offer(self, item: Pending) -> bool:
        """Queue an item; False when it was dropped (queue full)."""
        ...

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until everything offered so far was sent."""
        ...


class _Group:
    """Progress of this rank in one process group. Its times (`done`, `returned`, a token's
    entry) are nanoseconds since the epoch, as the hot path reads them; what leaves it for a
    heartbeat is in microseconds.

    Calls that may end on another thread (async work, failures, counted progress) update it
    under the recorder's lock. A synchronous call (`Recorder.enter`/`returned`, the common
    case) takes no lock: its sequence id comes from `seqs` (one step of a C iterator, atomic
    under the GIL), its entry is one store of `last` and its return one store of `returned`,
    a field only the calling thread writes. Readers take the larger of `done` and
    `returned`."""

    __slots__ = ("counted", "device", "done", "in_flight", "last", "name", "pruned_at",
                 "returned", "seqs")

    def __init__(self, name: str) -> None:
        self.name = name
        self.seqs = itertools.count(1)
        """`next(seqs)`: the next call's sequence id."""
        self.last: Token | None = None
        """The token of the latest call entered (its seq is `last_enqueued`): while it is
        pending, its op, size and dtype are what a heartbeat reports as pending."""
        self.done: tuple[int, int] = (0, 0)
        """(seq, ns) of the latest completion seen under the lock: async ends, failures,
        counted progress."""
        self.returned: tuple[int, int] = (0, 0)
        """(seq, ns) of the latest synchronous call returned (`Recorder.returned`)."""
        # async calls entered and not yet ended: seq -> their token. Bounded: past the cap
        # newer calls are not added, so the oldest (what a heartbeat reports) stays right.
        self.in_flight: dict[int, Token] = {}
        self.pruned_at = 0
        """last_completed when in_flight was last pruned (a full dict is pruned only after it
        moved)."""
        self.device = False
        """Its calls complete on an accelerator after they return (`DEVICE_BACKENDS`): a
        synchronous call stays in flight until the device has done its work."""
        self.counted: Any = None
        """What counts the backend ops of this group's calls, when the group's other traffic is
        counted rather than recorded call by call (`hooks.ddp._DdpCount`): the wrappers let it read
        the group's counter around each call they record. None for almost every group."""

    @property
    def last_enqueued(self) -> int:
        last = self.last
        return 0 if last is None else last[1]

    def _completed(self) -> tuple[int, int]:
        done, returned = self.done, self.returned
        return done if done[0] >= returned[0] else returned

    @property
    def last_completed(self) -> int:
        return self._completed()[0]

    def snapshot(self) -> tuple[int, int, Token | None]:
        """(last completed seq, its time in ns, latest token entered), read in that order so that a
        synchronous call entered and returned meanwhile shows as pending rather than as
        completed before it was entered."""
        done, done_ns = self._completed()
        return done, done_ns, self.last

    def oldest(self, done: int, last: Token | None) -> tuple[int, str, int, str]:
        """The oldest call in flight after the last completed one (`done`), when more than one
        is: (seq, op, nbytes, dtype), else (0, "", 0, ""). Calls before the last completed one
        that never ended (a work object dropped unwaited) are left out. (Under the recorder's
        lock: async entries change only under it.)"""
        pending = {seq: entry for seq, entry in self.in_flight.items() if seq > done}
        if last is not None and last[1] > done:
            pending.setdefault(last[1], last)  # a synchronous call is in no dict
        if len(pending) < 2:
            return (0, "", 0, "")
        _, seq, op, nbytes, dtype, _, _ = pending[min(pending)]
        return (seq, op, nbytes, dtype_name(dtype))

    def pending_since(self) -> int:
        """When the oldest call in flight after the last completed one was entered (ns); 0 when
        no call is pending. (Under the recorder's lock.)"""
        done, _, last = self.snapshot()
        if last is None or done >= last[1]:
            return 0
        since = last[6]
        for seq, entry in self.in_flight.items():
            if seq > done and entry[6] < since:
                since = entry[6]
        return since

    def progress(self) -> GroupProgress:
        """This group's part of a heartbeat. (Under the recorder's lock.)"""
        done, done_ns, last = self.snapshot()
        oldest_seq, oldest_op, oldest_nbytes, oldest_dtype = self.oldest(done, last)
        enqueued, enqueue_us, op, nbytes, dtype = 0, 0, "", 0, ""
        if last is not None:
            enqueued, enqueue_us = last[1], last[6] // 1000
            if enqueued > done:  # pending: its op, size and dtype
                op, nbytes, dtype = last[2], last[3], dtype_name(last[4])
        return GroupProgress(
            group=GroupId(self.name), last_enqueued=enqueued, last_completed=done,
            pending_op=op, last_enqueue_us=enqueue_us, last_complete_us=done_ns // 1000,
            pending_nbytes=nbytes, pending_dtype=dtype,
            oldest_seq=oldest_seq, oldest_op=oldest_op, oldest_nbytes=oldest_nbytes,
            oldest_dtype=oldest_dtype,
        )


def _with_live(refs: list[weakref.WeakMethod[Callable[[], None]]], method: Callable[[], None]
               ) -> list[weakref.WeakMethod[Callable[[], None]]]:
    """A new list (the old one may be iterated without the lock meanwhile): the live entries
    of `refs`, then a weak reference to the bound `method`."""
    return [r for r in refs if r() is not None] + [weakref.WeakMethod(method)]


Token = tuple[_Group, int, str, int, Dtype, int, int]
"""What `begin` returns and `end` takes: (group, seq, op, nbytes, dtype, peer, enqueue_ns)."""


class Recorder:
    """Collective progress, steps and heartbeats of one training process."""

    def __init__(
        self,
        *,
        job: str,
        attempt: int,
        node: str,
        rank: int,
        sink: RecordSink,
        clock: Clock = now_us,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        inflight_s: float = DEFAULT_INFLIGHT_S,
        inflight_heartbeat_s: float = INFLIGHT_HEARTBEAT_S,
        pid: int | None = None,
    ) -> None:
        self.ident: Identity = (job, attempt, node, rank)
        """(job, attempt, node, rank), the first element of every collective's item (one tuple
        rather than four reads and four slots an event)."""
        self.disabled = False
        """Set by `disable`: nothing is recorded any more (read by the hooks' inlined path)."""
        self.queue: collections.deque[Pending] | None = None
        """The sink's deque, when it has one (`RecordSink`) and recording is on: the hot paths
        append to it directly while it holds fewer than `queue_bound`."""
        self.queue_bound = 0
        self._sharing: list[dict[str, Any]] = []
        """Namespaces of compiled wrappers that hold `queue` and `queue_bound` as globals
        (`share_queue`)."""
        self.sink = sink
        self.clock = clock
        self.wall_clock = clock is now_us
        """The clock is the wall clock: the hot paths read `time.time_ns()` inline, without a
        Python call (0.05 us of a record). Otherwise the group progress times are `clock()`
        times 1000."""
        self.heartbeat_s = heartbeat_s
        self.inflight_s = inflight_s
        """A call pending longer than this switches heartbeats to `inflight_heartbeat_s`."""
        self.inflight_heartbeat_s = min(inflight_heartbeat_s, heartbeat_s)
        self.pid = os.getpid() if pid is None else pid
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self.groups: Mapping[str, _Group] = self._groups
        """This rank's progress by group name, to read (the hooks' inlined synchronous path
        looks a group up here and calls `group_state` for a new one)."""
        self._dropped = 0
        self._errors = 0
        # Steps: step = start_step + steps of the lead optimizer (or what set_step said).
        self._start_step = 0
        self._step_base = 0
        self._opt_steps = 0
        self._lead_optimizer: int | None = None
        self._steps_paused = False
        self._step_us = 0
        self._first_step_us = 0
        self._resumed_us = 0
        # Async work whose completion can only be seen by polling (gloo send/recv): (work, token,
        # ordered), see poll_later.
        self._polled: list[tuple[Any, Token, bool]] = []
        # Who else holds calls whose completion is seen by looking (DDP models): called from the
        # heartbeat thread before each look at what is pending, at every optimizer step and at
        # close. Weak: a model that goes away takes its entry with it.
        self._settlers: list[weakref.WeakMethod[Callable[[], None]]] = []
        # Called from the heartbeat thread only, after the settlers (and at close): looks at
        # what others hold that the training thread has no need to look at. Weak too.
        self._watchers: list[weakref.WeakMethod[Callable[[], None]]] = []
        # Called at each training step (after the settlers), on the training thread; weak too.
        self._step_hooks: list[weakref.WeakMethod[Callable[[], None]]] = []
        self.device_marker: Callable[[], Any] | None = None
        """Makes a marker of the work enqueued on the device so far (`is_completed()`,
        `exception()`), for the groups of a `DEVICE_BACKENDS` backend: `cuda_marker` once such
        a group is created where CUDA is available; tests put their own."""
        self.device_fallbacks = 0
        """Synchronous calls of a device group taken as complete when they returned: no marker
        could be made (counted, and the error noted once)."""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._resumed_unsent = False
        """`resume_from` was called since the last beat: the next wake beats at once."""
        self._thread: threading.Thread | None = None

    @property
    def sink(self) -> RecordSink:
        """Where the records go (the node agent's transport)."""
        return self._sink

    @sink.setter
    def sink(self, sink: RecordSink) -> None:
        self._sink = sink
        self._nudge: Callable[[], None] | None = getattr(sink, "nudge", None)
        """The sink's way to send what it holds at once, if it has one (SocketTransport)."""
        self._take_queue()

    def _take_queue(self) -> None:
        direct = getattr(self._sink, "direct_queue", None)
        if direct is None or self.disabled:
            self.queue, self.queue_bound = None, 0
        else:
            self.queue, self.queue_bound = direct()
        for namespace in self._sharing:
            namespace["_queue"], namespace["_bound"] = self.queue, self.queue_bound

    def share_queue(self, namespace: dict[str, Any]) -> None:
        """Keep `namespace["_queue"]` and `namespace["_bound"]` equal to `queue` and
        `queue_bound` from now on, whatever sink comes (or `disable`): the globals of a hooks'
        compiled wrapper, which reads a global for less than an attribute."""
        self._sharing.append(namespace)
        namespace["_queue"], namespace["_bound"] = self.queue, self.queue_bound

    # -- identity -----------------------------------------------------------------------------

    @property
    def job(self) -> str:
        return self.ident[0]

    @property
    def attempt(self) -> int:
        return self.ident[1]

    @property
    def node(self) -> str:
        return self.ident[2]

    @property
    def rank(self) -> int:
        return self.ident[3]

    # -- counters -----------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Records lost so far: refused by a full queue, lost to an error of the recorder, or
        accepted by the transport and then lost there (could not be encoded)."""
        return self._dropped + self._errors + int(getattr(self.sink, "lost", 0))

    @property
    def errors(self) -> int:
        """Errors of the recorder itself that were swallowed."""
        return self._errors

    def count_dropped(self) -> None:
        """A record the sink refused (its queue full): counted in `dropped`."""
        self._dropped += 1

    def note_error(self, where: str, exc: BaseException) -> None:
        """Count (and log the first few) errors of the recorder itself; never raises."""
        self._errors += 1
        if self._errors <= _MAX_LOGGED_ERRORS:
            with contextlib.suppress(Exception):  # logging must not break training either
                log.warning("tracehound recorder error in %s (rank %s): %r", where, self.rank, exc)

    def _offer(self, item: Pending) -> None:
        """Queue `item` (appended to the sink's deque while it has room, else offered: a
        refusal is counted); never raises."""
        queue = self.queue
        if queue is not None and len(queue) < self.queue_bound:
            queue.append(item)
            return
        if self.disabled:
            return
        try:
            if not self._sink.offer(item):
                self._dropped += 1
        except Exception as exc:
            self.note_error("sink.offer", exc)

    # -- collectives --------------------------------------------------------------------------

    def _group(self, name: str) -> _Group:
        group = self._groups.get(name)
        if group is None:
            group = self._groups.setdefault(name, _Group(name))
        return group

    def group_state(self, group_name: str) -> _Group:
        """This rank's progress in a group (made if new)."""
        with self._lock:
            return self._group(group_name)

    def begin(self, group_name: str, op: str, nbytes: int, dtype: Dtype, peer: int = -1) -> Token:
        """This rank enters an operation of a group that may end on another thread (async work,
        a future's callback): the group's next sequence id is taken and the call is kept in
        flight until `end`. A call that returns complete uses `enter`/`returned`."""
        now = _time_ns() if self.wall_clock else self.clock() * 1000
        # acquire/release rather than `with`: half the cost (0.06 against 0.15 us)
        lock = self._lock
        lock.acquire()
        try:
            group = self._groups.get(group_name) or self._group(group_name)
            seq = next(group.seqs)
            token = (group, seq, op, nbytes, dtype, peer, now)
            group.last = token
            in_flight = group.in_flight
            if len(in_flight) >= _MAX_IN_FLIGHT:
                done = group.last_completed  # forget calls that never ended
                if done > group.pruned_at:  # else nothing can go: no rebuild on every call
                    group.pruned_at = done
                    in_flight = group.in_flight = {k: v for k, v in in_flight.items()
                                                   if k > done}
                if len(in_flight) >= _MAX_IN_FLIGHT:
                    return token
            in_flight[seq] = token
        finally:
            lock.release()
        return token

    def enter(self, group_name: str, op: str, nbytes: int, dtype: Dtype) -> Token:
        """`begin` for a call that returns complete on the thread that makes it (a synchronous
        collective, the hot path of most jobs): no lock (but at a group's first call) and no
        in-flight entry (`_Group`), about a third less. Pair it with `returned`, or with
        `end(token, False)` if the call raised. The hooks' one-tensor collective wrapper
        (`hooks.installer._Installer.wrap_collective`) does what `enter` and `returned` do
        inline, to save the two calls: a change here is a change there
        (tests/agent/test_hot_path.py holds them to the same records)."""
        now = _time_ns() if self.wall_clock else self.clock() * 1000
        # a new group is added under the lock: the heartbeat thread iterates the groups under it
        group = self._groups.get(group_name) or self.group_state(group_name)
        token = (group, next(group.seqs), op, nbytes, dtype, -1, now)
        group.last = token
        return token

    def returned(self, token: Token) -> None:
        """The synchronous call of `token` (`enter`) returned: queue its event, or, in a device
        group, watch for its work to complete (`on_device`)."""
        group, seq, op, nbytes, dtype, peer, enqueued = token
        if group.device and self.on_device(token):
            return
        now = _time_ns() if self.wall_clock else self.clock() * 1000
        if seq > group.returned[0]:
            group.returned = (seq, now)
        self._offer((self.ident, group.name, seq, op, nbytes, dtype, peer, False, enqueued, now))

    def on_device(self, token: Token) -> bool:
        """A synchronous call of a device group returned, its work enqueued: keep it in flight
        until a marker made now says the device has done it (polled from the heartbeat thread,
        `poll_later`). False when no marker could be made: the caller takes the call as
        complete (counted in `device_fallbacks`)."""
        make = self.device_marker
        try:
            if make is None:
                raise RuntimeError("no device marker")
            marker = make()
        except Exception as exc:
            self.device_fallbacks += 1
            if self.device_fallbacks == 1:
                self.note_error("device completion", exc)
            return False
        group, seq = token[0], token[1]
        with self._lock:
            if len(group.in_flight) < _MAX_IN_FLIGHT:
                group.in_flight[seq] = token
        self.poll_later(marker, token, ordered=True)
        return True

    def end(self, token: Token, ok: bool, *, peer: int | None = None) -> None:
        """The operation `token` finished (ok) or failed on this rank; queue its event."""
        group, seq, op, nbytes, dtype, token_peer, enqueued = token
        now = _time_ns() if self.wall_clock else self.clock() * 1000
        lock = self._lock
        lock.acquire()
        try:
            group.in_flight.pop(seq, None)
            if seq > group.done[0]:
                group.done = (seq, now)
        finally:
            lock.release()
        self._offer((self.ident, group.name, seq, op, nbytes, dtype,
                     token_peer if peer is None else peer, not ok, enqueued, now))

    def now_us(self) -> int:
        return _time_ns() // 1000 if self.wall_clock else self.clock()

    def now_ns(self) -> int:
        """The clock of the group progress times (`_Group`)."""
        return _time_ns() if self.wall_clock else self.clock() * 1000

    def counted(self, group_name: str, op: str, entered: int, completed: int = -1, *,
                entered_us: int = 0, relabel: bool = False) -> None:
        """Progress in a group seen by counting rather than call by call (DDP's own
        communication, `hooks.ddp._DdpCount`; a backend's, `backend.BackendProgress`): `entered`
        operations so far (the last at `entered_us`, or now), the first `completed` of them
        known complete (-1: no news). Neither goes back. The group's heartbeat shows `op`
        pending while entered > completed; with `relabel`, `op` also renames the latest one
        entered when it was counted before."""
        now = self.now_ns()
        with self._lock:
            group = self._group(group_name)
            last = group.last
            if entered > group.last_enqueued:
                group.last = (group, entered, op, 0, "", -1, entered_us * 1000 or now)
            elif relabel and last is not None and last[1] == entered and last[2] != op:
                group.last = (group, entered, op, 0, "", -1, last[6])
            if completed > group.last_completed:
                group.done = (min(completed, group.last_enqueued), now)

    def record_span(self, group_name: str, seq: int, op: str, enqueue_us: int) -> None:
        """Record a completed operation of a counted group (`counted`) from `enqueue_us` to
        now."""
        self._offer((self.ident, group_name, seq, op, 0, "", -1, False, enqueue_us * 1000,
                     self.now_ns()))

    def poll_later(self, work: Any, token: Token, *, ordered: bool = False) -> None:
        """Watch an async work without a future (gloo send/recv) from the heartbeat thread.

        `ordered`: the work is a collective's, so it is taken as completed once a later call of
        its group has completed on this rank. Gloo's reduce_scatter works never report their
        completion (`is_completed()` stays False after `wait()`); without this their calls
        would never end."""
        with self._lock:
            kept = len(self._polled) < _MAX_POLLED
            if kept:
                self._polled.append((work, token, ordered))
        if not kept:
            self.end(token, True)
        self._wake.set()

    def add_settler(self, settle: Callable[[], None]) -> None:
        """`settle` (a bound method) ends the calls it holds that have completed; it is called
        from the heartbeat thread, at every optimizer step and at close, as long as its object
        lives."""
        with self._lock:
            self._settlers = _with_live(self._settlers, settle)

    def add_watcher(self, look: Callable[[], None]) -> None:
        """`look` (a bound method) is called from the heartbeat thread before each look at what
        is pending, and at close, never at an optimizer step, as long as its object lives."""
        with self._lock:
            self._watchers = _with_live(self._watchers, look)

    def add_step_hook(self, hook: Callable[[], None]) -> None:
        """`hook` (a bound method) is called at every training step (an optimizer step of the
        lead optimizer, not paused), on the training thread, as long as its object lives."""
        with self._lock:
            self._step_hooks = _with_live(self._step_hooks, hook)

    def settle(self) -> None:
        """Let the settlers end the calls of theirs that have completed."""
        self._call_each(self._settlers, "settle")

    def _call_each(self, refs: list[weakref.WeakMethod[Callable[[], None]]], where: str) -> None:
        """Call each live method of `refs`; an error is counted, never raised."""
        for ref in refs:
            method = ref()
            if method is not None:
                try:
                    method()
                except Exception as exc:
                    self.note_error(where, exc)

    def poll(self) -> None:
        """Finish the events of polled works that have completed, let the settlers end theirs
        and the watchers look."""
        self.settle()
        if self._watchers:
            self._call_each(self._watchers, "watch")
        if not self._polled:
            return
        with self._lock:
            polled, self._polled = self._polled, []
        still: list[tuple[Any, Token, bool]] = []
        for work, token, ordered in polled:
            try:
                done = bool(work.is_completed())
            except Exception as exc:
                self.note_error("work.is_completed", exc)
                continue
            if not done and ordered:
                done = token[0].last_completed > token[1]
            if not done:
                still.append((work, token, ordered))
                continue
            ok = True
            try:
                ok = work.exception() is None
            except Exception:
                ok = True
            self.end(token, ok)
        if still:
            with self._lock:
                self._polled[:0] = still

    # -- groups and identity --------------------------------------------------------------------

    def set_rank(self, rank: int) -> None:
        job, attempt, node, _ = self.ident
        self.ident = (job, attempt, node, rank)

    def group_created(self, group_name: str, ranks: tuple[int, ...], backend: str) -> None:
        """A process group this rank belongs to was created. Its calls complete on the device
        when its backend is one of `DEVICE_BACKENDS` and CUDA is available (or a test set
        `device_marker`)."""
        device = backend.lower() in DEVICE_BACKENDS and self._device_ready()
        with self._lock:
            self._group(group_name).device = device
        self._offer(ProcessGroupInfo(
            job=JobId(self.job), attempt=self.attempt, rank=Rank(self.rank),
            group=GroupId(group_name), ranks=ranks, backend=backend, time_us=self.clock(),
        ))

    def _device_ready(self) -> bool:
        """Whether device markers can be made (`cuda_marker` is taken when CUDA is there)."""
        if self.device_marker is None:
            try:
                import torch

                if torch.cuda.is_available():
                    self.device_marker = cuda_marker
            except Exception as exc:
                self.note_error("device completion", exc)
        return self.device_marker is not None

    # -- steps --------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        return self._step_base + self._opt_steps

    def pause_steps(self, paused: bool) -> None:
        """While paused, optimizer steps are not training steps (e.g. DCP's state init)."""
        self._steps_paused = paused

    def optimizer_stepped(self, optimizer: object) -> None:
        """Optimizer step post-hook: one training step per step of the first optimizer seen.
        Every optimizer step also ends the DDP buckets seen completed by then (`settle`)."""
        if self._settlers:
            self.settle()
        if self._steps_paused:
            return
        key = id(optimizer)
        if self._lead_optimizer is None:
            self._lead_optimizer = key
        elif key != self._lead_optimizer:
            return
        self._opt_steps += 1
        self._reached()
        if self._step_hooks:
            self._call_each(self._step_hooks, "step hook")

    def _reached(self) -> None:
        now = self.clock()
        self._step_us = now
        if not self._first_step_us and self.step > self._start_step:
            self._first_step_us = now

    def resume_from(self, step: int) -> None:
        """This process resumed from a checkpoint of `step`: steps count on from there."""
        self._start_step = step
        self._step_base = step - self._opt_steps
        self._resumed_us = self.clock()
        # told at once, not at the next beat: the controller measures the restart by it, and a
        # rank that stops soon after (a fault early in the attempt) may never beat again
        self._resumed_unsent = True
        self._wake.set()

    def set_step(self, step: int) -> None:
        """The training script says it has reached `step` now; optimizer steps count on from it."""
        self._step_base = step - self._opt_steps
        self._reached()

    # -- heartbeats -----------------------------------------------------------------------------

    def pending_since(self) -> int:
        """When the oldest call still pending in any group was entered (us); 0 when none is.
        Called from the heartbeat thread; holds the lock only for a scan of the groups."""
        since = 0
        with self._lock:
            for g in self._groups.values():
                t = g.pending_since()
                if t and (not since or t < since):
                    since = t
        return since // 1000

    def heartbeat_interval_s(self, now_us: int, since_us: int | None = None) -> float:
        """The heartbeat interval now: `inflight_heartbeat_s` while a call has been pending for
        `inflight_s` or longer, else `heartbeat_s` (`since_us`: `pending_since()`, if known)."""
        since = self.pending_since() if since_us is None else since_us
        if since and now_us - since >= self.inflight_s * 1e6:
            return self.inflight_heartbeat_s
        return self.heartbeat_s

    def heartbeat_record(self) -> Heartbeat:
        with self._lock:
            groups = tuple(g.progress() for g in self._groups.values())
        return Heartbeat(
            job=JobId(self.job), attempt=self.attempt, node=NodeId(self.node),
            rank=Rank(self.rank), time_us=self.clock(), pid=self.pid, step=self.step,
            step_us=self._step_us, start_step=self._start_step,
            first_step_us=self._first_step_us, dropped=self.dropped, groups=groups,
            resumed_us=self._resumed_us,
        )

    def heartbeat(self) -> None:
        """Queue a heartbeat now; never raises."""
        try:
            self._offer(self.heartbeat_record())
        except Exception as exc:
            self.note_error("heartbeat", exc)

    def start(self) -> None:
        """Start the heartbeat thread (idempotent)."""
        if self._thread is not None or self.disabled:
            return
        self._thread = threading.Thread(
            target=self._run, name="tracehound-heartbeat", daemon=True
        )
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        last_beat = 0
        while not self._stop.is_set():
            wait = self.heartbeat_s
            try:
                self.poll()
                now = self.clock()
                since = self.pending_since()
                interval = self.heartbeat_interval_s(now, since)
                resumed, self._resumed_unsent = self._resumed_unsent, False
                if resumed or now - last_beat >= interval * 1e6:
                    self.heartbeat()
                    last_beat = self.clock()
                    if (resumed or interval < self.heartbeat_s) and self._nudge is not None:
                        # a resume, or a call long in flight: the node agent sees this beat
                        # now, not at the sink's next send
                        self._nudge()
                if since:
                    # wake at the fast rate while anything is pending: to see it pass
                    # `inflight_s`, and to beat at that rate from then on
                    wait = self.inflight_heartbeat_s
            except Exception as exc:
                self.note_error("heartbeat thread", exc)
            if self._polled:
                wait = min(wait, 0.02)
            self._wake.wait(wait)
            self._wake.clear()

    def close(self, timeout: float = 2.0) -> None:
        """Stop heartbeats, send a final one and flush the sink, waiting at most `timeout` s."""
        if self.disabled:
            return
        self._stop.set()
        self._wake.set()
        try:
            if self._thread is not None:
                self._thread.join(timeout=min(timeout, 0.5))
            self.poll()
            self.heartbeat()
            self.sink.flush(timeout)
        except Exception as exc:
            self.note_error("close", exc)

    def disable(self) -> None:
        """Stop recording for good (e.g. in a forked child, whose threads did not survive)."""
        self.disabled = True
        self._take_queue()
        self._stop.set()


def identity_from_env(env: dict[str, str] | None = None) -> tuple[str, int, str, int]:
    """(job, attempt, node, rank) of this process from the launch environment."""
    source = dict(os.environ) if env is None else env
    job = (env_str(TRACEHOUND_JOB_ID, env=source) or source.get("TORCHELASTIC_RUN_ID")
           or DEFAULT_JOB_ID)
    attempt = env_int(
        TRACEHOUND_ATTEMPT, env_int("TORCHELASTIC_RESTART_COUNT", 0, env=source), env=source
    )
    node = env_str(TRACEHOUND_NODE_ID, env=source) or socket.gethostname()
    rank = env_int("RANK", 0, env=source)
    return job, attempt, node, rank
