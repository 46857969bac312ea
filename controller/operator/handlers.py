"""The Kubernetes operator (kopf): one supervisor per TrainingJob, acting through pods and nodes.

For each TrainingJob the operator runs a kopf daemon (a thread) holding the same supervisor as
`tracehound run`: the same detectors, policies, durable state machine, journal and alerts, with
the Kubernetes orchestrator (`controller.kubeorch`) in place of local processes. Each state the
supervisor writes is mirrored into the resource's status (phase, attempt, restarts, last
incident, nodes, isolated nodes, conditions) and announced as a Kubernetes event.

The job's state lives in the trace store, so the operator itself holds nothing that matters:
stopped or moved, it detaches from its jobs (their pods keep training), and when it starts again
each supervisor picks its job up where the store says it was (adopting the running pods, or
finishing an incident's plan without repeating a step). A resource whose status says Finished,
Failed or Invalid is left alone.

What it must never do: harm a job because the operator stops (detaching never deletes a pod),
act on a spec it has not checked (an invalid spec gets status Invalid, a Warning event naming
the field, and no pods), or let one job's failure stop the others.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tracehound.controller.alerts import Alert
from tracehound.controller.extras import require_extra
from tracehound.controller.operator.trainingjob import SpecError, crd_yaml, read_spec
from tracehound.controller.orchestrators import kubeobjects as ko
from tracehound.controller.orchestrators.jobspec import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    TrainingJobSpec,
)
from tracehound.controller.orchestrators.kubernetes import (
    KubernetesOrchestrator,
    delete_pod,
    labelled_pods,
    matches,
    selector,
)
from tracehound.controller.supervision.jobstate import read_history
from tracehound.controller.supervision.supervisor import (
    Detached,
    JobSpec,
    RunResult,
    Supervisor,
    SupervisorSettings,
)
from tracehound.tracing.events import JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore, open_store
from tracehound.tracing.store.urls import mask_url

log = logging.getLogger(__name__)

DONE_PHASES = frozenset({"Finished", "Failed", "Invalid"})
"""Statuses of a resource the operator leaves alone (its run is over)."""

_WARNING_PHASES = frozenset({JobPhase.SUSPECT, JobPhase.STALLED, JobPhase.DIAGNOSING,
                             JobPhase.ISOLATING, JobPhase.RESTARTING, JobPhase.FAILED})


@dataclass(frozen=True, slots=True, kw_only=True)
class OperatorConfig:
    """How the operator runs; `tracehound operator` fills it from flags and TRACEHOUND_*."""

    store_url: str
    image: str
    """Tracehound's image: the recorder's init container and the default sidecar."""
    sidecar: Mapping[str, Any]
    """The node agent's container template (the chart's ConfigMap, else `default_sidecar`)."""
    workdir: Path
    """Per-job journals and incident evidence."""
    namespaces: tuple[str, ...] = ()
    """Namespaces watched; () means every namespace."""
    settings: SupervisorSettings = field(default_factory=SupervisorSettings)
    api_url: str | None = None
    """The API server (tests); None: in-cluster config, else the kube config."""
    alerts: Sequence[Path] = ()
    """Alert receiver files (the same format as `tracehound run --alerts`)."""
    max_jobs: int = 200
    """How many TrainingJobs may be supervised at once (one thread each)."""


def job_id(namespace: str, name: str) -> JobId:
    """A TrainingJob's id in the store."""
    return JobId(f"{namespace}.{name}")


def phase_name(phase: JobPhase) -> str:
    return phase.value.capitalize()


def _now_rfc3339() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_of(state: JobState) -> dict[str, Any]:
    """The TrainingJob status that mirrors a job state."""
    healthy = state.state in (JobPhase.RUNNING, JobPhase.FINISHED)
    recovering = state.state in (JobPhase.DIAGNOSING, JobPhase.ISOLATING, JobPhase.RESTARTING)
    at = _now_rfc3339()
    message = state.detail or (f"incident {state.incident_id}" if state.incident_id else "")
    return {
        "phase": phase_name(state.state),
        "attempt": state.attempt,
        "restarts": state.attempt,
        "lastIncident": state.incident_id,
        "nodes": list(state.nodes),
        "isolatedNodes": list(state.isolated),
        "message": message,
        "conditions": [
            {"type": "Healthy", "status": "True" if healthy else "False",
             "reason": phase_name(state.state), "message": message, "lastTransitionTime": at},
            {"type": "Recovering", "status": "True" if recovering else "False",
             "reason": phase_name(state.state), "message": message, "lastTransitionTime": at},
        ],
    }


class KubeApi:
    """The Kubernetes client the supervisors use (synchronous, thread-safe per call)."""

    def __init__(self, api_url: str | None) -> None:
        from kubernetes import client, config

        if api_url is not None:
            configuration = client.Configuration()
            configuration.host = api_url.rstrip("/")
            api_client = client.ApiClient(configuration)
        else:
            try:
                config.load_incluster_config()  # type: ignore[no-untyped-call]
            except config.ConfigException:
                config.load_kube_config()  # type: ignore[no-untyped-call]
            api_client = client.ApiClient()
        self.client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def patch_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)})

    def event(self, namespace: str, name: str, uid: str | None, *, type_: str, reason: str,
              message: str) -> None:
        """A Kubernetes event on the TrainingJob (named uniquely: not every API server fills
        in generateName)."""
        from kubernetes import client

        now = dt.datetime.now(dt.UTC)
        body = client.CoreV1Event(
            metadata=client.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:16]}",
                                         namespace=namespace),
            involved_object=client.V1ObjectReference(
                api_version=f"{GROUP}/{VERSION}", kind=KIND, name=name, namespace=namespace,
                uid=uid),
            reason=reason, message=message[:1024], type=type_,
            first_timestamp=now, last_timestamp=now, count=1,
            source=client.V1EventSource(component="tracehound-operator"),
        )
        self.core.create_namespaced_event(namespace, body)

    def pool(self, spec: TrainingJobSpec, known: Sequence[str]) -> list[str]:
        """The job's nodes: the first nodes + spareNodes schedulable nodes matching its
        nodeSelector (by name), then every node its history names (isolated ones too)."""
        found: list[Any] = self.core.list_node(
            label_selector=selector(spec.node_selector) or None).items
        matching = [n for n in found if matches(n, spec.node_selector)]
        schedulable: list[str] = sorted(n.metadata.name for n in matching
                             if not (n.spec is not None and n.spec.unschedulable))
        pool = schedulable[:spec.nodes + spec.spare_nodes]
        return pool + [n for n in dict.fromkeys(known) if n not in pool]


class JobRunner:
    """Supervises one TrainingJob for one operator process (a kopf daemon's body)."""

    def __init__(self, config: OperatorConfig, api: KubeApi, store: TraceStore,
                 body: Mapping[str, Any]) -> None:
        self.config = config
        self.api = api
        self.store = store
        meta = body.get("metadata", {})
        self.name: str = meta["name"]
        self.namespace: str = meta.get("namespace") or "default"
        self.uid: str | None = meta.get("uid")
        self.body = body
        self.job = job_id(self.namespace, self.name)

    def event(self, type_: str, reason: str, message: str) -> None:
        try:
            self.api.event(self.namespace, self.name, self.uid, type_=type_, reason=reason,
                           message=message)
        except Exception:  # an event is a courtesy: never stop supervising for one
            log.exception("job %s: could not post event %s", self.job, reason)

    def on_state(self, state: JobState) -> None:
        self.api.patch_status(self.namespace, self.name, status_of(state))
        if state.state is JobPhase.RUNNING and state.attempt == 0:
            return  # the start: no event needed beyond the status
        self.event("Warning" if state.state in _WARNING_PHASES else "Normal",
                   phase_name(state.state),
                   f"attempt {state.attempt}: {state.detail or state.state.value}"
                   + (f" (incident {state.incident_id})" if state.incident_id else ""))

    def notify(self, alert: Alert, also: Callable[[Alert], object] | None) -> None:
        self.event("Warning" if alert.status == "firing" else "Normal",
                   "Incident" if alert.status == "firing" else "Resolved", alert.summary)
        if also is not None:
            also(alert)

    def reject(self, error: SpecError) -> None:
        log.error("job %s: %s", self.job, error)
        at = _now_rfc3339()
        self.api.patch_status(self.namespace, self.name, {
            "phase": "Invalid", "message": str(error),
            "conditions": [{"type": "Valid", "status": "False", "reason": "InvalidSpec",
                            "message": str(error), "lastTransitionTime": at}],
        })
        self.event("Warning", "InvalidSpec", str(error))

    def run(self, spec: TrainingJobSpec, sleep: Callable[[float], None],
            alert: Callable[[Alert], object] | None = None) -> RunResult:
        history = read_history(self.store, self.job, [])
        known = [] if history.latest is None else [*history.latest.nodes,
                                                    *history.latest.isolated]
        pool = self.api.pool(spec, known)
        orch = KubernetesOrchestrator(
            core=self.api.core, namespace=self.namespace, resource=self.name, spec=spec,
            sidecar=self.config.sidecar, image=self.config.image, owner=self.body, pool=pool,
            event=self.event)
        workdir = self.config.workdir / self.job
        settings = self.config.settings
        supervisor = Supervisor(
            spec=JobSpec(job=self.job, command=spec.command, nnodes=spec.nodes,
                         nproc_per_node=spec.procs_per_node, spare_nodes=spec.spare_nodes,
                         pool=tuple(pool)),
            store=self.store, orchestrator=orch,
            settings=replace(settings, policy=spec.policy), sleep=sleep,
            evidence_dir=workdir / "incidents", journal_path=workdir / "journal.jsonl",
            notify=lambda a: self.notify(a, alert), on_state=self.on_state,
        )
        return supervisor.run()


class _Sleeper:
    """The supervisor's sleep inside a kopf daemon: waits on the daemon's stop flag and, once
    it is set, detaches the supervisor (once; later sleeps, while the journal drains, return
    at once)."""

    def __init__(self, stopped: Any) -> None:
        self.stopped = stopped
        self.detached = False

    def __call__(self, seconds: float) -> None:
        if self.detached:
            return
        if self.stopped.wait(max(seconds, 0.0)):  # kopf's waiter: truthy once stopped
            self.detached = True
            raise Detached("the operator is stopping")


def build_registry(config: OperatorConfig) -> Any:
    """The kopf registry of the operator's handlers (a registry of its own, so tests can run
    several operators in one process)."""
    import kopf

    registry = kopf.OperatorRegistry()
    state: dict[str, Any] = {}
    lock = threading.Lock()

    def shared() -> tuple[KubeApi, TraceStore]:
        with lock:
            if "api" not in state:
                state["api"] = KubeApi(config.api_url)
        return state["api"], shared_store()

    def shared_store() -> TraceStore:
        with lock:
            if "store" not in state:
                state["store"] = open_store(config.store_url)
            store: TraceStore = state["store"]
            return store

    @kopf.on.startup(registry=registry)
    def configure(settings: Any, **_: Any) -> None:
        settings.posting.enabled = False  # the operator posts its own events
        settings.persistence.finalizer = "tracehound.io/operator"
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
            prefix="tracehound.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="tracehound.io", key="last-handled-configuration")
        settings.execution.max_workers = config.max_jobs + 8
        settings.watching.server_timeout = 300

    dispatcher = None
    if config.alerts:
        from tracehound.controller import alerts

        receivers = alerts.merge_receivers(*((str(p), alerts.load_receivers(p))
                                             for p in config.alerts))
        dispatcher = alerts.Dispatcher(alerts.Outbox(config.workdir / "alerts", receivers))
        state["dispatcher"] = dispatcher

        @kopf.on.startup(registry=registry)
        def start_alerts(**_: Any) -> None:
            # each settled alert is recorded on its incident (the store opened when first
            # needed: an unreachable store must not keep the operator from starting)
            recorder = alerts.AlertRecorder(
                shared_store, config.workdir / "alerts" / alerts.ACTIONS_JOURNAL)
            state["alert_recorder"] = recorder
            dispatcher.on_settled = recorder
            recorder.start()
            dispatcher.start()

    @kopf.on.cleanup(registry=registry)
    def close(**_: Any) -> None:
        # the dispatcher stops first, then its last records go to the store, then it closes
        if dispatcher is not None:
            dispatcher.stop(10.0)
        recorder = state.pop("alert_recorder", None)
        if recorder is not None:
            recorder.stop(10.0)
        with lock:
            store = state.pop("store", None)
        if store is not None:
            store.close()

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> Any:
        if config.api_url is not None:
            return kopf.ConnectionInfo(server=config.api_url, insecure=True)
        return kopf.login_via_client(**kwargs)

    @kopf.daemon(GROUP, VERSION, PLURAL, registry=registry,
                 cancellation_timeout=30.0)
    def supervise(body: Any, stopped: Any, **_: Any) -> None:
        api, store = shared()
        runner = JobRunner(config, api, store, body)
        phase = (body.get("status") or {}).get("phase")
        if phase in DONE_PHASES:
            log.info("job %s is %s: nothing to supervise", runner.job, phase)
            return
        try:
            spec = read_spec(body.get("spec"), source=f"{KIND} {runner.namespace}/{runner.name}")
        except SpecError as exc:
            runner.reject(exc)
            return
        try:
            result = runner.run(spec, _Sleeper(stopped),
                                dispatcher.enqueue if dispatcher is not None else None)
        except Exception:
            log.exception("job %s: the supervisor failed; the job's pods are left as they "
                          "are and the next operator start picks it up", runner.job)
            return
        log.info("job %s: %s", runner.job, result.reason)

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    def delete(body: Any, **_: Any) -> None:
        """Remove the job's pods and Service (owner references do this on a real cluster too;
        done here so it never depends on the garbage collector)."""
        from kubernetes.client.exceptions import ApiException

        api, _store = shared()
        meta = body.get("metadata", {})
        name, namespace = meta["name"], meta.get("namespace") or "default"
        for pod in labelled_pods(api.core, namespace, {ko.LABEL_JOB: name}):
            delete_pod(api.core, namespace, pod.metadata.name)
        try:
            api.core.delete_namespaced_service(ko.service_name(name), namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    return registry


def run_operator(config: OperatorConfig, *, stop_flag: threading.Event | None = None,
                 ready_flag: threading.Event | None = None,
                 liveness: str | None = None) -> None:
    """Run the operator until `stop_flag` is set (or a signal, in the main thread)."""
    import kopf

    kopf.run(registry=build_registry(config), standalone=True,
             clusterwide=not config.namespaces, namespaces=list(config.namespaces),
             stop_flag=stop_flag, ready_flag=ready_flag, liveness_endpoint=liveness)


# -- the command ---------------------------------------------------------------------------------
EPILOG = """\
environment (flags win): TRACEHOUND_STORE, TRACEHOUND_IMAGE, TRACEHOUND_SIDECAR_TEMPLATE,
TRACEHOUND_NAMESPACE (comma separated), TRACEHOUND_ALERTS, TRACEHOUND_WORKDIR.

examples:
  # in the cluster (the chart runs this)
  tracehound operator --liveness http://0.0.0.0:8080/healthz
  # from a workstation, against the current kube context, one namespace
  tracehound operator --namespace ml --store clickhouse://default:@ch:9000/tracehound \\
      --image ghcr.io/tracehound/tracehound:0.1.0
  # the TrainingJob CRD, for kubectl apply
  tracehound operator --crd > trainingjob-crd.yaml
"""

SIDECAR_TEMPLATE_ENV = "TRACEHOUND_SIDECAR_TEMPLATE"
IMAGE_ENV = "TRACEHOUND_IMAGE"
NAMESPACE_ENV = "TRACEHOUND_NAMESPACE"
WORKDIR_ENV = "TRACEHOUND_WORKDIR"
DEFAULT_IMAGE = "ghcr.io/tracehound/tracehound:0.1.0"


def add_parser(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    p = sub.add_parser(
        "operator", help="run the Kubernetes operator over TrainingJob resources",
        description="Supervise every TrainingJob: create its pods with the node agent as a "
                    "sidecar, diagnose faults from the store, cordon and taint faulty nodes "
                    "and restart from the latest checkpoint. Stopping it leaves the jobs "
                    "running; started again it picks them up.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    store_arg(p)
    p.add_argument("--namespace", action="append", default=None, metavar="NS",
                   help="watch this namespace (repeatable; default: $TRACEHOUND_NAMESPACE, "
                        "else every namespace)")
    p.add_argument("--image", default=None,
                   help=f"Tracehound's image for the recorder and the default sidecar "
                        f"(default: ${IMAGE_ENV}, else {DEFAULT_IMAGE})")
    p.add_argument("--sidecar-template", type=Path, default=None, metavar="FILE",
                   help=f"the node agent's container template, YAML (default: "
                        f"${SIDECAR_TEMPLATE_ENV}, else the built-in one)")
    p.add_argument("--workdir", type=Path, default=None,
                   help=f"journals and evidence (default: ${WORKDIR_ENV}, else "
                        ".tracehound/operator)")
    p.add_argument("--alerts", type=Path, action="append", default=None, metavar="FILE",
                   help="alert receivers file (repeatable; default: $TRACEHOUND_ALERTS)")
    p.add_argument("--liveness", default=None, metavar="URL",
                   help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--api-server", default=None, metavar="URL",
                   help="talk to this API server without credentials (tests, kubectl proxy)")
    p.add_argument("--crd", action="store_true",
                   help="print the TrainingJob CustomResourceDefinition and exit")
    p.set_defaults(handler=cmd_operator)


def config_from_args(args: argparse.Namespace,
                     environ: Mapping[str, str] | None = None) -> OperatorConfig:
    """The operator's configuration; ValueError naming the flag or variable that is wrong."""
    environ = os.environ if environ is None else environ
    image = args.image or environ.get(IMAGE_ENV) or DEFAULT_IMAGE
    template = args.sidecar_template or (Path(environ[SIDECAR_TEMPLATE_ENV])
                                         if environ.get(SIDECAR_TEMPLATE_ENV) else None)
    sidecar = (ko.load_sidecar_template(template) if template is not None
               else ko.default_sidecar(image=image))
    namespaces = args.namespace or [n.strip() for n in environ.get(NAMESPACE_ENV, "").split(",")
                                    if n.strip()]
    alerts = args.alerts or ([Path(environ["TRACEHOUND_ALERTS"])]
                             if environ.get("TRACEHOUND_ALERTS") else [])
    from tracehound.tracing.store.urls import default_store_url

    return OperatorConfig(
        store_url=args.store or environ.get("TRACEHOUND_STORE") or default_store_url(),
        image=image, sidecar=sidecar,
        workdir=args.workdir or Path(environ.get(WORKDIR_ENV) or ".tracehound/operator"),
        namespaces=tuple(namespaces), api_url=args.api_server, alerts=tuple(alerts),
    )


def cmd_operator(args: argparse.Namespace) -> int:
    if args.crd:
        sys.stdout.write(crd_yaml())
        return 0
    require_extra("kubernetes", "kopf", "kubernetes")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"tracehound operator: {exc}", file=sys.stderr)
        return 2
    log.info("operator: store %s, namespaces %s", mask_url(config.store_url),
             ", ".join(config.namespaces) or "all")
    run_operator(config, liveness=args.liveness)
    return 0
