"""Every TRACEHOUND_* variable is documented once, read somewhere, and has its default defined
once, in `tracing.settings`; the values are checked where they are read."""

from __future__ import annotations

import ast
from itertools import pairwise
from pathlib import Path

import pytest

from tracehound.agent.node.daemon import parse_args
from tracehound.tracing import settings
from tracehound.tracing.settings import (
    DEFAULT_BUFFER_RECORDS,
    DEFAULT_HEARTBEAT_S,
    TRACEHOUND_HEARTBEAT_S,
    TRACEHOUND_SINK,
    TRACEHOUND_SPOOL_DIR,
    SettingError,
    env_float,
    env_int,
)

ROOT = Path(settings.__file__).resolve().parent.parent
PACKAGES = ("agent", "tracing", "analysis", "controller", "ui")
SETTINGS = Path(settings.__file__).resolve()
READERS = frozenset({"env_str", "env_int", "env_float", "env_flag", "env_choice", "get", "getenv"})
"""Calls that read an environment variable named by their first argument."""

CARRIERS = {"heartbeat_s": "DEFAULT_HEARTBEAT_S", "bound": "DEFAULT_BUFFER_RECORDS"}
"""Parameters that carry a setting on (a recorder's heartbeat, a transport's buffer): their
default must be the setting's DEFAULT_* constant, not a copy of its value."""

def _documented() -> list[str]:
    """The variables `tracing.settings` declares, each followed by its docstring."""
    body = ast.parse(SETTINGS.read_text()).body
    names = []
    for stmt, after in pairwise(body):
        if (isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name)
                and stmt.targets[0].id.startswith("TRACEHOUND_")):
            assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant), (
                f"{stmt.targets[0].id} has no docstring")
            names.append(stmt.targets[0].id)
    return names


def _sources() -> dict[str, ast.Module]:
    """Every module of the package, by path relative to the repository."""
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[str(path.relative_to(ROOT))] = ast.parse(path.read_text())
    return out


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _named(node: ast.expr) -> str:
    """The variable an argument names: a settings constant, or the variable's name itself."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ""


def _reads(tree: ast.Module) -> set[str]:
    return {
        _named(node.args[0]) for node in ast.walk(tree)
        if isinstance(node, ast.Call) and node.args and _called(node) in READERS
    }


def test_every_documented_variable_is_read_somewhere() -> None:
    documented = _documented()
    assert {"TRACEHOUND_SINK", "TRACEHOUND_SPOOL_DIR", "TRACEHOUND_HEARTBEAT_S"} <= set(documented)
    read = set().union(*(_reads(t) for p, t in _sources().items() if p != "tracing/settings.py"))
    assert [v for v in documented if v not in read] == []


def test_every_variable_read_is_documented() -> None:
    documented = set(_documented())
    read = set().union(*(_reads(t) for t in _sources().values()))
    assert {v for v in read if v.startswith("TRACEHOUND_")} <= documented


def test_readers_pass_the_named_default_never_a_copy_of_its_value() -> None:
    copies = []
    for path, tree in _sources().items():
        for node in ast.walk(tree):
            # A DEFAULT_* constant, or another variable to fall back on; never a number.
            if (isinstance(node, ast.Call) and _called(node) in {"env_int", "env_float"}
                    and node.args and _named(node.args[0]).startswith("TRACEHOUND_")
                    and isinstance(node.args[1] if len(node.args) > 1 else None, ast.Constant)):
                copies.append(f"{path}:{node.lineno}")
    assert copies == []


def _defaults(tree: ast.Module) -> list[tuple[str, ast.expr, int]]:
    """(parameter or field name, its default, line) of every function and class body."""
    out: list[tuple[str, ast.expr, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            positional = args.posonlyargs + args.args
            out += [(a.arg, d, d.lineno) for a, d in
                    zip(positional[len(positional) - len(args.defaults):], args.defaults,
                        strict=True)]
            out += [(a.arg, d, d.lineno) for a, d in zip(args.kwonlyargs, args.kw_defaults,
                                                          strict=True) if d is not None]
        elif isinstance(node, ast.ClassDef):
            out += [(s.target.id, s.value, s.lineno) for s in node.body
                    if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
                    and s.value is not None]
    return out


def _copies() -> dict[tuple[str, str], int]:
    found = {}
    for path, tree in _sources().items():
        for name, default, line in _defaults(tree):
            if name in CARRIERS and isinstance(default, ast.Constant):
                found[(path, name)] = line
    return found


def test_each_default_is_defined_once() -> None:
    """Parameters that carry a setting default to its constant, not to a copy of the value;
    and each DEFAULT_* constant is assigned once, in tracing.settings."""
    assert _copies() == {}
    assigned = [
        (path, target.id) for path, tree in _sources().items() for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name) and target.id in set(CARRIERS.values())
    ]
    assert sorted(assigned) == [("tracing/settings.py", n) for n in sorted(CARRIERS.values())]


def test_defaults_and_bad_values() -> None:
    assert env_float(TRACEHOUND_HEARTBEAT_S, DEFAULT_HEARTBEAT_S, env={}) == DEFAULT_HEARTBEAT_S
    assert env_int("X", DEFAULT_BUFFER_RECORDS, env={"X": ""}) == DEFAULT_BUFFER_RECORDS
    with pytest.raises(SettingError, match=r"TRACEHOUND_HEARTBEAT_S='fast': expected a number, "
                                           r"e\.g\. 0\.5"):
        env_float(TRACEHOUND_HEARTBEAT_S, DEFAULT_HEARTBEAT_S, env={TRACEHOUND_HEARTBEAT_S: "fast"})


def test_the_node_agent_takes_its_sink_and_spool_from_the_environment() -> None:
    base = ["--job", "j", "--node", "n", "--socket", "/tmp/s"]
    env = {TRACEHOUND_SINK: "http://127.0.0.1:9", TRACEHOUND_SPOOL_DIR: "/var/spool/th"}
    args = parse_args(base, env=env)
    assert (args.sink, args.spool) == ("http://127.0.0.1:9", "/var/spool/th")
    args = parse_args([*base, "--sink", "clickhouse://h:9000/db", "--spool", "/d"], env=env)
    assert (args.sink, args.spool) == ("clickhouse://h:9000/db", "/d")


def test_the_node_agent_needs_a_sink_and_a_spool_one_way_or_the_other(
        capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--job", "j", "--node", "n", "--socket", "/tmp/s"]
    with pytest.raises(SystemExit):
        parse_args([*base, "--spool", "/d"], env={})
    assert "--sink is required unless TRACEHOUND_SINK is set" in capsys.readouterr().err
