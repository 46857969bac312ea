"""bench/watch.py, small, against the test server: simulated jobs stream into the store, one
watcher of all of them names the hung job's stopped rank, and the policy would act on none of
the healthy ones. `--json` keeps the figures the README reports. No figure of speed is asserted
(a shared machine)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.clickhouse_server

BENCH = Path(__file__).resolve().parents[2] / "bench" / "watch.py"
FIGURES = ("jobs", "windows_per_s", "detect_s", "false_verdicts", "stalls_observed",
           "watcher_cpu_share")


def test_quick_watch_bench_names_the_hang_and_would_act_on_no_healthy_job(
        clickhouse_url: str) -> None:
    url = urlsplit(clickhouse_url)._replace(path=f"/tracehound_wb{uuid.uuid4().hex[:8]}").geturl()
    try:
        done = subprocess.run(
            [sys.executable, str(BENCH), "--quick", "--json", "--store", url],
            capture_output=True, text=True, timeout=900, check=False,  # a hang guard only
        )
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout)
    finally:
        from tracehound.tracing.store.server import ClickHouseServerStore

        cleanup = ClickHouseServerStore(url)
        try:
            cleanup.drop_database()
        finally:
            cleanup.close()
    assert set(FIGURES) <= set(result)
    assert (result["jobs"], result["jobs_watched"], result["ranks"]) == (4, 4, 32)
    assert result["windows_written"] == 4 * int(result["duration_s"] / result["window_s"])
    assert result["hang"]["job"] == "prod-002" and result["hang"]["kind"] == "hang"
    assert result["hang_named"] is True and result["detect_s"] > 0
    assert result["false_would_act"] == 0 and result["stalls_would_act"] == 0, result
    assert result["windows_per_s"] > 0 and 0 < result["watcher_cpu_share"] < 2
