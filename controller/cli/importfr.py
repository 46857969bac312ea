"""`tracehound import-fr`: PyTorch Flight Recorder dumps of a job into a store, for `diagnose`.

Reads every file of a directory (`tracing.flightrecorder`): dumps are mapped onto records and
stored; files that are not dumps are skipped and listed; bad dumps are listed with what was
wrong, and the good ones are stored all the same. It prints a summary on standard error (or a
JSON object on standard output with `--json`).

It never unpickles code (the dumps are read as plain data only) and never changes what the
store already holds: importing the same dumps twice stores them once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tracehound.tracing.ids import JobId

EPILOG = """\
The rank of a dump is its `rank` key, or else the number its file name ends in (torch names
dumps PREFIX<rank>). A rank the job had but that left no dump is stored as a member of its
groups that never reported: the analysis reads it as frozen. When ranks exited, say so with
--exit (torchrun prints each failed rank's exit code).

examples:
  tracehound import-fr /shared/fr_dumps --job exp7 --store chdb:///tmp/offline
  tracehound diagnose --job exp7 --store chdb:///tmp/offline

  tracehound import-fr ./dumps --job exp8 --world-size 64 --exit 17=-9 --json
"""

INSERT_BATCH = 10_000
"""Records per stored batch."""


def add_parser(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the `import-fr` command to the CLI's subparsers."""
    p = sub.add_parser(
        "import-fr", help="read PyTorch Flight Recorder dumps of a job into a store",
        description="Store the collectives, group progress and process groups recorded in "
                    "PyTorch Flight Recorder dumps (pickle or JSON, format 2.3 to 2.10, one file "
                    "per rank) as a job's traces, so that `tracehound diagnose` can name the "
                    "rank behind a hang, a mismatch or a crash. Files that are not dumps are "
                    "skipped and listed.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("directory", type=Path, metavar="DIR",
                   help="directory holding the dumps (searched recursively)")
    p.add_argument("--job", required=True, help="job id to store them under")
    p.add_argument("--attempt", type=int, default=0, help="attempt number (default 0)")
    p.add_argument("--world-size", type=int, metavar="N",
                   help="number of ranks the job had (default: from the dumps' group lists, "
                        "else the highest rank seen plus one, which cannot show a missing last "
                        "rank)")
    p.add_argument("--exit", action="append", default=[], metavar="RANK=CODE", dest="exits",
                   help="a rank exited with CODE (negative: killed by that signal), as the "
                        "launcher reported; repeatable")
    p.add_argument("--dumped-at", type=float, metavar="EPOCH_S",
                   help="when the dumps were taken, in seconds since the epoch (default: each "
                        "file's modification time)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    store_arg(p)
    p.set_defaults(handler=cmd_import_fr)


def _batches(records: Sequence[Any], job: str, attempt: int) -> list[tuple[str, tuple[Any, ...]]]:
    """Records in batches whose ids depend only on their content: a second import of the same
    dumps is recognized by the store."""
    from tracehound.tracing.wire import encode_line

    out = []
    for start in range(0, len(records), INSERT_BATCH):
        chunk = tuple(records[start:start + INSERT_BATCH])
        digest = hashlib.sha256()
        for r in chunk:
            digest.update(encode_line(r))
        out.append((f"import-fr/{job}/{attempt}/{digest.hexdigest()[:20]}", chunk))
    return out


def cmd_import_fr(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.events import Batch, Heartbeat
    from tracehound.tracing.flightrecorder import parse_exits, read_dump_dir, to_records
    from tracehound.tracing.store import open_store

    directory: Path = args.directory
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (expected one holding the dumps)")
    if args.world_size is not None and args.world_size < 1:
        raise ValueError(f"--world-size {args.world_size}: expected a positive number of ranks")
    exits = parse_exits(args.exits)
    dumped_at = int(args.dumped_at * 1_000_000) if args.dumped_at is not None else None
    found = read_dump_dir(directory, dumped_at_us=dumped_at)
    if not found.dumps:
        reasons = "; ".join(r for _, r in found.errors[:3]) or "no file was a dump"
        raise ValueError(f"{directory}: no Flight Recorder dump could be read ({reasons}); "
                         f"{len(found.skipped)} file(s) skipped as not dumps")
    conv = to_records(found.dumps, job=JobId(args.job), attempt=args.attempt,
                      world_size=args.world_size, exits=exits)
    counts: dict[str, int] = {}
    for r in conv.records:
        counts[type(r).__name__] = counts.get(type(r).__name__, 0) + 1
    inserted = skipped = 0
    store = open_store(resolve_store_url(args.store))
    try:
        for batch_id, chunk in _batches(conv.records, args.job, args.attempt):
            result = store.insert(Batch(batch_id=batch_id, records=chunk), maybe_duplicate=True)
            inserted += result.inserted
            skipped += result.skipped
    finally:
        store.close()
    waiting = any(g.pending_op for r in conv.records if isinstance(r, Heartbeat)
                  for g in r.groups)
    hint = ""
    if conv.missing and not waiting and not exits:
        hint = (f"ranks {list(conv.missing)} left no dump and no dumped rank is waiting in a "
                "collective: if the job failed, they likely exited; pass --exit RANK=CODE as "
                "the launcher reported")
    summary = {
        "job": args.job, "attempt": args.attempt, "directory": str(directory),
        "files_read": len(found.dumps), "skipped": len(found.skipped),
        "skipped_files": [{"file": f, "reason": r} for f, r in found.skipped],
        "errors": [{"file": f, "reason": r} for f, r in found.errors],
        "versions": sorted({".".join(map(str, d.version)) for d in found.dumps}),
        "ranks": list(conv.ranks), "ranks_without_dump": list(conv.missing),
        "rank_from": sorted({d.rank_from for d in found.dumps}),
        "world_size": conv.world_size, "world_size_from": conv.world_from,
        "inferred_groups": list(conv.inferred_groups),
        "records": len(conv.records), "records_written": inserted,
        "already_stored": skipped, "counts": counts, "notes": list(conv.notes), "hint": hint,
    }
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    return 1 if found.errors else 0


def _print_summary(s: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"imported job {s['job']} attempt {s['attempt']} from {s['directory']}: "
          f"{s['files_read']} dump(s) of ranks {s['ranks']} (format {', '.join(s['versions'])}), "
          f"{s['records_written']} records stored, {s['already_stored']} already there",
          file=err)
    print(f"  world size {s['world_size']} (from {s['world_size_from']}); ranks without a "
          f"dump: {s['ranks_without_dump'] or 'none'}", file=err)
    if s["skipped"]:
        print(f"  skipped {s['skipped']} file(s) that are not dumps:", file=err)
        for f in s["skipped_files"][:10]:
            print(f"    {f['file']}: {f['reason']}", file=err)
        if s["skipped"] > 10:
            print(f"    ... and {s['skipped'] - 10} more", file=err)
    for f in s["errors"][:20]:
        print(f"  error: {f['reason']}", file=err)
    if s["inferred_groups"]:
        print(f"  groups {s['inferred_groups']}: members not listed in the dumps (gloo); taken "
              "from the dumps that show them", file=err)
    for note in s["notes"]:
        print(f"  note: {note}", file=err)
    if s["hint"]:
        print(f"  hint: {s['hint']}", file=err)
