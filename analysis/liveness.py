"""Frozen, stuck or busy: what a rank that others wait on is doing.

Peers waiting in a collective prove only that some rank has not arrived. Whether that is a fault
depends on what the rank is doing, and production jobs spend seconds to minutes outside
collectives on some ranks (checkpoint writes, evaluation, compilation, data loading):

- *frozen*: its process is stopped (state `T`, e.g. SIGSTOP) or gone, or its heartbeats have
  stopped and nothing shows that the process still runs. Frozen ranks cannot complete anything,
  so a frozen member blocks every collective of its groups, entered or not (but one frozen by
  its silence alone, inside a collective that still waits for a member that reports, is not
  what that collective waits on: `analysis.detect`).
- *stuck*: it reports, and it has been inside one operation for `hang_after_s` (on its own clock)
  that does not complete.
- *busy*: it is alive and outside every collective (or just passing through short ones). Its
  heartbeats may even pause while a C call holds the interpreter lock: the node agent's process
  samples (`/proc`: state, CPU and I/O counters) taken after its last heartbeat say whether the
  process still runs.

Frozen and stuck ranks are hangs at once; a busy one is a stall, judged a hang only after the
busy grace. This module never decides that: it only says which is which, with the facts behind
it, for `analysis.detect`.

Pure: no I/O, no clock; the snapshot carries the time.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing.events import Heartbeat, ProcessSample, ProcessState, StackSample

_US = 1_000_000

_STOPPED = frozenset({ProcessState.STOPPED, ProcessState.TRACED})
_GONE = frozenset({ProcessState.ZOMBIE, ProcessState.DEAD, ProcessState.GONE})
_ACTIVE = frozenset({ProcessState.RUNNING, ProcessState.DISK_WAIT})

ALIVE_CPU_RATE = 0.05
"""CPU seconds per second above which a process whose heartbeats stopped is still working."""


class Condition(enum.StrEnum):
    FROZEN = "frozen"
    STUCK = "stuck"
    BUSY = "busy"


@dataclass(frozen=True, slots=True, kw_only=True)
class RankLife:
    """What is known of one rank's process and where it is."""

    rank: int
    frozen: bool
    strength: tuple[int, float]
    """Sort key of a frozen rank's evidence, strongest first: (0 stopped or gone by the
    process's own state, 1 silent heartbeats, 2 never reported), then minus seconds silent."""
    why: str
    """Words for the condition, e.g. "its process is stopped (state T)"."""
    process: ProcessSample | None = None
    """The newest process sample of the rank, if the node agent sent one."""
    stack: StackSample | None = None
    """The newest stack sample of the rank, if one was captured."""


def _words(sample: ProcessSample) -> str:
    rate = sample.io_rate
    io = f", I/O {rate / 1e6:.1f} MB/s" if rate >= 1e5 else ""
    return f"state {sample.state}, CPU {sample.cpu_rate:.2f} s/s{io}"


def process_words(sample: ProcessSample | None) -> str:
    """A process sample in words ("state R, CPU 0.98 s/s, I/O 12.0 MB/s"), "" without one."""
    return "" if sample is None else _words(sample)


def assess(
    snap: JobSnapshot, *, heartbeat_timeout_s: float, ranks: Mapping[int, Heartbeat | None]
) -> dict[int, RankLife]:
    """The life of every rank in `ranks` (rank -> its newest heartbeat, None if it never sent
    one). Exited ranks are left to the crash detector and not assessed."""
    exited = {int(e.rank) for e in snap.exits}
    procs = {int(p.rank): p for p in snap.processes}
    stacks = {int(s.rank): s for s in snap.stacks}
    silent_after = snap.now_us - int(heartbeat_timeout_s * _US)
    out: dict[int, RankLife] = {}
    for rank, hb in ranks.items():
        if rank in exited:
            continue
        proc = procs.get(rank)
        if proc is not None and hb is not None and proc.pid != hb.pid:
            proc = None  # a sample of another process (an earlier one of the same rank)
        frozen, strength, why = _judge(snap.now_us, silent_after, hb, proc)
        out[rank] = RankLife(rank=rank, frozen=frozen, strength=strength, why=why,
                             process=proc, stack=stacks.get(rank))
    return out


def _judge(now_us: int, silent_after: int, hb: Heartbeat | None,
           proc: ProcessSample | None) -> tuple[bool, tuple[int, float], str]:
    if proc is not None and proc.state in _STOPPED:
        return True, (0, 0.0), f"its process is stopped (state {proc.state})"
    if proc is not None and proc.state in _GONE:
        return True, (0, 0.0), f"its process is gone (state {proc.state})"
    if hb is None:
        if proc is not None and _shows_life(proc):
            return False, (9, 0.0), f"it never reported, but its process runs ({_words(proc)})"
        return True, (2, 0.0), "it never reported"
    if hb.time_us >= silent_after:
        return False, (9, 0.0), "it reports"
    silent_s = round((now_us - hb.time_us) / _US, 1)
    # Only a sample taken after the last heartbeat can show life after the heartbeats stopped.
    if proc is not None and proc.time_us > hb.time_us and _shows_life(proc):
        return False, (9, 0.0), (
            f"its heartbeats paused {silent_s:.1f} s ago but its process runs ({_words(proc)})"
        )
    return True, (1, -silent_s), f"it has sent no heartbeat for {silent_s:.1f} s"


def _shows_life(proc: ProcessSample) -> bool:
    return proc.state in _ACTIVE or proc.cpu_rate >= ALIVE_CPU_RATE or proc.io_rate > 0


def last_activity_us(hb: Heartbeat) -> int:
    """When the rank last entered or left an operation, on its own clock (0: never)."""
    return max((max(g.last_enqueue_us, g.last_complete_us) for g in hb.groups), default=0)


def fresh_stack(life: RankLife, since_us: int) -> StackSample | None:
    """The rank's newest stack if it has frames and was captured at or after `since_us` (its
    last activity), else None: a stack older than that shows where the rank was before, not
    where it is now."""
    stack = life.stack
    if stack is None or not stack.frames or stack.time_us < since_us:
        return None
    return stack


def where_words(life: RankLife, since_us: int) -> str:
    """Where a busy rank is, from a stack captured since `since_us`: its innermost frames,
    innermost last. "" when no such stack was captured."""
    stack = fresh_stack(life, since_us)
    return "" if stack is None else " > ".join(stack.frames[-3:])


_COLLECTIVE_FILES = ("torch/distributed/distributed_c10d.py",
                     "torch/distributed/_functional_collectives.py",
                     "torch/distributed/c10d_logger.py")
"""Files a stack is in while it runs a collective of torch.distributed (a call that blocks until
its peers join, or a functional collective's `wait_tensor`)."""
_COLLECTIVE_FUNCTIONS = ("wait_tensor",)
_WRAPPER_MARK = "<tracehound wrapper of "
_INNERMOST = 3


def collective_wait(frames: tuple[str, ...]) -> str:
    """The frame that shows a stack waiting in a collective (`file:line function`, innermost
    last), "" when its innermost frames show none: a c10d call of torch.distributed, a functional
    collective's `wait_tensor`, or a recorder wrapper. Only Python frames are seen: a rank in a
    C++ `Work.wait()` called from user code shows the user's line and counts as busy."""
    for frame in reversed(frames[-_INNERMOST:]):
        where, _, function = frame.rpartition(" ")
        if (where.rsplit(":", 1)[0].endswith(_COLLECTIVE_FILES)
                or function.rsplit(".", 1)[-1] in _COLLECTIVE_FUNCTIONS
                or _WRAPPER_MARK in where):
            return frame
    return ""


def stack_wait(life: RankLife, since_us: int) -> StackSample | None:
    """The rank's stack captured since `since_us` if it shows the rank waiting in a collective
    (`collective_wait`), else None."""
    stack = fresh_stack(life, since_us)
    return stack if stack is not None and collective_wait(stack.frames) else None
