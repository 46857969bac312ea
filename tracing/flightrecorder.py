"""PyTorch Flight Recorder dumps read into Tracehound records.

Flight Recorder keeps a ring of each rank's recent collectives and dumps it as a pickle (the
default) or JSON: top level `version` ("2.3" to "2.10" here), `pg_config` (group name -> desc
and member ranks as a string such as "[0, 1]"; empty on gloo), `pg_status` (per group: last
enqueued / started / completed counters) and `entries` (one dict per operation). This module
reads such dumps, from files (`read_dump_dir`, `read_dump_file`) or as parsed JSON
(`parse_dump`; `tracehound.agent.sources.live_fr.read_live` reads a running rank's own), and maps
them onto the records the analysis already understands
(`to_records`): a ProcessGroupInfo per group, a CollectiveEvent per completed operation, one
Heartbeat per dumped rank (its progress per group at the time of the dump) and, from what the
launcher reported, RankExit records.

A rank the dumps say should exist but that left no dump gets no heartbeat: it is a member of
its groups that "never reported", which the analysis reads as frozen (the frozen or crashed
rank is the one that cannot write its dump).

It must never unpickle anything but plain data (dicts, lists, tuples, str, int, float, bool,
None, bytes): a dump is untrusted input, and a pickle that names a class or function is refused.
It never imports torch.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import pickle
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tracehound.tracing.events import (
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    Heartbeat,
    ProcessGroupInfo,
    RankExit,
    Record,
    now_us,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.kinds import MAX_TEXT, MAX_U64
from tracehound.tracing.shapes import joined, shape_text

log = logging.getLogger(__name__)

OLDEST_VERSION = (2, 3)
NEWEST_VERSION = (2, 10)
"""The Flight Recorder format versions this reader knows (torch writes "2.10" in 2.13)."""

MAX_DUMP_BYTES = 1 << 30
"""Files larger than this are not read (a ring of 2,000 entries with frames is a few MB)."""

MAX_WORLD = 1 << 20
"""Ranks a dump may name are below this (a million; the largest jobs have a few hundred
thousand): the job's ranks are enumerated, and a dump naming rank 10**10 would take all
memory."""

UNKNOWN_NODE = NodeId("unknown")
"""Dumps do not say which machine wrote them."""

P2P_BACKEND = "p2p"

_P2P_OPS = ("send", "recv")

_OP_ALIASES = {
    "_allgather_base": "all_gather_into_tensor",
    "_all_gather_base": "all_gather_into_tensor",
    "_reduce_scatter_base": "reduce_scatter_tensor",
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "alltoall_base": "all_to_all_single",
    "alltoall": "all_to_all",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor",
}
"""Flight Recorder's op names (profiling names after the backend prefix) that differ from the
`torch.distributed` function names the live recorder uses."""

_DTYPES: dict[str, tuple[str, int]] = {
    "Float": ("float32", 4), "Double": ("float64", 8), "Half": ("float16", 2),
    "BFloat16": ("bfloat16", 2), "Long": ("int64", 8), "Int": ("int32", 4),
    "Short": ("int16", 2), "Char": ("int8", 1), "Byte": ("uint8", 1), "Bool": ("bool", 1),
    "ComplexHalf": ("complex32", 4), "ComplexFloat": ("complex64", 8),
    "ComplexDouble": ("complex128", 16), "UInt16": ("uint16", 2), "UInt32": ("uint32", 4),
    "UInt64": ("uint64", 8), "Float8_e4m3fn": ("float8_e4m3fn", 1),
    "Float8_e5m2": ("float8_e5m2", 1), "Float8_e4m3fnuz": ("float8_e4m3fnuz", 1),
    "Float8_e5m2fnuz": ("float8_e5m2fnuz", 1),
}
"""c10 ScalarType names (as dumps spell them) -> torch's dtype name and element size."""

_RANK_IN_NAME = re.compile(r"(\d+)(?:\.(?:json|pkl|pickle|bin))?$")


# -- errors ---------------------------------------------------------------------------------------


class DumpError(ValueError):
    """A file that should be a Flight Recorder dump cannot be used; the message names the file
    and what was expected. Permanent: reading it again gives the same error."""


class NotADump(DumpError):
    """The file is neither a pickle nor a JSON object: not a dump at all, to be skipped."""


# -- the restricted unpickler -------------------------------------------------------------------


class _PlainDataUnpickler(pickle.Unpickler):
    """Unpickles only what pickle builds without naming a global: dict, list, tuple, set, str,
    bytes, int, float, bool and None. Any class or function reference is refused."""

    def __init__(self, data: bytes, source: str) -> None:
        super().__init__(io.BytesIO(data))
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        raise DumpError(
            f"{self._source}: refused to unpickle {module}.{name}: a Flight Recorder dump holds "
            "only plain data (dicts, lists, strings, numbers); this pickle names code"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise DumpError(f"{self._source}: refused a pickle with persistent references")


def restricted_loads(data: bytes, source: str = "<bytes>") -> Any:
    """Unpickle plain data only (see `_PlainDataUnpickler`); DumpError naming `source` for a
    pickle that names code or is corrupt."""
    try:
        return _PlainDataUnpickler(data, source).load()
    except DumpError:
        raise
    except Exception as exc:  # pickle raises many kinds on corrupt input
        raise DumpError(f"{source}: corrupt pickle ({type(exc).__name__}: {exc})") from exc


# -- the parsed form ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class FrEntry:
    """One operation of one rank's ring."""

    group: str
    """The process group's name (torch's `group_name`, "0" for the default group)."""
    desc: str
    pg_id: int
    seq: int
    """collective_seq_id: the same on every member for collectives (0 for p2p on some
    versions)."""
    p2p_seq: int
    op_id: int
    """The group's counter over all its operations (p2p included), where the dump has it, else 0."""
    record_id: int
    """Position in the rank's ring since the process started (0 for the first operation)."""
    op: str
    """torch.distributed's name for it (`all_reduce`, `send`, ...)."""
    backend: str
    src: int
    """Group rank of the sender of a send/recv (-1 otherwise)."""
    dst: int
    nbytes: int
    dtype: str
    state: str
    """scheduled, started or completed (gloo leaves everything `scheduled`)."""
    created_ns: int
    completed_ns: int
    """0 when unknown (gloo never records it)."""
    shape: str = ""
    """Every input and output tensor's shape and dtype (`tracing.shapes`); of every part, for
    a coalesced call read as one."""
    parts: int = 1
    """Records of the ring read as this one (a coalesced call's parts and its end)."""

    @property
    def p2p(self) -> bool:
        return self.op in _P2P_OPS


@dataclass(frozen=True, slots=True, kw_only=True)
class FrStatus:
    """pg_status of one group: its operation counters (-1: none)."""

    last_enqueued: int
    last_started: int
    last_completed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FrDump:
    """One rank's Flight Recorder dump, parsed."""

    source: str
    version: tuple[int, int]
    rank: int
    rank_from: str
    """Where the rank came from: "dump" (its `rank` key), "file name" or "process"."""
    dumped_at_us: int
    """When the dump was written (the file's modification time, or as given)."""
    entries: tuple[FrEntry, ...]
    members: Mapping[str, tuple[int, ...]]
    """Group name -> global ranks, from pg_config (groups it lists without ranks are absent)."""
    descs: Mapping[str, str]
    status: Mapping[str, FrStatus]
    """Group name -> its pg_status."""


def _version(raw: Any, source: str) -> tuple[int, int]:
    try:
        text = str(raw)
    except ValueError:  # an integer of more than 4300 digits
        text = f"an integer of {raw.bit_length()} bits"
    try:
        major, minor = (int(p) for p in text.split("."))
    except ValueError:
        raise DumpError(f"{source}: Flight Recorder version {text!r} is not MAJOR.MINOR") from None
    if not OLDEST_VERSION <= (major, minor) <= NEWEST_VERSION:
        raise DumpError(
            f"{source}: Flight Recorder format version {text} is not supported; expected "
            f"{OLDEST_VERSION[0]}.{OLDEST_VERSION[1]} to {NEWEST_VERSION[0]}.{NEWEST_VERSION[1]}"
        )
    return major, minor


def _int(value: Any, default: int = 0) -> int:
    if value is None or isinstance(value, bool):
        return default
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float
        return default


def _ranks(text: Any, source: str, group: str) -> tuple[int, ...]:
    """pg_config's ranks: a string like "[0, 1]" (or, from other writers, a list)."""
    value = text
    if isinstance(text, str):
        try:
            value = ast.literal_eval(text) if text.strip() else []
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            # TypeError: a set or dict display with a list in it; the last two: nested too deep
            raise DumpError(
                f"{source}: pg_config of group {group!r} has ranks {text!r}; expected a list "
                "such as \"[0, 1]\""
            ) from None
    if not isinstance(value, list | tuple) or not all(
        isinstance(r, int) and not isinstance(r, bool) and 0 <= r < MAX_WORLD for r in value
    ):
        raise DumpError(f"{source}: pg_config of group {group!r} has ranks {text!r}; expected "
                        f"a list of integers from 0 to {MAX_WORLD - 1}")
    return tuple(int(r) for r in value)


def _op_and_peers(name: str) -> tuple[str, str, int, int]:
    """(op, backend, src, dst) from a profiling name such as `nccl:send 0->1`,
    `gloo:all_reduce` or `nccl:recv 1<-0`."""
    backend, _, rest = name.partition(":") if ":" in name else ("", "", name)
    parts = rest.split(" ", 1)
    op = parts[0]
    src = dst = -1
    meta = parts[1].strip() if len(parts) == 2 else ""
    if op == "send" and "->" in meta:
        s, d = meta.split("->", 1)
        src, dst = _int(s, -1), _int(d, -1)
    elif op == "recv" and "<-" in meta:
        d, s = meta.split("<-", 1)
        src, dst = _int(s, -1), _int(d, -1)
    return _OP_ALIASES.get(op, op), backend, src, dst


def _bytes_and_dtype(entry: Mapping[str, Any]) -> tuple[int, str]:
    sizes = entry.get("input_sizes") or []
    dtypes = entry.get("input_dtypes") or []
    if not isinstance(sizes, list | tuple):
        sizes = []
    if not isinstance(dtypes, list | tuple):
        dtypes = []
    total = 0
    for i, shape in enumerate(sizes):
        numel = 1
        for d in shape if isinstance(shape, list | tuple) else ():
            numel *= _int(d)
        scalar = dtypes[i] if i < len(dtypes) else (dtypes[0] if dtypes else "")
        total += numel * _DTYPES.get(str(scalar), ("", 0))[1]
    first = str(dtypes[0]) if dtypes else ""
    return total, _DTYPES.get(first, (first.lower(), 0))[0]


def _tensors(entry: Mapping[str, Any], sizes_key: str, dtypes_key: str
             ) -> list[tuple[list[int], str]]:
    """(dims, dtype) of each tensor a record lists under `sizes_key` and `dtypes_key`."""
    sizes = entry.get(sizes_key) or []
    dtypes = entry.get(dtypes_key) or []
    if not isinstance(sizes, list | tuple):
        return []
    if not isinstance(dtypes, list | tuple):
        dtypes = []
    out = []
    for i, dims in enumerate(sizes):
        scalar = str(dtypes[i]) if i < len(dtypes) else ""
        shape = [_int(d) for d in dims] if isinstance(dims, list | tuple) else []
        out.append((shape, _DTYPES.get(scalar, (scalar.lower(), 0))[0]))
    return out


def _shape(entry: Mapping[str, Any]) -> str:
    return shape_text(_tensors(entry, "input_sizes", "input_dtypes"),
                      _tensors(entry, "output_sizes", "output_dtypes"))


def _coalesced(entries: tuple[FrEntry, ...]) -> tuple[FrEntry, ...]:
    """The ring with each coalesced call read as one entry. NCCL records a call made inside a
    coalescing manager as one record per part, all with the group's one sequence id, followed by
    an end record (`coalesced`, `allreduce_coalesced`, ...) under the same id; torch's analyzer
    groups them the same way. The one entry has the first part's creation, the end's state and
    completion, the parts' bytes in all and their shapes one after another, and the parts' op
    when they share one (else the end's). Point-to-point records are left as they are."""
    out: list[FrEntry] = []
    run: list[FrEntry] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            end = run[-1]
            parts = [e for e in run[:-1] if e.shape] or run[:-1]
            ops = {e.op for e in run[:-1]}
            out.append(replace(
                end, op=ops.pop() if len(ops) == 1 else end.op,
                nbytes=sum(e.nbytes for e in parts), dtype=parts[0].dtype,
                shape=joined(e.shape for e in parts) if len(parts) > 1 or parts[0].shape
                else end.shape,
                created_ns=run[0].created_ns, parts=len(run),
            ))
        run.clear()

    for e in entries:
        if run and (e.p2p or e.seq <= 0 or (e.group, e.seq) != (run[0].group, run[0].seq)):
            flush()
        if e.p2p or e.seq <= 0:
            out.append(e)
        else:
            run.append(e)
    flush()
    return tuple(out)


def _entry(raw: Any, source: str, index: int) -> FrEntry:
    if not isinstance(raw, Mapping):
        raise DumpError(f"{source}: entry {index} is a {type(raw).__name__}; expected a dict")
    missing = [k for k in ("profiling_name", "collective_seq_id", "time_created_ns")
               if k not in raw]
    if missing:
        raise DumpError(f"{source}: entry {index} lacks {', '.join(missing)}")
    group_field = raw.get("process_group") or ("", "")
    if not isinstance(group_field, list | tuple) or len(group_field) != 2:
        raise DumpError(f"{source}: entry {index} has process_group {group_field!r}; expected "
                        "(name, desc)")
    group, desc = str(group_field[0]), str(group_field[1])
    pg_id = _int(raw.get("pg_id"))
    if not group:
        group = str(pg_id)
    op, backend, src, dst = _op_and_peers(str(raw["profiling_name"]))
    nbytes, dtype = _bytes_and_dtype(raw)
    entry = FrEntry(
        group=group, desc=desc, pg_id=pg_id, seq=_int(raw["collective_seq_id"]),
        p2p_seq=_int(raw.get("p2p_seq_id")), op_id=_int(raw.get("op_id")),
        record_id=_int(raw.get("record_id")), op=op,
        backend=backend, src=src, dst=dst, nbytes=nbytes, dtype=dtype,
        state=str(raw.get("state") or "scheduled"), created_ns=_int(raw["time_created_ns"]),
        completed_ns=_int(raw.get("time_discovered_completed_ns")), shape=_shape(raw),
    )
    _check_fits(entry, source, index)
    return entry


def _short_text(text: str, source: str, what: str) -> str:
    """`text` if it fits a record's text field (with room for what is added to a group name);
    DumpError otherwise."""
    if len(text) > MAX_TEXT // 2:
        raise DumpError(f"{source}: a {what} of {len(text)} characters; expected at most "
                        f"{MAX_TEXT // 2}")
    return text


def _check_fits(e: FrEntry, source: str, index: int) -> None:
    """DumpError unless the entry's values fit the records it becomes (a negative time, a
    size past 64 bits or an empty op name would make records no store takes)."""
    numbers = (("collective_seq_id", e.seq), ("time_created_ns", e.created_ns),
               ("time_discovered_completed_ns", e.completed_ns), ("input bytes", e.nbytes))
    for name, value in numbers:
        if not 0 <= value <= MAX_U64:
            raise DumpError(f"{source}: entry {index} has {name} {value}; expected an integer "
                            f"from 0 to {MAX_U64}")
    if not e.op:
        raise DumpError(f"{source}: entry {index} has a profiling_name that names no operation")
    for name, text in (("process group", e.group), ("profiling_name", e.op),
                       ("input_dtypes", e.dtype), ("process group desc", e.desc),
                       ("list of tensor sizes and dtypes", e.shape)):
        if len(text) > MAX_TEXT // 2:
            raise DumpError(f"{source}: entry {index} has a {name} of {len(text)} characters; "
                            f"expected at most {MAX_TEXT // 2}")


def parse_dump(raw: Any, *, source: str, dumped_at_us: int,
               rank_hint: int | None = None, hint_from: str = "file name") -> FrDump:
    """A dump's content (as unpickled or JSON-decoded) parsed; DumpError naming `source` when it
    is not a Flight Recorder dump of a known version. The rank is the dump's own `rank` key
    where it has one; `rank_hint` (from the file name, or the running process) otherwise."""
    if not isinstance(raw, Mapping) or "version" not in raw or not (
        "entries" in raw or "pg_config" in raw
    ):
        keys = sorted(str(k) for k in raw)[:8] if isinstance(raw, Mapping) else []
        found = f"keys {keys}" if isinstance(raw, Mapping) else f"a {type(raw).__name__}"
        raise DumpError(f"{source}: not a Flight Recorder dump: expected a dict with keys "
                        f"version, pg_config and entries; found {found}")
    version = _version(raw["version"], source)
    if "rank" in raw and _int(raw["rank"], -1) >= 0:
        rank, rank_from = _int(raw["rank"]), "dump"
    elif rank_hint is not None:
        rank, rank_from = rank_hint, hint_from
    else:
        raise DumpError(f"{source}: the dump has no `rank` key and the file name ends in no "
                        "rank number (torch names dumps PREFIX<rank>)")
    if rank >= MAX_WORLD:
        raise DumpError(f"{source}: rank {rank} (from the {rank_from}) is not below "
                        f"{MAX_WORLD}, the most ranks this reader takes")
    entries_raw = raw.get("entries") or []
    if not isinstance(entries_raw, list | tuple):
        raise DumpError(f"{source}: entries is a {type(entries_raw).__name__}; expected a list")
    entries = _coalesced(tuple(_entry(e, source, i) for i, e in enumerate(entries_raw)))
    members: dict[str, tuple[int, ...]] = {}
    descs: dict[str, str] = {}
    config = raw.get("pg_config") or {}
    if not isinstance(config, Mapping):
        raise DumpError(f"{source}: pg_config is a {type(config).__name__}; expected a dict")
    for key, info in config.items():
        if not isinstance(info, Mapping):
            continue
        name = str(info.get("name") or key)
        if not name:
            continue  # gloo writes one empty placeholder
        descs[name] = _short_text(str(info.get("desc") or ""), source, "pg_config desc")
        _short_text(name, source, "pg_config group name")
        ranks = _ranks(info.get("ranks", "[]"), source, name)
        if ranks:
            members[name] = ranks
    names_by_id = {str(e.pg_id): e.group for e in entries}
    status: dict[str, FrStatus] = {}
    pg_status = raw.get("pg_status") or {}
    if not isinstance(pg_status, Mapping):
        raise DumpError(f"{source}: pg_status is a {type(pg_status).__name__}; expected a dict")
    for key, st in pg_status.items():
        if not isinstance(st, Mapping) or not str(key):
            continue  # not a group's status, or an empty placeholder like pg_config's
        name = str(key) if str(key) in members or str(key) in descs else names_by_id.get(
            str(key), _short_text(str(key), source, "pg_status group name"))
        status[name] = FrStatus(
            last_enqueued=_int(st.get("last_enqueued_collective"), -1),
            last_started=_int(st.get("last_started_collective"), -1),
            last_completed=_int(st.get("last_completed_collective"), -1),
        )
    for e in entries:
        descs.setdefault(e.group, e.desc)
    return FrDump(source=source, version=version, rank=rank, rank_from=rank_from,
                  dumped_at_us=dumped_at_us, entries=entries, members=members, descs=descs,
                  status=status)


# -- reading files --------------------------------------------------------------------------------


def decode_bytes(data: bytes, source: str) -> Any:
    """A dump file's content decoded: pickle (protocol 2+) or JSON. NotADump when it is
    neither; DumpError when it looks like one but is corrupt."""
    if data[:1] == b"\x80":
        return restricted_loads(data, source)
    head = data.lstrip()[:1]
    if head == b"{":
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as exc:
            # ValueError: not JSON, not UTF-8, or an integer of more than 4300 digits
            problem = "nested too deep" if isinstance(exc, RecursionError) else exc
            raise DumpError(f"{source}: corrupt JSON ({problem})") from exc
    raise NotADump(f"{source}: neither a pickle nor a JSON object")


def rank_in_name(name: str) -> int | None:
    """The rank torch's dump naming puts at the end of a file name (PREFIX<rank>)."""
    match = _RANK_IN_NAME.search(name)
    return int(match.group(1)) if match else None


def read_dump_file(path: Path, *, dumped_at_us: int | None = None) -> FrDump:
    """One dump file; NotADump / DumpError (naming the file) when it cannot be used."""
    source = str(path)
    try:
        size = path.stat().st_size
        if size > MAX_DUMP_BYTES:
            raise DumpError(f"{source}: {size} bytes, larger than any Flight Recorder dump "
                            f"this reader accepts ({MAX_DUMP_BYTES})")
        data = path.read_bytes()
        mtime_us = path.stat().st_mtime_ns // 1000
    except OSError as exc:
        raise DumpError(f"{source}: cannot be read ({exc.strerror})") from exc
    raw = decode_bytes(data, source)
    dump = parse_dump(raw, source=source, dumped_at_us=dumped_at_us or mtime_us,
                      rank_hint=rank_in_name(path.name))
    # A dump cannot be older than what it records (a copy may have reset the file's time).
    newest = max((e.created_ns // 1000 for e in dump.entries), default=0)
    if dump.dumped_at_us < newest:
        return _with_time(dump, newest)
    return dump


def _with_time(dump: FrDump, at_us: int) -> FrDump:
    return FrDump(source=dump.source, version=dump.version, rank=dump.rank,
                  rank_from=dump.rank_from, dumped_at_us=at_us, entries=dump.entries,
                  members=dump.members, descs=dump.descs, status=dump.status)


@dataclass(slots=True)
class DirReport:
    """What reading a directory found: the dumps, and every file not used and why."""

    dumps: list[FrDump] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(file, reason): files that are not dumps at all."""
    errors: list[tuple[str, str]] = field(default_factory=list)
    """(file, reason): files that should be dumps but cannot be used."""


def read_dump_dir(directory: Path, *, dumped_at_us: int | None = None) -> DirReport:
    """Every dump in `directory` (recursively). Files that are not dumps are skipped and listed;
    bad dumps are listed as errors; a second dump of the same rank is an error (the first one,
    in name order, is kept)."""
    report = DirReport()
    by_rank: dict[int, str] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        try:
            dump = read_dump_file(path, dumped_at_us=dumped_at_us)
        except NotADump as exc:
            report.skipped.append((str(path), str(exc).removeprefix(f"{path}: ")))
            continue
        except DumpError as exc:
            report.errors.append((str(path), str(exc)))
            continue
        if dump.rank in by_rank:
            report.errors.append((str(path), f"{path}: a second dump of rank {dump.rank} "
                                  f"(the first is {by_rank[dump.rank]}); not used"))
            continue
        by_rank[dump.rank] = str(path)
        report.dumps.append(dump)
    return report


# -- mapping onto records -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Conversion:
    """The records made of a set of dumps, and what was inferred on the way."""

    records: tuple[Record, ...]
    ranks: tuple[int, ...]
    """Ranks that left a dump."""
    missing: tuple[int, ...]
    """Ranks expected (world size, group members) that left none."""
    world_size: int
    world_from: str
    """"given", "pg_config" or "highest rank" (a missing last rank cannot be seen then)."""
    inferred_groups: tuple[str, ...]
    """Groups whose members the dumps do not list (gloo): their members are the ranks whose
    dumps show them (all ranks for the default group)."""
    notes: tuple[str, ...] = ()


def _records_states(dump: FrDump) -> bool:
    """Whether the dump's backend records states and times (NCCL does, gloo does not)."""
    return any(x.state != "scheduled" or x.completed_ns > 0 for x in dump.entries)


def _completed(dump: FrDump, e: FrEntry, with_states: bool) -> bool:
    """Whether the rank saw `e` complete. NCCL records states and times; gloo leaves every entry
    `scheduled` without times, and only pg_status says how far the group got (counting all its
    operations: op_id where the dump has it). A failed gloo operation counts as completed there
    too: the dumps cannot tell it from a successful one."""
    if e.state == "completed" or e.completed_ns > 0:
        return True
    if with_states:
        return False  # scheduled or started: pending
    st = dump.status.get(e.group)
    if st is None:
        return False
    counter = e.op_id if e.op_id > 0 else e.seq
    return 0 < counter <= st.last_completed


def _group_id(name: str, ranks: tuple[int, ...], ambiguous: set[str]) -> str:
    if name not in ambiguous:
        return name
    digest = hashlib.sha1(repr(ranks).encode(), usedforsecurity=False).hexdigest()[:8]
    return f"{name}#{digest}"


def _pair(group: str, a: int, b: int) -> str:
    low, high = min(a, b), max(a, b)
    return f"{group}:p2p:{low}-{high}"


@dataclass(slots=True)
class _Progress:
    last_enqueued: int = 0
    last_completed: int = 0
    last_enqueue_us: int = 0
    last_complete_us: int = 0
    pending: list[tuple[int, str, int, str, str]] = field(default_factory=list)
    """(seq, op, nbytes, dtype, shape) of operations entered and not completed, in order."""

    def to_progress(self, group: str) -> GroupProgress:
        pending = sorted(p for p in self.pending if p[0] > self.last_completed)
        last = next((p for p in pending if p[0] == self.last_enqueued), None)
        oldest = pending[0] if len(pending) > 1 else None
        return GroupProgress(
            group=GroupId(group), last_enqueued=self.last_enqueued,
            last_completed=self.last_completed, pending_op=last[1] if last else "",
            last_enqueue_us=self.last_enqueue_us, last_complete_us=self.last_complete_us,
            pending_nbytes=last[2] if last else 0, pending_dtype=last[3] if last else "",
            oldest_seq=oldest[0] if oldest else 0, oldest_op=oldest[1] if oldest else "",
            oldest_nbytes=oldest[2] if oldest else 0, oldest_dtype=oldest[3] if oldest else "",
            pending_shape=last[4] if last else "", oldest_shape=oldest[4] if oldest else "",
        )


def to_records(
    dumps: Iterable[FrDump], *, job: JobId, attempt: int, world_size: int | None = None,
    exits: Mapping[int, int] | None = None,
) -> Conversion:
    """The records the dumps stand for (see the module docstring). `world_size`: the job's
    number of ranks where known (else from pg_config, else the highest rank seen plus one);
    `exits`: rank -> exit status as the launcher reported it (negative: killed by signal)."""
    dumps = sorted(dumps, key=lambda d: d.rank)
    notes: list[str] = []
    sets: dict[str, set[tuple[int, ...]]] = {}
    for d in dumps:
        for name, ranks in d.members.items():
            sets.setdefault(name, set()).add(ranks)
    ambiguous = {n for n, s in sets.items() if len(s) > 1}
    if ambiguous:
        notes.append(f"groups {sorted(ambiguous)} have different members on different ranks: "
                     "each member set is a group of its own")
    seen = {d.rank for d in dumps}
    configured = {r for s in sets.values() for ranks in s for r in ranks} | set(exits or {})
    if world_size is not None:
        world, world_from = world_size, "given"
    elif configured:
        world, world_from = max(configured | seen) + 1, "pg_config" if sets else "exits"
    else:
        world, world_from = max(seen, default=-1) + 1, "highest rank"
    if any(r >= world for r in seen | configured):
        raise ValueError(f"world size {world} is too small: the dumps show rank "
                         f"{max(seen | configured)}")

    # Groups without listed members (gloo): the default group has every rank, the others the
    # ranks whose dumps show them.
    shown: dict[str, set[int]] = {}
    default_names: set[str] = set()
    for d in dumps:
        for name in {e.group for e in d.entries} | set(d.status) | set(d.descs):
            shown.setdefault(name, set()).add(d.rank)
        for e in d.entries:
            if e.desc == "default_pg" or e.pg_id == 0:
                default_names.add(e.group)
        default_names.update(n for n, desc in d.descs.items() if desc == "default_pg")
    inferred = sorted(n for n in shown if n not in sets)

    def members_of(d: FrDump, name: str) -> tuple[int, ...]:
        if name in d.members:
            return d.members[name]
        if name in sets:  # listed by other ranks only
            return min(sets[name])
        if name in default_names:
            return tuple(range(world))
        return tuple(sorted(shown.get(name, {d.rank})))

    records: list[Record] = []
    for d in dumps:
        records.extend(_rank_records(d, job=job, attempt=attempt, members_of=members_of,
                                     ambiguous=ambiguous, notes=notes))
    expected = set(range(world)) | configured
    missing = sorted(expected - seen)
    newest_us = max((e.created_ns // 1000 for d in dumps for e in d.entries), default=0)
    for rank, code in sorted((exits or {}).items()):
        # When it exited is not known: at the latest operation any dump shows, before the dumps.
        records.append(RankExit(job=job, attempt=attempt, node=UNKNOWN_NODE, rank=Rank(rank),
                                pid=0, exit_code=code, time_us=newest_us or now_us()))
    return Conversion(records=tuple(records), ranks=tuple(sorted(seen)), missing=tuple(missing),
                      world_size=world, world_from=world_from, inferred_groups=tuple(inferred),
                      notes=tuple(notes))


def _rank_records(
    d: FrDump, *, job: JobId, attempt: int,
    members_of: Callable[[FrDump, str], tuple[int, ...]], ambiguous: set[str],
    notes: list[str],
) -> list[Record]:
    out: list[Record] = []
    progress: dict[str, _Progress] = {}
    announced: dict[str, tuple[tuple[int, ...], str, int]] = {}
    pair_seq: dict[str, int] = {}
    # A ring that wrapped lost the first sends/recvs, so pair sequence ids cannot be counted.
    wrapped = bool(d.entries) and d.entries[0].record_id > 0
    with_states = _records_states(d)
    for e in d.entries:
        ranks = members_of(d, e.group)
        group = _group_id(e.group, ranks, ambiguous)
        at_us = e.created_ns // 1000
        if group not in announced:
            announced[group] = (ranks, e.backend, at_us)
        done = _completed(d, e, with_states)
        if e.p2p:
            if wrapped:
                continue
            me_in_group, peer_in_group = (e.src, e.dst) if e.op == "send" else (e.dst, e.src)
            if not 0 <= peer_in_group < len(ranks):
                continue
            peer = ranks[peer_in_group]
            if 0 <= me_in_group < len(ranks) and ranks[me_in_group] != d.rank:
                notes.append(f"{d.source}: {e.op} names group rank {me_in_group} as itself, "
                             f"which is global rank {ranks[me_in_group]}, not {d.rank}")
            name = _pair(group, d.rank, peer)
            if name not in announced:
                announced[name] = ((min(d.rank, peer), max(d.rank, peer)), P2P_BACKEND, at_us)
            seq = pair_seq[name] = pair_seq.get(name, 0) + 1
            group, peer_rank = name, peer
        else:
            seq, peer_rank = e.seq, -1
            if seq <= 0:
                continue
        p = progress.setdefault(group, _Progress())
        if seq >= p.last_enqueued:
            p.last_enqueued, p.last_enqueue_us = seq, at_us
        if done:
            complete_us = e.completed_ns // 1000 if e.completed_ns else at_us
            if seq >= p.last_completed:
                p.last_completed, p.last_complete_us = seq, complete_us
            out.append(CollectiveEvent(
                job=job, attempt=attempt, node=UNKNOWN_NODE, rank=Rank(d.rank),
                group=GroupId(group), seq=seq, op=e.op, nbytes=e.nbytes, dtype=e.dtype,
                peer=peer_rank, state=CollectiveState.COMPLETED, enqueue_us=at_us,
                # gloo records no completion time: the operation is stored as taking none
                complete_us=complete_us, shape=e.shape,
            ))
        else:
            p.pending.append((seq, e.op, e.nbytes, e.dtype, e.shape))
    # Groups the rank is in with no entry left in its ring (pg_status, pg_config only).
    for name in set(d.status) | set(d.members):
        ranks = members_of(d, name)
        group = _group_id(name, ranks, ambiguous)
        if group not in announced:
            announced[group] = (ranks, "", d.dumped_at_us)
    for group, (ranks, backend, at_us) in announced.items():
        out.append(ProcessGroupInfo(job=job, attempt=attempt, rank=Rank(d.rank),
                                    group=GroupId(group), ranks=ranks, backend=backend,
                                    time_us=at_us))
    out.append(Heartbeat(
        job=job, attempt=attempt, node=UNKNOWN_NODE, rank=Rank(d.rank), time_us=d.dumped_at_us,
        pid=0, step=0, step_us=0, start_step=0, first_step_us=0, dropped=0,
        groups=tuple(p.to_progress(g) for g, p in sorted(progress.items())),
    ))
    return out


def parse_exits(values: Iterable[str]) -> dict[int, int]:
    """`RANK=CODE` strings (as the launcher reported them) -> {rank: code}; ValueError naming
    the bad one."""
    out: dict[int, int] = {}
    for text in values:
        rank, sep, code = text.partition("=")
        try:
            if not sep:
                raise ValueError
            out[int(rank)] = int(code)
        except ValueError:
            raise ValueError(f"--exit {text!r}: expected RANK=CODE, e.g. 2=1 or 2=-9 "
                             "(killed by signal 9)") from None
        if out[int(rank)] == 0 or int(rank) < 0:
            raise ValueError(f"--exit {text!r}: a failed exit has a non-zero code and a rank "
                             ">= 0")
    return out

