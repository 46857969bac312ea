"""Ranks that someone else launched, as the store shows them: the orchestrator adapter of
`tracehound watch`, which observes only.

A watched job was started by Slurm, torchrun or Ray, with `tracehound instrument` or `tracehound
agent` recording it. The watcher runs the supervisor's detection loop over it through this
adapter, which starts, stops and isolates nothing (what the watcher does about an incident goes
through its own port, `controller.actions`). It does not satisfy the launching part of the port's
contract: `launch` and `adopt` start nothing, `stop` and `isolate` refuse, and it reports no exits.
A watcher is nobody's parent, and the node agents do not see exit statuses, only that a process
is gone.

What it knows, it learns from the store:

- `placement`: the attempt's ranks and their nodes, from the ranks' heartbeats, the process
  samples of their node agents, and the members of the process groups they created. A member
  that has not reported yet is expected on node `UNKNOWN_NODE`, so that a rank that never
  reports while its peers wait on it is still named.
- `attempt_end`: whether the attempt is over, and how. It is over when every rank's process is
  gone (the node agents' last process sample says `gone`, or a stored exit says so): "exited".
  It is also over when nothing of the attempt has reported for `silent_after_s`, no heartbeat
  and no process sample: "stopped reporting". How the ranks ended (their exit status) is not
  known to a watcher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, Literal

from tracehound.analysis.snapshot import JobSnapshot
from tracehound.controller.orchestrators.port import AttemptPlan, Launched
from tracehound.tracing.events import ProcessState, RankExit
from tracehound.tracing.ids import NodeId

UNKNOWN_NODE: Final = "unknown"
"""The node of a process group's member that has not reported yet."""

_GONE: Final = frozenset({ProcessState.GONE.value, ProcessState.ZOMBIE.value,
                          ProcessState.DEAD.value})

How = Literal["exited", "stopped reporting"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptEnd:
    """How a watched attempt ended."""

    how: How
    at_us: int
    """When: the last rank's process was seen gone, or the attempt's last report."""
    ranks: int
    """How many ranks the attempt had."""

    def words(self, now_us: int) -> str:
        if self.how == "exited":
            return (f"its {self.ranks} rank{'s' if self.ranks != 1 else ''} exited (their "
                    "processes are gone; how they ended is not known to a watcher)")
        silent = max(0.0, (now_us - self.at_us) / 1e6)
        return (f"its {self.ranks} rank{'s' if self.ranks != 1 else ''} stopped reporting: "
                f"nothing from any of them for {silent:.1f} s")


def placement(snapshot: JobSnapshot, known: Mapping[int, str] | None = None) -> dict[int, str]:
    """Rank -> node of every rank `snapshot` shows, on top of what was `known` before (a rank
    once seen stays; a node learned replaces `UNKNOWN_NODE`)."""
    nodes = dict(known or {})
    for rank in sorted({r for g in snapshot.groups for r in g.ranks}):
        nodes.setdefault(int(rank), UNKNOWN_NODE)
    seen = [*snapshot.exits, *snapshot.processes, *snapshot.heartbeats]  # newest kind last
    for record in seen:
        nodes[int(record.rank)] = str(record.node)
    return dict(sorted(nodes.items()))


def known_nodes(rank_nodes: Mapping[int, str]) -> list[str]:
    """The nodes of a `placement` its ranks have named, sorted (without `UNKNOWN_NODE`)."""
    return sorted({n for n in rank_nodes.values() if n != UNKNOWN_NODE})


def last_report_us(snapshot: JobSnapshot) -> int:
    """When anything of the attempt last reported (a heartbeat or a process sample); 0 never."""
    times = [hb.time_us for hb in snapshot.heartbeats]
    times += [p.time_us for p in snapshot.processes]
    return max(times, default=0)


def attempt_end(snapshot: JobSnapshot, ranks: Iterable[int], *, now_us: int,
                silent_after_s: float) -> AttemptEnd | None:
    """How the attempt of `snapshot` (whose ranks are `ranks`) ended, or None while it runs (see
    the module docstring)."""
    expected = set(ranks) | {int(hb.rank) for hb in snapshot.heartbeats}
    if not expected:
        return None
    ended: dict[int, int] = {int(e.rank): e.time_us for e in snapshot.exits}
    for sample in snapshot.processes:
        if sample.state in _GONE:
            ended.setdefault(int(sample.rank), sample.time_us)
    if expected <= set(ended):
        return AttemptEnd(how="exited", at_us=max(ended[r] for r in expected),
                          ranks=len(expected))
    last = last_report_us(snapshot)
    if last and now_us - last >= int(silent_after_s * 1e6):
        return AttemptEnd(how="stopped reporting", at_us=last, ranks=len(expected))
    return None


class NotActing(RuntimeError):
    """A watcher asked its observe-only orchestrator to act (a defect: the watcher acts through
    its action port)."""


class WatchedRanks:
    """The Orchestrator port over ranks someone else launched (see the module docstring)."""

    def __init__(self, *, pids: Callable[[], Mapping[int, int]] = dict) -> None:
        """`pids()` gives rank -> pid as last reported (for `pid_of`)."""
        self._pids = pids

    def launch(self, plan: AttemptPlan) -> Launched:
        return Launched()  # its launcher started it

    def wait_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> bool:
        sleep(timeout_s)
        return False

    def warm_up(self) -> None:
        return None

    def poll_exits(self) -> list[RankExit]:
        return []  # a watcher sees no exit status: `attempt_end` tells the ranks are gone

    def pid_of(self, rank: int) -> int | None:
        return self._pids().get(rank)

    def finish(self) -> None:
        return None

    def stop(self, *, grace_s: float = 3.0) -> None:
        raise NotActing("a watched job is never stopped by its orchestrator; the watcher's "
                        "action port acts on it")

    def isolate(self, node: NodeId, *, reason: str) -> None:
        raise NotActing("a watched job's nodes are isolated through the watcher's action port")

    def adopt(self, plan: AttemptPlan) -> bool:
        return True  # whether its ranks still run is `attempt_end`'s to say

    def kill_leftovers(self, attempt: int) -> int:
        return 0  # never: its ranks are its launcher's

    def close(self) -> None:
        return None
