"""The sidecar the operator injects is the chart's template: with the default values the
ConfigMap holds exactly the operator's own default (`default_sidecar`), other values show in it,
the operator's loader accepts it, a rank pod built with it is valid Kubernetes, and the agent it
starts gets a job, node, socket, spool and sink from that pod's environment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from chart_harness import NAMESPACE, Helm, Rendered, env_of, resolved_env

from tracehound.agent.node.daemon import parse_args
from tracehound.controller.operator.trainingjob import read_spec
from tracehound.controller.orchestrators.kubeobjects import (
    RUN_DIR,
    SIDECAR_NAME,
    default_sidecar,
    load_sidecar_template,
    rank_pod,
    restricted_security_context,
)
from tracehound.controller.orchestrators.port import AttemptPlan
from tracehound.tracing.ids import JobId, NodeId


def sidecar_of(rendered: Rendered) -> dict[str, Any]:
    configmap = rendered.one("ConfigMap", "tracehound-sidecar")
    assert set(configmap["data"]) == {"sidecar.yaml"}
    container: dict[str, Any] = yaml.safe_load(configmap["data"]["sidecar.yaml"])
    return container


def operator_image(rendered: Rendered) -> str:
    deployment = rendered.one("Deployment", "tracehound-operator")
    image: str = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    return image


def test_default_values_give_the_operators_default_sidecar(
        default_render: Rendered, default_values: dict[str, Any]) -> None:
    [store] = [s for s in default_render.of_kind("Secret")
               if s["metadata"]["labels"]["app.kubernetes.io/component"] == "store"]
    assert sidecar_of(default_render) == default_sidecar(
        image=operator_image(default_render), store_secret=store["metadata"]["name"],
        store_secret_key="url", pull_policy=default_values["image"]["pullPolicy"])


def test_other_values_show_in_the_sidecar(custom_render: Rendered,
                                          custom_values: dict[str, Any]) -> None:
    sidecar = sidecar_of(custom_render)
    wanted = custom_values["sidecar"]
    assert sidecar["image"] == operator_image(custom_render)
    assert sidecar["imagePullPolicy"] == "Always"
    assert sidecar["resources"] == wanted["resources"]
    assert sidecar["securityContext"] == wanted["securityContext"]
    assert sidecar["env"][0]["valueFrom"] == {
        "secretKeyRef": {"name": "ml-clickhouse", "key": "dsn"}}
    assert sidecar["env"][-len(wanted["extraEnv"]):] == wanted["extraEnv"]
    # everything else is the operator's default
    default = default_sidecar(image=sidecar["image"], store_secret="ml-clickhouse",
                              store_secret_key="dsn", pull_policy="Always")
    changed = {"resources", "securityContext", "env"}
    assert {k: v for k, v in sidecar.items() if k not in changed} == {
        k: v for k, v in default.items() if k not in changed}
    assert sidecar["env"][:len(default["env"])] == default["env"]


@pytest.fixture
def template_file(render: Rendered, tmp_path: Path) -> Path:
    """The ConfigMap's sidecar.yaml as the operator finds it mounted."""
    path = tmp_path / "sidecar.yaml"
    path.write_text(render.one("ConfigMap", "tracehound-sidecar")["data"]["sidecar.yaml"])
    return path


def test_the_operator_loads_the_template_and_builds_a_valid_rank_pod(template_file: Path) -> None:
    template = load_sidecar_template(template_file)
    assert template["name"] == SIDECAR_NAME
    spec = read_spec({"image": "registry.example/train:1", "command": ["python", "train.py"],
                      "nodes": 2}, source="test")
    plan = AttemptPlan(job=JobId("ml-team-a.exp7"), attempt=3,
                       nodes=(NodeId("gpu-1"), NodeId("gpu-2")), nproc_per_node=1,
                       command=spec.command)
    pod = rank_pod(spec=spec, plan=plan, resource="exp7", node_rank=1, namespace="ml-team-a",
                   sidecar=template, recorder_image=template["image"])
    kubernetes_validate.validate(pod, "1.33", strict=True)
    [agent] = [c for c in pod["spec"]["initContainers"] if c["name"] == SIDECAR_NAME]
    assert agent["securityContext"].items() >= restricted_security_context().items()
    # the agent that container starts has what it needs, from the pod's environment
    args = parse_args(agent["args"][1:], env=resolved_env(
        agent, secret_value="clickhouse://u:p@ch:9000/tracehound", node_name="gpu-2"))
    assert (args.job, args.node) == ("ml-team-a.exp7", "gpu-2")
    assert args.socket == f"{RUN_DIR}/agent.sock"
    assert args.spool == f"{RUN_DIR}/spool"
    assert args.sink == "clickhouse://u:p@ch:9000/tracehound"
    assert env_of(agent)["TRACEHOUND_ATTEMPT"]["value"] == "3"


def test_the_store_secret_is_in_every_namespace_whose_pods_read_it(helm: Helm) -> None:
    """The sidecar reads the store URL from a Secret of the rank pod's own namespace, so the
    chart writes its Secret into each watched namespace (and its own, for the operator)."""
    rendered = helm.template("--set", "operator.watchNamespaces={ml-a,ml-b}")
    secrets = [s for s in rendered.of_kind("Secret") if s["metadata"]["name"]
               == sidecar_of(rendered)["env"][0]["valueFrom"]["secretKeyRef"]["name"]]
    assert sorted(s["metadata"]["namespace"] for s in secrets) == sorted(
        ["ml-a", "ml-b", NAMESPACE])
    assert all(s["stringData"] == secrets[0]["stringData"] for s in secrets)
