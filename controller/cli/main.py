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
    tracehound watch      watch jobs Tracehound did not launch: incidents, alerts, actions

Exit status: 0 on success, 1 when the job (or the demo) failed, 2 for bad usage or a store that
cannot be used, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from tracehound.controller.cli import (
    bundle,
    dashboard,
    demo,
    explain,
    importfr,
    incidents,
    launchers,
    retention,
    simulate,
    stacks,
    status,
    tracefiles,
    watch,
)
from tracehound.controller.cli import run as run_command
from tracehound.controller.cli.options import store_arg
from tracehound.controller.extras import MissingExtra
from tracehound.controller.operator import handlers as operator
from tracehound.controller.policy import file as policyfile
from tracehound.tracing import logs
from tracehound.tracing.errors import StoreError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tracehound",
        description="Find the rank and node behind a hung or crashed distributed training job, "
                    "isolate it and restart from checkpoint.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    run_command.add_parser(sub)
    incidents.add_parser(sub)
    explain.add_parser(sub)
    simulate.add_parser(sub)
    tracefiles.add_parsers(sub, store_arg)
    stacks.add_parser(sub, store_arg)
    importfr.add_parser(sub, store_arg)
    launchers.add_parsers(sub, store_arg)
    policyfile.add_parser(sub)
    status.add_parser(sub, store_arg)
    retention.add_parser(sub, store_arg)
    operator.add_parser(sub, store_arg)
    bundle.add_parser(sub)
    dashboard.add_parser(sub, store_arg)
    watch.add_parser(sub)
    return parser


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
    handlers = {"export": tracefiles.cmd_export, "load": tracefiles.cmd_load}
    # each command module's add_parser sets its handler with set_defaults(handler=...)
    handler = getattr(args, "handler", None) or handlers[args.command]
    try:
        return int(handler(args))
    except (StoreError, MissingExtra) as exc:
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


