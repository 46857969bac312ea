"""What the analysis looks at: the state of one attempt of a job at one moment."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from tracehound.tracing.events import (
    Heartbeat,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    Record,
    StackSample,
)
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import FOREVER_US, TraceStore
from tracehound.tracing.wire import InvalidRecord, decode_records, encode


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
    processes: tuple[ProcessSample, ...] = ()
    """The newest process sample of each rank (node agent, `/proc`), where there is one."""
    stacks: tuple[StackSample, ...] = ()
    """The newest stack sample of each rank taken lately, where there is one."""
    recorded: Mapping[tuple[int, str], int] = field(default_factory=dict)
    """(rank, group) -> the highest sequence id of the rank's stored collective records in the
    group as of `now_us`, where it was read (`with_recorded`: for the ranks a hang leads to).
    A rank ships its records as it completes them and beats its heart about once a second, so
    in a burst of collectives (FSDP: dozens a second) its records are ahead of its last
    heartbeat; stopped in the burst, they stay ahead."""

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


SAMPLES_HORIZON_S = 120.0
"""Process and stack samples older than this are not read into a snapshot."""


def load_snapshot(
    store: TraceStore,
    *,
    job: JobId,
    attempt: int,
    now_us: int,
    expected_ranks: Mapping[int, str] | None = None,
    until_us: int = FOREVER_US,
) -> JobSnapshot:
    """Read what the analysis needs from a store (five small queries, aggregated in SQL);
    heartbeats and exits as they were at `until_us` (default: the newest)."""
    since = now_us - int(SAMPLES_HORIZON_S * 1_000_000)
    return JobSnapshot(
        job=job,
        attempt=attempt,
        now_us=now_us,
        heartbeats=tuple(store.latest_heartbeats(job, attempt, until_us)),
        exits=tuple(e for e in store.exits(job, attempt) if e.time_us <= until_us),
        groups=tuple(store.groups(job, attempt)),
        expected_ranks=dict(expected_ranks or {}),
        processes=tuple(store.latest_processes(job, attempt, since)),
        stacks=tuple(store.latest_stacks(job, attempt, since)),
    )


def with_recorded(store: TraceStore, snap: JobSnapshot,
                  wanted: Mapping[str, tuple[int, Sequence[int]]]) -> JobSnapshot:
    """`snap` with the stored reach (`JobSnapshot.recorded`) of some ranks read in: `wanted`
    maps a group to (the sequence id from which records count, its ranks). Records enqueued
    after `now_us` (by their rank's clock) do not count. One small query per group (the
    order key's range: job, attempt, group, seq); `snap` as it is when nothing is ahead."""
    found = dict(snap.recorded)
    for group, (from_seq, ranks) in sorted(wanted.items()):
        if not ranks:
            continue
        reach = store.recorded_reach(snap.job, snap.attempt, group, sorted(set(ranks)),
                                     from_seq=max(from_seq, 1), until_us=snap.now_us)
        for rank, seq in reach.items():
            if seq > found.get((rank, group), 0):
                found[(rank, group)] = seq
    if found == dict(snap.recorded):
        return snap
    return replace(snap, recorded=found)


def snapshot_to_json(snap: JobSnapshot) -> str:
    """A snapshot as JSON (records in their wire form), for golden traces and incident evidence."""
    records: list[Record] = [
        *snap.heartbeats, *snap.exits, *snap.groups, *snap.processes, *snap.stacks,
    ]
    return json.dumps(
        {
            "job": snap.job,
            "attempt": snap.attempt,
            "now_us": snap.now_us,
            "expected_ranks": {str(r): n for r, n in sorted(snap.expected_ranks.items())},
            "records": [encode(r) for r in records],
            "recorded": [[r, g, seq] for (r, g), seq in sorted(snap.recorded.items())],
        },
        indent=1,
    )


def snapshot_from_json(text: str) -> JobSnapshot:
    """The inverse of `snapshot_to_json`; bad records raise `InvalidRecord` naming the field."""
    raw = json.loads(text)
    records, rejected = decode_records(raw["records"])
    if rejected:
        raise InvalidRecord(f"record {rejected[0].index}: {rejected[0].reason}")
    return JobSnapshot(
        job=JobId(raw["job"]),
        attempt=int(raw["attempt"]),
        now_us=int(raw["now_us"]),
        heartbeats=tuple(r for r in records if isinstance(r, Heartbeat)),
        exits=tuple(r for r in records if isinstance(r, RankExit)),
        groups=tuple(r for r in records if isinstance(r, ProcessGroupInfo)),
        expected_ranks={int(r): str(n) for r, n in raw.get("expected_ranks", {}).items()},
        processes=tuple(r for r in records if isinstance(r, ProcessSample)),
        stacks=tuple(r for r in records if isinstance(r, StackSample)),
        recorded={(int(r), str(g)): int(seq) for r, g, seq in raw.get("recorded", [])},
    )
