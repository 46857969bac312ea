"""`tracehound status --job J`: where a job is in its state machine, read from the store.

The job's latest state (who wrote it and when), its attempts, the nodes it runs on and those
isolated, and its open incidents: those of the current run that no restart has resolved yet
(none once the job finished). `--json` prints one object for scripts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from tracehound.controller.supervision.jobstate import read_history
from tracehound.tracing.events import Incident, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.jobs import TERMINAL, open_incidents
from tracehound.tracing.store import TraceStore

EPILOG = """\
examples:
  tracehound status --job exp7
  tracehound status --job exp7 --json | jq .state
exit status: 0 when the job has a stored state, 1 when the store knows no state of it.
"""

def incident_json(incident: Incident) -> dict[str, Any]:
    return {
        "job": incident.job,
        "incident_id": incident.incident_id,
        "attempt": incident.attempt,
        "kind": incident.kind,
        "culprit_ranks": list(incident.culprit_ranks),
        "culprit_nodes": list(incident.culprit_nodes),
        "confidence": incident.confidence,
        "summary": incident.summary,
        "detected_at": incident.detected_at_us / 1e6,
        "actions": [
            {"kind": a.kind.value, "target": a.target, "ok": a.ok, "detail": a.detail,
             "at": a.time_us / 1e6, "rule": a.rule}
            for a in incident.actions
        ],
        "verdict": json.loads(incident.verdict_json) if incident.verdict_json else None,
    }


def job_status(store: TraceStore, job: JobId) -> dict[str, Any] | None:
    """The job's status as `--json` prints it; None when no state of it is stored."""
    history = read_history(store, job, [])
    latest = history.latest
    if latest is None:
        return None
    run = history.run
    return {
        "job": job,
        "state": latest.state.value,
        "attempt": latest.attempt,
        "since": latest.time_us / 1e6,
        "controller": latest.controller,
        "detail": latest.detail,
        "ended": latest.state in TERMINAL,
        "attempts": sorted({s.attempt for s in run}),
        "nodes": list(latest.nodes),
        "isolated": list(latest.isolated),
        "incidents": len(history.incidents),
        "open_incidents": [incident_json(i) for i in open_incidents(history.states,
                                                                   history.incidents)],
        "states": [_state_json(s) for s in run[-20:]],
    }


def _state_json(state: JobState) -> dict[str, Any]:
    return {"seq": state.seq, "state": state.state.value, "attempt": state.attempt,
            "at": state.time_us / 1e6, "incident_id": state.incident_id, "detail": state.detail}


def _when(seconds: float) -> str:
    return f"{dt.datetime.fromtimestamp(seconds, tz=dt.UTC):%Y-%m-%d %H:%M:%S} UTC"


def format_status(status: dict[str, Any]) -> str:
    lines = [
        f"job {status['job']}: {status['state']} (attempt {status['attempt']}) since "
        f"{_when(status['since'])}, written by controller {status['controller'] or '?'}",
    ]
    if status["detail"]:
        lines.append(f"  {status['detail']}")
    lines.append(f"  attempts of this run: {', '.join(map(str, status['attempts']))}")
    lines.append(f"  nodes: {', '.join(status['nodes']) or '-'}; "
                 f"isolated: {', '.join(status['isolated']) or 'none'}")
    open_ = status["open_incidents"]
    lines.append(f"  open incidents: {len(open_)} (of {status['incidents']} stored)")
    for i in open_:
        acts = ", ".join(f"{a['kind']} {a['target']}" for a in i["actions"]) or "none yet"
        lines.append(f"    {i['incident_id']} {i['kind']}: ranks {i['culprit_ranks']} on "
                     f"{i['culprit_nodes']}: {i['summary']}\n      actions: {acts}")
    lines.append("  recent states: " + " -> ".join(
        f"{s['state']}({s['attempt']})" for s in status["states"]))
    return "\n".join(lines)


def add_parser(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "status", help="where a supervised job is: state, attempts, isolated nodes, open "
                       "incidents",
        description="Print the job's state (running, suspect, stalled, diagnosing, isolating, "
                    "restarting, failed, finished) as its controller last wrote it to the "
                    "store, with the run's attempts, nodes, isolated nodes and the incidents "
                    "still open.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--job", required=True, help="job id")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    store_arg(p)
    p.set_defaults(handler=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store

    store = open_store(resolve_store_url(args.store))
    try:
        status = job_status(store, JobId(args.job))
        known = store.jobs() if status is None else []
    finally:
        store.close()
    if status is None:
        message = (f"no state of job {args.job!r} in the store (jobs there: "
                   f"{', '.join(known) or 'none'}); only jobs run by `tracehound run` have one")
        if args.json:
            print(json.dumps({"job": args.job, "error": message}))
        else:
            print(message)
        return 1
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0
