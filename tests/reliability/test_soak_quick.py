"""The soak benchmark, short, against the test server: simulated ranks through real node agents
into the real ClickHouse server lose nothing and store nothing twice, and `--json` keeps the
contract scripts rely on. No figure of speed is asserted (a shared machine); the benchmark's
counts are checked against each other and against its own inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.clickhouse_server

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"
CONTRACT = ("events_sent", "events_stored", "lost", "duplicated", "events_per_s", "max_rss_mb")


def test_quick_soak_loses_nothing_and_stores_nothing_twice(clickhouse_url: str) -> None:
    ranks, rate, duration = 8, 50, 15
    done = subprocess.run(
        [sys.executable, str(SOAK), "--json", "--quick", "--duration", str(duration),
         "--ranks", str(ranks), "--agents", "2", "--ranks-per-process", "4",
         "--rate", str(rate), "--server", clickhouse_url],
        capture_output=True, text=True, timeout=900, check=False,  # a hang guard only
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert set(CONTRACT) <= set(result)
    assert set(result["max_rss_mb"]) >= {"agent", "rank", "bench"}
    assert all(mb > 0 for mb in result["max_rss_mb"].values())
    assert result["server"] == f"given: {clickhouse_url}"

    assert result["ranks_reported"] == ranks
    # every rank emitted rate * duration collectives, paced against the clock
    assert result["events_emitted"] == ranks * rate * duration
    assert result["dropped_by_ranks"] == 0
    assert result["events_sent"] == result["events_emitted"]
    assert result["lost"] == 0
    assert result["duplicated"] == 0
    assert result["unexpected"] == 0
    assert result["events_stored"] == result["events_sent"]
    assert result["transport"]["lost"] == 0
    assert result["transport"]["unsent_at_exit"] == 0
    assert result["agents_final"]["rejected"] == 0
    assert result["agents_final"]["pending_segments"] == 0
    assert result["agents_final"]["shipped"] == result["agents_final"]["spooled"]
    assert result["probe"]["lost"] == 0
    assert result["probe"]["duplicated"] == 0
    assert result["probe"]["sent"] > 0
    assert result["ship_lag_ms"]["samples"] == result["probe"]["seen"]
