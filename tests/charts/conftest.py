"""Fixtures of the chart tests: the chart rendered offline (real helm) with its default values
and with `custom-values.yaml`; makes `chart_harness` importable under pytest's importlib mode."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chart_harness import CHART, CUSTOM_VALUES, Helm, Rendered, find_helm


@pytest.fixture(scope="session")
def helm() -> Helm:
    return Helm(find_helm())


@pytest.fixture(scope="session")
def default_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


@pytest.fixture(scope="session")
def custom_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(CUSTOM_VALUES.read_text())
    return values


@pytest.fixture(scope="session")
def default_render(helm: Helm) -> Rendered:
    return helm.template()


@pytest.fixture(scope="session")
def custom_render(helm: Helm) -> Rendered:
    return helm.template("-f", str(CUSTOM_VALUES))


@pytest.fixture(params=["default", "custom"])
def render(request: pytest.FixtureRequest) -> Iterator[Rendered]:
    """Each test that takes it runs once with the default values and once with the custom ones."""
    yield request.getfixturevalue(f"{request.param}_render")
