"""`tracehound ui` as a script runs it: bad arguments named, a served dashboard that answers,
and a clean stop on Ctrl-C (SIGINT) with exit status 0."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_browser import _free_port

pytestmark = pytest.mark.e2e


def tracehound(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracehound.controller.cli", *args],
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize(("args", "message"), [
    (["--port", "0"], "--port 0: expected a port number from 1 to 65535"),
    (["--refresh", "-1"], "--refresh -1.0: expected a positive number of seconds"),
    (["--store", "mysql://db/x"], "--store 'mysql://db/x': expected clickhouse://"),
])
def test_bad_arguments_are_named(args: list[str], message: str) -> None:
    done = tracehound("ui", *args)
    assert done.returncode == 2
    assert message in done.stderr


def test_help_teaches_the_views_and_the_contract_flags() -> None:
    done = tracehound("ui", "--help")
    assert done.returncode == 0
    for text in ("--store", "--port", "--address", "?view=incident", "ClickHouse server"):
        assert text in done.stdout


def test_serves_until_ctrl_c_then_exits_cleanly(tmp_path: Path) -> None:
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tracehound.controller.cli", "ui", "--store",
         f"chdb://{tmp_path / 'store'}", "--port", str(port), "--address", "127.0.0.1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health",
                                            timeout=2) as answer:
                    assert answer.status == 200
                    break
            except OSError:
                assert server.poll() is None, server.communicate()
                time.sleep(0.2)
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err
    assert "serving the dashboard of chdb://" in err and "tracehound ui: stopped" in err
