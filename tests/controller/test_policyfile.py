"""The policy file (controller/policyfile.py): loading real YAML and JSON files, the error of
every bad input, the schema file, and `tracehound policy` through its own parser."""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from tracehound.controller.policy.file import (
    EXAMPLE,
    SCHEMA_FILE,
    PolicyConfigError,
    add_parser,
    load_policy,
    policy_document,
    policy_from_document,
    policy_schema,
    policy_yaml,
)
from tracehound.controller.policy.recovery import (
    DEFAULT_RULES,
    KindRule,
    PolicySettings,
    Response,
    Uncertain,
    plan_recovery,
)
from tracehound.tracing.events import IncidentKind


def write(tmp_path: Path, text: str, name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


EVERYTHING_CHANGED = PolicySettings(
    max_restarts=7, max_restarts_per_hour=2, max_isolations=5, max_isolations_per_hour=1,
    restart_backoff_s=2.5, restart_backoff_max_s=90.0, watch_s=120.0,
    uncertain=Uncertain.ISOLATE_GROUP,
    rules={**DEFAULT_RULES,
           IncidentKind.HANG: KindRule(act_from=0.5, isolate_from=None, repeats=2, why="x"),
           IncidentKind.STALL: KindRule(response=Response.GIVE_UP, why="")},
)


# -- good files -----------------------------------------------------------------------------------


@pytest.mark.parametrize("settings", [PolicySettings(), EVERYTHING_CHANGED],
                         ids=["defaults", "everything-changed"])
def test_a_document_loads_back_to_equal_settings(tmp_path: Path,
                                                 settings: PolicySettings) -> None:
    doc = policy_document(settings)
    assert policy_from_document(doc, source="doc") == settings
    assert load_policy(write(tmp_path, policy_yaml(settings))) == settings
    assert load_policy(write(tmp_path, json.dumps(doc), "policy.json")) == settings


def test_the_document_has_every_setting_and_a_rule_for_every_kind() -> None:
    doc = policy_document(PolicySettings())
    assert set(doc) == {"version"} | {f.name for f in fields(PolicySettings)}
    assert doc["version"] == 1
    assert list(doc["rules"]) == [k.value for k in IncidentKind]
    assert doc["rules"]["stall"] == {"response": "observe", "act_from": 0.7,
                                     "isolate_from": None, "repeats": 1,
                                     "why": DEFAULT_RULES[IncidentKind.STALL].why}
    assert doc["uncertain"] == "watch"
    assert doc["max_restarts_per_hour"] is None


def test_only_a_version_keeps_every_default(tmp_path: Path) -> None:
    assert load_policy(write(tmp_path, "version: 1\n")) == PolicySettings()
    assert load_policy(write(tmp_path, '{"version": 1}', "p.json")) == PolicySettings()


def test_a_partial_rule_keeps_the_rest_of_its_kinds_default_rule(tmp_path: Path) -> None:
    settings = load_policy(write(tmp_path, "version: 1\nrules:\n  slow_link: {repeats: 4}\n"
                                           "  hang:\n    isolate_from: null\n"))
    assert settings.rule(IncidentKind.SLOW_LINK) == replace(
        DEFAULT_RULES[IncidentKind.SLOW_LINK], repeats=4)
    assert settings.rule(IncidentKind.SLOW_LINK).act_from == 0.5  # slow_link's own default
    assert settings.rule(IncidentKind.HANG) == replace(DEFAULT_RULES[IncidentKind.HANG],
                                                       isolate_from=None)
    untouched = set(IncidentKind) - {IncidentKind.SLOW_LINK, IncidentKind.HANG}
    assert all(settings.rule(k) == DEFAULT_RULES[k] for k in untouched)
    assert replace(settings, rules=DEFAULT_RULES) == PolicySettings()


def test_the_example_of_the_help_loads_and_sets_what_it_says(tmp_path: Path) -> None:
    settings = load_policy(write(tmp_path, EXAMPLE))
    assert (settings.max_restarts, settings.max_restarts_per_hour, settings.max_isolations,
            settings.max_isolations_per_hour) == (5, 3, 4, None)
    assert [settings.restart_delay_s(n) for n in range(5)] == [10.0, 20.0, 40.0, 80.0, 120.0]
    assert settings.uncertain is Uncertain.ISOLATE_GROUP
    hang = settings.rule(IncidentKind.HANG)
    assert (hang.act_from, hang.isolate_from, hang.why) == (
        0.7, 0.85, DEFAULT_RULES[IncidentKind.HANG].why)
    assert settings.rule(IncidentKind.STRAGGLER).repeats == 3
    outlier = settings.rule(IncidentKind.NODE_OUTLIER)
    assert (outlier.response, outlier.why) == (Response.OBSERVE,
                                                "our outlier model is still on trial")


def test_integral_floats_count_as_integers_like_json_schema_says() -> None:
    settings = policy_from_document({"version": 1, "max_restarts": 4.0,
                                     "rules": {"crash": {"repeats": 2.0}}}, source="doc")
    assert settings.max_restarts == 4 and isinstance(settings.max_restarts, int)
    assert settings.rule(IncidentKind.CRASH).repeats == 2


def test_a_loaded_policy_drives_the_plan(tmp_path: Path) -> None:
    """The file's settings reach plan_recovery: the hourly limit stops the job naming itself."""
    from tracehound.analysis.verdict import Basis, Verdict
    from tracehound.tracing.ids import JobId

    settings = load_policy(write(tmp_path, "version: 1\nmax_restarts_per_hour: 1\n"))
    hang = Verdict(job=JobId("j"), attempt=1, kind=IncidentKind.HANG, culprit_ranks=(3,),
                   culprit_nodes=("node-1",), confidence=0.95,
                   basis=Basis.CONTROL_DEPENDENCY, summary="rank 3 hangs", evidence=(),
                   observed_at_us=0)
    plan = plan_recovery(hang, restarts_done=1, healthy_spares=1, settings=settings,
                         restarts_last_hour=1)
    assert [(a.kind.value, a.rule) for a in plan] == [
        ("stop_job", "max_restarts_per_hour"), ("give_up", "max_restarts_per_hour")]


# -- bad files ------------------------------------------------------------------------------------

KINDS = "hang, crash, mismatch, straggler, slow_link, hardware, silent_hang, node_outlier, stall"

# (file text, the field its error must name, what the error must then say)
BAD: list[tuple[str, str, str]] = [
    ("version: 1\nrules: {hang: {act_from: high}}\n", "rules.hang.act_from",
     "expected a number from 0 to 1, got 'high'"),
    ("version: 1\nrules: {hang: {act_from: 1.5}}\n", "rules.hang.act_from",
     "expected a number from 0 to 1, got 1.5"),
    ("version: 1\nrules: {stall: {act_from: null}}\n", "rules.stall.act_from",
     "expected a number from 0 to 1, got None"),
    ("version: 1\nrules: {hardware: {isolate_from: -0.1}}\n", "rules.hardware.isolate_from",
     "expected a number from 0 to 1 or null, got -0.1"),
    ("version: 2\n", "version", "expected 1 (the only policy format), got 2"),
    ("version: '1'\n", "version", "expected 1 (the only policy format), got '1'"),
    ("version: true\n", "version", "expected 1 (the only policy format), got True"),
    ("max_restarts: 3\n", "version", "required: expected 1"),
    ("version: 1\nmax_restart: 3\n", "max_restart",
     "unknown key (allowed: version, max_restarts, max_restarts_per_hour, max_isolations, "
     "max_isolations_per_hour, restart_backoff_s, restart_backoff_max_s, watch_s, "
     "stall_alert_after_s, uncertain, watch_actions, rules); did you mean max_restarts?"),
    ("version: 1\nrules: {hnag: {}}\n", "rules.hnag",
     f"unknown incident kind (allowed: {KINDS}); did you mean hang?"),
    ("version: 1\nrules: {hang: {isolate: 0.9}}\n", "rules.hang.isolate",
     "unknown key (allowed: response, act_from, isolate_from, repeats, why); did you mean "
     "isolate_from?"),
    ("version: 1\nmax_restarts: -1\n", "max_restarts", "expected an integer >= 0, got -1"),
    ("version: 1\nmax_restarts: yes\n", "max_restarts", "expected an integer >= 0, got True"),
    ("version: 1\nmax_isolations: 2.5\n", "max_isolations",
     "expected an integer >= 0 or null (no limit), got 2.5"),
    ("version: 1\nmax_isolations_per_hour: '3'\n", "max_isolations_per_hour",
     "expected an integer >= 0 or null (no limit), got '3'"),
    ("version: 1\nmax_restarts_per_hour: []\n", "max_restarts_per_hour",
     "expected an integer >= 0 or null (no limit), got []"),
    ("version: 1\nrestart_backoff_s: -1\n", "restart_backoff_s",
     "expected a number of seconds >= 0, got -1"),
    ("version: 1\nrestart_backoff_max_s: null\n", "restart_backoff_max_s",
     "expected a number of seconds >= 0, got None"),
    ("version: 1\nwatch_s: .inf\n", "watch_s", "expected a number of seconds >= 0, got inf"),
    ("version: 1\nuncertain: evict\n", "uncertain",
     "expected one of watch, isolate_group, got 'evict'"),
    ("version: 1\nuncertain: no\n", "uncertain",
     "expected one of watch, isolate_group, got False (YAML reads yes, no, on and off as "
     "booleans: quote the word)"),
    ("version: 1\nrules: {crash: {repeats: 0}}\n", "rules.crash.repeats",
     "expected an integer >= 1, got 0"),
    ("version: 1\nrules: {crash: {response: restart}}\n", "rules.crash.response",
     "expected one of recover, observe, give_up, got 'restart'"),
    ("version: 1\nrules: {crash: {why: 3}}\n", "rules.crash.why", "expected a string, got 3"),
    ("version: 1\nrules: [hang]\n", "rules",
     f"expected a mapping of incident kinds ({KINDS}) to rules, got ['hang']"),
    ("version: 1\nrules:\n  hang:\n", "rules.hang",
     "expected a mapping of response, act_from, isolate_from, repeats, why, got None"),
    ("version: 1\nrules:\n  hang: {act_from: 0.5}\n  hang: {act_from: 0.9}\n", "rules.hang",
     "given twice, on lines 3 and 4"),
    ("version: 1\nwatch_s: 60\nrules: {}\nwatch_s: 30\n", "watch_s",
     "given twice, on lines 2 and 4"),
]


@pytest.mark.parametrize(("text", "field", "says"), BAD, ids=[f"{f}:{s[:24]}" for _, f, s in BAD])
def test_a_bad_file_is_rejected_naming_the_file_and_the_field(
        tmp_path: Path, text: str, field: str, says: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyConfigError) as caught:
        load_policy(path)
    assert str(caught.value) == f"{path}: {field}: {says}"
    assert isinstance(caught.value, ValueError)


def test_there_are_enough_bad_inputs_and_each_names_a_different_problem() -> None:
    assert len(BAD) >= 12
    assert len({(field, says) for _, field, says in BAD}) == len(BAD)


def test_a_file_that_is_no_policy_at_all_names_the_file(tmp_path: Path) -> None:
    cases = {
        "": "expected a mapping of policy keys with version: 1, got an empty document",
        "- version: 1\n": "expected a mapping of policy keys with version: 1, got "
                          "[{'version': 1}]",
        "version: 1\nrules: [1\n": "line 3, column 1: not valid YAML: while parsing a flow "
                                   "sequence, expected ',' or ']', but got '<stream end>'",
        "version: 1\n  max_restarts: 2\n": "line 2, column 15: not valid YAML: mapping values are "
                                           "not allowed here",
        "version: 1\n---\nversion: 1\n": "line 2, column 1: not valid YAML: expected a single "
                                         "document in the stream, but found another document",
    }
    for text, says in cases.items():
        path = write(tmp_path, text)
        with pytest.raises(PolicyConfigError) as caught:
            load_policy(path)
        assert str(caught.value) == f"{path}: {says}", text
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(PolicyConfigError) as caught:
        load_policy(missing)
    assert str(caught.value) == f"{missing}: cannot be read: No such file or directory"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"version: 1\nwhy: \xff\n")
    with pytest.raises(PolicyConfigError, match=f"^{re.escape(str(binary))}: not UTF-8 text"):
        load_policy(binary)


def test_a_document_error_names_its_source() -> None:
    with pytest.raises(PolicyConfigError,
                       match=r"^inline: rules\.hang\.repeats: expected an integer >= 1, got 0$"):
        policy_from_document({"version": 1, "rules": {"hang": {"repeats": 0}}}, source="inline")
    with pytest.raises(PolicyConfigError, match=r"^inline: 1: unknown key \(allowed: version"):
        policy_from_document({"version": 1, 1: 2}, source="inline")


# -- the schema -----------------------------------------------------------------------------------


def test_the_schema_file_is_the_schema_the_loader_is_built_from() -> None:
    expected = json.dumps(policy_schema(), indent=2, sort_keys=True) + "\n"
    assert SCHEMA_FILE.read_text(encoding="utf-8") == expected, (
        "controller/policy.schema.json is stale: regenerate it with "
        "`tracehound policy --schema > controller/policy.schema.json`")


def test_the_schema_names_every_setting_every_rule_field_and_every_kind() -> None:
    schema = policy_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["required"] == ["version"]
    assert set(schema["properties"]) == {"version"} | {f.name for f in fields(PolicySettings)}
    rule = schema["$defs"]["rule"]
    assert set(rule["properties"]) == {f.name for f in fields(KindRule)}
    assert rule["properties"]["response"]["enum"] == [r.value for r in Response]
    assert schema["properties"]["uncertain"]["enum"] == [u.value for u in Uncertain]
    rules = schema["properties"]["rules"]
    assert list(rules["properties"]) == [k.value for k in IncidentKind]
    assert all(p["$ref"] == "#/$defs/rule" for p in rules["properties"].values())
    assert all("description" in p for p in [*schema["properties"].values(),
                                            *rule["properties"].values()])


def test_the_defaults_in_the_schema_are_the_default_policy() -> None:
    schema = policy_schema()
    doc = {name: p["default"] for name, p in schema["properties"].items()
           if name not in ("version", "rules")}
    doc["version"] = schema["properties"]["version"]["const"]
    doc["rules"] = {k: p["default"] for k, p in schema["properties"]["rules"]["properties"].items()}
    assert policy_from_document(doc, source="schema") == PolicySettings()


def schema_errors(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> list[str]:
    """The keywords of `schema` that `value` fails: the subset of JSON Schema the policy schema
    uses (type, const, enum, minimum, maximum, required, properties, additionalProperties,
    $ref). A stand-in, in this test only, for a JSON Schema validator, which this project does
    not depend on."""
    if "$ref" in schema:
        schema = {**root["$defs"][schema["$ref"].rsplit("/", 1)[1]],
                  **{k: v for k, v in schema.items() if k != "$ref"}}
    checks = {
        "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, float) and v.is_integer()),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
    }
    kinds = schema.get("type")
    if kinds is not None:
        kinds = kinds if isinstance(kinds, list) else [kinds]
        if not any(checks[k](value) for k in kinds):
            return ["type"]
    errors = []
    if "const" in schema and (isinstance(value, bool) or value != schema["const"]):
        errors.append("const")
    if "enum" in schema and value not in schema["enum"]:
        errors.append("enum")
    if isinstance(value, int | float) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append("minimum")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append("maximum")
    if isinstance(value, dict):
        errors += [f"required {k}" for k in schema.get("required", []) if k not in value]
        properties = schema.get("properties", {})
        for key, item in value.items():
            if key in properties:
                errors += [f"{key}.{e}" for e in schema_errors(item, properties[key], root)]
            elif schema.get("additionalProperties") is False:
                errors.append(f"additionalProperties {key}")
    return errors


def test_the_schema_and_the_loader_agree_on_every_document_of_these_tests() -> None:
    import yaml

    schema = policy_schema()
    good = [policy_document(PolicySettings()), policy_document(EVERYTHING_CHANGED),
            yaml.safe_load(EXAMPLE), {"version": 1}, {"version": 1, "max_restarts": 4.0}]
    for doc in good:
        assert schema_errors(doc, schema, schema) == [], doc
    # a key given twice is YAML's business, before any schema; JSON has no infinity
    bad = [yaml.safe_load(text) for text, _, says in BAD
           if "given twice" not in says and "inf" not in says]
    assert len(bad) >= 20
    for doc in bad:
        assert schema_errors(doc, schema, schema), doc
        with pytest.raises(PolicyConfigError):
            policy_from_document(doc, source="doc")
    assert math.isinf(yaml.safe_load("watch_s: .inf")["watch_s"])


# -- tracehound policy ----------------------------------------------------------------------------


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="tracehound")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.handler(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_check_says_ok_or_prints_the_error_and_exits_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, EXAMPLE)
    assert run_cli(["policy", "--check", str(good)], capsys) == (0, f"{good}: ok\n", "")
    bad = write(tmp_path, "version: 1\nrules: {hang: {act_from: high}}\n", "bad.yaml")
    code, out, err = run_cli(["policy", "--check", str(bad)], capsys)
    assert (code, out) == (2, "")
    assert err == (f"tracehound policy: {bad}: rules.hang.act_from: expected a number from 0 "
                   "to 1, got 'high'\n")


def test_check_json_prints_the_policy_in_force_or_the_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, EXAMPLE)
    code, out, _ = run_cli(["policy", "--check", str(good), "--json"], capsys)
    assert code == 0
    assert json.loads(out) == {"ok": True, "error": None,
                               "policy": policy_document(load_policy(good))}
    assert json.loads(out)["policy"]["rules"]["hang"]["isolate_from"] == 0.85
    missing = tmp_path / "missing.yaml"
    code, out, _ = run_cli(["policy", "--check", str(missing), "--json"], capsys)
    assert code == 2
    assert json.loads(out) == {
        "ok": False, "policy": None,
        "error": f"{missing}: cannot be read: No such file or directory"}


def test_defaults_prints_a_commented_policy_file_that_loads_back(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["policy", "--defaults"], capsys)
    assert code == 0
    assert "# Restarts allowed per job" in out
    assert all(len(line) <= 100 for line in out.splitlines() if line.startswith("#"))
    assert load_policy(write(tmp_path, out)) == PolicySettings()
    code, out, _ = run_cli(["policy", "--defaults", "--json"], capsys)
    assert policy_from_document(json.loads(out), source="stdout") == PolicySettings()


def test_schema_prints_the_schema_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(["policy", "--schema"], capsys)
    assert code == 0
    assert out == SCHEMA_FILE.read_text(encoding="utf-8")


def test_help_shows_the_example_and_one_action_is_required(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        run_cli(["policy", "--help"], capsys)
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "example policy.yaml:\n  version: 1\n  max_restarts: 5\n" in out
    assert "tracehound policy --check policy.yaml" in out
    for argv in (["policy"], ["policy", "--defaults", "--schema"]):
        with pytest.raises(SystemExit) as done:
            run_cli(argv, capsys)
        assert done.value.code == 2
