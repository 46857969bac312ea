"""The TraceStore contract for health and stack samples, bulk collective columns and the window
summaries, run against every adapter (a real ClickHouse 18.16 server and chdb): the summaries
the store computes in SQL equal the numpy reference (tracehound.analysis.sim.reference) on the
same rows."""

from __future__ import annotations

import dataclasses
import uuid

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from store_urls import STORE_ADAPTERS
from summary_data import (
    SIBLING_EXAMPLE,
    T0,
    Case,
    Row,
    assert_clock_samples,
    assert_link_stats,
    assert_node_windows,
    assert_rank_stats,
    columns,
    random_case,
    skewed_clock,
    small_cases,
)

from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    HealthSample,
    HealthSeverity,
    Record,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import InsertReport, TraceStore, bulk
from tracehound.tracing.summaries import CollectiveColumns

JOB = JobId("job-q")


def stack(rank: int, t: int, *, job: str = JOB, attempt: int = 0, top: str = "train.py:10 step"
          ) -> StackSample:
    return StackSample(job=JobId(job), attempt=attempt, node=NodeId(f"node-{rank // 2}"),
                       rank=Rank(rank), time_us=t,
                       frames=("run.py:1 <module>", "train.py:40 main", top))


def health(node: str, t: int, metric: str = "xid", *, job: str = JOB, value: float = 79.0,
           severity: HealthSeverity = HealthSeverity.CRITICAL) -> HealthSample:
    return HealthSample(job=JobId(job), node=NodeId(node), device="gpu3", time_us=t,
                        source="simulated", metric=metric, value=value, severity=severity,
                        detail="fell off the bus" if metric == "xid" else "")


# --- health and stack samples ----------------------------------------------------------------


def test_stack_and_health_samples_round_trip_exactly_once(store: TraceStore) -> None:
    records: list[Record] = [
        stack(0, T0 + 5), stack(1, T0 + 6, top="it's \\ odd\n ✓"),
        StackSample(job=JOB, attempt=0, node=NodeId("n"), rank=Rank(2), time_us=T0, frames=()),
        health("node-0", T0 + 1), health("node-0", T0 + 1, "temperature_c", value=-0.5,
                                         severity=HealthSeverity.INFO),
        health("node-1", T0 + 2, job="", value=1e300),
    ]
    batch = Batch(batch_id="b-samples", records=tuple(records))
    assert store.insert(batch, maybe_duplicate=True) == InsertReport(inserted=6, skipped=0)
    assert store.insert(batch, maybe_duplicate=True) == InsertReport(inserted=0, skipped=6)
    assert store.latest_stacks(JOB, 0, 0) == [records[0], records[1], records[2]]
    # Time-ordered; at one time by node, device and metric.
    assert store.health(["node-0", "node-1"], 0, T0 + 10) == [records[4], records[3], records[5]]


def test_latest_stacks_gives_the_newest_sample_per_rank_since_a_time(store: TraceStore) -> None:
    store.insert(Batch(batch_id="b1", records=(
        stack(1, T0 + 10), stack(0, T0 + 30, top="old"), stack(0, T0 + 50, top="new"),
        stack(2, T0 + 5), stack(0, T0 + 90, attempt=1), stack(0, T0 + 95, job="other"),
    )))
    store.insert(Batch(batch_id="b2", records=(stack(1, T0 + 20, top="newer"),)))
    assert store.latest_stacks(JOB, 0, T0 + 10) == [
        stack(0, T0 + 50, top="new"), stack(1, T0 + 20, top="newer"),
    ]
    assert [s.rank for s in store.latest_stacks(JOB, 0, 0)] == [0, 1, 2]
    assert store.latest_stacks(JOB, 0, T0 + 51) == []
    assert store.latest_stacks(JOB, 1, -5) == [stack(0, T0 + 90, attempt=1)]


def test_health_reads_the_nodes_asked_for_in_a_window_of_any_job(store: TraceStore) -> None:
    samples = [
        health("node-1", T0 + 30), health("node-0", T0 + 10, job=""),
        health("node-0", T0 + 20, "temperature_c", job="other-job", value=88.5,
               severity=HealthSeverity.WARNING),
        health("node-2", T0 + 15), health("node-0", T0 + 100), health("node-0", T0 + 9),
        health("odd'node\\", T0 + 12),
    ]
    store.insert(Batch(batch_id="b1", records=tuple(samples)))
    got = store.health(["node-0", "node-1", "node-0", "odd'node\\"], T0 + 10, T0 + 100)
    assert got == [samples[1], samples[6], samples[2], samples[0]]
    # Before the window, from events_since_us on: the warning and critical samples only, not
    # the plain metrics; in the window every sample.
    metric = health("node-0", T0 + 40, "temperature_c", value=61.0,
                    severity=HealthSeverity.INFO)
    later = health("node-0", T0 + 60, "temperature_c", value=62.0,
                   severity=HealthSeverity.INFO)
    store.insert(Batch(batch_id="b2", records=(metric, later)))
    assert metric in store.health(["node-0"], T0 + 10, T0 + 100)
    events = store.health(["node-0", "node-1", "odd'node\\"], T0 + 50, T0 + 100,
                          events_since_us=T0 + 10)
    assert events == [samples[1], samples[6], samples[2], samples[0], later]
    assert store.health(["node-0"], T0 + 50, T0 + 100) == [later]
    assert store.health([], 0, T0 + 1000) == []
    assert store.health(["node-0"], T0 + 100, T0 + 100) == []
    assert store.health(["nowhere"], 0, T0 + 1000) == []


def test_jobs_and_attempts_include_stack_and_health_samples(store: TraceStore) -> None:
    store.insert(Batch(batch_id="b1", records=(
        stack(0, 1, attempt=4), health("node-0", 1, job="from-health"), health("node-1", 1, job=""),
    )))
    assert store.jobs() == ["from-health", JOB]
    assert store.attempts(JOB) == [4]


# --- bulk columns -------------------------------------------------------------------------------


def test_insert_columns_writes_rows_the_store_reads_back(store: TraceStore) -> None:
    case = random_case(3)
    batch_id = "bulk-" + uuid.uuid4().hex
    assert store.insert_columns(JOB, 2, case.cols, case.node_of_rank, batch_id=batch_id) == len(
        case.cols
    )
    c = case.cols
    wanted = [
        CollectiveEvent(
            job=JOB, attempt=2, node=NodeId(case.node_of_rank[int(c.rank[i])]),
            rank=Rank(int(c.rank[i])), group=GroupId(str(c.group[i])), seq=int(c.seq[i]),
            op=str(c.op[i]), nbytes=int(c.nbytes[i]), dtype=str(c.dtype[i]), peer=int(c.peer[i]),
            state=CollectiveState.COMPLETED if c.completed[i] else CollectiveState.FAILED,
            enqueue_us=int(c.enqueue_us[i]), complete_us=int(c.complete_us[i]),
            shape=str(c.shapes()[i]),
        )
        for i in range(len(c))
    ]
    assert sorted(bulk(store).collectives(JOB, 2), key=repr) == sorted(wanted, key=repr)
    assert store.attempts(JOB) == [2]
    empty = columns([])
    assert store.insert_columns(JOB, 2, empty, {}, batch_id="nothing") == 0


def test_insert_columns_refuses_bad_columns_and_writes_nothing(store: TraceStore) -> None:
    cols = columns([Row(rank=5, group="0", seq=1, op="barrier", nbytes=0, dtype="", peer=-1,
                        completed=True, enqueue_us=T0, complete_us=T0 + 1)])
    with pytest.raises(ValueError, match=r"no node for ranks \[5\]"):
        store.insert_columns(JOB, 0, cols, {4: "n"}, batch_id="b")
    with pytest.raises(ValueError, match="column 'seq' has shape"):
        store.insert_columns(JOB, 0, dataclasses.replace(cols, seq=np.array([1, 2])), {5: "n"},
                             batch_id="b")
    with pytest.raises(ValueError, match="column 'enqueue_us' holds negative values"):
        store.insert_columns(JOB, 0, dataclasses.replace(cols, enqueue_us=np.array([-1])),
                             {5: "n"}, batch_id="b")
    assert store.collective_keys(JOB) == []


# --- window summaries: SQL == numpy ------------------------------------------------------------


def assert_store_matches_numpy(store: TraceStore, job: JobId, case: Case) -> None:
    from tracehound.analysis.sim import reference as summaries

    c = case
    assert_rank_stats(store.rank_stats(job, 0, c.start_us, c.end_us),
                      summaries.rank_stats(c.cols, c.start_us, c.end_us))
    assert_link_stats(store.link_stats(job, 0, c.start_us, c.end_us),
                      summaries.link_stats(c.cols, c.start_us, c.end_us))
    for limit, uneven in ((100, ()), (3, ()), (3, ("all_reduce", "broadcast"))):
        got = store.disagreements(job, 0, c.start_us, c.end_us, limit, uneven_ops=uneven)
        want = summaries.disagreements(c.cols, c.start_us, c.end_us, limit, uneven_ops=uneven)
        assert (tuple(got), got.dropped) == (tuple(want), want.dropped)
    assert_node_windows(
        store.node_windows(job, 0, c.start_us, c.end_us, c.window_us),
        summaries.node_windows(c.cols, c.node_of_rank, c.start_us, c.end_us, c.window_us),
    )
    # the same on node clocks corrected by offsets and drift
    clock = skewed_clock(c)
    assert_rank_stats(store.rank_stats(job, 0, c.start_us, c.end_us, clock=clock),
                      summaries.rank_stats(c.cols, c.start_us, c.end_us, clock=clock,
                                           node_of_rank=c.node_of_rank))
    assert_link_stats(store.link_stats(job, 0, c.start_us, c.end_us, clock=clock),
                      summaries.link_stats(c.cols, c.start_us, c.end_us, clock=clock,
                                           node_of_rank=c.node_of_rank))
    if c.window_us > 0:
        assert_node_windows(
            store.node_windows(job, 0, c.start_us, c.end_us, c.window_us, clock=clock),
            summaries.node_windows(c.cols, c.node_of_rank, c.start_us, c.end_us, c.window_us,
                                   clock=clock),
        )
        assert_clock_samples(
            store.clock_samples(job, 0, c.start_us, c.end_us, c.window_us),
            summaries.clock_samples(c.cols, c.node_of_rank, c.start_us, c.end_us, c.window_us),
        )


def as_batch(job: JobId, case: Case, batch_id: str) -> Batch:
    c: CollectiveColumns = case.cols
    return Batch(batch_id=batch_id, records=tuple(
        CollectiveEvent(
            job=job, attempt=0, node=NodeId(case.node_of_rank[int(c.rank[i])]),
            rank=Rank(int(c.rank[i])), group=GroupId(str(c.group[i])), seq=int(c.seq[i]),
            op=str(c.op[i]), nbytes=int(c.nbytes[i]), dtype=str(c.dtype[i]), peer=int(c.peer[i]),
            state=CollectiveState.COMPLETED if c.completed[i] else CollectiveState.FAILED,
            enqueue_us=int(c.enqueue_us[i]), complete_us=int(c.complete_us[i]),
            shape=str(c.shapes()[i]),
        )
        for i in range(len(c))
    ))


ON_EACH_ENGINE = pytest.mark.parametrize("store_url", STORE_ADAPTERS, indirect=True)
"""The summaries' SQL on the server, its cluster mode and the embedded engine; not again through
a shared store's client, whose holder runs the same SQL on the same engine as `embedded`."""


@ON_EACH_ENGINE
@pytest.mark.parametrize("seed", range(4))
def test_summaries_in_sql_equal_the_numpy_reference(store: TraceStore, seed: int) -> None:
    case = random_case(seed)
    store.insert_columns(JOB, 0, case.cols, case.node_of_rank, batch_id=f"b{seed}")
    # Noise the queries must not read: another attempt, another job.
    store.insert_columns(JOB, 1, case.cols, case.node_of_rank, batch_id="noise-1")
    store.insert_columns(JobId("job-other"), 0, case.cols, case.node_of_rank, batch_id="noise-2")
    assert_store_matches_numpy(store, JOB, case)
    assert store.rank_stats(JOB, 0, case.start_us, case.end_us).n.sum() > 0
    with pytest.raises(ValueError, match="at most 100000 are allowed"):
        store.node_windows(JOB, 0, 0, 2**62, 1_000)
    # Whole, shifted and empty windows too.
    for start, end, width in ((0, 2**62, 2**59), (case.start_us + 777, case.end_us + 5_000, 999),
                              (case.end_us, case.start_us, 10), (-100, T0, T0 // 3)):
        assert_store_matches_numpy(store, JOB, dataclasses.replace(
            case, start_us=start, end_us=end, window_us=width))


def test_summaries_read_rows_from_the_batch_path_too(store: TraceStore) -> None:
    case = random_case(11)
    batch = as_batch(JOB, case, "b-records")
    store.insert(batch, maybe_duplicate=True)
    store.insert(batch, maybe_duplicate=True)  # a retry stores nothing twice
    assert_store_matches_numpy(store, JOB, case)


@ON_EACH_ENGINE
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=small_cases())
def test_summaries_in_sql_equal_the_numpy_reference_on_small_windows(
    store: TraceStore, case: Case
) -> None:
    # One store for all examples: each example gets its own job.
    job = JobId(f"job-{uuid.uuid4().hex}")
    store.insert_columns(job, 0, case.cols, case.node_of_rank, batch_id=job)
    assert_store_matches_numpy(store, job, case)


def test_disagreements_in_sql_carry_the_sibling_reference(store: TraceStore) -> None:
    case = Case(cols=columns(SIBLING_EXAMPLE), node_of_rank={r: "n" for r in range(15)},
                start_us=T0, end_us=T0 + 100, window_us=10)
    store.insert_columns(JOB, 0, case.cols, case.node_of_rank, batch_id="b-siblings")
    got = store.disagreements(JOB, 0, T0, T0 + 100)
    assert [(d.group, d.seq, d.peer_op, d.peer_nbytes, d.peer_dtype, d.peer_groups)
            for d in got] == [
        ("dp-0", 7, "all_reduce", 8, "bf16", 2), ("dp-0", 9, "all_reduce", 8, "f32", 1),
        ("dp-0", 10, "", 0, "", 0), ("dp-4", 7, "all_reduce", 8, "bf16", 2),
    ]
    assert_store_matches_numpy(store, JOB, case)
    # The limit counts disagreements; each keeps its reference.
    assert store.disagreements(JOB, 0, T0, T0 + 100, limit=2) == got[:2]


@ON_EACH_ENGINE
def test_clock_corrected_summaries_of_a_job_on_1600_nodes(store: TraceStore) -> None:
    """One rank per node, every node's clock corrected: the summary queries name 1,600
    offsets and drifts (about 400 KB of SQL), past the engines' default query size and AST
    limits (`sql.QUERY_LIMITS` raises them on both adapters)."""
    from tracehound.analysis.sim import reference as summaries

    case = random_case(5, ranks=1_600)
    case = dataclasses.replace(case, node_of_rank={r: f"node-{r}" for r in case.node_of_rank})
    store.insert_columns(JOB, 0, case.cols, case.node_of_rank, batch_id="many-nodes")
    clock = skewed_clock(case)
    assert len(clock.nodes) >= 1_600
    assert_rank_stats(
        store.rank_stats(JOB, 0, case.start_us, case.end_us, clock=clock),
        summaries.rank_stats(case.cols, case.start_us, case.end_us, clock=clock,
                             node_of_rank=case.node_of_rank))
    assert_link_stats(
        store.link_stats(JOB, 0, case.start_us, case.end_us, clock=clock),
        summaries.link_stats(case.cols, case.start_us, case.end_us, clock=clock,
                             node_of_rank=case.node_of_rank))
