"""Hang and crash detection with localization by control dependency.

A crash is attributed to the first rank that failed: peers of a dead rank fail too (connection
reset) a moment later, so the earliest failure, not the loudest, is the cause.

A hang is declared when a rank that still reports has been inside one collective for
`hang_after_s`, measured on that rank's own clock (so a slow pipeline delays detection but never
invents a hang). Then, per process group, the ranks that never entered the collective the others
wait in are the suspects; following waits-for edges across groups leads to the root: the rank
that waits on nobody. A rank that stopped reporting while its peers wait is a suspect too.

A rank with nothing traced pending whose stack, taken since its last progress, shows it inside a
collective (`liveness.collective_wait`: one the recorder does not see, e.g. a compiled graph's)
waits too, in a collective of unknown group: on every other rank of the job. The chain then runs
through it to the ranks that wait on nobody (frozen or busy ones), and the evidence says that it
waits where the trace does not show. Where the chain only returns to waiting ranks, the hang is
not localized; such a cycle counts only once each of its ranks has waited `hang_after_s`
(before that, it is reports sent at different moments, not a deadlock).

The waits-for graph is never built edge by edge: the ranks a pending collective (group, seq)
waits on are computed once per (group, seq) and expanded once, so a hang of 10,000 ranks in
groups of hundreds costs O(ranks x groups), not O(ranks x group size).

Pure: no I/O, no clock; the snapshot carries the time.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import msgspec

from tracehound.analysis.clocks import ClockEstimate
from tracehound.analysis.common import group_members, ordered_nodes, rank_nodes
from tracehound.analysis.confidence import CERTAIN, LIKELY, STRONG, UNSURE, WEAK
from tracehound.analysis.liveness import (
    RankLife,
    assess,
    collective_wait,
    fresh_stack,
    last_activity_us,
    process_words,
    stack_wait,
    where_words,
)
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import (
    EXIT_UNKNOWN,
    Heartbeat,
    IncidentKind,
    RankExit,
    StackSample,
)

_US = 1_000_000

def _sec(us: int) -> float:
    return round(us / _US, 3)


def _failed(exit_: RankExit) -> bool:
    return exit_.exit_code != 0


def _describe_exit(exit_: RankExit) -> str:
    if exit_.exit_code == EXIT_UNKNOWN:
        return "ended while no controller watched it (how is not known)"
    if exit_.exit_code < 0:
        return f"killed by signal {-exit_.exit_code}"
    return f"exited with code {exit_.exit_code}"


def _last_collective(hb: Heartbeat, exit_: RankExit) -> Evidence | None:
    """Where the rank was in its collectives when it last reported, from its last heartbeat."""
    entered = [g for g in hb.groups if g.last_enqueued > 0]
    if not entered:
        return None
    last = max(entered, key=lambda g: (g.last_enqueue_us, g.last_enqueued))
    ago = _sec(exit_.time_us - hb.time_us)
    if last.pending_op:
        detail = (
            f"rank {exit_.rank} on node {exit_.node} was inside {last.pending_op} "
            f"#{last.last_enqueued} of group {last.group} when it last reported, {ago:.1f} s "
            "before it exited"
        )
        fact = Fact.WAITING
    else:
        detail = (
            f"rank {exit_.rank} on node {exit_.node} had completed collective "
            f"#{last.last_completed} of group {last.group}, its last one, when it last "
            f"reported, {ago:.1f} s before it exited"
        )
        fact = Fact.EXIT
    return Evidence(
        fact=fact, rank=exit_.rank, node=exit_.node, detail=detail, group=last.group,
        seq=last.last_enqueued, value=ago,
    )


def _on_common_clock(exits: Iterable[RankExit], clocks: ClockEstimate | None) -> list[RankExit]:
    """Exits with their times moved onto the job's common clock where their node's offset is
    estimated (exit records are written on the node's own clock)."""
    if clocks is None or not clocks.nodes:
        return list(exits)
    out = []
    for e in exits:
        known = clocks.of(str(e.node))
        if known is None:
            out.append(e)
            continue
        i = clocks.nodes.index(str(e.node))
        correction = known[0] + clocks.drift_ppm[i] * (e.time_us - clocks.ref_us) / _US
        out.append(msgspec.structs.replace(e, time_us=max(0, e.time_us - round(correction))))
    return out


def _clock_error_us(clocks: ClockEstimate | None, *nodes: str) -> float:
    """How uncertain the order of events on `nodes` is from their clocks alone: the sum of the
    two largest uncertainties of the nodes' offsets (nodes without an estimate: 0)."""
    if clocks is None:
        return 0.0
    errors = sorted((k[1] for n in set(nodes) if (k := clocks.of(n)) is not None),
                    reverse=True)
    return float(sum(errors[:2]))


def detect_crash(snap: JobSnapshot, settings: DetectionSettings,
                 clocks: ClockEstimate | None = None) -> Verdict | None:
    """The first rank to exit with a failure, once the exits have settled. With `clocks`,
    exits are ordered on the common clock, and exits closer than the clocks' uncertainty cannot
    be ordered."""
    failures = sorted((e for e in _on_common_clock(snap.exits, clocks) if _failed(e)),
                      key=lambda e: (e.time_us, e.rank))
    if not failures:
        return None
    first = failures[0]
    if snap.now_us - first.time_us < settings.crash.settle_s * _US:
        return None
    culprits = [first]
    # Exits within the clock's resolution of each other cannot be ordered: name them all.
    culprits += [
        e for e in failures[1:]
        if e.time_us - first.time_us <= max(1_000.0, _clock_error_us(clocks, first.node, e.node))
    ]
    gap_us = (
        failures[len(culprits)].time_us - first.time_us if len(failures) > len(culprits) else None
    )
    margin = _clock_error_us(clocks, *(str(e.node) for e in failures[:len(culprits) + 1]))
    if len(culprits) > 1:
        confidence = WEAK  # exits too close to order: one of them failed first
    elif gap_us is None or gap_us >= 20_000 + margin or EXIT_UNKNOWN < first.exit_code < 0:
        confidence = CERTAIN
    else:
        confidence = STRONG  # the next failure followed within 20 ms: its report may lag
    evidence = [
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
        for e in failures[: settings.max_evidence]
    ]
    if clocks is not None and clocks.nodes:
        shown = dict.fromkeys(str(e.node) for e in failures[:3])
        moved = [n for n in shown if (k := clocks.of(n)) is not None and abs(k[0]) >= 1_000]
        if moved:
            evidence.append(Evidence(
                fact=Fact.CLOCK, rank=first.rank, node=first.node,
                value=round(clocks.spread_us() / 1000, 3),
                detail="exit times compared on the common clock: "
                       + "; ".join(f"node {n} {clocks.words(n)}" for n in shown),
            ))
    last_beat = next((hb for hb in snap.heartbeats if hb.rank == first.rank), None)
    last = _last_collective(last_beat, first) if last_beat is not None else None
    if last is not None:
        evidence.append(last)
    ranks = tuple(sorted(e.rank for e in culprits))
    nodes = tuple(sorted({e.node for e in culprits}))
    others = len(failures) - len(culprits)
    where = ""
    if last is not None and last.fact is Fact.WAITING:
        where = f" inside collective #{last.seq} of group {last.group}"
    summary = (
        f"rank {first.rank} on node {first.node} {_describe_exit(first)} first{where}"
        + (f"; {others} other rank(s) failed after it" if others else "")
    )
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.CRASH, culprit_ranks=ranks,
        culprit_nodes=nodes, confidence=confidence, basis=Basis.EXIT_STATUS, summary=summary,
        evidence=tuple(evidence), observed_at_us=snap.now_us,
    )


@dataclass(frozen=True, slots=True)
class _Wait:
    rank: int
    group: str
    seq: int
    op: str
    waited_us: int
    entered_us: int = 0
    """When the waiting rank entered the collective, on its own clock."""


_UNTRACED = ("", 0)
"""The pending key of a rank seen waiting in a collective by its stack alone: it waits on every
other rank of the job (`_WaitsFor.laggards`)."""


class _WaitsFor:
    """The waits-for graph of a snapshot, with edges computed per (group, seq) on demand.

    A rank inside collective `seq` of `group` waits on every member of the group whose highest
    entered sequence id is below `seq` (members that never reported count as 0), and on every
    frozen member, entered or not: a frozen process completes nothing. Frozen ranks themselves
    wait on nobody.

    Except a member that entered `seq` and is frozen by its silence alone (`silent`: no process
    state shows it stopped or gone) while a member that reports has not entered it: the
    collective waits on that one first, and on a loaded machine a healthy rank's heartbeats can
    fall silent for seconds. Its silence stays a fact; it is not made a culprit for it."""

    def __init__(self, beats: Mapping[int, Heartbeat], exited: set[int],
                 members: Mapping[str, frozenset[int]], frozen: frozenset[int],
                 silent: frozenset[int], *, untraced: Iterable[int] = (),
                 everyone: frozenset[int] = frozenset(),
                 recorded: Mapping[tuple[int, str], int] | None = None) -> None:
        self.reached: dict[tuple[int, str], int] = {}
        """How far each rank entered each group: the furthest of its heartbeat and its stored
        records (`JobSnapshot.recorded`, ahead of a heartbeat sent before a burst)."""
        self.beat: dict[tuple[int, str], int] = {}
        """The same by its heartbeat alone."""
        self.pending: dict[int, list[tuple[str, int]]] = {}
        for rank, hb in beats.items():
            for g in hb.groups:
                self.beat[(rank, g.group)] = self.reached[(rank, g.group)] = g.last_enqueued
                if g.pending_op and rank not in exited and rank not in frozen:
                    self.pending.setdefault(rank, []).append((g.group, g.last_enqueued))
        for key, seq in (recorded or {}).items():
            if seq > self.reached.get(key, 0):
                self.reached[key] = seq
        for rank in untraced:  # seen waiting by its stack, in a collective of unknown group
            self.pending.setdefault(rank, []).append(_UNTRACED)
        self._everyone = tuple(sorted(everyone))
        self._members = members
        self._frozen = frozen
        self._silent = silent
        self._lag: dict[tuple[str, int], tuple[int, ...]] = {}

    def entered(self, rank: int, group: str) -> int:
        return self.reached.get((rank, group), 0)

    def by_records(self, rank: int, group: str) -> bool:
        """Whether how far `rank` entered `group` comes from its stored records (they are
        ahead of its heartbeat): they say what it completed, not whether it entered the next
        call."""
        return self.entered(rank, group) > self.beat.get((rank, group), 0)

    def laggards(self, group: str, seq: int) -> tuple[int, ...]:
        key = (group, seq)
        if key == _UNTRACED:
            return self._everyone
        found = self._lag.get(key)
        if found is None:
            members = self._members.get(group, ())
            behind = {m for m in members if self.reached.get((m, group), 0) < seq}
            awaited = any(m not in self._frozen for m in behind)
            found = tuple(
                m for m in members
                if m in behind or (m in self._frozen and not (awaited and m in self._silent))
            )
            self._lag[key] = found
        return found

    def waits_on_someone(self, rank: int) -> bool:
        return any(
            any(m != rank for m in self.laggards(g, s)) for g, s in self.pending.get(rank, ())
        )

    def roots(self, start: Iterable[int]) -> tuple[set[int], bool]:
        """Ranks reachable from `start` that wait on nobody, and True; where the reachable ranks
        only wait on each other (a cycle), all of them, and False."""
        expanded: set[tuple[str, int]] = set()
        reached: set[int] = set()
        frontier: list[int] = []

        def expand(rank: int) -> None:
            for key in self.pending.get(rank, ()):
                if key not in expanded:
                    expanded.add(key)
                    frontier.extend(self.laggards(*key))

        for rank in start:
            expand(rank)
        while frontier:
            rank = frontier.pop()
            if rank in reached:
                continue
            reached.add(rank)
            expand(rank)
        roots = {r for r in reached if not self.waits_on_someone(r)}
        return (roots, True) if roots else (reached, False)


def _stuck_us(hb: Heartbeat | None) -> int:
    """How long a reporting rank has been inside its longest-pending operation (own clock)."""
    if hb is None:
        return 0
    return max((hb.time_us - g.last_enqueue_us for g in hb.groups if g.pending_op), default=0)


def _waiting_facts(stalled: Iterable[_Wait], node_of: Callable[[int], str]) -> list[Evidence]:
    """The ranks that have waited longest in a stalled collective (at most 8): the reach of a
    hang or stall, after the facts about its culprits."""
    return [
        Evidence(
            fact=Fact.WAITING, rank=wait.rank, node=node_of(wait.rank),
            group=wait.group, seq=wait.seq, value=_sec(wait.waited_us),
            detail=(
                f"rank {wait.rank} has waited {_sec(wait.waited_us):.1f} s in "
                f"{wait.op} #{wait.seq} of group {wait.group}"
            ),
        )
        for wait in sorted(stalled, key=lambda w: (-w.waited_us, w.rank))[:8]
    ]


def _since_us(hb: Heartbeat | None) -> int:
    """The rank's last activity on its own clock (0 without a heartbeat): a stack is fresh from
    then on."""
    return last_activity_us(hb) if hb is not None else 0


def detect_hang(snap: JobSnapshot, settings: DetectionSettings) -> Verdict | None:
    """A stall localized by control dependency (see the module docstring), judged by what the
    ranks it leads to are doing (`analysis.liveness`): frozen or stuck ranks make a hang at
    once; busy ones a stall, and a hang only once peers have waited the busy grace."""
    beats: dict[int, Heartbeat] = {int(hb.rank): hb for hb in snap.heartbeats}
    exited = {int(e.rank) for e in snap.exits}
    silent_after_us = snap.now_us - int(settings.hang.heartbeat_timeout_s * _US)
    hang_us = int(settings.hang.after_s * _US)

    stalled: list[_Wait] = []
    for hb in beats.values():
        if hb.rank in exited or hb.time_us < silent_after_us:
            continue
        for g in hb.groups:
            if g.pending_op and hb.time_us - g.last_enqueue_us >= hang_us:
                stalled.append(
                    _Wait(hb.rank, g.group, g.last_enqueued, g.pending_op,
                          hb.time_us - g.last_enqueue_us, g.last_enqueue_us)
                )
    if not stalled:
        return None

    nodes = rank_nodes(snap)

    def node_of(rank: int) -> str:
        return nodes.get(rank, "unknown")

    members = group_members(snap)
    expected = set(snap.expected_ranks) | set(beats)
    lives = assess(snap, heartbeat_timeout_s=settings.hang.heartbeat_timeout_s,
                   ranks={r: beats.get(r) for r in expected})
    frozen = frozenset(r for r, life in lives.items() if life.frozen)
    stuck_us = {r: _stuck_us(hb) for r, hb in beats.items()}
    silent = {r for r in frozen if r in beats}
    never_reported = {r for r in frozen if r not in beats}

    # waits-for edges: a rank inside a collective waits on every member of that group that has
    # not entered it yet, and on its frozen members. Every pending rank contributes edges, not
    # only those past the hang threshold: a rank that entered the stalled collective's
    # predecessor a moment later than its peers waits there too, and the chain must run
    # through it to the root.
    silent_only = frozenset(r for r in silent if lives[r].strength[0] == 1)
    untraced: dict[int, StackSample] = {}
    for r, hb in beats.items():
        life = lives.get(r)
        if life is None or life.frozen or r in exited or any(g.pending_op for g in hb.groups):
            continue
        stack = stack_wait(life, last_activity_us(hb))
        if stack is not None:
            untraced[r] = stack
    graph = _WaitsFor(beats, exited, members, frozen, silent_only, untraced=untraced,
                      everyone=frozenset(r for r in expected if r not in exited),
                      recorded=snap.recorded)
    roots, acyclic = graph.roots(w.rank for w in stalled)
    if not acyclic and untraced:
        roots = set()  # waiters waiting on waiters, some where no trace shows: not localized
    elif not acyclic and any(stuck_us.get(r, 0) < hang_us for r in roots):
        # Waiters waiting on each other, one of them only a moment: every member of a deadlock
        # waits on for good, so the cycle is a view of reports sent at different moments (a
        # waiter's last heartbeat from just before its collective completed, beside a peer that
        # has moved on to the next one and was never seen in the first, as a backend's group
        # `<group>:c10d` shows only its members that waited). The next look shows which.
        return None

    stalled_groups: dict[str, int] = {}
    for wait in stalled:
        stalled_groups[wait.group] = max(stalled_groups.get(wait.group, 0), wait.seq)
    waiting_in = Counter(w.group for w in stalled)
    lag_facts: dict[int, Evidence] = {}
    for group, seq in stalled_groups.items():
        for member in graph.laggards(group, seq):
            if member in lag_facts:
                continue
            reached = graph.entered(member, group)
            where = _reach_words(graph, member, group, reported=member in beats)
            by_records = graph.by_records(member, group)
            if reached < seq:
                head = (f"{'was not seen entering' if by_records else 'never entered'} "
                        f"collective #{seq} of group {group} ({where}); ")
            elif by_records:
                head = f"completed collective #{seq} of group {group} ({where}), then froze; "
            else:
                head = f"entered collective #{seq} of group {group} and froze there; "
            elsewhere = untraced.get(member)
            lag_facts[member] = Evidence(
                fact=Fact.LAGGING, rank=member, node=node_of(member), group=group,
                seq=seq, value=float(max(seq - reached, 0)),
                detail=(
                    f"rank {member} on node {node_of(member)} " + head
                    + _stuck_words(beats, member, group,
                                   recorded=snap.recorded.get((member, group), 0))
                    + f"{waiting_in[group]} rank(s) wait on it"
                    + ("" if elsewhere is None else
                       "; it waits itself, in a collective the trace does not show ("
                       + collective_wait(elsewhere.frames) + ")")
                ),
            )
    longest = max(stalled, key=lambda w: w.waited_us)

    # What the roots are doing decides between a hang now and a stall.
    busy: list[int] = []
    hard: list[int] = []
    for r in roots:
        life = lives.get(r)
        if (r in exited or life is None or life.frozen or not acyclic
                or stuck_us.get(r, 0) >= hang_us):
            hard.append(r)
        else:
            busy.append(r)
    # A root frozen by its silence alone that had entered the collective its peers wait in is
    # one of the waiters whose reports come late (a loaded machine, a busy node agent), not a
    # cause, when another root explains the hang: one that never entered it, or whose process
    # is stopped or gone (a CI run named two such ranks beside a stopped one).
    explained = [r for r in hard if r in exited
                 or (r in lag_facts and lag_facts[r].value > 0)
                 or (r in lives and lives[r].frozen and lives[r].strength[0] == 0)]
    late = {r for r in hard if r in silent_only and r not in explained
            and r in lag_facts and lag_facts[r].value == 0} if explained else set()
    hard = [r for r in hard if r not in late]
    if not hard and busy:
        if longest.waited_us < int(settings.hang.busy_grace_s * _US):
            return _stall(snap, settings, busy=busy, lives=lives, beats=beats,
                          stalled=stalled, longest=longest, node_of=node_of)
        hard, basis_override = busy, Basis.BUSY_TIMEOUT
    else:
        basis_override = None

    if hard:
        culprits = set(hard)
        # Frozen culprits that entered the collective their peers wait in lag in nothing: only
        # their silence (or stopped process) shows them.
        lagging = {r for r in culprits if r in lag_facts and lag_facts[r].value > 0}
        basis = basis_override or (
            Basis.HEARTBEAT_LOSS if culprits <= frozen and not lagging
            else Basis.CONTROL_DEPENDENCY
        )
        # Frozen culprits cannot be anything but stopped; reporting ones could be slow.
        confidence = CERTAIN if culprits <= frozen else STRONG
    elif frozen:
        # Frozen ranks the waits-for chain does not lead to: likely, but not shown, the cause.
        culprits = set(frozen)
        basis = Basis.HEARTBEAT_LOSS
        confidence = LIKELY
    else:
        # Nobody lags and nobody is frozen: every member is inside the collective. Unless they
        # have all been there for the hang threshold, it is one that has just filled up; and a
        # member that completed it or moved past it shows that it did complete (the waiters'
        # newest heartbeats were sent a moment before).
        group_s = longest.group
        seq_s = stalled_groups[group_s]
        for m in members.get(group_s, ()):
            beat = beats.get(m)
            if m in exited or beat is None:
                continue
            mine = next((g for g in beat.groups if g.group == group_s), None)
            if mine is None:
                continue
            if mine.last_completed >= seq_s or mine.last_enqueued > seq_s:
                return None
            if mine.last_enqueued == seq_s and mine.pending_op and (
                beat.time_us - mine.last_enqueue_us < hang_us
            ):
                return None
        culprits = set().union(*(members.get(g, frozenset()) for g in stalled_groups))
        basis = Basis.UNLOCALIZED
        confidence = UNSURE

    cap = settings.max_evidence

    def evidence_order(r: int) -> tuple[int, int, float, int]:
        """Culprits first: frozen (by how sure and how long), then stuck (longest first), then
        the rest; the rank number only breaks exact ties."""
        life = lives.get(r)
        if r not in culprits:
            return (9, 0, 0.0, r)
        if life is not None and life.frozen:
            return (0, life.strength[0], life.strength[1], r)
        return (1, 0, -stuck_us.get(r, 0), r)

    ordered = sorted(culprits, key=evidence_order)

    def culprits_first(ranks: Iterable[int]) -> list[int]:
        return sorted(ranks, key=evidence_order)[:cap]

    frozen_facts = [
        Evidence(
            fact=Fact.SILENT if r in beats and lives[r].strength[0] == 1 else Fact.FROZEN,
            rank=r, node=node_of(r),
            value=_sec(snap.now_us - beats[r].time_us) if r in beats else 0.0,
            detail=(f"rank {r} on node {node_of(r)} is frozen: {lives[r].why}, while its "
                    "peers wait" if r not in late else
                    f"rank {r} on node {node_of(r)}: {lives[r].why}, but it had entered the "
                    "collective its peers wait in: its reports are late, it is not what they "
                    "wait for"),
        )
        for r in culprits_first(silent)
    ]
    missing_facts = [
        Evidence(fact=Fact.MISSING, rank=r, node=node_of(r),
                 detail=f"rank {r} on node {node_of(r)} never reported")
        for r in culprits_first(never_reported)
    ]
    stuck_facts = [
        Evidence(
            fact=Fact.STUCK, rank=r, node=node_of(r), value=_sec(stuck_us.get(r, 0)),
            detail=(
                f"rank {r} on node {node_of(r)} has been inside one operation for "
                f"{_sec(stuck_us.get(r, 0)):.1f} s that does not complete"
                if basis is not Basis.BUSY_TIMEOUT else
                f"rank {r} on node {node_of(r)} has kept its peers waiting for "
                f"{_sec(longest.waited_us):.1f} s, longer than the busy grace of "
                f"{settings.hang.busy_grace_s:.0f} s, outside collectives"
                + _busy_where(lives.get(r), _since_us(beats.get(r)))
            ),
        )
        for r in ordered if r not in frozen and r in beats and r not in exited
    ][:cap]
    waiting_facts = _waiting_facts(stalled, node_of) + [
        Evidence(
            fact=Fact.STACK, rank=r, node=node_of(r), value=stack.time_us / _US,
            detail=(f"rank {r} on node {node_of(r)} waits in a collective the trace does not "
                    f"show ({collective_wait(stack.frames)}); stack, outermost first: "
                    + " > ".join(stack.frames[-8:])),
        )
        for r, stack in sorted(untraced.items())[:cap]
    ]
    # Laggards that are not culprits are themselves blocked further down the chain: name the
    # culprits' facts one by one, and the others once per group, so the evidence of a 10,000-rank
    # hang reads as a cause and its reach, not as a list of victims.
    blocked: dict[str, list[int]] = {}
    for r, fact in lag_facts.items():
        if r not in culprits:
            blocked.setdefault(fact.group, []).append(r)
    blocked_facts = [
        Evidence(
            fact=Fact.LAGGING, rank=min(rs), node=node_of(min(rs)), group=group,
            seq=stalled_groups[group], value=float(len(rs)),
            detail=(
                f"{len(rs)} other rank(s) of group {group} (e.g. rank {min(rs)} on node "
                f"{node_of(min(rs))}) have not entered #{stalled_groups[group]} either: they "
                "are blocked in other collectives, behind the culprit(s)"
            ),
        )
        for group, rs in sorted(blocked.items())
    ]
    evidence = (
        [lag_facts[r] for r in culprits_first(lag_facts) if r in culprits][:cap] + frozen_facts
        + missing_facts + stuck_facts + blocked_facts[:cap] + waiting_facts
    )
    ranks = tuple(ordered)
    culprit_nodes = ordered_nodes(ranks, nodes)
    if basis is Basis.UNLOCALIZED:
        summary = (
            f"{len(stalled)} rank(s) have waited up to {_sec(longest.waited_us):.1f} s in "
            f"{longest.op} #{longest.seq} of group {longest.group}; no rank lags or is silent"
        )
    else:
        who = ", ".join(f"rank {r} on node {node_of(r)}" for r in ranks[:4])
        more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
        lead = lives.get(ranks[0])
        state = f" ({lead.why})" if lead is not None and lead.frozen and len(ranks) == 1 else ""
        if basis is Basis.BUSY_TIMEOUT:
            state = f" (busy outside collectives past the {settings.hang.busy_grace_s:.0f} s grace)"
        summary = (
            f"{who}{more}{state} blocked the job: {len(stalled)} rank(s) have waited up to "
            f"{_sec(longest.waited_us):.1f} s in {longest.op} #{longest.seq} of group "
            f"{longest.group}"
        )
    group = ""
    if basis is not Basis.HEARTBEAT_LOSS:
        lagging_groups = {lag_facts[r].group for r in ranks if r in lag_facts}
        group = lagging_groups.pop() if len(lagging_groups) == 1 else ""
        if basis is Basis.UNLOCALIZED and len(stalled_groups) == 1:
            group = next(iter(stalled_groups))
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.HANG, culprit_ranks=ranks,
        culprit_nodes=culprit_nodes, confidence=confidence, basis=basis, summary=summary,
        evidence=tuple(evidence), observed_at_us=snap.now_us, group=group,
    )


def _busy_where(life: RankLife | None, since_us: int) -> str:
    """"; state R, CPU ...; at a.py:1 f > b.py:2 g" for a busy rank, from what is known (a
    stack counts if taken since `since_us`)."""
    if life is None:
        return ""
    parts = []
    proc = process_words(life.process)
    if proc:
        parts.append(f"process {proc}")
    where = where_words(life, since_us)
    if where:
        parts.append(f"at {where}")
    return "; " + "; ".join(parts) if parts else ""


def _stall(
    snap: JobSnapshot, settings: DetectionSettings, *, busy: list[int],
    lives: Mapping[int, RankLife], beats: Mapping[int, Heartbeat], stalled: list[_Wait],
    longest: _Wait, node_of: Callable[[int], str],
) -> Verdict:
    """Peers wait on ranks that are alive and busy outside collectives: a stall, not a hang."""

    def busy_us(r: int) -> int:
        hb = beats.get(r)
        if hb is None:
            return longest.waited_us
        since = last_activity_us(hb)
        return snap.now_us - since if since else longest.waited_us

    ranks = tuple(sorted(busy, key=lambda r: (-busy_us(r), r)))
    # A stack from before the peers began to wait shows where the rank was before the work that
    # keeps them waiting: a rank that waited in DDP's construction (untraced, no progress) and
    # then computes a slow first step would be placed in the construction.
    waited_from = min(w.entered_us for w in stalled)

    def since(r: int) -> int:
        return max(_since_us(beats.get(r)), waited_from)

    evidence = [
        Evidence(
            fact=Fact.BUSY, rank=r, node=node_of(r), value=_sec(busy_us(r)),
            detail=(
                f"rank {r} on node {node_of(r)} is alive and outside collectives for "
                f"{_sec(busy_us(r)):.1f} s ({lives[r].why})"
                + _busy_where(lives.get(r), since(r))
            ),
        )
        for r in ranks[: settings.max_evidence]
    ]
    for r in ranks[: settings.max_evidence]:
        stack = fresh_stack(lives[r], since(r))
        if stack is not None:
            evidence.append(Evidence(
                fact=Fact.STACK, rank=r, node=node_of(r), value=_sec(stack.time_us),
                detail=f"rank {r} stack, outermost first: " + " > ".join(stack.frames),
            ))
    evidence += _waiting_facts(stalled, node_of)
    lead = ranks[0]
    where = where_words(lives[lead], since(lead))
    who = ", ".join(f"rank {r} on node {node_of(r)}" for r in ranks[:4])
    more = f" and {len(ranks) - 4} more" if len(ranks) > 4 else ""
    summary = (
        f"{who}{more} {'is' if len(ranks) == 1 else 'are'} busy outside collectives, not hung"
        + (f" (at {where})" if where else "")
        + f": {len(stalled)} rank(s) have waited up to {_sec(longest.waited_us):.1f} s in "
        f"{longest.op} #{longest.seq} of group {longest.group}; nothing is done unless it "
        f"lasts {settings.hang.busy_grace_s:.0f} s"
    )
    nodes = {r: node_of(r) for r in ranks}
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.STALL, culprit_ranks=ranks,
        culprit_nodes=ordered_nodes(ranks, nodes), confidence=STRONG,
        basis=Basis.CONTROL_DEPENDENCY, summary=summary, evidence=tuple(evidence),
        observed_at_us=snap.now_us, group=longest.group,
    )


def _reach_words(graph: _WaitsFor, member: int, group: str, *, reported: bool) -> str:
    """How far a laggard got in `group`, and by which source: its stored records where they
    are ahead of its last heartbeat (which the words then give too), else its heartbeat."""
    reached = graph.entered(member, group)
    beat = graph.beat.get((member, group))
    if graph.by_records(member, group):
        told = ("it reported no heartbeat" if not reported else
                "its last heartbeat named no work in the group" if beat is None else
                f"its last heartbeat, {reached - beat} collective(s) older, said #{beat}")
        return f"completed #{reached} by its stored records; {told}"
    return "never reported" if not reported else f"last entered #{reached}"


def _stuck_words(beats: Mapping[int, Heartbeat], member: int, group: str, *,
                 recorded: int = 0) -> str:
    """Where a laggard's own work in `group` stopped completing, when its peers completed that
    work ("" otherwise): it issued the call (a peer cannot complete a collective a member never
    joined) and is stuck in it; its later calls are not issued yet. On a GPU this is work
    enqueued whose kernel never finished. Not where its stored records (`recorded`: the
    furthest it reached by them) show that work completed."""
    beat = beats.get(member)
    own = next((g for g in beat.groups if g.group == group), None) if beat else None
    completed = max(own.last_completed, recorded) if own is not None else 0
    if own is None or own.last_enqueued <= completed:
        return ""
    done = max((g.last_completed for r, hb in beats.items() if r != member
                for g in hb.groups if g.group == group), default=0)
    first = completed + 1
    if done < first:
        return ""
    return (f"its work from #{first} on (entered through #{own.last_enqueued}) never "
            f"completed while its peers completed through #{done}: it is stuck at #{first}; ")
