"""`tracehound stacks --job J`: the Python stacks of a job's ranks on this machine, grouped.

For a silent hang (no rank lags in collectives, nobody is gone, the job just stopped moving):
every local rank's stack is captured with `py-spy dump --nonblocking` (the process is never
paused), reduced to its innermost frames, and the ranks are grouped by identical stacks, largest
group first. Stuck ranks wait in a few large groups (the same wait in the same collective); a
smaller group is where the odd ones out are, and its ranks are the suspects.

Which processes are the job's ranks here: `/proc` first. A process whose environment has
TRACEHOUND_JOB_ID=J and RANK is a rank of J (its attempt from TRACEHOUND_ATTEMPT, else
TORCHELASTIC_RESTART_COUNT, else 0; only the newest attempt is kept). This needs neither the
store nor the ranks' heartbeats, so it works when a hung rank stopped reporting and when the
store is down; a child that inherited the environment (a data loader worker, a process under a
wrapper shell) is told from the rank by its parent. Only when `/proc` shows no such process (the
job id came from elsewhere, or the environments are not readable) are the newest heartbeats of
the job's latest attempt read from the store, and a heartbeat's pid is taken only if a process
with that pid exists here and started before the heartbeat was sent (a reused pid started
later). With `--save`, the stacks are also written to the store as `StackSample` records, for
the analysis and the dashboard.

This only reads processes from outside; it must never stop, signal or slow a rank.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracehound.agent.node.procwatch import (
    PySpy,
    StackCaptureError,
    StackCapturer,
    find_py_spy,
)
from tracehound.agent.sources.procfs import parse_environ
from tracehound.tracing.events import Batch, Heartbeat, StackSample, now_us
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.settings import (
    TRACEHOUND_ATTEMPT,
    TRACEHOUND_JOB_ID,
    TRACEHOUND_NODE_ID,
    TRACEHOUND_STORE,
)

DEFAULT_FRAMES = 3
"""Innermost frames two stacks must share to be grouped (the analysis's `stack_frames`)."""

EPILOG = """\
Finds the job's ranks on this machine (processes with TRACEHOUND_JOB_ID=J and RANK in their
environment; else the pids of the job's newest heartbeats in the store), captures each one's
Python stack with py-spy --nonblocking (the ranks are never paused) and groups the ranks by their
innermost frames, largest group first: the ranks of a small group are the odd ones out.
Exit status: 0 when stacks were captured, 1 when the job has no rank here or no stack could be
captured, 2 for bad usage or a store that cannot be used.

examples:
  tracehound stacks --job exp7
  tracehound stacks --job exp7 --frames 5 --json
  tracehound stacks --job exp7 --save --store clickhouse://default:@db:9000/tracehound
"""


def add_parser(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `stacks` command to the CLI's subparsers."""
    p = sub.add_parser(
        "stacks", help="capture and group the Python stacks of a job's ranks on this machine",
        description="Capture the Python stack of every rank of a job running on this machine\n"
                    "(py-spy, without pausing them) and group the ranks by identical stacks,\n"
                    "largest group first: in a silent hang, the ranks of the smallest group are\n"
                    "the suspects.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--job", required=True, help="job id (the ranks' TRACEHOUND_JOB_ID)")
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES, metavar="K",
                   help="group ranks whose innermost K frames are identical "
                        f"(default: {DEFAULT_FRAMES})")
    p.add_argument("--py-spy", metavar="PATH",
                   help="py-spy binary (default: on PATH, else beside this Python)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="give up on one rank's stack after this many seconds (default: 5)")
    p.add_argument("--save", action="store_true",
                   help="also write the stacks to the store as stack samples")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    store_arg(p)
    p.set_defaults(handler=cmd_stacks)


# -- finding the ranks ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LocalRank:
    """A process of a rank of the job on this machine."""

    rank: int
    pid: int
    attempt: int
    node: str
    """The rank's node id (its TRACEHOUND_NODE_ID or heartbeat node; else this host's name)."""


@dataclass(frozen=True, slots=True)
class _Proc:
    pid: int
    ppid: int
    comm: str
    start_ticks: int
    env: Mapping[str, str]


def _read_proc(root: Path, pid: int) -> _Proc | None:
    base = root / str(pid)
    try:
        stat = (base / "stat").read_bytes().decode(errors="replace")
        raw_env = (base / "environ").read_bytes()
    except OSError:
        return None  # gone, or not ours to read
    close = stat.rfind(")")
    fields = stat[close + 1:].split()
    if close < 0 or len(fields) < 20:
        return None
    env = parse_environ(raw_env)
    comm = stat[stat.find("(") + 1:close]
    return _Proc(pid=pid, ppid=int(fields[1]), comm=comm, start_ticks=int(fields[19]), env=env)


def _attempt(env: Mapping[str, str]) -> int:
    value = env.get(TRACEHOUND_ATTEMPT) or env.get("TORCHELASTIC_RESTART_COUNT") or "0"
    return int(value) if value.isdigit() else 0


def _ancestors(root: Path, pid: int) -> set[int]:
    out: set[int] = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            stat = (root / str(pid) / "stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rfind(")") + 1:].split()[1])
    return out


def find_in_proc(job: str, *, proc_root: str | os.PathLike[str] = "/proc",
                 host: str | None = None) -> list[LocalRank]:
    """The job's ranks among this machine's processes (see the module docstring), by rank."""
    root = Path(proc_root)
    me = _ancestors(root, os.getpid()) if Path(proc_root) == Path("/proc") else set()
    found: list[_Proc] = []
    for entry in root.iterdir():
        if not entry.name.isdigit() or int(entry.name) in me:
            continue
        proc = _read_proc(root, int(entry.name))
        if proc is None or proc.env.get(TRACEHOUND_JOB_ID) != job:
            continue
        if proc.env.get("RANK", "").isdigit():
            found.append(proc)
    if not found:
        return []
    newest = max(_attempt(p.env) for p in found)
    by_rank: dict[int, list[_Proc]] = {}
    for p in found:
        if _attempt(p.env) == newest:
            by_rank.setdefault(int(p.env["RANK"]), []).append(p)
    out: list[LocalRank] = []
    for rank, procs in sorted(by_rank.items()):
        proc = _the_rank(procs)
        node = proc.env.get(TRACEHOUND_NODE_ID) or host or socket.gethostname()
        out.append(LocalRank(rank=rank, pid=proc.pid, attempt=newest, node=node))
    return out


def _is_python(proc: _Proc) -> bool:
    return proc.comm.startswith(("python", "pt_main_thread")) or "python" in proc.comm


def _the_rank(procs: list[_Proc]) -> _Proc:
    """Of the processes that claim one rank, the rank itself: the topmost one (its children are
    data loader workers and the like), or the only child of a topmost wrapper that is not
    Python (a shell running the script)."""
    pids = {p.pid for p in procs}
    tops = sorted((p for p in procs if p.ppid not in pids), key=lambda p: p.start_ticks)
    top = tops[0] if tops else procs[0]
    children = [p for p in procs if p.ppid == top.pid]
    if not _is_python(top) and len(children) == 1:
        return children[0]
    return top


def _boot_time_s(proc_root: Path) -> float:
    for line in (proc_root / "stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError(f"no btime in {proc_root / 'stat'}")


def alive_from_heartbeats(heartbeats: Iterable[Heartbeat], *,
                          proc_root: str | os.PathLike[str] = "/proc") -> list[LocalRank]:
    """The heartbeats' ranks whose process runs here: a process with the heartbeat's pid that
    started before the heartbeat was sent (a pid reused since then started later)."""
    root = Path(proc_root)
    ticks = os.sysconf("SC_CLK_TCK")
    try:
        boot = _boot_time_s(root)
    except OSError:
        return []
    out: list[LocalRank] = []
    for hb in heartbeats:
        try:
            stat = (root / str(hb.pid) / "stat").read_text()
        except OSError:
            continue
        started_s = boot + int(stat[stat.rfind(")") + 1:].split()[19]) / ticks
        if started_s * 1e6 <= hb.time_us + 1e6:  # a second for rounding of btime
            out.append(LocalRank(rank=int(hb.rank), pid=hb.pid, attempt=hb.attempt,
                                 node=str(hb.node)))
    return sorted(out, key=lambda r: r.rank)


# -- capturing and grouping -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Captured:
    rank: LocalRank
    frames: tuple[str, ...] = ()
    error: str = ""
    time_us: int = 0


def capture_all(ranks: Sequence[LocalRank], capturer: StackCapturer, *,
                clock: Callable[[], int] = now_us, workers: int = 8) -> list[Captured]:
    """Each rank's stack (or why there is none), captured concurrently, in the ranks' order."""
    cancel = threading.Event()

    def one(r: LocalRank) -> Captured:
        when = clock()
        try:
            return Captured(rank=r, frames=capturer.capture(r.pid, cancel=cancel), time_us=when)
        except StackCaptureError as exc:
            return Captured(rank=r, error=str(exc), time_us=when)

    if not ranks:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(ranks)))) as pool:
        try:
            return list(pool.map(one, ranks))
        except BaseException:
            cancel.set()
            raise


@dataclass(frozen=True, slots=True, kw_only=True)
class StackGroup:
    signature: tuple[str, ...]
    """The innermost frames the members share, outermost of them first."""
    members: tuple[Captured, ...]
    suspect: bool = False
    """Smaller than the largest group: its ranks are the odd ones out."""

    @property
    def ranks(self) -> list[int]:
        return [c.rank.rank for c in self.members]


def group_stacks(captured: Iterable[Captured], frames: int) -> list[StackGroup]:
    """Ranks grouped by their innermost `frames` frames, largest group first (then lowest rank).
    Every group smaller than the largest is a suspect (none when all are the same size)."""
    k = max(1, frames)
    by_sig: dict[tuple[str, ...], list[Captured]] = {}
    for c in captured:
        if not c.error:
            by_sig.setdefault(c.frames[-k:], []).append(c)
    ordered = sorted(by_sig.items(), key=lambda kv: (-len(kv[1]), min(c.rank.rank for c in kv[1])))
    largest = len(ordered[0][1]) if ordered else 0
    return [StackGroup(signature=sig, members=tuple(members), suspect=len(members) < largest)
            for sig, members in ordered]


# -- the command ----------------------------------------------------------------------------------


@dataclass
class _Found:
    ranks: list[LocalRank]
    how: str
    notes: list[str] = field(default_factory=list)


def _find(job: str, store_url: str | None) -> _Found:
    ranks = find_in_proc(job)
    if ranks:
        return _Found(ranks, "process environments")
    notes = [f"no process here has {TRACEHOUND_JOB_ID}={job} and RANK in its environment "
             "(or their environments are not readable by this user)"]
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.errors import StoreError
    from tracehound.tracing.store import open_store
    from tracehound.tracing.store.urls import embedded_path, is_embedded

    url = resolve_store_url(store_url)
    if not store_url and not os.environ.get(TRACEHOUND_STORE) and is_embedded(url) and (
            not Path(embedded_path(url)).exists()):
        notes.append(f"no store to read heartbeats from ({url} does not exist; give --store)")
        return _Found([], "", notes)
    try:
        store = open_store(url, create=False)
        try:
            attempts = store.attempts(JobId(job))
            beats = store.latest_heartbeats(JobId(job), attempts[-1]) if attempts else []
        finally:
            store.close()
    except StoreError as exc:
        notes.append(f"could not read heartbeats from the store: {exc}")
        return _Found([], "", notes)
    if not beats:
        notes.append(f"the store {store.url} has no heartbeats of job {job}")
        return _Found([], "", notes)
    ranks = alive_from_heartbeats(beats)
    if not ranks:
        pids = ", ".join(str(hb.pid) for hb in beats[:8])
        notes.append(f"none of the pids of its latest heartbeats (attempt {beats[0].attempt}: "
                     f"{pids}{', ...' if len(beats) > 8 else ''}) runs here")
    return _Found(ranks, f"heartbeats in {store.url}", notes)


def _save(url: str | None, job: str, captured: Sequence[Captured]) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store

    records = tuple(
        StackSample(job=JobId(job), attempt=c.rank.attempt, node=NodeId(c.rank.node),
                    rank=Rank(c.rank.rank), time_us=c.time_us, frames=c.frames)
        for c in captured if not c.error
    )
    if not records:
        return 0
    store = open_store(resolve_store_url(url))
    try:
        store.insert(Batch(batch_id=f"stacks-{uuid.uuid4().hex}", records=records))
    finally:
        store.close()
    return len(records)


def _report(job: str, found: _Found, captured: Sequence[Captured], groups: Sequence[StackGroup],
            frames: int) -> dict[str, Any]:
    first = found.ranks[0]
    return {
        "job": job,
        "attempt": first.attempt,
        "nodes": sorted({r.node for r in found.ranks}),
        "found_by": found.how,
        "frames": frames,
        "ranks": [{"rank": r.rank, "pid": r.pid, "node": r.node} for r in found.ranks],
        "groups": [
            {"ranks": g.ranks, "pids": [c.rank.pid for c in g.members], "suspect": g.suspect,
             "signature": list(g.signature), "stack": list(g.members[0].frames)}
            for g in groups
        ],
        "suspects": sorted(r for g in groups if g.suspect for r in g.ranks),
        "failed": [{"rank": c.rank.rank, "pid": c.rank.pid, "error": c.error}
                   for c in captured if c.error],
    }


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_report(report: Mapping[str, Any]) -> str:
    """The report as text: one block per group, largest first, suspects marked."""
    groups = report["groups"]
    lines = [
        f"job {report['job']} attempt {report['attempt']} on {', '.join(report['nodes'])}: "
        f"{_plural(len(report['ranks']), 'rank')} (found by {report['found_by']}), "
        f"{_plural(len(groups), 'distinct stack')} (innermost {report['frames']} frames)",
    ]
    for g in groups:
        mark = "   <- differs from the majority: suspect" if g["suspect"] else ""
        pids = ", ".join(str(p) for p in g["pids"])
        lines.append("")
        lines.append(f"{_plural(len(g['ranks']), 'rank')} {g['ranks']} (pid {pids}){mark}")
        hidden = len(g["stack"]) - len(g["signature"])
        if hidden > 0:
            lines.append(f"    ... {_plural(hidden, 'outer frame')} (of rank {g['ranks'][0]})")
        lines.extend(f"    {frame}" for frame in g["signature"])
        if not g["signature"]:
            lines.append("    (no Python frame)")
    for f in report["failed"]:
        lines.append("")
        lines.append(f"rank {f['rank']} (pid {f['pid']}): no stack: {f['error']}")
    if report["suspects"]:
        lines.append("")
        lines.append(f"suspects: ranks {report['suspects']}")
    elif len(groups) == 1 and len(report["ranks"]) > 1 and not report["failed"]:
        lines.append("")
        lines.append("all ranks are at the same place: no odd one out")
    return "\n".join(lines)


def cmd_stacks(args: argparse.Namespace) -> int:
    if args.frames < 1:
        raise ValueError(f"--frames must be at least 1, got {args.frames}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    found = _find(args.job, args.store)
    if not found.ranks:
        reasons = "; ".join(found.notes)
        print(f"tracehound stacks: no rank of job {args.job} runs on this machine "
              f"({socket.gethostname()}): {reasons}", file=sys.stderr)
        return 1
    capturer = PySpy(find_py_spy(args.py_spy), timeout_s=args.timeout)
    started = time.monotonic()
    captured = capture_all(found.ranks, capturer)
    groups = group_stacks(captured, args.frames)
    report = _report(args.job, found, captured, groups, args.frames)
    report["capture_s"] = round(time.monotonic() - started, 3)
    if args.save:
        report["saved"] = _save(args.store, args.job, captured)
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
        if args.save:
            print(f"\n{_plural(report['saved'], 'stack sample')} written to the store")
    if not groups:
        print(f"tracehound stacks: no stack of the {_plural(len(found.ranks), 'rank')} of job "
              f"{args.job} could be captured (see the errors above)", file=sys.stderr)
        return 1
    return 0
