"""A healthy job's rhythm: pauses that recur at one place in the code with comparable lengths.

A job that writes a checkpoint every half hour, or evaluates every K steps, pauses there each
time: one rank is busy outside collectives while its peers wait, which the analysis reads as a
stall. Each is right and harmless; recorded as an incident every time, a week-long job files
hundreds of them for its normal rhythm.

A pause is keyed by its rank and its place: the stall's lead rank and the frames of its stack
from the outermost in, up to the first frame in a library (`place_of`: the user's own code, the
same for every checkpoint the same line writes, whatever torch does inside). `Rhythm` keeps each
key's past pauses and how long the peers waited in them. A pause at a place with history is
expected while it lasts at most `factor` (3) times its longest past one; it is recorded on the
job as an expected pause, not as an incident. A pause with no history, or one lasting longer
than that, is a stall incident, the second with the history in its words (`history_words`).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from tracehound.analysis.verdict import Fact, Verdict
from tracehound.tracing.events import IncidentKind

EXPECTED_PAUSE = "expected pause"
"""How the detail of a job state that notes a pause of the job's rhythm begins."""

STACK_PREFIX = "stack, outermost first: "
"""What a stall's stack evidence says before its frames (`analysis.detect`)."""

LIBRARY_FRAMES = ("torch/", "numpy/", "site-packages/", "dist-packages/", "<frozen",
                  "threading.py", "concurrent/", "multiprocessing/", "asyncio/", "importlib/")
"""Frames from here on are a library's: where the user's code called into it is the place."""

MAX_PLACE_FRAMES = 12
"""The most frames of the user's code a place keeps (the outermost ones)."""


@dataclass(frozen=True, slots=True)
class Pause:
    """One pause that ended: its rank, its place and how long its peers waited in it."""

    rank: int
    place: str
    seconds: float
    ended_us: int


def place_of(verdict: Verdict) -> str:
    """Where the stall's lead rank is, from its stack evidence: the user's frames, outermost
    first (see the module docstring); "" without a stack of that rank."""
    if verdict.kind is not IncidentKind.STALL or not verdict.culprit_ranks:
        return ""
    lead = verdict.culprit_ranks[0]
    for e in verdict.evidence:
        if e.fact is Fact.STACK and e.rank == lead and STACK_PREFIX in e.detail:
            return place_in(e.detail.split(STACK_PREFIX, 1)[1].split(" > "))
    return ""


def place_in(frames: Iterable[str]) -> str:
    """The place of a stack (its frames outermost first): the user's frames, up to the first
    frame in a library."""
    own: list[str] = []
    for frame in frames:
        if any(marker in frame for marker in LIBRARY_FRAMES):
            break
        own.append(frame)
    return " > ".join(own[:MAX_PLACE_FRAMES])


def waited_s(verdict: Verdict) -> float:
    """How long the peers of a stall have waited so far (its longest `waiting` fact)."""
    return max((e.value for e in verdict.evidence if e.fact is Fact.WAITING), default=0.0)


@dataclass(slots=True)
class Rhythm:
    """The pauses a job made, by (rank, place); see the module docstring."""

    factor: float = 3.0
    """A pause lasting more than this times its place's longest past pause is a stall again."""
    keep: int = 20
    """Past pauses kept per place (the latest)."""
    pauses: dict[tuple[int, str], list[Pause]] = field(default_factory=dict)

    def history(self, rank: int, place: str) -> list[Pause]:
        return list(self.pauses.get((rank, place), ())) if place else []

    def knows(self, rank: int) -> bool:
        """Whether `rank` paused anywhere before (only then can a pause of it be expected)."""
        return any(r == rank for r, _ in self.pauses)

    def expected(self, rank: int, place: str, seconds: float) -> bool:
        """Whether a pause of `rank` at `place` that has lasted `seconds` so far is the job's
        rhythm: its place has history and it is not `factor` times longer than the longest."""
        past = self.history(rank, place)
        return bool(past) and seconds <= self.factor * max(p.seconds for p in past)

    def add(self, pause: Pause) -> None:
        if not pause.place:
            return
        kept = self.pauses.setdefault((pause.rank, pause.place), [])
        kept.append(pause)
        del kept[:-self.keep]

    def extend(self, pauses: Iterable[Pause]) -> None:
        for p in pauses:
            self.add(p)


def history_words(past: list[Pause]) -> str:
    """"seen 3 times before at this place, 2.9-3.4 s" ("" without history)."""
    if not past:
        return ""
    low, high = min(p.seconds for p in past), max(p.seconds for p in past)
    span = f"{low:.1f} s" if high - low < 0.05 else f"{low:.1f}-{high:.1f} s"
    return (f"paused at this place {len(past)} time{'s' if len(past) > 1 else ''} before, "
            f"its peers waiting {span}")
