"""What the watcher tests drive it with: a job that reports into a real store the way a job under
`tracehound instrument` does (heartbeats from the ranks, process samples from the node agents,
the world's process group), on a clock that the test moves; and a fake of the other engineer's
`SlurmControl` (no Slurm cluster runs in these tests) keeping node and job states as scontrol
reports them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from supervisor_fakes import Clock, heartbeat

from tracehound.tracing.events import Batch, ProcessGroupInfo, ProcessSample, Record
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore

_batches = itertools.count()


@dataclass
class ReportingJob:
    """A 2x2 job as its recorders and node agents report it; `tick()` sends one round."""

    store: TraceStore
    clock: Clock
    job: JobId
    nodes: dict[int, str] = field(default_factory=lambda: {0: "node-0", 1: "node-0",
                                                           2: "node-1", 3: "node-1"})
    attempt: int = 0
    seq: int = 0
    stopped: int | None = None
    """The rank stopped with SIGSTOP (its peers wait for it in the next collective)."""
    stopped_at: int = 0
    gone: bool = False
    """Every rank's process ended (the node agents' last samples say `gone`)."""
    silent: bool = False
    """Nothing reports any more (the node agents are gone too)."""
    lag_us: int = 0
    """How late its reports reach the store: each is made this long before the clock's time
    (a node agent's shipping delay, a busy store)."""
    inside_ticks: int = 0
    """Rounds after `resume(inside=...)` in which every rank still reports waiting in the
    collective the stopped rank froze in (it had entered it), until that call completes."""
    late: set[int] = field(default_factory=set)
    """Ranks its group names that do not report yet (started after the others)."""
    _announced: int = -1
    _last_tick: int = 0
    _gone_sent: bool = False

    def tick(self) -> None:
        """One round of reports at the clock's time (none twice at one time: a node agent never
        samples a process twice in one microsecond)."""
        if self.silent or self._gone_sent or self.clock.now == self._last_tick:
            return
        self._last_tick = self.clock.now
        now = self.clock.now - self.lag_us
        records: list[Record] = []
        if self._announced != self.attempt:
            self._announced = self.attempt
            records.append(ProcessGroupInfo(job=self.job, attempt=self.attempt, rank=Rank(0),
                                            group=GroupId("0"), ranks=tuple(self.nodes),
                                            backend="gloo", time_us=now))
        if self.gone:
            self._gone_sent = True
            records += [self._process(r, now, "gone") for r in self.nodes]
        elif self.stopped is None and self.inside_ticks > 0:
            self.inside_ticks -= 1
            for rank, node in self.nodes.items():
                records.append(heartbeat(self.job, self.attempt, rank, now, self.seq + 1,
                                         self.seq, self.stopped_at, node))
                records.append(self._process(rank, now, "R"))
        elif self.stopped is None or now < self.stopped_at:  # (reports made before the stop)
            self.seq += 1
            for rank, node in self.nodes.items():
                if rank in self.late:
                    continue
                records.append(heartbeat(self.job, self.attempt, rank, now, self.seq, self.seq,
                                         now, node))
                records.append(self._process(rank, now, "R"))
        else:
            for rank, node in self.nodes.items():
                if rank == self.stopped:
                    records.append(self._process(rank, now, "T"))
                    continue
                records.append(heartbeat(self.job, self.attempt, rank, now, self.seq + 1,
                                         self.seq, self.stopped_at, node))
                records.append(self._process(rank, now, "S"))
        self.store.insert(Batch(batch_id=f"w-{self.job}-{next(_batches)}",
                                records=tuple(records)))

    def stop(self, rank: int) -> None:
        self.stopped, self.stopped_at = rank, self.clock.now

    def resume(self, *, inside: int = 0) -> None:
        """SIGCONT; with `inside`, the rank had frozen inside the collective its peers wait in,
        and every rank reports waiting there for `inside` more rounds."""
        self.stopped, self.inside_ticks = None, inside

    def restart(self, attempt: int, nodes: dict[int, str]) -> None:
        """Its launcher (or a requeue) starts `attempt` on `nodes`."""
        self.attempt, self.nodes, self.seq = attempt, dict(nodes), 0
        self.stopped, self.gone, self._gone_sent = None, False, False

    def _process(self, rank: int, now: int, state: str) -> ProcessSample:
        return ProcessSample(job=self.job, attempt=self.attempt, node=NodeId(self.nodes[rank]),
                             rank=Rank(rank), pid=1000 + rank, time_us=now, state=state,
                             cpu_s=1.0, cpu_rate=0.9 if state == "R" else 0.0, read_bytes=0,
                             write_bytes=0, io_rate=0.0)


class SlurmError(Exception):
    pass


@dataclass(frozen=True)
class StepResult:
    command: tuple[str, ...]
    ok: bool
    changed: bool
    detail: str


@dataclass
class FakeSlurm:
    """scontrol as the Slurm adapter sees it: node states, a job's state and nodes; every call
    that changes something is recorded."""

    nodes: dict[str, str] = field(default_factory=lambda: {"node-0": "ALLOCATED",
                                                           "node-1": "MIXED"})
    job: str = "RUNNING"
    job_nodes_: list[str] = field(default_factory=lambda: ["node-0", "node-1"])
    calls: list[tuple[str, ...]] = field(default_factory=list)
    fail: str = ""
    """A method that raises SlurmError."""

    def _maybe_fail(self, name: str) -> None:
        if self.fail == name:
            raise SlurmError(f"scontrol {name}: exit status 1: slurm_load_jobs error: Unable to "
                             "contact slurm controller")

    def check(self) -> None:
        self._maybe_fail("check")

    def node_state(self, node: str) -> str:
        self._maybe_fail("node_state")
        return self.nodes[node]

    def job_state(self, job_id: str) -> str:
        self._maybe_fail("job_state")
        return self.job

    def job_nodes(self, job_id: str) -> list[str]:
        return list(self.job_nodes_)

    def drain(self, nodes: list[str], reason: str) -> StepResult:
        self._maybe_fail("drain")
        self.calls.append(("drain", *nodes, reason))
        for n in nodes:
            self.nodes[n] += "+DRAIN"
        return StepResult(("scontrol", "update", f"NodeName={','.join(nodes)}", "State=DRAIN",
                           f"Reason={reason}"), True, True, "drained")

    def resume(self, nodes: list[str]) -> StepResult:
        raise AssertionError("the watcher never resumes a node")

    def requeue(self, job_id: str) -> StepResult:
        self._maybe_fail("requeue")
        self.calls.append(("requeue", job_id))
        self.job = "PENDING"
        return StepResult(("scontrol", "requeue", job_id), True, True, "requeued")

    def cancel(self, job_id: str) -> StepResult:
        self.calls.append(("cancel", job_id))
        self.job = "CANCELLED"
        return StepResult(("scontrol", "cancel", job_id), True, True, "cancelled")
