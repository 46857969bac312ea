"""`tracehound run`: launch a torchrun-compatible job as N nodes of M local ranks, supervise it,
and on a fault isolate the culprit node and restart from checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from tracehound.controller.cli import status
from tracehound.controller.cli.incidents import incident_line
from tracehound.controller.cli.options import (
    detection_args,
    own_ingest_token,
    print_json,
    store_arg,
    supervisor_settings,
)
from tracehound.tracing.ids import JobId
from tracehound.tracing.settings import TRACEHOUND_ALERTS

EPILOG_RUN = """\
Every rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), so a
script that runs under torchrun runs here unchanged. The recorder is installed into each rank
automatically. Scripts that call tracehound.agent.checkpoint.save/load resume from the latest
complete checkpoint after a restart.

With --ui the dashboard is served beside the job (http://127.0.0.1:8501 unless --ui-port says
otherwise) and stopped when the run ends; it reads the job's store through this process, which
holds it.

example:
  tracehound run --nnodes 2 --nproc-per-node 2 --spare-nodes 1 --job-id exp7 train.py --lr 0.1
  tracehound run --ui --nnodes 2 --nproc-per-node 2 --job-id exp8 train.py
"""


def add_parser(sub: Any) -> None:
    run = sub.add_parser(
        "run", help="launch and supervise a job on this machine",
        description="Launch a torchrun-compatible job as N nodes of M local ranks, watch it, and "
                    "on a hang or crash isolate the culprit node and restart from checkpoint.",
        epilog=EPILOG_RUN, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("--nnodes", type=int, required=True, help="nodes the job runs on")
    run.add_argument("--nproc-per-node", type=int, required=True, help="ranks per node")
    run.add_argument("--spare-nodes", type=int, default=0,
                     help="extra nodes that replace isolated ones (default: 0)")
    run.add_argument("--job-id", default="job", help="job id every record is tagged with")
    run.add_argument("--workdir", type=Path, default=Path(".tracehound/runs"),
                     help="checkpoints, spools, logs and the journal of records on their way "
                          "to the store go under WORKDIR/JOB "
                          "(default: .tracehound/runs)")
    run.add_argument("--max-restarts", type=int, default=None,
                     help="restarts before giving up (default: the policy's, 3)")
    run.add_argument("--policy", type=Path, metavar="FILE",
                     help="recovery policy (YAML; see `tracehound policy --defaults`); its "
                          "watch_s replaces --busy-grace as the time an unsure verdict is "
                          "watched")
    run.add_argument("--alerts", type=Path, metavar="FILE",
                     help="this job's alert receivers (YAML or JSON: Alertmanager, Slack, "
                          "PagerDuty, signed webhook), beside the global ones of "
                          "$TRACEHOUND_ALERTS; undelivered alerts wait in WORKDIR/JOB/alerts "
                          "for the next run")
    run.add_argument("--warm-spares", action=argparse.BooleanOptionalAction, default=True,
                     help="keep one process per rank with torch and the script's heavy modules "
                          "already imported, so a restart skips spawning and importing (costs "
                          "one idle interpreter with torch per rank; default: on)")
    run.add_argument("--preload", default="", metavar="MODULES",
                     help="more modules warm spares import while they wait, comma-separated "
                          "(they already import torch and the script's top-level imports)")
    detection_args(run)
    run.add_argument("--timeout", type=float, default=None, metavar="S",
                     help="give up after S seconds (default: never)")
    run.add_argument("--json", action="store_true", help="print the outcome as JSON")
    run.add_argument("--ui", action="store_true",
                     help="serve the dashboard beside the job on 127.0.0.1 while it runs (its "
                          "address is printed; its log goes to WORKDIR/JOB/dashboard.log)")
    run.add_argument("--ui-port", type=int, default=8501, metavar="P",
                     help="the dashboard's port with --ui (default: 8501)")
    store_arg(run)
    run.add_argument("script", help="training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    run.set_defaults(handler=cmd_run)


def cmd_run(args: argparse.Namespace) -> int:
    with own_ingest_token():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import store_session
    from tracehound.controller.journal import JOURNAL_FILE
    from tracehound.controller.orchestrators.local import LocalOrchestrator
    from tracehound.controller.supervision.supervisor import JobSpec, Supervisor

    script = Path(args.script)
    if not script.is_file():
        print(f"tracehound run: training script {args.script!r} does not exist", file=sys.stderr)
        return 2
    for name in ("nnodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            print(f"tracehound run: --{name.replace('_', '-')} must be at least 1",
                  file=sys.stderr)
            return 2
    spec = JobSpec(
        job=JobId(args.job_id), command=(sys.executable, str(script), *args.args),
        nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, spare_nodes=args.spare_nodes,
    )
    settings = supervisor_settings(args, timeout_s=args.timeout)
    workdir = args.workdir / args.job_id
    if args.ui:
        from tracehound.controller.cli.dashboard import check_port

        check_port(args.ui_port, "127.0.0.1", "--ui-port")  # before anything is launched
    dispatcher = None
    files = [(f"${TRACEHOUND_ALERTS} ({os.environ[TRACEHOUND_ALERTS]})",
              Path(os.environ[TRACEHOUND_ALERTS]))] if os.environ.get(TRACEHOUND_ALERTS) else []
    if args.alerts is not None:
        files.append((str(args.alerts), args.alerts))
    if files:
        from tracehound.controller import alerts

        # AlertConfigError names the file and the field
        receivers = alerts.merge_receivers(*((where, alerts.load_receivers(path))
                                             for where, path in files))
        dispatcher = alerts.Dispatcher(alerts.Outbox(workdir / "alerts", receivers))
    with store_session(args.store) as session, contextlib.ExitStack() as stack:
        if dispatcher is not None:
            # each settled alert is recorded on its incident; at the end the dispatcher stops,
            # then the recorder stores what is left, then the store closes
            recorder = alerts.AlertRecorder(lambda: session.store,
                                            workdir / "alerts" / alerts.ACTIONS_JOURNAL)
            dispatcher.on_settled = recorder
            recorder.start()
            stack.callback(recorder.stop, 10.0)
            dispatcher.start()
            stack.callback(dispatcher.stop, 10.0)
        if args.ui:
            from tracehound.controller.cli.dashboard import Dashboard

            # stopped first when the run ends or is interrupted, while the store is still held
            dashboard = Dashboard(session.url, port=args.ui_port,
                                  log=workdir / "dashboard.log").start()
            stack.callback(dashboard.stop)
            print(f"dashboard: {dashboard.address_url}", file=sys.stderr, flush=True)
        orch = LocalOrchestrator(
            workdir=workdir, sink=session.sink, warm_spares=args.warm_spares,
            preload=tuple(m for m in args.preload.split(",") if m),
        )
        result = Supervisor(spec=spec, store=session.store, orchestrator=orch,
                            settings=settings, evidence_dir=workdir / "incidents",
                            journal_path=workdir / JOURNAL_FILE,
                            notify=dispatcher.enqueue if dispatcher else None).run()
    if args.json:
        print_json({
            "job": result.job, "completed": result.completed, "attempts": result.attempts,
            "reason": result.reason,
            "incidents": [status.incident_json(i) for i in result.incidents],
            "restarts": [r.to_json() for r in result.restarts],
            "workdir": str(workdir),
        })
    else:
        state = "finished" if result.completed else "FAILED"
        print(f"job {result.job} {state} after {result.attempts} attempt(s): {result.reason}")
        for incident in result.incidents:
            print(incident_line(incident))
        for restart in result.restarts:
            print(f"  {restart.describe()}")
        print(f"logs and checkpoints: {workdir}")
    return 0 if result.completed else 1
