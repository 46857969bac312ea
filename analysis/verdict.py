"""The verdict: what went wrong, who is to blame, how sure the analysis is, and the evidence."""

from __future__ import annotations

import enum
import json
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
    """A stall was seen but no rank stands out; the whole group is named."""


class Fact(enum.StrEnum):
    """The kind of one piece of evidence."""

    EXIT = "exit"
    LAGGING = "lagging"
    WAITING = "waiting"
    SILENT = "silent"
    MISSING = "missing"


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
    confidence: float
    """0..1: how sure the analysis is that the culprits are right."""
    basis: Basis
    summary: str
    evidence: tuple[Evidence, ...]
    observed_at_us: int
    """The time the snapshot was taken (the analysis' notion of now)."""
    schema_version: int = SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["kind"] = self.kind.value
        data["basis"] = self.basis.value
        data["culprit_ranks"] = list(self.culprit_ranks)
        data["culprit_nodes"] = list(self.culprit_nodes)
        data["evidence"] = [{**asdict(e), "fact": e.fact.value} for e in self.evidence]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))
