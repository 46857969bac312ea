"""The confidence scale: its levels, its arithmetic, and that every detector states its
confidence on it rather than as a bare number."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

from tracehound.analysis import confidence as scale
from tracehound.analysis.confidence import (
    CERTAIN,
    LEVELS,
    LIKELY,
    STEP,
    STRONG,
    TYPICAL,
    UNSURE,
    WEAK,
    between,
    level_of,
    nudged,
    raised,
)
from tracehound.tracing.events import IncidentKind

ANALYSIS = Path(scale.__file__).parent


def test_levels_run_from_certain_down_to_unsure() -> None:
    assert [lv.floor for lv in LEVELS] == [CERTAIN, STRONG, LIKELY, WEAK, UNSURE]
    assert all(a.floor > b.floor for a, b in pairwise(LEVELS))
    assert all(lv.meaning for lv in LEVELS)


@pytest.mark.parametrize(("value", "name"), [
    (0.97, "certain"), (CERTAIN, "certain"), (0.9, "strong"), (STRONG, "strong"),
    (0.8, "likely"), (LIKELY, "likely"), (0.6, "weak"), (WEAK, "weak"), (0.45, "unsure"),
    (UNSURE, "unsure"), (0.1, "unsure"),
])
def test_a_confidence_belongs_to_the_highest_level_it_reaches(value: float, name: str) -> None:
    assert level_of(value).name == name


def test_between_interpolates_and_clips() -> None:
    assert between(LIKELY, CERTAIN, 0.0) == LIKELY
    assert between(LIKELY, CERTAIN, 1.0) == CERTAIN
    assert between(LIKELY, CERTAIN, 0.5) == 0.825
    assert between(LIKELY, CERTAIN, 7.0) == CERTAIN
    assert between(LIKELY, CERTAIN, -1.0) == LIKELY


def test_a_nudge_is_one_step_and_never_leaves_the_scale() -> None:
    assert nudged(STRONG) == round(STRONG + STEP, 3)
    assert nudged(CERTAIN) == CERTAIN
    assert nudged(UNSURE, -1) == UNSURE
    assert nudged(LIKELY, -2) == round(LIKELY - 2 * STEP, 3)


def test_raised_is_the_next_level_up() -> None:
    assert raised(LIKELY) == STRONG
    assert raised(STRONG) == CERTAIN
    assert raised(CERTAIN) == CERTAIN
    assert raised(0.6) == LIKELY


def test_every_kind_has_a_typical_confidence_on_a_level() -> None:
    assert set(TYPICAL) == set(IncidentKind)
    assert {level_of(c).floor for c in TYPICAL.values()} <= {lv.floor for lv in LEVELS}
    assert all(c == level_of(c).floor for c in TYPICAL.values())


def _literals(value: ast.expr) -> list[int]:
    """Lines of the number literals a confidence expression can evaluate to (or is computed
    from), leaving out conditions: `STRONG if ratio >= 2.0 else LIKELY` has none."""
    if isinstance(value, ast.Constant):
        return [value.lineno] if isinstance(value.value, float) else []
    if isinstance(value, ast.IfExp):
        return _literals(value.body) + _literals(value.orelse)
    if isinstance(value, ast.BinOp):
        return _literals(value.left) + _literals(value.right)
    if isinstance(value, ast.Call):
        return [line for arg in value.args for line in _literals(arg)]
    return []


def _bare_confidences(tree: ast.AST) -> list[int]:
    """Lines where a number literal is assigned to, or passed as, a confidence."""
    found: list[int] = []
    for node in ast.walk(tree):
        values: list[ast.expr] = []
        if isinstance(node, ast.keyword) and node.arg == "confidence":
            values.append(node.value)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = any(isinstance(t, ast.Name) and t.id == "confidence" for t in targets)
            if named and node.value is not None:
                values.append(node.value)
        for value in values:
            found += _literals(value)
    return found


@pytest.mark.parametrize("path", sorted(p.name for p in ANALYSIS.glob("*.py")))
def test_detectors_state_confidence_on_the_scale_not_as_bare_numbers(path: str) -> None:
    tree = ast.parse((ANALYSIS / path).read_text())
    assert _bare_confidences(tree) == [], f"{path}: use a level of analysis.confidence"
