"""Hang and crash detection with localization by control dependency.

A crash is attributed to the first rank that failed: peers of a dead rank fail too (connection
reset) a moment later, so the earliest failure, not the loudest, is the cause.

A hang is declared when a rank that still reports has been inside one collective for
`hang_after_s`, measured on that rank's own clock (so a slow pipeline delays detection but never
invents a hang). Then, per process group, the ranks that never entered the collective the others
wait in are the suspects; following waits-for edges across groups leads to the root: the rank
that waits on nobody. A rank that stopped reporting while its peers wait is a suspect too.

Pure: no I/O, no clock; the snapshot carries the time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import GroupProgress, Heartbeat, IncidentKind, RankExit

_US = 1_000_000


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectionSettings:
    """Thresholds of the detectors."""

    hang_after_s: float = 5.0
    """A rank waiting this long inside one collective means the job hangs. Training steps take
    milliseconds to seconds; raise it for jobs with longer legitimate waits."""
    heartbeat_timeout_s: float = 2.5
    """A rank silent for this long (heartbeats arrive every 0.5 s by default) is not reporting."""
    crash_settle_s: float = 0.3
    """How long after the first failed exit to wait for earlier exits still in flight."""


def _sec(us: int) -> float:
    return round(us / _US, 3)


def _failed(exit_: RankExit) -> bool:
    return exit_.exit_code != 0


def _describe_exit(exit_: RankExit) -> str:
    if exit_.exit_code < 0:
        return f"killed by signal {-exit_.exit_code}"
    return f"exited with code {exit_.exit_code}"


def detect_crash(snap: JobSnapshot, settings: DetectionSettings) -> Verdict | None:
    """The first rank to exit with a failure, once the exits have settled."""
    failures = sorted((e for e in snap.exits if _failed(e)), key=lambda e: (e.time_us, e.rank))
    if not failures:
        return None
    first = failures[0]
    if snap.now_us - first.time_us < settings.crash_settle_s * _US:
        return None
    culprits = [first]
    # Exits within the clock's resolution of each other cannot be ordered: name them all.
    culprits += [e for e in failures[1:] if e.time_us - first.time_us <= 1_000]
    gap_us = (
        failures[len(culprits)].time_us - first.time_us if len(failures) > len(culprits) else None
    )
    if len(culprits) > 1:
        confidence = 0.6
    elif gap_us is None or gap_us >= 20_000 or first.exit_code < 0:
        confidence = 0.95
    else:
        confidence = 0.8
    evidence = tuple(
        Evidence(
            fact=Fact.EXIT,
            rank=e.rank,
            node=e.node,
            detail=(
                f"rank {e.rank} on {e.node} {_describe_exit(e)} "
                f"{_sec(e.time_us - first.time_us):+.3f} s after the first failure"
            ),
            value=float(e.exit_code),
        )
        for e in failures
    )
    ranks = tuple(sorted(e.rank for e in culprits))
    nodes = tuple(sorted({e.node for e in culprits}))
    others = len(failures) - len(culprits)
    summary = (
        f"rank {first.rank} on node {first.node} {_describe_exit(first)} first"
        + (f"; {others} other rank(s) failed after it" if others else "")
    )
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.CRASH, culprit_ranks=ranks,
        culprit_nodes=nodes, confidence=confidence, basis=Basis.EXIT_STATUS, summary=summary,
        evidence=evidence, observed_at_us=snap.now_us,
    )


@dataclass(frozen=True, slots=True)
class _Wait:
    rank: int
    group: str
    seq: int
    op: str
    waited_us: int


def _members(snap: JobSnapshot, beats: dict[int, Heartbeat]) -> dict[str, set[int]]:
    """Group -> global ranks, from group records and from who reports progress in it."""
    members: dict[str, set[int]] = defaultdict(set)
    for info in snap.groups:
        members[info.group].update(info.ranks)
    for hb in beats.values():
        for g in hb.groups:
            members[g.group].add(hb.rank)
    return members


def _progress(hb: Heartbeat | None, group: str) -> GroupProgress | None:
    if hb is None:
        return None
    for g in hb.groups:
        if g.group == group:
            return g
    return None


def detect_hang(snap: JobSnapshot, settings: DetectionSettings) -> Verdict | None:
    """A stall localized by control dependency (see the module docstring)."""
    beats: dict[int, Heartbeat] = {int(hb.rank): hb for hb in snap.heartbeats}
    exited = {e.rank for e in snap.exits}
    silent_after_us = snap.now_us - int(settings.heartbeat_timeout_s * _US)
    hang_us = int(settings.hang_after_s * _US)

    stalled: list[_Wait] = []
    for hb in beats.values():
        if hb.rank in exited or hb.time_us < silent_after_us:
            continue
        for g in hb.groups:
            if g.pending_op and hb.time_us - g.last_enqueue_us >= hang_us:
                stalled.append(
                    _Wait(hb.rank, g.group, g.last_enqueued, g.pending_op,
                          hb.time_us - g.last_enqueue_us)
                )
    if not stalled:
        return None

    members = _members(snap, beats)
    silent = {
        r for r, hb in beats.items() if r not in exited and hb.time_us < silent_after_us
    }
    expected = set(snap.expected_ranks) | set(beats)
    never_reported = {r for r in expected if r not in beats and r not in exited}

    # waits-for edges: a rank inside a collective waits on every member of that group that has
    # not entered it yet. Every pending rank contributes edges, not only those past the hang
    # threshold: a rank that entered the stalled collective's predecessor a moment later than
    # its peers waits there too, and the chain must run through it to the root.
    edges: dict[int, set[int]] = defaultdict(set)
    for rank, hb in beats.items():
        if rank in exited:
            continue
        for g in hb.groups:
            if not g.pending_op:
                continue
            for member in members.get(g.group, set()):
                progress = _progress(beats.get(member), g.group)
                if (progress.last_enqueued if progress else 0) < g.last_enqueued:
                    edges[rank].add(member)
    evidence: list[Evidence] = []
    lag_facts: dict[int, Evidence] = {}
    stalled_groups: dict[str, int] = {}
    for wait in stalled:
        stalled_groups[wait.group] = max(stalled_groups.get(wait.group, 0), wait.seq)
    for group, seq in stalled_groups.items():
        waiting = sorted(w.rank for w in stalled if w.group == group)
        for member in sorted(members.get(group, set())):
            progress = _progress(beats.get(member), group)
            reached = progress.last_enqueued if progress else 0
            if reached >= seq:
                continue
            if member not in lag_facts:
                where = "never reported" if member not in beats else f"last entered #{reached}"
                lag_facts[member] = Evidence(
                    fact=Fact.LAGGING, rank=member, node=snap.node_of(member), group=group,
                    seq=seq, value=float(seq - reached),
                    detail=(
                        f"rank {member} on node {snap.node_of(member)} never entered "
                        f"collective #{seq} of group {group} ({where}); "
                        f"{len(waiting)} rank(s) wait on it"
                    ),
                )
    for wait in sorted(stalled, key=lambda w: -w.waited_us)[:8]:
        evidence.append(
            Evidence(
                fact=Fact.WAITING, rank=wait.rank, node=snap.node_of(wait.rank),
                group=wait.group, seq=wait.seq, value=_sec(wait.waited_us),
                detail=(
                    f"rank {wait.rank} has waited {_sec(wait.waited_us):.1f} s in "
                    f"{wait.op} #{wait.seq} of group {wait.group}"
                ),
            )
        )

    roots = _roots(edges, {w.rank for w in stalled})
    silent_facts = [
        Evidence(
            fact=Fact.SILENT, rank=r, node=snap.node_of(r),
            value=_sec(snap.now_us - beats[r].time_us),
            detail=(
                f"rank {r} on node {snap.node_of(r)} has sent no heartbeat for "
                f"{_sec(snap.now_us - beats[r].time_us):.1f} s while its peers wait"
            ),
        )
        for r in sorted(silent)
    ]
    missing_facts = [
        Evidence(fact=Fact.MISSING, rank=r, node=snap.node_of(r),
                 detail=f"rank {r} on node {snap.node_of(r)} never reported")
        for r in sorted(never_reported)
    ]

    if roots:
        culprits = roots
        basis = Basis.CONTROL_DEPENDENCY
        corroborated = culprits & (silent | never_reported)
        confidence = 0.95 if corroborated == culprits else 0.85
    elif silent or never_reported:
        culprits = silent | never_reported
        basis = Basis.HEARTBEAT_LOSS
        confidence = 0.75
    else:
        culprits = set().union(*(members.get(g, set()) for g in stalled_groups))
        basis = Basis.UNLOCALIZED
        confidence = 0.3

    evidence = [lag_facts[r] for r in sorted(lag_facts)] + silent_facts + missing_facts + evidence
    ranks = tuple(sorted(culprits))
    nodes = tuple(sorted({snap.node_of(r) for r in ranks}))
    longest = max(stalled, key=lambda w: w.waited_us)
    if basis is Basis.UNLOCALIZED:
        summary = (
            f"{len(stalled)} rank(s) have waited up to {_sec(longest.waited_us):.1f} s in "
            f"{longest.op} #{longest.seq} of group {longest.group}; no rank lags or is silent"
        )
    else:
        who = ", ".join(f"rank {r} on node {snap.node_of(r)}" for r in ranks[:4])
        more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
        summary = (
            f"{who}{more} blocked the job: {len(stalled)} rank(s) have waited up to "
            f"{_sec(longest.waited_us):.1f} s in {longest.op} #{longest.seq} of group "
            f"{longest.group}"
        )
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.HANG, culprit_ranks=ranks,
        culprit_nodes=nodes, confidence=confidence, basis=basis, summary=summary,
        evidence=tuple(evidence), observed_at_us=snap.now_us,
    )


def _roots(edges: dict[int, set[int]], start: set[int]) -> set[int]:
    """Ranks reachable from `start` over waits-for edges that wait on nobody; where the reachable
    ranks only wait on each other (a cycle), all of them."""
    reached: set[int] = set()
    frontier = [t for s in start for t in edges.get(s, ())]
    while frontier:
        rank = frontier.pop()
        if rank in reached:
            continue
        reached.add(rank)
        frontier.extend(edges.get(rank, ()))
    roots = {r for r in reached if not edges.get(r)}
    return roots or reached


def diagnose(snap: JobSnapshot, settings: DetectionSettings | None = None) -> Verdict | None:
    """The verdict for a snapshot, or None while nothing is wrong. Crashes are checked first: a
    dead rank also stalls its peers, and its exit is the stronger evidence."""
    settings = settings or DetectionSettings()
    return detect_crash(snap, settings) or detect_hang(snap, settings)


def first(verdicts: Iterable[Verdict | None]) -> Verdict | None:
    return next((v for v in verdicts if v is not None), None)
