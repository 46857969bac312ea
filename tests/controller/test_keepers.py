"""The local orchestrator's snapshot keepers: started per node, kept, taken over, and none left.

The keepers are real processes (`python -m tracehound.agent.node.keeper`) on loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tracehound.controller.orchestrators.keepers import NodeKeepers, answers
from tracehound.tracing.ids import NodeId


def test_keepers_are_kept_taken_over_and_none_is_left(tmp_path: Path) -> None:
    first = NodeKeepers(tmp_path)
    listed = first.ensure([NodeId("node-0"), NodeId("node-1")])
    urls = dict(item.split("=", 1) for item in listed.split(","))
    assert all(answers(u) for u in urls.values())
    assert first.ensure([NodeId("node-0")]) == f"node-0={urls['node-0']}"  # kept, not restarted
    # a controller started again takes over what the first noted
    second = NodeKeepers(tmp_path)
    assert second.ensure([NodeId("node-0"), NodeId("node-1")]) == listed
    # a keeper started by a controller killed before it noted it
    orphan = subprocess.Popen([sys.executable, "-m", "tracehound.agent.node.keeper", "--node",
                               "node-9", "--port-file", str(tmp_path / "keepers" / "node-9.addr")])
    deadline = time.monotonic() + 30
    while not (tmp_path / "keepers" / "node-9.addr").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    second.drop(NodeId("node-1"))
    assert not answers(urls["node-1"])
    assert [k["node"] for k in json.loads((tmp_path / "keepers.json").read_text())] == ["node-0"]
    second.close()
    assert orphan.wait(timeout=10) == 0  # SIGTERM: it stops cleanly
    assert not answers(urls["node-0"])
