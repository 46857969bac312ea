"""The Kubernetes objects the operator creates for a TrainingJob, as the Kubernetes client's
models: one pod per node of an attempt, a headless Service for torchrun's rendezvous, standby
pods on spare nodes.

A rank pod holds three containers, and the user's image is used as it is:

    tracehound-recorder  init container (Tracehound's image): copies the recorder into the
                         shared volume /opt/tracehound (`tracehound bundle`)
    tracehound-agent     native sidecar (an init container with restartPolicy Always, Kubernetes
                         >= 1.29): the node agent, on the socket /var/run/tracehound/agent.sock;
                         built from the sidecar template (the chart's ConfigMap, else
                         `default_sidecar`) plus the job, node and attempt of the pod
    trainer              the user's image and command, started by torchrun; PYTHONPATH puts the
                         recorder's sitecustomize first, the TRACEHOUND_* variables name the
                         job, node, attempt and socket

Pods are pinned to their node (node affinity on kubernetes.io/hostname), so a replacement takes
an isolated node's place and every other node keeps its node rank. The node's name reaches the
recorder and the agent through the downward API (spec.nodeName), so a verdict names the
Kubernetes node that is cordoned.

This module only builds objects; it must never call the API.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from tracehound.controller.orchestrators.jobspec import GROUP, KIND, VERSION, TrainingJobSpec
from tracehound.controller.orchestrators.port import AttemptPlan
from tracehound.tracing import settings as env

LABEL_JOB = "tracehound.io/job"
LABEL_ATTEMPT = "tracehound.io/attempt"
LABEL_NODE_RANK = "tracehound.io/node-rank"
LABEL_ROLE = "tracehound.io/role"
LABEL_NODE = "tracehound.io/node"
LABEL_MANAGED = "app.kubernetes.io/managed-by"
MANAGER = "tracehound"

SIDECAR_NAME = "tracehound-agent"
RECORDER_NAME = "tracehound-recorder"
TRAINER_NAME = "trainer"
RUN_VOLUME = "tracehound-run"
RUN_DIR = "/var/run/tracehound"
RECORDER_VOLUME = "tracehound-recorder"
RECORDER_DIR = "/opt/tracehound"
AGENT_UID = 10001
"""The user (and group) Tracehound's image runs as; the pod's fsGroup, so ranks of any user may
connect to the agent's socket (mode 0660)."""

DEFAULT_STORE_SECRET = "tracehound-clickhouse"  # noqa: S105 - the Secret's name, not a secret
DEFAULT_STORE_SECRET_KEY = "url"  # noqa: S105 - the key of the store URL in that Secret


def restricted_security_context() -> dict[str, Any]:
    """Non-root, no privilege escalation, read-only root, no capabilities."""
    return {
        "runAsNonRoot": True,
        "runAsUser": AGENT_UID,
        "runAsGroup": AGENT_UID,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def default_sidecar(*, image: str, store_secret: str = DEFAULT_STORE_SECRET,
                    store_secret_key: str = DEFAULT_STORE_SECRET_KEY,
                    pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    """The node agent's container when no template is given: what the chart's default values
    render into its sidecar ConfigMap (the chart tests hold the two equal)."""
    return {
        "name": SIDECAR_NAME,
        "image": image,
        "imagePullPolicy": pull_policy,
        "args": ["agent"],
        "restartPolicy": "Always",
        "env": [
            {"name": env.TRACEHOUND_SINK,
             "valueFrom": {"secretKeyRef": {"name": store_secret, "key": store_secret_key}}},
            {"name": env.TRACEHOUND_AGENT_SOCKET, "value": f"{RUN_DIR}/agent.sock"},
            {"name": env.TRACEHOUND_SPOOL_DIR, "value": f"{RUN_DIR}/spool"},
        ],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"},
                      "limits": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": restricted_security_context(),
        "volumeMounts": [{"name": RUN_VOLUME, "mountPath": RUN_DIR}],
    }


class SidecarTemplateError(ValueError):
    """A sidecar template file that is not a container the operator can inject."""


def load_sidecar_template(path: Path) -> dict[str, Any]:
    """The container a sidecar template file (YAML) holds; SidecarTemplateError naming the file
    and the field otherwise."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SidecarTemplateError(f"sidecar template {path}: cannot read it: {exc}") from None
    if not isinstance(doc, dict):
        raise SidecarTemplateError(f"sidecar template {path}: expected a container (a mapping), "
                                   f"got {doc!r}")
    for key in ("name", "image"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise SidecarTemplateError(f"sidecar template {path}: {key}: required string")
    if doc["name"] != SIDECAR_NAME:
        raise SidecarTemplateError(f"sidecar template {path}: name: expected {SIDECAR_NAME!r} "
                                   f"(the operator finds the agent by it), got {doc['name']!r}")
    mounts = doc.get("volumeMounts", [])
    if not any(isinstance(m, dict) and m.get("mountPath") == RUN_DIR for m in mounts):
        raise SidecarTemplateError(f"sidecar template {path}: volumeMounts: expected a mount at "
                                   f"{RUN_DIR} (where the ranks find the agent's socket)")
    return doc


def _node_name_env(name: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}


def pod_env(job: str, attempt: int) -> list[dict[str, Any]]:
    """What every Tracehound container of a job's pod is told about where it runs."""
    return [
        {"name": env.TRACEHOUND_JOB_ID, "value": job},
        _node_name_env(env.TRACEHOUND_NODE_ID),
        {"name": env.TRACEHOUND_ATTEMPT, "value": str(attempt)},
    ]


def sidecar_container(template: Mapping[str, Any], *, job: str, attempt: int) -> dict[str, Any]:
    """The template with the pod's job, node and attempt put first in its environment (the
    template's own entries of the same names give way)."""
    container = copy.deepcopy(dict(template))
    ours = pod_env(job, attempt)
    names = {e["name"] for e in ours}
    container["env"] = ours + [e for e in container.get("env", []) if e.get("name") not in names]
    return container


def recorder_container(image: str, pull_policy: str = "IfNotPresent") -> dict[str, Any]:
    return {
        "name": RECORDER_NAME,
        "image": image,
        "imagePullPolicy": pull_policy,
        "args": ["bundle", "--into", RECORDER_DIR],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"},
                      "limits": {"cpu": "500m", "memory": "256Mi"}},
        "securityContext": restricted_security_context(),
        "volumeMounts": [{"name": RECORDER_VOLUME, "mountPath": RECORDER_DIR}],
    }


def service_name(resource: str) -> str:
    return resource


def pod_name(resource: str, attempt: int, node_rank: int) -> str:
    return f"{resource}-a{attempt}-n{node_rank}"


def standby_name(resource: str, node: str) -> str:
    return f"{resource}-standby-{node}"[:63].rstrip("-.")


def labels(resource: str, *, attempt: int | None = None, node_rank: int | None = None,
           role: str = "rank") -> dict[str, str]:
    out = {LABEL_MANAGED: MANAGER, LABEL_JOB: resource, LABEL_ROLE: role}
    if attempt is not None:
        out[LABEL_ATTEMPT] = str(attempt)
    if node_rank is not None:
        out[LABEL_NODE_RANK] = str(node_rank)
    return out


def owner_reference(owner: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The TrainingJob as the owner (garbage collection removes its pods with it); none when
    the object carries no uid."""
    meta = owner.get("metadata", {})
    uid = meta.get("uid")
    if not uid:
        return []
    return [{"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta.get("name", ""),
             "uid": uid, "controller": True, "blockOwnerDeletion": True}]


def _pinned_to(node: str) -> dict[str, Any]:
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}]}]}}}


def rank_pod(*, spec: TrainingJobSpec, plan: AttemptPlan, resource: str, node_rank: int,
             namespace: str, sidecar: Mapping[str, Any], recorder_image: str,
             owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The pod of node `node_rank` of an attempt (a V1Pod's dict form); `resource` is the
    TrainingJob's name, which names its pods (the job id in the store is `plan.job`)."""
    job = plan.job
    name = pod_name(resource, plan.attempt, node_rank)
    master = f"{pod_name(resource, plan.attempt, 0)}.{service_name(resource)}.{namespace}.svc"
    launcher = [
        "python", "-m", "torch.distributed.run",
        f"--nnodes={len(plan.nodes)}", f"--nproc-per-node={plan.nproc_per_node}",
        f"--node-rank={node_rank}", f"--master-addr={master}",
        f"--master-port={spec.master_port}", "--no-python",
    ]
    trainer_env = [
        *pod_env(job, plan.attempt),
        {"name": env.TRACEHOUND_AGENT_SOCKET, "value": f"{RUN_DIR}/agent.sock"},
        {"name": "PYTHONPATH", "value": f"{RECORDER_DIR}/bootstrap:{RECORDER_DIR}/site"},
    ]
    if spec.checkpoint_dir:
        trainer_env.append({"name": env.TRACEHOUND_CHECKPOINT_DIR, "value": spec.checkpoint_dir})
    ours = {e["name"] for e in trainer_env}
    trainer_env += [{"name": k, "value": v} for k, v in sorted({**spec.env, **plan.env}.items())
                    if k not in ours]
    trainer: dict[str, Any] = {
        "name": TRAINER_NAME,
        "image": spec.image,
        "command": launcher + list(spec.command),
        "env": trainer_env,
        "volumeMounts": [
            {"name": RUN_VOLUME, "mountPath": RUN_DIR},
            {"name": RECORDER_VOLUME, "mountPath": RECORDER_DIR, "readOnly": True},
            *[dict(m) for m in spec.volume_mounts],
        ],
    }
    if spec.resources:
        trainer["resources"] = dict(spec.resources)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "hostname": name,
        "subdomain": service_name(resource),
        "shareProcessNamespace": True,  # the agent watches the ranks' processes
        "securityContext": {"fsGroup": AGENT_UID},
        "affinity": _pinned_to(plan.nodes[node_rank]),
        "initContainers": [recorder_container(recorder_image),
                           sidecar_container(sidecar, job=job, attempt=plan.attempt)],
        "containers": [trainer],
        "volumes": [{"name": RUN_VOLUME, "emptyDir": {}},
                    {"name": RECORDER_VOLUME, "emptyDir": {}},
                    *[dict(v) for v in spec.volumes]],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": labels(resource, attempt=plan.attempt, node_rank=node_rank),
                     "ownerReferences": owner_reference(owner or {})},
        "spec": pod_spec,
    }


def standby_pod(*, spec: TrainingJobSpec, resource: str, node: str, namespace: str,
                owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A pod that keeps a spare node warm for the job: the image pulled, torch imported once
    (the page cache keeps it), then it waits to be replaced by a rank pod."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": standby_name(resource, node), "namespace": namespace,
                     "labels": {**labels(resource, role="standby"), LABEL_NODE: node},
                     "ownerReferences": owner_reference(owner or {})},
        "spec": {
            "restartPolicy": "Always",
            "affinity": _pinned_to(node),
            "containers": [{
                "name": "standby", "image": spec.image,
                "command": ["python", "-c", "import signal, torch; signal.pause()"],
                "resources": {"requests": {"cpu": "10m", "memory": "64Mi"}},
            }],
        },
    }


def headless_service(resource: str, namespace: str,
                     owner: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Gives each rank pod the DNS name torchrun's node 0 is reached by."""
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": service_name(resource), "namespace": namespace,
                     "labels": labels(resource), "ownerReferences": owner_reference(owner or {})},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {LABEL_JOB: resource, LABEL_ROLE: "rank"}},
    }
