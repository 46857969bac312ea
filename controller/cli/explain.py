"""`tracehound diagnose`: the analysis run over a job's stored traces, after the fact.

The snapshot is taken "as of the end of the data" (the newest heartbeat or exit of the attempt),
so a stored job gives the same verdict whenever it is diagnosed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from tracehound.analysis.diagnose import diagnose_with_records
from tracehound.analysis.observation import Observation, load_observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot, load_snapshot
from tracehound.analysis.verdict import suspect_nodes
from tracehound.controller.cli.options import print_json, store_arg
from tracehound.tracing.events import ActionKind, Incident
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import FOREVER_US, TraceStore


def _acted_at(incidents: Sequence[Incident], attempt: int) -> int:
    """When the controller first stopped the attempt for one of the job's `incidents` (0: it
    never did)."""
    stops = [i.detected_at_us for i in incidents if i.attempt == attempt
             and any(a.kind is ActionKind.STOP_JOB for a in i.actions)]
    return min(stops, default=0)


def _as_of_end(store: TraceStore, job: JobId, attempt: int, window_s: float,
               incidents: Sequence[Incident]) -> Observation:
    """The attempt's observation as of the end of its data, or as of when the controller
    stopped it for one of the job's `incidents` (read once by the caller for all attempts)."""
    # An attempt the controller stopped is replayed as the controller saw it: what the ranks
    # sent while being stopped (a stopped rank resumed by the stop reports once more) is not
    # part of the fault.
    acted = _acted_at(incidents, attempt)
    probe = load_snapshot(store, job=job, attempt=attempt, now_us=0,
                          until_us=acted or FOREVER_US)
    # As of the median rank's last report (or the last exit, if later): when the controller
    # stopped the attempt, its ranks stopped reporting within a moment of each other, while a
    # rank that froze before stays silent well before them. As of the very newest report, the
    # first ranks the stop reached would look silent too.
    beats = sorted(hb.time_us for hb in probe.heartbeats)
    times = [e.time_us for e in probe.exits] + ([beats[len(beats) // 2]] if beats else [])
    members = {r for g in probe.groups for r in g.ranks}
    nodes: dict[int, str] = {int(hb.rank): str(hb.node) for hb in probe.heartbeats}
    nodes.update({int(e.rank): str(e.node) for e in probe.exits})
    expected = {r: nodes.get(r, "unknown") for r in members | set(nodes)}
    end = acted or max(times, default=0)
    snap = JobSnapshot(
        job=job, attempt=attempt, now_us=end, heartbeats=probe.heartbeats,
        exits=probe.exits, groups=probe.groups, expected_ranks=expected,
    )
    # The window's end is exclusive: reach one microsecond past the newest record.
    return load_observation(store, job=job, attempt=attempt, now_us=end + 1, window_s=window_s,
                            snapshot=snap)


def diagnose_stored(
    store: TraceStore,
    job: JobId,
    attempt: int | None = None,
    settings: DetectionSettings | None = None,
    window_s: float = 10.0,
) -> dict[str, Any] | None:
    """The verdict for one attempt (default: the latest attempt that shows a fault, else the
    latest attempt) as a JSON-ready dict; None when the store has nothing of the job."""
    attempts = store.attempts(job)
    if not attempts:
        return None
    # Stored data is complete: no exit is still in flight, so nothing needs to settle.
    settings = settings or DetectionSettings()
    settings = dataclasses.replace(settings,
                                   crash=dataclasses.replace(settings.crash, settle_s=0.0))
    candidates = [attempt] if attempt is not None else sorted(attempts, reverse=True)
    incidents = store.incidents(job)
    latest = _as_of_end(store, job, candidates[0], window_s, incidents)
    for a in candidates:
        obs = latest if a == candidates[0] else _as_of_end(store, job, a, window_s, incidents)
        verdict, obs = diagnose_with_records(store, obs, settings)
        if verdict is not None:
            return {**verdict.to_dict(), "ranks_seen": len(obs.snapshot.heartbeats)}
    a = candidates[0]
    snap = latest.snapshot
    return {
        "job": job, "attempt": a, "kind": "healthy", "culprit_ranks": [], "culprit_nodes": [],
        "confidence": 1.0, "basis": "", "evidence": [], "ranks_seen": len(snap.heartbeats),
        "summary": f"no fault found in attempt {a} ({len(snap.heartbeats)} ranks reported)",
        "observed_at_us": snap.now_us,
    }


def format_verdict(outcome: dict[str, Any]) -> str:
    lines = [
        f"job {outcome['job']} attempt {outcome['attempt']}: {outcome['kind'].upper()}",
        f"  {outcome['summary']}",
    ]
    if outcome["culprit_ranks"]:
        lines.append(
            f"  culprits: ranks {outcome['culprit_ranks']} on nodes {outcome['culprit_nodes']} "
            f"(confidence {outcome['confidence']:.2f}, basis {outcome['basis']})"
        )
    elif outcome["kind"] != "healthy":
        suspects = suspect_nodes(outcome["evidence"])
        lines.append(
            f"  culprits: none, not localized; suspects: nodes {suspects} "
            f"(confidence {outcome['confidence']:.2f}, basis {outcome['basis']})"
        )
    if outcome["evidence"]:
        lines.append("  evidence:")
        lines += [f"    - {e['detail']}" for e in outcome["evidence"]]
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    diag = sub.add_parser(
        "diagnose", help="explain a job's state from its stored traces",
        description="Run the analysis over what the store holds for a job and print the verdict "
                    "with its evidence. By default the latest attempt that shows a fault.",
    )
    diag.add_argument("--job", required=True, help="job id")
    diag.add_argument("--attempt", type=int, help="attempt to diagnose (default: see above)")
    diag.add_argument("--json", action="store_true", help="print the verdict as JSON")
    store_arg(diag)
    diag.set_defaults(handler=cmd_diagnose)


def cmd_diagnose(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.explain import diagnose_stored, format_verdict
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store

    store = open_store(resolve_store_url(args.store))
    try:
        outcome = diagnose_stored(store, JobId(args.job), args.attempt)
    finally:
        store.close()
    if outcome is None:
        print(f"tracehound diagnose: no traces of job {args.job!r} in this store",
              file=sys.stderr)
        return 1
    if args.json:
        print_json(outcome)
    else:
        print(format_verdict(outcome))
    return 0
