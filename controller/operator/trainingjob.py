"""The `TrainingJob` custom resource: its schema (the CRD the chart installs) and its spec, read
and checked field by field.

The API server checks a TrainingJob against the CRD's OpenAPI schema (`crd_manifest`) before
anyone sees it; the operator checks it again here (`read_spec`), because a schema cannot say
everything (a policy's keys, a command that is empty once split, more warm standbys than spare
nodes) and because an object written before a CRD upgrade may not match the schema in force.
A spec the operator refuses is reported on the resource (status phase `Invalid`, a condition and
a Warning event) with the field named, and nothing is created for it.

This module only describes and reads; it must never call the Kubernetes API.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from tracehound.controller.orchestrators.jobspec import (
    DEFAULT_MASTER_PORT,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    TrainingJobSpec,
)
from tracehound.controller.policy.file import PolicyConfigError, policy_from_document
from tracehound.controller.policy.recovery import PolicySettings


class SpecError(ValueError):
    """A TrainingJob spec the operator cannot run; the message names the field."""


def _string_list(description: str) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string"}, "description": description}


def spec_schema() -> dict[str, Any]:
    """The OpenAPI v3 schema of a TrainingJob's spec (structural, as CRDs require)."""
    free = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    return {
        "type": "object",
        "required": ["image", "command", "nodes"],
        "properties": {
            "image": {"type": "string", "minLength": 1,
                      "description": "The training image, used as it is."},
            "command": {**_string_list("What each rank runs, e.g. [python, train.py]."),
                        "minItems": 1},
            "nodes": {"type": "integer", "minimum": 1,
                      "description": "Nodes (pods) to train on."},
            "procsPerNode": {"type": "integer", "minimum": 1, "default": 1,
                             "description": "Ranks per node (torchrun --nproc-per-node)."},
            "spareNodes": {"type": "integer", "minimum": 0, "default": 0,
                           "description": "Healthy nodes kept free to replace an isolated one."},
            "warmStandby": {"type": "integer", "minimum": 0, "default": 0,
                            "description": "Standby pods warming spare nodes (at most "
                                           "spareNodes)."},
            "nodeSelector": {"type": "object", "additionalProperties": {"type": "string"},
                             "description": "Labels of the nodes the job may use."},
            "checkpointDir": {"type": "string",
                              "description": "Where the script keeps its checkpoints."},
            "env": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "Extra environment of every rank."},
            "resources": {**free, "description": "The trainer container's resources."},
            "volumes": {"type": "array", "items": free,
                        "description": "Pod volumes (checkpoints, data), passed through."},
            "volumeMounts": {"type": "array", "items": free,
                             "description": "The trainer container's volume mounts."},
            "masterPort": {"type": "integer", "minimum": 1, "maximum": 65535,
                           "default": DEFAULT_MASTER_PORT,
                           "description": "torchrun's rendezvous port on node 0."},
            "policy": {**free, "description": "A policy document (`tracehound policy "
                                              "--defaults`); the defaults when absent."},
        },
    }


def status_schema() -> dict[str, Any]:
    return {
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": {
            "phase": {"type": "string"},
            "attempt": {"type": "integer"},
            "restarts": {"type": "integer"},
            "lastIncident": {"type": "string"},
            "isolatedNodes": {"type": "array", "items": {"type": "string"}},
            "nodes": {"type": "array", "items": {"type": "string"}},
            "message": {"type": "string"},
            "conditions": {"type": "array", "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string"},
                    "status": {"type": "string"},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "lastTransitionTime": {"type": "string"},
                },
            }},
        },
    }


def crd_manifest() -> dict[str, Any]:
    """The CustomResourceDefinition of TrainingJob (apiextensions.k8s.io/v1)."""
    columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Attempt", "type": "integer", "jsonPath": ".status.attempt"},
        {"name": "Isolated", "type": "string", "jsonPath": ".status.isolatedNodes"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": SINGULAR, "kind": KIND,
                      "shortNames": list(SHORT_NAMES)},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "required": ["spec"],
                    "properties": {"spec": spec_schema(), "status": status_schema()},
                }},
            }],
        },
    }


class _PlainDumper(yaml.SafeDumper):  # type: ignore[misc]
    """Writes a repeated sub-schema out in full: no &anchors and *aliases in a manifest."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def crd_yaml() -> str:
    return "# Generated by `tracehound operator --crd`: edit controller/trainingjob.py instead.\n" \
        + str(yaml.dump(crd_manifest(), Dumper=_PlainDumper, sort_keys=False))


# -- reading a spec ------------------------------------------------------------------------------
_KNOWN = tuple(spec_schema()["properties"])


def read_spec(spec: object, *, source: str) -> TrainingJobSpec:
    """The checked spec of a TrainingJob; SpecError naming `source` and the field otherwise."""

    def fail(at: str, message: str) -> SpecError:
        return SpecError(f"{source}: spec.{at}: {message}" if at else f"{source}: spec: {message}")

    if not isinstance(spec, Mapping):
        raise fail("", f"expected a mapping, got {spec!r}")
    for key in spec:
        if key not in _KNOWN:
            raise fail(str(key), f"unknown field (allowed: {', '.join(_KNOWN)})")
    for key in ("image", "command", "nodes"):
        if key not in spec:
            raise fail(key, "required")

    def text(key: str, default: str = "") -> str:
        value = spec.get(key, default)
        if not isinstance(value, str):
            raise fail(key, f"expected a string, got {value!r}")
        return value

    def integer(key: str, default: int, minimum: int, maximum: int | None = None) -> int:
        value = spec.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(key, f"expected an integer, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
            raise fail(key, f"expected an integer {bound}, got {value}")
        return value

    def strings(key: str) -> dict[str, str]:
        value = spec.get(key, {})
        if not isinstance(value, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise fail(key, f"expected a mapping of strings to strings, got {value!r}")
        return dict(value)

    def objects(key: str) -> tuple[Mapping[str, Any], ...]:
        value = spec.get(key, [])
        if not isinstance(value, Sequence) or isinstance(value, str) or not all(
                isinstance(v, Mapping) for v in value):
            raise fail(key, f"expected a list of objects, got {value!r}")
        return tuple(dict(v) for v in value)

    image = text("image")
    if not image.strip():
        raise fail("image", "expected an image reference, got an empty string")
    command = spec["command"]
    if (not isinstance(command, Sequence) or isinstance(command, str)
            or not all(isinstance(c, str) for c in command)):
        raise fail("command", f"expected a list of strings, got {command!r}")
    if not command or not command[0].strip():
        raise fail("command", "expected the program to run first (e.g. [python, train.py]), "
                              "got an empty command")
    resources = spec.get("resources", {})
    if not isinstance(resources, Mapping):
        raise fail("resources", f"expected a mapping (requests, limits), got {resources!r}")
    nodes = integer("nodes", 1, 1)
    spare = integer("spareNodes", 0, 0)
    warm = integer("warmStandby", 0, 0)
    if warm > spare:
        raise fail("warmStandby", f"expected at most spareNodes ({spare}), got {warm}")
    policy = PolicySettings()
    if "policy" in spec:
        try:
            policy = policy_from_document(spec["policy"], source=f"{source}: spec.policy")
        except PolicyConfigError as exc:
            raise SpecError(str(exc)) from None
    return TrainingJobSpec(
        image=image, command=tuple(command), nodes=nodes,
        procs_per_node=integer("procsPerNode", 1, 1), spare_nodes=spare, warm_standby=warm,
        node_selector=strings("nodeSelector"), checkpoint_dir=text("checkpointDir"),
        env=strings("env"), resources=dict(resources), volumes=objects("volumes"),
        volume_mounts=objects("volumeMounts"),
        master_port=integer("masterPort", DEFAULT_MASTER_PORT, 1, 65535), policy=policy,
    )
