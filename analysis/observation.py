"""Everything the analysis may look at for one detection window of one attempt.

The snapshot (latest heartbeats, exits, groups) is always there; the window summaries, stack
samples and health samples are there when the store (or the simulator) has them. Detectors read
what they need and ignore the rest, so a partial observation gives fewer verdict kinds, never a
wrong one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from tracehound.analysis.clocks import (
    ClockEstimate,
    clock_bucket_us,
    estimate_clocks,
    with_readings,
)
from tracehound.analysis.settings import UNEVEN_OPS
from tracehound.analysis.snapshot import JobSnapshot, load_snapshot
from tracehound.tracing.events import HealthSample, HealthSeverity, StackSample
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore
from tracehound.tracing.summaries import Disagreement, LinkStats, NodeWindows, RankStats

HEALTH_LOOKBACK_S = 600.0
"""How far before the window an observation holds health events: a fault that stopped a rank
(an Xid, a GPU fallen off the bus) is reported once, near the stop, and explains the stop for
as long as it lasts (`DetectionSettings.hang.busy_grace_s`)."""


def window_health(samples: Iterable[HealthSample], start_us: int, end_us: int, *,
                  lookback_s: float = HEALTH_LOOKBACK_S) -> tuple[HealthSample, ...]:
    """What an observation of [start_us, end_us) holds of `samples` (`Observation.health`):
    those in the window, and the warning and critical ones of `lookback_s` before it."""
    earliest = start_us - int(lookback_s * 1_000_000)
    return tuple(h for h in samples if h.time_us < end_us and (
        h.time_us >= start_us
        or (h.time_us >= earliest and h.severity is not HealthSeverity.INFO)))


@dataclass(frozen=True, slots=True, kw_only=True)
class Observation:
    snapshot: JobSnapshot
    window_start_us: int
    window_end_us: int
    ranks: RankStats | None = None
    links: LinkStats | None = None
    disagreements: tuple[Disagreement, ...] = ()
    """Collectives whose ranks disagree, in group order (`tracing.summaries`), up to a limit."""
    disagreements_dropped: int = 0
    """How many more disagreeing collectives the window held past that limit."""
    stacks: tuple[StackSample, ...] = ()
    """The newest stack sample of each rank that has one."""
    health: tuple[HealthSample, ...] = ()
    """Health samples of the job's nodes in the window (events and metrics), and the events
    (warning and critical samples) of the `HEALTH_LOOKBACK_S` before it."""
    node_windows: NodeWindows | None = None
    """Per-node features over consecutive windows ending at window_end_us."""
    clocks: ClockEstimate | None = None
    """Node clock offsets estimated from the trace (the summaries above are on the clocks it
    corrects); None when nobody estimated them."""

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
    uneven_ops: tuple[str, ...] = UNEVEN_OPS,
    min_collectives: int = 24,
    max_window_s: float = 900.0,
    health_lookback_s: float = HEALTH_LOOKBACK_S,
    since_us: int = 0,
) -> Observation:
    """Read one detection window ending at `now_us` from a store; every summary is computed by
    the store in SQL, so the rows read back are per rank, per link or per node, never per event.

    With `summaries=False` only the snapshot and the window's health events (warnings and
    critical samples, no plain readings) are read (four small queries): enough for crashes,
    hangs and op mismatches, which a supervisor checks far more often than the window summaries
    that stragglers, slow links and outliers need; the health events are what tells a hang of a
    lost GPU from a frozen process. A `snapshot` already read is used as it is.
    Collectives of `uneven_ops` whose sizes alone differ are no disagreement (pass the detection
    settings' `mismatch_size_exempt_ops`).

    `window_s` is the shortest window: where the median rank has fewer than `min_collectives`
    collectives in it (steps of tens of seconds), the window widens, up to `max_window_s`, until
    it holds that many, and the per-node windows widen with it. Node clock offsets are estimated
    first (`analysis.clocks`) and every summary compares times on the clocks they correct.
    Health events are read from `health_lookback_s` before the window on (`HEALTH_LOOKBACK_S`).
    The summaries' window never starts before `since_us` (an attempt's warm-up ends there), nor
    widens past it."""
    snap = snapshot or load_snapshot(store, job=job, attempt=attempt, now_us=now_us,
                                     expected_ranks=expected_ranks)
    start = now_us - int(window_s * 1_000_000)
    nodes = sorted(set(snap.expected_ranks.values()) | {str(hb.node) for hb in snap.heartbeats})
    if not summaries:
        # events only: with the readings' start at the window's end, the store's severity
        # filter keeps the warnings and critical samples since the lookback
        events = store.health(nodes, now_us, now_us,
                              events_since_us=start - int(health_lookback_s * 1_000_000))
        return Observation(snapshot=snap, window_start_us=start, window_end_us=now_us,
                           health=tuple(events))
    widest_us = int(max_window_s * 1_000_000)
    if since_us:
        widest_us = max(1, min(widest_us, now_us - since_us))
    window_us = min(int(window_s * 1_000_000), widest_us)
    clocks, ranks = _ranks_and_clocks(store, job, attempt, now_us, window_us)
    # Judge over collectives, not seconds: a job with long steps has few collectives in the
    # window, so the window widens until the median rank has `min_collectives` of them.
    for _ in range(_WIDENINGS):
        have = float(np.median(ranks.n)) if ranks.n.size else 0.0
        if have >= min_collectives or window_us >= widest_us:
            break
        factor = min_collectives / have * 1.2 if have > 0 else 6.0
        window_us = min(int(window_us * max(factor, 1.5)), widest_us)
        clocks, ranks = _ranks_and_clocks(store, job, attempt, now_us, window_us)
    start = now_us - window_us
    scale = window_us / (window_s * 1_000_000)
    # Outlier windows reach further back than the detection window: consecutive windows are the
    # point of the outlier model.
    node_start = now_us - 4 * window_us
    clock = clocks.correction() if clocks.nodes else None
    disagreements = store.disagreements(job, attempt, start, now_us, uneven_ops=uneven_ops)
    return Observation(
        snapshot=snap,
        window_start_us=start,
        window_end_us=now_us,
        clocks=clocks,
        ranks=ranks,
        links=store.link_stats(job, attempt, start, now_us, clock=clock),
        disagreements=tuple(disagreements),
        disagreements_dropped=disagreements.dropped,
        stacks=tuple(store.latest_stacks(job, attempt, start)),
        health=tuple(store.health(
            nodes, start, now_us,
            events_since_us=start - int(health_lookback_s * 1_000_000))),
        node_windows=store.node_windows(job, attempt, node_start, now_us,
                                        max(1, int(node_window_s * scale * 1_000_000)),
                                        clock=clock),
    )


READINGS_REACH_US = 600_000_000
"""Node agents' clock readings this old still count (they measure every 30 s)."""

_WIDENINGS = 4
"""At most this many times a sparse window is widened (each by the factor the collectives seen
so far call for, at least 1.5x; 6x when there were none)."""


def _ranks_and_clocks(store: TraceStore, job: JobId, attempt: int, now_us: int,
                      window_us: int) -> tuple[ClockEstimate, RankStats]:
    """Clock offsets over the outlier model's reach (four windows, so drift shows) and the rank
    statistics of the window on the clocks they correct."""
    reach = now_us - 4 * window_us
    clocks = with_readings(
        estimate_clocks(store.clock_samples(job, attempt, reach, now_us,
                                            clock_bucket_us(reach, now_us))),
        store.clock_readings(job, min(reach, now_us - READINGS_REACH_US)), now_us=now_us)
    clock = clocks.correction() if clocks.nodes else None
    return clocks, store.rank_stats(job, attempt, now_us - window_us, now_us, clock=clock)
