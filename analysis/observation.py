"""Everything the analysis may look at for one detection window of one attempt.

The snapshot (latest heartbeats, exits, groups) is always there; the window summaries, stack
samples and health samples are there when the store (or the simulator) has them. Detectors read
what they need and ignore the rest, so a partial observation gives fewer verdict kinds, never a
wrong one.
"""

from __future__ import annotations

from dataclasses import dataclass

from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing.events import HealthSample, StackSample
from tracehound.tracing.summaries import Disagreement, LinkStats, NodeWindows, RankStats


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    snapshot: JobSnapshot
    window_start_us: int
    window_end_us: int
    ranks: RankStats | None = None
    links: LinkStats | None = None
    disagreements: tuple[Disagreement, ...] = ()
    stacks: tuple[StackSample, ...] = ()
    """The newest stack sample of each rank that has one."""
    health: tuple[HealthSample, ...] = ()
    """Health samples of the job's nodes in the window (events and metrics)."""
    node_windows: NodeWindows | None = None
    """Per-node features over consecutive windows ending at window_end_us."""
