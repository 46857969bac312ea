"""Warm spares: processes that imported torch before a restart become the next attempt's ranks.

Real processes: the local orchestrator starts real spares (`python -m
tracehound.agent.rank.warmspare`) that import torch, and hands them ranks of a second attempt of a
small script."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tracehound.agent.rank.warmspare import script_imports
from tracehound.controller.orchestrators.local import LocalOrchestrator
from tracehound.controller.orchestrators.port import AttemptPlan
from tracehound.tracing.ids import JobId, NodeId

SCRIPT = '''\
import os
import sys
import json

import torch

import helper_beside_me  # a module beside the script: never imported by a spare

rank = int(os.environ["RANK"])
print("ran", json.dumps({"rank": rank, "argv": sys.argv[1:], "main": __name__,
                         "attempt": os.environ["TRACEHOUND_ATTEMPT"],
                         "torch_before": "torch" in sys.modules,
                         "threads": torch.get_num_threads(), "cwd": os.getcwd(),
                         "path0": sys.path[0]}), flush=True)
sys.exit(3 if rank == 1 else 0)
'''


def test_script_imports_are_the_top_level_absolute_ones_not_beside_the_script(
        tmp_path: Path) -> None:
    (tmp_path / "mine.py").write_text("")
    (tmp_path / "pkg").mkdir()
    script = tmp_path / "train.py"
    script.write_text(
        "from __future__ import annotations\nimport os, numpy.linalg\nimport mine\n"
        "from pkg import thing\nfrom . import rel\ntry:\n    import yaml\nexcept ImportError:\n"
        "    pass\nif True:\n    from json import dumps\ndef f():\n    import never_top\n"
    )
    assert script_imports(script) == ["os", "numpy.linalg", "yaml", "json"]
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert script_imports(broken) == []


def _exits(orch: LocalOrchestrator, count: int, timeout_s: float = 120.0) -> dict[int, int]:
    codes: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(codes) < count and time.monotonic() < deadline:
        codes.update({e.rank: e.exit_code for e in orch.poll_exits()})
        time.sleep(0.05)
    return codes


@pytest.mark.e2e
def test_a_restart_hands_its_ranks_to_warm_spares(tmp_path: Path) -> None:
    scripts = tmp_path / "src"
    scripts.mkdir()
    script = scripts / "train.py"
    script.write_text(SCRIPT)
    (scripts / "helper_beside_me.py").write_text("")
    orch = LocalOrchestrator(workdir=tmp_path / "work", sink="http://127.0.0.1:9/ingest",
                             warm_spares=True, spare_delay_s=0.0)
    try:
        def plan(attempt: int) -> AttemptPlan:
            return AttemptPlan(job=JobId("warm"), attempt=attempt, nodes=(NodeId("n0"),),
                               nproc_per_node=2,
                               command=(sys.executable, str(script), "--lr", "0.1"))

        first = orch.launch(plan(0))
        assert (first.cold, first.warm) == (2, 0)
        assert _exits(orch, 2) == {0: 0, 1: 3}
        orch.finish()
        # the spares for the next attempt, started right after the first launch
        logs = tmp_path / "work" / "logs" / "spares"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum(
                "waiting for a rank" in p.read_text() for p in logs.glob("*.log")) < 2:
            time.sleep(0.1)
        second = orch.launch(plan(1))
        assert (second.warm, second.cold) == (2, 0)
        assert _exits(orch, 2) == {0: 0, 1: 3}  # the script's own exit status, rank by rank
        orch.finish()
    finally:
        orch.close()
    for rank in (0, 1):
        out = (tmp_path / "work" / "logs" / "attempt-1" / f"rank-{rank}.log").read_text()
        line = next(x for x in out.splitlines() if x.startswith("ran "))
        ran = json.loads(line[4:])
        assert ran["rank"] == rank and ran["argv"] == ["--lr", "0.1"]
        assert ran["main"] == "__main__" and ran["attempt"] == "1"
        assert ran["torch_before"] is True  # imported while it waited
        assert ran["threads"] == 1  # OMP_NUM_THREADS of the rank's environment
        assert ran["path0"] == str(scripts)
    spare_logs = "".join(p.read_text() for p in (tmp_path / "work" / "logs" / "spares").glob("*"))
    assert "could not import" not in spare_logs
    # close() ended the spares started after the second launch: none is left waiting
    assert not orch._spares
