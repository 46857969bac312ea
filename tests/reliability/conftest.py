"""Faults injected into Tracehound's own parts (the store, node agents, the ingest endpoint, the
controller, the spool's disk, a flooding rank), each checked by counts. Puts this directory on
sys.path for its shared harness modules: the suite runs with `--import-mode=importlib`, which
puts no test directory on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
