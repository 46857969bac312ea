"""The records Tracehound keeps: what ranks did, how far they got, how they ended, what was done.

Each record kind is declared here once, as a frozen msgspec struct built with keyword arguments
only; `tracing.kinds` derives its wire form, validation, table and rows from the declaration.
Times are integer microseconds since the Unix epoch (UTC), so they survive every store and wire
format unchanged. Building a record validates nothing (but that floats are finite): `tracing.wire`
turns untrusted payloads into records and says what was wrong with the ones it rejects.
"""

from __future__ import annotations

import enum
import time
from typing import Annotated, ClassVar

import msgspec

from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.kinds import (
    BOUNDED,
    F64,
    I32,
    I64,
    MAX_U64,
    NON_EMPTY,
    NOT_STORED,
    U32,
    U64,
    Name,
    RecordBase,
    Stored,
    Text,
    column,
    integer,
    record_kind,
)

SCHEMA_VERSION = 1
"""Bumped whenever a record or a table changes shape."""

JobName = Annotated[JobId, NON_EMPTY]
NodeName = Annotated[NodeId, NON_EMPTY]
GroupName = Annotated[GroupId, NON_EMPTY, column("group_id")]
RankNo = Annotated[Rank, integer("UInt32", ge=0, le=2**31 - 1)]


def now_us() -> int:
    """The wall clock in microseconds, the unit of every timestamp here."""
    return time.time_ns() // 1000


class RankRecord(RecordBase, frozen=True):
    """What one rank of one attempt of a job reported (or what was seen of it): the fields every
    such kind starts with, in this order."""

    job: JobName
    attempt: U32
    node: NodeName
    rank: RankNo


BY_RANK_IN_TIME = ("job", "attempt", "rank", "time_us")
"""The sort order (and batch key) of the kinds read back per rank, newest first."""


class CollectiveState(enum.StrEnum):
    """How a collective ended, as seen by one rank."""

    COMPLETED = "completed"
    FAILED = "failed"


@record_kind
class CollectiveEvent(RankRecord, frozen=True, tag="collective"):
    """One rank's part in one collective or point-to-point operation."""

    TABLE: ClassVar[Stored] = Stored(
        "collectives", time="enqueue_us",
        # Replacing: a safety net that folds a row stored twice into one at merge time; queries
        # that must count every stored row read without FINAL.
        engine="ReplacingMergeTree",
        order_by=("job", "attempt", "group_id", "seq", "rank"),
        key=("job", "attempt", "group_id", "seq", "rank"),
    )

    group: GroupName
    seq: Annotated[int, integer("UInt64", ge=1, le=MAX_U64)]
    """Per-group sequence id, 1 for the first operation the group ran; the same on every member."""
    op: Name
    """`all_reduce`, `broadcast`, `barrier`, `send`, `recv`, ... (torch's function name)."""
    nbytes: U64
    dtype: Text
    peer: Annotated[int, integer("Int32", ge=-1, le=2**31 - 1)]
    """Global rank of the other side of a send/recv; -1 for collectives."""
    state: CollectiveState
    enqueue_us: U64
    complete_us: U64
    """When the operation finished (or failed) on this rank; 0 if it never did."""
    shape: Text = ""
    """Every tensor the call takes and fills, with its shape and dtype (`tracing.shapes`); ""
    when the source does not say."""


class GroupProgress(msgspec.Struct, frozen=True, kw_only=True):
    """How far one rank got in one process group, at the time of a heartbeat (kept in the
    heartbeat's row as one array column per field: `group_ids`, `group_last_enqueued`, ...)."""

    group: Annotated[GroupId, NON_EMPTY, column("ids")]
    last_enqueued: U64
    """Highest sequence id this rank has entered in the group (0: none yet)."""
    last_completed: U64
    """Highest sequence id this rank has seen complete in the group."""
    pending_op: Text
    """Op of `last_enqueued` while it has not completed, "" otherwise."""
    last_enqueue_us: U64
    last_complete_us: U64
    pending_nbytes: U64 = 0
    """Bytes this rank passes to the pending op (with `pending_dtype`, what a size or dtype
    mismatch that hangs is told by); 0 when none is pending."""
    pending_dtype: Text = ""
    """Dtype of the pending op; "" when none is pending, or from a recorder that predates it."""
    oldest_seq: U64 = 0
    """With several calls in flight (DDP's gradient buckets, ZeRO's prefetches), the oldest one
    this rank entered and has not seen complete: the call the group is blocked on, the one a
    mismatch that hangs is in. 0 when at most one call is pending (then it is `last_enqueued`)
    or from a recorder that predates it."""
    oldest_op: Text = ""
    """Op of `oldest_seq` ("" when it is 0)."""
    oldest_nbytes: U64 = 0
    """Bytes this rank passes to `oldest_seq`."""
    oldest_dtype: Text = ""
    """Dtype of `oldest_seq`."""
    pending_shape: Text = ""
    """Shape text (`tracing.shapes`) of the pending op; "" when none is pending or unknown."""
    oldest_shape: Text = ""
    """Shape text of `oldest_seq`."""


@record_kind
class Heartbeat(RankRecord, frozen=True, tag="heartbeat"):
    """A rank's periodic report of progress; it keeps coming while the main thread waits."""

    TABLE: ClassVar[Stored] = Stored(
        "heartbeats", time="time_us", order_by=BY_RANK_IN_TIME, key=BY_RANK_IN_TIME,
    )

    time_us: U64
    pid: U32
    step: U64
    """Training step the rank has reached (optimizer steps plus the step it resumed from)."""
    step_us: U64
    """When `step` was reached; 0 before the first step."""
    start_step: U64
    """The step this process resumed from (0 for a fresh start)."""
    first_step_us: U64
    """When this process finished its first step; 0 before that."""
    dropped: U64
    """Events the recorder in this process has dropped so far (full buffer, encoding failure)."""
    groups: Annotated[tuple[GroupProgress, ...], column("group")] = ()
    resumed_us: U64 = 0
    """When this process finished loading the checkpoint it resumed from; 0 for a fresh start
    (or a recorder that predates it). A restart's checkpoint-load phase ends here."""


@record_kind
class ProcessGroupInfo(RecordBase, frozen=True, tag="group"):
    """A process group as one rank created it: its id and the global ranks in it."""

    TABLE: ClassVar[Stored] = Stored(
        "process_groups", time="time_us", order_by=("job", "attempt", "group_id", "rank"),
        key=("job", "attempt", "group_id", "rank", "time_us"),
    )

    job: JobName
    attempt: U32
    rank: RankNo
    group: GroupName
    ranks: tuple[U32, ...]
    backend: Text
    time_us: U64


@record_kind
class RankExit(RankRecord, frozen=True, tag="exit"):
    """A rank's process ended. `exit_code` < 0 means it was killed by signal -exit_code
    (`EXIT_UNKNOWN`: it ended unwatched, how is not known)."""

    TABLE: ClassVar[Stored] = Stored(
        "rank_exits", time="time_us", order_by=BY_RANK_IN_TIME,
        key=("job", "attempt", "rank", "pid", "time_us"),
    )

    pid: U32
    exit_code: I32
    time_us: U64


EXIT_UNKNOWN = -1000
"""`RankExit.exit_code` of a process that ended while no controller was its parent (it was
adopted from a controller that died): it is gone, how it ended is not known."""


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


@record_kind
class HealthSample(RecordBase, frozen=True, tag="health"):
    """A device or host health reading or event (NVML, the host, or a simulator)."""

    TABLE: ClassVar[Stored] = Stored(
        "health", time="time_us",
        # Read by node and time, whatever the job (a node-wide reading has job "").
        order_by=("node", "time_us", "device", "metric"),
        key=("job", "node", "device", "time_us", "source", "metric"),
    )

    job: Annotated[JobId, BOUNDED]
    """The job running on the node at the time ("" when the reading is node-wide)."""
    node: NodeName
    device: Name
    """`gpu0`, `nic1`, `host`, ..."""
    time_us: U64
    source: Name
    """`nvml`, `host`, `simulated`, ..."""
    metric: Name
    """`xid`, `ecc_uncorrectable`, `remapped_rows`, `temperature_c`, `sm_clock_mhz`, `power_w`,
    `nvlink_errors`, `pcie_replays`, `nic_errors`, `throttle`, ..."""
    value: F64
    severity: HealthSeverity
    detail: Text = ""


@record_kind
class ClockReading(RecordBase, frozen=True, tag="clock"):
    """How far a node's clock was from the collector's, measured by the node agent from the
    round trip of a shipment (NTP's four timestamps: sent, received, replied, answered)."""

    TABLE: ClassVar[Stored] = Stored(
        "clock_readings", time="time_us", order_by=("job", "node", "time_us"),
        key=("job", "node", "time_us", "source"),
    )

    job: JobName
    node: NodeName
    time_us: U64
    """When it was measured, on the node's clock."""
    offset_us: I64
    """How far the node's clock reads ahead of the collector's (negative: behind)."""
    delay_us: U64
    """The round trip minus the collector's time handling it: the offset is good to half of it."""
    source: Name = "ingest"


@record_kind
class StackSample(RankRecord, frozen=True, tag="stack"):
    """One rank's Python stack at one moment, outermost frame first (`file:line function`)."""

    TABLE: ClassVar[Stored] = Stored(
        "stacks", time="time_us", order_by=BY_RANK_IN_TIME, key=BY_RANK_IN_TIME,
    )

    time_us: U64
    frames: tuple[Text, ...]


@record_kind
class ProcessSample(RankRecord, frozen=True, tag="process"):
    """What the node agent sees of one rank's process from outside (`/proc`): whether it runs,
    sleeps, is stopped or gone, and how much CPU and I/O it used lately. It tells a rank that is
    busy (writing a checkpoint, evaluating, loading data) from one that is frozen, even when the
    rank's own heartbeats cannot get out."""

    TABLE: ClassVar[Stored] = Stored(
        "processes", time="time_us", order_by=BY_RANK_IN_TIME,
        key=("job", "attempt", "rank", "pid", "time_us"),
    )

    pid: U32
    time_us: U64
    state: Name
    """The kernel's state letter (`R` running, `S` sleeping, `D` disk wait, `T` stopped, `t`
    traced, `Z` zombie, `X` dead), or `gone` when the process no longer exists."""
    cpu_s: F64
    """User plus system CPU seconds the process has used so far."""
    cpu_rate: F64
    """CPU seconds per second over the last sampling interval (0 when idle; above 1 with
    several busy threads)."""
    read_bytes: U64
    """Bytes the process has read from storage so far (0 where `/proc/PID/io` is unreadable)."""
    write_bytes: U64
    """Bytes the process has written to storage so far."""
    io_rate: F64
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
    RESUMED = "resumed"
    """The restarted job made its first step on every rank; the detail says where the
    restart's time went (`controller.restarts`)."""
    COMMAND = "command"
    """The watcher's `--on-incident` command ran for the incident (`tracehound watch`); the
    detail gives its exit status and the tail of its output."""
    ALERT = "alert"
    """An alert about the incident reached a receiver, or was set aside for good; the target is
    the receiver's name, the detail says which alert (firing, resolved) and what became of it.
    A record of what was said, never a step of the recovery: no decision reads it."""


@record_kind
class Action(RecordBase, frozen=True, tag="action"):
    """One step the controller took (or failed to take) for an incident."""

    TABLE: ClassVar[Stored] = Stored(
        "actions", time="time_us", order_by=("job", "incident_id", "time_us"), batch=False,
    )

    job: JobName
    incident_id: Name
    kind: ActionKind
    target: Text
    """What it acted on: a node id, an attempt number."""
    time_us: U64
    ok: bool
    detail: Text = ""
    rule: Text = ""
    """The policy rule that decided it: a path into the policy file (`rules.hang.isolate_from`,
    `max_restarts`, ...); "" for what no rule decides (a restart's `resumed` report)."""


@record_kind
class Incident(RecordBase, frozen=True, tag="incident"):
    """A diagnosed anomaly of one attempt of a job, with the verdict that explains it."""

    TABLE: ClassVar[Stored] = Stored(
        "incidents", time="detected_at_us", order_by=("job", "detected_at_us", "incident_id"),
        batch=False,
    )

    job: JobName
    incident_id: Name
    attempt: U32
    detected_at_us: U64
    kind: Name
    """An `IncidentKind` value (kept as text so that newer kinds read back from old code)."""
    culprit_ranks: tuple[I64, ...]
    culprit_nodes: tuple[Text, ...]
    confidence: F64
    summary: str
    verdict_json: str
    """The full verdict, evidence included, as the analysis serialized it."""
    schema_version: U32 = SCHEMA_VERSION
    actions: Annotated[tuple[Action, ...], NOT_STORED] = ()
    """Filled in when read back from a store; ignored when recorded."""


class JobPhase(enum.StrEnum):
    """Where a supervised job is (`JobState.state`); `controller.jobstate` says which state
    follows which."""

    RUNNING = "running"
    """An attempt is running and nothing is wrong with it."""
    SUSPECT = "suspect"
    """A soft fault was seen and recorded; the controller acts if it is seen again."""
    STALLED = "stalled"
    """Ranks wait without progress while some of them are busy outside collectives: alerted,
    watched through the busy grace."""
    DIAGNOSING = "diagnosing"
    """A verdict became an incident and its plan is being carried out (the stop comes first)."""
    ISOLATING = "isolating"
    """The plan's nodes are being isolated."""
    RESTARTING = "restarting"
    """The next attempt is about to be launched (written before the launch)."""
    FAILED = "failed"
    """The run ended without finishing the training (gave up, timed out, out of nodes)."""
    FINISHED = "finished"
    """Every rank of the last attempt exited cleanly."""


@record_kind
class JobState(RecordBase, frozen=True, tag="state"):
    """One step of a job's state machine, as the controller wrote it before acting on it: the
    latest one is where a controller started again picks the job up."""

    TABLE: ClassVar[Stored] = Stored(
        "job_states", time="time_us", order_by=("job", "time_us", "seq"), batch=False,
    )

    job: JobName
    time_us: U64
    seq: U32
    """Counts the job's state records (from 1): orders those written in the same microsecond."""
    state: JobPhase
    attempt: U32
    """The attempt the state is about (for `restarting`: the one about to be launched)."""
    incident_id: Text = ""
    """The incident being acted on (diagnosing, isolating, restarting) or watched."""
    nodes: tuple[Text, ...] = ()
    """The attempt's nodes in node-rank order."""
    isolated: tuple[Text, ...] = ()
    """Every node isolated so far in this run."""
    plan: Text = ""
    """While acting: the plan's steps as JSON (kind, target, reason, rule), so a controller
    started again finishes the same plan."""
    detail: Text = ""
    controller: Text = ""
    """Who wrote it: host and process id of the controller."""


Record = (
    CollectiveEvent | Heartbeat | ProcessGroupInfo | RankExit | HealthSample | StackSample
    | ProcessSample | ClockReading
)
"""What a batch carries from the ranks to the store."""


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    """Records shipped together. `batch_id` is unique per batch and stable across retries, so a
    store can tell a retried batch it already holds from a new one."""

    batch_id: Annotated[str, NON_EMPTY]
    records: tuple[Record, ...]
