"""The Kubernetes operator against kmock over real HTTP.

The Kubernetes API server cannot run on this machine, so kmock's emulator stands in for it (see
`kube_harness`): the operator and the tests use the real Kubernetes client and its models over
HTTP, and the tests play the kubelet and the ranks. The store is the real ClickHouse server;
the ranks' heartbeats are written to it as node agents would.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_harness import Cluster, Emulator, config, operator, wait_for
from store_urls import store_url_of
from supervisor_fakes import S, heartbeat

from tracehound.analysis.settings import DetectionSettings, HangSettings
from tracehound.controller.operator.handlers import job_id
from tracehound.controller.orchestrators import kubeobjects as ko
from tracehound.controller.orchestrators.kubernetes import TAINT_KEY
from tracehound.controller.supervision.supervisor import SupervisorSettings
from tracehound.tracing.events import Batch, JobPhase
from tracehound.tracing.store import open_store

pytestmark = pytest.mark.clickhouse_server

NS = "ml"
NAME = "bert"
JOB = job_id(NS, NAME)
SPEC: dict[str, Any] = {
    "image": "registry.example/bert:7", "command": ["python", "train.py"],
    "nodes": 2, "procsPerNode": 2, "spareNodes": 1, "warmStandby": 1,
    "nodeSelector": {"pool": "gpu"},
    "checkpointDir": "/ckpt",
}
SETTINGS = SupervisorSettings(poll_s=0.2,
                              detection=DetectionSettings(hang=HangSettings(after_s=2.0)))


@pytest.fixture
def cluster() -> Iterator[tuple[Emulator, Cluster]]:
    emulator = Emulator(namespaces=(NS,)).start()
    try:
        kube = Cluster(emulator.url)
        for node in ("n-a", "n-b", "n-c"):
            kube.add_node(node, {"pool": "gpu"})
        kube.add_node("n-cpu", {"pool": "cpu"})
        yield emulator, kube
    finally:
        emulator.stop()


@pytest.fixture
def server_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    yield from store_url_of("server", request, tmp_path)


@pytest.fixture
def sidecar_file(tmp_path: Path) -> Path:
    """A sidecar template as the chart mounts it, with resources of its own."""
    template = ko.default_sidecar(image="tracehound:test", store_secret="ch-secret")
    template["resources"] = {"requests": {"cpu": "250m", "memory": "300Mi"},
                             "limits": {"cpu": "2", "memory": "2Gi"}}
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(template))
    return path


class Ranks:
    """The ranks of the running attempt, as their node agents report them: attempt 0 hangs
    (rank 3, on node-rank 1, stops while 0-2 wait in the next all_reduce); later attempts
    train."""

    def __init__(self, store_url: str, kube: Cluster) -> None:
        self.store = open_store(store_url)
        self.kube = kube
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ranks", daemon=True)
        self.n = 0

    def _attempt_nodes(self) -> tuple[int, dict[int, str]] | None:
        pods = [p for p in self.kube.pods(NS)
                if (p.metadata.labels or {}).get(ko.LABEL_ROLE) == "rank"]
        if not pods:
            return None
        attempt = max(int(p.metadata.labels[ko.LABEL_ATTEMPT]) for p in pods)
        nodes = {}
        for pod in pods:
            if int(pod.metadata.labels[ko.LABEL_ATTEMPT]) != attempt:
                continue
            nodes[int(pod.metadata.labels[ko.LABEL_NODE_RANK])] = _pinned_node(pod)
        return attempt, nodes

    def _run(self) -> None:
        stall_at: int | None = None
        while not self.stop.wait(0.2):
            found = self._attempt_nodes()
            if found is None:
                continue
            attempt, nodes = found
            now = int(time.time() * S)
            node_of = {r: nodes[r // 2] for r in range(4) if r // 2 in nodes}
            if attempt == 0:
                stall_at = stall_at or now
                beats = [heartbeat(JOB, 0, r, now, 41, 40, stall_at, node_of[r])
                         for r in (0, 1, 2) if r in node_of]
                if 3 in node_of:
                    beats.append(heartbeat(JOB, 0, 3, stall_at, 40, 40, stall_at - S // 10,
                                           node_of[3]))
            else:
                beats = [heartbeat(JOB, attempt, r, now, 5, 5, now, node_of[r])
                         for r in node_of]
            self.n += 1
            self.store.insert(Batch(batch_id=f"ranks-{self.n}", records=tuple(beats)))

    def __enter__(self) -> Ranks:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)
        self.store.close()


def _pinned_node(pod: Any) -> str:
    affinity = pod.spec.affinity.node_affinity
    term = affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[0]
    return str(term.match_expressions[0].values[0])


def _rank_pods(kube: Cluster, attempt: int) -> dict[str, Any]:
    return {p.metadata.name: p for p in kube.pods(NS)
            if (p.metadata.labels or {}).get(ko.LABEL_ATTEMPT) == str(attempt)}


def _phase(kube: Cluster) -> str | None:
    return (kube.job(NS, NAME).get("status") or {}).get("phase")


@pytest.mark.parametrize("stopped_while", ["attempt 1 trains", "restarting (backoff)"])
def test_a_faulty_node_is_cordoned_once_its_pods_recreated_and_a_restarted_operator_repeats_nothing(
    cluster: tuple[Emulator, Cluster], server_store_url: str, tmp_path: Path,
    sidecar_file: Path, stopped_while: str, caplog: pytest.LogCaptureFixture,
) -> None:
    emulator, kube = cluster
    caplog.set_level(logging.INFO, logger="tracehound.controller.orchestrators.kubernetes")
    template = ko.load_sidecar_template(sidecar_file)
    # clusterwide: kmock 0.8 cannot parse GET /api/v1/namespaces, which kopf's namespace
    # observer sends when given namespaces
    cfg = config(server_store_url, emulator.url, tmp_path / "op", template, settings=SETTINGS)
    spec = dict(SPEC)
    if stopped_while == "restarting (backoff)":
        spec["policy"] = {"version": 1, "restart_backoff_s": 60}
    kube.create_job(NS, NAME, spec)
    with Ranks(server_store_url, kube):
        with operator(cfg):
            wait_for("attempt 0's pods", lambda: len(_rank_pods(kube, 0)) == 2)
            pods0 = _rank_pods(kube, 0)
            if stopped_while == "attempt 1 trains":
                # the hang on n-b is found, n-b isolated, attempt 1 launched on n-a and n-c
                wait_for("attempt 1's pods", lambda: len(_rank_pods(kube, 1)) == 2)
                wait_for("status running attempt 1", lambda: (
                    kube.job(NS, NAME).get("status", {}).get("attempt") == 1
                    and _phase(kube) == "Running"))
            else:
                wait_for("status restarting", lambda: _phase(kube) == "Restarting")
        # the operator stopped (detached) and deleted nothing of the job
        if stopped_while == "attempt 1 trains":
            assert len(_rank_pods(kube, 1)) == 2, "stopping the operator deleted no pod"
        else:
            assert not _rank_pods(kube, 1) and not _rank_pods(kube, 0)
            assert kube.core.read_node("n-b").spec.unschedulable is True
        with operator(cfg):  # a new operator picks the job up where the store says it was
            wait_for("attempt 1's pods", lambda: len(_rank_pods(kube, 1)) == 2)
            # its ranks end only once it watches them: a job whose ranks all ended while no
            # controller watched is relaunched (a loaded CI run ended them before the new
            # operator had looked, after the second it was once given here)
            if stopped_while == "attempt 1 trains":  # (else it launches attempt 1 itself)
                wait_for("the new operator to adopt attempt 1", lambda: any(
                    "attempt 1: adopted 2 pods" in r.getMessage() for r in caplog.records))
            time.sleep(1.0)  # a few of its polls, while attempt 1 trains
            for name in _rank_pods(kube, 1):
                kube.end_pod(NS, name, 0)
            wait_for("the job to finish", lambda: _phase(kube) == "Finished")

    # exactly one cordon and taint, of the node the hang was on
    node_b = kube.core.read_node("n-b")
    assert node_b.spec.unschedulable is True
    assert [t.key for t in node_b.spec.taints] == [TAINT_KEY]
    assert len(emulator.requests("PATCH", "nodes")) == 1, "n-b patched once, by one operator"
    for other in ("n-a", "n-c", "n-cpu"):
        assert not kube.core.read_node(other).spec.unschedulable

    # attempt 0's pods were deleted, attempt 1's created once each on n-a and n-c
    assert not _rank_pods(kube, 0)
    created = [r.data["metadata"]["name"] for r in emulator.requests("POST", "pods")]
    ranks_created = [n for n in created if "-standby-" not in n]
    assert sorted(ranks_created) == sorted([*pods0, "bert-a1-n0", "bert-a1-n1"]), created
    pods1 = _rank_pods(kube, 1)
    assert {name: _pinned_node(p) for name, p in pods1.items()} == {
        "bert-a1-n0": "n-a", "bert-a1-n1": "n-c"}

    # the sidecar injected is the template plus the pod's job, node and attempt
    pod = pods1["bert-a1-n1"]
    sidecar = kube.api.sanitize_for_serialization(pod.spec.init_containers[1])
    assert sidecar == ko.sidecar_container(template, job=JOB, attempt=1)
    trainer = pod.spec.containers[0]
    assert trainer.image == SPEC["image"] and trainer.command[-2:] == ["python", "train.py"]
    assert "--node-rank=1" in trainer.command and "--nproc-per-node=2" in trainer.command
    env = {e.name: e.value for e in trainer.env}
    assert env["TRACEHOUND_JOB_ID"] == JOB and env["TRACEHOUND_ATTEMPT"] == "1"
    assert env["PYTHONPATH"] == f"{ko.RECORDER_DIR}/bootstrap:{ko.RECORDER_DIR}/site"

    # the spare n-c was kept warm by a standby pod until attempt 1 took the node
    standby = ko.standby_name(NAME, "n-c")
    assert created.count(standby) == 1
    assert standby not in {p.metadata.name for p in kube.pods(NS)}

    # the status says what happened
    status = kube.job(NS, NAME)["status"]
    assert status["phase"] == "Finished" and status["restarts"] == 1
    assert status["isolatedNodes"] == ["n-b"] and status["nodes"] == ["n-a", "n-c"]
    assert status["lastIncident"] == ""  # the run finished; the incident is in the store
    healthy = next(c for c in status["conditions"] if c["type"] == "Healthy")
    assert healthy["status"] == "True"
    with open_store(server_store_url) as store:
        incidents = store.incidents(JOB)
        (incident,) = [i for i in incidents if i.kind == "hang"]
        assert incident.culprit_nodes == ("n-b",)
        # before the hang was sure, rank 3 may have looked busy (a stall): only watched
        assert all(a.kind == "observe" for i in incidents if i is not incident
                   for a in i.actions)
        assert [a.kind for a in incident.actions][:3] == ["stop_job", "isolate_node", "restart"]
        states = store.job_states(JOB)
    assert [s.seq for s in states] == list(range(1, len(states) + 1))
    assert states[-1].state is JobPhase.FINISHED
    assert len({s.controller for s in states}) >= 1

    reasons = [e.reason for e in kube.events(NS)]
    assert reasons.count("NodeIsolated") == 1
    assert "Incident" in reasons and "Restarting" in reasons and "Finished" in reasons


class Receiver:
    """A webhook receiver on 127.0.0.1 that answers 200 and keeps each body."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[dict[str, Any]] = []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                bodies.append(json.loads(body))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_the_alerts_the_operator_sent_are_recorded_on_the_incident(
    cluster: tuple[Emulator, Cluster], server_store_url: str, tmp_path: Path,
) -> None:
    emulator, kube = cluster
    receiver = Receiver()
    receivers = tmp_path / "alerts.yaml"
    receivers.write_text(yaml.safe_dump({"receivers": [
        {"name": "oncall-hook", "kind": "webhook", "url": receiver.url, "secret": "s"}]}))
    cfg = config(server_store_url, emulator.url, tmp_path / "op",
                 ko.default_sidecar(image="tracehound:test"), settings=SETTINGS,
                 alerts=(receivers,))
    kube.create_job(NS, NAME, SPEC)
    try:
        with Ranks(server_store_url, kube), operator(cfg):
            wait_for("attempt 1's pods", lambda: len(_rank_pods(kube, 1)) == 2)
            for name in _rank_pods(kube, 1):
                kube.end_pod(NS, name, 0)
            wait_for("the job to finish", lambda: _phase(kube) == "Finished")
    finally:
        receiver.close()

    assert [b["status"] for b in receiver.bodies if b["kind"] == "hang"][:1] == ["firing"]
    with open_store(server_store_url) as store:
        (incident,) = [i for i in store.incidents(JOB) if i.kind == "hang"]
    alerts = [(a.target, a.ok, a.detail) for a in incident.actions if a.kind == "alert"]
    assert ("oncall-hook", True,
            "firing alert delivered to oncall-hook (webhook) after 1 try") in alerts
    assert {target for target, _, _ in alerts} == {"oncall-hook"}
    # what the operator did is what it does without alerts
    assert [a.kind for a in incident.actions if a.kind != "alert"][:3] == [
        "stop_job", "isolate_node", "restart"]


@pytest.mark.parametrize(("spec", "field"), [
    ({**SPEC, "nodes": 0}, "spec.nodes"),
    ({**SPEC, "warmStandby": 2}, "spec.warmStandby"),
    ({k: v for k, v in SPEC.items() if k != "image"}, "spec.image"),
    ({**SPEC, "policy": {"version": 1, "restart_backof_s": 3}}, "restart_backof_s"),
])
def test_an_invalid_trainingjob_is_rejected_naming_the_field_and_gets_no_pods(
    cluster: tuple[Emulator, Cluster], server_store_url: str, tmp_path: Path,
    spec: dict[str, Any], field: str,
) -> None:
    emulator, kube = cluster
    cfg = config(server_store_url, emulator.url, tmp_path / "op",
                 ko.default_sidecar(image="tracehound:test"), settings=SETTINGS)
    kube.create_job(NS, NAME, spec)
    with operator(cfg):
        wait_for("status Invalid", lambda: _phase(kube) == "Invalid")
    status = kube.job(NS, NAME)["status"]
    assert field in status["message"] and f"{NS}/{NAME}" in status["message"]
    (condition,) = status["conditions"]
    assert condition["type"] == "Valid" and condition["status"] == "False"
    warnings = [e for e in kube.events(NS) if e.reason == "InvalidSpec"]
    assert len(warnings) == 1 and field in warnings[0].message
    assert warnings[0].type == "Warning" and warnings[0].involved_object.name == NAME
    assert not kube.pods(NS)
    assert not emulator.requests("POST", "pods")
