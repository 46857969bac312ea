"""The orchestrator port: whatever starts, watches and stops the ranks of a job.

`orchestrators.local.LocalOrchestrator` runs every "node" as a group of processes on this
machine; `orchestrators.kubernetes.KubernetesOrchestrator` runs it as pods (and cordons nodes).
The port declares every method the supervisor calls, and the supervisor only ever speaks to this
Protocol; tests/controller/test_orchestrator_contract.py holds both adapters to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tracehound.tracing.events import RankExit
from tracehound.tracing.ids import JobId, NodeId


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptPlan:
    """One launch of a job: which nodes, how many ranks each, what to run."""

    job: JobId
    attempt: int
    nodes: tuple[NodeId, ...]
    """The nodes of this attempt, in node-rank order: node i runs ranks i*M .. i*M+M-1."""
    nproc_per_node: int
    command: tuple[str, ...]
    """The training command (`python script.py ARGS` with the launcher's interpreter)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every rank."""

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.nproc_per_node

    def rank_nodes(self) -> dict[int, str]:
        """Global rank -> node."""
        return {
            i * self.nproc_per_node + local: node
            for i, node in enumerate(self.nodes)
            for local in range(self.nproc_per_node)
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Launched:
    """How an attempt's ranks were started: `warm` took the place of a waiting spare process
    (torch already imported), `cold` were started afresh, in `seconds`."""

    warm: int = 0
    cold: int = 0
    seconds: float = 0.0


class Orchestrator(Protocol):
    """Starts the ranks of an attempt, reports how they end, and stops them."""

    def launch(self, plan: AttemptPlan) -> Launched:
        """Start every rank of the attempt (and whatever per-node agents it needs)."""
        ...

    def wait_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> bool:
        """Wait up to `timeout_s` for a rank to exit; True when one did since the last call
        (`poll_exits` then returns it). An orchestrator that cannot be woken by an exit waits
        with `sleep` (the supervisor's own, so that tests drive time) and returns False."""
        ...

    def warm_up(self) -> None:
        """The attempt trains (every rank made its first step): prepare what would make the
        next attempt start faster (warm spare processes); nothing where there is no such
        thing."""
        ...

    def poll_exits(self) -> list[RankExit]:
        """Rank exits observed since the last call, earliest first."""
        ...

    def pid_of(self, rank: int) -> int | None:
        """The process id of a running rank, where the orchestrator can know it."""
        ...

    def finish(self) -> None:
        """The attempt ended by itself: let per-node agents ship what they hold, then stop them."""
        ...

    def stop(self, *, grace_s: float = 3.0) -> None:
        """Stop every rank of the current attempt (also stopped or hung ones) and the node agents,
        letting the agents ship what they hold."""
        ...

    def isolate(self, node: NodeId, *, reason: str) -> None:
        """Keep a node out of future attempts (cordon it)."""
        ...

    def adopt(self, plan: AttemptPlan) -> bool:
        """Watch the ranks of `plan`'s attempt that an earlier controller launched and left
        running; False when none of them runs any more."""
        ...

    def kill_leftovers(self, attempt: int) -> int:
        """Stop whatever an earlier controller left running of `attempt`; how many ranks."""
        ...

    def close(self) -> None:
        ...


class NotEnoughNodes(RuntimeError):
    """The pool has fewer healthy nodes than the job needs."""


class NodePool:
    """Nodes a job may run on, and which of them are isolated.

    A replacement takes the place of an isolated node, so every other node keeps its node rank
    (and its ranks) across a restart."""

    def __init__(self, nodes: Sequence[NodeId]) -> None:
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"node names must be unique, got {list(nodes)}")
        self._nodes = list(nodes)
        self._isolated: dict[NodeId, str] = {}
        self._current: list[NodeId] = []

    @property
    def isolated(self) -> dict[NodeId, str]:
        return dict(self._isolated)

    @property
    def current(self) -> tuple[NodeId, ...]:
        """The nodes of the latest assignment, in node-rank order."""
        return tuple(self._current)

    def restore(self, current: Sequence[str], isolated: Mapping[str, str]) -> None:
        """Take up where an earlier controller's pool was: its latest nodes and isolations."""
        unknown = sorted({*current, *isolated} - set(self._nodes))
        if unknown:
            raise ValueError(f"nodes {unknown} are not in this pool ({self._nodes})")
        self._current = [NodeId(n) for n in current]
        self._isolated = {NodeId(n): reason for n, reason in isolated.items()}

    def healthy_spares(self) -> list[NodeId]:
        return [n for n in self._nodes if n not in self._isolated and n not in self._current]

    def isolate(self, node: NodeId, reason: str) -> None:
        self._isolated[node] = reason

    def assign(self, count: int) -> tuple[NodeId, ...]:
        """The nodes for the next attempt: the current ones minus the isolated, topped up with
        spares in pool order."""
        keep = [n for n in self._current if n not in self._isolated]
        spares = [n for n in self._nodes if n not in self._isolated and n not in keep]
        nodes: list[NodeId] = []
        for slot in range(count):
            if slot < len(self._current) and self._current[slot] in keep:
                nodes.append(self._current[slot])
            elif spares:
                nodes.append(spares.pop(0))
            else:
                raise NotEnoughNodes(
                    f"need {count} healthy nodes, have {len(keep) + len(spares)} "
                    f"({len(self._isolated)} isolated: {sorted(self._isolated)})"
                )
        self._current = nodes
        return tuple(nodes)
