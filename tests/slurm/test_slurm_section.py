"""The Slurm batch script users read is the one the tests run: the `bash` block of README.md's
"Under Slurm" section is examples/slurm/train.sbatch, byte for byte
(tests/slurm/test_train_sbatch.py submits that file to a real cluster)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
HEADING = "### Under Slurm"


def script_in(page: str) -> str:
    """The first ```bash block after the section's heading."""
    assert HEADING in page, f"the page lost its section {HEADING!r}"
    section = page.split(HEADING, 1)[1]
    found = re.search(r"^```bash\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert found is not None, f"the section {HEADING!r} holds no ```bash block"
    return found.group(1)


def test_the_script_shown_is_the_script_tested() -> None:
    shown = script_in((REPO / "README.md").read_text())
    assert shown == SCRIPT.read_text(), f"README.md: update its script from {SCRIPT}"


def test_the_agents_step_is_stopped_by_the_name_it_was_started_with() -> None:
    # the script finds the agents' step by its name to send it SIGTERM; a name changed in one
    # place only would leave the agents to be killed at the job's end, with records unshipped
    text = SCRIPT.read_text()
    started = re.findall(r"--job-name=(\S+) tracehound agent &", text)
    stopped = re.findall(r"awk '\$2 == \"([^\"]+)\"", text)
    assert started == stopped == ["tracehound-agent"]
