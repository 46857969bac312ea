"""Everything the analysis may look at for one detection window of one attempt.

The snapshot (latest heartbeats, exits, groups) is always there; the window summaries, stack
samples and health samples are there when the store (or the simulator) has them. Detectors read
what they need and ignore the rest, so a partial observation gives fewer verdict kinds, never a
wrong one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tracehound.analysis.snapshot import JobSnapshot, load_snapshot
from tracehound.tracing.events import HealthSample, StackSample
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore
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

    @classmethod
    def of(cls, snapshot: JobSnapshot) -> Observation:
        """An observation of a snapshot alone (no window summaries, stacks or health): enough
        for crashes, hangs and stalls."""
        return cls(snapshot=snapshot, window_start_us=snapshot.now_us,
                   window_end_us=snapshot.now_us)


def load_observation(
    store: TraceStore,
    *,
    job: JobId,
    attempt: int,
    now_us: int,
    window_s: float = 10.0,
    node_window_s: float = 5.0,
    expected_ranks: Mapping[int, str] | None = None,
    summaries: bool = True,
    snapshot: JobSnapshot | None = None,
) -> Observation:
    """Read one detection window ending at `now_us` from a store; every summary is computed by
    the store in SQL, so the rows read back are per rank, per link or per node, never per event.

    With `summaries=False` only the snapshot is read (three small queries): enough for crashes,
    hangs and op mismatches, which a supervisor checks far more often than the window summaries
    that stragglers, slow links and outliers need. A `snapshot` already read is used as it is."""
    snap = snapshot or load_snapshot(store, job=job, attempt=attempt, now_us=now_us,
                                     expected_ranks=expected_ranks)
    start = now_us - int(window_s * 1_000_000)
    if not summaries:
        return Observation(snapshot=snap, window_start_us=start, window_end_us=now_us)
    nodes = sorted(set(snap.expected_ranks.values()) | {str(hb.node) for hb in snap.heartbeats})
    # Outlier windows reach further back than the detection window: consecutive windows are the
    # point of the outlier model.
    node_start = now_us - 4 * int(window_s * 1_000_000)
    return Observation(
        snapshot=snap,
        window_start_us=start,
        window_end_us=now_us,
        ranks=store.rank_stats(job, attempt, start, now_us),
        links=store.link_stats(job, attempt, start, now_us),
        disagreements=tuple(store.disagreements(job, attempt, start, now_us)),
        stacks=tuple(store.latest_stacks(job, attempt, start)),
        health=tuple(store.health(nodes, start, now_us)),
        node_windows=store.node_windows(job, attempt, node_start, now_us,
                                        int(node_window_s * 1_000_000)),
    )
