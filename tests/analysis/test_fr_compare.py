"""`bench/fr_compare.py`: its cases read right by Tracehound, and its reading of torch's
analyzer. Every case is checked in process (the dumps parsed and diagnosed as `import-fr` and
`diagnose` do, without a store); three go through the bench itself, end to end, with torch's
`fr_trace` beside them: one where torch's analyzer blames every rank, one it reads as a state
mismatch, and a control where it blames none."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import Observation
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing import flightrecorder as fr
from tracehound.tracing.events import CollectiveEvent, Heartbeat, ProcessGroupInfo
from tracehound.tracing.ids import JobId

BENCH = Path(__file__).resolve().parents[2] / "bench" / "fr_compare.py"


def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fr_compare", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fr_compare"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


FR = bench()


@pytest.mark.parametrize("case", FR.cases(), ids=lambda c: c.name)
def test_tracehound_reads_each_case_right(case: object) -> None:
    dumped_at_us = int(FR.DUMPED_AT_S * 1_000_000)
    dumps = [fr.parse_dump(raw, source=f"rank_{r}", dumped_at_us=dumped_at_us)
             for r, raw in case.make().items()]  # type: ignore[attr-defined]
    conv = fr.to_records(dumps, job=JobId("c"), attempt=0, world_size=FR.WORLD)
    snap = JobSnapshot(
        job=JobId("c"), attempt=0, now_us=dumped_at_us,
        heartbeats=tuple(r for r in conv.records if isinstance(r, Heartbeat)),
        groups=tuple(r for r in conv.records if isinstance(r, ProcessGroupInfo)),
        expected_ranks={r: "unknown" for r in range(FR.WORLD)},
    )
    assert any(isinstance(r, CollectiveEvent) for r in conv.records)
    verdict = diagnose_observation(Observation.of(snap))
    got = {"kind": verdict.kind.value if verdict else "healthy",
           "culprit_ranks": list(verdict.culprit_ranks) if verdict else []}
    assert FR.right(case, got), (got, verdict.summary if verdict else "")


def test_the_bench_compares_both_readers_and_says_where_torchs_goes_wrong() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--cases",
         "op-odd-last,gpu-incomplete,control-gather"],
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    rows = {r["case"]: r for r in result["cases"]}
    assert result["tracehound_right"] == result["total"] == 3
    assert all(r["tracehound"]["right"] for r in rows.values())
    assert rows["gpu-incomplete"]["tracehound"]["culprit_ranks"] == [3]
    # torch's analyzer, as its log lines say: it takes the rank it reads first as right, and
    # reads an unfinished call on one rank as a state mismatch of the others
    assert rows["op-odd-last"]["fr_trace"]["culprit_ranks"] == [0, 1, 2]
    assert "COLLECTIVE_STATE_MISMATCH" in rows["gpu-incomplete"]["fr_trace"]["detail"]
    assert rows["control-gather"]["fr_trace"]["culprit_ranks"] == []
    assert "[3/3] control-gather" in done.stderr  # progress on stderr
