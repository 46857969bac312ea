"""Idle is not busy: a rank that keeps its peers waiting while its process does nothing at all.

A stall's culprits are alive and outside collectives while their peers wait. Busy, computing,
writing or reading, they get the busy grace (`HangSettings.busy_grace_s`, 10 minutes): a
checkpoint or an evaluation may take that long. A rank whose process uses no CPU and does no
storage I/O, and whose stack stays the same, is not working towards anything: a data loader
whose worker died, a deadlock in the user's own code, an answer that never comes. Its peers
would wait for torch's watchdog.

`IdleTracker` follows, poll after poll, the node agent's process samples and stacks of every
rank, and says since when each has been idle: every sample since then sleeping (`S`) with CPU
under `IDLE_CPU_RATE` and no storage I/O, and every stack taken since then the same. A new pid,
a sample that shows work or a stack that moved starts over. `idle_hang` turns a stall whose
every culprit has been idle for its threshold, with a stack to show where, into a hang (basis
`IDLE_TIMEOUT`: the program is stuck there, the machine is not implicated). A stall of which
one culprit works is left a stall: the idle one may wait on the one that works.

The threshold of each rank is the caller's: the idle grace, or more where the job's rhythm has
shown longer pauses at that place (`controller.supervision`).

Pure but for the tracker's memory of earlier polls: no I/O, no clock; the records carry the time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tracehound.analysis.confidence import STRONG
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind, ProcessSample, ProcessState, StackSample

_US = 1_000_000

IDLE_CPU_RATE = 0.02
"""CPU seconds per second under which a sleeping process counts as idle: a rank's recorder
threads (heartbeats, the transport) use about a thousandth of a core."""

FRESH_S = 5.0
"""An idle span whose newest sample is older than this (the agent stopped sampling) says
nothing about now."""


def is_idle(sample: ProcessSample) -> bool:
    """Whether one process sample shows a process doing nothing: asleep, no CPU, no storage I/O."""
    return (sample.state == ProcessState.SLEEPING and sample.cpu_rate < IDLE_CPU_RATE
            and sample.io_rate == 0)


@dataclass(slots=True)
class IdleSpan:
    """How long one rank's process has been idle."""

    pid: int
    since_us: int
    """The first idle sample of the span (the process may have been idle a little longer)."""
    last_us: int
    """The newest idle sample."""
    stack: StackSample | None = None
    """The first stack taken during the span; every later one had the same frames."""


class IdleTracker:
    """Since when each rank's process has been idle, from the samples of successive polls."""

    def __init__(self) -> None:
        self._spans: dict[int, IdleSpan] = {}

    def observe(self, processes: Iterable[ProcessSample], stacks: Iterable[StackSample]) -> None:
        """Take the newest process sample and stack of each rank, as a poll reads them."""
        for sample in processes:
            rank = int(sample.rank)
            span = self._spans.get(rank)
            if not is_idle(sample):
                if span is not None and sample.time_us >= span.last_us:
                    del self._spans[rank]
                continue
            if span is None or span.pid != sample.pid:
                self._spans[rank] = IdleSpan(pid=sample.pid, since_us=sample.time_us,
                                             last_us=sample.time_us)
            else:
                span.last_us = max(span.last_us, sample.time_us)
        for stack in stacks:
            span = self._spans.get(int(stack.rank))
            if span is None or stack.time_us < span.since_us or not stack.frames:
                continue
            if span.stack is None:
                span.stack = stack
            elif stack.frames != span.stack.frames and stack.time_us > span.stack.time_us:
                # it moved: idle again, but somewhere else, from this stack on
                span.since_us, span.stack = stack.time_us, stack

    def span(self, rank: int, now_us: int) -> IdleSpan | None:
        """The rank's idle span if its newest sample is fresh, else None."""
        span = self._spans.get(rank)
        if span is None or now_us - span.last_us > int(FRESH_S * _US):
            return None
        return span

    def forget(self) -> None:
        """A new attempt: its processes are new."""
        self._spans.clear()


def idle_hang(stall: Verdict, tracker: IdleTracker, *, thresholds_s: Mapping[int, float],
              now_us: int) -> Verdict | None:
    """The hang that `stall` is when every one of its culprits has been idle, with a stack, for
    at least its threshold (`thresholds_s`, by rank); None otherwise."""
    if stall.kind is not IncidentKind.STALL or not stall.culprit_ranks:
        return None
    spans: dict[int, IdleSpan] = {}
    for rank in stall.culprit_ranks:
        span = tracker.span(rank, now_us)
        threshold = thresholds_s.get(rank)
        if (span is None or span.stack is None or threshold is None
                or now_us - span.since_us < int(threshold * _US)):
            return None
        spans[rank] = span
    nodes = dict(zip(stall.culprit_ranks, stall.culprit_nodes, strict=False))
    facts = []
    for rank, span in spans.items():
        stack = span.stack
        frames = stack.frames if stack is not None else ()
        idle_s = (now_us - span.since_us) / _US
        facts.append(Evidence(
            fact=Fact.IDLE, rank=rank, node=nodes.get(rank, "unknown"), value=idle_s,
            detail=(f"rank {rank} on node {nodes.get(rank, 'unknown')} has been idle outside "
                    f"collectives for {idle_s:.1f} s (asleep, under {IDLE_CPU_RATE:g} s/s of CPU, "
                    f"no storage I/O, the same stack; threshold {thresholds_s[rank]:.0f} s) while "
                    f"its peers wait; stack, outermost first: " + " > ".join(frames[-8:])),
        ))
    lead = stall.culprit_ranks[0]
    idle_s = (now_us - spans[lead].since_us) / _US
    words = ", ".join(f"rank {r} on node {nodes.get(r, 'unknown')}"
                      for r in stall.culprit_ranks[:4])
    summary = (f"{words} {'is' if len(spans) == 1 else 'are'} stuck idle outside collectives "
               f"(no CPU, no I/O, the same stack for {idle_s:.1f} s) while peers wait: not busy, "
               f"the program is stuck there")
    kept = tuple(e for e in stall.evidence if e.fact is not Fact.BUSY)
    return dataclasses.replace(
        stall, kind=IncidentKind.HANG, basis=Basis.IDLE_TIMEOUT, confidence=STRONG,
        summary=summary, evidence=(*facts, *kept), observed_at_us=now_us)
