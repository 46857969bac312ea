"""Retention drops whole days of every table, older than the age asked for, on each adapter."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from tracehound.controller.cli.main import main
from tracehound.controller.cli.retention import cutoff_day
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Batch,
    Heartbeat,
    JobPhase,
    JobState,
    RankExit,
)
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore, open_store

JOB = JobId("old")
DAY_US = 86_400 * 1_000_000
T0 = int(dt.datetime(2026, 11, 1, 12, tzinfo=dt.UTC).timestamp()) * 1_000_000


def fill(store: TraceStore) -> None:
    """Records of 2026-11-01, -02 and -03 in a batch table and two controller tables."""
    for day in range(3):
        at = T0 + day * DAY_US
        store.insert(Batch(batch_id=f"d{day}", records=(
            Heartbeat(job=JOB, attempt=0, node=NodeId("n"), rank=Rank(0), time_us=at, pid=1,
                      step=day, step_us=at, start_step=0, first_step_us=at, dropped=0),
            RankExit(job=JOB, attempt=day, node=NodeId("n"), rank=Rank(0), pid=1, exit_code=0,
                     time_us=at))))
        store.record_state(JobState(job=JOB, time_us=at, seq=day + 1, state=JobPhase.RUNNING,
                                    attempt=day))
        store.record_action(Action(job=JOB, incident_id="i", kind=ActionKind.OBSERVE,
                                   target="n", time_us=at, ok=True))


def test_days_before_the_cutoff_are_dropped_from_every_table(store: TraceStore) -> None:
    fill(store)
    assert store.drop_days_before(20261102, dry_run=True) == {
        "heartbeats": [20261101], "rank_exits": [20261101], "actions": [20261101],
        "job_states": [20261101]}
    assert [s.seq for s in store.job_states(JOB)] == [1, 2, 3], "a dry run drops nothing"
    dropped = store.drop_days_before(20261103)
    assert dropped["job_states"] == [20261101, 20261102]
    assert [s.seq for s in store.job_states(JOB)] == [3]
    assert [e.attempt for e in store.exits(JOB, 2)] == [2] and store.exits(JOB, 0) == []
    assert store.drop_days_before(20261103) == {}
    with pytest.raises(ValueError, match="YYYYMMDD"):
        store.drop_days_before(2026)


def test_cutoff_keeps_the_last_n_days() -> None:
    now = dt.datetime(2026, 11, 24, 3, tzinfo=dt.UTC)
    assert cutoff_day(1, now) == 20261123
    assert cutoff_day(30, now) == 20261025
    with pytest.raises(ValueError, match="--older-than-days"):
        cutoff_day(0, now)


def test_the_command_lists_then_drops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"chdb://{tmp_path / 'store'}"
    with open_store(url) as store:
        fill(store)
    assert main(["retention", "--older-than-days", "1", "--dry-run", "--store", url]) == 0
    assert "job_states: would drop 3 days (20261101 .. 20261103)" in capsys.readouterr().out
    assert main(["retention", "--older-than-days", "1", "--json", "--store", url]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] is False and report["dropped"]["heartbeats"] == [
        20261101, 20261102, 20261103]
    with open_store(url) as store:
        assert store.job_states(JOB) == []
    assert main(["retention", "--older-than-days", "0", "--store", url]) == 2
    assert "expected a whole number of days >= 1" in capsys.readouterr().err
