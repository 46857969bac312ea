"""Decisions and actions: launching and supervising jobs, recovery policy, incidents, the CLI.

The controller acts on verdicts the analysis returns; it never diagnoses by itself. Nothing
imports it. Its public face: `Supervisor` (with `JobSpec`, `SupervisorSettings`, `RunResult`)
watches one job and acts on verdicts under a `PolicySettings` (per verdict kind, when to act,
isolate or watch); `diagnose_stored` explains a stored job; `main` is the `tracehound` command.
They load on first use, so that importing one controller module does not import them all.
"""

from __future__ import annotations

import importlib
from typing import Any

_FACE = {
    "JobSpec": "supervision.supervisor",
    "Supervisor": "supervision.supervisor",
    "SupervisorSettings": "supervision.supervisor",
    "RunResult": "supervision.supervisor",
    "PolicySettings": "policy.recovery",
    "KindRule": "policy.recovery",
    "plan_recovery": "policy.recovery",
    "diagnose_stored": "cli.explain",
    "format_verdict": "cli.explain",
    "main": "cli.main",
}

__all__ = [
    "JobSpec",
    "KindRule",
    "PolicySettings",
    "RunResult",
    "Supervisor",
    "SupervisorSettings",
    "diagnose_stored",
    "format_verdict",
    "main",
    "plan_recovery",
]



def __getattr__(name: str) -> Any:
    module = _FACE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
