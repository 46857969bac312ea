"""The chart lints and renders offline with real helm, with the default values and others, and
every manifest it renders is valid Kubernetes 1.33 (kubernetes-validate, strict: no unknown
field); its values are all declared in values.schema.json and described in values.yaml, and the
schema turns bad values away with their names; the CRD is the operator's own."""

from __future__ import annotations

import json
import re
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_harness import CHART, CUSTOM_VALUES, Helm, Rendered
from jsonschema import Draft7Validator

from tracehound.controller.operator.trainingjob import crd_manifest, crd_yaml

KUBERNETES = "1.33"
CRD_FILE = CHART / "crds" / "trainingjob.yaml"
SCHEMA_FILE = CHART / "values.schema.json"


@pytest.mark.parametrize("values", [[], ["-f", str(CUSTOM_VALUES)]], ids=["default", "custom"])
def test_lint_strict_is_clean(helm: Helm, values: list[str]) -> None:
    done = helm.run("lint", "--strict", str(CHART), *values)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout
    assert not re.search(r"\[(WARNING|ERROR)\]", done.stdout), done.stdout


def test_default_values_render_the_operator_alone(default_render: Rendered) -> None:
    assert default_render.kinds() == sorted([
        "CustomResourceDefinition", "ServiceAccount", "Secret", "ConfigMap", "ClusterRole",
        "ClusterRoleBinding", "Deployment",
    ])


def test_custom_values_render_every_part(custom_render: Rendered) -> None:
    assert custom_render.kinds() == sorted([
        "CustomResourceDefinition", "ServiceAccount",
        "Secret",  # the alert receivers; the store URL is in an existing Secret
        "ConfigMap", "ClusterRole", "ClusterRoleBinding",
        "Role", "RoleBinding", "Role", "RoleBinding",  # one of each per watched namespace
        "Deployment", "Deployment", "Service", "DaemonSet",
    ])


def test_every_rendered_manifest_is_valid_kubernetes(render: Rendered) -> None:
    failures = []
    for doc in render.docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            failures.append(f"{where}: {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            failures.append(f"{where}: {exc.message}")
    assert not failures, "\n".join(failures)


def test_a_broken_manifest_is_caught() -> None:
    """The validation above can fail: a container without its image is refused."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "imagePullPolicy": "Sometimes", "bogus": 1}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pod, KUBERNETES, strict=True)


def test_crd_is_the_operators_own(default_render: Rendered) -> None:
    assert yaml.safe_load(CRD_FILE.read_text()) == crd_manifest()
    assert CRD_FILE.read_text() == crd_yaml(), (
        "regenerate it: .venv/bin/python -c \"from tracehound.controller.operator.trainingjob "
        "import crd_yaml; print(crd_yaml(), end='')\" > charts/tracehound/crds/trainingjob.yaml")
    assert default_render.of_kind("CustomResourceDefinition") == [crd_manifest()]


# -- values and their schema ---------------------------------------------------------------------
def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return schema


def _resolve(node: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = root
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def _declared(path: tuple[str, ...], root: dict[str, Any]) -> tuple[bool, dict[str, Any], bool]:
    """Whether the schema declares the value at `path` (a free-form object, e.g. nodeSelector,
    declares everything below it); the schema node of its parent; and whether that parent is a
    map of the chart's own (reached without a `$ref` to a Kubernetes type such as resources)."""
    node, own = root, True
    for key in path[:-1]:
        own = own and "$ref" not in node
        node = _resolve(node, root)
        if key not in node.get("properties", {}):
            return node.get("additionalProperties", True) is not False, node, False
        node = node["properties"][key]
    own = own and "$ref" not in node
    parent = _resolve(node, root)
    if path[-1] in parent.get("properties", {}):
        return True, parent, own
    return parent.get("additionalProperties", True) is not False, parent, own


def _leaves(values: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(values, dict) and values:
        return [leaf for key, value in values.items() for leaf in _leaves(value, (*path, key))]
    return [path]


def test_schema_is_draft_07_and_accepts_both_value_sets(
        default_values: dict[str, Any], custom_values: dict[str, Any]) -> None:
    schema = _schema()
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    Draft7Validator.check_schema(schema)
    Draft7Validator(schema).validate(default_values)
    merged = _merge(default_values, custom_values)
    Draft7Validator(schema).validate(merged)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Helm's merge of a values file over the defaults: maps merge, everything else replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = (_merge(base[key], value) if isinstance(value, dict)
                    and isinstance(base.get(key), dict) else value)
    return out


def test_every_value_is_in_the_schema(default_values: dict[str, Any],
                                      custom_values: dict[str, Any]) -> None:
    schema = _schema()
    leaves = _leaves(default_values) + _leaves(custom_values)
    undeclared = [".".join(p) for p in leaves if not _declared(p, schema)[0]]
    assert not undeclared


def test_the_schema_declares_no_value_that_values_yaml_lacks(
        default_values: dict[str, Any]) -> None:
    """Each value the schema names in a closed map of the chart's own has a default (and so a
    description) in values.yaml."""
    schema = _schema()

    def walk(node: dict[str, Any], values: dict[str, Any], path: str) -> list[str]:
        node = _resolve(node, schema)
        if node.get("additionalProperties", True) is not False:
            return []
        missing = []
        for key, sub in node["properties"].items():
            if key not in values:
                missing.append(f"{path}{key}")
            elif isinstance(values[key], dict):
                missing += walk(sub, values[key], f"{path}{key}.")
        return missing

    assert not walk(schema, default_values, "")


def test_every_value_of_the_charts_own_is_described_in_values_yaml() -> None:
    """Each key of a map the chart defines (a closed map of the schema's own, not a Kubernetes
    type such as resources or a security context) has a comment right above it."""
    schema = _schema()
    stack: list[tuple[int, str]] = []
    previous = ""
    undescribed = []
    for line in (CHART / "values.yaml").read_text().splitlines():
        match = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if match:
            indent, key = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = (*(k for _, k in stack), key)
            stack.append((indent, key))
            _, parent, own = _declared(path, schema)
            if own and parent.get("additionalProperties", True) is False \
                    and not previous.lstrip().startswith("#"):
                undescribed.append(".".join(path))
        if line.strip():
            previous = line
    assert not undescribed


@pytest.mark.parametrize(("setting", "named"), [
    ("image.pullPolicy=Sometimes", "pullPolicy"),
    ("operator.watchNamespaces[0]=Not_A_Namespace", "watchNamespaces"),
    ("nodeHealth.gpu=cuda", "gpu"),
    ("dashboard.service.port=70000", "port"),
    ("operator.probe.everySeconds=3", "everySeconds"),
    ("clickhouse.url=mysql://db:3306/x", "url"),
])
def test_the_schema_refuses_a_bad_value_by_name(helm: Helm, setting: str, named: str) -> None:
    done = helm.run("template", "tracehound", str(CHART), "--set", setting)
    assert done.returncode != 0, f"--set {setting} rendered"
    assert "schema" in done.stderr and named in done.stderr, done.stderr


def test_a_store_is_required(helm: Helm) -> None:
    done = helm.run("template", "tracehound", str(CHART), "--set", "clickhouse.url=")
    assert done.returncode != 0
    assert "clickhouse.url: required unless clickhouse.existingSecret" in done.stderr
