"""`tracehound watch` as a command: it stops cleanly (status 0) on SIGTERM and Ctrl-C, and bad
input gets a message naming the input and what was expected, and a status of 2, before
anything is watched. A glob matching no job is said, and the watcher keeps looking."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracehound.tracing.events import JobPhase, JobState
from tracehound.tracing.store import open_store


def watch(*args: str) -> list[str]:
    return [sys.executable, "-m", "tracehound.controller.cli", "watch", *args]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRACEHOUND_")}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(watch(*args), capture_output=True, text=True, env=env(), timeout=300,
                          check=False)


def started(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[str], Path]:
    out = tmp_path / "watch.out"
    with open(out, "w") as sink:
        proc = subprocess.Popen(watch(*args), stdout=sink, stderr=subprocess.PIPE, text=True,
                                env=env())
    return proc, out


def first_event(proc: subprocess.Popen[str], out: Path) -> dict[str, object]:
    """The first JSON line the watcher printed (waiting until it has printed one)."""
    while not out.read_text().strip():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    return json.loads(out.read_text().splitlines()[0])  # type: ignore[no-any-return]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_watcher_with_status_0_saying_the_jobs_run_on(
        tmp_path: Path, sig: signal.Signals) -> None:
    proc, out = started(tmp_path, "--job", "exp7", "--store", f"chdb://{tmp_path / 'store'}",
                        "--workdir", str(tmp_path / "w"), "--json")
    waiting = first_event(proc, out)
    assert waiting["event"] == "waiting" and waiting["job"] == "exp7"
    assert "job exp7 has no records" in str(waiting["reason"])
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    last = json.loads(out.read_text().splitlines()[-1])
    assert last["event"] == "stopped" and "signal" in last["reason"]


def test_a_glob_matching_no_job_is_said_once_and_the_watcher_keeps_looking(
        tmp_path: Path) -> None:
    store = open_store(f"chdb://{tmp_path / 'store'}")
    store.record_state(JobState(job="dev-1", time_us=1, seq=1, state=JobPhase.FINISHED,
                                attempt=0, controller="h:1"))
    store.close()
    proc, out = started(tmp_path, "--jobs", "prod-*", "--store", f"chdb://{tmp_path / 'store'}",
                        "--workdir", str(tmp_path / "w"), "--poll", "0.2")
    first = out
    while "waiting" not in first.read_text():
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0
    text = out.read_text()
    assert "no job in chdb://" in text and "matches 'prod-*' yet (jobs there: dev-1); waiting " \
                                          "for one to report" in text
    assert text.count("matches 'prod-*'") == 1


def test_an_unreachable_store_is_named(tmp_path: Path) -> None:
    done = run("--job", "j", "--store", "clickhouse://default:secret@127.0.0.1:1/nope",
               "--workdir", str(tmp_path))
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tracehound watch: ClickHouse at clickhouse://default:***@127.0.0.1:1"
                           "/nope is unreachable")
    assert "secret" not in done.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["--jobs", "p*", "--slurm-job", "5"], "--slurm-job names the Slurm job of one --job J"),
    (["--job", "j", "--on-incident", " "], "--on-incident: the command is empty; expected a "
                                           "shell command"),
    (["--job", "j", "--on-incident", "true", "--on-incident-timeout", "0"],
     "--on-incident-timeout must be a positive number of seconds, got 0"),
    (["--job", "j", "--poll", "-1"], "--poll must be a positive number of seconds, got -1"),
    (["--job", "j", "--hang-after", "0"], "--hang-after must be a positive number of seconds"),
])
def test_bad_options_are_named_with_what_was_expected(tmp_path: Path, args: list[str],
                                                      says: str) -> None:
    done = run(*args, "--store", f"chdb://{tmp_path / 'store'}", "--workdir", str(tmp_path))
    assert done.returncode == 2 and says in done.stderr, done.stderr


def test_slurm_actions_that_cannot_work_are_an_error_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "no-scontrol-here"
    done = run("--job", "j", "--slurm", "--scontrol", str(missing), "--store",
               f"chdb://{tmp_path / 'store'}", "--workdir", str(tmp_path))
    assert done.returncode == 2
    # without the scontrol module this installation says so; with it, scontrol's own check
    # names the command that is missing
    assert ("--slurm needs tracehound.controller.actions.scontrol" in done.stderr
            or ("--slurm: " in done.stderr and str(missing) in done.stderr)), done.stderr


def test_a_job_another_controller_supervises_is_not_watched(tmp_path: Path) -> None:
    store = open_store(f"chdb://{tmp_path / 'store'}")
    store.record_state(JobState(job="exp7", time_us=1, seq=1, state=JobPhase.RUNNING,
                                attempt=0, controller="gpu-host:4242"))
    store.close()
    done = run("--job", "exp7", "--store", f"chdb://{tmp_path / 'store'}", "--workdir",
               str(tmp_path))
    assert done.returncode == 2
    assert ("tracehound watch: job exp7 is not watched: controller gpu-host:4242 supervises it "
            "(state running, attempt 0)") in done.stderr


def test_help_teaches_the_json_keys_the_actions_and_the_exit_status() -> None:
    done = subprocess.run(watch("--help"), capture_output=True, text=True, check=True,
                          timeout=120)
    text = " ".join(done.stdout.split())
    for words in ('{"job", "incident", "kind", "culprit_ranks", "culprit_nodes", "confidence", '
                  '"summary"}', "TRACEHOUND_INCIDENT_JOB", "scontrol requeue JOBID",
                  "--slurm-job ID", "Ctrl-C or SIGTERM stops the watcher at once with status 0",
                  "exited", "stopped reporting", "tracehound watch --jobs 'prod-*'"):
        assert words in text, words
