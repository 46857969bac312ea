"""Every TRACEHOUND_* environment variable, in one place, with what it means.

The controller sets most of these for the processes it launches; a user sets them to run the
recorder or the node agent by hand. Bad values raise SettingError naming the variable and the
accepted form.

A variable's default (and the smallest value it accepts, where there is one) is the DEFAULT_* (or
MIN_*) constant next to it: code that reads the variable, or passes the same setting on as an
argument, uses that constant rather than repeating the value.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

TRACEHOUND_JOB_ID = "TRACEHOUND_JOB_ID"
"""Job every record is tagged with. Default: the torchrun run id, else DEFAULT_JOB_ID."""

DEFAULT_JOB_ID = "default"
"""The job of a process that neither Tracehound nor torchrun named."""

TRACEHOUND_ATTEMPT = "TRACEHOUND_ATTEMPT"
"""Attempt number of this launch (0 first; +1 per restart). Default: TORCHELASTIC_RESTART_COUNT."""

TRACEHOUND_NODE_ID = "TRACEHOUND_NODE_ID"
"""Node this process runs on. Default: the host name."""

TRACEHOUND_AGENT_SOCKET = "TRACEHOUND_AGENT_SOCKET"
"""Unix socket of the node agent that receives this rank's records. Unset: the recorder records
nothing and installs no hooks."""

TRACEHOUND_DISABLE = "TRACEHOUND_DISABLE"
"""Set to 1 to keep the recorder out of a training process altogether."""

TRACEHOUND_HEARTBEAT_S = "TRACEHOUND_HEARTBEAT_S"
"""Seconds between a rank's heartbeats (default DEFAULT_HEARTBEAT_S, at least MIN_HEARTBEAT_S)."""

DEFAULT_HEARTBEAT_S = 0.5
"""A heartbeat shows that a rank is alive and how far it got; the analysis calls a rank silent
after several missed ones (`DetectionSettings.hang.heartbeat_timeout_s`)."""

MIN_HEARTBEAT_S = 0.01
"""Keeps a mistyped value from flooding the node agent with heartbeats."""

TRACEHOUND_SEND_S = "TRACEHOUND_SEND_S"
"""Seconds between a rank's sends to its node agent (default DEFAULT_SEND_S, at least
MIN_SEND_S): what the rank recorded meanwhile goes in one write. A heartbeat sent while a call
has been in flight for TRACEHOUND_INFLIGHT_S goes at once."""

DEFAULT_SEND_S = 0.2
"""Each send wakes the rank's sender thread, the node agent and the sender again for the agent's
acknowledgement, on cores the ranks share: on the 4-rank CPU job of bench/overhead.py (one
run each, back to back) the traced / untraced step time was 1.068 with sends every 0.05 s (one
or two steps' records each) and 1.027 with sends every 0.2 s. Records reach the agent at most
this much later; the detection thresholds are seconds."""

MIN_SEND_S = 0.001
"""Keeps a mistyped value from spinning the sender thread."""

TRACEHOUND_INFLIGHT_S = "TRACEHOUND_INFLIGHT_S"
"""Seconds a collective or point-to-point call may be in flight before its rank sends heartbeats
every 100 ms instead of every TRACEHOUND_HEARTBEAT_S, until nothing is pending that long (default
DEFAULT_INFLIGHT_S, at least 0)."""

DEFAULT_INFLIGHT_S = 1.0
"""Longer than the calls of a healthy step usually take, so fast heartbeats mean something is
stuck or slow; they show its pending op and oldest sequence id at 100 ms resolution."""

TRACEHOUND_DDP_TRACE_EVERY = "TRACEHOUND_DDP_TRACE_EVERY"
"""Record a DDP model's gradient all-reduces bucket by bucket one training step in this many, or
never (0, the default DEFAULT_DDP_TRACE_EVERY). Other than 1, DDP's communication is counted on
every step instead (agent/hooks.py `_DdpCount`, the group `<group>:ddp`): heartbeats show who
is inside it and who lags (the hang detector's dependency), and its steps are recorded as
`ddp_comm` operations from the end of a step's forward to the end of the step (who arrives
last, and the compute between steps: the straggler analysis; how often: TRACEHOUND_DDP_SPAN_S).
A recorded bucket goes from DDP's C++ reducer through a process group written in Python, and
that route is costly on CPU ranks: the overhead bench's 4-rank job
(`python bench/overhead.py --json --step-times`, 60 ms steps of four 1 MB buckets) took a
median step 1.026-1.032 times plain DDP's with 16, and every step paid it, not just the
routed ones; with 0, 1.008. The hang and straggler tests of tests/controller/test_run_faults.py
run with 0 and 1 (and passed with 16 while it was tested)."""

DEFAULT_DDP_TRACE_EVERY = 0
"""Counted only: nothing from DDP's backward pass enters Python."""

TRACEHOUND_DDP_SPAN_S = "TRACEHOUND_DDP_SPAN_S"
"""Where DDP's communication is counted (TRACEHOUND_DDP_TRACE_EVERY other than 1), record its
`ddp_comm` steps about one per this many seconds (default DEFAULT_DDP_SPAN_S, at least 0; 0:
every step). The steps recorded are the same on every rank (a step is recorded when the group's
sequence id crosses a multiple of a power of two fitted to the pace), and every step is still
counted in the heartbeats. A fast step of a small model is cheaper than the record of it: each
record crosses the rank's sender thread, the node agent and the store, which share the training
processes' cores on a small machine."""

DEFAULT_DDP_SPAN_S = 0.05
"""At most about 20 recorded steps a second per rank: the straggler analysis compares arrivals
over windows of seconds, so it has dozens of steps in each."""

TRACEHOUND_BUFFER_RECORDS = "TRACEHOUND_BUFFER_RECORDS"
"""Records a rank buffers for its node agent before it drops (and counts) new ones (default
DEFAULT_BUFFER_RECORDS, at least MIN_BUFFER_RECORDS)."""

DEFAULT_BUFFER_RECORDS = 65536
"""Bounds the memory a rank spends on records its node agent has not taken yet."""

MIN_BUFFER_RECORDS = 1
"""A buffer must hold at least the record being sent."""

TRACEHOUND_STORE = "TRACEHOUND_STORE"
"""Trace store URL: clickhouse://user:pass@host:9000/db or chdb:///dir (default
chdb://./.tracehound/store)."""

TRACEHOUND_SINK = "TRACEHOUND_SINK"
"""Where a node agent ships batches: a clickhouse:// store URL, or the http:// ingest endpoint of
the process that owns an embedded store. The node agent's --sink, when that is not given."""

TRACEHOUND_SHIP_MAX_BACKOFF_S = "TRACEHOUND_SHIP_MAX_BACKOFF_S"
"""Longest wait, in seconds, of a node agent between tries of a sink it cannot reach (default
DEFAULT_SHIP_MAX_BACKOFF_S); the waits start at 0.2 s and double up to it. The node agent's
--retry-max, when that is not given."""

DEFAULT_SHIP_MAX_BACKOFF_S = 10.0

TRACEHOUND_INGEST_TOKEN = "TRACEHOUND_INGEST_TOKEN"  # noqa: S105 - the variable's name
"""Shared secret of the ingest endpoint of an embedded store: node agents send it
(`Authorization: Bearer <token>`), the endpoint answers 401 without it. Required for an endpoint
that listens on an address other than loopback; unset: an endpoint on loopback takes any local
caller."""

TRACEHOUND_STORE_CALL_TIMEOUT_S = "TRACEHOUND_STORE_CALL_TIMEOUT_S"
"""Seconds a process waits for the answer to one call on an embedded store that another process
of this machine holds and shares (`tracing.store.sharing`) before it gives up with a
TemporaryStoreError (default DEFAULT_STORE_CALL_TIMEOUT_S, at least MIN_STORE_CALL_TIMEOUT_S)."""

DEFAULT_STORE_CALL_TIMEOUT_S = 120.0
"""Longer than the dashboard's heaviest summary query of a large job takes; a holder that is
stopped (SIGSTOP) or wedged is reported after this long instead of waited on forever."""

MIN_STORE_CALL_TIMEOUT_S = 0.1

TRACEHOUND_SPOOL_DIR = "TRACEHOUND_SPOOL_DIR"
"""Directory where a node agent keeps records until the store has them. The node agent's
--spool, when that is not given."""

TRACEHOUND_GPU = "TRACEHOUND_GPU"
"""GPU health backend of a node agent: auto (NVML when it works, else none), nvml, sim (simulated
GPUs, for machines without any and for fault injection) or off. The node agent's --gpu."""

DEFAULT_GPU = "auto"

GPU_BACKENDS = ("auto", "nvml", "sim", "off")

TRACEHOUND_HEALTH_INTERVAL_S = "TRACEHOUND_HEALTH_INTERVAL_S"
"""Seconds between a node agent's GPU and host health samples (0: off). The node agent's
--health-interval."""

DEFAULT_HEALTH_INTERVAL_S = 10.0
"""Health events (Xids, links down) are found at this pace; a detection window (10 s) sees at
least one reading of every gauge."""

TRACEHOUND_SIM_GPUS = "TRACEHOUND_SIM_GPUS"
"""Number of simulated GPUs per node when TRACEHOUND_GPU=sim (default DEFAULT_SIM_GPUS)."""

DEFAULT_SIM_GPUS = 8

TRACEHOUND_SIM_GPU_FAULTS = "TRACEHOUND_SIM_GPU_FAULTS"
"""File of JSON lines, one injected fault each, that simulated GPUs read as it grows (see
tracehound.agent.sources.gpu). Unset: no injected faults."""

TRACEHOUND_NCCL_RAS = "TRACEHOUND_NCCL_RAS"
"""Whether a node agent polls NCCL RAS on its local port (NCCL_RAS_ADDR, default
localhost:28028): on, off, or auto (default: on when the node's GPUs are read through NVML).
The node agent's --nccl-ras."""

NCCL_RAS_MODES = ("auto", "on", "off")

DEFAULT_NCCL_RAS = "auto"

TRACEHOUND_NCCL_INSPECTOR_DIR = "TRACEHOUND_NCCL_INSPECTOR_DIR"
"""Directory of NCCL Inspector's JSON lines that a node agent tails (default: the job's
NCCL_INSPECTOR_DUMP_DIR when the agent sees it; unset: not read). The node agent's
--nccl-inspector-dir."""

TRACEHOUND_OTEL_SPANS_EVERY = "TRACEHOUND_OTEL_SPANS_EVERY"
"""Export every Nth collective of each process group as an OpenTelemetry span (the node agent,
over OTLP/HTTP to OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT +
/v1/traces). By sequence id, so every rank exports the same collectives, which share one trace
id. Default DEFAULT_OTEL_SPANS_EVERY."""

DEFAULT_OTEL_SPANS_EVERY = 0
"""No spans."""

TRACEHOUND_CHECKPOINT_DIR = "TRACEHOUND_CHECKPOINT_DIR"
"""Directory of the job's checkpoints, shared by all attempts (set by `tracehound run`)."""

TRACEHOUND_SNAPSHOT_KEEPERS = "TRACEHOUND_SNAPSHOT_KEEPERS"
"""The snapshot keepers of the job's nodes, in node order: `node-0=http://host:port,node-1=...`
(set by `tracehound run`). A rank's `checkpoint.snapshot` sends its state to its own node's keeper
and a replica to another node's; `checkpoint.load` asks them all. Unset: snapshots go to disk
only, when persisted."""

TRACEHOUND_SNAPSHOT_REPLICAS = "TRACEHOUND_SNAPSHOT_REPLICAS"
"""1 (DEFAULT_SNAPSHOT_REPLICAS): every snapshot also goes to the keeper of another node, so that
the ranks of an isolated node can be restored on a spare; 0: to the own node's keeper only."""

DEFAULT_SNAPSHOT_REPLICAS = 1

TRACEHOUND_SNAPSHOT_KEEP = "TRACEHOUND_SNAPSHOT_KEEP"
"""How many snapshots of each rank a keeper holds (default DEFAULT_SNAPSHOT_KEEP, at least 1);
older ones are dropped as newer ones arrive."""

DEFAULT_SNAPSHOT_KEEP = 3

TRACEHOUND_SNAPSHOT_BUDGET_MB = "TRACEHOUND_SNAPSHOT_BUDGET_MB"
"""The memory a node's keeper may hold, in MiB (default DEFAULT_SNAPSHOT_BUDGET_MB): its own
ranks' snapshots and the replicas it keeps for other nodes. A snapshot that cannot fit beside
the newest of every rank is refused with an error that names this variable."""

DEFAULT_SNAPSHOT_BUDGET_MB = 2048.0

TRACEHOUND_ALERTS = "TRACEHOUND_ALERTS"
"""A global alert receivers file (YAML or JSON), used by every `tracehound run` beside the job's
own `--alerts` file; a receiver's `jobs` patterns limit it to some jobs."""

TRACEHOUND_EXIT_FILE = "TRACEHOUND_EXIT_FILE"
"""Where a rank leaves its exit status as it ends (set by `tracehound run`), so that a controller
started after the one that launched it (not its parent) learns how it ended."""

TRACEHOUND_LOG_LEVEL = "TRACEHOUND_LOG_LEVEL"
"""Log level of Tracehound's own loggers (default DEFAULT_LOG_LEVEL)."""

DEFAULT_LOG_LEVEL = "INFO"
"""Informational messages and above; DEBUG adds detail meant for developing Tracehound."""


class SettingError(ValueError):
    """An environment variable with a value that cannot be used."""


def env_float(
    name: str, default: float, *, env: Mapping[str, str] | None = None, minimum: float = 0.0
) -> float:
    """The number in variable `name` of `env` (default: the process environment), `default`
    when it is unset or empty; SettingError when it is no finite number or below `minimum`."""
    raw = (os.environ if env is None else env).get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected a number, e.g. {default}") from None
    if not math.isfinite(value):
        raise SettingError(f"{name}={raw!r}: expected a finite number, e.g. {default}")
    if value < minimum:
        raise SettingError(f"{name}={raw!r}: expected a number >= {minimum}")
    return value


def env_int(
    name: str, default: int, *, env: Mapping[str, str] | None = None, minimum: int = 0
) -> int:
    """The whole number in variable `name` of `env` (default: the process environment),
    `default` when it is unset or empty; SettingError when it is none or below `minimum`."""
    raw = (os.environ if env is None else env).get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected a whole number, e.g. {default}") from None
    if value < minimum:
        raise SettingError(f"{name}={raw!r}: expected a whole number >= {minimum}")
    return value


def env_str(name: str, default: str = "", *, env: Mapping[str, str] | None = None) -> str:
    """The text of variable `name` of `env` (default: the process environment), `default` when
    it is unset or empty."""
    return (os.environ if env is None else env).get(name, "") or default


def env_choice(
    name: str, default: str, choices: tuple[str, ...], *, env: Mapping[str, str] | None = None
) -> str:
    """The value of variable `name` of `env` (default: the process environment), one of
    `choices`; `default` when unset or empty; SettingError naming the choices otherwise."""
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in choices:
        raise SettingError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def env_flag(name: str, *, env: Mapping[str, str] | None = None) -> bool:
    """Whether variable `name` of `env` (default: the process environment) is set to 1 (or true,
    yes, on); False when unset; SettingError for anything else."""
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SettingError(f"{name}={raw!r}: expected 1 or 0")
