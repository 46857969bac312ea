"""Each package's `__init__` is its public face: every name in `__all__` resolves, and importing
the base layer stays light (no numpy, no torch) because training processes import it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = [
    "tracehound.tracing", "tracehound.tracing.store", "tracehound.agent",
    "tracehound.analysis", "tracehound.analysis.sim", "tracehound.controller", "tracehound.ui",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_exported_name_resolves(name: str) -> None:
    package = importlib.import_module(name)
    exported = package.__all__
    assert len(exported) == len(set(exported))
    for attribute in exported:
        assert getattr(package, attribute) is not None, f"{name}.{attribute}"


def test_the_base_layer_imports_without_numpy_or_torch() -> None:
    code = ("import sys, tracehound.tracing, tracehound.tracing.store, tracehound.agent; "
            "print(sorted(m for m in ('numpy', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
