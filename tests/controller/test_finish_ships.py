"""A job that ended by itself: its node agents are stopped only once their spools are shipped
(or nothing ships any more), since no later agent would ship them (real spool files; the
agents' shipping is played by removing them)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from tracehound.agent.node.spool import waiting_segments
from tracehound.controller.orchestrators.local import LocalOrchestrator


def spooled(workdir: Path, node: str, numbers: range) -> list[Path]:
    spool = workdir / "spool" / node
    (spool / "rejected").mkdir(parents=True, exist_ok=True)
    (spool / "rejected" / "seg-0000000099.seg").write_text("{}\n")  # refused for good
    paths = [spool / f"seg-{n:010d}.seg" for n in numbers]
    for path in paths:
        path.write_text("{}\n")
    return paths


def test_finish_waits_while_the_spools_shrink(tmp_path: Path) -> None:
    orch = LocalOrchestrator(workdir=tmp_path / "job", sink="http://127.0.0.1:9/")
    paths = spooled(orch.workdir, "node-0", range(1, 4)) + spooled(orch.workdir, "node-1",
                                                                    range(1, 3))
    assert waiting_segments(orch.workdir / "spool") == 5

    def ship() -> None:
        for path in paths:
            time.sleep(0.3)
            path.unlink()

    shipper = threading.Thread(target=ship)
    shipper.start()
    orch.finish()
    shipper.join()
    assert waiting_segments(orch.workdir / "spool") == 0


def test_finish_gives_up_when_nothing_ships(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    orch = LocalOrchestrator(workdir=tmp_path / "job", sink="http://127.0.0.1:9/")
    spooled(orch.workdir, "node-0", range(1, 3))
    with caplog.at_level(logging.WARNING):
        orch._ship_spools(stalled_s=0.5)
    assert waiting_segments(orch.workdir / "spool") == 2
    assert "2 spooled segment(s) not shipped" in caplog.text
