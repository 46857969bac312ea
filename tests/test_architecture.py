"""The import contracts (pyproject's [tool.importlinter], checked by `lint-imports` in `make
test`) cover every module: a module added to a package cannot escape them by not being listed.

Contracts whose source is a whole package cover its new modules by themselves; these check the
ones that name modules one by one: the diagnosis modules that must never import the simulator,
the controller's layers, and where the agent's code runs."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path
from typing import Any

import tracehound.agent
import tracehound.analysis
import tracehound.controller

ROOT = Path(__file__).resolve().parents[1]


def contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return found


def contract(words: str) -> dict[str, Any]:
    (found,) = [c for c in contracts() if words in c["name"]]
    return found


def children(package: Any) -> set[str]:
    return {f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)}


def test_every_diagnosis_module_is_held_away_from_the_simulator() -> None:
    listed = set(contract("never imports the job simulator")["source_modules"])
    modules = children(tracehound.analysis) - {"tracehound.analysis.sim"}
    assert modules - listed == set(), "add them to the contract in pyproject.toml"
    assert listed - modules == set(), "modules the contract names that do not exist"


def test_every_controller_package_has_its_layer() -> None:
    layers = contract("controller by concern")["layers"]
    listed = {name.strip() for layer in layers for name in layer.split("|")}
    assert children(tracehound.controller) == listed


def test_every_part_of_the_agent_says_where_it_runs() -> None:
    rank = set(contract("inside the training process")["source_modules"])
    node = set(contract("node daemon uses")["layers"])
    assert children(tracehound.agent) == rank | node
