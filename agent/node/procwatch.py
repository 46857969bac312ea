"""Watches the local ranks' processes from outside: `/proc` samples and py-spy stacks.

The node agent learns each local rank's pid from its heartbeats and hands every heartbeat to a
`ProcWatcher`. Every `proc_interval_s` the watcher's thread reads `/proc/PID/stat` and
`/proc/PID/io` of each watched rank and emits a `ProcessSample` (state, CPU and I/O used so far,
and their rates since the previous sample); a rank whose process is gone gets one last sample with
state `gone` and is watched no more. A rank that looks stuck (`suspicion`: pending in an op, busy
outside collectives, or silent while its process lives) gets its Python stack captured with
`py-spy dump --nonblocking` and emitted as a `StackSample`, once per episode of no progress,
again every `stack_repeat_s` while the episode lasts, and never more often than every
`stack_min_gap_s`; and again when the process went from waiting to computing or back since its
last capture (`ACTIVE_CPU_RATE`), after `stack_after_s`. A capture that failed is tried again
after `stack_after_s`, up to `CAPTURE_RETRIES` times in a row: `--nonblocking` reads memory the
process is changing, and a read that caught it mid-change fails where the next succeeds (a rank
writing a checkpoint, a CI run). A rank that waited in DDP's
construction and then computes a slow first step makes no collective progress in between, and
the stack from its wait would stand for the step. Ranks are keyed by (job, attempt, rank): a
newer attempt of a job ends the watch of the older one's ranks.

This runs in the node agent, never inside a training process, and it must never pause one: py-spy
is always run with `--nonblocking` (it reads the process's memory without stopping it). Nothing
here may raise into the agent: a failed read or capture is counted, logged once, and skipped.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tracehound.agent.sources.procfs import parse_io, parse_stat
from tracehound.tracing import logs
from tracehound.tracing.events import (
    Heartbeat,
    ProcessSample,
    ProcessState,
    Record,
    StackSample,
    now_us,
)
from tracehound.tracing.ids import JobId, NodeId, Rank

log = logging.getLogger(__name__)

PY_SPY_TIMEOUT_S = 5.0
"""Longest a single `py-spy dump` may take before it is killed."""

_CAPTURE_BUDGET_S = 5.0
"""Captures of one round stop once they took this long; the rest wait for the next round."""

_TRIGGER_INTERVAL_S = 1.0
"""How often stack triggers are checked when process sampling is off."""

CAPTURE_RETRIES = 3
"""Failed captures of a stuck rank tried again soon in a row; after that, as if captured."""

_MAX_FRAME_CHARS = 4096
"""The wire's limit on one frame string."""

Emit = Callable[[Sequence[Record]], None]
"""Where the watcher's records go (the agent's spool). May raise; the watcher logs and goes on."""

Episode = tuple[tuple[str, int, int], ...]
"""(group, last_enqueued, last_completed) of every group of a heartbeat: any progress changes it."""

_Key = tuple[JobId, int, Rank]


# -- /proc ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcReading:
    """What `/proc` says of one process at one moment."""

    state: str
    """The kernel's state letter (R, S, D, T, t, Z, X)."""
    cpu_s: float
    """User plus system CPU seconds so far."""
    start_ticks: int
    """When the process started, in clock ticks after boot: a reused pid has another value."""
    read_bytes: int = 0
    write_bytes: int = 0
    io_known: bool = False
    """False when `/proc/PID/io` could not be read (the byte counts are then 0)."""


class ProcReader(Protocol):
    """Reads one process's state and counters (the real one is `ProcFs`)."""

    def read(self, pid: int) -> ProcReading | None:
        """What `/proc` says of `pid` now; None when no such process exists."""
        ...


class ProcFs:
    """Reads `/proc/PID/stat` and `/proc/PID/io` (under `root`, for tests)."""

    def __init__(self, root: str | os.PathLike[str] = "/proc", *, clock_ticks: int = 0) -> None:
        self.root = Path(root)
        self.clock_ticks = clock_ticks or os.sysconf("SC_CLK_TCK")
        self._io_logged = False

    def read(self, pid: int) -> ProcReading | None:
        base = self.root / str(pid)
        try:
            text = (base / "stat").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError):
            return None
        state, cpu_s, start = parse_stat(text, self.clock_ticks)
        try:
            read_bytes, write_bytes = parse_io((base / "io").read_text())
        except (FileNotFoundError, ProcessLookupError):
            # It ended between the two reads; the next round sees it gone.
            return ProcReading(state=state, cpu_s=cpu_s, start_ticks=start)
        except (OSError, ValueError) as exc:
            if not self._io_logged:
                self._io_logged = True
                log.warning("cannot read %s (I/O counts will be 0; logged once): %r",
                            base / "io", exc)
            return ProcReading(state=state, cpu_s=cpu_s, start_ticks=start)
        return ProcReading(
            state=state, cpu_s=cpu_s, start_ticks=start, read_bytes=read_bytes,
            write_bytes=write_bytes, io_known=True,
        )


# -- py-spy ---------------------------------------------------------------------------------------


class StackCaptureError(Exception):
    """No stack could be captured; the message says why (py-spy missing, failed, timed out)."""


class StackCapturer(Protocol):
    """Captures a process's Python stack from outside it (the real one is `PySpy`)."""

    def capture(self, pid: int, *, cancel: threading.Event) -> tuple[str, ...]:
        """The main thread's frames, outermost first, as `file:line function`; raises
        StackCaptureError. Gives up soon after `cancel` is set."""
        ...


def find_py_spy(explicit: str | None = None) -> str | None:
    """The py-spy binary: `explicit` if given, else the one on PATH, else the one beside this
    Python (a virtualenv's bin directory); None if there is none."""
    if explicit:
        return explicit
    found = shutil.which("py-spy")
    if found:
        return found
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return None


def frames_from_dump(dump: Any, pid: int) -> tuple[str, ...]:
    """The frames of the main thread in `py-spy dump --json` output, outermost first.

    The main thread is the one whose os_thread_id is the pid, else the one named MainThread, else
    the first. py-spy lists frames innermost first; each becomes `short_filename:line name`."""
    threads = [t for t in dump if isinstance(t, dict)] if isinstance(dump, list) else []
    if not threads:
        raise StackCaptureError("py-spy listed no threads")
    chosen = (
        next((t for t in threads if t.get("os_thread_id") == pid), None)
        or next((t for t in threads if t.get("thread_name") == "MainThread"), None)
        or threads[0]
    )
    frames = chosen.get("frames")
    if not isinstance(frames, list):
        raise StackCaptureError("py-spy gave a thread without a frame list")
    out: list[str] = []
    for frame in reversed(frames):
        if not isinstance(frame, dict):
            continue
        where = frame.get("short_filename") or frame.get("filename") or "?"
        out.append(f"{where}:{frame.get('line')} {frame.get('name')}"[:_MAX_FRAME_CHARS])
    return tuple(out)


class PySpy:
    """Runs `py-spy dump --pid P --nonblocking --json` (never without --nonblocking: the process
    must not be paused) and reads the main thread's stack from its output."""

    def __init__(self, path: str | None, *, timeout_s: float = PY_SPY_TIMEOUT_S) -> None:
        self.path = path
        self.timeout_s = timeout_s

    def capture(self, pid: int, *, cancel: threading.Event) -> tuple[str, ...]:
        if self.path is None:
            raise StackCaptureError("py-spy not found (install py-spy or pass --py-spy PATH)")
        command = [self.path, "dump", "--pid", str(pid), "--nonblocking", "--json"]
        try:
            process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        except OSError as exc:
            raise StackCaptureError(f"cannot run {self.path}: {exc}") from exc
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                out, err = process.communicate(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                if cancel.is_set() or time.monotonic() >= deadline:
                    process.kill()
                    process.communicate()
                    reason = "cancelled" if cancel.is_set() else f"took over {self.timeout_s}s"
                    raise StackCaptureError(f"py-spy {reason}") from None
        if process.returncode != 0:
            lines = [s.strip() for s in err.decode(errors="replace").splitlines() if s.strip()]
            first = lines[0][:300] if lines else "no message"
            raise StackCaptureError(f"py-spy exited with {process.returncode}: {first}")
        try:
            dump = json.loads(out)
        except ValueError as exc:
            raise StackCaptureError(f"py-spy output is not JSON: {exc}") from exc
        return frames_from_dump(dump, pid)


# -- when to capture ------------------------------------------------------------------------------


class SuspectKind(enum.StrEnum):
    """Why a rank's stack is worth capturing."""

    PENDING = "pending"
    """Inside an op (a collective it entered has not completed) for stack_after_s or longer."""
    BUSY = "busy"
    """Outside all ops for stack_after_s or longer since its last collective activity (writing
    a checkpoint, evaluating, loading data)."""
    SILENT = "silent"
    """No heartbeat for stack_after_s or longer while its process still exists (stopped, or
    stuck in a call that holds the GIL)."""


@dataclass(frozen=True, slots=True)
class Suspicion:
    kind: SuspectKind
    since_us: int
    """When the condition began (the op's enqueue, the last activity, the last heartbeat)."""
    detail: str = ""
    """The op and group of a PENDING suspicion."""

    def describe(self, now: int) -> str:
        what = f"{self.kind.value} {self.detail}".strip()
        return f"{what} for {(now - self.since_us) / 1e6:.1f}s"


def suspicion(hb: Heartbeat, *, now: int, after_us: int, joined_us: int = 0
              ) -> Suspicion | None:
    """Whether a rank whose latest heartbeat is `hb` looks stuck at time `now` (microseconds,
    the ranks' clock), and why. `joined_us`: when the rank was first seen in a process group
    (0: unknown); a rank in a group that has run no collective since then for `after_us` is busy
    too (a slow first step: compilation, a first data load). The caller checks that the process
    still exists."""
    if now - hb.time_us >= after_us:
        return Suspicion(SuspectKind.SILENT, hb.time_us)
    pending = [g for g in hb.groups if g.pending_op]
    if pending:
        oldest = min(pending, key=lambda g: g.last_enqueue_us)
        if now - oldest.last_enqueue_us >= after_us:
            return Suspicion(
                SuspectKind.PENDING, oldest.last_enqueue_us,
                f"in {oldest.pending_op} (group {oldest.group})",
            )
        return None
    if not any(g.last_enqueued > 0 for g in hb.groups):
        if hb.groups and joined_us and now - joined_us >= after_us:
            return Suspicion(SuspectKind.BUSY, joined_us)
        return None  # no collective yet: still starting up
    last = max(max(g.last_complete_us, g.last_enqueue_us) for g in hb.groups)
    if now - last >= after_us:
        return Suspicion(SuspectKind.BUSY, last)
    return None


def episode(hb: Heartbeat) -> Episode:
    """The progress a heartbeat reports; a new value starts a new episode."""
    return tuple(sorted((g.group, g.last_enqueued, g.last_completed) for g in hb.groups))


# -- the launcher's note ---------------------------------------------------------------------------


def read_launch_file(path: str | os.PathLike[str], *, job: str, node: str
                     ) -> tuple[int, list[tuple[Rank, int, int | None]]]:
    """The attempt and (rank, pid, start ticks or None) of each rank of `job` on `node` that
    a launcher noted in `path`: a JSON object with `job`, `attempt` and `ranks`, a list of
    objects with `rank`, `pid`, `node` and optionally `start` (`/proc/PID/stat` field 22), as
    `tracehound run` writes for each attempt. Raises ValueError, naming the file and the
    field, on anything else, and OSError when it cannot be read."""
    where = os.fspath(path)
    try:
        doc = json.loads(Path(path).read_bytes())
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object with job, attempt and ranks")
    if doc.get("job") != job:
        return 0, []  # another job's launches
    attempt = _count(where, "attempt", doc.get("attempt"))
    entries = doc.get("ranks")
    if not isinstance(entries, list):
        raise ValueError(f"{where}: ranks must be a list, got {type(entries).__name__}")
    found: list[tuple[Rank, int, int | None]] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or entry.get("node") != node:
            continue
        rank, pid = (_count(where, f"ranks[{i}].{name}", entry.get(name))
                     for name in ("rank", "pid"))
        start = entry.get("start")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool)):
            raise ValueError(f"{where}: ranks[{i}].start must be an integer or null, "
                             f"got {start!r}")
        found.append((Rank(rank), pid, start))
    return attempt, found


def _count(where: str, name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{where}: {name} must be an integer >= 0, got {value!r}")
    return value


# -- the watcher ----------------------------------------------------------------------------------


@dataclass
class WatchStats:
    process_samples: int = 0
    """ProcessSample records emitted."""
    stacks_captured: int = 0
    """StackSample records emitted."""
    stacks_failed: int = 0
    """Captures that gave no stack (py-spy missing, failed or timed out)."""


@dataclass
class _Watched:
    """One rank of one attempt, as the watcher follows it."""

    hb: Heartbeat
    """The latest heartbeat (its pid is the process watched)."""
    log: logs.JobLogger
    previous: ProcReading | None = None
    previous_us: int = 0
    gone: bool = False
    read_failed: bool = False
    captured_us: int | None = None
    captured_episode: Episode | None = None
    failures: int = 0
    """Captures of its stack that failed in a row since the last that worked."""
    joined_us: int = 0
    """When the rank was first seen in a process group (0: not yet)."""
    active: bool = False
    """The latest sample found it computing (CPU rate >= ACTIVE_CPU_RATE)."""
    captured_active: bool = False
    """`active` when its stack was last captured."""
    heard: bool = True
    """False while the rank is known only from its launcher (`ProcWatcher.expect`): its
    heartbeat is a stand-in, so its process is sampled but its stack is not judged."""
    start_ticks: int | None = None
    """The process's start time as its launcher noted it; a pid that started at another time
    is not that process (reused)."""


ACTIVE_CPU_RATE = 0.5
"""CPU seconds per second from which a rank counts as computing rather than waiting."""


def _seconds(name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return value


class ProcWatcher:
    """Samples the processes of the ranks it has heard from and captures stacks of stuck ones."""

    def __init__(
        self,
        *,
        emit: Emit,
        proc_interval_s: float = 1.0,
        stack_after_s: float = 2.0,
        stack_repeat_s: float = 30.0,
        stack_min_gap_s: float = 5.0,
        reader: ProcReader | None = None,
        capturer: StackCapturer | None = None,
        clock: Callable[[], int] = now_us,
        job: str = "",
        node: str = "",
        launch_file: str | os.PathLike[str] | None = None,
    ) -> None:
        """`proc_interval_s` 0 turns sampling off, `stack_after_s` 0 turns captures off.
        `clock` gives wall-clock microseconds, the clock of the ranks' heartbeats.
        `launch_file`: the launcher's note of the ranks it started (`read_launch_file`), read
        again whenever it changes; the ranks of `job` on `node` in it are watched from then on
        (`expect`)."""
        self.emit = emit
        self.proc_interval_s = _seconds("proc_interval_s", proc_interval_s)
        self.stack_after_s = _seconds("stack_after_s", stack_after_s)
        self.stack_repeat_s = _seconds("stack_repeat_s", stack_repeat_s)
        self.stack_min_gap_s = _seconds("stack_min_gap_s", stack_min_gap_s)
        self.reader: ProcReader = reader if reader is not None else ProcFs()
        self.capturer: StackCapturer = capturer if capturer is not None else PySpy(find_py_spy())
        self.clock = clock
        self.stats = WatchStats()
        self.log = logs.JobLogger(log, job=job, node=node)
        self._ranks: dict[_Key, _Watched] = {}
        self._newest_attempt: dict[JobId, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._capture_failure_logged = False
        self.job, self.node = job, node
        self.launch_file = Path(launch_file) if launch_file is not None else None
        self._launch_seen: tuple[int, int] | None = None
        self._launch_error = ""

    @property
    def sampling(self) -> bool:
        return self.proc_interval_s > 0

    @property
    def capturing(self) -> bool:
        return self.stack_after_s > 0

    # -- input ----------------------------------------------------------------------------------

    def observe(self, hb: Heartbeat) -> None:
        """Take note of a rank's heartbeat (called for every heartbeat the agent receives)."""
        if hb.pid <= 0:
            return
        with self._lock:
            if not self._current(hb.job, hb.attempt):
                return  # a late heartbeat of an attempt that was replaced
            key = (hb.job, hb.attempt, hb.rank)
            watched = self._ranks.get(key)
            if watched is None or watched.hb.pid != hb.pid:
                watched = _Watched(
                    hb=hb, log=logs.JobLogger(log, job=hb.job, node=hb.node, rank=hb.rank)
                )
                self._ranks[key] = watched
                watched.log.info("watching pid %d (attempt %d)", hb.pid, hb.attempt)
            elif not watched.heard or hb.time_us >= watched.hb.time_us:
                if not watched.heard:
                    watched.log.info("pid %d reports (attempt %d)", hb.pid, hb.attempt)
                watched.hb, watched.heard = hb, True

    def expect(self, *, job: JobId, attempt: int, node: str, rank: Rank, pid: int,
               start_ticks: int | None = None) -> None:
        """Watch a rank's process from its launch, as its launcher noted it, before (or
        without) any heartbeat: a rank whose recorder never reaches the agent (not installed,
        its socket unreachable) still has its process state sampled, so a stopped or vanished
        one is seen. Its stack is not captured until it reports. Ignored for a rank already
        watched under that pid, and for an attempt older than the newest one seen."""
        if pid <= 0:
            return
        with self._lock:
            if not self._current(job, attempt):
                return
            key = (job, attempt, rank)
            known = self._ranks.get(key)
            if known is not None and known.hb.pid == pid:
                return
            stand_in = Heartbeat(job=job, attempt=attempt, node=NodeId(node), rank=rank, time_us=0,
                                 pid=pid, step=0, step_us=0, start_step=0, first_step_us=0,
                                 dropped=0)
            watched = _Watched(hb=stand_in, log=logs.JobLogger(log, job=job, node=node,
                                                                rank=rank),
                               heard=False, start_ticks=start_ticks)
            self._ranks[key] = watched
            watched.log.info("watching pid %d (attempt %d) from its launch, before it reports",
                             pid, attempt)

    def _current(self, job: JobId, attempt: int) -> bool:
        """Whether `attempt` is the newest of `job` seen (a newer one ends the watch of the
        older attempts' ranks); called under the lock."""
        newest = self._newest_attempt.get(job)
        if newest is not None and attempt < newest:
            return False
        if newest is None or attempt > newest:
            self._newest_attempt[job] = attempt
            old = [k for k in self._ranks if k[0] == job and k[1] < attempt]
            for key in old:
                del self._ranks[key]
            if old:
                self.log.info("job %s attempt %d: no longer watching %d ranks of earlier "
                              "attempts", job, attempt, len(old))
        return True

    def watched(self) -> list[tuple[_Key, int]]:
        """(job, attempt, rank) and pid of every process still watched."""
        with self._lock:
            return sorted((k, w.hb.pid) for k, w in self._ranks.items() if not w.gone)

    # -- one round ------------------------------------------------------------------------------

    def _read_launches(self) -> None:
        """Watch the ranks the launch file lists for this node, when it changed since the last
        look (a missing file is not an error: the launcher writes it after it started them)."""
        if self.launch_file is None:
            return
        try:
            st = self.launch_file.stat()
        except FileNotFoundError:
            return
        except OSError as exc:
            self._launch_failed(f"cannot read {self.launch_file}: {exc}")
            return
        seen = (st.st_mtime_ns, st.st_size)
        if seen == self._launch_seen:
            return
        try:
            attempt, ranks = read_launch_file(self.launch_file, job=self.job, node=self.node)
        except (OSError, ValueError) as exc:
            self._launch_failed(str(exc))
            return
        self._launch_seen, self._launch_error = seen, ""
        for rank, pid, start in ranks:
            self.expect(job=JobId(self.job), attempt=attempt, node=self.node, rank=rank,
                        pid=pid, start_ticks=start)

    def _launch_failed(self, why: str) -> None:
        if why != self._launch_error:
            self._launch_error = why
            self.log.warning("launch file ignored until it changes: %s", why)

    def tick(self) -> None:
        """One round: read every watched process, emit the samples, capture the due stacks."""
        self._read_launches()
        work = self._sample()
        if self.capturing:
            self._capture_due(work)

    def last_look(self) -> None:
        """One more round of samples, no stacks, once the thread is stopped: a rank that ended
        since the last round is reported gone before the agent ships its last records (a
        launcher that stops the agent as soon as its ranks exit would leave them unreported, and
        a watcher could not tell that they exited). Never raises."""
        if not self.sampling:
            return
        try:
            self._sample()
        except Exception as exc:
            self.log.warning("last process round failed: %r", exc)

    def _sample(self) -> list[tuple[_Key, _Watched, int]]:
        """Read every watched process and emit the samples; the processes read."""
        with self._lock:
            work = [(k, w, w.hb.pid) for k, w in self._ranks.items() if not w.gone]
        samples: list[Record] = []
        for key, watched, pid in work:
            try:
                reading = self.reader.read(pid)
            except Exception as exc:
                if not watched.read_failed:
                    watched.read_failed = True
                    watched.log.warning("cannot read /proc of pid %d (logged once): %r", pid, exc)
                continue
            now = self.clock()
            with self._lock:
                if self._ranks.get(key) is not watched or watched.hb.pid != pid or watched.gone:
                    continue  # replaced or dropped while it was read
                sample = self._account(watched, reading, now)
            if self.sampling:
                samples.append(sample)
        if samples and self._emit(samples):
            self.stats.process_samples += len(samples)
        return work

    def _account(self, watched: _Watched, reading: ProcReading | None, now: int) -> ProcessSample:
        hb, previous = watched.hb, watched.previous
        started = previous.start_ticks if previous is not None else watched.start_ticks
        reused = started is not None and reading is not None and reading.start_ticks != started
        if reading is None or reused:
            watched.gone = True
            watched.log.info("pid %d is gone: no longer watched", hb.pid)
            return ProcessSample(
                job=hb.job, attempt=hb.attempt, node=hb.node, rank=hb.rank, pid=hb.pid,
                time_us=now, state=ProcessState.GONE.value,
                cpu_s=previous.cpu_s if previous else 0.0, cpu_rate=0.0,
                read_bytes=previous.read_bytes if previous else 0,
                write_bytes=previous.write_bytes if previous else 0, io_rate=0.0,
            )
        cpu_rate = io_rate = 0.0
        if previous is not None and now > watched.previous_us:
            elapsed = (now - watched.previous_us) / 1e6
            cpu_rate = max(0.0, (reading.cpu_s - previous.cpu_s) / elapsed)
            if reading.io_known and previous.io_known:
                moved = reading.read_bytes + reading.write_bytes
                moved -= previous.read_bytes + previous.write_bytes
                io_rate = max(0.0, moved / elapsed)
        watched.previous, watched.previous_us = reading, now
        if previous is not None:
            watched.active = cpu_rate >= ACTIVE_CPU_RATE
        return ProcessSample(
            job=hb.job, attempt=hb.attempt, node=hb.node, rank=hb.rank, pid=hb.pid, time_us=now,
            state=reading.state, cpu_s=reading.cpu_s, cpu_rate=cpu_rate,
            read_bytes=reading.read_bytes, write_bytes=reading.write_bytes, io_rate=io_rate,
        )

    def _due(self, watched: _Watched, now: int) -> Suspicion | None:
        """Why to capture this rank's stack now, or None (not suspect, or captured lately)."""
        if not watched.heard:
            return None  # no heartbeat yet: nothing to judge it stuck by
        if not watched.joined_us and watched.hb.groups:
            watched.joined_us = watched.hb.time_us
        why = suspicion(watched.hb, now=now, after_us=round(self.stack_after_s * 1e6),
                        joined_us=watched.joined_us)
        if why is None:
            return None
        last = watched.captured_us
        if last is not None:
            if 0 < watched.failures <= CAPTURE_RETRIES:
                return why if now - last >= self.stack_after_s * 1e6 else None
            if watched.active != watched.captured_active:
                # waiting then computing (or back): the last stack is from before the change
                return why if now - last >= self.stack_after_s * 1e6 else None
            if now - last < self.stack_min_gap_s * 1e6:
                return None
            same = watched.captured_episode == episode(watched.hb)
            if same and now - last < self.stack_repeat_s * 1e6:
                return None
        return why

    def _capture_due(self, work: list[tuple[_Key, _Watched, int]]) -> None:
        spent = 0.0
        for key, watched, pid in work:
            if self._stop.is_set() or spent >= _CAPTURE_BUDGET_S:
                return
            with self._lock:
                if self._ranks.get(key) is not watched or watched.hb.pid != pid or watched.gone:
                    continue
                now = self.clock()
                why = self._due(watched, now)
                if why is None:
                    continue
                watched.captured_us, watched.captured_episode = now, episode(watched.hb)
                watched.captured_active = watched.active
                hb = watched.hb
            started = time.monotonic()
            try:
                frames = self.capturer.capture(pid, cancel=self._stop)
            except Exception as exc:
                if self._stop.is_set():
                    return
                self.stats.stacks_failed += 1
                watched.failures += 1
                self._capture_failed(watched, pid, exc)
                continue
            finally:
                spent += time.monotonic() - started
            watched.failures = 0
            sample = StackSample(
                job=hb.job, attempt=hb.attempt, node=hb.node, rank=hb.rank, time_us=now,
                frames=frames,
            )
            if self._emit([sample]):
                self.stats.stacks_captured += 1
                watched.log.info("stack of pid %d captured (%s), innermost: %s", pid,
                                 why.describe(now), frames[-1] if frames else "no Python frame")

    def _capture_failed(self, watched: _Watched, pid: int, exc: Exception) -> None:
        if self._capture_failure_logged:
            watched.log.debug("no stack of pid %d (%d failures): %s",
                              pid, self.stats.stacks_failed, exc)
            return
        self._capture_failure_logged = True
        watched.log.warning("no stack of pid %d: %s (logged once; failures are counted in "
                            "stacks_failed)", pid, exc)

    def _emit(self, records: list[Record]) -> bool:
        try:
            self.emit(records)
        except Exception as exc:
            self.log.warning("could not spool %d records of the process watcher: %r",
                             len(records), exc)
            return False
        return True

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the sampling thread (nothing to do when sampling and captures are both off)."""
        if self._thread is not None or not (self.sampling or self.capturing):
            return
        self._stop.clear()
        if self.capturing and isinstance(self.capturer, PySpy):
            self.log.info("stacks of ranks stuck for %.1fs via %s", self.stack_after_s,
                          self.capturer.path or "py-spy (not found)")
        self._thread = threading.Thread(
            target=self._run, name="tracehound-node-procwatch", daemon=True
        )
        self._thread.start()

    def stop(self, timeout_s: float = 1.0) -> bool:
        """Stop the thread (a running py-spy is killed); True if it ended within `timeout_s`."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        thread.join(timeout=timeout_s)
        return not thread.is_alive()

    def _run(self) -> None:
        interval = self.proc_interval_s if self.sampling else _TRIGGER_INTERVAL_S
        while not self._stop.wait(interval):
            try:
                self.tick()
            except Exception as exc:
                self.log.exception("process watcher round failed: %r", exc)
