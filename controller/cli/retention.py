"""`tracehound retention --older-than-days N`: drop what the store holds from before that age.

Every table is partitioned by day (UTC, from each record's own time), so retention drops whole
days: a day goes once all of it is older than N days. `--dry-run` lists what would go. Run it
from cron or a Kubernetes CronJob; it only ever drops whole partitions, never rewrites data.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from collections.abc import Callable
from typing import Any

EPILOG = """\
examples:
  tracehound retention --older-than-days 30 --dry-run     # what would be dropped
  tracehound retention --older-than-days 30 --json        # drop it; one JSON object
"""


def cutoff_day(older_than_days: int, now: dt.datetime | None = None) -> int:
    """The first day (YYYYMMDD, UTC) kept when everything older than `older_than_days` goes."""
    if older_than_days < 1:
        raise ValueError(f"--older-than-days: expected a whole number of days >= 1, got "
                         f"{older_than_days}")
    today = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC).date()
    first_kept = today - dt.timedelta(days=older_than_days)
    return first_kept.year * 10000 + first_kept.month * 100 + first_kept.day


def add_parser(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "retention", help="drop stored records older than a number of days",
        description="Drop the daily partitions of every table (traces, incidents, actions, job "
                    "states) that are entirely older than --older-than-days days (UTC).",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--older-than-days", type=int, required=True, metavar="N",
                   help="keep the last N days (today included)")
    p.add_argument("--dry-run", action="store_true", help="only list what would be dropped")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    store_arg(p)
    p.set_defaults(handler=cmd_retention)


def cmd_retention(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store

    try:
        day = cutoff_day(args.older_than_days)
    except ValueError as exc:
        print(f"tracehound retention: {exc}", file=sys.stderr)
        return 2
    store = open_store(resolve_store_url(args.store))
    try:
        dropped = store.drop_days_before(day, dry_run=args.dry_run)
    finally:
        store.close()
    if args.json:
        print(json.dumps({"kept_from": day, "dry_run": args.dry_run, "dropped": dropped}))
        return 0
    verb = "would drop" if args.dry_run else "dropped"
    if not dropped:
        print(f"nothing older than {day} (YYYYMMDD, UTC) to drop")
    for table, days in dropped.items():
        print(f"{table}: {verb} {len(days)} days ({days[0]} .. {days[-1]})")
    return 0
