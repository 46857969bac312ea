"""What the supervisor tests drive it with: an orchestrator that records what it is asked (exits
are queued by the test) and a clock whose sleep only moves it forward."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tracehound.controller.orchestrators.port import AttemptPlan, Launched
from tracehound.tracing.events import GroupProgress, Heartbeat, RankExit
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank

S = 1_000_000


@dataclass
class ScriptedOrchestrator:
    """Records what the supervisor asks (launches also on the wall clock); exits are queued."""

    plans: list[AttemptPlan] = field(default_factory=list)
    launched_at: list[float] = field(default_factory=list)
    exits: list[RankExit] = field(default_factory=list)
    stopped: int = 0
    finished: int = 0
    isolated: list[str] = field(default_factory=list)
    closed: bool = False
    warmed: int = 0
    clock: Callable[[], float] = time.time
    """Seconds, for `launched_at` (the wall clock unless a test drives time)."""

    def launch(self, plan: AttemptPlan) -> Launched:
        self.plans.append(plan)
        self.launched_at.append(self.clock())
        return Launched(cold=plan.world_size)

    def wait_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> bool:
        sleep(timeout_s)
        return False

    def warm_up(self) -> None:
        self.warmed += 1

    def poll_exits(self) -> list[RankExit]:
        out, self.exits = self.exits, []
        return out

    def pid_of(self, rank: int) -> int | None:
        return 1000 + rank

    def finish(self) -> None:
        self.finished += 1

    def stop(self, *, grace_s: float = 3.0) -> None:
        self.stopped += 1

    def isolate(self, node: NodeId, *, reason: str) -> None:
        self.isolated.append(node)

    def adopt(self, plan: AttemptPlan) -> bool:
        return False

    def kill_leftovers(self, attempt: int) -> int:
        return 0

    def close(self) -> None:
        self.closed = True


class Clock:
    """Microseconds since the epoch; `sleep` advances it instead of waiting."""

    def __init__(self) -> None:
        self.now = 1_700_000_000 * S

    def __call__(self) -> int:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += int(seconds * S)


def heartbeat(job: JobId, attempt: int, rank: int, at: int, enq: int, comp: int, enq_us: int,
              node: str) -> Heartbeat:
    """A heartbeat of a rank in group 0 at `at`: `enq` collectives entered, `comp` completed
    (it waits in an all_reduce while enq > comp), the last one entered at `enq_us`."""
    return Heartbeat(
        job=job, attempt=attempt, node=NodeId(node), rank=Rank(rank), time_us=at, pid=1000 + rank,
        step=enq, step_us=at, start_step=0, first_step_us=at, dropped=0,
        groups=(GroupProgress(group=GroupId("0"), last_enqueued=enq, last_completed=comp,
                              pending_op="all_reduce" if enq > comp else "",
                              last_enqueue_us=enq_us, last_complete_us=enq_us),),
    )


def clean_exits(job: JobId, attempt: int, nodes: dict[int, str], at: int) -> list[RankExit]:
    """Every rank of `nodes` (rank -> node) exiting 0 at `at`: the attempt finished."""
    return [RankExit(job=job, attempt=attempt, node=NodeId(node), rank=Rank(r), pid=1000 + r,
                     exit_code=0, time_us=at) for r, node in sorted(nodes.items())]
