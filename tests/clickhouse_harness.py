"""Starts a real ClickHouse server (Debian's clickhouse-server) for tests and local runs.

The server gets its own config, data and log directories under a work directory and listens on
free ports of 127.0.0.1 only, so it never collides with another server or touches the system's
data. It must never be pointed at a directory another server uses (ClickHouse refuses: exit 70).

    python tests/clickhouse_harness.py start --dir /tmp/ch    # prints the URL, runs until SIGTERM
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

SERVER_BINARY = "clickhouse-server"
USERS_CONFIG = "/etc/clickhouse-server/users.xml"
TEST_DATABASE = "tracehound_test"
TEST_CLUSTER = "tracehound_test"
"""A cluster of two shards that the harness's server defines on itself (`remote_servers`), so
the store's cluster mode is tested for real on one server: both shards are this server's own
native port, and each shard's replica names its own `default_database` (`SHARD_DATABASES`),
which is where the store puts that shard's local tables."""
SHARD_DATABASES = ("tracehound_shard1", "tracehound_shard2")
INSTALL_HINT = "apt-get install -y clickhouse-server clickhouse-client"


class HarnessError(RuntimeError):
    """The test server could not be started or stopped."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _server_binary() -> str:
    found = shutil.which(SERVER_BINARY) or (
        "/usr/sbin/clickhouse-server" if os.path.exists("/usr/sbin/clickhouse-server") else None
    )
    if found is None:
        raise HarnessError(
            f"{SERVER_BINARY} is not installed; install it with `{INSTALL_HINT}` (as root, after "
            "`apt-get update`), or set TRACEHOUND_TEST_CLICKHOUSE_URL to a running server"
        )
    return found


def _config_xml(workdir: Path, tcp_port: int, http_port: int) -> str:
    def p(name: str) -> str:
        return escape(str(workdir / name)) + "/"

    shards = "".join(
        f"""
            <shard>
                <replica>
                    <host>127.0.0.1</host>
                    <port>{tcp_port}</port>
                    <default_database>{escape(database)}</default_database>
                </replica>
            </shard>"""
        for database in SHARD_DATABASES
    )
    return f"""<?xml version="1.0"?>
<yandex>
    <logger>
        <level>information</level>
        <log>{escape(str(workdir / "log" / "clickhouse-server.log"))}</log>
        <errorlog>{escape(str(workdir / "log" / "clickhouse-server.err.log"))}</errorlog>
        <size>100M</size>
        <count>2</count>
    </logger>
    <listen_host>127.0.0.1</listen_host>
    <tcp_port>{tcp_port}</tcp_port>
    <http_port>{http_port}</http_port>
    <max_connections>256</max_connections>
    <keep_alive_timeout>3</keep_alive_timeout>
    <max_concurrent_queries>100</max_concurrent_queries>
    <mark_cache_size>268435456</mark_cache_size>
    <path>{p("data")}</path>
    <tmp_path>{p("tmp")}</tmp_path>
    <user_files_path>{p("user_files")}</user_files_path>
    <format_schema_path>{p("format_schemas")}</format_schema_path>
    <users_config>{escape(USERS_CONFIG)}</users_config>
    <default_profile>default</default_profile>
    <default_database>default</default_database>
    <remote_servers>
        <{TEST_CLUSTER}>{shards}
        </{TEST_CLUSTER}>
    </remote_servers>
</yandex>
"""


def _log_tail(workdir: Path, lines: int = 30) -> str:
    parts = []
    for name in ("clickhouse-server.err.log", "clickhouse-server.log"):
        log = workdir / "log" / name
        if log.exists():
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"--- {log} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(parts) or f"(no log under {workdir / 'log'})"


def pid_runs(pid: int) -> bool:
    """Whether `pid` runs. A daemon is not our child, so a zombie (no reaper in a container)
    counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None when it
    cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _answers(port: int) -> bool:
    from clickhouse_driver import Client

    client = Client(
        host="127.0.0.1", port=port, connect_timeout=1, send_receive_timeout=2,
        sync_request_timeout=1,
    )
    try:
        return bool(client.execute("SELECT 1") == [(1,)])
    except Exception:
        return False
    finally:
        client.disconnect()


@dataclass
class RunningServer:
    """A ClickHouse server this harness started; `stop()` ends it."""

    url: str
    """clickhouse://default:@127.0.0.1:PORT/tracehound_test"""
    tcp_port: int
    http_port: int
    pid: int
    workdir: Path

    def stop(self, *, timeout: float = 30.0) -> None:
        """SIGTERM the server and wait until it is gone (SIGKILL after `timeout` seconds)."""
        if not pid_runs(self.pid):
            return
        os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_runs(self.pid):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                break
            time.sleep(0.05)

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    workdir: Path, *, startup_timeout: float = 30.0, tcp_port: int | None = None
) -> RunningServer:
    """Start clickhouse-server with its files under `workdir`; returns once it answers a query.

    Pass the `tcp_port` of an earlier server on the same `workdir` to bring it back after a stop
    (outage tests): same URL, same data.

    Raises HarnessError (with the server log's tail) if it does not answer in `startup_timeout`
    seconds, or says how to install it if it is missing."""
    binary = _server_binary()
    workdir = Path(workdir).resolve()
    for sub in ("data", "tmp", "user_files", "format_schemas", "log"):
        # The log directory must exist before a --daemon start: without it the daemon exits
        # silently.
        (workdir / sub).mkdir(parents=True, exist_ok=True)
    tcp_port = tcp_port or free_port()
    http_port = free_port()
    while http_port == tcp_port:
        http_port = free_port()
    config = workdir / "config.xml"
    config.write_text(_config_xml(workdir, tcp_port, http_port))
    pid_file = workdir / "server.pid"
    pid_file.unlink(missing_ok=True)
    launched = subprocess.run(
        [binary, "--daemon", f"--pid-file={pid_file}", f"--config-file={config}"],
        cwd=workdir, capture_output=True, text=True, check=False,
    )
    if launched.returncode != 0:
        raise HarnessError(
            f"{binary} --daemon exited with {launched.returncode}: "
            f"{launched.stderr.strip()}\n{_log_tail(workdir)}"
        )
    deadline = time.monotonic() + startup_timeout
    pid = 0
    while time.monotonic() < deadline:
        if not pid and pid_file.exists():
            text = pid_file.read_text().strip()
            pid = int(text) if text.isdigit() else 0
        if pid and not pid_runs(pid):
            raise HarnessError(f"clickhouse-server (pid {pid}) exited during start\n"
                               + _log_tail(workdir))
        if pid and _answers(tcp_port):
            url = f"clickhouse://default:@127.0.0.1:{tcp_port}/{TEST_DATABASE}"
            return RunningServer(url, tcp_port, http_port, pid, workdir)
        time.sleep(0.1)
    server = RunningServer("", tcp_port, http_port, pid, workdir)
    if pid:
        server.stop()
    raise HarnessError(
        f"clickhouse-server did not answer on 127.0.0.1:{tcp_port} within {startup_timeout:.0f} s "
        f"(pid file {pid_file}: {'pid ' + str(pid) if pid else 'never written'})\n"
        + _log_tail(workdir)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a server, print its URL, stop it on SIGTERM/SIGINT")
    start.add_argument("--dir", required=True, type=Path, help="work directory of the server")
    args = parser.parse_args(argv)

    server = start_server(args.dir)
    done = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        done.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(server.url, flush=True)
    began = time.monotonic()
    try:
        while not done.wait(0.5):
            if not pid_runs(server.pid):
                print(f"clickhouse-server (pid {server.pid}) died\n{_log_tail(server.workdir)}",
                      file=sys.stderr)
                return 1
        # what the server cost the machine (a daemon: no one reaps it, so no one counts it)
        used = _cpu_seconds(server.pid)
        if used is not None:
            print(f"clickhouse-server used {used:.0f} CPU-s in {time.monotonic() - began:.0f} s",
                  file=sys.stderr)
    finally:
        server.stop()
    return 0


def _cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of a running process, from /proc (None when unreadable)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
