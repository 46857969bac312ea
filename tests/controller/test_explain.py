"""`tracehound diagnose` over stored traces gives the verdict the live analysis gave."""

from __future__ import annotations

from typing import Any, cast

from tracehound.controller.cli.explain import diagnose_stored, format_verdict
from tracehound.tracing.events import Batch, GroupProgress, Heartbeat, RankExit
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore

S = 1_000_000
T0 = 1_700_000_000 * S
JOB = JobId("explain")


def beat(rank: int, at: int, attempt: int = 0) -> Heartbeat:
    return Heartbeat(
        job=JOB, attempt=attempt, node=NodeId(f"node-{rank // 2}"), rank=Rank(rank), time_us=at,
        pid=1, step=3, step_us=at, start_step=0, first_step_us=T0, dropped=0,
        groups=(GroupProgress(group=GroupId("0"), last_enqueued=9, last_completed=9,
                              pending_op="", last_enqueue_us=at, last_complete_us=at),),
    )


def test_a_crash_at_the_very_end_of_the_data_is_still_diagnosed(store: TraceStore) -> None:
    # The job was stopped right after the first failure: no record is newer than the exit.
    kill = T0 + 10 * S
    records = (*(beat(r, kill - S // 10) for r in range(4)),
               RankExit(job=JOB, attempt=0, node=NodeId("node-0"), rank=Rank(1), pid=2,
                        exit_code=-9, time_us=kill))
    store.insert(Batch(batch_id="x", records=records))
    outcome = diagnose_stored(store, JOB)
    assert outcome is not None
    assert outcome["kind"] == "crash"
    assert outcome["culprit_ranks"] == [1]
    assert "rank 1 on node node-0 killed by signal 9" in format_verdict(outcome)


def test_a_healthy_job_says_so_and_an_unknown_job_is_none(store: TraceStore) -> None:
    store.insert(Batch(batch_id="y", records=tuple(beat(r, T0) for r in range(2))))
    outcome = diagnose_stored(store, JOB)
    assert outcome is not None
    assert outcome["kind"] == "healthy" and outcome["ranks_seen"] == 2
    assert diagnose_stored(store, JobId("nope")) is None


class CountingStore:
    """A store that counts how often the job's incidents are read."""

    def __init__(self, store: TraceStore) -> None:
        self.store = store
        self.incident_reads = 0

    def incidents(self, job: JobId | None = None) -> list[Any]:
        self.incident_reads += 1
        return self.store.incidents(job)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def test_the_incidents_are_read_once_whatever_the_attempts(store: TraceStore) -> None:
    records = tuple(beat(r, T0 + a * S, attempt=a) for a in range(3) for r in range(2))
    store.insert(Batch(batch_id="z", records=records))
    counting = CountingStore(store)
    outcome = diagnose_stored(cast(TraceStore, counting), JOB)
    assert outcome is not None and outcome["kind"] == "healthy"
    assert counting.incident_reads == 1
