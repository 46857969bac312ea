"""Makes `agent_harness` (real node agents, real gloo jobs, an in-test ingest endpoint) importable
by the agent tests under pytest's importlib import mode."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
