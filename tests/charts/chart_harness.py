"""A real helm binary for the chart tests, and what `helm template` renders, as objects.

helm is $TRACEHOUND_HELM, else `.tools/bin/helm` (what scripts/install-helm.sh installs; the
test command runs it first), else the one on PATH. Without any, the chart tests FAIL and say how
to get one: a chart nobody rendered is not a chart that passed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "tracehound"
CUSTOM_VALUES = Path(__file__).with_name("custom-values.yaml")
RELEASE = "tracehound"
NAMESPACE = "tracehound-system"
HELM_ENV = "TRACEHOUND_HELM"


def find_helm() -> str:
    """The helm binary to use; fails the test (never skips) when there is none."""
    given = os.environ.get(HELM_ENV)
    if given:
        if not os.access(given, os.X_OK):
            pytest.fail(f"${HELM_ENV}={given} is not an executable helm")
        return given
    local = REPO / ".tools" / "bin" / "helm"
    if os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("helm")
    if found:
        return found
    pytest.fail(f"no helm found ({HELM_ENV}, {local.relative_to(REPO)}, PATH): run "
                "scripts/install-helm.sh (scripts/test.sh does) to install it into .tools/bin")


@dataclass(frozen=True)
class Rendered:
    """The objects one `helm template --include-crds` printed, in order."""

    docs: tuple[dict[str, Any], ...]

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.docs if d["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        found = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}: " + ", ".join(
            f"{d['kind']}/{d['metadata']['name']}" for d in self.docs)
        return found[0]

    def kinds(self) -> list[str]:
        return sorted(d["kind"] for d in self.docs)


@dataclass(frozen=True)
class Helm:
    path: str

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.path, *args], capture_output=True, text=True, check=False,
                              cwd=REPO)

    def template(self, *args: str) -> Rendered:
        """The chart rendered as release RELEASE in NAMESPACE with extra `args` (-f, --set)."""
        done = self.run("template", RELEASE, str(CHART), "--namespace", NAMESPACE,
                        "--include-crds", *args)
        assert done.returncode == 0, f"helm template {' '.join(args)} failed:\n{done.stderr}"
        docs = tuple(d for d in yaml.safe_load_all(done.stdout) if d)
        return Rendered(docs)


WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")


def pod_specs(rendered: Rendered) -> list[tuple[str, dict[str, Any]]]:
    """(kind/name, pod spec) of every workload the chart renders."""
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"])
            for d in rendered.docs if d["kind"] in WORKLOADS]


def containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod_spec.get("initContainers", []), *pod_spec["containers"]]


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A container's environment entries by name (a name given twice fails)."""
    names = [e["name"] for e in container.get("env", [])]
    assert len(names) == len(set(names)), f"{container['name']}: an env name twice: {names}"
    return {e["name"]: e for e in container.get("env", [])}


def resolved_env(container: dict[str, Any], *, secret_value: str,
                 node_name: str) -> dict[str, str]:
    """A container's environment as the kubelet would give it: Secret references resolve to
    `secret_value`, the downward API's spec.nodeName to `node_name`."""
    out: dict[str, str] = {}
    for name, entry in env_of(container).items():
        source = entry.get("valueFrom")
        if source is None:
            out[name] = entry.get("value", "")
        elif "secretKeyRef" in source:
            out[name] = secret_value
        elif source.get("fieldRef", {}).get("fieldPath") == "spec.nodeName":
            out[name] = node_name
        else:
            raise AssertionError(f"{container['name']}: {name}: unexpected source {source}")
    return out
