"""`tracehound import-fr` then `tracehound diagnose` on real Flight Recorder dumps of faulty gloo
jobs: the golden dumps of tests/golden/fr (hang, op mismatch, crash; see its README) and, marked
slow, fresh runs of the same generator. torch's own analyzer is run on the same dumps, and what
it says is checked too. Everything goes through the real commands and an embedded store."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from evidence_check import check_incidents

from tracehound.tracing.store import open_store

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "fr"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracehound.controller.cli", *args],
                          capture_output=True, text=True, check=False)


def import_fr(directory: Path, job: str, store: str, *extra: str,
              expect: int = 0) -> dict[str, Any]:
    done = cli("import-fr", str(directory), "--job", job, "--store", store, "--json", *extra)
    assert done.returncode == expect, done.stderr
    summary: dict[str, Any] = json.loads(done.stdout)
    return summary


def diagnose(job: str, store: str) -> dict[str, Any]:
    done = cli("diagnose", "--job", job, "--store", store, "--json")
    assert done.returncode == 0, done.stderr
    verdict: dict[str, Any] = json.loads(done.stdout)
    return verdict


def golden(scenario: str, into: Path) -> tuple[Path, dict[str, Any]]:
    """A copy of a golden scenario's dumps with their recorded modification times (a dump's
    time is its file's; git keeps none), and its manifest."""
    manifest: dict[str, Any] = json.loads((GOLDEN / scenario / "manifest.json").read_text())
    target = into / scenario
    shutil.copytree(GOLDEN / scenario / "dumps", target)
    for name, mtime_ns in manifest["files"].items():
        os.utime(target / name, ns=(mtime_ns, mtime_ns))
    return target, manifest


def fr_trace(directory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(directory),
         *extra], capture_output=True, text=True, check=False)


def failed_on_a_dumped_rank(done: subprocess.CompletedProcess[str], directory: Path) -> bool:
    """`fr_trace` failed looking up gloo's empty pg_config for one of the ranks dumped in
    `directory`: the first it read, which depends on the directory's order."""
    dumped = {int(f.name.rsplit("_", 1)[1]) for f in directory.iterdir()}
    named = re.findall(r"KeyError: \('0', (\d+)\)", done.stderr)
    return done.returncode != 0 and len(named) == 1 and int(named[0]) in dumped


@pytest.fixture
def store(tmp_path: Path) -> str:
    return f"chdb://{tmp_path / 'store'}"


def test_a_hang_names_the_frozen_rank_that_left_no_dump(tmp_path: Path, store: str) -> None:
    dumps, manifest = golden("hang", tmp_path)
    (dumps / "launcher.log").write_text("rank 1: SIGSTOP\n")
    summary = import_fr(dumps, "hang", store)
    assert summary["files_read"] == 2 and summary["skipped"] == 1
    assert summary["skipped_files"][0]["file"].endswith("launcher.log")
    assert summary["ranks"] == [0, 2] and summary["ranks_without_dump"] == [1]
    assert summary["versions"] == ["2.10"] and summary["errors"] == []
    assert summary["records_written"] == summary["records"] > 0
    verdict = diagnose("hang", store)
    assert verdict["kind"] == "hang"
    assert verdict["culprit_ranks"] == [manifest["culprit"]] == [1]
    assert any(e["fact"] == "lagging" and e["rank"] == 1 and e["seq"] == 4
               for e in verdict["evidence"])
    waiting = {e["rank"] for e in verdict["evidence"] if e["fact"] == "waiting"}
    assert waiting == {0, 2}
    with open_store(store, create=False) as opened:  # the evidence agrees with the records
        assert check_incidents(opened, "hang", [{"attempt": 0, "verdict": verdict}]) >= 3


def test_an_op_mismatch_names_the_rank_that_ran_the_other_op(tmp_path: Path,
                                                              store: str) -> None:
    dumps, manifest = golden("mismatch", tmp_path)
    summary = import_fr(dumps, "mm", store)
    assert summary["ranks"] == [0, 1, 2] and summary["ranks_without_dump"] == []
    verdict = diagnose("mm", store)
    assert verdict["kind"] == "mismatch"
    assert verdict["culprit_ranks"] == [manifest["culprit"]] == [1]
    assert "broadcast" in verdict["summary"] and "all_reduce" in verdict["summary"]


def test_a_crash_names_the_rank_that_exited(tmp_path: Path, store: str) -> None:
    dumps, manifest = golden("crash", tmp_path)
    assert manifest["exit_codes"]["2"] == 3
    summary = import_fr(dumps, "crash", store, "--exit", "2=3")
    assert summary["ranks_without_dump"] == [2] and summary["counts"]["RankExit"] == 1
    verdict = diagnose("crash", store)
    assert verdict["kind"] == "crash" and verdict["culprit_ranks"] == [2]


def test_a_crash_without_exit_codes_says_what_is_missing(tmp_path: Path, store: str) -> None:
    """gloo counts the failed all_reduce as completed: the survivors' dumps show nothing
    pending, so the dumps alone cannot tell a crash from a job that stopped."""
    dumps, _ = golden("crash", tmp_path)
    summary = import_fr(dumps, "crash0", store, "--world-size", "3")
    assert summary["ranks_without_dump"] == [2]
    assert "--exit" in summary["hint"]
    assert diagnose("crash0", store)["kind"] == "healthy"


def test_importing_twice_stores_once(tmp_path: Path, store: str) -> None:
    dumps, _ = golden("mismatch", tmp_path)
    first = import_fr(dumps, "twice", store)
    again = import_fr(dumps, "twice", store)
    assert again["records_written"] == 0
    assert again["already_stored"] == first["records_written"] == first["records"]


def test_bad_dumps_are_named_and_the_good_ones_stored(tmp_path: Path, store: str) -> None:
    dumps, _ = golden("hang", tmp_path)
    (dumps / "nccl_trace_rank_3").write_bytes(b"\x80\x04\x95 truncated")
    (dumps / "config.json").write_text('{"lr": 0.1}')
    raw = json.loads(json.dumps(pickle.loads((dumps / "nccl_trace_rank_0").read_bytes())))
    (dumps / "old_rank_4").write_text(json.dumps({**raw, "version": "2.1"}))
    summary = import_fr(dumps, "bad", store, expect=1)
    errors = {Path(e["file"]).name: e["reason"] for e in summary["errors"]}
    assert set(errors) == {"nccl_trace_rank_3", "config.json", "old_rank_4"}
    assert "corrupt pickle" in errors["nccl_trace_rank_3"]
    assert "expected a dict with keys version, pg_config and entries" in errors["config.json"]
    assert "2.3 to 2.10" in errors["old_rank_4"]
    assert summary["ranks"] == [0, 2] and summary["records_written"] > 0
    assert diagnose("bad", store)["culprit_ranks"] == [1]


def test_a_directory_without_dumps_is_an_error(tmp_path: Path, store: str) -> None:
    (tmp_path / "notes.txt").write_text("nothing here\n")
    done = cli("import-fr", str(tmp_path), "--job", "none", "--store", store)
    assert done.returncode == 2
    assert "no Flight Recorder dump" in done.stderr and "1 file(s) skipped" in done.stderr


def test_help_shows_an_example() -> None:
    done = cli("import-fr", "--help")
    assert done.returncode == 0
    assert "tracehound import-fr /shared/fr_dumps --job exp7" in done.stdout


def test_torchs_analyzer_names_no_culprit_on_the_same_dumps(tmp_path: Path) -> None:
    """What `python -m torch.distributed.flight_recorder.fr_trace` makes of the golden dumps
    (Tracehound's verdicts on them are the tests above): it stops on the missing rank of the
    hang, and otherwise fails on gloo's empty pg_config."""
    hang = fr_trace(GOLDEN / "hang" / "dumps")
    assert hang.returncode != 0
    assert "Missing dump files from ranks {1}" in hang.stderr
    partial = fr_trace(GOLDEN / "hang" / "dumps", "--allow-incomplete-ranks")
    assert failed_on_a_dumped_rank(partial, GOLDEN / "hang" / "dumps"), partial.stderr[-2000:]
    mismatch = fr_trace(GOLDEN / "mismatch" / "dumps")
    assert failed_on_a_dumped_rank(mismatch, GOLDEN / "mismatch" / "dumps"), mismatch.stderr
    # It reads pickles only: the JSON crash dumps, as they are and converted.
    crash = fr_trace(GOLDEN / "crash" / "dumps")
    assert crash.returncode != 0 and "UnpicklingError" in crash.stderr
    converted = tmp_path / "crash"
    converted.mkdir()
    for f in (GOLDEN / "crash" / "dumps").iterdir():
        (converted / f.name).write_bytes(pickle.dumps(json.loads(f.read_text())))
    crash2 = fr_trace(converted, "--allow-incomplete-ranks")
    assert failed_on_a_dumped_rank(crash2, converted), crash2.stderr[-2000:]


def make_dumps(scenario: str, outdir: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, str(GOLDEN / "make_dumps.py"), scenario, str(outdir),
                           *args], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


@pytest.mark.e2e
def test_a_fresh_hang_of_the_last_of_four_ranks(tmp_path: Path, store: str) -> None:
    """The last rank freezes: the dumps alone cannot show a fourth rank, --world-size does."""
    run = make_dumps("hang", tmp_path / "dumps", "--world", "4", "--culprit", "3",
                     "--prefix", "fr-")
    assert sorted(run["files"]) == ["fr-0", "fr-1", "fr-2"]
    summary = import_fr(tmp_path / "dumps", "fresh-hang", store, "--world-size", "4")
    assert summary["ranks_without_dump"] == [3]
    verdict = diagnose("fresh-hang", store)
    assert verdict["kind"] == "hang" and verdict["culprit_ranks"] == [3]


@pytest.mark.e2e
def test_a_fresh_crash_with_the_exit_code_the_launcher_saw(tmp_path: Path, store: str) -> None:
    run = make_dumps("crash", tmp_path / "dumps", "--world", "3", "--culprit", "1",
                     "--format", "pickle")
    code = run["exit_codes"]["1"]
    assert code == 3 and sorted(run["files"]) == ["nccl_trace_rank_0", "nccl_trace_rank_2"]
    summary = import_fr(tmp_path / "dumps", "fresh-crash", store, "--exit", f"1={code}")
    assert summary["ranks_without_dump"] == [1]
    verdict = diagnose("fresh-crash", store)
    assert verdict["kind"] == "crash" and verdict["culprit_ranks"] == [1]
