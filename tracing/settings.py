"""Every TRACEHOUND_* environment variable, in one place, with what it means.

The controller sets most of these for the processes it launches; a user sets them to run the
recorder or the node agent by hand. Bad values raise SettingError naming the variable and the
accepted form.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TRACEHOUND_JOB_ID = "TRACEHOUND_JOB_ID"
"""Job every record is tagged with. Default: the torchrun run id, else "default"."""

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
"""Seconds between a rank's heartbeats (default 0.5)."""

TRACEHOUND_BUFFER_RECORDS = "TRACEHOUND_BUFFER_RECORDS"
"""Records a rank buffers for its node agent before it drops (and counts) new ones (default
65536)."""

TRACEHOUND_STORE = "TRACEHOUND_STORE"
"""Trace store URL: clickhouse://user:pass@host:9000/db or chdb:///dir (default
chdb://./.tracehound/store)."""

TRACEHOUND_SINK = "TRACEHOUND_SINK"
"""Where a node agent ships batches: a clickhouse:// store URL, or the http:// ingest endpoint of
the process that owns an embedded store."""

TRACEHOUND_SPOOL_DIR = "TRACEHOUND_SPOOL_DIR"
"""Directory where a node agent keeps records until the store has them."""

TRACEHOUND_CHECKPOINT_DIR = "TRACEHOUND_CHECKPOINT_DIR"
"""Directory of the job's checkpoints, shared by all attempts (set by `tracehound run`)."""

TRACEHOUND_LOG_LEVEL = "TRACEHOUND_LOG_LEVEL"
"""Log level of Tracehound's own loggers (default INFO)."""


class SettingError(ValueError):
    """An environment variable with a value that cannot be used."""


def env_float(
    name: str, default: float, *, env: Mapping[str, str] | None = None, minimum: float = 0.0
) -> float:
    raw = (os.environ if env is None else env).get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected a number of seconds, e.g. 0.5") from None
    if value < minimum:
        raise SettingError(f"{name}={raw!r}: expected a number >= {minimum}")
    return value


def env_int(
    name: str, default: int, *, env: Mapping[str, str] | None = None, minimum: int = 0
) -> int:
    raw = (os.environ if env is None else env).get(name, "")
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r}: expected a whole number, e.g. 65536") from None
    if value < minimum:
        raise SettingError(f"{name}={raw!r}: expected a whole number >= {minimum}")
    return value


def env_str(name: str, default: str = "", *, env: Mapping[str, str] | None = None) -> str:
    return (os.environ if env is None else env).get(name, "") or default


def env_flag(name: str, *, env: Mapping[str, str] | None = None) -> bool:
    raw = (os.environ if env is None else env).get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise SettingError(f"{name}={raw!r}: expected 1 or 0")
