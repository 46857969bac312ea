"""A warm spare: a Python process that has imported torch (and the training script's heavy
modules) and waits to become a rank of the next attempt.

A restart that spawns fresh processes pays, on every rank, for starting the interpreter and
importing torch and whatever the script imports, seconds of CPU each, before process-group setup
can even begin. `controller.local.LocalOrchestrator` keeps one spare per rank ready instead, and
a restart hands each spare its rank:

    python -m tracehound.agent.rank.warmspare --script train.py [--preload mod,...]

reads one JSON line on stdin, `{"argv": [...], "env": {...}, "cwd": "...", "log": "..."}`,
takes that environment (the one a freshly spawned rank would get), sends its output to `log`,
installs the recorder as the bootstrap would have at interpreter start, and runs the script as
`__main__` with `argv`. Its exit status is the script's. End of input before an assignment (the
orchestrator closed the spare, or died) ends the spare quietly, so spares never outlive it.

What is imported while waiting: torch and the parts of it a DDP script uses, the recorder, and
the absolute imports at the top level of the script that do not name a module beside it (those
are the user's own and may read the rank's environment at import). A module that fails to
import is skipped (the script will meet the same error itself) and counted in the spare's log.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

BASE_PRELOAD = (
    "torch",
    "torch.nn",
    "torch.optim",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.checkpoint",
    "tracehound.agent.rank.autoinstall",
    "tracehound.agent.rank.hooks",
    "tracehound.agent.rank.recorder",
    "tracehound.agent.rank.transport",
    "tracehound.agent.rank.checkpoint",
)
"""What every spare imports while it waits, whatever the script."""


def script_imports(script: Path) -> list[str]:
    """The absolute imports at the top level of `script` (also inside top-level `try` and `if`
    blocks), minus modules that live beside it; [] when the script cannot be read or parsed."""
    try:
        tree = ast.parse(script.read_bytes(), filename=str(script))
    except (OSError, SyntaxError, ValueError):
        return []
    here = script.resolve().parent
    names: list[str] = []
    body = list(tree.body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, (ast.Try, ast.If)):
            body[:0] = [*node.body, *node.orelse]
    local = {p.stem for p in here.glob("*.py")} | {p.name for p in here.iterdir() if p.is_dir()}
    seen: set[str] = set()
    kept = []
    for name in names:
        if name.split(".")[0] in local or name in seen or name == "__future__":
            continue
        seen.add(name)
        kept.append(name)
    return kept


def preload(names: list[str]) -> tuple[int, list[str]]:
    """Import `names`; how many were imported and which failed (with why)."""
    done, failed = 0, []
    for name in names:
        try:
            importlib.import_module(name)
            done += 1
        except (Exception, SystemExit) as exc:  # a spare waits whatever a module does
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    return done, failed


def _take_output(log: str) -> None:
    """Send this process's stdout and stderr (the file descriptors, so native code's output too)
    to `log`, appending."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _become(assignment: dict[str, Any], script: str) -> None:
    """Take the rank's environment, output, working directory and arguments."""
    env = assignment["env"]
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in env.items()})
    if assignment.get("log"):
        _take_output(str(assignment["log"]))
    if assignment.get("cwd"):
        os.chdir(assignment["cwd"])
    sys.argv = [script, *(str(a) for a in assignment.get("argv", []))]
    sys.path[0] = str(Path(script).resolve().parent)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tracehound.agent.rank.warmspare",
        description="Import torch and a training script's heavy modules, then wait on stdin for "
                    "the rank to become (started by tracehound run, not by hand).",
    )
    parser.add_argument("--script", required=True, help="the training script it will run")
    parser.add_argument("--preload", default="",
                        help="more modules to import while waiting, comma-separated")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    extra = [m for m in args.preload.split(",") if m]
    names = list(dict.fromkeys([*BASE_PRELOAD, *script_imports(Path(args.script)), *extra]))
    done, failed = preload(names)
    print(f"warm spare {os.getpid()}: {done} modules imported in "
          f"{time.monotonic() - started:.2f} s; waiting for a rank", flush=True)
    for failure in failed:
        print(f"warm spare {os.getpid()}: could not import {failure}", flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # closed before an assignment
    try:
        assignment = json.loads(line)
        if not isinstance(assignment, dict) or not isinstance(assignment.get("env"), dict):
            raise ValueError("expected an object with an env object")
    except ValueError as exc:
        print(f"warm spare {os.getpid()}: unreadable assignment ({exc}): {line[:200]!r}",
              file=sys.stderr, flush=True)
        return 2
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    _become(assignment, args.script)
    from tracehound.agent.rank import autoinstall

    autoinstall.install(dict(os.environ))
    runpy.run_path(args.script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
