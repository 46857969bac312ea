"""The trace file: a job's records as JSON lines, for bug reports, sharing an incident, offline
analysis and traces from other tools (`tracehound export` / `tracehound load`).

A trace file is UTF-8 text, one JSON object per line:

- line 1, the header: `{"format": "tracehound-trace", "version": 1, "job": "...",
  "exported_at_us": ..., "counts": {"collective": n, ...}}`;
- every other line, one record in its wire form (`tracing.wire`): an object whose `type` names
  the kind (`collective`, `heartbeat`, `group`, `exit`, `health`, `stack`, `process`, `incident`,
  `action`) and whose other fields are the kind's fields as declared in `tracing.events`.
  Incidents are written without their actions; each action is a line of its own.

Compatibility: `version` changes only when a reader of the old version could misread the file.
A reader takes every version up to its own and refuses newer ones by name. Within a version,
fields may be added (with defaults, so old files still read) and unknown fields are ignored, so
newer files read with an older Tracehound lose only what it does not know. A line of a kind this
reader does not know is skipped and counted, never silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec

from tracehound.tracing import kinds, wire
from tracehound.tracing.events import Action, Batch, Incident, JobState, now_us
from tracehound.tracing.ids import JobId
from tracehound.tracing.store.port import FOREVER_US, BulkStore, HeldRecords, TraceStore

FORMAT = "tracehound-trace"
VERSION = 1
"""The trace file version this Tracehound writes, and the newest it reads."""

LOAD_BATCH = 50_000
"""Records per insert when a file is loaded."""


class TraceFileError(ValueError):
    """A trace file that cannot be read; the message names the file, the line and the problem."""


@dataclass
class ExportReport:
    job: str
    counts: dict[str, int] = field(default_factory=dict)
    """Records written per kind."""


@dataclass
class LoadReport:
    job: str
    version: int
    counts: dict[str, int] = field(default_factory=dict)
    """Valid records in the file, per kind."""
    stored: int = 0
    """Records stored now."""
    already_stored: int = 0
    """Records the store held already (a file loaded twice is stored once)."""
    unknown_kinds: dict[str, int] = field(default_factory=dict)
    """Lines of kinds this Tracehound does not know, per `type`: skipped, counted here."""
    rejected: list[tuple[int, str]] = field(default_factory=list)
    """(line number, reason) of every line that is not a valid record."""


# --- export --------------------------------------------------------------------------------


def job_records(store: BulkStore, job: JobId) -> Iterator[kinds.RecordBase]:
    """Every record of `job`, kind by kind in declaration order: the kinds with a job column,
    plus node-wide health readings (job "") on the job's nodes while it ran, which a hardware
    verdict may rest on."""
    nodes: set[str] = set()
    first, last = FOREVER_US, 0
    for layout in kinds.layouts():
        if "job" not in layout.read_columns:
            continue
        found = store.records(layout.kind, job)
        times = [t for t in (getattr(r, layout.stored.time) for r in found) if t]
        if times:
            first, last = min(first, *times), max(last, *times)
        if "node" in layout.read_columns:
            nodes.update(r.node for r in found)
        yield from found
    if nodes and last:
        for sample in store.health(sorted(nodes), first, last + 1):
            if not sample.job:
                yield sample


def write_trace(records: Iterable[kinds.RecordBase], out: IO[bytes], job: str) -> ExportReport:
    """Write a header and `records` to `out`; the header's counts are of what follows, so the
    records are gathered first."""
    report = ExportReport(job=job)
    lines: list[bytes] = []
    for found in records:
        record = (msgspec.structs.replace(found, actions=())
                  if isinstance(found, Incident) and found.actions else found)
        tag = kinds.layout(type(record)).tag
        report.counts[tag] = report.counts.get(tag, 0) + 1
        lines.append(wire.encode_line(record))
    header = {"format": FORMAT, "version": VERSION, "job": job, "exported_at_us": now_us(),
              "counts": report.counts}
    out.write(json.dumps(header, separators=(",", ":")).encode() + b"\n")
    for line in lines:
        out.write(line + b"\n")
    return report


def export_job(store: TraceStore, job: JobId, out: IO[bytes]) -> ExportReport:
    """Write every record of `job` in `store` to `out` as a trace file."""
    from tracehound.tracing.store.port import bulk

    return write_trace(job_records(bulk(store), job), out, job)


# --- load ----------------------------------------------------------------------------------


def read_header(first: bytes, name: str) -> dict[str, Any]:
    """The header of a trace file; TraceFileError saying what is wrong."""
    try:
        header = json.loads(first)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceFileError(f"{name}: line 1 is not JSON ({exc}); expected the header "
                             f'{{"format": "{FORMAT}", "version": N, ...}}') from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise TraceFileError(f"{name}: line 1 is not a Tracehound trace header (expected "
                             f'"format": "{FORMAT}")')
    version = header.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise TraceFileError(f"{name}: header field 'version' must be a positive integer, "
                             f"got {version!r}")
    if version > VERSION:
        raise TraceFileError(f"{name}: written in trace format version {version}; this "
                             f"Tracehound reads versions 1 to {VERSION}: upgrade to load it")
    if not isinstance(header.get("job"), str) or not header["job"]:
        raise TraceFileError(f"{name}: header field 'job' must be a non-empty string")
    return header


def read_trace(handle: IO[bytes], name: str, report: LoadReport | None = None
               ) -> Iterator[tuple[int, kinds.RecordBase]]:
    """(line number, record) of every valid record line; bad lines and unknown kinds are
    recorded in `report` and skipped."""
    report = report or LoadReport(job="", version=VERSION)
    first = handle.readline()
    header = read_header(first, name)
    report.job, report.version = header["job"], header["version"]
    for number, raw in enumerate(handle, start=2):
        line = raw.strip()
        if not line:
            continue
        try:
            yield number, wire.decode_line(line, batch_only=False)
        except wire.InvalidRecord as exc:
            tag = _type_of(line)
            if tag is not None and kinds.by_tag(tag) is None:
                report.unknown_kinds[tag] = report.unknown_kinds.get(tag, 0) + 1
            else:
                report.rejected.append((number, str(exc)))


def _type_of(line: bytes) -> str | None:
    try:
        raw = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    tag = raw.get("type") if isinstance(raw, dict) else None
    return tag if isinstance(tag, str) else None


def load_trace(handle: IO[bytes], name: str, store: TraceStore) -> LoadReport:
    """Store every record of a trace file. Batch kinds go in as batches whose ids come from the
    file's job and the records' position, sent as possible duplicates, so loading a file twice
    stores it once; incidents and actions the store already holds are skipped."""
    report = LoadReport(job="", version=VERSION)
    pending: list[Any] = []
    controller_records: list[Any] = []
    for number, record in read_trace(handle, name, report):
        tag = kinds.layout(type(record)).tag
        report.counts[tag] = report.counts.get(tag, 0) + 1
        if kinds.layout(type(record)).stored.batch:
            pending.append(record)
            if len(pending) >= LOAD_BATCH:
                _insert(store, report, pending, number)
                pending = []
        else:
            controller_records.append(record)
    if pending:
        _insert(store, report, pending, -1)
    _store_incidents_and_actions(store, report, controller_records)
    return report


def _insert(store: TraceStore, report: LoadReport, records: list[Any], number: int) -> None:
    batch_id = f"load/{report.job}/{number}"
    result = store.insert(Batch(batch_id=batch_id, records=tuple(records)), maybe_duplicate=True)
    report.stored += result.inserted
    report.already_stored += result.skipped


def _store_incidents_and_actions(store: TraceStore, report: LoadReport, records: list[Any]
                                 ) -> None:
    held = HeldRecords.read(store, {r.job for r in records})
    for record in records:
        if not isinstance(record, Incident | Action | JobState):  # no writer for this kind
            report.rejected.append((0, f"no way to store {type(record).__name__} records"))
            continue
        if held.has(record):
            report.already_stored += 1
            continue
        if isinstance(record, Incident):
            store.record_incident(record)
        elif isinstance(record, JobState):
            store.record_state(record)
        else:
            store.record_action(record)
        held.add(record)
        report.stored += 1


__all__ = [
    "FORMAT",
    "VERSION",
    "ExportReport",
    "LoadReport",
    "TraceFileError",
    "export_job",
    "job_records",
    "load_trace",
    "read_header",
    "read_trace",
    "write_trace",
]

