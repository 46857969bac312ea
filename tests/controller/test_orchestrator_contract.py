"""The orchestrator port's contract, held to both adapters: the local one (real processes on
this machine, a real node agent per node) and the Kubernetes one against kmock's emulator over
real HTTP (no API server can run here: kmock stands in for it, and the test plays the kubelet,
reporting a trainer container's end on its pod, as tests/controller/kube_harness.py says).

Each adapter implements every method the port declares, with the port's parameters; a launch
says how its ranks were started; every rank's exit is reported once, with its code and attempt;
an orchestrator that cannot be woken by an exit waits with the supervisor's sleep; after a stop
nothing of the attempt is left to adopt; isolating and closing never raise."""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from kube_harness import Cluster, Emulator

from tracehound.controller.orchestrators import kubeobjects as ko
from tracehound.controller.orchestrators.jobspec import TrainingJobSpec
from tracehound.controller.orchestrators.kubernetes import KubernetesOrchestrator
from tracehound.controller.orchestrators.local import LocalOrchestrator
from tracehound.controller.orchestrators.port import AttemptPlan, Launched, Orchestrator
from tracehound.tracing.events import RankExit
from tracehound.tracing.ids import JobId, NodeId

pytestmark = pytest.mark.e2e

NODES = (NodeId("n0"), NodeId("n1"))
PER_NODE = 2


@dataclass
class Adapter:
    """An orchestrator under test, and how its ranks are made to end (the kubelet's part, for
    pods) with a code."""

    name: str
    orch: Orchestrator
    end_all: Callable[[AttemptPlan, int], None]
    command: Callable[[int], tuple[str, ...]]


def plan(adapter: Adapter, attempt: int, code: int) -> AttemptPlan:
    return contract_plan(adapter.command(code), attempt)


def contract_plan(command: tuple[str, ...], attempt: int = 0) -> AttemptPlan:
    return AttemptPlan(job=JobId("contract"), attempt=attempt, nodes=NODES,
                       nproc_per_node=PER_NODE, command=command)


@pytest.fixture(params=["local", "kubernetes"])
def adapter(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Adapter]:
    if request.param == "local":
        orch = local_orchestrator(tmp_path / "work")

        def command(code: int) -> tuple[str, ...]:
            # each rank waits a moment (so that a stop finds it running), then exits with `code`
            return (sys.executable, "-c", f"import sys, time; time.sleep(1.5); sys.exit({code})")

        try:
            yield Adapter("local", orch, lambda plan, code: None, command)
        finally:
            orch.close()
        return
    emulator, cluster = kube_cluster()
    kube = kube_orchestrator(cluster)

    def end_all(plan: AttemptPlan, code: int) -> None:
        for node_rank in range(len(plan.nodes)):
            cluster.end_pod("default", ko.pod_name("contract", plan.attempt, node_rank), code)

    try:
        yield Adapter("kubernetes", kube, end_all, lambda code: ("python", "train.py"))
    finally:
        kube.close()
        emulator.stop()


def local_orchestrator(workdir: Path) -> LocalOrchestrator:
    """A local orchestrator in `workdir` (one per controller) whose agents ship nowhere."""
    return LocalOrchestrator(workdir=workdir, sink="http://127.0.0.1:9/ingest", warm_spares=False)


def kube_cluster() -> tuple[Emulator, Cluster]:
    """kmock's emulator with three nodes."""
    emulator = Emulator().start()
    cluster = Cluster(emulator.url)
    for node in ("n0", "n1", "n2"):
        cluster.add_node(node)
    return emulator, cluster


def kube_orchestrator(cluster: Cluster) -> KubernetesOrchestrator:
    """An orchestrator of the job `contract` on `cluster` (one per controller)."""
    spec = TrainingJobSpec(image="registry.example/train:1", command=("python", "train.py"),
                           nodes=len(NODES), procs_per_node=PER_NODE, spare_nodes=1)
    return KubernetesOrchestrator(core=cluster.core, namespace="default", resource="contract",
                                  spec=spec, sidecar=ko.default_sidecar(image="tracehound:1"),
                                  image="tracehound:1", pool=("n0", "n1", "n2"))


def exits_of(adapter: Adapter, count: int, timeout_s: float = 60.0) -> list[RankExit]:
    found: list[RankExit] = []
    deadline = time.monotonic() + timeout_s
    while len(found) < count and time.monotonic() < deadline:
        adapter.orch.wait_exit(0.2, time.sleep)
        found += adapter.orch.poll_exits()
    return found


def test_every_method_the_port_declares_is_implemented_with_its_parameters(
        adapter: Adapter) -> None:
    declared = {name: member for name, member in vars(Orchestrator).items()
                if inspect.isfunction(member) and not name.startswith("_")}
    assert {"launch", "wait_exit", "warm_up", "poll_exits", "stop", "adopt"} <= set(declared)
    for name, member in declared.items():
        implemented = getattr(adapter.orch, name, None)
        assert callable(implemented), f"{adapter.name} lacks {name}"
        wanted = [p for p in inspect.signature(member).parameters if p != "self"]
        given = list(inspect.signature(implemented).parameters)
        assert given[:len(wanted)] == wanted, (adapter.name, name, given, wanted)


def test_each_rank_exit_is_reported_once_with_its_code(adapter: Adapter) -> None:
    attempt = plan(adapter, 0, 3)
    launched = adapter.orch.launch(attempt)
    assert isinstance(launched, Launched)
    assert launched.warm + launched.cold == attempt.world_size
    adapter.orch.warm_up()
    adapter.end_all(attempt, 3)
    exits = exits_of(adapter, attempt.world_size)
    assert sorted(int(e.rank) for e in exits) == list(range(attempt.world_size))
    assert {(e.exit_code, e.attempt, e.job) for e in exits} == {(3, 0, "contract")}
    assert {int(e.rank): e.node for e in exits} == attempt.rank_nodes()
    assert exits_of(adapter, 1, timeout_s=0.5) == []  # never twice
    adapter.orch.finish()


def test_a_stopped_attempt_leaves_nothing_to_adopt(adapter: Adapter) -> None:
    attempt = plan(adapter, 1, 0)
    adapter.orch.launch(attempt)
    adapter.orch.stop(grace_s=0.5)
    assert adapter.orch.adopt(attempt) is False
    assert adapter.orch.kill_leftovers(1) >= 0
    adapter.orch.isolate(NodeId("n1"), reason="contract test")
    adapter.orch.close()
    adapter.orch.close()  # closing twice is harmless


def test_waiting_for_an_exit_returns_within_its_timeout(adapter: Adapter) -> None:
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)

    started = time.monotonic()
    woken = adapter.orch.wait_exit(0.3, sleep)
    assert woken is False  # nothing launched: nothing exited
    assert time.monotonic() - started >= 0.25
    assert slept in ([], [0.3])  # woken by exits (local), or the supervisor's sleep


@pytest.mark.parametrize(("codes", "adopted"), [((0, 0, 0, 0), True), ((0, 0, 1, 0), False)],
                         ids=["all status 0", "one failed"])
def test_an_attempt_that_ended_unwatched_is_adopted_only_if_every_rank_finished(
        tmp_path: Path, codes: tuple[int, ...], adopted: bool) -> None:
    """(The local adapter.) A controller dies; its ranks end before the next one looks. If
    each left status 0, the next one adopts the ended attempt and reports those exits, so the
    job finishes instead of being relaunched from its last checkpoint; if one failed, nothing
    is adopted (its supervisor relaunches it, as after any rank ended unknown)."""
    workdir = tmp_path / "work"
    first = local_orchestrator(workdir)
    script = f"import sys, os; sys.exit({list(codes)}[int(os.environ['RANK'])])"
    attempt = contract_plan((sys.executable, "-c", script))
    first.launch(attempt)
    exits = exits_of(Adapter("local", first, lambda plan, code: None, lambda code: ()), 4)
    assert sorted(e.exit_code for e in exits) == sorted(codes)
    # the first controller is gone without finishing (its node agents still run)
    second = local_orchestrator(workdir)
    try:
        assert second.adopt(attempt) is adopted
        if adopted:
            again = exits_of(Adapter("local", second, lambda plan, code: None,
                                     lambda code: ()), 4)
            assert {int(e.rank): e.exit_code for e in again} == dict(enumerate(codes))
            second.finish()
    finally:
        second.close()
        first.close()


def test_a_stopped_attempt_whose_ranks_exit_0_is_not_adopted(tmp_path: Path) -> None:
    """(The local adapter.) Ranks that leave status 0 on SIGTERM, stopped by their
    controller: stopped, not finished, so nothing is adopted."""
    orch = local_orchestrator(tmp_path / "work")
    script = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
              "time.sleep(60)")
    attempt = contract_plan((sys.executable, "-c", script))
    try:
        orch.launch(attempt)
        time.sleep(1.0)
        orch.stop(grace_s=5.0)
        assert orch.adopt(attempt) is False
    finally:
        orch.close()


@pytest.mark.parametrize(("codes", "adopted"), [((0, 0), True), ((0, 1), False)],
                         ids=["all status 0", "one failed"])
def test_pods_that_ended_unwatched_are_adopted_only_if_every_trainer_finished(
        codes: tuple[int, ...], adopted: bool) -> None:
    """(The Kubernetes adapter, on kmock.) As for the local one: an attempt whose pods all
    ended with 0 before the next controller looked is adopted, and its exits reported."""
    emulator, cluster = kube_cluster()
    attempt = contract_plan(("python", "train.py"))
    first, second = kube_orchestrator(cluster), kube_orchestrator(cluster)
    try:
        first.launch(attempt)
        for node_rank, code in enumerate(codes):
            cluster.end_pod("default", ko.pod_name("contract", 0, node_rank), code)
        # the first controller is gone; the next one looks
        assert second.adopt(attempt) is adopted
        if adopted:
            exits = second.poll_exits()
            assert {int(e.rank): e.exit_code for e in exits} == dict.fromkeys(range(4), 0)
    finally:
        second.close()
        first.close()
        emulator.stop()
