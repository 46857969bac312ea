"""`tracehound ui`: serves the incident dashboard (`tracehound.ui.app`, a Streamlit script) over
the store until stopped.

The dashboard runs in its own process (`python -m streamlit run`), found by module path so the
controller never imports it. The store URL reaches it through $TRACEHOUND_STORE, not the command
line, so a password in the URL does not show in the process list. Ctrl-C or SIGTERM stops the
server and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tracehound.tracing.settings import TRACEHOUND_STORE
from tracehound.tracing.store.urls import mask_url

EPILOG = """\
examples:
  tracehound ui                                   # the embedded store of `tracehound demo`
  tracehound ui --store clickhouse://default:@db:9000/tracehound --port 8080 --address 0.0.0.0
  open http://127.0.0.1:8501/?view=incident&job=exp7   # link straight to a view

views: jobs, incident, progress (ranks x sequence ids), stragglers (lateness, link matrix),
health (GPU and host metrics, events). An embedded store (chdb://) can be read only while no
other process holds it: for a running job's live view, use a ClickHouse server.
"""


def add_parser(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "ui", help="serve the incident dashboard (Streamlit) over the store",
        description="Serve the incident dashboard over the trace store, read-only, until "
                    "stopped: jobs and their effective training time, incidents with their "
                    "evidence and timeline, collective progress, stragglers and links, node "
                    "health.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--port", type=int, default=8501, help="port to serve on (default: 8501)")
    p.add_argument("--address", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--refresh", type=float, default=5.0, metavar="S",
                   help="seconds between redraws of a running job's view (default: 5)")
    store_arg(p)
    p.set_defaults(handler=cmd_ui)


def app_path() -> str:
    spec = importlib.util.find_spec("tracehound.ui.app")
    if spec is None or spec.origin is None:
        raise RuntimeError("the dashboard tracehound.ui is not installed")
    return spec.origin


def streamlit_command(args: argparse.Namespace) -> list[str]:
    return [
        sys.executable, "-m", "streamlit", "run", app_path(),
        "--server.port", str(args.port), "--server.address", args.address,
        "--server.headless", "true", "--server.fileWatcherType", "none",
        "--server.runOnSave", "false", "--browser.gatherUsageStats", "false",
        "--global.developmentMode", "false", "--client.toolbarMode", "viewer",
        "--", "--refresh", str(args.refresh),
    ]


def cmd_ui(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.controller.extras import require_extra

    require_extra("ui", "streamlit", "altair", "pandas")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port}: expected a port number from 1 to 65535")
    if not args.refresh > 0:
        raise ValueError(f"--refresh {args.refresh}: expected a positive number of seconds")
    url = resolve_store_url(args.store)
    if not url.startswith(("chdb://", "clickhouse://")):
        raise ValueError(f"--store {mask_url(url)!r}: expected clickhouse://user:pass@host:9000/"
                         "db or chdb:///dir")
    env = {**os.environ, TRACEHOUND_STORE: url}
    print(f"tracehound ui: serving the dashboard of {mask_url(url)} at "
          f"http://{args.address}:{args.port}/ (Ctrl-C stops it)", file=sys.stderr, flush=True)
    server = subprocess.Popen(streamlit_command(args), env=env)
    try:
        return _exit_status(server.wait())
    except KeyboardInterrupt:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        print("tracehound ui: stopped", file=sys.stderr)
        return 0


def _exit_status(code: int) -> int:
    return 0 if code in (0, -2, -15) else code
