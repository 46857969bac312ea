"""`tracehound bundle --into DIR`: the recorder as files another image's Python can import.

The Kubernetes operator runs this in an init container of Tracehound's image, into a volume the
trainer container mounts, so a user's image gets the recorder with no change to it:

    DIR/bootstrap/sitecustomize.py   installs the recorder at interpreter start
    DIR/site/tracehound/agent, tracehound/tracing, msgspec, typing_extensions

The trainer puts `DIR/bootstrap:DIR/site` on PYTHONPATH. msgspec is a compiled extension: the
user's Python must have the same version and ABI as this image's (CPython 3.11 on linux); if it
does not, the import fails in the bootstrap, which says so on stderr and lets the job run
untraced. It never touches anything outside DIR.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("tracehound.agent", "tracehound.tracing", "msgspec", "typing_extensions")
"""What the recorder imports beyond the standard library (checked by the bundle tests)."""


def _source(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise RuntimeError(f"{name} is not installed in {sys.executable}")
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin is None:
        raise RuntimeError(f"{name} has no file to copy")
    return Path(spec.origin)


def _copy(src: Path, dest: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "examples"))
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)


def write_bundle(into: Path) -> dict[str, Any]:
    """Copy the recorder into `into`; what was written."""
    site, bootstrap = into / "site", into / "bootstrap"
    written = []
    for name in PACKAGES:
        src = _source(name)
        dest = site.joinpath(*name.split(".")) if src.is_dir() else site / src.name
        _copy(src, dest)
        written.append(str(dest))
    _copy(_source("tracehound.agent._bootstrap") / "sitecustomize.py",
          bootstrap / "sitecustomize.py")
    return {"into": str(into), "pythonpath": f"{bootstrap}{os.pathsep}{site}",
            "copied": written, "python": f"{sys.version_info.major}.{sys.version_info.minor}"}


def check_bundle(into: Path, python: str = sys.executable) -> str:
    """Import the recorder from the bundle alone (no site-packages); '' when it works, else
    what the interpreter said."""
    env = {"PYTHONPATH": f"{into / 'bootstrap'}{os.pathsep}{into / 'site'}",
           "PATH": os.environ.get("PATH", "")}
    done = subprocess.run(
        [python, "-S", "-c",
         "import tracehound.agent.rank.autoinstall, tracehound.agent.rank.recorder"],
        env=env, capture_output=True, text=True, check=False)
    return "" if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bundle", help="copy the recorder into a directory another image can import it from",
        description=__doc__.split("\n\n", 1)[0] if __doc__ else None,
        epilog="example (the operator's init container):\n"
               "  tracehound bundle --into /opt/tracehound\n"
               "then run the training with PYTHONPATH=/opt/tracehound/bootstrap:"
               "/opt/tracehound/site",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--into", type=Path, required=True, metavar="DIR")
    p.add_argument("--no-check", action="store_true",
                   help="do not import the bundle in a fresh interpreter afterwards")
    p.add_argument("--json", action="store_true", help="print what was written as JSON")
    p.set_defaults(handler=cmd_bundle)


def cmd_bundle(args: argparse.Namespace) -> int:
    try:
        out = write_bundle(args.into)
    except (OSError, RuntimeError) as exc:
        print(f"tracehound bundle: cannot write {args.into}: {exc}", file=sys.stderr)
        return 1
    problem = "" if args.no_check else check_bundle(args.into)
    out["check"] = problem or "ok"
    if args.json:
        print(json.dumps(out))
    else:
        print(f"recorder bundled into {out['into']}; PYTHONPATH={out['pythonpath']}")
    if problem:
        print(f"tracehound bundle: the bundle does not import on its own: {problem}",
              file=sys.stderr)
        return 1
    return 0
