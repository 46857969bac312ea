"""The one confidence scale of every verdict: named levels, each with what it promises.

A verdict's `confidence` says how sure the analysis is that its culprits are right (the first
culprit above all). Every detector states it as one of these levels, or as a level moved by a
documented piece of evidence (`between`, `nudged`, `raised`), never as a bare number, so that
one number means the same thing whatever the detector, and the recovery policy
(`controller.policy.PolicySettings`) can set its thresholds per verdict kind on the same scale.

CERTAIN (0.95)
    The evidence admits no other culprit: the first rank to fail, well ahead of the others or
    killed by a signal; a rank whose process is stopped or gone (or silent) while its peers wait
    on it; the one member that ran something else than a unanimous group; a critical device
    event on the anomaly's node.
STRONG (0.85)
    One sound line of reasoning names the culprit and nothing contradicts it, but another
    explanation is conceivable: control dependency leading to a rank that still reports; a
    link or a node's network markedly slower than comparable ones; a small minority outvoted.
LIKELY (0.7)
    Right most of the time, with a known alternative: a frozen rank its peers do not wait on
    directly; a larger minority outvoted or one borrowed from sibling groups; a statistical
    model flagging one node; a warning (not critical) health event.
WEAK (0.5)
    A set of candidates that holds the culprit, in an order that is only a hint: exits too
    close to order, the two ends of a link that cannot be told apart, a tie without majority,
    many late ranks or several flagged nodes at once.
UNSURE (0.3)
    No rank stands out: a stall that nothing localizes names its whole group.

Measured: the share of verdicts at each level whose first culprit was a true one, over the
seeded simulated scenarios of `bench/diagnosis.py` (312 scenarios: 36 of each fault class and
60 healthy runs, 64 to 4,096 ranks; a verdict counts at the highest level its confidence
reaches; healthy runs gave no verdict):

    .venv/bin/python bench/diagnosis.py --no-timing    # table "precision by confidence level"

    level    verdicts  right  precision
    certain        94     94       1.00
    strong        111    111       1.00
    likely         42     42       1.00
    weak            3      2       0.67
    unsure          0      0          -

(`--quick`, 44 scenarios: 15/15, 12/12, 5/5, 2/2, none.) The simulated faults are clean, so
these figures are an upper bound, not a calibration of the upper levels against each other:
they do show that a verdict from LIKELY up named a true culprit every time, and that a WEAK one
names a set whose first member is only a hint (the two ends of a slow link that cannot be told
apart). The simulator has no stall that nothing localizes, hence no UNSURE verdict.

Pure: constants and arithmetic.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final

from tracehound.tracing.events import IncidentKind

CERTAIN: Final = 0.95
STRONG: Final = 0.85
LIKELY: Final = 0.7
WEAK: Final = 0.5
UNSURE: Final = 0.3

STEP: Final = 0.05
"""One notch: what one corroborating (or doubtful) piece of evidence moves a verdict by."""


@dataclass(frozen=True, slots=True)
class Level:
    """One named level of the scale: its name, its lowest confidence, and what it promises."""

    name: str
    floor: float
    meaning: str


LEVELS: Final = (
    Level("certain", CERTAIN, "the evidence admits no other culprit"),
    Level("strong", STRONG, "one sound line of reasoning, nothing contradicts it"),
    Level("likely", LIKELY, "right most of the time, with a known alternative"),
    Level("weak", WEAK, "a set of candidates that holds the culprit; the order is a hint"),
    Level("unsure", UNSURE, "no rank stands out; the whole group is named"),
)
"""The levels, most sure first."""


def level_of(confidence: float) -> Level:
    """The highest level `confidence` reaches (the lowest level for anything below it)."""
    for level in LEVELS:
        if confidence >= level.floor - 1e-9:
            return level
    return LEVELS[-1]


def between(low: float, high: float, fraction: float) -> float:
    """A confidence `fraction` (clipped to 0..1) of the way from level `low` to level `high`:
    for detectors whose evidence has a strength (how often a rank is last, how large the
    majority is), rounded to 3 places."""
    share = min(1.0, max(0.0, fraction))
    return round(low + (high - low) * share, 3)


def nudged(confidence: float, steps: int = 1) -> float:
    """`confidence` moved by `steps` notches (STEP each, down when negative), kept within
    UNSURE..CERTAIN: no amount of corroboration takes a verdict past CERTAIN."""
    return round(min(CERTAIN, max(UNSURE, confidence + steps * STEP)), 3)


def raised(confidence: float) -> float:
    """The next level up from `confidence` (CERTAIN stays CERTAIN): for evidence that settles
    the alternative the level allowed for (sibling groups agreeing with a majority)."""
    floors = [level.floor for level in LEVELS if level.floor > confidence + 1e-9]
    return min(floors, default=CERTAIN)


TYPICAL: Final[Mapping[IncidentKind, float]] = MappingProxyType({
    IncidentKind.CRASH: CERTAIN,
    IncidentKind.MISMATCH: CERTAIN,
    IncidentKind.HANG: STRONG,
    IncidentKind.STALL: STRONG,
    IncidentKind.HARDWARE: STRONG,
    IncidentKind.SLOW_LINK: STRONG,
    IncidentKind.STRAGGLER: LIKELY,
    IncidentKind.SILENT_HANG: LIKELY,
    IncidentKind.NODE_OUTLIER: LIKELY,
})
"""The least confidence of each kind's verdict in its ordinary form (one culprit, localized): a
crash's first failure, a hang's stuck rank, a slow link twice as slow as its peers, a warning on
an anomaly's node, one straggler or one flagged node. Weaker forms (ties, several candidates,
nothing localized) sit below it. The recovery policy must be able to act on every kind at this
level (`controller.policy.PolicySettings`)."""
