"""`tracehound run --policy FILE --alerts FILE`: a bad file stops the run before anything starts,
with a message naming the file and the field; `tracehound policy` checks a file on its own. A
dashboard port that cannot be served (`--ui --ui-port`) stops it as early."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tracehound.controller.cli.main import main


def _run(tmp_path: Path, *flags: str) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    return ["run", "--nnodes", "1", "--nproc-per-node", "1", "--workdir", str(tmp_path / "w"),
            "--store", f"chdb://{tmp_path / 'store'}", *flags, str(script)]


@pytest.mark.parametrize(("text", "field"), [
    ("version: 1\nrules:\n  hang: {act_from: high}\n", "rules.hang.act_from"),
    ("version: 1\nmax_restart: 3\n", "max_restart"),
    ("version: 2\n", "version"),
    ("version: 1\nrules:\n  hangs: {}\n", "rules.hangs"),
])
def test_a_bad_policy_file_is_refused_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(text)
    assert main(_run(tmp_path, "--policy", str(policy))) == 2
    err = capsys.readouterr().err
    assert f"{policy}: {field}" in err
    assert not (tmp_path / "w").exists()  # nothing was launched


@pytest.mark.parametrize(("doc", "field"), [
    ({"receivers": [{"name": "s", "kind": "slak", "url": "http://127.0.0.1:1/x"}]},
     "receivers[0].kind"),
    ({"receivers": [{"name": "p", "kind": "pagerduty", "url": "http://127.0.0.1:1/x"}]},
     "receivers[0].routing_key"),
])
def test_a_bad_alerts_file_is_refused_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], doc: object, field: str) -> None:
    alerts = tmp_path / "alerts.json"
    alerts.write_text(json.dumps(doc))
    assert main(_run(tmp_path, "--alerts", str(alerts))) == 2
    err = capsys.readouterr().err
    assert f"{alerts}: {field}" in err


def test_policy_check_and_defaults(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["policy", "--defaults"]) == 0
    defaults = tmp_path / "defaults.yaml"
    defaults.write_text(capsys.readouterr().out)
    assert main(["policy", "--check", str(defaults)]) == 0
    assert f"{defaults}: ok" in capsys.readouterr().out


def test_a_bad_global_alerts_file_is_refused_naming_the_variable_and_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    global_file = tmp_path / "global.yaml"
    global_file.write_text("receivers:\n  - {name: oncall, kind: slack, url: 'http://s/', "
                           "jobs: {exp: 1}}\n")
    monkeypatch.setenv("TRACEHOUND_ALERTS", str(global_file))
    assert main(_run(tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"{global_file}: receivers[0].jobs: expected a list" in err
    assert not (tmp_path / "w").exists()


def test_a_dashboard_port_that_cannot_be_served_stops_the_run_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_run(tmp_path, "--ui", "--ui-port", "70000")) == 2
    assert "--ui-port 70000: expected a port number from 1 to 65535" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(_run(tmp_path, "--ui", "--ui-port", str(port))) == 2
    err = capsys.readouterr().err
    assert f"--ui-port {port}: cannot serve on 127.0.0.1:{port} (Address already in use)" in err
    assert not (tmp_path / "w").exists() and not (tmp_path / "store").exists()
