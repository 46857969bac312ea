"""The `tracehound` command.

    tracehound demo       inject a fault into a real job and watch Tracehound recover it
    tracehound run        launch and supervise a torchrun-style job
    tracehound incidents  list stored incidents and the actions taken
    tracehound status     a supervised job's state, attempts, isolated nodes, open incidents
    tracehound ui         the incident dashboard (Streamlit) over the store
    tracehound retention  drop stored records older than N days
    tracehound operator   the Kubernetes operator over TrainingJob resources
    tracehound bundle     copy the recorder where another image can import it
    tracehound diagnose   explain a job's state from its stored traces
    tracehound simulate   write a simulated job's traces (with a fault) to a store
    tracehound agent      run a node agent on its own (torchrun, srun, Ray, Kubernetes)
    tracehound instrument run a command (torchrun ...) with the recorder in every rank

Exit status: 0 on success, 1 when the job (or the demo) failed, 2 for bad usage or a store that
cannot be used, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from tracehound.controller.cli import (
    bundle,
    dashboard,
    importfr,
    launchers,
    retention,
    stacks,
    status,
    tracefiles,
)
from tracehound.controller.operator import handlers as operator
from tracehound.controller.policy import file as policyfile
from tracehound.tracing import logs
from tracehound.tracing.errors import StoreError
from tracehound.tracing.ids import JobId
from tracehound.tracing.settings import TRACEHOUND_ALERTS, TRACEHOUND_INGEST_TOKEN
from tracehound.tracing.store.urls import mask_url

EPILOG_RUN = """\
Every rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), so a
script that runs under torchrun runs here unchanged. The recorder is installed into each rank
automatically. Scripts that call tracehound.agent.checkpoint.save/load resume from the latest
complete checkpoint after a restart.

example:
  tracehound run --nnodes 2 --nproc-per-node 2 --spare-nodes 1 --job-id exp7 train.py --lr 0.1
"""

EPILOG_DEMO = """\
examples:
  tracehound demo                        # SIGSTOP rank 3 mid-training, recover, report
  tracehound demo --fault crash --rank 1 # SIGKILL rank 1 instead
  tracehound demo --fault xid            # rank 3's (simulated) GPU falls off the bus
  tracehound demo --json                 # one JSON object for scripts
"""


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store", metavar="URL",
        help="trace store: clickhouse://user:pass@host:9000/db or chdb:///dir "
             "(default: $TRACEHOUND_STORE, else chdb://./.tracehound/store)",
    )


def _detection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hang-after", type=float, default=5.0, metavar="S",
                   help="ranks waiting this long in one collective on a rank that is frozen "
                        "(stopped, gone, silent) or stuck in an operation is a hang "
                        "(default: 5)")
    p.add_argument("--busy-grace", type=float, default=600.0, metavar="S",
                   help="ranks waiting on a rank that is alive and busy outside collectives "
                        "(checkpoint, evaluation, compilation, data loading) is a stall: "
                        "recorded, never acted on until it lasts this long; also how long an "
                        "unsure verdict is watched before a restart that evicts nobody "
                        "(default: 600, like torch's watchdog)")


def _supervisor_settings(args: argparse.Namespace, **overrides: Any) -> Any:
    """The supervisor's settings from the detection flags; ValueError naming a bad flag."""
    from tracehound.analysis.detect import DetectionSettings
    from tracehound.controller.policy.recovery import PolicySettings
    from tracehound.controller.supervision.supervisor import SupervisorSettings

    if not args.hang_after > 0:
        raise ValueError(f"--hang-after must be a positive number of seconds, "
                         f"got {args.hang_after}")
    if not args.busy_grace >= args.hang_after:
        raise ValueError(f"--busy-grace must be at least --hang-after "
                         f"({args.hang_after} s), got {args.busy_grace}")
    policy_file = getattr(args, "policy", None)
    if policy_file is not None:
        from tracehound.controller.policy.file import load_policy

        policy = load_policy(policy_file)  # PolicyConfigError (a ValueError) names the field
        if getattr(args, "max_restarts", None) is not None:
            policy = dataclasses.replace(policy, max_restarts=args.max_restarts)
    else:
        max_restarts = getattr(args, "max_restarts", None)
        policy = PolicySettings(watch_s=args.busy_grace,
                                max_restarts=3 if max_restarts is None else max_restarts)
    return SupervisorSettings(
        detection=DetectionSettings(hang_after_s=args.hang_after, busy_grace_s=args.busy_grace),
        policy=policy, **overrides,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracehound",
        description="Find the rank and node behind a hung or crashed distributed training job, "
                    "isolate it and restart from checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo", help="inject a fault into a real 2x2-rank DDP job and recover it",
        description="Run a real DDP job (2 nodes x 2 gloo ranks + 1 spare node), inject a fault "
                    "from outside, and report what Tracehound found and how fast it recovered.",
        epilog=EPILOG_DEMO, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_argument("--fault", choices=["hang", "crash", "xid"], default="hang",
                      help="hang = SIGSTOP the rank, crash = SIGKILL it, xid = its simulated GPU "
                           "reports Xid 79 (fallen off the bus) and the rank freezes "
                           "(default: hang)")
    demo.add_argument("--rank", type=int, default=3, help="rank to fault, 0-3 (default: 3)")
    demo.add_argument("--fault-step", type=int, default=60,
                      help="training step at which to inject (default: 60)")
    demo.add_argument("--steps", type=int, default=200, help="training steps (default: 200)")
    demo.add_argument("--job-id", help="job id (default: demo-<fault>-<time>)")
    demo.add_argument("--workdir", type=Path, help="checkpoints, spools and logs (default: temp)")
    _detection_args(demo)
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    _store_arg(demo)

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
    _detection_args(run)
    run.add_argument("--timeout", type=float, default=None, metavar="S",
                     help="give up after S seconds (default: never)")
    run.add_argument("--json", action="store_true", help="print the outcome as JSON")
    _store_arg(run)
    run.add_argument("script", help="training script")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    inc = sub.add_parser("incidents", help="list stored incidents and their actions")
    inc.add_argument("--job", help="only this job")
    inc.add_argument("--json", action="store_true", help="print a JSON list")
    _store_arg(inc)

    diag = sub.add_parser(
        "diagnose", help="explain a job's state from its stored traces",
        description="Run the analysis over what the store holds for a job and print the verdict "
                    "with its evidence. By default the latest attempt that shows a fault.",
    )
    diag.add_argument("--job", required=True, help="job id")
    diag.add_argument("--attempt", type=int, help="attempt to diagnose (default: see above)")
    diag.add_argument("--json", action="store_true", help="print the verdict as JSON")
    _store_arg(diag)

    sim = sub.add_parser(
        "simulate", help="write a simulated job's traces (with a fault) to a store",
        description="Simulate one detection window of a large job (DDP, ZeRO-3, MoE or a "
                    "Megatron pipeline; 4 or 8 ranks per node; skewed node clocks, pauses, "
                    "checkpoints and harmless warnings) with a fault injected, and write its "
                    "traces to a store so that `tracehound diagnose` can be run on it.",
        epilog="example:\n  tracehound simulate --ranks 4096 --fault straggler --seed 7 "
               "--job-id s7\n  tracehound diagnose --job s7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim.add_argument("--ranks", type=int, required=True, help="ranks in the job (8 to 32768)")
    sim.add_argument("--fault", required=True, metavar="CLASS",
                     help="hang, crash, mismatch, straggler, slow_link, hardware, silent_hang "
                          "or healthy")
    sim.add_argument("--seed", type=int, default=0, help="scenario seed (default: 0)")
    sim.add_argument("--job-id", help="job id (default: sim-<fault>-<ranks>-<seed>)")
    sim.add_argument("--skew-ms", type=float, default=None, metavar="MS",
                     help="sigma of the node clock offsets in ms (default: 5, ordinary NTP)")
    sim.add_argument("--lab", action="store_true",
                     help="lab conditions: clocks within microseconds, Megatron layouts only, "
                          "faults well above the detectors' thresholds, little noise (default: "
                          "field conditions)")
    sim.add_argument("--json", action="store_true", help="print what was written as JSON")
    _store_arg(sim)
    tracefiles.add_parsers(sub, _store_arg)
    stacks.add_parser(sub, _store_arg)
    importfr.add_parser(sub, _store_arg)
    launchers.add_parsers(sub, _store_arg)
    policyfile.add_parser(sub)
    status.add_parser(sub, _store_arg)
    retention.add_parser(sub, _store_arg)
    operator.add_parser(sub, _store_arg)
    bundle.add_parser(sub)
    dashboard.add_parser(sub, _store_arg)
    return parser


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=None, sort_keys=False))


@contextlib.contextmanager
def own_ingest_token() -> Iterator[str]:
    """Give this run's loopback ingest endpoint a token of its own while the block runs, when
    none is configured: the node agents it starts inherit it, and another user of the machine
    cannot post batches into the job's store. A configured token is kept; the one made here is
    removed again at the end (`main` may run in a longer-lived process)."""
    configured = os.environ.get(TRACEHOUND_INGEST_TOKEN)
    if configured:
        yield configured
        return
    token = secrets.token_urlsafe(24)
    os.environ[TRACEHOUND_INGEST_TOKEN] = token
    try:
        yield token
    finally:
        if os.environ.get(TRACEHOUND_INGEST_TOKEN) == token:
            del os.environ[TRACEHOUND_INGEST_TOKEN]


def cmd_demo(args: argparse.Namespace) -> int:
    with own_ingest_token():
        return _demo(args)


def _demo(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.demo import demo_ok, format_report, run_demo

    settings = _supervisor_settings(args, poll_s=0.25, timeout_s=600)
    if not args.json:
        print(f"tracehound demo: 2 nodes x 2 ranks + 1 spare; {args.fault} of rank {args.rank} "
              f"at step {args.fault_step} of {args.steps} ...", file=sys.stderr)
    report = run_demo(
        fault=args.fault, rank=args.rank, fault_step=args.fault_step, steps=args.steps,
        store_url=args.store, workdir=args.workdir, settings=settings, job=args.job_id,
    )
    if args.json:
        _print_json(report)
    else:
        print(format_report(report))
    return 0 if demo_ok(report) else 1


def cmd_run(args: argparse.Namespace) -> int:
    with own_ingest_token():
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import store_session
    from tracehound.controller.orchestrators.local import LocalOrchestrator
    from tracehound.controller.supervision.journal import JOURNAL_FILE
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
    settings = _supervisor_settings(args, timeout_s=args.timeout)
    workdir = args.workdir / args.job_id
    dispatcher = None
    files = [(f"${TRACEHOUND_ALERTS} ({os.environ[TRACEHOUND_ALERTS]})",
              Path(os.environ[TRACEHOUND_ALERTS]))] if os.environ.get(TRACEHOUND_ALERTS) else []
    if args.alerts is not None:
        files.append((str(args.alerts), args.alerts))
    if files:
        from tracehound.controller.alerts import delivery as alerts

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
        orch = LocalOrchestrator(
            workdir=workdir, sink=session.sink, warm_spares=args.warm_spares,
            preload=tuple(m for m in args.preload.split(",") if m),
        )
        result = Supervisor(spec=spec, store=session.store, orchestrator=orch,
                            settings=settings, evidence_dir=workdir / "incidents",
                            journal_path=workdir / JOURNAL_FILE,
                            notify=dispatcher.enqueue if dispatcher else None).run()
    if args.json:
        _print_json({
            "job": result.job, "completed": result.completed, "attempts": result.attempts,
            "reason": result.reason, "incidents": [_incident_json(i) for i in result.incidents],
            "restarts": [r.to_json() for r in result.restarts],
            "workdir": str(workdir),
        })
    else:
        state = "finished" if result.completed else "FAILED"
        print(f"job {result.job} {state} after {result.attempts} attempt(s): {result.reason}")
        for incident in result.incidents:
            print(_incident_line(incident))
        for restart in result.restarts:
            print(f"  {restart.describe()}")
        print(f"logs and checkpoints: {workdir}")
    return 0 if result.completed else 1


def _incident_json(incident: Any) -> dict[str, Any]:
    return status.incident_json(incident)


def _incident_line(incident: Any) -> str:
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
        _print_json([_incident_json(i) for i in incidents])
    elif not incidents:
        print("no incidents" + (f" for job {args.job}" if args.job else ""))
    else:
        for incident in incidents:
            print(_incident_line(incident))
    return 0


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
        _print_json(outcome)
    else:
        print(format_verdict(outcome))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from tracehound.analysis.sim import FAULT_KINDS, FIELD, LAB, simulate, write_to_store
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store

    classes = [k.value for k in FAULT_KINDS] + ["healthy"]
    if args.fault not in classes:
        raise ValueError(f"--fault {args.fault!r}: expected one of {', '.join(classes)}")
    if not 8 <= args.ranks <= 32_768:
        raise ValueError(f"--ranks {args.ranks}: expected a number of ranks from 8 to 32768")
    job = args.job_id or f"sim-{args.fault}-{args.ranks}-{args.seed}"
    if args.skew_ms is not None and not 0 <= args.skew_ms <= 1_000:
        raise ValueError(f"--skew-ms {args.skew_ms}: expected milliseconds from 0 to 1000")
    sim = simulate(ranks=args.ranks, fault=args.fault, seed=args.seed, job=job,
                   conditions=LAB if args.lab else FIELD, skew_ms=args.skew_ms)
    store = open_store(resolve_store_url(args.store))
    try:
        write_to_store(sim, store)
        shown = store.url
    finally:
        store.close()
    truth = sim.truth
    written = {
        "job": job, "store": shown, "ranks": args.ranks, "fault": args.fault,
        "seed": args.seed, "collectives": len(sim.columns),
        "nodes": len(set(sim.rank_nodes.values())),
        "truth": {
            "kind": truth.kind.value if truth.kind else "healthy",
            "culprit_ranks": list(truth.culprit_ranks), "culprit_nodes": list(truth.culprit_nodes),
            "link": list(truth.link) if truth.link else None, "variant": truth.variant,
            "size": truth.size,
        },
        "conditions": "lab" if args.lab else "field",
        "workload": sim.info.get("workload"),
    }
    if args.json:
        _print_json(written)
    else:
        print(f"wrote job {job}: {args.ranks} ranks on {written['nodes']} nodes, "
              f"{written['collectives']} collective events, injected {written['truth']['kind']} "
              f"({truth.variant or '-'}) at ranks {list(truth.culprit_ranks)[:8]} to {shown}")
        print(f"now: tracehound diagnose --job {job}"
              + (f" --store {mask_url(args.store)}" if args.store else ""))
    return 0


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM and SIGINT unwind as KeyboardInterrupt, so every `finally` runs and no rank is left
    behind. SIGINT is handled explicitly too: a process started in the background by a
    non-interactive shell inherits SIGINT ignored, and Ctrl-C must still stop it cleanly."""
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logs.configure(args.log_level)
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    handlers = {"demo": cmd_demo, "run": cmd_run, "incidents": cmd_incidents,
                "diagnose": cmd_diagnose, "simulate": cmd_simulate,
                "export": tracefiles.cmd_export, "load": tracefiles.cmd_load}
    # a subcommand module's add_parser may set its handler with set_defaults(handler=...)
    handler = getattr(args, "handler", None) or handlers[args.command]
    try:
        return int(handler(args))
    except StoreError as exc:
        print(f"tracehound {args.command}: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"tracehound {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tracehound {args.command}: interrupted; all ranks were stopped", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `tracehound` command: `main`, then exit with its status. After an interrupt (130)
    every rank is stopped and the store closed already; the process then exits at once, so a
    signal arriving while the interpreter tears down (its handlers back to the defaults, and the
    embedded store's native threads still winding down) cannot turn a clean stop into death by
    signal."""
    code = main()
    if code == 130:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


