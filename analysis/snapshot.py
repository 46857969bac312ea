"""What the analysis looks at: the state of one attempt of a job at one moment."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tracehound.tracing.events import Heartbeat, ProcessGroupInfo, RankExit
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSnapshot:
    """Latest heartbeats, exits and process groups of an attempt, as of `now_us`."""

    job: JobId
    attempt: int
    now_us: int
    heartbeats: tuple[Heartbeat, ...]
    """The newest heartbeat of each rank that has sent one."""
    exits: tuple[RankExit, ...] = ()
    groups: tuple[ProcessGroupInfo, ...] = ()
    expected_ranks: Mapping[int, str] = field(default_factory=dict)
    """Rank -> node for every rank the launcher started (may be empty when unknown)."""

    def node_of(self, rank: int) -> str:
        """The node a rank ran on, from whatever record names it."""
        if rank in self.expected_ranks:
            return self.expected_ranks[rank]
        for hb in self.heartbeats:
            if hb.rank == rank:
                return hb.node
        for ex in self.exits:
            if ex.rank == rank:
                return ex.node
        return "unknown"


def load_snapshot(
    store: TraceStore,
    *,
    job: JobId,
    attempt: int,
    now_us: int,
    expected_ranks: Mapping[int, str] | None = None,
) -> JobSnapshot:
    """Read what the analysis needs from a store (three small queries, aggregated in SQL)."""
    return JobSnapshot(
        job=job,
        attempt=attempt,
        now_us=now_us,
        heartbeats=tuple(store.latest_heartbeats(job, attempt)),
        exits=tuple(store.exits(job, attempt)),
        groups=tuple(store.groups(job, attempt)),
        expected_ranks=dict(expected_ranks or {}),
    )
