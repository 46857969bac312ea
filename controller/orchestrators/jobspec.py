"""What a Kubernetes training job asks for: the `TrainingJob` resource's names and its checked
spec, which the Kubernetes orchestrator launches (`kubernetes`, `kubeobjects`) and the operator
reads from the resource (`controller.operator.trainingjob`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tracehound.controller.policy.recovery import PolicySettings

GROUP = "tracehound.io"
VERSION = "v1alpha1"
PLURAL = "trainingjobs"
KIND = "TrainingJob"
SINGULAR = "trainingjob"
SHORT_NAMES = ("thjob",)

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingJobSpec:
    """What a TrainingJob asks for, checked."""

    image: str
    """The user's training image, unchanged: the recorder reaches it through the environment."""
    command: tuple[str, ...]
    """What each rank runs (started by torchrun inside the pod, one pod per node)."""
    nodes: int
    """How many nodes (pods) the job trains on."""
    procs_per_node: int = 1
    spare_nodes: int = 0
    """Healthy nodes kept free to take an isolated node's place."""
    warm_standby: int = 0
    """Standby pods kept on spare nodes with the image pulled and Python warm."""
    node_selector: Mapping[str, str] = field(default_factory=dict)
    """Labels of the nodes the job may use (its node pool)."""
    checkpoint_dir: str = ""
    env: Mapping[str, str] = field(default_factory=dict)
    resources: Mapping[str, Any] = field(default_factory=dict)
    """The trainer container's resources (requests/limits), passed through."""
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    master_port: int = DEFAULT_MASTER_PORT
    policy: PolicySettings = field(default_factory=PolicySettings)
