"""`tracehound export` and `tracehound load`: a job's records to a trace file and back.

The file format is `tracing.traceformat` (versioned JSON lines). Export writes to a file or to
standard output; load reads a file (or `-` for standard input) into any store, so a trace taken
on a cluster's ClickHouse server can be diagnosed on a laptop's embedded store and the other way
round. Both print a one-line summary on standard error (or a JSON object with `--json`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from tracehound.tracing.ids import JobId

EPILOG = """\
examples:
  tracehound export --job exp7 -o exp7.trace.jsonl
  tracehound load exp7.trace.jsonl --store chdb:///tmp/offline
  tracehound diagnose --job exp7 --store chdb:///tmp/offline
"""


def add_parsers(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `export` and `load` commands to the CLI's subparsers."""
    exp = sub.add_parser(
        "export", help="write a job's records to a trace file (JSON lines)",
        description="Write every record of a job (collectives, heartbeats, groups, exits, health, "
                    "stacks, process samples, incidents and actions) as a versioned JSON-lines "
                    "trace file: for a bug report, to share an incident or to analyse offline.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    exp.add_argument("--job", required=True, help="job id")
    exp.add_argument("-o", "--output", type=Path, metavar="FILE",
                     help="where to write (default: standard output)")
    exp.add_argument("--json", action="store_true", help="print the summary as JSON")
    store_arg(exp)

    load = sub.add_parser(
        "load", help="read a trace file into a store",
        description="Store the records of a trace file written by `tracehound export` (or by "
                    "another tool in the same format). Loading a file twice stores it once. "
                    "Bad lines are reported by number and skipped; the rest is stored.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    load.add_argument("file", help="trace file, or - for standard input")
    load.add_argument("--json", action="store_true", help="print the summary as JSON")
    store_arg(load)


@contextlib.contextmanager
def _output(path: Path | None) -> Iterator[IO[bytes]]:
    if path is None:
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as handle:
        yield handle
    tmp.replace(path)  # a file that exists is complete


def cmd_export(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store
    from tracehound.tracing.traceformat import export_job

    store = open_store(resolve_store_url(args.store))
    try:
        with _output(args.output) as out:
            report = export_job(store, JobId(args.job), out)
    finally:
        store.close()
    total = sum(report.counts.values())
    if total == 0:
        print(f"tracehound export: no records of job {args.job!r} in this store",
              file=sys.stderr)
        return 1
    where = str(args.output) if args.output else "standard output"
    summary = {"job": args.job, "file": where, "records": total, "counts": report.counts}
    if args.json:
        print(json.dumps(summary), file=sys.stderr if args.output is None else sys.stdout)
    else:
        kinds = ", ".join(f"{n} {k}" for k, n in report.counts.items())
        print(f"exported job {args.job}: {total} records ({kinds}) to {where}", file=sys.stderr)
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store
    from tracehound.tracing.traceformat import TraceFileError, load_trace

    name = "standard input" if args.file == "-" else args.file
    store = open_store(resolve_store_url(args.store))
    try:
        if args.file == "-":
            report = load_trace(sys.stdin.buffer, name, store)
        else:
            try:
                handle = open(args.file, "rb")  # noqa: SIM115 (closed below)
            except OSError as exc:
                raise ValueError(f"trace file {args.file!r}: {exc.strerror}") from None
            with handle:
                report = load_trace(handle, name, store)
    except TraceFileError as exc:
        raise ValueError(str(exc)) from None
    finally:
        store.close()
    summary = {
        "job": report.job, "version": report.version, "counts": report.counts,
        "stored": report.stored, "already_stored": report.already_stored,
        "unknown_kinds": report.unknown_kinds,
        "rejected": [{"line": n, "reason": r} for n, r in report.rejected],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"loaded job {report.job} from {name}: {report.stored} records stored, "
              f"{report.already_stored} already there", file=sys.stderr)
        for kind, n in report.unknown_kinds.items():
            print(f"  skipped {n} records of unknown type {kind!r} (written by a newer "
                  "Tracehound?)", file=sys.stderr)
        for number, reason in report.rejected[:20]:
            print(f"  line {number}: {reason}", file=sys.stderr)
        if len(report.rejected) > 20:
            print(f"  ... and {len(report.rejected) - 20} more bad lines", file=sys.stderr)
    return 1 if report.rejected else 0
