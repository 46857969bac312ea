"""The hand-written JSON codec Tracehound used before records were declared once (kept only so
`bench/codec.py` can measure the old and the new codec side by side on the same records).

The JSON wire form of records, and the one place untrusted payloads become records.

Ranks send records to their node agent and node agents send batches to an ingest endpoint in this
form. Decoding checks every field; a bad record is rejected with a message that names the field
and what was expected, and the good records of the same batch are kept.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypedDict, TypeVar

from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    Record,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.wire import DecodedBatch, InvalidRecord, Rejection

RecordType = Literal["collective", "heartbeat", "group", "exit", "health", "stack", "process"]
RECORD_TYPES: tuple[RecordType, ...] = (
    "collective", "heartbeat", "group", "exit", "health", "stack", "process",
)
"""Every `type` a record may have on the wire."""

_MAX_U64 = 2**63 - 1
_MAX_I32 = 2**31 - 1

_E = TypeVar("_E", bound=enum.StrEnum)


class GroupProgressWire(TypedDict):
    group: str
    last_enqueued: int
    last_completed: int
    pending_op: str
    last_enqueue_us: int
    last_complete_us: int


class CollectiveWire(TypedDict):
    type: Literal["collective"]
    job: str
    attempt: int
    node: str
    rank: int
    group: str
    seq: int
    op: str
    nbytes: int
    dtype: str
    peer: int
    state: str
    enqueue_us: int
    complete_us: int


class HeartbeatWire(TypedDict):
    type: Literal["heartbeat"]
    job: str
    attempt: int
    node: str
    rank: int
    time_us: int
    pid: int
    step: int
    step_us: int
    start_step: int
    first_step_us: int
    dropped: int
    groups: list[GroupProgressWire]


class GroupWire(TypedDict):
    type: Literal["group"]
    job: str
    attempt: int
    rank: int
    group: str
    ranks: list[int]
    backend: str
    time_us: int


class ExitWire(TypedDict):
    type: Literal["exit"]
    job: str
    attempt: int
    node: str
    rank: int
    pid: int
    exit_code: int
    time_us: int


class HealthWire(TypedDict):
    type: Literal["health"]
    job: str
    """May be empty: a node-wide reading."""
    node: str
    device: str
    time_us: int
    source: str
    metric: str
    value: float
    """A finite number (JSON integers are accepted)."""
    severity: str
    detail: str


class StackWire(TypedDict):
    type: Literal["stack"]
    job: str
    attempt: int
    node: str
    rank: int
    time_us: int
    frames: list[str]


class ProcessWire(TypedDict):
    type: Literal["process"]
    job: str
    attempt: int
    node: str
    rank: int
    pid: int
    time_us: int
    state: str
    cpu_s: float
    cpu_rate: float
    read_bytes: int
    write_bytes: int
    io_rate: float


RecordWire = (
    CollectiveWire | HeartbeatWire | GroupWire | ExitWire | HealthWire | StackWire | ProcessWire
)


class BatchWire(TypedDict):
    batch_id: str
    records: list[RecordWire]


def encode(record: Record) -> RecordWire:
    """The wire form of a record."""
    match record:
        case CollectiveEvent():
            return CollectiveWire(
                type="collective", job=record.job, attempt=record.attempt, node=record.node,
                rank=record.rank, group=record.group, seq=record.seq, op=record.op,
                nbytes=record.nbytes, dtype=record.dtype, peer=record.peer,
                state=record.state.value, enqueue_us=record.enqueue_us,
                complete_us=record.complete_us,
            )
        case Heartbeat():
            return HeartbeatWire(
                type="heartbeat", job=record.job, attempt=record.attempt, node=record.node,
                rank=record.rank, time_us=record.time_us, pid=record.pid, step=record.step,
                step_us=record.step_us, start_step=record.start_step,
                first_step_us=record.first_step_us, dropped=record.dropped,
                groups=[
                    GroupProgressWire(
                        group=g.group, last_enqueued=g.last_enqueued,
                        last_completed=g.last_completed, pending_op=g.pending_op,
                        last_enqueue_us=g.last_enqueue_us, last_complete_us=g.last_complete_us,
                    )
                    for g in record.groups
                ],
            )
        case ProcessGroupInfo():
            return GroupWire(
                type="group", job=record.job, attempt=record.attempt, rank=record.rank,
                group=record.group, ranks=list(record.ranks), backend=record.backend,
                time_us=record.time_us,
            )
        case RankExit():
            return ExitWire(
                type="exit", job=record.job, attempt=record.attempt, node=record.node,
                rank=record.rank, pid=record.pid, exit_code=record.exit_code,
                time_us=record.time_us,
            )
        case HealthSample():
            return HealthWire(
                type="health", job=record.job, node=record.node, device=record.device,
                time_us=record.time_us, source=record.source, metric=record.metric,
                value=float(record.value), severity=record.severity.value, detail=record.detail,
            )
        case StackSample():
            return StackWire(
                type="stack", job=record.job, attempt=record.attempt, node=record.node,
                rank=record.rank, time_us=record.time_us, frames=list(record.frames),
            )
        case ProcessSample():
            return ProcessWire(
                type="process", job=record.job, attempt=record.attempt, node=record.node,
                rank=record.rank, pid=record.pid, time_us=record.time_us, state=record.state,
                cpu_s=float(record.cpu_s), cpu_rate=float(record.cpu_rate),
                read_bytes=record.read_bytes, write_bytes=record.write_bytes,
                io_rate=float(record.io_rate),
            )


def encode_batch(batch: Batch) -> bytes:
    """A batch as compact JSON bytes."""
    payload = BatchWire(batch_id=batch.batch_id, records=[encode(r) for r in batch.records])
    return json.dumps(payload, separators=(",", ":")).encode()


def _field(raw: Mapping[str, Any], name: str) -> Any:
    if name not in raw:
        raise InvalidRecord(f"missing field {name!r}")
    return raw[name]


def _int(raw: Mapping[str, Any], name: str, lo: int = 0, hi: int = _MAX_U64) -> int:
    value = _field(raw, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRecord(f"field {name!r} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidRecord(f"field {name!r} must be between {lo} and {hi}, got {value}")
    return value


def _str(raw: Mapping[str, Any], name: str, *, allow_empty: bool = False) -> str:
    value = _field(raw, name)
    if not isinstance(value, str):
        raise InvalidRecord(f"field {name!r} must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise InvalidRecord(f"field {name!r} must not be empty")
    if len(value) > 4096:
        raise InvalidRecord(f"field {name!r} must be at most 4096 characters")
    return value


def _float(raw: Mapping[str, Any], name: str) -> float:
    value = _field(raw, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRecord(f"field {name!r} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise InvalidRecord(f"field {name!r} must be a finite number, got {value!r}")
    return number


def _choice(raw: Mapping[str, Any], name: str, kind: type[_E]) -> _E:
    text = _str(raw, name)
    try:
        return kind(text)
    except ValueError:
        accepted = ", ".join(e.value for e in kind)
        raise InvalidRecord(f"field {name!r} must be one of {accepted}, got {text!r}") from None


def _frames(raw: Mapping[str, Any]) -> tuple[str, ...]:
    frames = _field(raw, "frames")
    if not isinstance(frames, list):
        raise InvalidRecord("field 'frames' must be a list of strings")
    out = []
    for index, frame in enumerate(frames):
        if not isinstance(frame, str):
            raise InvalidRecord(
                f"field 'frames' must be a list of strings: frames[{index}] is "
                f"{type(frame).__name__}"
            )
        if len(frame) > 4096:
            raise InvalidRecord(f"field 'frames': frames[{index}] is over 4096 characters")
        out.append(frame)
    return tuple(out)


def _progress(raw: Any, index: int) -> GroupProgress:
    if not isinstance(raw, Mapping):
        raise InvalidRecord(f"groups[{index}] must be an object")
    try:
        return GroupProgress(
            group=GroupId(_str(raw, "group")),
            last_enqueued=_int(raw, "last_enqueued"),
            last_completed=_int(raw, "last_completed"),
            pending_op=_str(raw, "pending_op", allow_empty=True),
            last_enqueue_us=_int(raw, "last_enqueue_us"),
            last_complete_us=_int(raw, "last_complete_us"),
        )
    except InvalidRecord as exc:
        raise InvalidRecord(f"groups[{index}]: {exc}") from None


def decode(raw: Any) -> Record:
    """A record from its wire form; raises InvalidRecord saying what is wrong."""
    if not isinstance(raw, Mapping):
        raise InvalidRecord(f"a record must be a JSON object, got {type(raw).__name__}")
    kind = raw.get("type")
    if kind not in RECORD_TYPES:
        raise InvalidRecord(
            f"field 'type' must be one of {', '.join(RECORD_TYPES)}, got {kind!r}"
        )
    if kind == "health":
        # Node-wide readings have no job, attempt or rank.
        return HealthSample(
            job=JobId(_str(raw, "job", allow_empty=True)), node=NodeId(_str(raw, "node")),
            device=_str(raw, "device"), time_us=_int(raw, "time_us"),
            source=_str(raw, "source"), metric=_str(raw, "metric"),
            value=_float(raw, "value"), severity=_choice(raw, "severity", HealthSeverity),
            detail=_str(raw, "detail", allow_empty=True),
        )
    job = JobId(_str(raw, "job"))
    attempt = _int(raw, "attempt", hi=_MAX_I32)
    rank = Rank(_int(raw, "rank", hi=_MAX_I32))
    if kind == "collective":
        state = _choice(raw, "state", CollectiveState)
        return CollectiveEvent(
            job=job, attempt=attempt, node=NodeId(_str(raw, "node")), rank=rank,
            group=GroupId(_str(raw, "group")), seq=_int(raw, "seq", lo=1), op=_str(raw, "op"),
            nbytes=_int(raw, "nbytes"), dtype=_str(raw, "dtype", allow_empty=True),
            peer=_int(raw, "peer", lo=-1, hi=_MAX_I32), state=state,
            enqueue_us=_int(raw, "enqueue_us"), complete_us=_int(raw, "complete_us"),
        )
    if kind == "heartbeat":
        groups = _field(raw, "groups")
        if not isinstance(groups, list):
            raise InvalidRecord("field 'groups' must be a list")
        return Heartbeat(
            job=job, attempt=attempt, node=NodeId(_str(raw, "node")), rank=rank,
            time_us=_int(raw, "time_us"), pid=_int(raw, "pid", hi=_MAX_I32),
            step=_int(raw, "step"), step_us=_int(raw, "step_us"),
            start_step=_int(raw, "start_step"), first_step_us=_int(raw, "first_step_us"),
            dropped=_int(raw, "dropped"),
            groups=tuple(_progress(g, i) for i, g in enumerate(groups)),
        )
    if kind == "group":
        ranks = _field(raw, "ranks")
        if not isinstance(ranks, list) or not all(
            isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= _MAX_I32 for r in ranks
        ):
            raise InvalidRecord("field 'ranks' must be a list of non-negative integers")
        return ProcessGroupInfo(
            job=job, attempt=attempt, rank=rank, group=GroupId(_str(raw, "group")),
            ranks=tuple(ranks), backend=_str(raw, "backend", allow_empty=True),
            time_us=_int(raw, "time_us"),
        )
    if kind == "exit":
        return RankExit(
            job=job, attempt=attempt, node=NodeId(_str(raw, "node")), rank=rank,
            pid=_int(raw, "pid", hi=_MAX_I32),
            exit_code=_int(raw, "exit_code", lo=-_MAX_I32, hi=_MAX_I32),
            time_us=_int(raw, "time_us"),
        )
    if kind == "process":
        return ProcessSample(
            job=job, attempt=attempt, node=NodeId(_str(raw, "node")), rank=rank,
            pid=_int(raw, "pid", hi=_MAX_I32), time_us=_int(raw, "time_us"),
            state=_str(raw, "state"), cpu_s=_float(raw, "cpu_s"),
            cpu_rate=_float(raw, "cpu_rate"), read_bytes=_int(raw, "read_bytes"),
            write_bytes=_int(raw, "write_bytes"), io_rate=_float(raw, "io_rate"),
        )
    return StackSample(
        job=job, attempt=attempt, node=NodeId(_str(raw, "node")), rank=rank,
        time_us=_int(raw, "time_us"), frames=_frames(raw),
    )


def decode_records(raws: Iterable[Any]) -> tuple[list[Record], list[Rejection]]:
    """Decode what can be decoded; every rejected record is returned with its reason."""
    records: list[Record] = []
    rejected: list[Rejection] = []
    for index, raw in enumerate(raws):
        try:
            records.append(decode(raw))
        except InvalidRecord as exc:
            rejected.append(Rejection(index, str(exc)))
    return records, rejected


def decode_batch(data: bytes | str) -> DecodedBatch:
    """A batch from JSON. The batch itself must be well formed; bad records inside are rejected."""
    try:
        raw = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRecord(f"a batch must be JSON: {exc}") from exc
    if not isinstance(raw, Mapping):
        raise InvalidRecord("a batch must be a JSON object with 'batch_id' and 'records'")
    batch_id = _str(raw, "batch_id")
    raws = _field(raw, "records")
    if not isinstance(raws, Sequence) or isinstance(raws, str):
        raise InvalidRecord("field 'records' must be a list")
    records, rejected = decode_records(raws)
    return DecodedBatch(Batch(batch_id=batch_id, records=tuple(records)), tuple(rejected))
