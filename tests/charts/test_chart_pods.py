"""Every pod the chart runs is non-root and locked down, with requests and limits; the operator
Deployment keeps its contract with the operator (args, environment, mounts, probes, one replica);
the dashboard and the node-health DaemonSet render as the commands they run expect."""

from __future__ import annotations

from typing import Any

import pytest
from chart_harness import Rendered, containers, env_of, pod_specs, resolved_env

from tracehound.agent.node.daemon import parse_args
from tracehound.controller.alerts import load_receivers
from tracehound.controller.orchestrators.kubeobjects import AGENT_UID, restricted_security_context

STORE_URL = "clickhouse://default:@clickhouse:9000/tracehound"


def assert_restricted(where: str, security: dict[str, Any]) -> None:
    """Non-root (10001), no privilege escalation, read-only root, no capability, RuntimeDefault."""
    for key, value in restricted_security_context().items():
        assert security.get(key) == value, f"{where}: securityContext.{key} = {security.get(key)}"
    assert not security.get("privileged"), f"{where}: privileged"
    assert "add" not in security["capabilities"], f"{where}: adds capabilities"


def assert_requests_and_limits(where: str, resources: dict[str, Any]) -> None:
    for kind in ("requests", "limits"):
        assert set(resources.get(kind, {})) >= {"cpu", "memory"}, f"{where}: no {kind}"


def test_every_pod_and_container_runs_non_root_and_locked_down(render: Rendered) -> None:
    pods = pod_specs(render)
    assert pods
    for name, spec in pods:
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == AGENT_UID, name
        assert pod["fsGroup"] == AGENT_UID, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert "hostNetwork" not in spec and "hostPID" not in spec, name
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name
        for container in containers(spec):
            where = f"{name}: {container['name']}"
            assert_restricted(where, container["securityContext"])
            assert_requests_and_limits(where, container["resources"])
            # the root file system is read-only: every path it writes is a volume
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"]), where


def _operator(rendered: Rendered) -> dict[str, Any]:
    return rendered.one("Deployment", "tracehound-operator")


def _only_container(workload: dict[str, Any]) -> dict[str, Any]:
    [container] = workload["spec"]["template"]["spec"]["containers"]
    return container


def _mounts(workload: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """mountPath -> the volume mounted there."""
    spec = workload["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: volumes[m["name"]] for m in _only_container(workload)["volumeMounts"]}


def _port(container: dict[str, Any], name: str) -> int:
    [port] = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def test_the_operator_is_one_replica_recreated(render: Rendered) -> None:
    spec = _operator(render)["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


@pytest.mark.parametrize(("values", "image", "namespaces", "secret"), [
    ("default", "ghcr.io/tracehound/tracehound:0.1.0", "", ("tracehound-clickhouse", "url")),
    ("custom", "registry.example/ml/tracehound:0.1.0-test", "ml-team-a,ml-team-b",
     ("ml-clickhouse", "dsn")),
])
def test_the_operator_gets_what_it_reads(request: pytest.FixtureRequest, values: str, image: str,
                                         namespaces: str, secret: tuple[str, str]) -> None:
    rendered: Rendered = request.getfixturevalue(f"{values}_render")
    operator = _operator(rendered)
    container = _only_container(operator)
    assert container["image"] == image
    assert container["args"] == ["operator", "--liveness=http://0.0.0.0:8080/healthz"]
    env = env_of(container)
    assert env["TRACEHOUND_STORE"]["valueFrom"] == {
        "secretKeyRef": {"name": secret[0], "key": secret[1]}}
    assert env["TRACEHOUND_IMAGE"]["value"] == image
    assert env["TRACEHOUND_NAMESPACE"]["value"] == namespaces
    assert env["TRACEHOUND_SIDECAR_TEMPLATE"]["value"] == "/etc/tracehound/sidecar/sidecar.yaml"
    assert _mounts(operator)["/etc/tracehound/sidecar"]["configMap"] == {
        "name": "tracehound-sidecar"}
    for probe in (container["livenessProbe"], container["readinessProbe"]):
        assert probe["httpGet"]["path"] == "/healthz"
        assert _port(container, probe["httpGet"]["port"]) == 8080
    if values == "default":  # the store Secret is the chart's own
        stored = rendered.one("Secret", secret[0])
        assert stored["stringData"] == {"url": STORE_URL}


def test_global_alert_receivers_reach_the_operator_from_a_secret(
        custom_render: Rendered, tmp_path: Any) -> None:
    operator = _operator(custom_render)
    path = env_of(_only_container(operator))["TRACEHOUND_ALERTS"]["value"]
    assert path == "/etc/tracehound/alerts/alerts.yaml"
    volume = _mounts(operator)["/etc/tracehound/alerts"]
    secret = custom_render.one("Secret", volume["secret"]["secretName"])
    receivers_file = tmp_path / "alerts.yaml"
    receivers_file.write_text(secret["stringData"]["alerts.yaml"])
    # the operator's own reader accepts what the chart wrote
    assert [r.name for r in load_receivers(receivers_file)] == ["oncall"]


def test_no_alerts_no_alerts_secret(default_render: Rendered) -> None:
    operator = _operator(default_render)
    assert "TRACEHOUND_ALERTS" not in env_of(_only_container(operator))
    assert "/etc/tracehound/alerts" not in _mounts(operator)


def test_the_operator_state_lives_on_the_claim_given(default_render: Rendered,
                                                     custom_render: Rendered) -> None:
    for rendered in (default_render, custom_render):
        env = env_of(_only_container(_operator(rendered)))
        assert env["TRACEHOUND_WORKDIR"]["value"] == "/var/lib/tracehound"
    assert _mounts(_operator(default_render))["/var/lib/tracehound"]["emptyDir"] == {}
    assert _mounts(_operator(custom_render))["/var/lib/tracehound"]["persistentVolumeClaim"] == {
        "claimName": "tracehound-operator-state"}


def test_the_dashboard_renders_only_when_enabled(default_render: Rendered,
                                                 custom_render: Rendered) -> None:
    assert [d["metadata"]["name"] for d in default_render.of_kind("Deployment")] == [
        "tracehound-operator"]
    assert default_render.of_kind("Service") == []
    dashboard = custom_render.one("Deployment", "tracehound-dashboard")
    assert dashboard["spec"]["replicas"] == 2
    container = _only_container(dashboard)
    assert container["args"] == ["ui", "--port", "8501", "--address", "0.0.0.0"]
    assert env_of(container)["TRACEHOUND_STORE"]["valueFrom"] == {
        "secretKeyRef": {"name": "ml-clickhouse", "key": "dsn"}}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/_stcore/health"
        assert _port(container, container[probe]["httpGet"]["port"]) == 8501
    service = custom_render.one("Service", "tracehound-dashboard")
    [port] = service["spec"]["ports"]
    assert port["port"] == 8501 and _port(container, port["targetPort"]) == 8501
    assert service["spec"]["type"] == "NodePort"
    labels = dashboard["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert dashboard["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_node_health_daemonset_starts_an_agent_of_its_own_job(custom_render: Rendered,
                                                                  default_render: Rendered) -> None:
    assert default_render.of_kind("DaemonSet") == []
    daemonset = custom_render.one("DaemonSet", "tracehound-node-health")
    spec = daemonset["spec"]["template"]["spec"]
    container = _only_container(daemonset)
    assert container["args"][:5] == ["agent", "--gpu", "sim", "--health-interval", "5"]
    env = env_of(container)
    assert env["TRACEHOUND_NODE_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["TRACEHOUND_SINK"]["valueFrom"] == {
        "secretKeyRef": {"name": "ml-clickhouse", "key": "dsn"}}
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "gpu-large"}
    assert spec["tolerations"][0]["key"] == "nvidia.com/gpu"
    # the agent's own parser takes these arguments and this environment
    args = parse_args(container["args"][1:], env=resolved_env(
        container, secret_value="clickhouse://u:p@ch:9000/tracehound", node_name="gpu-7"))
    assert (args.job, args.node, args.gpu, args.health_interval) == (
        "fleet-health", "gpu-7", "sim", 5.0)
    assert args.socket == "/var/run/tracehound/agent.sock"
    assert args.spool == "/var/run/tracehound/spool"
    assert args.sink == "clickhouse://u:p@ch:9000/tracehound"


def test_an_agent_without_a_job_is_refused() -> None:
    """Why nodeHealth.jobId exists: `tracehound agent` needs a job id (an empty one is refused)."""
    with pytest.raises(SystemExit):
        parse_args(["--gpu", "auto"], env={"TRACEHOUND_JOB_ID": "",
                                           "TRACEHOUND_SINK": "clickhouse://u:p@ch:9000/db"})
