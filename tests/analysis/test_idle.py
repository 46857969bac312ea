"""`analysis.idle`: since when a rank has done nothing, and the stall that makes a hang."""

from __future__ import annotations

from tracehound.analysis.idle import IdleTracker, idle_hang, is_idle
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind, ProcessSample, StackSample
from tracehound.tracing.ids import JobId, NodeId, Rank

S = 1_000_000
JOB = JobId("j")
FRAMES = ("train.py:9 main", "train.py:40 next_batch", "queue.py:180 get")


def proc(rank: int, t: float, *, state: str = "S", cpu: float = 0.001, io: float = 0.0,
         pid: int = 100) -> ProcessSample:
    return ProcessSample(job=JOB, attempt=0, node=NodeId("n1"), rank=Rank(rank), pid=pid,
                         time_us=int(t * S), state=state, cpu_s=1.0, cpu_rate=cpu,
                         read_bytes=0, write_bytes=0, io_rate=io)


def stack(rank: int, t: float, frames: tuple[str, ...] = FRAMES) -> StackSample:
    return StackSample(job=JOB, attempt=0, node=NodeId("n1"), rank=Rank(rank),
                       time_us=int(t * S), frames=frames)


def stall(*ranks: int, kind: IncidentKind = IncidentKind.STALL) -> Verdict:
    return Verdict(job=JOB, attempt=0, kind=kind, culprit_ranks=ranks,
                   culprit_nodes=tuple("n1" for _ in ranks), confidence=0.85,
                   basis=Basis.STANDSTILL, summary="busy",
                   evidence=(Evidence(fact=Fact.BUSY, rank=ranks[0], node="n1", detail="busy"),
                             Evidence(fact=Fact.WAITING, rank=0, node="n0", detail="waits")),
                   observed_at_us=0)


def follow(tracker: IdleTracker, rank: int, times: range, **kw: object) -> None:
    for t in times:
        tracker.observe([proc(rank, t, **kw)], [])  # type: ignore[arg-type]


def test_what_counts_as_idle() -> None:
    assert is_idle(proc(1, 0))
    assert not is_idle(proc(1, 0, cpu=0.3))  # computing
    assert not is_idle(proc(1, 0, io=1e6))  # writing
    assert not is_idle(proc(1, 0, state="D"))  # waiting on the disk
    assert not is_idle(proc(1, 0, state="T"))  # stopped: frozen, judged elsewhere


def test_a_span_runs_from_the_first_idle_sample_and_work_or_a_new_pid_starts_over() -> None:
    tracker = IdleTracker()
    follow(tracker, 3, range(10, 20))
    span = tracker.span(3, 20 * S)
    assert span is not None and span.since_us == 10 * S
    tracker.observe([proc(3, 20, cpu=0.5)], [])
    assert tracker.span(3, 21 * S) is None
    follow(tracker, 3, range(21, 23))
    tracker.observe([proc(3, 23, pid=101)], [])
    span = tracker.span(3, 23 * S)
    assert span is not None and span.since_us == 23 * S


def test_a_span_whose_samples_stopped_says_nothing_of_now() -> None:
    tracker = IdleTracker()
    follow(tracker, 3, range(0, 10))
    assert tracker.span(3, 12 * S) is not None
    assert tracker.span(3, 16 * S) is None


def test_a_stack_that_moved_starts_the_span_over_from_it() -> None:
    tracker = IdleTracker()
    follow(tracker, 3, range(0, 5))
    tracker.observe([], [stack(3, 2)])
    tracker.observe([proc(3, 8)], [stack(3, 8, ("train.py:9 main", "train.py:50 save"))])
    span = tracker.span(3, 8 * S)
    assert span is not None and span.since_us == 8 * S and span.stack is not None
    assert span.stack.frames[-1] == "train.py:50 save"


def test_a_stall_of_ranks_idle_past_their_threshold_with_a_stack_is_a_hang() -> None:
    tracker = IdleTracker()
    follow(tracker, 3, range(0, 31))
    assert idle_hang(stall(3), tracker, thresholds_s={3: 30}, now_us=31 * S) is None  # no stack
    tracker.observe([], [stack(3, 1)])
    assert idle_hang(stall(3), tracker, thresholds_s={3: 40}, now_us=31 * S) is None
    hang = idle_hang(stall(3), tracker, thresholds_s={3: 30}, now_us=31 * S)
    assert hang is not None
    assert (hang.kind, hang.basis, hang.culprit_ranks) == (IncidentKind.HANG,
                                                           Basis.IDLE_TIMEOUT, (3,))
    assert [e.fact for e in hang.evidence] == [Fact.IDLE, Fact.WAITING]
    assert "idle outside collectives for 31.0 s" in hang.evidence[0].detail
    assert "queue.py:180 get" in hang.evidence[0].detail
    assert hang.observed_at_us == 31 * S


def test_one_culprit_that_works_keeps_the_stall_and_other_kinds_are_left_alone() -> None:
    tracker = IdleTracker()
    for t in range(0, 31):
        tracker.observe([proc(3, t), proc(2, t, cpu=0.9)], [stack(3, 1)] if t == 1 else [])
    assert idle_hang(stall(3, 2), tracker, thresholds_s={2: 10, 3: 10}, now_us=31 * S) is None
    assert idle_hang(stall(3), tracker, thresholds_s={3: 10}, now_us=31 * S) is not None
    assert idle_hang(stall(3, kind=IncidentKind.STRAGGLER), tracker, thresholds_s={3: 10},
                     now_us=31 * S) is None
