"""`tracehound watch`: live detection, incidents, alerts and actions for jobs Tracehound did not
launch (`controller.supervision.watcher`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from tracehound.controller.cli.options import detection_args, store_arg, supervisor_settings
from tracehound.tracing.ids import JobId
from tracehound.tracing.settings import TRACEHOUND_ALERTS

DESCRIPTION = """\
Watch jobs that Tracehound did not launch (Slurm, torchrun, Ray, recorded by `tracehound
instrument` or `tracehound agent`) through the trace store, and do what `tracehound run` does for
its own jobs: detect hangs, crashes, stragglers and the rest within seconds, record incidents,
job states and alerts, and act as the policy says through the actions given (observe, a command,
Slurm). It learns each job's ranks and nodes from their reports, and watches until the job ends:
its ranks' processes are gone ("exited") or nothing of it reported for --silent-after seconds
("stopped reporting"). A newer attempt of the job (its launcher restarted it, or a requeue) is
watched next."""

EPILOG = """\
actions (default: observe only: incidents and what the policy would do are recorded, the job is
never touched):
  --on-incident CMD   run CMD through /bin/sh once per incident, with the incident as one JSON
                      object on stdin: {"job", "incident", "kind", "culprit_ranks",
                      "culprit_nodes", "confidence", "summary"}, and the same fields as
                      TRACEHOUND_INCIDENT_JOB, _INCIDENT, _KIND, _CULPRIT_RANKS, _CULPRIT_NODES
                      (comma-separated), _CONFIDENCE, _SUMMARY. Its exit status and the tail of
                      its output are stored as the action's result; a CMD that fails is recorded
                      as failed and the watch goes on. Never run twice for one incident, also
                      across a restart of the watcher (a marker in WORKDIR/JOB/commands). The
                      watcher waits for CMD (--on-incident-timeout), so keep it short.
  --slurm             (or `watch_actions: slurm` in the policy file) drain the culprit nodes
                      (scontrol update NodeName=N State=DRAIN Reason="tracehound <incident>"),
                      then requeue (scontrol requeue JOBID) or cancel the job, as the policy's
                      plan says. Each step is recorded with the policy rule that decided it and
                      asks Slurm first, so a watcher started again never does it twice. The Slurm
                      job id is --slurm-job ID, else the ID of a job named slurm-ID (the default
                      job id of `tracehound instrument` inside a Slurm allocation). Node names
                      must be Slurm's (`tracehound instrument` names the node $SLURMD_NODENAME
                      there). With --on-incident too, the Slurm steps come first. After a
                      requeue the job's next attempt is waited for, as long as it takes.

jobs:
  --job J             one job: waits for it to report, watches it until it ends, then exits
                      (status 0 if it finished, 1 if it failed or was cancelled).
  --jobs GLOB         every job whose id matches GLOB (fnmatch: 'prod-*') that reports now or
                      later, each until it ends; runs until Ctrl-C or SIGTERM. A glob that matches
                      no job yet is said once, and the watcher keeps looking. A job supervised
                      by `tracehound run` is never watched as well.

Ctrl-C or SIGTERM stops the watcher at once with status 0; the jobs run on, and a watcher
started again on the same --workdir and store picks them up without recording an incident or
taking an action twice (its journal is WORKDIR/JOB/journal.jsonl).

output: one line per event on stdout (waiting, watching, incident, action, restarted, ended,
skipped); with --json one JSON object per line, {"event": ..., "job": ..., "time": ..., ...}.
Logs (naming job, node and rank) go to stderr.

examples:
  tracehound watch --job exp7 --store clickhouse://default:@ch:9000/tracehound
  tracehound watch --job exp7 --on-incident 'jq -c . >> incidents.jsonl' --json
  tracehound watch --jobs 'prod-*' --policy policy.yaml --alerts alerts.yaml
  tracehound watch --job slurm-4242 --slurm
"""


def add_parser(sub: Any) -> None:
    watch = sub.add_parser(
        "watch", help="watch jobs Tracehound did not launch: incidents, alerts, actions",
        description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    which = watch.add_mutually_exclusive_group(required=True)
    which.add_argument("--job", metavar="J", help="watch this job until it ends")
    which.add_argument("--jobs", metavar="GLOB",
                       help="watch every job matching GLOB, until interrupted")
    store_arg(watch)
    watch.add_argument("--policy", type=Path, metavar="FILE",
                       help="recovery policy (YAML; `tracehound policy --defaults`); its "
                            "watch_s replaces --busy-grace, and `watch_actions: slurm` acts "
                            "as --slurm")
    watch.add_argument("--alerts", type=Path, metavar="FILE",
                       help="alert receivers (YAML or JSON), beside the global ones of "
                            "$TRACEHOUND_ALERTS; undelivered alerts wait in WORKDIR/alerts")
    watch.add_argument("--on-incident", metavar="CMD",
                       help="shell command run once per incident (see below)")
    watch.add_argument("--on-incident-timeout", type=float, default=60.0, metavar="S",
                       help="kill CMD (and what it started) after S seconds (default: 60)")
    watch.add_argument("--slurm", action="store_true",
                       help="drain, requeue and cancel through scontrol (see below)")
    watch.add_argument("--slurm-job", metavar="ID",
                       help="the Slurm job id of --job J (default: ID of a job named slurm-ID)")
    watch.add_argument("--scontrol", default="scontrol", metavar="PATH",
                       help="the scontrol command (default: scontrol on PATH)")
    detection_args(watch)
    watch.add_argument("--poll", type=float, default=1.0, metavar="S",
                       help="seconds between two polls of one job (default: 1)")
    watch.add_argument("--silent-after", type=float, default=60.0, metavar="S",
                       help="an attempt of which nothing reported for S seconds stopped "
                            "reporting: it is over (default: 60)")
    watch.add_argument("--end-grace", type=float, default=15.0, metavar="S",
                       help="after an attempt ended, how long a newer one (its launcher "
                            "restarting it) may take to report before the job has ended "
                            "(default: 15)")
    watch.add_argument("--workdir", type=Path, default=Path(".tracehound/watch"),
                       help="journal, incident evidence and command markers go under "
                            "WORKDIR/JOB (default: .tracehound/watch)")
    watch.add_argument("--json", action="store_true",
                       help="one JSON object per line per event, for scripts")
    watch.set_defaults(handler=cmd_watch)


def _positive(args: argparse.Namespace, name: str) -> float:
    value = float(getattr(args, name))
    if not value > 0:
        raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds, "
                         f"got {value:g}")
    return value


def _job_dir(workdir: Path, job: str) -> Path:
    return workdir / job.replace(os.sep, "_")


def cmd_watch(args: argparse.Namespace) -> int:
    from tracehound.controller.actions.command import CommandActions
    from tracehound.controller.actions.observe import ObserveActions
    from tracehound.controller.actions.port import ActionsUnavailable, Chain, IncidentActions
    from tracehound.controller.actions.slurm import SlurmActions, load_control, slurm_job_of
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.controller.policy.recovery import WatchActions
    from tracehound.controller.supervision.watcher import (
        EventKind,
        Watcher,
        WatchEvent,
        WatchFleet,
        WatchSettings,
        supervised_by,
    )
    from tracehound.tracing.events import now_us
    from tracehound.tracing.store import open_store

    if args.slurm_job is not None and args.job is None:
        raise ValueError("--slurm-job names the Slurm job of one --job J; with --jobs each job "
                         "must be named slurm-ID")
    poll_s = _positive(args, "poll")
    settings = WatchSettings(
        supervisor=supervisor_settings(args, poll_s=poll_s,
                                       summaries_every_s=WatchSettings().supervisor
                                       .summaries_every_s),
        silent_after_s=_positive(args, "silent_after"), end_grace_s=_positive(args, "end_grace"),
    )
    slurm = args.slurm or settings.supervisor.policy.watch_actions is WatchActions.SLURM
    if args.on_incident is not None:
        _positive(args, "on_incident_timeout")
        if not args.on_incident.strip():
            raise ValueError("--on-incident: the command is empty; expected a shell command, "
                             "e.g. --on-incident 'notify-oncall.sh'")
    control = None
    errors: tuple[type[Exception], ...] = (Exception,)
    if slurm:  # a bad --scontrol: ValueError, which main names
        control, errors = load_control(scontrol=args.scontrol)
    dispatcher, stack = _alerts(args), contextlib.ExitStack()
    store = open_store(resolve_store_url(args.store))  # StoreError: main says which and exits 2
    stack.callback(store.close)

    def actions_for(job: JobId) -> IncidentActions:
        primary: IncidentActions = ObserveActions()
        if control is not None:
            slurm_job = (args.slurm_job if args.job is not None and args.slurm_job
                         else slurm_job_of(job))

            def attempt_over(attempt: int, job: JobId = job) -> bool:
                return any(a > attempt for a in store.attempts(job))

            primary = SlurmActions(control, job=job, slurm_job=slurm_job, errors=errors,
                                   attempt_over=attempt_over)
        if args.on_incident is None:
            return primary
        command = CommandActions(args.on_incident, timeout_s=args.on_incident_timeout,
                                 state_dir=_job_dir(args.workdir, job) / "commands")
        return Chain(primary, command)

    printer = Printer(as_json=args.json)

    def make_watcher(job: JobId) -> Watcher:
        return Watcher(job=job, store=store, actions=actions_for(job), settings=settings,
                       workdir=_job_dir(args.workdir, job),
                       notify=dispatcher.enqueue if dispatcher is not None else None,
                       on_event=printer)

    with stack:
        if dispatcher is not None:
            _start_alerts(dispatcher, store, args.workdir, stack)
        try:
            # an adapter that cannot work at all is an error now, not at the first incident
            if control is not None:
                SlurmActions(control, job="", slurm_job=None, errors=errors).check()
            if args.on_incident is not None:
                CommandActions(args.on_incident, state_dir=args.workdir).check()
        except ActionsUnavailable as exc:
            print(f"tracehound watch: {exc}", file=sys.stderr)
            return 2
        if args.job is not None:
            other = supervised_by(store, JobId(args.job))
            if other:
                print(f"tracehound watch: job {args.job} is not watched: {other}",
                      file=sys.stderr)
                return 2
        fleet = WatchFleet(store=store, make_watcher=make_watcher, job=args.job,
                           pattern=args.jobs, settings=settings, on_event=printer)
        try:
            fleet.run()
        except KeyboardInterrupt as exc:
            # the jobs run on; their watch is picked up by the next watcher
            fleet.close(settings.supervisor.journal_drain_s)
            reason = str(exc or "Ctrl-C")
            printer(WatchEvent(kind=EventKind.STOPPED, job=args.job or "", time_us=now_us(),
                               text=f"tracehound watch: stopped ({reason}); the jobs run on, "
                                    "and a watcher started again picks them up",
                               data={"reason": reason}))
            return 0
        fleet.close(settings.supervisor.journal_drain_s)
    if args.job is None:
        return 0
    return 0 if printer.finished(args.job) else 1


class Printer:
    """Says each event on stdout: a line of text, or one JSON object per line."""

    def __init__(self, *, as_json: bool) -> None:
        self.as_json = as_json
        self.ended: dict[str, str] = {}
        """Job -> the state it ended in, for the exit status of `--job`."""

    def __call__(self, event: Any) -> None:
        from tracehound.controller.supervision.watcher import EventKind

        if event.kind is EventKind.ENDED:
            self.ended[event.job] = str(event.data.get("state", ""))
        if self.as_json:
            print(json.dumps(event.to_json(), separators=(",", ":")), flush=True)
        else:
            print(event.text, flush=True)

    def finished(self, job: str) -> bool:
        return self.ended.get(job) == "finished"


def _alerts(args: argparse.Namespace) -> Any:
    """The alert dispatcher for the receivers of $TRACEHOUND_ALERTS and --alerts (None without
    any); AlertConfigError naming the file and the field."""
    files = [(f"${TRACEHOUND_ALERTS} ({os.environ[TRACEHOUND_ALERTS]})",
              Path(os.environ[TRACEHOUND_ALERTS]))] if os.environ.get(TRACEHOUND_ALERTS) else []
    if args.alerts is not None:
        files.append((str(args.alerts), args.alerts))
    if not files:
        return None
    from tracehound.controller import alerts

    receivers = alerts.merge_receivers(*((where, alerts.load_receivers(path))
                                         for where, path in files))
    return alerts.Dispatcher(alerts.Outbox(args.workdir / "alerts", receivers))


def _start_alerts(dispatcher: Any, store: Any, workdir: Path,
                  stack: contextlib.ExitStack) -> None:
    """Each settled alert is recorded on its incident; at the end the dispatcher stops, then
    the recorder stores what is left, then the store closes."""
    from tracehound.controller import alerts

    recorder = alerts.AlertRecorder(lambda: store, workdir / "alerts" / alerts.ACTIONS_JOURNAL)
    dispatcher.on_settled = recorder
    recorder.start()
    stack.callback(recorder.stop, 10.0)
    dispatcher.start()
    stack.callback(dispatcher.stop, 10.0)
