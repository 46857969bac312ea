"""`tracehound simulate` writes a simulated job to a real store; `tracehound diagnose` reads it back
through the store's SQL summaries and names the injected culprit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tracehound.controller.cli", *args],
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize(("fault", "seed"), [("straggler", 3), ("hang", 5), ("mismatch", 2)])
def test_simulated_fault_is_diagnosed_from_the_store(
    tmp_path: Path, fault: str, seed: int
) -> None:
    store = f"chdb://{tmp_path / 'store'}"
    wrote = cli("simulate", "--ranks", "256", "--fault", fault, "--seed", str(seed),
                "--job-id", "sim", "--store", store, "--json")
    assert wrote.returncode == 0, wrote.stderr
    truth = json.loads(wrote.stdout)["truth"]
    assert truth["kind"] == fault
    diag = cli("diagnose", "--job", "sim", "--store", store, "--json")
    assert diag.returncode == 0, diag.stderr
    verdict = json.loads(diag.stdout)
    if truth["variant"] == "compute_stuck":
        # Stuck in computation while reporting: busy, a stall until the busy grace has passed.
        assert verdict["kind"] == "stall"
    else:
        assert verdict["kind"] == fault
    assert verdict["culprit_ranks"][0] in truth["culprit_ranks"]
    assert verdict["culprit_nodes"][0] in truth["culprit_nodes"]
    assert verdict["evidence"]
    text = cli("diagnose", "--job", "sim", "--store", store)
    assert f"rank {verdict['culprit_ranks'][0]}" in text.stdout


def test_healthy_simulation_stays_healthy(tmp_path: Path) -> None:
    store = f"chdb://{tmp_path / 'store'}"
    assert cli("simulate", "--ranks", "128", "--fault", "healthy", "--seed", "1",
               "--job-id", "ok", "--store", store).returncode == 0
    verdict = json.loads(cli("diagnose", "--job", "ok", "--store", store, "--json").stdout)
    assert verdict["kind"] == "healthy"


def test_unknown_fault_class_is_a_clear_error(tmp_path: Path) -> None:
    proc = cli("simulate", "--ranks", "64", "--fault", "gremlins", "--store",
               f"chdb://{tmp_path / 's'}")
    assert proc.returncode == 2
    assert "gremlins" in proc.stderr and "straggler" in proc.stderr


def test_clock_skew_and_conditions_are_chosen_on_the_command_line(tmp_path: Path) -> None:
    """A crash on nodes whose clocks are N(0, 20 ms) apart is still put on the rank that died
    first, from the trace's own clock estimate; --lab and a bad --skew-ms are understood."""
    store = f"chdb://{tmp_path / 'store'}"
    wrote = cli("simulate", "--ranks", "128", "--fault", "crash", "--seed", "4", "--skew-ms",
                "20", "--job-id", "skewed", "--store", store, "--json")
    assert wrote.returncode == 0, wrote.stderr
    written = json.loads(wrote.stdout)
    assert written["conditions"] == "field"
    verdict = json.loads(cli("diagnose", "--job", "skewed", "--store", store, "--json").stdout)
    assert verdict["kind"] == "crash"
    assert verdict["culprit_ranks"][0] in written["truth"]["culprit_ranks"]
    lab = cli("simulate", "--ranks", "64", "--fault", "healthy", "--lab", "--job-id", "lab",
              "--store", store, "--json")
    assert lab.returncode == 0, lab.stderr
    assert json.loads(lab.stdout)["conditions"] == "lab"
    bad = cli("simulate", "--ranks", "64", "--fault", "healthy", "--skew-ms", "-3", "--store",
              store)
    assert bad.returncode == 2 and "--skew-ms" in bad.stderr
