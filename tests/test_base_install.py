"""`pip install tracehound` without extras, into a training image's Python: a fresh virtualenv
with only the pinned CPU torch installed first (as an image brings its own torch), then this
project with no extras. It must not pull in the control plane's heavy parts (streamlit, kopf,
kubernetes), and it must be enough to record a real 2-rank gloo job under `tracehound instrument
-- torchrun ...` and diagnose it; `tracehound ui` and `tracehound operator` then name the extra
they need and exit with status 2.

It installs from the pip cache `make setup` filled (about a minute here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
JOB = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for _ in range(20):
    dist.all_reduce(torch.ones(4))
dist.destroy_process_group()
"""


def test_the_base_install_records_and_diagnoses_and_names_missing_extras(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: byte-compiling all of torch and the dependencies at install took 30 of
    # the 49 CPU seconds of the two installs here; what the job imports is compiled on import
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    subprocess.run([*pip, "torch==2.13.0"], check=True, timeout=900)
    subprocess.run([*pip, str(REPO)], check=True, timeout=900)
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format",
                             "json"], check=True, capture_output=True, text=True).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert {"tracehound", "torch", "chdb", "clickhouse-driver"} <= installed
    assert not installed & {"streamlit", "kopf", "kubernetes"}, installed
    tracehound = str(venv / "bin" / "tracehound")
    store = f"chdb://{tmp_path / 'store'}"
    script = tmp_path / "job.py"
    script.write_text(JOB)
    done = subprocess.run(
        [tracehound, "instrument", "--job", "base", "--store", store, "--",
         str(venv / "bin" / "torchrun"), "--nproc-per-node", "2", str(script)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    diagnosed = subprocess.run([tracehound, "diagnose", "--job", "base", "--store", store,
                                "--json"], capture_output=True, text=True, timeout=300,
                               check=False)
    assert diagnosed.returncode == 0, diagnosed.stderr[-2000:]
    verdict = json.loads(diagnosed.stdout)
    assert verdict["kind"] == "healthy" and verdict["ranks_seen"] == 2, verdict
    for command, extra in (("ui", "ui"), ("operator", "kubernetes")):
        refused = subprocess.run([tracehound, command, "--store", store], capture_output=True,
                                 text=True, timeout=120, check=False)
        assert refused.returncode == 2, (command, refused.stderr)
        assert f"pip install 'tracehound[{extra}]'" in refused.stderr, refused.stderr
