"""The TrainingJob spec, the objects built for it, the operator's configuration and the
recorder bundle: pure pieces, no API server involved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tracehound.controller.cli.main import main
from tracehound.controller.operator.handlers import config_from_args, status_of
from tracehound.controller.operator.trainingjob import SpecError, crd_manifest, crd_yaml, read_spec
from tracehound.controller.orchestrators import kubeobjects as ko
from tracehound.controller.orchestrators.kubernetes import to_model
from tracehound.controller.orchestrators.port import AttemptPlan
from tracehound.tracing.events import JobPhase, JobState
from tracehound.tracing.ids import JobId, NodeId

SPEC: dict[str, Any] = {"image": "img:1", "command": ["python", "train.py"], "nodes": 2}


def test_a_minimal_spec_gets_the_defaults() -> None:
    spec = read_spec(SPEC, source="TrainingJob ml/a")
    assert spec.procs_per_node == 1 and spec.spare_nodes == 0 and spec.master_port == 29500
    assert spec.command == ("python", "train.py") and spec.policy.max_restarts >= 0


@pytest.mark.parametrize(("change", "named"), [
    ({"command": "python train.py"}, "spec.command: expected a list of strings"),
    ({"command": [""]}, "spec.command: expected the program to run first"),
    ({"nodes": True}, "spec.nodes: expected an integer, got True"),
    ({"masterPort": 70000}, "spec.masterPort: expected an integer from 1 to 65535"),
    ({"nodeSelector": {"pool": 1}}, "spec.nodeSelector: expected a mapping of strings"),
    ({"procPerNode": 2}, "spec.procPerNode: unknown field"),
    ({"volumes": ["data"]}, "spec.volumes: expected a list of objects"),
    ({"policy": {"version": 1, "rules": {"hang": {"act_from": "high"}}}}, "rules.hang.act_from"),
])
def test_a_bad_spec_is_refused_naming_the_job_and_the_field(change: dict[str, Any],
                                                            named: str) -> None:
    with pytest.raises(SpecError) as caught:
        read_spec({**SPEC, **change}, source="TrainingJob ml/a")
    assert "TrainingJob ml/a" in str(caught.value) and named in str(caught.value)


def test_the_crd_yaml_is_the_manifest_without_yaml_aliases() -> None:
    text = crd_yaml()
    assert yaml.safe_load(text) == crd_manifest()
    assert "&id" not in text and "*id" not in text


def test_a_rank_pod_is_a_valid_pod_model_that_keeps_the_user_image_and_our_variables() -> None:
    spec = read_spec({**SPEC, "procsPerNode": 4, "env": {"TRACEHOUND_JOB_ID": "mine", "X": "1"},
                      "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "c"}}],
                      "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}]},
                     source="t")
    plan = AttemptPlan(job=JobId("ml.a"), attempt=3, nodes=(NodeId("n1"), NodeId("n2")),
                       nproc_per_node=4, command=spec.command)
    body = ko.rank_pod(spec=spec, plan=plan, resource="a", node_rank=1, namespace="ml",
                       sidecar=ko.default_sidecar(image="th:1"), recorder_image="th:1",
                       owner={"metadata": {"name": "a", "uid": "u-1"}})
    pod = to_model(client.ApiClient(), body, "V1Pod")
    assert isinstance(pod, client.V1Pod)
    assert pod.metadata.name == "a-a3-n1" and pod.metadata.owner_references[0].uid == "u-1"
    assert [c.name for c in pod.spec.init_containers] == [ko.RECORDER_NAME, ko.SIDECAR_NAME]
    assert pod.spec.init_containers[1].restart_policy == "Always"  # a native sidecar
    (trainer,) = pod.spec.containers
    assert trainer.image == "img:1"
    assert "--master-addr=a-a3-n0.a.ml.svc" in trainer.command
    env = {e.name: e.value for e in trainer.env}
    assert env["TRACEHOUND_JOB_ID"] == "ml.a" and env["X"] == "1", "the user's env cannot " \
        "rename the job"
    assert [v.name for v in pod.spec.volumes][-1] == "ckpt"
    assert pod.spec.security_context.fs_group == ko.AGENT_UID


def test_status_mirrors_a_state() -> None:
    state = JobState(job=JobId("ml.a"), time_us=1, seq=4, state=JobPhase.RESTARTING, attempt=2,
                     incident_id="ml.a/1/3", nodes=("n1", "n3"), isolated=("n2",), plan="",
                     detail="", controller="c")
    status = status_of(state)
    assert status["phase"] == "Restarting" and status["restarts"] == 2
    assert status["isolatedNodes"] == ["n2"] and status["lastIncident"] == "ml.a/1/3"
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {"Healthy": "False", "Recovering": "True"}


def _operator_args(*extra: str) -> Any:
    from tracehound.controller.cli.main import _parser

    return _parser().parse_args(["operator", *extra])


def test_operator_configuration_comes_from_flags_then_the_environment(tmp_path: Path) -> None:
    template = tmp_path / "sidecar.yaml"
    template.write_text(yaml.safe_dump(ko.default_sidecar(image="th:2")))
    config = config_from_args(_operator_args("--namespace", "ml"), {
        "TRACEHOUND_SIDECAR_TEMPLATE": str(template), "TRACEHOUND_IMAGE": "th:2",
        "TRACEHOUND_NAMESPACE": "a,b", "TRACEHOUND_STORE": "clickhouse://h:9000/db"})
    assert config.namespaces == ("ml",) and config.image == "th:2"
    assert config.sidecar["image"] == "th:2" and config.store_url == "clickhouse://h:9000/db"
    config = config_from_args(_operator_args(), {"TRACEHOUND_NAMESPACE": "a, b"})
    assert config.namespaces == ("a", "b") and config.sidecar == ko.default_sidecar(
        image=config.image)


def test_a_bad_sidecar_template_is_refused_naming_the_file(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           ) -> None:
    template = tmp_path / "sidecar.yaml"
    template.write_text(yaml.safe_dump({"name": "agent", "image": "x"}))
    assert main(["operator", "--sidecar-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert str(template) in err and "name: expected 'tracehound-agent'" in err


def test_the_bundle_imports_in_an_interpreter_without_site_packages(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "tracehound.controller.cli", "bundle", "--into",
                          str(tmp_path / "b"), "--json"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["check"] == "ok"
    assert (tmp_path / "b" / "bootstrap" / "sitecustomize.py").is_file()
    # the check really runs without site-packages: a bundle missing msgspec fails it
    import shutil

    shutil.rmtree(tmp_path / "b" / "site" / "msgspec")
    from tracehound.controller.cli.bundle import check_bundle

    assert "msgspec" in check_bundle(tmp_path / "b")
