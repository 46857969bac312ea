"""The recovery policy as one file: load and check it, print it, and its JSON Schema.

An operator sets every threshold of `controller.policy.PolicySettings` in one YAML file (JSON is
YAML too), one key per settings field, and a rule per verdict kind under `rules`:

    version: 1
    max_restarts: 5
    uncertain: isolate_group
    rules:
      hang: {act_from: 0.7, isolate_from: 0.85}
      straggler: {repeats: 3}

Keys left out keep their defaults, and a rule given in part keeps the rest of its kind's default
rule (`policy.DEFAULT_RULES`). Anything the loader does not take is a `PolicyConfigError` naming
the file, the field and what was expected: an unknown key (a typo must never fall back to a
default in silence), a key given twice, a value of the wrong type or out of range, a version
other than 1. The loader and the JSON Schema (`policy_schema`, written out as
`policy.schema.json` beside this module for editors and CI) are built from the same tables,
`_SETTINGS` and `_RULE_FIELDS`, so they cannot drift apart.

`tracehound policy` (`add_parser`) checks a file, prints the defaults or the schema. This module
only reads and describes settings; it never acts on a job.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import json
import math
import os
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from tracehound.controller.policy.recovery import (
    DEFAULT_RULES,
    KindRule,
    PolicySettings,
    Response,
    Uncertain,
    WatchActions,
)
from tracehound.tracing.errors import shown
from tracehound.tracing.events import IncidentKind

FORMAT_VERSION: Final = 1
"""The `version` a policy file must give: the only format there is."""

SCHEMA_FILE: Final = Path(__file__).with_name("policy.schema.json")
"""`policy_schema()` written out (`tracehound policy --schema`), shipped with the package."""


class PolicyConfigError(ValueError):
    """A policy file (or document) that cannot be used as given. Permanent: the message names
    the file, the field path and what was expected; the file must be fixed."""


class _Invalid(Exception):
    """A value a field does not take (internal: the loader adds the file and the path)."""


# -- the tables: one entry per key, the loader, the dumper and the schema read them -------------


def _same(value: Any) -> object:
    return value


def _enum_value(member: enum.StrEnum) -> object:
    return member.value


@dataclass(frozen=True, slots=True)
class _Field:
    """One key of a policy document: what it means and takes, its JSON Schema and its codec."""

    description: str
    expected: str
    """What an error says the key takes: "an integer >= 0"."""
    schema: Mapping[str, Any]
    """The JSON Schema of its value (the schema adds the description and the default)."""
    parse: Callable[[object], object]
    """The settings value of a document value; raises _Invalid."""
    dump: Callable[[Any], object] = _same
    """The document value of a settings value."""


def _integer(description: str, minimum: int, *, null: bool = False) -> _Field:
    """An integer >= minimum (or null when `null`). 3.0 counts as 3, as in JSON Schema."""

    def parse(value: object) -> object:
        if value is None and null:
            return None
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise _Invalid
        return value

    return _Field(
        description, f"an integer >= {minimum}" + (" or null (no limit)" if null else ""),
        {"type": ["integer", "null"] if null else "integer", "minimum": minimum}, parse)


def _number(description: str, minimum: float, maximum: float | None = None, *,
            null: bool = False, unit: str = "") -> _Field:
    """A finite number from minimum to maximum (or null when `null`)."""

    def parse(value: object) -> object:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _Invalid
        try:
            number = float(value)
        except OverflowError:  # an integer too large for a float
            raise _Invalid from None
        if not math.isfinite(number) or number < minimum or (
                maximum is not None and number > maximum):
            raise _Invalid
        return number

    span = f"from {minimum:g} to {maximum:g}" if maximum is not None else f">= {minimum:g}"
    expected = f"a number{f' of {unit}' if unit else ''} {span}" + (" or null" if null else "")
    schema: dict[str, Any] = {"type": ["number", "null"] if null else "number",
                              "minimum": minimum}
    if maximum is not None:
        schema["maximum"] = maximum
    return _Field(description, expected, schema, parse)


def _choice(description: str, kind: type[enum.StrEnum]) -> _Field:
    """One of the values of a string enum, read as its member."""
    values = [m.value for m in kind]

    def parse(value: object) -> object:
        if not isinstance(value, str) or value not in values:
            raise _Invalid
        return kind(value)

    return _Field(description, f"one of {', '.join(values)}",
                  {"type": "string", "enum": values}, parse, _enum_value)


def _text(description: str) -> _Field:
    def parse(value: object) -> object:
        if not isinstance(value, str):
            raise _Invalid
        return value

    return _Field(description, "a string", {"type": "string"}, parse)


_SETTINGS: Final[Mapping[str, _Field]] = {
    "max_restarts": _integer(
        "Restarts allowed per job; then the controller stops the job and gives up.", 0),
    "max_restarts_per_hour": _integer(
        "Restarts allowed within any hour; then the controller stops the job and gives up "
        "(null: no hourly limit).", 0, null=True),
    "max_isolations": _integer(
        "Nodes that may be isolated per job; a recovery that would isolate more restarts "
        "evicting nobody (null: unlimited).", 0, null=True),
    "max_isolations_per_hour": _integer(
        "Nodes that may be isolated within any hour, as max_isolations (null: unlimited).",
        0, null=True),
    "restart_backoff_s": _number(
        "Seconds to wait before the first restart, doubled for each restart after it "
        "(0: restart at once).", 0, unit="seconds"),
    "restart_backoff_max_s": _number(
        "The longest wait before a restart, in seconds.", 0, unit="seconds"),
    "watch_s": _number(
        "Seconds an unsure verdict (or one naming more nodes than there are spares) on a "
        "running job is only watched before the job restarts evicting nobody.",
        0, unit="seconds"),
    "stall_alert_after_s": _number(
        "Seconds a stall (ranks waiting on a rank busy outside collectives) lasts before it is "
        "alerted as a warning; its incident is info-level until then, which receivers take "
        "only with min_severity: info (null: never).", 0, unit="seconds", null=True),
    "uncertain": _choice(
        "What to do about a localized verdict not sure enough to evict its culprits' node: "
        "watch (evict nobody) or isolate_group (evict the nodes of the smallest parallel "
        "group holding the culprit ranks, when the spares and isolation limits allow).",
        Uncertain),
    "watch_actions": _choice(
        "How `tracehound watch` acts on a job Tracehound did not launch: observe (record "
        "incidents and what the policy would do, never touch the job) or slurm (through "
        "scontrol: drain the culprit nodes, then requeue or cancel the job as the plan says; "
        "the same as --slurm). tracehound run and the operator ignore it.",
        WatchActions),
}
"""Every top-level key but `version` and `rules`, named as the `PolicySettings` field it sets."""

_RULE_FIELDS: Final[Mapping[str, _Field]] = {
    "response": _choice(
        "recover (stop, evict the culprits' nodes when sure enough, restart), observe (record "
        "and watch, never act) or give_up (stop and give up: the program is at fault).",
        Response),
    "act_from": _number(
        "Least confidence to stop a running job at once; a less sure verdict is watched for "
        "watch_s, then the job restarts evicting nobody.", 0, 1),
    "isolate_from": _number(
        "Least confidence to evict the culprit nodes (null: never evict).", 0, 1, null=True),
    "repeats": _integer(
        "Consecutive detection windows that must show the verdict on the same nodes before "
        "anything is done.", 1),
    "why": _text("Why the rule is what it is (free text)."),
}
"""Every key of a rule, named as the `KindRule` field it sets."""

_VERSION_DESCRIPTION = "The policy file format: 1."
_RULES_DESCRIPTION = ("The rule of each verdict kind; a rule given in part keeps the rest of "
                      "its kind's default rule.")

KINDS: Final = tuple(k.value for k in IncidentKind)
"""The verdict kinds a policy file may give a rule for."""


# -- loading ------------------------------------------------------------------------------------


def load_policy(path: Path) -> PolicySettings:
    """The settings in the YAML (or JSON) policy file at `path`; PolicyConfigError naming the
    file, and the field or the line, when it cannot be read or is not a valid policy."""
    source = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyConfigError(f"{source}: cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise PolicyConfigError(f"{source}: not UTF-8 text: {exc}") from exc
    try:
        _no_key_twice(yaml.compose(text, Loader=yaml.SafeLoader), "", source)
        doc: object = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PolicyConfigError(f"{source}: {_yaml_problem(exc)}") from exc
    except PolicyConfigError:
        raise
    except (ValueError, OverflowError, RecursionError) as exc:
        # what PyYAML's constructors let through: a date such as 2024-13-01, an integer of more
        # than 4300 digits, a document nested deeper than Python's recursion limit
        problem = "nested too deep" if isinstance(exc, RecursionError) else str(exc)
        raise PolicyConfigError(f"{source}: not a usable YAML document: {problem}") from exc
    return policy_from_document(doc, source=source)


def _yaml_problem(exc: Exception) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    if context:
        problem = f"{context}, {problem}"
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}not valid YAML: {problem}"


def _no_key_twice(node: object, at: str, source: str, seen_nodes: set[int] | None = None
                  ) -> None:
    """PolicyConfigError for a key given twice in one mapping (YAML would keep the last in
    silence, and the first is likely what was meant to be changed). Each node is checked once:
    an alias is the node it names, and walking every path to it takes exponential time."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _no_key_twice(item, f"{at}[{index}]", source, seen_nodes)
    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[object, int] = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else key
        path = f"{at}.{name}" if at else f"{name}"
        line = key.start_mark.line + 1
        if name in seen:
            raise PolicyConfigError(
                f"{source}: {path}: given twice, on lines {seen[name]} and {line}")
        seen[name] = line
        _no_key_twice(value, path, source, seen_nodes)


def policy_from_document(doc: object, *, source: str) -> PolicySettings:
    """The settings a parsed policy document gives (a mapping as `load_policy` reads it);
    PolicyConfigError naming `source` and the field when it is not a valid policy."""

    def fail(at: str, message: str) -> PolicyConfigError:
        return PolicyConfigError(f"{source}: {at}: {message}" if at else f"{source}: {message}")

    if not isinstance(doc, Mapping):
        got = "an empty document" if doc is None else shown(doc)
        raise fail("", f"expected a mapping of policy keys with version: {FORMAT_VERSION}, "
                       f"got {got}")
    _known_keys(doc, ("version", *_SETTINGS, "rules"), "", fail)
    if "version" not in doc:
        raise fail("version", f"required: expected {FORMAT_VERSION}")
    version = doc["version"]
    if isinstance(version, bool) or version != FORMAT_VERSION:
        raise fail("version", f"expected {FORMAT_VERSION} (the only policy format), "
                              f"got {shown(version)}")
    changes: dict[str, Any] = {name: _parse(spec, doc[name], name, fail)
                               for name, spec in _SETTINGS.items() if name in doc}
    if "rules" in doc:
        changes["rules"] = _rules(doc["rules"], fail)
    return replace(PolicySettings(), **changes)


def _known_keys(doc: Mapping[Any, Any], allowed: tuple[str, ...], at: str,
                fail: Callable[[str, str], PolicyConfigError], what: str = "key") -> None:
    for key in doc:
        if isinstance(key, str) and key in allowed:
            continue
        path = f"{at}.{key}" if at else f"{key}"
        close = difflib.get_close_matches(str(key), allowed, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise fail(path, f"unknown {what} (allowed: {', '.join(allowed)}){hint}")


def _parse(spec: _Field, value: object, at: str,
           fail: Callable[[str, str], PolicyConfigError]) -> object:
    try:
        return spec.parse(value)
    except _Invalid:
        hint = (" (YAML reads yes, no, on and off as booleans: quote the word)"
                if isinstance(value, bool) and spec.schema.get("type") == "string" else "")
        raise fail(at, f"expected {spec.expected}, got {shown(value)}{hint}") from None


def _rules(value: object,
           fail: Callable[[str, str], PolicyConfigError]) -> Mapping[IncidentKind, KindRule]:
    if not isinstance(value, Mapping):
        raise fail("rules", f"expected a mapping of incident kinds ({', '.join(KINDS)}) to "
                            f"rules, got {shown(value)}")
    _known_keys(value, KINDS, "rules", fail, what="incident kind")
    rules = dict(DEFAULT_RULES)
    for name, given in value.items():
        kind, at = IncidentKind(name), f"rules.{name}"
        if not isinstance(given, Mapping):
            raise fail(at, f"expected a mapping of {', '.join(_RULE_FIELDS)}, "
                           f"got {shown(given)}")
        _known_keys(given, tuple(_RULE_FIELDS), at, fail)
        changes: dict[str, Any] = {
            key: _parse(_RULE_FIELDS[key], given[key], f"{at}.{key}", fail)
            for key in _RULE_FIELDS if key in given}
        rules[kind] = replace(DEFAULT_RULES.get(kind, KindRule()), **changes)
    return rules


# -- writing ------------------------------------------------------------------------------------


def policy_document(settings: PolicySettings) -> dict[str, Any]:
    """The full policy document of `settings` (every key, a rule for every kind): what
    `policy_from_document` turns back into equal settings."""
    doc: dict[str, Any] = {"version": FORMAT_VERSION}
    for name, spec in _SETTINGS.items():
        doc[name] = spec.dump(getattr(settings, name))
    doc["rules"] = {kind.value: _rule_document(settings.rule(kind)) for kind in IncidentKind}
    return doc


def _rule_document(rule: KindRule) -> dict[str, Any]:
    return {name: spec.dump(getattr(rule, name)) for name, spec in _RULE_FIELDS.items()}


def policy_yaml(settings: PolicySettings) -> str:
    """`policy_document(settings)` as a YAML file, each top-level key under a comment that says
    what it means."""
    doc = policy_document(settings)
    parts = [f"# Tracehound recovery policy (check with: tracehound policy --check FILE)\n"
             f"# {_VERSION_DESCRIPTION}\n"
             f"{_dump({'version': doc['version']})}"]
    for name, spec in _SETTINGS.items():
        parts.append(f"{_comment(spec.description)}{_dump({name: doc[name]})}")
    rule_help = "".join(
        textwrap.fill(f"{name}: {spec.description}", width=98, initial_indent="#   ",
                      subsequent_indent="#     ") + "\n"
        for name, spec in _RULE_FIELDS.items())
    parts.append(f"{_comment(_RULES_DESCRIPTION)}{rule_help}{_dump({'rules': doc['rules']})}")
    return "\n".join(parts)


def _comment(text: str) -> str:
    return textwrap.fill(text, width=98, initial_indent="# ", subsequent_indent="# ") + "\n"


def _dump(doc: Mapping[str, Any]) -> str:
    text: str = yaml.safe_dump(dict(doc), sort_keys=False, width=100, allow_unicode=True)
    return text


def policy_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy document, from the loader's own tables; the
    defaults in it are those of `PolicySettings()`."""
    defaults = policy_document(PolicySettings())
    properties: dict[str, Any] = {
        "version": {"const": FORMAT_VERSION, "description": _VERSION_DESCRIPTION}}
    for name, spec in _SETTINGS.items():
        properties[name] = {**spec.schema, "description": spec.description,
                            "default": defaults[name]}
    properties["rules"] = {
        "type": "object",
        "description": _RULES_DESCRIPTION,
        "properties": {kind: {"$ref": "#/$defs/rule", "default": defaults["rules"][kind]}
                       for kind in KINDS},
        "additionalProperties": False,
    }
    rule = {
        "type": "object",
        "description": "How the policy treats the verdicts of one kind.",
        "properties": {name: {**spec.schema, "description": spec.description}
                       for name, spec in _RULE_FIELDS.items()},
        "additionalProperties": False,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Tracehound recovery policy",
        "description": "What Tracehound does about each verdict: when to act, evict, watch, "
                       "restart or give up (tracehound policy --help).",
        "type": "object",
        "required": ["version"],
        "properties": properties,
        "additionalProperties": False,
        "$defs": {"rule": rule},
    }


def schema_text() -> str:
    """`policy_schema()` as the text of `policy.schema.json`."""
    return json.dumps(policy_schema(), indent=2, sort_keys=True) + "\n"


# -- the command ----------------------------------------------------------------------------------

EXAMPLE = """\
version: 1
max_restarts: 5
max_restarts_per_hour: 3       # give up when the job keeps failing soon after restarts
max_isolations: 4              # evict at most 4 nodes per job
restart_backoff_s: 10          # wait 10, 20, 40 ... s before restarts
restart_backoff_max_s: 120
uncertain: isolate_group       # unsure of the node: evict the culprits' smallest group
rules:
  hang: {act_from: 0.7, isolate_from: 0.85}
  straggler: {repeats: 3}
  node_outlier:
    response: observe
    why: our outlier model is still on trial
"""
"""The example policy file of `tracehound policy --help` (the tests load it)."""

EPILOG = f"""\
A policy file sets the thresholds of the recovery policy in YAML (or JSON). Keys left out keep
their defaults (--defaults prints them all, each with what it means), and a rule given in part
keeps the rest of its kind's default rule. Unknown keys, keys given twice and values out of
range are errors naming the file and the field. Every action Tracehound takes names the key
that decided it (e.g. rules.hang.isolate_from, max_restarts_per_hour, uncertain).

example policy.yaml:
{textwrap.indent(EXAMPLE, "  ")}
{textwrap.fill("incident kinds under rules: " + ", ".join(KINDS), width=96)}
Exit status: 0 when the file is a valid policy, 2 when it is not (or cannot be read).

examples:
  tracehound policy --check policy.yaml
  tracehound policy --check policy.yaml --json
  tracehound policy --defaults > policy.yaml
  tracehound policy --schema > policy.schema.json
"""


def add_parser(sub: Any) -> None:
    """Add the `policy` command to the CLI's subparsers."""
    p = sub.add_parser(
        "policy", help="check a recovery policy file, or print the defaults or its schema",
        description="Check a recovery policy file (what Tracehound does about each verdict:\n"
                    "when to act, evict, watch, restart or give up), or print the default\n"
                    "policy or the JSON Schema of policy files.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--check", type=Path, metavar="FILE",
                      help="check a policy file: prints 'FILE: ok' or what is wrong")
    what.add_argument("--defaults", action="store_true",
                      help="print the default policy as YAML, each key with what it means")
    what.add_argument("--schema", action="store_true",
                      help="print the JSON Schema (draft 2020-12) of policy files")
    p.add_argument("--json", action="store_true",
                   help='with --check: print one JSON object {"ok", "error", "policy"} (the '
                        "full policy in force); with --defaults: the default policy as JSON")
    p.set_defaults(handler=cmd_policy)


def cmd_policy(args: argparse.Namespace) -> int:
    if args.schema:
        print(schema_text(), end="")
        return 0
    if args.defaults:
        if args.json:
            print(json.dumps(policy_document(PolicySettings()), indent=2))
        else:
            print(policy_yaml(PolicySettings()), end="")
        return 0
    source = os.fspath(args.check)
    try:
        settings = load_policy(args.check)
    except PolicyConfigError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc), "policy": None}))
        else:
            print(f"tracehound policy: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"ok": True, "error": None, "policy": policy_document(settings)}))
    else:
        print(f"{source}: ok")
    return 0

