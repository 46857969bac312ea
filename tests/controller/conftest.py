"""Puts this directory on sys.path for the shared `run_harness`: the suite runs with
`--import-mode=importlib`, which puts no test directory on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
