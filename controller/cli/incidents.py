"""`tracehound incidents`: the stored incidents and the actions taken on each."""

from __future__ import annotations

import argparse
from typing import Any

from tracehound.controller.cli import status
from tracehound.controller.cli.options import print_json, store_arg
from tracehound.tracing.ids import JobId


def add_parser(sub: Any) -> None:
    inc = sub.add_parser("incidents", help="list stored incidents and their actions")
    inc.add_argument("--job", help="only this job")
    inc.add_argument("--json", action="store_true", help="print a JSON list")
    store_arg(inc)
    inc.set_defaults(handler=cmd_incidents)


def incident_line(incident: Any) -> str:
    import datetime as dt

    when = dt.datetime.fromtimestamp(incident.detected_at_us / 1e6, tz=dt.UTC)
    acts = ", ".join(f"{a.kind.value} {a.target}" for a in incident.actions) or "none"
    return (
        f"{when:%Y-%m-%d %H:%M:%S} {incident.job} attempt {incident.attempt} {incident.kind}: "
        f"ranks {list(incident.culprit_ranks)} on {list(incident.culprit_nodes)} "
        f"(confidence {incident.confidence:.2f})\n    {incident.summary}\n    actions: {acts}"
    )


def cmd_incidents(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store

    store = open_store(resolve_store_url(args.store))
    try:
        incidents = store.incidents(JobId(args.job) if args.job else None)
    finally:
        store.close()
    if args.json:
        print_json([status.incident_json(i) for i in incidents])
    elif not incidents:
        print("no incidents" + (f" for job {args.job}" if args.job else ""))
    else:
        for incident in incidents:
            print(incident_line(incident))
    return 0
