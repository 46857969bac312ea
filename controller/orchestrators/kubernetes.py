"""The orchestrator port on Kubernetes: an attempt is one pod per node, an isolation is a cordon
and a taint of the Kubernetes node, a rank exit is the trainer container's termination.

Everything goes through the Kubernetes client (`CoreV1Api`) and its models: the objects built in
`controller.kubeobjects` are turned into V1Pod/V1Service models before they are sent (the
client checks their required fields), and pods are read back as models.

What it must never do: act twice on a node (a taint already there is not added again, so an
operator that restarts mid-isolation leaves one taint), depend on the API server filtering by
label (selectors are sent, and the answer is filtered again here), or delete a pod that is not
the job's (every pod it touches carries the job's labels).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tracehound.controller.orchestrators import kubeobjects as ko
from tracehound.controller.orchestrators.jobspec import TrainingJobSpec
from tracehound.controller.orchestrators.port import AttemptPlan, Launched
from tracehound.tracing.events import EXIT_UNKNOWN, RankExit, now_us
from tracehound.tracing.ids import NodeId, Rank

log = logging.getLogger(__name__)

TAINT_KEY = "tracehound.io/faulty"
ISOLATED_ANNOTATION = "tracehound.io/isolated-reason"


def to_model(api_client: Any, data: Mapping[str, Any], model: str) -> Any:
    """The Kubernetes client's model (`V1Pod`, ...) of an object's dict form."""
    return api_client._ApiClient__deserialize(dict(data), model)


def selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def matches(obj: Any, labels: Mapping[str, str]) -> bool:
    """Whether an object (a client model) carries every one of `labels`."""
    have = (obj.metadata.labels or {}) if obj.metadata is not None else {}
    return all(have.get(k) == v for k, v in labels.items())


def labelled_pods(core: Any, namespace: str, labels: Mapping[str, str]) -> list[Any]:
    """The pods of `namespace` carrying `labels`: asked of the API server with a selector and
    filtered again here (not every server applies one)."""
    found = core.list_namespaced_pod(namespace, label_selector=selector(labels))
    return [p for p in found.items if matches(p, labels)]


def delete_pod(core: Any, namespace: str, name: str, grace_s: float | None = None) -> None:
    """Delete a pod; one that is gone already is what was wanted."""
    from kubernetes.client.exceptions import ApiException

    try:
        core.delete_namespaced_pod(
            name, namespace,
            grace_period_seconds=None if grace_s is None else max(0, round(grace_s)))
    except ApiException as exc:
        if exc.status != 404:
            raise


def _exit_code(terminated: Any) -> int:
    """A container's end as a RankExit code: negative for a signal (137 is SIGKILL)."""
    if getattr(terminated, "signal", None):
        return -int(terminated.signal)
    code = int(terminated.exit_code if terminated.exit_code is not None else EXIT_UNKNOWN)
    return -(code - 128) if 128 < code < 160 else code


def _time_us(when: object) -> int:
    if isinstance(when, dt.datetime):
        return int(when.timestamp() * 1e6)
    if isinstance(when, str):
        try:
            return int(dt.datetime.fromisoformat(when.replace("Z", "+00:00")).timestamp() * 1e6)
        except ValueError:
            return now_us()
    return now_us()


class KubernetesOrchestrator:
    """Runs a TrainingJob's attempts as pods of one namespace."""

    def __init__(
        self,
        *,
        core: Any,
        namespace: str,
        resource: str,
        spec: TrainingJobSpec,
        sidecar: Mapping[str, Any],
        image: str,
        owner: Mapping[str, Any] | None = None,
        pool: Sequence[str] = (),
        event: Callable[[str, str, str], object] | None = None,
    ) -> None:
        """`core` is a `kubernetes.client.CoreV1Api`; `resource` the TrainingJob's name;
        `image` Tracehound's image (the recorder's init container); `pool` the job's nodes in
        the order spares are taken (standby pods warm the spares); `event(type, reason,
        message)` reports on the TrainingJob."""
        self.core = core
        self.namespace = namespace
        self.resource = resource
        self.spec = spec
        self.sidecar = dict(sidecar)
        self.image = image
        self.owner = dict(owner or {})
        self.pool = tuple(pool)
        self._event = event
        self.current: AttemptPlan | None = None
        self._ended: set[str] = set()
        """Pods of the current attempt whose end was reported."""
        self._isolated: set[str] = set()

    # -- helpers ---------------------------------------------------------------------------------
    def _pods(self, labels: Mapping[str, str]) -> list[Any]:
        return labelled_pods(self.core, self.namespace, labels)

    def _attempt_pods(self, attempt: int) -> list[Any]:
        return self._pods({ko.LABEL_JOB: self.resource, ko.LABEL_ROLE: "rank",
                           ko.LABEL_ATTEMPT: str(attempt)})

    def _delete(self, pod: Any, grace_s: float) -> None:
        delete_pod(self.core, self.namespace, pod.metadata.name, grace_s)

    def _say(self, type_: str, reason: str, message: str) -> None:
        if self._event is not None:
            self._event(type_, reason, message)

    def _ensure_service(self) -> None:
        from kubernetes.client.exceptions import ApiException

        body = to_model(self.core.api_client,
                        ko.headless_service(self.resource, self.namespace, self.owner),
                        "V1Service")
        try:
            self.core.create_namespaced_service(self.namespace, body)
        except ApiException as exc:
            if exc.status != 409:  # exists: it is ours (same name, same selector)
                raise

    # -- the port --------------------------------------------------------------------------------
    def launch(self, plan: AttemptPlan) -> Launched:
        self._ensure_service()
        standby = {p.metadata.labels.get(ko.LABEL_NODE): p
                   for p in self._pods({ko.LABEL_JOB: self.resource, ko.LABEL_ROLE: "standby"})}
        for node in plan.nodes:  # a standby gives its node to the attempt
            if node in standby:
                self._delete(standby.pop(node), 0)
        for node_rank in range(len(plan.nodes)):
            pod = ko.rank_pod(spec=self.spec, plan=plan, resource=self.resource,
                              node_rank=node_rank, namespace=self.namespace,
                              sidecar=self.sidecar, recorder_image=self.image, owner=self.owner)
            self.core.create_namespaced_pod(self.namespace,
                                            to_model(self.core.api_client, pod, "V1Pod"))
        self.current = plan
        self._ended = set()
        log.info("job %s attempt %d: %d pods created on %s", plan.job, plan.attempt,
                 len(plan.nodes), ", ".join(plan.nodes))
        self._warm_spares(plan, standby)
        return Launched(cold=plan.world_size)

    def wait_exit(self, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> bool:
        """Pods' ends are seen by polling them (`poll_exits`): this waits with `sleep`."""
        sleep(timeout_s)
        return False

    def warm_up(self) -> None:
        """Standby pods are kept from the launch on (`_warm_spares`): nothing more to do."""

    def _warm_spares(self, plan: AttemptPlan, standby: dict[str | None, Any]) -> None:
        spares = [n for n in self.pool if n not in plan.nodes and n not in self._isolated]
        wanted = spares[:self.spec.warm_standby]
        for node, pod in standby.items():
            if node not in wanted:
                self._delete(pod, 0)
        for node in wanted:
            if node in standby:
                continue
            pod = ko.standby_pod(spec=self.spec, resource=self.resource, node=node,
                                 namespace=self.namespace, owner=self.owner)
            self.core.create_namespaced_pod(self.namespace,
                                            to_model(self.core.api_client, pod, "V1Pod"))

    def poll_exits(self) -> list[RankExit]:
        plan = self.current
        if plan is None:
            return []
        exits: list[RankExit] = []
        pods = {p.metadata.name: p for p in self._attempt_pods(plan.attempt)}
        for node_rank, node in enumerate(plan.nodes):
            name = ko.pod_name(self.resource, plan.attempt, node_rank)
            if name in self._ended:
                continue
            pod = pods.get(name)
            code, when = self._ended_how(pod)
            if code is None:
                continue
            self._ended.add(name)
            for local in range(plan.nproc_per_node):
                rank = node_rank * plan.nproc_per_node + local
                exits.append(RankExit(job=plan.job, attempt=plan.attempt, node=NodeId(node),
                                      rank=Rank(rank), pid=0, exit_code=code, time_us=when))
        return sorted(exits, key=lambda e: e.time_us)

    def _ended_how(self, pod: Any) -> tuple[int | None, int]:
        """(exit code, when) once the pod's trainer ended; (None, 0) while it runs. A pod
        that is gone, or failed without a trainer status (evicted, its node lost), ended in
        an unknown way."""
        if pod is None:
            return EXIT_UNKNOWN, now_us()
        status = pod.status
        for cs in (status.container_statuses or []) if status is not None else []:
            if cs.name == ko.TRAINER_NAME and cs.state is not None and cs.state.terminated:
                return _exit_code(cs.state.terminated), _time_us(cs.state.terminated.finished_at)
        if status is not None and status.phase == "Failed":
            return EXIT_UNKNOWN, now_us()
        if status is not None and status.phase == "Succeeded":
            return 0, now_us()
        return None, 0

    def pid_of(self, rank: int) -> int | None:
        return None  # the ranks' processes live in their pods; the sidecar knows their pids

    def finish(self) -> None:
        for pod in self._pods({ko.LABEL_JOB: self.resource, ko.LABEL_ROLE: "standby"}):
            self._delete(pod, 0)

    def stop(self, *, grace_s: float = 3.0) -> None:
        plan = self.current
        if plan is None:
            return
        pods = self._attempt_pods(plan.attempt)
        for pod in pods:
            self._delete(pod, grace_s)
        log.info("job %s attempt %d: %d pods deleted", plan.job, plan.attempt, len(pods))

    def isolate(self, node: NodeId, *, reason: str) -> None:
        """Cordon the node and taint it NoSchedule (once: a taint already there stays the only
        one), so no pod of any job is scheduled there until someone looks at it."""
        from kubernetes.client.exceptions import ApiException

        self._isolated.add(node)
        try:
            current = self.core.read_node(node)
        except ApiException as exc:
            if exc.status == 404:
                log.warning("node %s to isolate is not in the cluster any more", node)
                return
            raise
        node_spec = current.spec
        taints = [t for t in ((node_spec.taints if node_spec is not None else None) or [])
                  if t is not None]
        if any(t.key == TAINT_KEY for t in taints) and node_spec.unschedulable:
            log.info("node %s is cordoned and tainted already", node)
            return
        ours = {"key": TAINT_KEY, "value": self.resource, "effect": "NoSchedule"}
        patch = {
            "metadata": {"annotations": {ISOLATED_ANNOTATION: reason[:1000]}},
            "spec": {"unschedulable": True,
                     "taints": [self.core.api_client.sanitize_for_serialization(t)
                                for t in taints if t.key != TAINT_KEY] + [ours]},
        }
        self.core.patch_node(node, patch)
        self._say("Warning", "NodeIsolated", f"node {node} cordoned and tainted "
                                             f"{TAINT_KEY}:NoSchedule: {reason}")

    def adopt(self, plan: AttemptPlan) -> bool:
        """Watch the pods of `plan`'s attempt as if this orchestrator had created them. When
        none runs any more, the attempt is adopted only if each of its pods is there, not being
        deleted (a stop deletes them) and its trainer ended with 0: it finished while no
        controller watched, and `poll_exits` reports those exits. Otherwise False."""
        pods = self._attempt_pods(plan.attempt)
        if not pods:
            return False
        codes = [self._ended_how(p)[0] for p in pods]
        if all(c is not None for c in codes):
            finished = (len(pods) == len(plan.nodes) and all(c == 0 for c in codes)
                        and not any(p.metadata.deletion_timestamp for p in pods))
            if not finished:
                return False
            log.info("job %s attempt %d: every pod's trainer ended with 0 while no controller "
                     "watched: adopted as it ended", plan.job, plan.attempt)
        else:
            log.info("job %s attempt %d: adopted %d pods", plan.job, plan.attempt, len(pods))
        self.current = plan
        self._ended = set()
        return True

    def kill_leftovers(self, attempt: int) -> int:
        pods = self._attempt_pods(attempt)
        for pod in pods:
            self._delete(pod, 0)
        return len(pods) * self.spec.procs_per_node

    def close(self) -> None:
        """Nothing to let go of: the pods belong to the cluster, not to this process."""
