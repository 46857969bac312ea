"""A job that stands still with no traced collective pending: the safety net under coverage.

Control dependency (`analysis.detect.detect_hang`) starts from a traced collective that ranks have
waited in for the hang threshold. A collective the recorder does not see (one a compiled graph
issues, a path it does not wrap, a process group's own methods) leaves nothing pending: the
waiting ranks just stop progressing. This judges such a standstill without a trace of the
collective, from what is known of every rank:

- *progress*: a step finished, a collective entered or completed, counted progress (DDP's own
  communication), on the rank's own clock (`idle_us`);
- *frozen*: its process is stopped or gone (`analysis.liveness`), or it is silent with no process
  sample showing life since;
- *waiting*: its newest stack, taken since its last progress, is inside a collective
  (`liveness.collective_wait`: a c10d call, a functional collective's `wait_tensor`).

Verdicts, only when every rank that is neither frozen nor exited has made no progress for
`hang_after_s`:

- frozen ranks: a hang on them (basis `standstill`: no traced collective was pending), their
  state and the peers' stacks as evidence. A rank frozen by its silence alone counts only once it
  has been silent that long too and a peer is seen waiting in a collective: a node agent that
  stops relaying heartbeats while every rank writes a checkpoint must not restart a healthy job.
- nobody frozen, some ranks seen waiting: the others are busy outside collectives and keep them
  waiting. A stall on those (nothing is done), a hang once the waiters have waited the busy grace
  (`busy_timeout`, as for a busy rank behind a traced collective).
- nobody frozen, every rank seen waiting: a hang that no rank can be named for (`unlocalized`);
  their stacks may still tell (`analysis.stacks`).
- nobody frozen, nobody seen waiting: every rank busy on its own (a checkpoint on every rank, an
  evaluation): nothing while it lasts less than the busy grace (a stall incident for every
  long checkpoint of every rank would be noise, and nobody waits on anybody); past it, a hang
  on every rank (`busy_timeout`: the program, not a machine), which their stacks may still
  localize (`analysis.stacks`). Never "healthy".

A rank that has not progressed at all yet (starting up) and a job some rank of which has exited
(it ends, or a crash that `detect_crash` judges) are not judged.

Pure: no I/O, no clock; the snapshot carries the time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from tracehound.analysis.common import ordered_nodes, rank_nodes, who
from tracehound.analysis.confidence import CERTAIN, LIKELY, STRONG, UNSURE
from tracehound.analysis.liveness import (
    RankLife,
    assess,
    collective_wait,
    last_activity_us,
    stack_wait,
    where_words,
)
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import Heartbeat, IncidentKind, StackSample

_US = 1_000_000


def progress_us(hb: Heartbeat) -> int:
    """When the rank last progressed, on its own clock: a step finished, or a collective entered
    or completed (0: never)."""
    return max(last_activity_us(hb), hb.step_us)


def idle_us(hb: Heartbeat) -> int:
    """How long the rank had made no progress when it sent `hb` (0 before its first)."""
    since = progress_us(hb)
    return hb.time_us - since if since else 0


def _progress_words(hb: Heartbeat) -> str:
    """"step 87; last collective #736 of group 0, completed" for a heartbeat."""
    parts = [f"step {hb.step}"] if hb.step else []
    groups = [g for g in hb.groups if g.last_enqueued]
    if groups:
        g = max(groups, key=lambda g: max(g.last_enqueue_us, g.last_complete_us))
        state = "completed" if g.last_completed >= g.last_enqueued else "pending"
        parts.append(f"last collective #{g.last_enqueued} of group {g.group}, {state}")
    return "; ".join(parts)


def detect_standstill(snap: JobSnapshot, settings: DetectionSettings) -> Verdict | None:
    """The verdict for a job that stands still with no traced collective pending for the hang
    threshold (see the module docstring); None while any rank progresses."""
    if snap.exits:
        return None
    beats: dict[int, Heartbeat] = {int(hb.rank): hb for hb in snap.heartbeats}
    ranks = set(snap.expected_ranks) | set(beats)
    if len(ranks) < 2:
        return None
    lives = assess(snap, heartbeat_timeout_s=settings.hang.heartbeat_timeout_s,
                   ranks={r: beats.get(r) for r in ranks})
    hang_us = int(settings.hang.after_s * _US)
    frozen = {r for r, life in lives.items() if life.frozen}
    running = sorted(r for r in ranks if r not in frozen)
    if not running:
        return None  # nobody left to stand still: heartbeat loss or a crash, judged elsewhere
    idle: dict[int, int] = {}
    for r in running:
        hb = beats.get(r)
        if hb is None or not progress_us(hb):
            return None  # a rank that has not started yet
        idle[r] = idle_us(hb)
        if idle[r] < hang_us:
            return None  # somebody progresses
    waits: dict[int, StackSample] = {}
    for r in running:
        stack = stack_wait(lives[r], progress_us(beats[r]))
        if stack is not None:
            waits[r] = stack
    nodes = rank_nodes(snap)

    def node_of(rank: int) -> str:
        return nodes.get(rank, "unknown")

    still = min(idle.values())
    culprits = [r for r in frozen if _counts(lives[r], hang_us, bool(waits))]
    if culprits:
        return _frozen_hang(snap, culprits=culprits, lives=lives, beats=beats, idle=idle,
                            waits=waits, still_us=still, node_of=node_of, nodes=nodes,
                            max_evidence=settings.max_evidence)
    if frozen:
        return None  # only ranks silent too briefly
    if not waits:
        return _all_busy(snap, running=running, lives=lives, beats=beats, idle=idle,
                         nodes=nodes, node_of=node_of, settings=settings)
    busy = [r for r in running if r not in waits]
    waited = max(idle[r] for r in waits)
    peer_facts = _peer_facts(running, beats=beats, idle=idle, waits=waits, node_of=node_of,
                             max_evidence=settings.max_evidence)
    if not busy:
        ordered = tuple(running)
        return Verdict(
            job=snap.job, attempt=snap.attempt, kind=IncidentKind.HANG, culprit_ranks=ordered,
            culprit_nodes=ordered_nodes(ordered, nodes), confidence=UNSURE,
            basis=Basis.UNLOCALIZED,
            summary=(f"every rank has waited up to {waited / _US:.1f} s in a collective the "
                     "trace does not show (no traced collective is pending); no rank lags or "
                     "is frozen"),
            evidence=tuple(peer_facts), observed_at_us=snap.now_us,
        )
    busy.sort(key=lambda r: (-idle[r], r))
    hang = waited >= int(settings.hang.busy_grace_s * _US)
    evidence = [
        Evidence(
            fact=Fact.BUSY, rank=r, node=node_of(r), value=idle[r] / _US,
            detail=(f"rank {r} on node {node_of(r)} is alive and outside collectives for "
                    f"{idle[r] / _US:.1f} s ({lives[r].why})"
                    + (f"; at {where}" if (where := where_words(lives[r], progress_us(beats[r])))
                       else "")
                    + f" while {len(waits)} rank(s) wait in collectives the trace does not show"),
        )
        for r in busy[:settings.max_evidence]
    ] + peer_facts
    head = (f"{who(busy, nodes)} {'is' if len(busy) == 1 else 'are'} busy outside collectives "
            f"while {len(waits)} rank(s) have waited up to {waited / _US:.1f} s in collectives "
            "the trace does not show (no traced collective is pending)")
    if hang:
        summary = (f"{head}; past the busy grace of {settings.hang.busy_grace_s:.0f} s the program "
                   "is stuck there")
        kind, basis, confidence = IncidentKind.HANG, Basis.BUSY_TIMEOUT, LIKELY
    else:
        summary = f"{head}; nothing is done unless it lasts {settings.hang.busy_grace_s:.0f} s"
        kind, basis, confidence = IncidentKind.STALL, Basis.STANDSTILL, LIKELY
    ordered = tuple(busy)
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=kind, culprit_ranks=ordered,
        culprit_nodes=ordered_nodes(ordered, nodes), confidence=confidence, basis=basis,
        summary=summary, evidence=tuple(evidence), observed_at_us=snap.now_us,
    )


def _all_busy(snap: JobSnapshot, *, running: list[int], lives: Mapping[int, RankLife],
              beats: Mapping[int, Heartbeat], idle: Mapping[int, int], nodes: Mapping[int, str],
              node_of: Callable[[int], str], settings: DetectionSettings) -> Verdict | None:
    """Every rank busy outside collectives, nobody waiting: a hang on all of them once the
    least idle has been so for the busy grace."""
    still = min(idle.values())
    if still < int(settings.hang.busy_grace_s * _US):
        return None
    ordered = tuple(running)
    evidence = [
        Evidence(
            fact=Fact.BUSY, rank=r, node=node_of(r), value=idle[r] / _US,
            detail=(f"rank {r} on node {node_of(r)} is alive and outside collectives for "
                    f"{idle[r] / _US:.1f} s ({lives[r].why}; {_progress_words(beats[r])})"
                    + (f"; at {where}" if (where := where_words(lives[r], progress_us(beats[r])))
                       else "")),
        )
        for r in ordered[:settings.max_evidence]
    ]
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.HANG, culprit_ranks=ordered,
        culprit_nodes=ordered_nodes(ordered, nodes), confidence=UNSURE,
        basis=Basis.BUSY_TIMEOUT,
        summary=(f"no rank has progressed for {still / _US:.1f} s, longer than the busy grace "
                 f"of {settings.hang.busy_grace_s:.0f} s, every one alive and outside collectives "
                 "(no traced collective is pending): the program is stuck"),
        evidence=tuple(evidence), observed_at_us=snap.now_us,
    )


def _counts(life: RankLife, hang_us: int, waited_on: bool) -> bool:
    """Whether a frozen rank hangs the job: stopped or gone by its process state, or silent for
    the hang threshold (or never reported) while a peer is seen waiting in a collective."""
    kind, minus_silent_s = life.strength
    if kind == 0:
        return True
    if not waited_on:
        return False
    return kind != 1 or -minus_silent_s * _US >= hang_us


def _peer_facts(running: list[int], *, beats: Mapping[int, Heartbeat], idle: Mapping[int, int],
                waits: Mapping[int, StackSample], node_of: Callable[[int], str],
                max_evidence: int) -> list[Evidence]:
    """What the ranks that still run show: their stacks in collectives, first, then how long
    each has not progressed and where it stopped."""
    facts: list[Evidence] = []
    for r in sorted(running, key=lambda r: (r not in waits, -idle[r], r))[:max_evidence]:
        stack = waits.get(r)
        if stack is not None:
            facts.append(Evidence(
                fact=Fact.STACK, rank=r, node=node_of(r), value=stack.time_us / _US,
                detail=(f"rank {r} on node {node_of(r)} waits in a collective the trace does not "
                        f"show ({collective_wait(stack.frames)}); stack, outermost first: "
                        + " > ".join(stack.frames[-8:])),
            ))
        facts.append(Evidence(
            fact=Fact.WAITING, rank=r, node=node_of(r), value=idle[r] / _US,
            detail=(f"rank {r} on node {node_of(r)} has made no progress for "
                    f"{idle[r] / _US:.1f} s ({_progress_words(beats[r])})"),
        ))
    return facts


def _frozen_hang(snap: JobSnapshot, *, culprits: list[int], lives: Mapping[int, RankLife],
                 beats: Mapping[int, Heartbeat], idle: Mapping[int, int],
                 waits: Mapping[int, StackSample], still_us: int,
                 node_of: Callable[[int], str], nodes: Mapping[int, str],
                 max_evidence: int) -> Verdict:
    culprits.sort(key=lambda r: (lives[r].strength, r))
    ordered = tuple(culprits)
    frozen_facts = [
        Evidence(
            fact=Fact.FROZEN if lives[r].strength[0] != 1 else Fact.SILENT, rank=r,
            node=node_of(r),
            value=(snap.now_us - beats[r].time_us) / _US if r in beats else 0.0,
            detail=(f"rank {r} on node {node_of(r)} is frozen: {lives[r].why}, while no other "
                    f"rank has progressed for {still_us / _US:.1f} s"
                    + (f" ({_progress_words(beats[r])} when it last reported)"
                       if r in beats else "")),
        )
        for r in ordered[:max_evidence]
    ]
    running = sorted(idle)
    peer_facts = _peer_facts(running, beats=beats, idle=idle, waits=waits, node_of=node_of,
                             max_evidence=max_evidence)
    lead = lives[ordered[0]]
    state = f" ({lead.why})" if len(ordered) == 1 else ""
    seen = (f"; {len(waits)} of them wait in collectives the trace does not show, e.g. rank "
            f"{min(waits)} in {collective_wait(waits[min(waits)].frames)}"
            if waits else "")
    summary = (f"{who(ordered, nodes)}{state} blocked the job: no other rank has progressed for "
               f"{still_us / _US:.1f} s and no traced collective is pending{seen}")
    sure = all(lives[r].strength[0] == 0 for r in ordered)
    return Verdict(
        job=snap.job, attempt=snap.attempt, kind=IncidentKind.HANG, culprit_ranks=ordered,
        culprit_nodes=ordered_nodes(ordered, nodes),
        confidence=CERTAIN if sure else (STRONG if waits else LIKELY),
        basis=Basis.STANDSTILL, summary=summary,
        evidence=tuple(frozen_facts + peer_facts), observed_at_us=snap.now_us,
    )
