"""The verdict: what went wrong, who is to blame, how sure the analysis is, and the evidence."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tracehound.tracing.events import SCHEMA_VERSION, IncidentKind
from tracehound.tracing.ids import JobId


class Basis(enum.StrEnum):
    """Which line of reasoning produced the culprits."""

    EXIT_STATUS = "exit_status"
    """The first rank to exit with a failure (non-zero code or a signal)."""
    CONTROL_DEPENDENCY = "control_dependency"
    """Ranks wait in a collective that the culprits never entered (sequence ids lag)."""
    HEARTBEAT_LOSS = "heartbeat_loss"
    """The culprits stopped reporting while their peers wait on them."""
    UNLOCALIZED = "unlocalized"
    """Every member waits and no rank stands out: no culprit rank is named, the group's nodes
    are suspects (`Fact.SUSPECT`)."""
    MAJORITY_VOTE = "majority_vote"
    """The culprits differ from the majority of their group (op, size, dtype, stack)."""
    ARRIVAL_LATENESS = "arrival_lateness"
    """The culprits arrive last at collectives, consistently, while the others wait."""
    LINK_LATENCY = "link_latency"
    """Transfers over the culprit link take longer than over comparable links."""
    HEALTH_CORRELATION = "health_correlation"
    """A device health event on the culprit node coincides with the anomaly."""
    OUTLIER_MODEL = "outlier_model"
    """A model over per-node features flags the node in consecutive windows."""
    STANDSTILL = "standstill"
    """No traced collective was pending: every rank that is not a culprit stopped progressing
    (its stack, where one was taken, waiting in a collective the trace does not show) while the
    culprits are frozen, or, with nobody frozen, busy (`analysis.standstill`)."""
    BUSY_TIMEOUT = "busy_timeout"
    """The culprits were alive and busy outside collectives, but kept their peers waiting
    longer than the busy grace: the program is stuck there, the machine is not implicated."""
    IDLE_TIMEOUT = "idle_timeout"
    """The culprits were alive, outside collectives and idle (asleep, no CPU, no storage I/O,
    the same stack) while their peers waited, for the idle grace (`analysis.idle`): the
    program is stuck there, the machine is not implicated."""


class Fact(enum.StrEnum):
    """The kind of one piece of evidence."""

    EXIT = "exit"
    LAGGING = "lagging"
    WAITING = "waiting"
    SILENT = "silent"
    MISSING = "missing"
    DIFFERS = "differs"
    LATE = "late"
    SLOW_TRANSFER = "slow_transfer"
    HEALTH = "health"
    STACK = "stack"
    OUTLIER = "outlier"
    FROZEN = "frozen"
    """The rank's process is stopped or gone, or it stopped reporting with no sign of life."""
    STUCK = "stuck"
    """The rank has been inside one operation that does not complete."""
    BUSY = "busy"
    """The rank is alive and outside collectives (checkpoint, evaluation, data loading)."""
    IDLE = "idle"
    """The rank is alive, outside collectives and doing nothing: no CPU, no storage I/O, the
    same stack (`analysis.idle`)."""
    CLOCK = "clock"
    """The nodes' clocks differ: times were compared after correcting for it (offsets and
    their uncertainty)."""
    SUSPECT = "suspect"
    """Not a culprit: a node of the group an unlocalized hang is in (its network or the
    collective library are suspect), named where no rank stands out."""


def suspect_nodes(evidence: Iterable[Mapping[str, Any]]) -> list[str]:
    """The nodes of a verdict's `suspect` evidence, as serialized (`Verdict.to_dict`), once
    each in order: an unlocalized hang's suspects."""
    return list(dict.fromkeys(str(e.get("node", "")) for e in evidence
                              if isinstance(e, Mapping) and e.get("fact") == Fact.SUSPECT))


@dataclass(frozen=True, slots=True, kw_only=True)
class Evidence:
    """One observation behind a verdict, about one rank."""

    fact: Fact
    rank: int
    node: str
    detail: str
    """The observation in words a person can act on."""
    group: str = ""
    seq: int = 0
    """The collective's sequence id in `group`, where one is involved."""
    value: float = 0.0
    """The measured quantity (seconds waited or silent, exit code), where one is involved."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """The analysis' conclusion for one attempt of a job."""

    job: JobId
    attempt: int
    kind: IncidentKind
    culprit_ranks: tuple[int, ...]
    culprit_nodes: tuple[str, ...]
    """Nodes of the culprit ranks; culprit_ranks[0] and culprit_nodes[0] are the most likely."""
    confidence: float
    """0..1: how sure the analysis is that the culprits are right, on the scale of
    `analysis.confidence` (CERTAIN, STRONG, LIKELY, WEAK, UNSURE)."""
    basis: Basis
    summary: str
    evidence: tuple[Evidence, ...]
    observed_at_us: int
    """The time the snapshot was taken (the analysis' notion of now)."""
    culprit_link: tuple[int, int] | None = None
    """For a slow link: the two ranks (sender, receiver) at its ends."""
    group: str = ""
    """The process group the fault was localized in, where there is one."""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        data["basis"] = self.basis.value
        data["culprit_ranks"] = list(self.culprit_ranks)
        data["culprit_nodes"] = list(self.culprit_nodes)
        data["culprit_link"] = list(self.culprit_link) if self.culprit_link else None
        data["evidence"] = [{**asdict(e), "fact": e.fact.value} for e in self.evidence]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))
