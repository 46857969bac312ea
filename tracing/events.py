"""The records Tracehound keeps: what ranks did, how far they got, how they ended, what was done.

Records are frozen dataclasses built with keyword arguments only. Times are integer microseconds
since the Unix epoch (UTC), so they survive every store and wire format unchanged. This module
validates nothing: `tracing.wire` turns untrusted payloads into these records and says what was
wrong with the ones it rejects.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank

SCHEMA_VERSION = 1
"""Bumped whenever a record or a table changes shape."""


def now_us() -> int:
    """The wall clock in microseconds, the unit of every timestamp here."""
    return time.time_ns() // 1000


class CollectiveState(enum.StrEnum):
    """How a collective ended, as seen by one rank."""

    COMPLETED = "completed"
    FAILED = "failed"


@dataclass(frozen=True, slots=True, kw_only=True)
class CollectiveEvent:
    """One rank's part in one collective or point-to-point operation."""

    job: JobId
    attempt: int
    node: NodeId
    rank: Rank
    group: GroupId
    seq: int
    """Per-group sequence id, 1 for the first operation the group ran; the same on every member."""
    op: str
    """`all_reduce`, `broadcast`, `barrier`, `send`, `recv`, ... (torch's function name)."""
    nbytes: int
    dtype: str
    peer: int
    """Global rank of the other side of a send/recv; -1 for collectives."""
    state: CollectiveState
    enqueue_us: int
    complete_us: int
    """When the operation finished (or failed) on this rank; 0 if it never did."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupProgress:
    """How far one rank got in one process group, at the time of a heartbeat."""

    group: GroupId
    last_enqueued: int
    """Highest sequence id this rank has entered in the group (0: none yet)."""
    last_completed: int
    """Highest sequence id this rank has seen complete in the group."""
    pending_op: str
    """Op of `last_enqueued` while it has not completed, "" otherwise."""
    last_enqueue_us: int
    last_complete_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """A rank's periodic report of progress; it keeps coming while the main thread waits."""

    job: JobId
    attempt: int
    node: NodeId
    rank: Rank
    time_us: int
    pid: int
    step: int
    """Training step the rank has reached (optimizer steps plus the step it resumed from)."""
    step_us: int
    """When `step` was reached; 0 before the first step."""
    start_step: int
    """The step this process resumed from (0 for a fresh start)."""
    first_step_us: int
    """When this process finished its first step; 0 before that."""
    dropped: int
    """Events the recorder in this process has dropped so far (full buffer, encoding failure)."""
    groups: tuple[GroupProgress, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessGroupInfo:
    """A process group as one rank created it: its id and the global ranks in it."""

    job: JobId
    attempt: int
    rank: Rank
    group: GroupId
    ranks: tuple[int, ...]
    backend: str
    time_us: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankExit:
    """A rank's process ended. `exit_code` < 0 means it was killed by signal -exit_code."""

    job: JobId
    attempt: int
    node: NodeId
    rank: Rank
    pid: int
    exit_code: int
    time_us: int


class IncidentKind(enum.StrEnum):
    """What went wrong. Later analyses add kinds; stored values never change meaning."""

    HANG = "hang"
    """Ranks wait in a collective that others never reach (or never finish)."""
    CRASH = "crash"
    """A rank's process ended with a failure."""
    MISMATCH = "mismatch"
    """The ranks of a group disagree on the op, size, dtype or order of a collective."""
    STRAGGLER = "straggler"
    """A rank computes slower than its peers and keeps them waiting at every collective."""
    SLOW_LINK = "slow_link"
    """Transfers between two ranks (or to one node) are slower than between the others."""
    HARDWARE = "hardware"
    """A device's own health report coincides in time and place with the anomaly."""
    SILENT_HANG = "silent_hang"
    """No progress, or collapsed progress, that collective traces alone do not localize; the
    ranks' stack traces single out the culprits."""
    NODE_OUTLIER = "node_outlier"
    """A machine stays an outlier among similar machines over consecutive windows."""
    STALL = "stall"
    """Peers wait on a rank that is alive and busy outside collectives (writing a checkpoint,
    evaluating, compiling, loading data): recorded and watched, never acted on until the busy
    grace has passed."""


class HealthSeverity(enum.StrEnum):
    """How bad a health sample is. INFO samples are plain metrics (temperature, clocks)."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthSample:
    """A device or host health reading or event (NVML, the host, or a simulator)."""

    job: JobId
    """The job running on the node at the time ("" when the reading is node-wide)."""
    node: NodeId
    device: str
    """`gpu0`, `nic1`, `host`, ..."""
    time_us: int
    source: str
    """`nvml`, `host`, `simulated`, ..."""
    metric: str
    """`xid`, `ecc_uncorrectable`, `remapped_rows`, `temperature_c`, `sm_clock_mhz`, `power_w`,
    `nvlink_errors`, `pcie_replays`, `nic_errors`, `throttle`, ..."""
    value: float
    severity: HealthSeverity
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StackSample:
    """One rank's Python stack at one moment, outermost frame first (`file:line function`)."""

    job: JobId
    attempt: int
    node: NodeId
    rank: Rank
    time_us: int
    frames: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessSample:
    """What the node agent sees of one rank's process from outside (`/proc`): whether it runs,
    sleeps, is stopped or gone, and how much CPU and I/O it used lately. It tells a rank that is
    busy (writing a checkpoint, evaluating, loading data) from one that is frozen, even when the
    rank's own heartbeats cannot get out."""

    job: JobId
    attempt: int
    node: NodeId
    rank: Rank
    pid: int
    time_us: int
    state: str
    """The kernel's state letter (`R` running, `S` sleeping, `D` disk wait, `T` stopped, `t`
    traced, `Z` zombie, `X` dead), or `gone` when the process no longer exists."""
    cpu_s: float
    """User plus system CPU seconds the process has used so far."""
    cpu_rate: float
    """CPU seconds per second over the last sampling interval (0 when idle; above 1 with
    several busy threads)."""
    read_bytes: int
    """Bytes the process has read from storage so far (0 where `/proc/PID/io` is unreadable)."""
    write_bytes: int
    """Bytes the process has written to storage so far."""
    io_rate: float
    """Bytes per second read plus written over the last sampling interval."""


class ProcessState(enum.StrEnum):
    """The values of `ProcessSample.state` that mean something to the analysis."""

    RUNNING = "R"
    SLEEPING = "S"
    DISK_WAIT = "D"
    STOPPED = "T"
    TRACED = "t"
    ZOMBIE = "Z"
    DEAD = "X"
    GONE = "gone"


class ActionKind(enum.StrEnum):
    """What the controller did about an incident."""

    ISOLATE_NODE = "isolate_node"
    STOP_JOB = "stop_job"
    RESTART = "restart"
    GIVE_UP = "give_up"
    OBSERVE = "observe"
    """A soft fault was recorded; the controller acts if it is seen again."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Action:
    """One step the controller took (or failed to take) for an incident."""

    job: JobId
    incident_id: str
    kind: ActionKind
    target: str
    """What it acted on: a node id, an attempt number."""
    time_us: int
    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Incident:
    """A diagnosed anomaly of one attempt of a job, with the verdict that explains it."""

    job: JobId
    incident_id: str
    attempt: int
    detected_at_us: int
    kind: str
    """An `IncidentKind` value (kept as text so that newer kinds read back from old code)."""
    culprit_ranks: tuple[int, ...]
    culprit_nodes: tuple[str, ...]
    confidence: float
    summary: str
    verdict_json: str
    """The full verdict, evidence included, as the analysis serialized it."""
    schema_version: int = SCHEMA_VERSION
    actions: tuple[Action, ...] = field(default=())
    """Filled in when read back from a store; ignored when recorded."""


Record = (
    CollectiveEvent | Heartbeat | ProcessGroupInfo | RankExit | HealthSample | StackSample
    | ProcessSample
)
"""What a batch carries from the ranks to the store."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Records shipped together. `batch_id` is unique per batch and stable across retries, so a
    store can tell a retried batch it already holds from a new one."""

    batch_id: str
    records: tuple[Record, ...]
