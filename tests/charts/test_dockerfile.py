"""What can be checked of the Dockerfile without building it: the image is NOT built here (there is
no Docker engine on these machines), so these tests read the Dockerfile and .dockerignore and hold
them to the project and the chart: a numeric non-root USER equal to the chart's runAsUser,
ENTRYPOINT `tracehound` (a console script of the project), the CPU torch wheel pinned to the version
the Makefile pins and installed before the project (with every extra), the reference the Dockerfile
says it is built as equal to the chart's default image, labels, no secrets, and a .dockerignore that
keeps the venv and git history out of the build context."""

from __future__ import annotations

import json
import re
import tomllib
from typing import Any

import pytest
import yaml
from chart_harness import CHART, REPO

from tracehound.controller.orchestrators.kubeobjects import AGENT_UID

DOCKERFILE = REPO / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text = (pending + line).strip()
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends in a continuation line"
    return out


def only(instruction: str) -> str:
    found = [rest for word, rest in instructions() if word == instruction]
    assert len(found) == 1, f"expected one {instruction}, found {found}"
    return found[0]


def pyproject() -> dict[str, Any]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def chart_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def test_the_base_is_python_311_slim() -> None:
    assert only("FROM") == "python:3.11-slim"
    assert pyproject()["project"]["requires-python"] == ">=3.11"


def test_the_user_is_numeric_non_root_and_the_charts_run_as_user() -> None:
    user, _, group = only("USER").partition(":")
    assert user.isdigit() and group.isdigit(), "a numeric USER lets runAsNonRoot check it"
    assert int(user) != 0 and int(group) != 0
    values = chart_values()
    assert int(user) == AGENT_UID == values["podSecurityContext"]["runAsUser"] \
        == values["containerSecurityContext"]["runAsUser"] \
        == values["sidecar"]["securityContext"]["runAsUser"]
    assert int(group) == values["podSecurityContext"]["fsGroup"]
    # the USER comes last: nothing after it runs as root
    assert [w for w, _ in instructions()][-3:] == ["USER", "ENTRYPOINT", "CMD"]


def test_the_entrypoint_is_the_tracehound_command() -> None:
    assert json.loads(only("ENTRYPOINT")) == ["tracehound"]
    assert "tracehound" in pyproject()["project"]["scripts"]


def test_torch_is_the_cpu_wheel_pinned_as_in_the_makefile_and_comes_first() -> None:
    """The package does not require torch (training images bring their own); the image, like
    `make setup`, installs the one CPU build the Makefile pins, before the project with every
    extra (the image runs the operator and the dashboard too)."""
    assert not [d for d in pyproject()["project"]["dependencies"] if d.startswith("torch")]
    [pin] = re.findall(r"pip install -q (?:--\S+ )*(torch==[\d.]+)",
                       (REPO / "Makefile").read_text())
    runs = [rest for word, rest in instructions() if word == "RUN"]
    torch_runs = [i for i, r in enumerate(runs) if re.search(r"\btorch\b", r)]
    project_runs = [i for i, r in enumerate(runs)
                    if re.search(r'pip install (\S+ )*"\.\[all\]"(\s|$)', r)]
    assert len(torch_runs) == 1 and len(project_runs) == 1
    torch_run = runs[torch_runs[0]]
    assert re.search(rf"(^|\s){re.escape(pin)}(\s|$)", torch_run), torch_run
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_run
    assert torch_runs[0] < project_runs[0], "torch must be installed before the project"


def test_every_package_of_the_project_is_copied() -> None:
    copied = {rest.split()[0] for word, rest in instructions() if word == "COPY"}
    package_dirs = set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    assert package_dirs <= copied
    assert {"pyproject.toml", "README.md"} <= {
        part for word, rest in instructions() if word == "COPY" for part in rest.split()}


def test_the_documented_reference_is_the_charts_default_image() -> None:
    built = re.findall(r"docker build -t (\S+) \.", DOCKERFILE.read_text())
    assert len(built) == 1, "the Dockerfile names the reference it is built as, once"
    repository, _, tag = built[0].rpartition(":")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    image = chart_values()["image"]
    assert repository == image["repository"]
    assert image["tag"] == "" and tag == chart["appVersion"]  # the tag is the appVersion
    assert chart["appVersion"] == pyproject()["project"]["version"]


def test_labels_name_the_image_and_its_version() -> None:
    labels = dict(re.findall(r'(org\.opencontainers\.image\.[\w.]+)="([^"]*)"', only("LABEL")))
    assert labels["org.opencontainers.image.title"] == "tracehound"
    assert labels["org.opencontainers.image.licenses"] == pyproject()["project"]["license"]
    assert labels["org.opencontainers.image.description"]
    version = labels["org.opencontainers.image.version"]
    assert version == "${VERSION}"
    assert only("ARG") == f"VERSION={pyproject()['project']['version']}"


@pytest.mark.parametrize("pattern", [
    r"(?i)(password|passwd|token|secret|api[_-]?key)\s*=",
    r"clickhouse://[^\s:@/]+:[^\s@]+@",  # a URL with credentials
    r"(?i)^\s*(ENV|ARG)\s+TRACEHOUND_(STORE|SINK|ALERTS)\b",
])
def test_no_secret_is_baked_in(pattern: str) -> None:
    text = "\n".join(f"{w} {r}" for w, r in instructions())
    assert not re.search(pattern, text, re.MULTILINE)


@pytest.mark.parametrize("entry", [".venv", ".git", ".tools", "tests", "charts"])
def test_dockerignore_keeps_the_context_small(entry: str) -> None:
    ignored = {line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text()
               .splitlines() if line.strip() and not line.startswith("#")}
    assert entry in ignored
