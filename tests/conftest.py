"""Fixtures shared by the whole test suite: a real ClickHouse server, store URLs for both trace
store adapters (the server one also in cluster mode), and the guard of the `e2e` marker.

`make test` runs two lanes at once: every test not marked `e2e` in parallel (pytest-xdist), and
the `e2e` tests, which start real training processes or servers, one at a time beside them. A
test that starts a training job, a node agent, the dashboard's server or a browser without the
marker fails at once, naming what it started (`_e2e_processes_are_marked`), so that none lands
in the parallel lane by mistake.

The server comes from `tests/clickhouse_harness.py` (Debian's clickhouse-server, started once per
session in a temp dir) unless TRACEHOUND_TEST_CLICKHOUSE_URL names a running one. The harness's
server also defines the two-shard cluster `TEST_CLUSTER` on itself; a server given by URL is
used in cluster mode only if it defines a cluster of that name.
"""

from __future__ import annotations

import os
import resource
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for `import clickhouse_harness`

from clickhouse_harness import TEST_CLUSTER, start_server
from demo_harness import DemoRun, run_demo
from store_urls import (
    STORE_ADAPTERS,
    drop_server_store,
    store_url_of,
    with_database,
)

from tracehound.tracing.store import TraceStore, open_store

CLICKHOUSE_URL_ENV = "TRACEHOUND_TEST_CLICKHOUSE_URL"

SHARED_RUNS = ("demo_hang", "demo_crash", "demo_store")
"""Session fixtures holding a real demo run: the tests that read one go to one xdist worker of
the e2e lane, so that each run is made once."""


CPU_REPORT_ENV = "TRACEHOUND_TEST_CPU_REPORT"
"""A file to which each test appends a line `<own CPU s> <children's CPU s> <start> <end> <test
id>`, the times in seconds since the epoch (CI is CPU-bound on two cores, so CPU seconds, not
durations, say what a test costs; the times show what ran beside what). The children's
seconds are those of the processes the test's process reaped (with their own reaped
descendants): a daemon, such as a ClickHouse server, is not counted."""


def _cpu_seconds() -> tuple[float, float]:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    report = os.environ.get(CPU_REPORT_ENV)
    before = _cpu_seconds() if report else (0.0, 0.0)
    started = time.time()
    yield
    if report:
        own, children = (after - was for after, was in zip(_cpu_seconds(), before, strict=True))
        with open(report, "a") as out:
            out.write(f"{own:8.2f} {children:8.2f} {started:.1f} {time.time():.1f} "
                      f"{item.nodeid}\n")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # before xdist's worker reads the groups (--dist loadgroup)
    for item in items:
        if set(getattr(item, "fixturenames", ())) & set(SHARED_RUNS):
            item.add_marker(pytest.mark.xdist_group("demo-runs"))


E2E_PROGRAMS = ("torchrun", "chromium", "streamlit", "tracehound.agent.node",
                "tracehound.agent.rank.warmspare", "coverage_job.py", "busy_train.py",
                "torchrun_job.py", "train_ddp.py", "train_sharded.py", "overhead_job.py",
                "munged", "slurmctld", "slurmd", "sbatch", "srun", "watched_job.py")
"""What only an `e2e` test may start: training jobs, node agents, warm spares, the dashboard's
server, a browser, the Slurm test cluster's daemons and jobs."""
E2E_COMMANDS = ("run", "demo", "instrument", "agent", "ui", "operator")
"""`tracehound` commands that start such processes (the others only read or write a store)."""


def starts_e2e_process(argv: object) -> str:
    """What in a command line only an `e2e` test may start ("" when nothing)."""
    words = shlex.split(argv) if isinstance(argv, str) else [str(w) for w in argv]  # type: ignore[attr-defined]
    if "--help" in words or "-h" in words:
        return ""
    for word in words:
        if any(word == p or word.endswith(("/" + p, p)) for p in E2E_PROGRAMS):
            return word
    for i, word in enumerate(words):
        if word.endswith("tracehound.controller.cli") or word.endswith("/tracehound"):
            rest = [w for w in words[i + 1:] if not w.startswith("-")]
            if rest and rest[0] in E2E_COMMANDS:
                return f"tracehound {rest[0]}"
    return ""


@pytest.fixture(autouse=True)
def _e2e_processes_are_marked(request: pytest.FixtureRequest,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("e2e") is not None:
        return
    original = subprocess.Popen
    test = request.node.nodeid

    class Guarded(original):  # type: ignore[valid-type, misc]
        def __init__(self, args: object, *rest: object, **kwargs: object) -> None:
            started = starts_e2e_process(args)
            if started:
                raise RuntimeError(f"{test} starts {started}: mark it @pytest.mark.e2e (it runs "
                                   "in the serial lane of `make test`)")
            super().__init__(args, *rest, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Guarded)


@pytest.fixture(scope="session")
def clickhouse_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real ClickHouse server: $TRACEHOUND_TEST_CLICKHOUSE_URL, else one this session
    starts (and stops at its end) with the harness."""
    given = os.environ.get(CLICKHOUSE_URL_ENV)
    if given:
        yield given
        return
    server = start_server(tmp_path_factory.mktemp("clickhouse-server"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def test_cluster(clickhouse_url: str) -> str:
    """The name of the test server's own two-shard cluster; skips when a server given by
    $TRACEHOUND_TEST_CLICKHOUSE_URL does not define it (its config is not the harness's)."""
    from clickhouse_driver import Client

    address = urlsplit(clickhouse_url)
    client = Client(host=address.hostname or "127.0.0.1", port=address.port or 9000,
                    user=address.username or "default", password=address.password or "")
    try:
        shards: int = client.execute(
            "SELECT count(DISTINCT shard_num) FROM system.clusters WHERE cluster = %(c)s",
            {"c": TEST_CLUSTER})[0][0]
    finally:
        client.disconnect()
    if shards < 2:
        pytest.skip(f"the ClickHouse server at {clickhouse_url} defines no cluster "
                    f"{TEST_CLUSTER!r} of two shards in its remote_servers (start it with "
                    "tests/clickhouse_harness.py to test the store's cluster mode)")
    return TEST_CLUSTER


@pytest.fixture(params=STORE_ADAPTERS)
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty store URL per test, once for each adapter (`store_url_of`)."""
    yield from store_url_of(request.param, request, tmp_path)


@pytest.fixture
def cluster_url(clickhouse_url: str, test_cluster: str) -> Iterator[str]:
    """A fresh cluster-mode store URL on the session server's own two-shard cluster:
    `.../tracehound_t<random>?cluster=tracehound_test&ddl=per_shard` (per_shard: the server has
    no ZooKeeper for ON CLUSTER DDL). Its local tables live in the shards' databases, which every
    cluster-mode store on the server shares, so they are dropped before the test (leftovers of
    an interrupted run) and after it, with the store's database."""
    database = f"tracehound_t{uuid.uuid4().hex[:12]}"
    url = urlsplit(with_database(clickhouse_url, database))._replace(
        query=f"cluster={test_cluster}&ddl=per_shard").geturl()
    drop_server_store(url)
    yield url
    drop_server_store(url)


@pytest.fixture
def store(store_url: str) -> Iterator[TraceStore]:
    """An open store with its schema, on each adapter; closed after the test."""
    opened = open_store(store_url)
    try:
        yield opened
    finally:
        opened.close()


# -- real demo runs, shared by the tests that read them ------------------------------------------


@pytest.fixture(scope="session")
def demo_hang(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """Rank 3 stopped with SIGSTOP, on an embedded store: read by the demo's own checks and the
    dashboard's tests (one run for all of them)."""
    base = tmp_path_factory.mktemp("demo-hang")
    return run_demo(f"chdb://{base / 'store'}", "demo-hang", base / "work",
                    "--fault", "hang", "--rank", "3")


@pytest.fixture(scope="session")
def demo_crash(tmp_path_factory: pytest.TempPathFactory, clickhouse_url: str) -> DemoRun:
    """Rank 1 killed with SIGKILL, on the ClickHouse server: read by the demo's own checks and
    by export/load."""
    base = tmp_path_factory.mktemp("demo-crash")
    store = with_database(clickhouse_url, f"tracehound_demo{uuid.uuid4().hex[:10]}")
    return run_demo(store, "demo-crash", base / "work", "--fault", "crash", "--rank", "1")
