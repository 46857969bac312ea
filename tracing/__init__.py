"""The trace model and the stores that hold it: the base layer of Tracehound.

Everything else depends on this package and it depends on none of them. It must never import
torch or numpy at package level: the records are shared by the training-side recorder, the node
agent, the analysis and the controller.

- records, declared once (`events`), and what is derived from a declaration (`kinds`);
- the JSON wire codec (`wire`) and the versioned trace file (`traceformat`);
- the stores (`tracing.store`: `open_store`, the `TraceStore` and `BulkStore` ports);
- the window summary types the stores compute (`summaries`, imports numpy);
- settings (`settings`), errors (`errors`), logging with job/node/rank (`logs`), retry
  (`retry`).
"""

from tracehound.tracing.errors import (
    PermanentStoreError,
    StoreConfigError,
    StoreError,
    TemporaryStoreError,
)
from tracehound.tracing.events import (
    SCHEMA_VERSION,
    Action,
    ActionKind,
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    Incident,
    IncidentKind,
    ProcessGroupInfo,
    ProcessSample,
    ProcessState,
    RankExit,
    RankRecord,
    Record,
    StackSample,
    now_us,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.kinds import RecordBase, Stored, forget_kind, record_kind
from tracehound.tracing.wire import (
    InvalidRecord,
    decode,
    decode_batch,
    decode_line,
    encode,
    encode_batch,
    encode_line,
)

__all__ = [
    "SCHEMA_VERSION",
    "Action",
    "ActionKind",
    "Batch",
    "CollectiveEvent",
    "CollectiveState",
    "GroupId",
    "GroupProgress",
    "HealthSample",
    "HealthSeverity",
    "Heartbeat",
    "Incident",
    "IncidentKind",
    "InvalidRecord",
    "JobId",
    "NodeId",
    "PermanentStoreError",
    "ProcessGroupInfo",
    "ProcessSample",
    "ProcessState",
    "Rank",
    "RankExit",
    "RankRecord",
    "Record",
    "RecordBase",
    "StackSample",
    "StoreConfigError",
    "StoreError",
    "Stored",
    "TemporaryStoreError",
    "decode",
    "decode_batch",
    "decode_line",
    "encode",
    "encode_batch",
    "encode_line",
    "forget_kind",
    "now_us",
    "record_kind",
]
