"""The `tracehound` command: its parser (`main`) and one module per command.

`run` is the console entry point; `python -m tracehound.controller.cli` does the same.
"""

from tracehound.controller.cli.main import main, run

__all__ = ["main", "run"]
