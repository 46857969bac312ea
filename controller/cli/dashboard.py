"""`tracehound ui`: serves the incident dashboard (`tracehound.ui.app`, a Streamlit script) over
the store until stopped; `Dashboard` runs the same server beside a job (`tracehound run --ui`).

The dashboard runs in its own process (`python -m streamlit run`), found by module path so the
controller never imports it. The store URL reaches it through $TRACEHOUND_STORE, not the command
line, so a password in the URL does not show in the process list. Ctrl-C or SIGTERM stops the
server and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

from tracehound.tracing.settings import TRACEHOUND_STORE
from tracehound.tracing.store.urls import mask_url

EPILOG = """\
examples:
  tracehound ui                                   # the embedded store of `tracehound demo`
  tracehound ui --store clickhouse://default:@db:9000/tracehound --port 8080 --address 0.0.0.0
  open http://127.0.0.1:8501/?view=incident&job=exp7   # link straight to a view

views: jobs, incident, progress (ranks x sequence ids), stragglers (lateness, link matrix),
health (GPU and host metrics, events). An embedded store (chdb://) that a running job holds is
read through the job's `tracehound run` (or `tracehound run --ui` starts the dashboard beside
the job); a ClickHouse server (clickhouse://) is read directly by any number of dashboards.
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


def streamlit_command(*, port: int, address: str, refresh: float) -> list[str]:
    return [
        sys.executable, "-m", "streamlit", "run", app_path(),
        "--server.port", str(port), "--server.address", address,
        "--server.headless", "true", "--server.fileWatcherType", "none",
        "--server.runOnSave", "false", "--browser.gatherUsageStats", "false",
        "--global.developmentMode", "false", "--client.toolbarMode", "viewer",
        "--", "--refresh", str(refresh),
    ]


def check_port(port: int, address: str, flag: str) -> None:
    """ValueError naming `flag` unless `port` is a port number free on `address`."""
    if not 0 < port < 65536:
        raise ValueError(f"{flag} {port}: expected a port number from 1 to 65535")
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
        try:
            probe.bind((address, port))
        except OSError as exc:
            raise ValueError(f"{flag} {port}: cannot serve on {address}:{port} ({exc.strerror}); "
                             "pick another port") from None


class Dashboard:
    """The dashboard's server beside a job: started on a store URL, stopped when the job ends.
    Its output goes to `log`."""

    def __init__(self, url: str, *, port: int, log: Path, address: str = "127.0.0.1",
                 refresh: float = 5.0) -> None:
        self.url = url
        self.port = port
        self.address = address
        self.refresh = refresh
        self.log = log
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address_url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start(self) -> Self:
        from tracehound.controller.extras import require_extra

        require_extra("ui", "streamlit", "altair", "pandas")
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self._process = subprocess.Popen(
                streamlit_command(port=self.port, address=self.address, refresh=self.refresh),
                env={**os.environ, TRACEHOUND_STORE: self.url}, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,  # stopped by us, after the job, not by the terminal's ^C
            )
        return self

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s); say so if it had died."""
        process, self._process = self._process, None
        if process is None:
            return
        if process.poll() is not None:
            print(f"tracehound: the dashboard had stopped with status {process.returncode} "
                  f"(its log: {self.log})", file=sys.stderr)
            return
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the dashboard's server: SIGTERM, and SIGKILL when it has not gone 10 s later."""
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


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
    server = subprocess.Popen(streamlit_command(port=args.port, address=args.address,
                                                refresh=args.refresh), env=env)
    try:
        return _exit_status(server.wait())
    except KeyboardInterrupt:
        _stop(server)
        print("tracehound ui: stopped", file=sys.stderr)
        return 0


def _exit_status(code: int) -> int:
    return 0 if code in (0, -2, -15) else code
