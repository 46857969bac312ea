"""`python -m tracehound.controller.cli`: the `tracehound` command."""

from tracehound.controller.cli.main import run

run()
