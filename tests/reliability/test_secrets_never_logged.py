"""Credentials and webhook secrets never reach a log, an output or another user's eyes.

Real commands run at DEBUG log level with secrets that cannot occur by chance: a ClickHouse
server (its own, started here, with a user that has a password: the harness's shared server has
only the password-less `default`) reached through $TRACEHOUND_STORE, and alert receivers from
$TRACEHOUND_ALERTS with a webhook signing secret, a PagerDuty routing key and a Slack URL
whose path is its token. The receivers are a port where nothing listens (Slack), an HTTP server
that refuses the webhook for good (400) and one that is busy for PagerDuty (503), so the error
paths log as well as the happy ones.

- `tracehound run` of a one-rank job that crashes once and then finishes: its stdout, stderr,
  every file of its work directory (the agents' and ranks' logs, the journal, the incident
  evidence, the alert outbox), and the command line of every process it started while they ran
  (`ps` shows those to every user: the node agents get the store URL through their environment);
- `tracehound status` and `tracehound incidents`, against the server, against it with a wrong
  password and against a port where nothing listens;
- `tracehound ui`: its start-up until the dashboard answers, and the dashboard's views run
  in-process (Streamlit's AppTest) with every log record captured;

none may contain any of the secrets. The secrets are checked to have been used (the server
authenticated the user, the PagerDuty receiver got the routing key, the webhook's signature
verifies with the secret), so the greps cannot pass for want of anything to find. The alert
outbox is no log, and holds no secret, but it tells about the jobs: it is readable by its owner
only (0700 directory).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import clickhouse_harness
import pytest
from evidence_check import check_incidents

from tracehound.controller.alerts import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    verify_signature,
)
from tracehound.tracing.store import open_store

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ui"))  # for `import ui_harness`

pytestmark = pytest.mark.clickhouse_server

USER = "th_secret_user"
STORE_PASSWORD = "PwCH-7f1e9a3c-leak-canary"
WRONG_PASSWORD = "PwWRONG-0b5d2e-leak-canary"
WEBHOOK_SECRET = "WhSEC-4c8a1f-leak-canary"
ROUTING_KEY = "PdRK-9e2b7d-leak-canary"
SLACK_TOKEN = "SlTOK-1a6c0e-leak-canary"
SECRETS = (STORE_PASSWORD, WRONG_PASSWORD, WEBHOOK_SECRET, ROUTING_KEY, SLACK_TOKEN)

USERS_XML = f"""<?xml version="1.0"?>
<yandex>
    <profiles><default></default><readonly><readonly>1</readonly></readonly></profiles>
    <users>
        <default>
            <password></password>
            <networks><ip>127.0.0.1</ip></networks>
            <profile>default</profile><quota>default</quota>
        </default>
        <{USER}>
            <password>{STORE_PASSWORD}</password>
            <networks><ip>127.0.0.1</ip></networks>
            <profile>default</profile><quota>default</quota>
        </{USER}>
    </users>
    <quotas><default><interval><duration>3600</duration><queries>0</queries><errors>0</errors>
        <result_rows>0</result_rows><read_rows>0</read_rows><execution_time>0</execution_time>
    </interval></default></quotas>
</yandex>
"""


def leaks(text: str) -> list[str]:
    """The secrets that occur in `text`."""
    return [secret for secret in SECRETS if secret in text]


@pytest.fixture(scope="module")
def secret_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A ClickHouse server of its own whose user USER has the password STORE_PASSWORD: its
    native port and its work directory."""
    workdir = tmp_path_factory.mktemp("secret-clickhouse")
    users = workdir / "users.xml"
    users.write_text(USERS_XML)
    saved = clickhouse_harness.USERS_CONFIG
    clickhouse_harness.USERS_CONFIG = str(users)
    try:
        server = clickhouse_harness.start_server(workdir)
    finally:
        clickhouse_harness.USERS_CONFIG = saved
    try:
        yield server.tcp_port, workdir
    finally:
        server.stop()


def store_url(port: int, database: str, password: str = STORE_PASSWORD) -> str:
    return f"clickhouse://{USER}:{password}@127.0.0.1:{port}/{database}"


@dataclass
class Receivers:
    """An HTTP server taking the webhook (400: refused for good) and PagerDuty (503: busy),
    and what they were sent."""

    server: ThreadingHTTPServer
    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    got = Receivers(server=None)  # type: ignore[arg-type]

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            got.requests.append((self.path, dict(self.headers.items()), body))
            status = 400 if self.path.startswith("/hook") else 503
            reply = b'{"status": "no"}'
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    got.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=got.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield got
    finally:
        got.server.shutdown()
        got.server.server_close()


def receivers_file(path: Path, receivers: Receivers) -> Path:
    closed = clickhouse_harness.free_port()  # nothing listens here: connection refused
    path.write_text(json.dumps({"receivers": [
        {"name": "oncall-slack", "kind": "slack",
         "url": f"http://127.0.0.1:{closed}/services/T0LEAK/B0LEAK/{SLACK_TOKEN}",
         "timeout_s": 1},
        {"name": "oncall-hook", "kind": "webhook",
         "url": f"http://127.0.0.1:{receivers.port}/hook", "secret": WEBHOOK_SECRET},
        {"name": "pager", "kind": "pagerduty", "url": f"http://127.0.0.1:{receivers.port}/pd",
         "routing_key": ROUTING_KEY},
    ]}))
    return path


def command_env(store: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "TRACEHOUND_STORE": store, "TRACEHOUND_LOG_LEVEL": "DEBUG"}
    env.pop("TRACEHOUND_ALERTS", None)
    env.pop("TRACEHOUND_INGEST_TOKEN", None)
    return {**env, **extra}


def tracehound(*args: str, env: dict[str, str], timeout: float = 300
               ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracehound.controller.cli", *args],
                          capture_output=True, text=True, env=env, timeout=timeout, check=False)


class CommandLines:
    """Reads the command line of every process below this one while it runs (every user can
    read them from /proc). A pid is read again on every pass: a child seen between fork and exec
    still shows its parent's command line, and its own comes a moment later."""

    def __init__(self) -> None:
        self.seen: set[tuple[int, str]] = set()  # (pid, a command line it had)
        self._mine: set[int] = set()
        self._others: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = str(os.getpid())
        while not self._stop.wait(0.02):
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit() or int(entry.name) in self._others:
                    continue
                pid = int(entry.name)
                try:
                    if pid not in self._mine:
                        if me not in self._ancestors(entry.name):
                            self._others.add(pid)
                            continue
                        self._mine.add(pid)
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
                except OSError:
                    continue
                if cmdline:
                    self.seen.add((pid, cmdline.decode(errors="replace")))

    def commands(self, containing: str) -> set[int]:
        """The pids that ran a command line containing `containing`."""
        return {pid for pid, command in self.seen if containing in command}

    def leaking(self) -> list[tuple[int, str]]:
        return sorted((pid, command) for pid, command in self.seen if leaks(command))

    @staticmethod
    def _ancestors(pid: str) -> list[str]:
        out = []
        for _ in range(10):
            status = Path(f"/proc/{pid}/status").read_text()
            pid = next(line.split()[1] for line in status.splitlines()
                       if line.startswith("PPid:"))
            out.append(pid)
            if pid in ("0", "1"):
                break
        return out

    def __enter__(self) -> CommandLines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def files_under(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_a_run_with_a_crash_and_failing_receivers_logs_no_secret(
        secret_server: tuple[int, Path], receivers: Receivers, tmp_path: Path) -> None:
    port, _ = secret_server
    database = f"tracehound_sec{uuid.uuid4().hex[:10]}"
    url = store_url(port, database)
    script = tmp_path / "train.py"
    script.write_text("import os, sys\n"
                      "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
                      "    sys.exit(3)\n")
    alerts = receivers_file(tmp_path / "alerts.json", receivers)
    workdir = tmp_path / "work"
    env = command_env(url, TRACEHOUND_ALERTS=str(alerts))

    with CommandLines() as lines:
        run = tracehound("run", "--job-id", "leaky", "--nnodes", "1", "--nproc-per-node", "1",
                         "--workdir", str(workdir), "--timeout", "120", str(script), env=env)
    assert run.returncode == 0, run.stderr[-3000:]

    # the secrets were used: the job is in the password-protected store, each receiver was tried
    with open_store(url, create=False) as store:
        (incident,) = store.incidents("leaky")  # type: ignore[arg-type]
        assert incident.kind == "crash"
        check_incidents(store, "leaky", as_stored=True)  # its facts agree with its records
        alert_actions = [a for a in incident.actions if a.kind.value == "alert"]
    hooks = [r for r in receivers.requests if r[0] == "/hook"]
    pages = [r for r in receivers.requests if r[0] == "/pd"]
    # the crash fired and resolved (the job finished): the webhook refused both
    assert [json.loads(body)["status"] for _, _, body in hooks] == ["firing", "resolved"]
    for _, headers, body in hooks:
        assert verify_signature(WEBHOOK_SECRET, headers[TIMESTAMP_HEADER], body,
                                headers[SIGNATURE_HEADER], now_s=time.time())
    # PagerDuty is busy: its trigger is tried (again after a wait), its resolve waits behind it
    assert len(pages) >= 1
    assert {json.loads(body)["event_action"] for _, _, body in pages} == {"trigger"}
    assert {json.loads(body)["routing_key"] for _, _, body in pages} == {ROUTING_KEY}
    # each refusal was set aside and recorded on the incident, with the URL shown
    assert [(a.target, a.ok, a.detail) for a in alert_actions] == [
        ("oncall-hook", False,
         f"{status} alert to oncall-hook (webhook) set aside after 1 try: HTTP 400 from "
         f"http://127.0.0.1:{receivers.port}/...: {{\"status\": \"no\"}}")
        for status in ("firing", "resolved")]
    logged = run.stdout + run.stderr
    assert "receiver oncall-slack failed (try 1)" in logged  # the unreachable one, logged
    assert f"http://127.0.0.1:{receivers.port}/..." in logged
    assert "DEBUG" in logged  # the run logged at DEBUG

    # nothing written, printed or shown to other users names a secret
    assert leaks(logged) == []
    written = files_under(workdir)
    agent_logs = [p for p in written if p.name.startswith("agent-") and p.suffix == ".log"]
    assert len(agent_logs) == 2  # one node agent per attempt
    outbox = [p for p in written if "alerts" in p.relative_to(workdir).parts]
    assert len(outbox) >= 3  # the pending slack and pager deliveries, the hook's failed record
    assert {p: leaks(data.decode(errors="replace")) for p, data in written.items()
            if leaks(data.decode(errors="replace"))} == {}
    # one node agent per attempt, and the node's snapshot keeper (seen too: its command line
    # is checked for secrets with every other)
    assert len(lines.commands("-m tracehound.agent.node ")) == 2, sorted(lines.seen)
    assert len(lines.commands("-m tracehound.agent.node.keeper ")) == 1, sorted(lines.seen)
    assert lines.leaking() == []
    # the outbox is no log, but it tells about the jobs: its owner's only
    alerts_dir = workdir / "leaky" / "alerts"
    assert stat.S_IMODE(alerts_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(alerts_dir.parent.stat().st_mode) & 0o022 == 0

    # reading the store: status and incidents, and each with a wrong password and no server
    plain = command_env(url)
    shown = f"clickhouse://{USER}:***@127.0.0.1:{port}/{database}"
    for args in (("status", "--job", "leaky"), ("incidents", "--job", "leaky")):
        done = tracehound(*args, env=plain)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "leaky" in done.stdout
        assert leaks(done.stdout + done.stderr) == []
    closed = clickhouse_harness.free_port()
    for bad, expected in ((store_url(port, database, WRONG_PASSWORD), shown),
                          (store_url(closed, database),
                           f"clickhouse://{USER}:***@127.0.0.1:{closed}/{database}")):
        for args in (("status", "--job", "leaky"), ("incidents", "--job", "leaky")):
            done = tracehound(*args, env=command_env(bad))
            assert done.returncode == 2, (done.stdout, done.stderr)
            assert expected in done.stderr
            assert leaks(done.stdout + done.stderr) == []


@pytest.mark.e2e
def test_the_dashboard_logs_no_secret(
        secret_server: tuple[int, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    """`tracehound ui` starts (until the dashboard answers) and its views run over the store,
    at DEBUG, with the password in $TRACEHOUND_STORE."""
    from streamlit.testing.v1 import AppTest
    from ui_harness import app, texts

    from tracehound.controller.cli.dashboard import app_path
    from tracehound.ui.store import close_shared_store

    port, _ = secret_server
    database = f"tracehound_sec{uuid.uuid4().hex[:10]}"
    url = store_url(port, database)
    with open_store(url):
        pass  # the schema, as a run leaves it
    ui_port = clickhouse_harness.free_port()
    out = tmp_path / "ui.out"
    with open(out, "wb") as sink, CommandLines() as lines:
        ui = subprocess.Popen(
            [sys.executable, "-m", "tracehound.controller.cli", "ui", "--port", str(ui_port)],
            stdout=sink, stderr=subprocess.STDOUT, env=command_env(url))
        try:
            health = ""
            for _ in range(600):  # a hang guard: the dashboard usually answers in seconds
                try:
                    with urllib.request.urlopen(
                            f"http://127.0.0.1:{ui_port}/_stcore/health", timeout=2) as answer:
                        health = answer.read().decode()
                        break
                except OSError:
                    assert ui.poll() is None, out.read_text()
                    time.sleep(0.2)
            assert health == "ok"
        finally:
            ui.terminate()
            ui.wait(timeout=30)
    started = out.read_text(errors="replace")
    assert f"serving the dashboard of clickhouse://{USER}:***@127.0.0.1:{port}/" in started
    assert leaks(started) == []
    assert len(lines.commands("streamlit")) >= 1
    assert lines.leaking() == []

    # the views themselves, in this process, every log record of every logger captured
    caplog.set_level(logging.DEBUG)
    close_shared_store()
    try:
        drawn = []
        for view in ("jobs", "incident", "progress", "stragglers", "health"):
            drawn += texts(app(url, view, monkeypatch, job="nothing-here"))
        # and a store that refuses the password: the page shows the error, without it
        close_shared_store()
        monkeypatch.setenv("TRACEHOUND_STORE", store_url(port, database, WRONG_PASSWORD))
        at = AppTest.from_file(app_path(), default_timeout=120)
        at.query_params["view"] = "jobs"
        at.run()
        wrong = [str(e.value) for e in at.exception] + texts(at)
    finally:
        close_shared_store()
    assert any(f"{USER}:***@" in text and "Wrong password" in text for text in wrong), wrong
    records = [r.getMessage() for r in caplog.records]
    assert len(records) > 0
    assert [r for r in records if leaks(r)] == []
    assert [t for t in drawn + wrong if leaks(t)] == []
    printed = capsys.readouterr()
    assert leaks(printed.out + printed.err) == []
