"""Progress of each process group as its backend counts it: the collectives no wrapper saw.

Some collectives pass no Python function the recorder wraps: those of a compiled graph
(`torch.ops._c10d_functional.*` called from generated code), of funcol's autograd backward,
of a process group's own methods (`pg.allreduce(...)`). c10d still counts every collective a
group's backend issues, and its Flight Recorder keeps, per group, the last one enqueued and the
last one completed (`pg_status`; a few microseconds to read, with no entry copied). This is what
a watcher on the heartbeat thread (`BackendProgress.look`) reads at every wake:

- a group whose backend has had a collective in flight for `inflight_s` while the recorder shows
  nothing of that group pending (so none of its traced calls is the one in flight) is reported
  from then on as the group `<group>:c10d` (announced with the group's ranks, backend "c10d"):
  its sequence ids are c10d's, the same on every member, entered and completed as the backend
  counts them, the pending one named by its Flight Recorder entry (`all_reduce`, ...). The
  dependency analysis then follows who waits on whom there as in any group;
- the first such look at a group reads the Flight Recorder's entries once (tens of
  milliseconds for a full ring, holding the interpreter lock) to learn which group the
  backend's numbering belongs to and what the pending collective is; nothing else reads them,
  and a healthy job whose untraced collectives never stay in flight that long never pays it.

Groups whose other traffic DDP counts (`hooks.ddp._DdpCount`) are left out: their buckets are
counted there. Where the Flight Recorder is off (`TORCH_FR_BUFFER_SIZE=0`) or absent, nothing is
reported. A rank's group shows up here only once it was seen waiting; a member that never was
counts as not entered (a member that completed the collective without waiting in it, the root
of a broadcast, is the exception this leaves).

It runs on the heartbeat thread, never on the training thread; an error is counted by the
recorder and the look given up.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracehound.agent.rank.recorder import Recorder

BACKEND_SUFFIX = ":c10d"
"""The reported group of a process group's backend progress: `<group>:c10d`."""
UNTRACED_OP = "untraced"
"""The pending op of a backend group whose Flight Recorder entry was not read (yet)."""
_LOOK_EVERY = 0.9
"""Looks are at least this many heartbeat intervals apart (a little less than one, so that the
wake of each heartbeat looks)."""
_READ_AGAIN_S = 1.0
"""A full read of the Flight Recorder's entries is made at most this often, and at most once
for each collective that stays in flight (`_Seen.read`)."""


@dataclass(slots=True)
class _Seen:
    """One backend group (by Flight Recorder id) as the heartbeat thread last saw it."""

    enqueued: int = -1
    completed: int = -1
    since_us: int = 0
    """When this `enqueued` value was first seen (heartbeat thread's clock)."""
    op: str = UNTRACED_OP
    read: bool = False
    """Whether the entries were read while this collective was in flight."""


class BackendProgress:
    """The heartbeat thread's watcher of the backends' own progress (see the module)."""

    def __init__(self, recorder: Recorder, *, status: Callable[[bool], bytes],
                 ranks_of: Callable[[str], tuple[int, ...]],
                 counted: Callable[[str], bool]) -> None:
        self.recorder = recorder
        self.status = status
        """`_dump_fr_trace_json(includeCollectives, False)`: the Flight Recorder as JSON."""
        self.ranks_of = ranks_of
        """A group's global ranks, by name."""
        self.counted = counted
        """Whether DDP counts a group's traffic."""
        self.seen: dict[str, _Seen] = {}
        self.names: dict[str, str] = {}
        """Flight Recorder group id -> group name."""
        self.reported: set[str] = set()
        self.read_us = 0
        self.next_us = 0

    def look(self) -> None:
        """Read the backends' progress and report the groups that need it (heartbeat thread:
        at most once a heartbeat interval, though it wakes ten times as often while a call is
        pending)."""
        now = self.recorder.now_us()
        if now < self.next_us:
            return
        self.next_us = now + int(self.recorder.heartbeat_s * 1e6 * _LOOK_EVERY)
        status = json.loads(self.status(False)).get("pg_status") or {}
        after_us = int(self.recorder.inflight_s * 1e6)
        for uid, counts in status.items():
            enqueued = int(counts.get("last_enqueued_collective", -1))
            completed = int(counts.get("last_completed_collective", -1))
            seen = self.seen.get(uid)
            if seen is None:
                seen = self.seen[uid] = _Seen()
            if enqueued != seen.enqueued:
                seen.enqueued, seen.since_us, seen.op, seen.read = enqueued, now, UNTRACED_OP, False
            seen.completed = completed
            name = self.names.get(uid)
            if name in self.reported:
                self._report(name, seen, now - seen.since_us >= after_us)
                continue
            if enqueued <= completed or now - seen.since_us < after_us:
                continue
            if name is None:
                self._read_entries(seen, now)
                name = self.names.get(uid)
            if name is None or self.counted(name) or self._traced_pending(name):
                continue
            self.reported.add(name)
            self.recorder.group_created(name + BACKEND_SUFFIX, self.ranks_of(name), "c10d")
            self._report(name, seen, True)

    def _traced_pending(self, name: str) -> bool:
        group = self.recorder.groups.get(name)
        if group is None:
            return False
        done, _, last = group.snapshot()
        return last is not None and last[1] > done

    def _report(self, name: str, seen: _Seen, long: bool) -> None:
        if long and seen.op == UNTRACED_OP and seen.enqueued > seen.completed:
            self._read_entries(seen, self.recorder.now_us())
        self.recorder.counted(name + BACKEND_SUFFIX, seen.op, max(seen.enqueued, 0),
                              max(seen.completed, 0), entered_us=seen.since_us, relabel=True)

    def _read_entries(self, seen: _Seen, now_us: int) -> None:
        """Learn each backend id's group name, and name the pending collectives, from the
        Flight Recorder's entries (the one costly read), once while `seen`'s collective is in
        flight."""
        if seen.read or now_us - self.read_us < _READ_AGAIN_S * 1e6:
            return
        seen.read = True
        self.read_us = now_us
        entries = json.loads(self.status(True)).get("entries") or ()
        pending = {uid: s.enqueued for uid, s in self.seen.items() if s.enqueued > s.completed}
        for entry in entries:
            uid = str(entry.get("pg_id", ""))
            group = entry.get("process_group") or ()
            if group and uid not in self.names:
                self.names[uid] = str(group[0])
            if uid in pending and entry.get("collective_seq_id") == pending[uid]:
                op = str(entry.get("profiling_name") or UNTRACED_OP)
                self.seen[uid].op = op.split(":", 1)[-1] or UNTRACED_OP


_progress: BackendProgress | None = None


def install_backend_progress(recorder: Recorder, dist: Any,
                             counted: Callable[[str], bool]) -> bool:
    """Start watching the backends' progress of this process (once the default group exists);
    False where torch has no Flight Recorder to read."""
    global _progress
    c10d_c = importlib.import_module("torch._C._distributed_c10d")
    dump = getattr(c10d_c, "_dump_fr_trace_json", None)
    if dump is None:
        return False
    if _progress is not None and _progress.recorder is recorder:
        return True
    c10d = dist.distributed_c10d

    def status(entries: bool) -> bytes:
        raw: bytes = dump(entries, False)
        return raw

    def ranks_of(name: str) -> tuple[int, ...]:
        group = c10d._resolve_process_group(name)
        return tuple(int(r) for r in dist.get_process_group_ranks(group))

    _progress = BackendProgress(recorder, status=status, ranks_of=ranks_of, counted=counted)
    recorder.add_watcher(_progress.look)
    return True
