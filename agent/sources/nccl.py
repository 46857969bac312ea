"""NCCL's own views of a job, as node agent sources: RAS status and Inspector collective logs.

`NcclRasSource` asks NCCL RAS (built into NCCL 2.24+, JSON answers since 2.28.7) for the job's
status on its local client port (`NCCL_RAS_ADDR`, default localhost:28028) with the documented
line protocol: `CLIENT PROTOCOL 2` (answered `SERVER PROTOCOL n`), `TIMEOUT s` and
`SET FORMAT json` (each answered `OK`), then `STATUS`, answered with one JSON document after
which NCCL closes the connection. The document lists every communicator (`hash`, `size`), its
ranks (`rank`, `host` IP, `pid`, `cuda_dev`, `nvml_dev`, `status` with `init_state`,
`async_error`, `abort_flag`, ..., and `collective_counts` per op) and its `missing_ranks` (with
`status.unresponsive` and `status.considered_dead`). Each problem becomes a `HealthSample`
(source `nccl_ras`) on the node and GPU of the rank it is about:

    metric              severity   when
    nccl_rank_dead      CRITICAL   a missing rank RAS considers dead
    nccl_rank_missing   WARNING    a missing rank (unresponsive, or not answering in time)
    nccl_async_error    CRITICAL   a rank's communicator reports an asynchronous NCCL error
    nccl_init_error     CRITICAL   a rank's communicator failed to initialize
    nccl_comm_aborted   WARNING    a rank's communicator was aborted
    nccl_ops_behind     INFO       a rank launched fewer operations of a kind than a peer;
                        WARNING    ... and launched none since the previous poll

The analysis (`analysis.hardware`) interprets none of these names: they are process and
communicator states, not hardware faults, so they are shown as context and never turn a verdict
into a hardware one. A problem is emitted when first seen, when it changes, and every
`repeat_s` while it lasts. Nobody listening on the port (NCCL not started yet, RAS disabled, a
CPU-only job) is normal: it is logged once, counted in `stats.unavailable`, and the poll returns
nothing. An answer that is not the documented protocol raises `NcclFormatError` naming what was
expected (the poller logs it once per kind and counts it).

`NcclInspectorSource` tails the JSON lines the NCCL Inspector profiler plugin (NCCL 2.28+) writes
to `NCCL_INSPECTOR_DUMP_DIR`, one file per process (`<hostname>-pid<pid>.log`), one line per
completed collective per communicator: `header` (`id`: the communicator hash, `rank` in the
communicator, `n_ranks`, `nnodes`), `metadata` (`dump_timestamp_us`, `hostname`, `pid`) and
`coll_perf` (`coll`, `coll_sn`, `coll_msg_size_bytes`, `coll_exec_time_us`, `coll_busbw_gbs`,
and with NCCL_INSPECTOR_DUMP_VERBOSE=1 `event_trace_ts` with start and kernel stop times). Files
appear and grow while the job runs; each is read from where the previous poll stopped, a
partial last line is left for the next poll, a file truncated or replaced under the same name is
read again from its start, and a line that is not the documented format is counted and logged
(once per file) and skipped: the lines around it are kept.

What Inspector output tells, and what it does not:
- Only completed collectives: a collective that hangs is never written, so a hang shows as a
  gap (the ranks' last `coll_sn`s differ, or stop).
- `coll_sn` counts each kind of collective separately per communicator (NCCL's
  `seqNumber[func]`, from 0), so the group of a record is the communicator AND the op:
  `nccl:<commHash>/<Coll>` (e.g. `nccl:0x7f8c496ae9f661/AllReduce`), its seq `coll_sn + 1`.
- Inspector writes the latest completed collective of each communicator once per dump interval,
  so with a dump interval longer than a collective, sequence ids are skipped.
- No dtype and no peer of a send/recv; times are the dump time minus the execution time, or the
  traced start and kernel stop in verbose mode (wall clock microseconds of the writer's host).
- The rank in the header is the rank within the communicator; the job's global rank, attempt and
  job are resolved from the writer's pid (`LocalRanks`: the ranks' heartbeats, else the
  process's environment), so only records written on this host are mapped; others are counted
  in `stats.other_host`, unmapped pids in `stats.unmapped`.
- The members of a communicator are known only when all its ranks wrote here (a communicator
  within this node, or a job on one node); then a `ProcessGroupInfo` per member is emitted for
  each of its groups. A communicator spanning nodes gets none from this source.

Both run in the node agent, never inside a training process. They must never raise into the
agent except through `poll` (which the poller counts), never block longer than their timeouts,
and never drop a record they have parsed.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from tracehound.agent.sources.procfs import parse_environ
from tracehound.tracing import logs
from tracehound.tracing.events import (
    CollectiveEvent,
    CollectiveState,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    ProcessGroupInfo,
    Record,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.settings import TRACEHOUND_ATTEMPT, TRACEHOUND_JOB_ID

log = logging.getLogger(__name__)

NCCL_RAS_ADDR = "NCCL_RAS_ADDR"
"""NCCL's variable for the RAS client socket, `host:port` (the same value the job has)."""

DEFAULT_RAS_ADDR = "localhost:28028"
"""Where NCCL RAS listens when NCCL_RAS_ADDR is not set."""

NCCL_INSPECTOR_DUMP_DIR = "NCCL_INSPECTOR_DUMP_DIR"
"""NCCL Inspector's output directory (the same value the job has)."""

RAS_CLIENT_PROTOCOL = 2
"""The RAS client protocol version spoken here (NCCL's NCCL_RAS_CLIENT_PROTOCOL)."""

RAS_SOURCE = "nccl_ras"
"""The `source` of the health samples made from RAS answers."""

_MAX_ANSWER = 64 << 20
"""Longest RAS status answer read (a job of thousands of ranks answers a few MB)."""

_MAX_HANDSHAKE_LINE = 4096


# -- errors ---------------------------------------------------------------------------------------


class NcclSourceError(Exception):
    """Something an NCCL source could not use; the message says what and what was expected."""


class NcclFormatError(NcclSourceError, ValueError):
    """An answer or a line that is not in NCCL's documented format (permanent for that input)."""


class NcclRasTimeout(NcclSourceError):
    """RAS took longer than the timeout to answer (temporary: NCCL may be busy; retried next
    poll)."""


# -- RAS ------------------------------------------------------------------------------------------


def parse_ras_addr(text: str, *, variable: str = NCCL_RAS_ADDR) -> tuple[str, int]:
    """(host, port) from `host:port` or `[v6addr]:port`; ValueError naming `variable` otherwise."""
    host, sep, port = text.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{variable}={text!r}: expected host:port, e.g. {DEFAULT_RAS_ADDR}")
    return host, int(port)


def ras_addr_from_env(env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """The RAS address of NCCL_RAS_ADDR in `env` (default: this process's), else the default."""
    value = (os.environ if env is None else env).get(NCCL_RAS_ADDR, "").strip()
    return parse_ras_addr(value or DEFAULT_RAS_ADDR)


@dataclass(frozen=True, slots=True, kw_only=True)
class RasRank:
    """One rank of a communicator as RAS reports it (a present or a missing one)."""

    rank: int
    """Rank within the communicator."""
    host: str
    """IP address of the rank's host ("unknown" when RAS does not know the process)."""
    pid: int
    cuda_dev: int
    nvml_dev: int
    init_state: int = 0
    """ncclResult_t of the communicator's initialization (0: success, 7: in progress)."""
    async_error: int = 0
    """ncclResult_t of the communicator's asynchronous error state (0: none)."""
    abort_flag: bool = False
    finalize_called: bool = False
    collective_counts: tuple[tuple[str, int], ...] = ()
    """(op, operations launched) per kind of collective."""
    missing: bool = False
    unresponsive: bool = False
    considered_dead: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RasCommunicator:
    hash: str
    size: int
    ranks: tuple[RasRank, ...]
    missing_ranks: tuple[RasRank, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RasStatus:
    """What one `STATUS` answer says (the fields Tracehound uses)."""

    nccl_version: str
    timestamp: str
    communicators: tuple[RasCommunicator, ...]
    timeouts: int = 0
    """RAS collectives that timed out while gathering the answer (a peer did not reply)."""


_NCCL_RESULTS = {
    0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
    3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
    6: "ncclRemoteError", 7: "ncclInProgress",
}
_IN_PROGRESS = 7


def _where_text(where: str) -> str:
    return where or "the top level"


def _get(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str,
         default: Any = ...) -> Any:
    """obj[key] checked to be of `kind` (bool is not an int here); NcclFormatError otherwise."""
    if key not in obj:
        if default is not ...:
            return default
        raise NcclFormatError(f"NCCL RAS status: {_where_text(where)} has no {key!r} field "
                              f"(expected the JSON of NCCL 2.28.7+ `SET FORMAT json`)")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    bad_bool = isinstance(value, bool) and bool not in kinds
    if bad_bool or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise NcclFormatError(f"NCCL RAS status: {where}.{key} should be {names}, "
                              f"got {value!r:.80}")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise NcclFormatError(f"NCCL RAS status: {_where_text(where)} should be a JSON object, "
                              f"got {type(value).__name__}")
    return value


def _ras_rank(raw: Any, where: str, *, missing: bool) -> RasRank:
    obj = _object(raw, where)
    status = _object(_get(obj, "status", dict, where), f"{where}.status")
    common = {
        "rank": _get(obj, "rank", int, where),
        "host": _get(obj, "host", str, where, "unknown"),
        "pid": _get(obj, "pid", int, where, -1),
        "cuda_dev": _get(obj, "cuda_dev", int, where, -1),
        "nvml_dev": _get(obj, "nvml_dev", int, where, -1),
    }
    if missing:
        return RasRank(
            **common, missing=True,
            unresponsive=_get(status, "unresponsive", bool, f"{where}.status", False),
            considered_dead=_get(status, "considered_dead", bool, f"{where}.status", False),
        )
    counts_raw = _object(_get(obj, "collective_counts", dict, where, {}),
                         f"{where}.collective_counts")
    counts = tuple(
        (op, _get(counts_raw, op, int, f"{where}.collective_counts")) for op in sorted(counts_raw)
    )
    sw = f"{where}.status"
    return RasRank(
        **common,
        init_state=_get(status, "init_state", int, sw, 0),
        async_error=_get(status, "async_error", int, sw, 0),
        abort_flag=_get(status, "abort_flag", bool, sw, False),
        finalize_called=_get(status, "finalize_called", bool, sw, False),
        collective_counts=counts,
    )


def parse_ras_status(text: str) -> RasStatus:
    """The status in the JSON answer to `STATUS`; NcclFormatError saying what was expected."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        start = text.lstrip()[:60]
        hint = (" (a text answer: RAS ignored SET FORMAT json; NCCL older than 2.28.7?)"
                if start and not start.startswith("{") else "")
        raise NcclFormatError(f"NCCL RAS status is not JSON{hint}: {exc}; "
                              f"it starts with {start!r}") from exc
    top = _object(doc, "")
    comms_raw = _get(top, "communicators", list, "")
    comms: list[RasCommunicator] = []
    for i, raw in enumerate(comms_raw):
        where = f"communicators[{i}]"
        obj = _object(raw, where)
        ranks = _get(obj, "ranks", list, where, [])
        missing = _get(obj, "missing_ranks", list, where, [])
        comms.append(RasCommunicator(
            hash=_get(obj, "hash", str, where),
            size=_get(obj, "size", int, where),
            ranks=tuple(_ras_rank(r, f"{where}.ranks[{j}]", missing=False)
                        for j, r in enumerate(ranks)),
            missing_ranks=tuple(_ras_rank(r, f"{where}.missing_ranks[{j}]", missing=True)
                                for j, r in enumerate(missing)),
        ))
    ras = _get(top, "ras", dict, "", {})
    return RasStatus(
        nccl_version=_get(top, "nccl_version", str, "", ""),
        timestamp=_get(top, "timestamp", str, "", ""),
        communicators=tuple(comms),
        timeouts=_get(_object(ras, "ras"), "timeouts_count", int, "ras", 0),
    )


class RasUnavailable(NcclSourceError):
    """Nothing answers on the RAS port (refused, closed before the handshake, unreachable)."""


def query_ras(host: str, port: int, *, timeout_s: float = 5.0, connect_timeout_s: float = 1.0,
              max_bytes: int = _MAX_ANSWER) -> str:
    """The JSON text of one RAS `STATUS` answer. Raises RasUnavailable when nobody listens,
    NcclRasTimeout when RAS is too slow, NcclFormatError when it does not speak the protocol."""
    where = f"NCCL RAS at {host}:{port}"
    try:
        conn = socket.create_connection((host, port), timeout=connect_timeout_s)
    except OSError as exc:  # refused, reset, unreachable, unresolvable, timed out
        if isinstance(exc, TimeoutError):
            raise RasUnavailable(f"{where}: no connection within {connect_timeout_s}s") from exc
        raise RasUnavailable(f"{where}: {exc.strerror or exc}") from exc
    with conn:
        # RAS waits up to `timeout` for its peers; give it that plus a margin to answer.
        conn.settimeout(timeout_s + max(1.0, connect_timeout_s))
        reader = conn.makefile("rb")
        try:
            _exchange(conn, reader, f"CLIENT PROTOCOL {RAS_CLIENT_PROTOCOL}", "SERVER PROTOCOL ",
                      where, handshake=True)
            _exchange(conn, reader, f"TIMEOUT {max(1, round(timeout_s))}", "OK", where)
            _exchange(conn, reader, "SET FORMAT json", "OK", where,
                      hint=" (JSON answers need NCCL 2.28.7 or newer)")
            conn.sendall(b"STATUS\n")
            data = reader.read(max_bytes + 1)
        except TimeoutError as exc:
            raise NcclRasTimeout(f"{where}: no complete answer within "
                                 f"{conn.gettimeout()}s") from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise RasUnavailable(f"{where}: connection closed: {exc}") from exc
        finally:
            reader.close()
    if len(data) > max_bytes:
        raise NcclFormatError(f"{where}: STATUS answer longer than {max_bytes} bytes")
    if not data.strip():
        raise NcclFormatError(f"{where}: empty answer to STATUS (expected a JSON document)")
    return data.decode(errors="replace")


def _exchange(conn: socket.socket, reader: BinaryIO, command: str, expect: str, where: str, *,
              handshake: bool = False, hint: str = "") -> str:
    conn.sendall(command.encode() + b"\n")
    line = reader.readline(_MAX_HANDSHAKE_LINE)
    if not line:
        if handshake:
            raise RasUnavailable(f"{where}: connection closed before the handshake")
        raise NcclFormatError(f"{where}: connection closed after {command!r} "
                              f"(expected {expect!r}){hint}")
    answer = line.decode(errors="replace").strip()
    if not answer.upper().startswith(expect.upper()):
        raise NcclFormatError(f"{where} answered {answer[:200]!r} to {command!r}; "
                              f"expected {expect.strip()!r}{hint}")
    return answer


@dataclass
class RasStats:
    polls: int = 0
    """Status answers read and parsed."""
    unavailable: int = 0
    """Polls that found nobody listening on the RAS port."""
    samples: int = 0
    """Health samples emitted."""


class NodeNames(Protocol):
    def __call__(self, host: str) -> str:
        """The Tracehound node id of the host RAS names by IP address (or "unknown")."""
        ...


def local_addresses() -> frozenset[str]:
    """This machine's own IP addresses (loopback included), as far as name resolution says."""
    found = {"127.0.0.1", "::1", "localhost"}
    for name in {socket.gethostname(), socket.getfqdn()}:
        try:
            for info in socket.getaddrinfo(name, None):
                found.add(str(info[4][0]))
        except OSError:
            continue
    return frozenset(found)


@dataclass(frozen=True)
class HostNodes:
    """Names a RAS host: this machine's addresses are `node`; `known` maps other addresses to
    their node ids; any other address names itself (so it still says where)."""

    node: str
    known: Mapping[str, str] = field(default_factory=dict)
    local: frozenset[str] = field(default_factory=local_addresses)

    def __call__(self, host: str) -> str:
        if host in self.known:
            return self.known[host]
        if host in self.local:
            return self.node
        return host or "unknown"


@dataclass(frozen=True, slots=True)
class _Problem:
    comm: str
    rank: int
    metric: str
    severity: HealthSeverity
    value: float
    node: str
    device: str
    detail: str


class NcclRasSource:
    """A `Source` (agent.sources) of health samples from the local NCCL RAS port."""

    def __init__(
        self,
        *,
        job: str,
        node: str,
        addr: str | None = None,
        interval_s: float = 10.0,
        timeout_s: float = 5.0,
        repeat_s: float = 60.0,
        node_names: NodeNames | None = None,
        query: Callable[[str, int], str] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`addr`: `host:port` of RAS (default NCCL_RAS_ADDR of `env`, else localhost:28028).
        `timeout_s`: how long RAS may wait for its peers (and this poll for RAS). `repeat_s`:
        how often a lasting problem is emitted again. `node_names`: names the hosts RAS reports
        by IP address (default: this machine's addresses are `node`)."""
        self.name = RAS_SOURCE
        self.job = JobId(job)
        self.node = NodeId(node)
        self.host, self.port = (parse_ras_addr(addr, variable="addr") if addr
                                else ras_addr_from_env(env))
        if not interval_s > 0 or not timeout_s > 0 or repeat_s < 0:
            raise ValueError(f"NcclRasSource: interval_s and timeout_s must be > 0 and repeat_s "
                             f">= 0, got {interval_s!r}, {timeout_s!r}, {repeat_s!r}")
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.repeat_us = round(repeat_s * 1e6)
        self.node_names: NodeNames = node_names if node_names is not None else HostNodes(node)
        self._query = query or (lambda h, p: query_ras(h, p, timeout_s=self.timeout_s))
        self.stats = RasStats()
        self.log = logs.JobLogger(log, job=job, node=node)
        self._down = False
        self._emitted: dict[tuple[str, int, str], tuple[int, HealthSeverity, float]] = {}
        self._counts: dict[tuple[str, int], tuple[tuple[str, int], ...]] = {}

    def close(self) -> None:
        """Nothing is held between polls (each poll is one short connection)."""

    def poll(self, now_us: int) -> list[Record]:
        try:
            text = self._query(self.host, self.port)
        except RasUnavailable as exc:
            self.stats.unavailable += 1
            if not self._down:
                self._down = True
                self.log.info("%s (NCCL not running here, or RAS disabled); polled again every "
                              "%gs, logged once, counted in unavailable", exc, self.interval_s)
            return []
        status = parse_ras_status(text)
        if self._down:
            self._down = False
            self.log.info("NCCL RAS at %s:%d answers (NCCL %s)", self.host, self.port,
                          status.nccl_version or "?")
        self.stats.polls += 1
        out = self._samples(status, now_us)
        self.stats.samples += len(out)
        return list(out)

    def _samples(self, status: RasStatus, now_us: int) -> list[HealthSample]:
        problems = [p for comm in status.communicators for p in self._problems(comm)]
        reported = {(c.hash, r.rank) for c in status.communicators for r in c.ranks}
        for stale in set(self._counts) - reported:
            del self._counts[stale]
        out: list[HealthSample] = []
        live: set[tuple[str, int, str]] = set()
        for p in problems:
            key = (p.comm, p.rank, p.metric)
            live.add(key)
            last = self._emitted.get(key)
            if last is not None:
                when, severity, value = last
                fresh = severity == p.severity and value == p.value
                if fresh and now_us - when < self.repeat_us:
                    continue
            self._emitted[key] = (now_us, p.severity, p.value)
            out.append(HealthSample(
                job=self.job, node=NodeId(p.node), device=p.device, time_us=now_us,
                source=RAS_SOURCE, metric=p.metric, value=p.value, severity=p.severity,
                detail=p.detail[:4096],
            ))
        for gone in set(self._emitted) - live:
            del self._emitted[gone]
        return out

    def _problems(self, comm: RasCommunicator) -> Iterable[_Problem]:
        prefix = f"communicator {comm.hash} of {comm.size} ranks: rank {{}}"

        def problem(r: RasRank, metric: str, severity: HealthSeverity, value: float,
                    words: str) -> _Problem:
            gpu = r.nvml_dev if r.nvml_dev >= 0 else r.cuda_dev
            device = f"gpu{gpu}" if gpu >= 0 else "host"
            where = f"pid {r.pid} on {r.host}" + (
                f", GPU {r.cuda_dev} (NVML {r.nvml_dev})" if gpu >= 0 else "")
            return _Problem(comm.hash, r.rank, metric, severity, value,
                            self.node_names(r.host), device,
                            f"{prefix.format(r.rank)} ({where}) {words}")

        for r in comm.missing_ranks:
            if r.considered_dead:
                yield problem(r, "nccl_rank_dead", HealthSeverity.CRITICAL, 1.0,
                              "is missing and considered dead by RAS")
            else:
                why = "unresponsive" if r.unresponsive else "did not answer in time"
                yield problem(r, "nccl_rank_missing", HealthSeverity.WARNING, 1.0,
                              f"is missing ({why})")
        for r in comm.ranks:
            if r.async_error:
                yield problem(r, "nccl_async_error", HealthSeverity.CRITICAL,
                              float(r.async_error),
                              f"reports {_NCCL_RESULTS.get(r.async_error, r.async_error)}")
            if r.init_state not in (0, _IN_PROGRESS):
                yield problem(r, "nccl_init_error", HealthSeverity.CRITICAL,
                              float(r.init_state), "failed to initialize: "
                              f"{_NCCL_RESULTS.get(r.init_state, r.init_state)}")
            if r.abort_flag:
                yield problem(r, "nccl_comm_aborted", HealthSeverity.WARNING, 1.0,
                              "was aborted")
        yield from self._behind(comm, problem)

    def _behind(self, comm: RasCommunicator,
                problem: Callable[[RasRank, str, HealthSeverity, float, str], _Problem]
                ) -> Iterable[_Problem]:
        """Ranks that launched fewer operations of a kind than the furthest rank."""
        most: dict[str, int] = {}
        for r in comm.ranks:
            for op, n in r.collective_counts:
                most[op] = max(most.get(op, 0), n)
        for r in comm.ranks:
            key = (comm.hash, r.rank)
            before = self._counts.get(key)
            self._counts[key] = r.collective_counts
            lags = [(most[op] - n, op, n) for op, n in r.collective_counts if n < most[op]]
            if not lags:
                continue
            lag, op, n = max(lags)
            stuck = before == r.collective_counts
            severity = HealthSeverity.WARNING if stuck else HealthSeverity.INFO
            still = ", and launched nothing since the previous poll" if stuck else ""
            yield problem(r, "nccl_ops_behind", severity, float(lag),
                          f"launched {n} {op} operations, a peer {most[op]}{still}")


# -- Inspector ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class InspectorRecord:
    """One line of NCCL Inspector output: one completed collective of one communicator."""

    comm: str
    """The communicator hash (`header.id`, e.g. `0x7f8c496ae9f661`)."""
    comm_rank: int
    n_ranks: int
    nnodes: int
    hostname: str
    pid: int
    dump_us: int
    coll: str
    """NCCL's name of the collective (`AllReduce`, `AllGather`, `ReduceScatter`, ...)."""
    coll_sn: int
    """Per communicator and per kind of collective, from 0."""
    nbytes: int
    exec_us: int
    busbw_gbs: float
    algobw_gbs: float
    timing_source: str = ""
    start_us: int = 0
    """`event_trace_ts.coll_start_ts` (verbose output only; 0 otherwise)."""
    stop_us: int = 0
    """The latest `kernel_stop_ts` of `event_trace_ts.kernel_events` (verbose only; 0 otherwise)."""


def _field(obj: Mapping[str, Any], section: str, key: str, kind: type | tuple[type, ...],
           default: Any = ...) -> Any:
    if key not in obj:
        if default is not ...:
            return default
        raise NcclFormatError(f"no {section}.{key}")
    value = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise NcclFormatError(f"{section}.{key} should be {names}, got {value!r:.60}")
    if isinstance(value, int) and not isinstance(value, bool) and value < 0:
        raise NcclFormatError(f"{section}.{key} should be >= 0, got {value}")
    return value


def _section(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = doc.get(name)
    if not isinstance(value, dict):
        raise NcclFormatError(f"no {name} object" if value is None
                              else f"{name} should be an object, got {type(value).__name__}")
    return value


def parse_inspector_line(line: str | bytes) -> InspectorRecord:
    """One Inspector JSON line; NcclFormatError saying what is wrong and what was expected."""
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise NcclFormatError(f"not JSON ({exc}); expected one object with header, metadata "
                              "and coll_perf per line") from exc
    if not isinstance(doc, dict):
        raise NcclFormatError(f"a JSON {type(doc).__name__}; expected an object with header, "
                              "metadata and coll_perf")
    try:
        header, meta, perf = (_section(doc, n) for n in ("header", "metadata", "coll_perf"))
        num = (int, float)
        start = stop = 0
        trace = perf.get("event_trace_ts")
        if isinstance(trace, dict):
            start = _field(trace, "coll_perf.event_trace_ts", "coll_start_ts", int, 0)
            for i, k in enumerate(trace.get("kernel_events") or ()):
                if isinstance(k, dict):
                    stop = max(stop, _field(k, f"coll_perf.event_trace_ts.kernel_events[{i}]",
                                            "kernel_stop_ts", int, 0))
        return InspectorRecord(
            comm=_field(header, "header", "id", str),
            comm_rank=_field(header, "header", "rank", int),
            n_ranks=_field(header, "header", "n_ranks", int),
            nnodes=_field(header, "header", "nnodes", int, 0),
            hostname=_field(meta, "metadata", "hostname", str),
            pid=_field(meta, "metadata", "pid", int),
            dump_us=_field(meta, "metadata", "dump_timestamp_us", int),
            coll=_field(perf, "coll_perf", "coll", str),
            coll_sn=_field(perf, "coll_perf", "coll_sn", int),
            nbytes=_field(perf, "coll_perf", "coll_msg_size_bytes", int),
            exec_us=_field(perf, "coll_perf", "coll_exec_time_us", int),
            busbw_gbs=float(_field(perf, "coll_perf", "coll_busbw_gbs", num, 0.0)),
            algobw_gbs=float(_field(perf, "coll_perf", "coll_algobw_gbs", num, 0.0)),
            timing_source=_field(perf, "coll_perf", "coll_timing_source", str, ""),
            start_us=start,
            stop_us=stop,
        )
    except NcclFormatError as exc:
        raise NcclFormatError(f"{exc} (expected NCCL Inspector's JSON: header.id/rank/n_ranks, "
                              "metadata.hostname/pid/dump_timestamp_us, coll_perf.coll/coll_sn/"
                              "coll_msg_size_bytes/coll_exec_time_us)") from None


_OPS = {
    "AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
    "Broadcast": "broadcast", "Reduce": "reduce", "Send": "send", "Recv": "recv",
    "SendRecv": "send_recv", "AllToAll": "all_to_all",
}


def op_name(coll: str) -> str:
    """torch's name of an NCCL collective (`AllReduce` -> `all_reduce`)."""
    if coll in _OPS:
        return _OPS[coll]
    out = "".join(f"_{c.lower()}" if c.isupper() else c for c in coll).lstrip("_")
    return out or "unknown"


def group_of(comm: str, coll: str) -> str:
    """The Tracehound group of an Inspector record: one per communicator and kind of op."""
    return f"nccl:{comm}/{coll}"


@dataclass(frozen=True, slots=True)
class RankOf:
    """Who a process is in Tracehound's terms."""

    job: str
    attempt: int
    rank: int


class RankResolver(Protocol):
    def __call__(self, hostname: str, pid: int) -> RankOf | None:
        """The job, attempt and global rank of process `pid` on `hostname`; None if unknown."""
        ...


def _environ(path: Path) -> dict[str, str] | None:
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    return parse_environ(raw)


class LocalRanks:
    """Resolves the pids of this host's ranks: from the heartbeats the agent passes to
    `observe` (each carries pid, job, attempt and rank), else from `/proc/PID/environ` (RANK,
    TRACEHOUND_JOB_ID, TRACEHOUND_ATTEMPT or TORCHELASTIC_RESTART_COUNT). A pid of another host,
    or a process without RANK that sent no heartbeat, is unknown (None)."""

    def __init__(self, *, job: str = "", hostname: str | None = None,
                 proc_root: str | os.PathLike[str] = "/proc") -> None:
        self.job = job
        self.hostname = hostname if hostname is not None else socket.gethostname()
        self.proc_root = Path(proc_root)
        self._seen: dict[int, RankOf] = {}
        self._environ: dict[int, RankOf | None] = {}
        self._lock = threading.Lock()

    def observe(self, hb: Heartbeat) -> None:
        """Take note of a heartbeat (call it for every heartbeat the agent receives)."""
        if hb.pid > 0:
            with self._lock:
                self._seen[hb.pid] = RankOf(hb.job, hb.attempt, hb.rank)

    def is_local(self, hostname: str) -> bool:
        """Whether `hostname` (as a process of a rank reports it) names this host."""
        short = self.hostname.partition(".")[0]
        return hostname == self.hostname or hostname.partition(".")[0] == short

    def __call__(self, hostname: str, pid: int) -> RankOf | None:
        if not self.is_local(hostname):
            return None
        with self._lock:
            if pid in self._seen:
                return self._seen[pid]
            if pid in self._environ:
                return self._environ[pid]
        found = self._from_environ(pid)
        with self._lock:
            self._environ[pid] = found
        return found

    def _from_environ(self, pid: int) -> RankOf | None:
        env = _environ(self.proc_root / str(pid) / "environ")
        if env is None or not env.get("RANK", "").isdigit():
            return None
        attempt = env.get(TRACEHOUND_ATTEMPT) or env.get("TORCHELASTIC_RESTART_COUNT") or "0"
        return RankOf(
            job=env.get(TRACEHOUND_JOB_ID) or self.job,
            attempt=int(attempt) if attempt.isdigit() else 0,
            rank=int(env["RANK"]),
        )


@dataclass
class InspectorStats:
    lines: int = 0
    """Complete lines read."""
    collectives: int = 0
    """CollectiveEvent records emitted."""
    groups: int = 0
    """ProcessGroupInfo records emitted."""
    bad_lines: int = 0
    """Lines not in Inspector's format (skipped)."""
    unmapped: int = 0
    """Records of a local process whose job rank is unknown (skipped)."""
    other_host: int = 0
    """Records written on another host (a shared directory; skipped)."""
    restarts: int = 0
    """Files read again from the start (truncated, or replaced under the same name)."""
    dir_missing: int = 0
    """Polls that found no directory."""


@dataclass
class _Tail:
    inode: int
    offset: int = 0
    line_no: int = 0
    bad_logged: bool = False


@dataclass
class _Comm:
    n_ranks: int
    members: dict[int, RankOf] = field(default_factory=dict)
    """Rank within the communicator -> who it is."""
    colls: set[str] = field(default_factory=set)
    announced: set[str] = field(default_factory=set)


class NcclInspectorSource:
    """A `Source` (agent.sources) of collectives from NCCL Inspector's JSON lines."""

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        *,
        job: str,
        node: str,
        ranks: RankResolver | None = None,
        interval_s: float = 2.0,
        patterns: Sequence[str] = ("*.log", "*.jsonl"),
        max_bytes_per_file: int = 4 << 20,
        max_line_bytes: int = 1 << 20,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """`directory`: Inspector's output directory (default NCCL_INSPECTOR_DUMP_DIR of `env`,
        this process's environment by default). `ranks` resolves a writer's pid to its job rank
        (default `LocalRanks(job=job)`; give the agent's own and feed it heartbeats).
        `max_bytes_per_file`: read at most this much of one file per poll (the rest next poll)."""
        if directory is None:
            value = (os.environ if env is None else env).get(NCCL_INSPECTOR_DUMP_DIR, "")
            if not value:
                raise ValueError(f"NcclInspectorSource: no directory given and "
                                 f"{NCCL_INSPECTOR_DUMP_DIR} is not set (expected the "
                                 "directory the job's NCCL Inspector writes to)")
            directory = value
        if not interval_s > 0 or max_bytes_per_file < 1 or max_line_bytes < 1:
            raise ValueError("NcclInspectorSource: interval_s, max_bytes_per_file and "
                             "max_line_bytes must be > 0")
        self.name = "nccl_inspector"
        self.directory = Path(directory)
        self.job = job
        self.node = NodeId(node)
        self.ranks: RankResolver = ranks if ranks is not None else LocalRanks(job=job)
        self.interval_s = interval_s
        self.patterns = tuple(patterns)
        self.max_bytes_per_file = max_bytes_per_file
        self.max_line_bytes = max_line_bytes
        self.stats = InspectorStats()
        self.log = logs.JobLogger(log, job=job, node=node)
        self._tails: dict[Path, _Tail] = {}
        self._comms: dict[str, _Comm] = {}
        self._dir_logged = False
        self._logged_pids: set[tuple[str, int]] = set()

    def close(self) -> None:
        """Nothing is held open between polls."""

    def poll(self, now_us: int) -> list[Record]:
        if not self.directory.is_dir():
            self.stats.dir_missing += 1
            if not self._dir_logged:
                self._dir_logged = True
                self.log.info("no NCCL Inspector directory %s yet (logged once; counted in "
                              "dir_missing)", self.directory)
            return []
        if self._dir_logged:
            self._dir_logged = False
            self.log.info("reading NCCL Inspector output in %s", self.directory)
        paths = sorted({p for pattern in self.patterns for p in self.directory.glob(pattern)
                        if p.is_file()})
        for gone in set(self._tails) - set(paths):
            del self._tails[gone]
        out: list[Record] = []
        for path in paths:
            for line in self._read(path):
                out.extend(self._accept(line, path, now_us))
        out.extend(self._memberships(now_us))
        return out

    # -- files ----------------------------------------------------------------------------------

    def _read(self, path: Path) -> list[tuple[int, bytes]]:
        """The complete new lines of `path` (line number, text), advancing its offset."""
        try:
            with path.open("rb") as f:
                st = os.fstat(f.fileno())
                tail = self._tails.get(path)
                if tail is None or tail.inode != st.st_ino:
                    if tail is not None:
                        self.stats.restarts += 1
                        self.log.info("%s was replaced: reading the new file from its start",
                                      path)
                    tail = self._tails[path] = _Tail(inode=st.st_ino)
                elif st.st_size < tail.offset:
                    self.stats.restarts += 1
                    self.log.info("%s was truncated (%d < %d bytes read): reading it again from "
                                  "its start", path, st.st_size, tail.offset)
                    tail.offset, tail.line_no = 0, 0
                f.seek(tail.offset)
                chunk = f.read(self.max_bytes_per_file)
        except FileNotFoundError:
            self._tails.pop(path, None)
            return []
        end = chunk.rfind(b"\n")
        if end < 0:
            if len(chunk) >= self.max_line_bytes:
                # A line longer than any Inspector writes: skip what there is of it.
                tail.offset += len(chunk)
                self._bad(path, tail.line_no + 1,
                          f"a line longer than {self.max_line_bytes} bytes")
            return []
        lines: list[tuple[int, bytes]] = []
        for raw in chunk[:end].split(b"\n"):
            tail.line_no += 1
            if raw.strip():
                lines.append((tail.line_no, raw))
        tail.offset += end + 1
        self.stats.lines += len(lines)
        return lines

    def _bad(self, path: Path, line_no: int, why: object) -> None:
        self.stats.bad_lines += 1
        tail = self._tails.get(path)
        if tail is not None and not tail.bad_logged:
            tail.bad_logged = True
            self.log.warning("%s:%d: skipped: %s (logged once per file; counted in bad_lines)",
                             path, line_no, why)

    # -- records --------------------------------------------------------------------------------

    def _accept(self, line: tuple[int, bytes], path: Path, now_us: int) -> list[Record]:
        line_no, raw = line
        try:
            rec = parse_inspector_line(raw)
        except NcclFormatError as exc:
            self._bad(path, line_no, exc)
            return []
        who = self.ranks(rec.hostname, rec.pid)
        if who is None:
            foreign = isinstance(self.ranks, LocalRanks) and not self.ranks.is_local(rec.hostname)
            if foreign:
                self.stats.other_host += 1
            else:
                self.stats.unmapped += 1
            key = (rec.hostname, rec.pid)
            if key not in self._logged_pids:
                self._logged_pids.add(key)
                self.log.info("%s: records of pid %d on %s skipped: %s", path, rec.pid,
                              rec.hostname, "written on another host" if foreign else
                              "its job rank is unknown (no heartbeat, no RANK in its environment)")
            return []
        comm = self._comms.setdefault(rec.comm, _Comm(n_ranks=rec.n_ranks))
        comm.members[rec.comm_rank] = who
        comm.colls.add(rec.coll)
        if rec.stop_us and rec.start_us:
            enqueue, complete = rec.start_us, max(rec.stop_us, rec.start_us)
        elif rec.start_us:
            enqueue, complete = rec.start_us, rec.start_us + rec.exec_us
        else:
            complete = rec.dump_us
            enqueue = max(0, complete - rec.exec_us)
        self.stats.collectives += 1
        return [CollectiveEvent(
            job=JobId(who.job or self.job), attempt=who.attempt, node=self.node,
            rank=Rank(who.rank), group=GroupId(group_of(rec.comm, rec.coll)),
            seq=rec.coll_sn + 1, op=op_name(rec.coll), nbytes=rec.nbytes, dtype="", peer=-1,
            state=CollectiveState.COMPLETED, enqueue_us=enqueue, complete_us=complete,
        )]

    def _memberships(self, now_us: int) -> list[Record]:
        """ProcessGroupInfo for each group of each communicator whose ranks are all known."""
        out: list[Record] = []
        for hash_, comm in self._comms.items():
            if len(comm.members) < comm.n_ranks or not comm.colls - comm.announced:
                continue
            ranks = tuple(comm.members[i].rank for i in range(comm.n_ranks)
                          if i in comm.members)
            if len(ranks) < comm.n_ranks:
                continue  # members known, but not numbered 0..n-1: not the documented format
            for coll in sorted(comm.colls - comm.announced):
                comm.announced.add(coll)
                for who in comm.members.values():
                    out.append(ProcessGroupInfo(
                        job=JobId(who.job or self.job), attempt=who.attempt, rank=Rank(who.rank),
                        group=GroupId(group_of(hash_, coll)), ranks=ranks, backend="nccl",
                        time_us=now_us,
                    ))
        self.stats.groups += len(out)
        return out
