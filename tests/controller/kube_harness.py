"""A Kubernetes API for the operator tests: kmock's in-memory emulator, served over real HTTP.

No real API server can run on this machine (no kube-apiserver, kind or envtest here), so kmock
stands in for it. What it does not do, and the tests must not rely on: it ignores label and
field selectors (the operator filters again itself), sets no uid or resourceVersion, runs no
scheduler, kubelet or garbage collector. The tests play the kubelet: they move pods to
Succeeded/Failed by patching their status, as a kubelet reports a container's end.

The emulator runs in a thread of its own (its own event loop), the operator in another (kopf's
loop), and the tests talk to both through the Kubernetes client, as a user's kubectl would.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kmock
from kmock._internal import apps
from kubernetes import client

from tracehound.controller.operator.handlers import OperatorConfig, run_operator
from tracehound.controller.orchestrators.jobspec import GROUP, KIND, PLURAL, VERSION

T = TypeVar("T")


class Emulator:
    """kmock's Kubernetes emulator on a loopback port, with TrainingJob declared."""

    def __init__(self, namespaces: tuple[str, ...] = ("default",)) -> None:
        self.namespaces = namespaces
        self.url = ""
        self.handler: Any = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="kmock", daemon=True)

    def _serve(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            async with kmock.KubernetesEmulator() as handler, apps.Server(handler):
                handler.resources.load_bundled()
                handler.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = {
                    "namespaced": True, "kind": KIND, "singular": KIND.lower(),
                    "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
                    "shortnames": [], "categories": [], "subresources": ["status"],
                }
                for ns in self.namespaces:  # kmock cannot create one over the API
                    handler.objects[kmock.resource("v1/namespaces"), None, ns] = {
                        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
                self.handler = handler
                self.url = str(handler.url).rstrip("/")
                self._ready.set()
                await self._stop.wait()

        asyncio.run(main())

    def start(self) -> Emulator:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("kmock did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def requests(self, method: str, plural: str) -> list[Any]:
        """The requests the emulator served with this HTTP method on this resource."""
        return [r for r in list(self.handler)
                if r.method.upper() == method.upper() and r.resource is not None
                and r.resource.plural == plural]


class Cluster:
    """The Kubernetes client against the emulator."""

    def __init__(self, url: str) -> None:
        configuration = client.Configuration()
        configuration.host = url
        self.api = client.ApiClient(configuration)
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        self.core.create_node(client.V1Node(
            metadata=client.V1ObjectMeta(
                name=name, labels={"kubernetes.io/hostname": name, **(labels or {})}),
            spec=client.V1NodeSpec(unschedulable=False)))

    def create_job(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
            "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
            # what an API server fills in (kmock does not): kopf's JSON patches test the
            # resourceVersion, and owner references need the uid
            "metadata": {"name": name, "namespace": namespace, "resourceVersion": "1",
                         "uid": str(uuid.uuid4())},
            "spec": spec})

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        found: dict[str, Any] = self.custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name)
        return found

    def pods(self, namespace: str) -> list[client.V1Pod]:
        return list(self.core.list_namespaced_pod(namespace).items)

    def events(self, namespace: str) -> list[client.CoreV1Event]:
        return list(self.core.list_namespaced_event(namespace).items)

    def end_pod(self, namespace: str, name: str, exit_code: int) -> None:
        """What a kubelet reports when the trainer container ends."""
        phase = "Succeeded" if exit_code == 0 else "Failed"
        self.core.patch_namespaced_pod_status(name, namespace, {"status": {
            "phase": phase,
            "containerStatuses": [{
                "name": "trainer", "ready": False, "restartCount": 0, "image": "x",
                "imageID": "",
                "state": {"terminated": {"exitCode": exit_code,
                                         "finishedAt": "2026-11-24T00:00:00Z"}}}]}})


@contextlib.contextmanager
def operator(config: OperatorConfig) -> Iterator[threading.Thread]:
    """The operator running in a thread until the block ends (then stopped as kopf stops:
    its daemons are told to stop and the supervisors detach)."""
    stop, ready = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def body() -> None:
        try:
            run_operator(config, stop_flag=stop, ready_flag=ready)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    thread = threading.Thread(target=body, name="operator", daemon=True)
    thread.start()
    if not ready.wait(60):
        raise RuntimeError(f"the operator did not start: {errors}")
    try:
        yield thread
    finally:
        stop.set()
        thread.join(60)
        if errors:
            raise errors[0]


def config(store_url: str, api_url: str, workdir: Path, sidecar: dict[str, Any],
           **overrides: Any) -> OperatorConfig:
    return OperatorConfig(store_url=store_url, image="tracehound:test", sidecar=sidecar,
                          workdir=workdir, api_url=api_url, **overrides)


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float = 120.0) -> T:
    """Poll until `probe` gives something truthy. The timeout only guards against a hang of
    the test itself; nothing is measured by it."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
