"""The trace store ports: what the rest of Tracehound may ask of a store.

`TraceStore` is what the controller, the analysis and the dashboard read and write: batches in,
the latest state of an attempt and the window summaries out, incidents and actions both ways.
`BulkStore` adds the paths of tools and tests: the simulator's columnar insert, raw collective
rows and keys, and every record of a kind (for `tracehound export`).

Two adapters implement both, chosen by URL (`store.factory.open_store`):

- `clickhouse://user:password@host:9000/database`: a ClickHouse server over the native protocol
  (`store.server`); every node agent can write to it directly.
- `chdb:///path/to/dir`: ClickHouse embedded in this process (`store.embedded`), the zero-setup
  default on one machine. Only one process may open a path, so node agents ship their batches to
  the process that owns it (`store.ingest`) instead, and the other processes of the machine
  reach the store through that process too (`store.sharing`, `store.client`: the same port, its
  calls as requests).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tracehound.tracing.events import (
    Action,
    ActionKind,
    Batch,
    ClockReading,
    CollectiveEvent,
    HealthSample,
    Heartbeat,
    Incident,
    JobState,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import JobId

FOREVER_US = 2**63 - 1
"""A time after every record: "no upper bound"."""

if TYPE_CHECKING:  # numpy is imported by the adapters, not by the port
    from tracehound.tracing.kinds import RecordBase
    from tracehound.tracing.summaries import (
        ClockCorrection,
        ClockSamples,
        CollectiveColumns,
        Disagreements,
        LatenessSeries,
        LinkStats,
        NodeWindows,
        ProgressGrid,
        RankStats,
    )

@dataclass(frozen=True, slots=True)
class InsertReport:
    """What a store did with a batch."""

    inserted: int
    """Records written now."""
    skipped: int
    """Records the store already held from an earlier try of the same batch."""


@dataclass(frozen=True, slots=True)
class CollectiveKey:
    """The identity of one rank's part in one collective; unique in a store."""

    attempt: int
    rank: int
    group: str
    seq: int


class TraceStore(Protocol):
    """A place that keeps traces. Implementations must be safe to call from several threads."""

    @property
    def url(self) -> str:
        """The store's URL with any password masked, for messages and logs."""
        ...

    def ensure_schema(self) -> None:
        """Create the database and tables if they are missing (idempotent)."""
        ...

    def insert(self, batch: Batch, *, maybe_duplicate: bool = False) -> InsertReport:
        """Write a batch. With `maybe_duplicate` (a retry whose earlier try may have landed),
        records the store already holds from this batch id are skipped, so a retried batch is
        stored exactly once."""
        ...

    def latest_heartbeats(self, job: JobId, attempt: int,
                          until_us: int = FOREVER_US) -> list[Heartbeat]:
        """The newest heartbeat of every rank of an attempt sent at or before `until_us`,
        ordered by rank."""
        ...

    def exits(self, job: JobId, attempt: int) -> list[RankExit]:
        """Every rank exit of an attempt, earliest first."""
        ...

    def groups(self, job: JobId, attempt: int) -> list[ProcessGroupInfo]:
        """One entry per process group of an attempt (its members as first reported)."""
        ...

    def attempts(self, job: JobId) -> list[int]:
        """The attempts of a job that left any record, ascending."""
        ...

    def jobs(self) -> list[JobId]:
        """Every job with records or incidents, sorted."""
        ...

    def rank_stats(self, job: JobId, attempt: int, start_us: int, end_us: int, *,
                   clock: ClockCorrection | None = None) -> RankStats:
        """Per-rank arrival statistics of the window [start_us, end_us), computed by the store
        (definitions: `tracing.summaries`), on node clocks corrected by `clock` when given."""
        ...

    def link_stats(self, job: JobId, attempt: int, start_us: int, end_us: int, *,
                   clock: ClockCorrection | None = None) -> LinkStats:
        """Per-(src, dst) point-to-point transfer statistics of the window."""
        ...

    def clock_readings(self, job: JobId, since_us: int) -> list[ClockReading]:
        """Per node of the job, its node agent's most exact clock reading (shortest round
        trip) taken at or after `since_us`, ordered by node."""
        ...

    def clock_samples(self, job: JobId, attempt: int, start_us: int, end_us: int,
                      width_us: int) -> ClockSamples:
        """Per (group, node, bucket of `width_us`): how far the node's completion times sit
        from those of its collectives' other members: what node clock offsets are estimated
        from."""
        ...

    def disagreements(
        self, job: JobId, attempt: int, start_us: int, end_us: int, limit: int = 100, *,
        uneven_ops: tuple[str, ...] = (),
    ) -> Disagreements:
        """The first `limit` (at least 1) collectives of the window, in group order then by
        seq, whose ranks disagree on op, nbytes or dtype, and how many more there were
        (`Disagreements.dropped`). A collective of one op of `uneven_ops` and one dtype whose
        sizes alone differ is no disagreement and never counts against the limit (the op names
        are bound values, never formatted into SQL)."""
        ...

    def node_windows(
        self, job: JobId, attempt: int, start_us: int, end_us: int, window_us: int, *,
        clock: ClockCorrection | None = None,
    ) -> NodeWindows:
        """Per-node arrival features in consecutive windows of `window_us` from `start_us`."""
        ...

    def progress_grid(self, job: JobId, attempt: int, group: str, *, last_seqs: int = 64,
                      rank_buckets: int = 256) -> ProgressGrid:
        """The ranks x recent seqs grid of one process group of an attempt, aggregated by the
        store (definitions: `tracing.summaries.ProgressGrid`): per (bucket of ranks, seq) of the
        group's last `last_seqs` seqs the rows, failures and arrival lateness, and per bucket
        the progress the ranks' latest heartbeats report, with at most `rank_buckets` buckets.
        ValueError for last_seqs or rank_buckets below 1."""
        ...

    def lateness_series(self, job: JobId, attempt: int, start_us: int, end_us: int,
                        width_us: int, *, top: int = 8) -> LatenessSeries:
        """The `top` latest-arriving ranks of the window [start_us, end_us) and their arrival
        lateness per time bucket of `width_us`, against the median lateness of all ranks per
        bucket (definitions: `tracing.summaries.LatenessSeries`). ValueError unless
        start_us < end_us, width_us > 0 (at most `summaries.MAX_BUCKETS` buckets) and top >= 1."""
        ...

    def recorded_reach(self, job: JobId, attempt: int, group: str, ranks: Sequence[int], *,
                       from_seq: int, until_us: int) -> dict[int, int]:
        """Per rank of `ranks`, the highest sequence id of its stored collective records in
        `group` from `from_seq` on, enqueued by `until_us` (its rank's clock); ranks with no
        such record are left out. How far a rank got by what it shipped, which can be ahead of
        its last heartbeat."""
        ...

    def latest_stacks(self, job: JobId, attempt: int, since_us: int) -> list[StackSample]:
        """The newest stack sample of every rank taken at or after `since_us`, ordered by rank."""
        ...

    def latest_processes(self, job: JobId, attempt: int, since_us: int) -> list[ProcessSample]:
        """The newest process sample of every rank taken at or after `since_us`, ordered by
        rank."""
        ...

    def health(self, nodes: Sequence[str], start_us: int, end_us: int, *,
               events_since_us: int | None = None) -> list[HealthSample]:
        """Health samples of `nodes` in [start_us, end_us), whatever job they name, and the
        warning and critical ones (events, not plain metrics) from `events_since_us` on where
        that is earlier; oldest first."""
        ...

    def record_incident(self, incident: Incident) -> None:
        ...

    def record_action(self, action: Action) -> None:
        ...

    def drop_days_before(self, day: int, *, dry_run: bool = False) -> dict[str, list[int]]:
        """Retention: drop the daily partitions (`YYYYMMDD`, UTC) of every table older than
        `day`; the days dropped (or that would be, with `dry_run`) by table."""
        ...

    def record_state(self, state: JobState) -> None:
        """Store one step of a job's state machine."""
        ...

    def job_states(self, job: JobId) -> list[JobState]:
        """Every stored state of a job, in the order written (by `seq`)."""
        ...

    def incidents(self, job: JobId | None = None) -> list[Incident]:
        """Incidents, oldest first, each with its actions."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class BulkStore(TraceStore, Protocol):
    """A store's paths for tools and tests; both adapters implement them (see `bulk`)."""

    def collective_keys(self, job: JobId) -> list[CollectiveKey]:
        """Every stored collective row's key, duplicates included (used to prove no loss and no
        double storage)."""
        ...

    def insert_columns(
        self,
        job: JobId,
        attempt: int,
        cols: CollectiveColumns,
        node_of_rank: Mapping[int, str],
        *,
        batch_id: str,
    ) -> int:
        """Write collective rows given as columns (the simulator's bulk path) in ONE insert and
        return how many were written; each row's node is `node_of_rank[rank]`.

        No retry check is made (unlike `insert(maybe_duplicate=True)`): call it once per
        `batch_id`. ClickHouse writes an insert block by block (up to 1,048,576 rows each, its
        `max_insert_block_size`), so a call of up to that many rows is all-or-nothing and a larger
        one that fails may have stored a prefix (its rows carry `batch_id`). Raises ValueError
        for columns of unequal length, negative counts or times, or a rank without a node."""
        ...

    def collectives(self, job: JobId, attempt: int) -> list[CollectiveEvent]:
        """Every stored collective row of an attempt, ordered by group, seq, rank."""
        ...

    def records(self, kind: type[RecordBase], job: JobId, *,
                stored_by_us: int | None = None) -> list[Any]:
        """Every stored record of one kind of a job (any registered kind), oldest first; for
        incidents, without their actions (those are records of their own). With
        `stored_by_us`, only those that had reached the store by then, by the store's clock to
        the second (`schema.ARRIVAL`): what a verdict made at that time could have read."""
        ...


@dataclass(slots=True)
class HeldRecords:
    """The identities of the incidents and actions a store holds for some jobs: what a writer
    checks before writing one again (a retry whose first try may have landed, a trace file loaded
    twice). An incident is known by (job, id, detection time): ids restart with each supervisor.
    An action by (job, incident id, kind, target, time)."""

    incidents: set[tuple[str, str, int]]
    actions: set[tuple[str, str, str, str, int]]
    states: set[tuple[str, int, int]] = field(default_factory=set)
    """Job states by (job, seq, time)."""

    @classmethod
    def read(cls, store: TraceStore, jobs: Iterable[str]) -> HeldRecords:
        """What `store` holds of `jobs` now (one `incidents` read per job)."""
        held = cls(set(), set())
        for job in jobs:
            for incident in store.incidents(JobId(job)):
                held.add(incident)
                for action in incident.actions:
                    held.add(action)
            for state in store.job_states(JobId(job)):
                held.add(state)
        return held

    def has(self, record: Incident | Action | JobState) -> bool:
        if isinstance(record, Incident):
            return _incident_key(record) in self.incidents
        if isinstance(record, JobState):
            return (record.job, record.seq, record.time_us) in self.states
        return _action_key(record) in self.actions

    def add(self, record: Incident | Action | JobState) -> None:
        if isinstance(record, Incident):
            self.incidents.add(_incident_key(record))
        elif isinstance(record, JobState):
            self.states.add((record.job, record.seq, record.time_us))
        else:
            self.actions.add(_action_key(record))


def _incident_key(incident: Incident) -> tuple[str, str, int]:
    return (incident.job, incident.incident_id, incident.detected_at_us)


def _action_key(action: Action) -> tuple[str, str, str, str, int]:
    return (action.job, action.incident_id, ActionKind(action.kind).value, action.target,
            action.time_us)


def bulk(store: TraceStore) -> BulkStore:
    """`store` as a BulkStore; TypeError naming the store if it has no bulk paths."""
    if not isinstance(store, BulkStore):
        raise TypeError(f"store {store.url} has no bulk paths (insert_columns, records)")
    return store
