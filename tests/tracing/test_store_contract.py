"""The TraceStore contract, run against every adapter: a real ClickHouse server (also in cluster
mode), chdb, and the client of a chdb store another process holds and shares."""

from __future__ import annotations

import time

import msgspec
import pytest

from tracehound.tracing.events import (
    Action,
    ActionKind,
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    Heartbeat,
    Incident,
    IncidentKind,
    ProcessGroupInfo,
    RankExit,
    Record,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import CollectiveKey, InsertReport, TraceStore, bulk, open_store
from tracehound.tracing.store.engine import SqlTraceStore

JOB = JobId("job-a")
BIG = 2**64 - 1


def collective(
    rank: int, seq: int, *, job: str = JOB, attempt: int = 0, group: str = "0",
    op: str = "all_reduce",
) -> CollectiveEvent:
    return CollectiveEvent(
        job=JobId(job), attempt=attempt, node=NodeId(f"node-{rank // 2}"), rank=Rank(rank),
        group=GroupId(group), seq=seq, op=op, nbytes=4096 * seq, dtype="float32", peer=-1,
        state=CollectiveState.COMPLETED, enqueue_us=1_700_000_000_000_000 + seq * 1000 + rank,
        complete_us=1_700_000_000_000_500 + seq * 1000 + rank,
    )


def heartbeat(
    rank: int, time_us: int, *, job: str = JOB, attempt: int = 0, step: int = 1
) -> Heartbeat:
    return Heartbeat(
        job=JobId(job), attempt=attempt, node=NodeId("node-0"), rank=Rank(rank), time_us=time_us,
        pid=1000 + rank, step=step, step_us=time_us - 10, start_step=0, first_step_us=time_us - 99,
        dropped=0,
        groups=(
            GroupProgress(group=GroupId("0"), last_enqueued=step * 2, last_completed=step * 2 - 1,
                          pending_op="all_reduce", last_enqueue_us=time_us - 5,
                          last_complete_us=time_us - 7),
            GroupProgress(group=GroupId("1"), last_enqueued=3, last_completed=3, pending_op="",
                          last_enqueue_us=time_us - 50, last_complete_us=time_us - 40),
        ),
    )


def every_kind_batch(batch_id: str = "b-every") -> Batch:
    records: list[Record] = [
        collective(0, 1),
        collective(1, 1),
        msgspec.structs.replace(collective(1, 2), state=CollectiveState.FAILED, complete_us=0),
        CollectiveEvent(
            job=JOB, attempt=0, node=NodeId("node-0"), rank=Rank(0), group=GroupId("7"), seq=1,
            op="send", nbytes=BIG, dtype="", peer=1, state=CollectiveState.COMPLETED,
            enqueue_us=BIG, complete_us=BIG,
        ),
        heartbeat(0, 1_700_000_001_000_000),
        Heartbeat(
            job=JOB, attempt=0, node=NodeId("node-1"), rank=Rank(1), time_us=1_700_000_001_000_001,
            pid=2**31 - 1, step=BIG, step_us=0, start_step=0, first_step_us=0, dropped=BIG,
        ),
        ProcessGroupInfo(job=JOB, attempt=0, rank=Rank(0), group=GroupId("0"), ranks=(0, 1),
                         backend="gloo", time_us=1_700_000_000_000_000),
        ProcessGroupInfo(job=JOB, attempt=0, rank=Rank(0), group=GroupId("7"), ranks=(),
                         backend="", time_us=1_700_000_000_000_100),
        RankExit(job=JOB, attempt=0, node=NodeId("node-1"), rank=Rank(1), pid=4242, exit_code=-9,
                 time_us=1_700_000_002_000_000),
        RankExit(job=JOB, attempt=0, node=NodeId("node-0"), rank=Rank(0), pid=4241, exit_code=1,
                 time_us=1_700_000_003_000_000),
    ]
    return Batch(batch_id=batch_id, records=tuple(records))


def keys(store: TraceStore, job: str = JOB) -> list[tuple[int, int, str, int]]:
    return sorted((k.attempt, k.rank, k.group, k.seq) for k in store.collective_keys(JobId(job)))


def test_schema_creation_is_idempotent(store: TraceStore) -> None:
    store.ensure_schema()
    store.ensure_schema()
    assert store.jobs() == []
    store.insert(Batch(batch_id="b1", records=(collective(0, 1),)))
    store.ensure_schema()
    assert store.jobs() == [JOB]


def test_a_store_made_before_new_fields_gets_their_columns(store: TraceStore) -> None:
    """A store created by an older version lacks the columns of fields declared since (here
    the pending size and dtype of heartbeats): ensure_schema adds them, and what was stored
    before reads back with the fields' defaults."""
    if not isinstance(store, SqlTraceStore):
        pytest.skip("the old schema is made by dropping columns through the adapter's own SQL; "
                    "a client of a shared store has none (its holder is the embedded adapter, "
                    "tested here)")
    old = heartbeat(rank=0, step=3, time_us=1_700_000_000_500_000)
    store.insert(Batch(batch_id="before", records=(old,)))
    for column in ("group_pending_nbytes", "group_pending_dtype", "group_oldest_seq",
                   "group_oldest_op", "group_oldest_nbytes", "group_oldest_dtype", "stored_us"):
        store._query(f"ALTER TABLE {store.database}.heartbeats DROP COLUMN {column}", {})
    store.ensure_schema()
    store.ensure_schema()  # nothing left to add
    (back,) = store.latest_heartbeats(JOB, 0)
    assert back.groups[0].pending_nbytes == 0 and back.groups[0].pending_dtype == ""
    assert (back.groups[0].oldest_seq, back.groups[0].oldest_op) == (0, "")
    newer = msgspec.structs.replace(old, time_us=old.time_us + 1, groups=(
        msgspec.structs.replace(old.groups[0], pending_nbytes=4096, pending_dtype="bfloat16",
                                oldest_seq=3, oldest_op="broadcast", oldest_nbytes=64,
                                oldest_dtype="int64"),))
    store.insert(Batch(batch_id="after", records=(newer,)))
    (back,) = store.latest_heartbeats(JOB, 0)
    assert back.groups[0].pending_nbytes == 4096 and back.groups[0].pending_dtype == "bfloat16"
    assert (back.groups[0].oldest_seq, back.groups[0].oldest_op, back.groups[0].oldest_nbytes,
            back.groups[0].oldest_dtype) == (3, "broadcast", 64, "int64")


def test_reopening_keeps_the_data(store_url: str) -> None:
    first = open_store(store_url)
    try:
        first.insert(Batch(batch_id="b1", records=(collective(0, 1),)))
    finally:
        first.close()
    second = open_store(store_url)
    try:
        assert keys(second) == [(0, 0, "0", 1)]
    finally:
        second.close()


def test_every_record_type_round_trips(store: TraceStore) -> None:
    batch = every_kind_batch()
    report = store.insert(batch)
    assert report == InsertReport(inserted=len(batch.records), skipped=0)

    wanted = [r for r in batch.records if isinstance(r, CollectiveEvent)]
    stored = bulk(store).collectives(JOB, 0)
    assert sorted(stored, key=repr) == sorted(wanted, key=repr)

    heartbeats = [r for r in batch.records if isinstance(r, Heartbeat)]
    assert store.latest_heartbeats(JOB, 0) == heartbeats
    exits = [r for r in batch.records if isinstance(r, RankExit)]
    assert store.exits(JOB, 0) == exits
    groups = [r for r in batch.records if isinstance(r, ProcessGroupInfo)]
    assert store.groups(JOB, 0) == groups


def test_values_are_bound_not_spliced(store: TraceStore) -> None:
    """Names with quotes, backslashes, control characters and % survive and select exactly."""
    odd = ["it's", 'say "hi"', "back\\slash", "\\n literal", "tab\there", "new\nline", "%s %(job)s",
           "'); DROP TABLE collectives; --", "ünïcødé ✓", "\\", "\\N", "{job:String}"]
    batch = Batch(
        batch_id="b-odd\\'\n",
        records=tuple(heartbeat(0, 1000 + i, job=name) for i, name in enumerate(odd)),
    )
    store.insert(batch)
    assert store.insert(batch, maybe_duplicate=True) == InsertReport(inserted=0, skipped=len(odd))
    for i, name in enumerate(odd):
        [latest] = store.latest_heartbeats(JobId(name), 0)
        assert latest.job == name
        assert latest.time_us == 1000 + i
    assert store.jobs() == sorted(odd)


def test_latest_heartbeats_picks_the_newest_per_rank(store: TraceStore) -> None:
    t0 = 1_700_000_000_000_000
    store.insert(Batch(batch_id="b1", records=(
        heartbeat(2, t0 + 5, step=5), heartbeat(0, t0 + 1, step=1), heartbeat(1, t0 + 9, step=9),
    )))
    store.insert(Batch(batch_id="b2", records=(
        heartbeat(0, t0 + 7, step=7), heartbeat(2, t0 + 3, step=3), heartbeat(1, t0 + 8, step=8),
        heartbeat(0, t0 + 100, attempt=1), heartbeat(3, t0 + 100, job="other"),
    )))
    latest = store.latest_heartbeats(JOB, 0)
    assert [(h.rank, h.time_us, h.step) for h in latest] == [
        (0, t0 + 7, 7), (1, t0 + 9, 9), (2, t0 + 5, 5)
    ]
    assert latest[0] == heartbeat(0, t0 + 7, step=7)
    assert [h.rank for h in store.latest_heartbeats(JOB, 1)] == [0]
    assert store.latest_heartbeats(JOB, 2) == []


def test_recorded_reach_is_the_highest_stored_seq_per_rank_from_a_seq_and_by_a_time(
    store: TraceStore,
) -> None:
    rows = [collective(r, s) for r in (0, 1, 2) for s in range(1, 6 + r)]  # 0: 5, 1: 6, 2: 7
    rows += [collective(3, s, group="9") for s in range(1, 40)]  # another group
    rows += [collective(0, s, attempt=1) for s in range(1, 30)]  # another attempt
    store.insert(Batch(batch_id="b-reach", records=tuple(rows)))
    late = collective(2, 7).enqueue_us  # rank 2's seq 7 enqueued then: not by a time before
    reach = store.recorded_reach(JOB, 0, "0", [0, 1, 2, 3, 1], from_seq=3, until_us=late - 1)
    assert reach == {0: 5, 1: 6, 2: 6}  # rank 3 has nothing in group "0"
    assert store.recorded_reach(JOB, 0, "0", [0, 1, 2], from_seq=7, until_us=late) == {2: 7}
    assert store.recorded_reach(JOB, 0, "0", [0], from_seq=6, until_us=BIG) == {}
    assert store.recorded_reach(JOB, 0, "9", [3], from_seq=1, until_us=BIG) == {3: 39}
    assert store.recorded_reach(JOB, 1, "0", [0], from_seq=1, until_us=BIG) == {0: 29}
    assert store.recorded_reach(JOB, 0, "0", [], from_seq=1, until_us=BIG) == {}


def test_records_as_stored_by_a_time_leave_out_those_that_arrived_later(
        store: TraceStore) -> None:
    """The store stamps each row with when it arrived, to the second of its clock (this
    machine's, for every adapter here): what was stored by a time is what a verdict made then
    could have read, whatever times the records themselves carry."""
    early = Batch(batch_id="early", records=(collective(0, 1), heartbeat(0, 1_700_000_000_000_000)))
    store.insert(early)
    between = time.time_ns() // 1000
    time.sleep(1.05 - (between % 1_000_000) / 1e6)  # into the store clock's next second
    # a record made before the first ones, arriving after `between` (a stopped rank's, shipped
    # when it was continued)
    late = msgspec.structs.replace(collective(0, 2), enqueue_us=1, complete_us=2)
    store.insert(Batch(batch_id="late", records=(late, heartbeat(0, 1_699_999_999_000_000))))
    kept = store.records(CollectiveEvent, JOB, stored_by_us=between)
    assert [(c.rank, c.seq) for c in kept] == [(0, 1)]
    beats = store.records(Heartbeat, JOB, stored_by_us=between)
    assert [hb.time_us for hb in beats] == [1_700_000_000_000_000]
    assert len(store.records(CollectiveEvent, JOB)) == 2
    assert store.records(CollectiveEvent, JOB, stored_by_us=between - 60_000_000) == []


def test_retry_of_a_landed_batch_stores_nothing_twice(store: TraceStore) -> None:
    batch = every_kind_batch()
    first = store.insert(batch, maybe_duplicate=True)
    assert first == InsertReport(inserted=len(batch.records), skipped=0)
    again = store.insert(batch, maybe_duplicate=True)
    assert again == InsertReport(inserted=0, skipped=len(batch.records))
    assert keys(store) == sorted({(0, 0, "0", 1), (0, 1, "0", 1), (0, 1, "0", 2), (0, 0, "7", 1)})
    assert len(store.exits(JOB, 0)) == 2

    fresh = Batch(batch_id="b-new", records=(collective(0, 2), collective(1, 3)))
    assert store.insert(fresh, maybe_duplicate=True) == InsertReport(inserted=2, skipped=0)
    assert len(store.collective_keys(JOB)) == 6


def test_retry_of_a_partly_landed_batch_adds_only_the_missing_rows(store: TraceStore) -> None:
    full = Batch(batch_id="b-part", records=(
        *(collective(r, s) for r in range(4) for s in (1, 2)),
        heartbeat(0, 1000), heartbeat(1, 1000),
        RankExit(job=JOB, attempt=0, node=NodeId("n"), rank=Rank(3), pid=9, exit_code=0,
                 time_us=5),
    ))
    # An earlier try stored the heartbeats table completely, half of the collectives table
    # (as if that insert had been split) and none of the exits.
    landed = Batch(batch_id="b-part", records=tuple(
        r for r in full.records
        if isinstance(r, Heartbeat) or (isinstance(r, CollectiveEvent) and r.rank < 2)
    ))
    store.insert(landed)
    report = store.insert(full, maybe_duplicate=True)
    assert report == InsertReport(inserted=5, skipped=6)
    assert keys(store) == sorted((0, r, "0", s) for r in range(4) for s in (1, 2))
    assert len(store.latest_heartbeats(JOB, 0)) == 2
    assert [e.rank for e in store.exits(JOB, 0)] == [3]
    assert store.insert(full, maybe_duplicate=True) == InsertReport(inserted=0, skipped=11)


def test_without_maybe_duplicate_a_second_insert_is_kept(store: TraceStore) -> None:
    """collective_keys shows every stored row: a blind re-insert is visible, not hidden by
    FINAL or merges."""
    batch = Batch(batch_id="b1", records=(collective(0, 1),))
    store.insert(batch)
    store.insert(batch)
    assert keys(store) == [(0, 0, "0", 1), (0, 0, "0", 1)]


def test_groups_gives_one_entry_per_group_as_first_reported(store: TraceStore) -> None:
    def info(rank: int, group: str, ranks: tuple[int, ...], t: int) -> ProcessGroupInfo:
        return ProcessGroupInfo(job=JOB, attempt=0, rank=Rank(rank), group=GroupId(group),
                                ranks=ranks, backend="gloo", time_us=t)

    store.insert(Batch(batch_id="b1", records=(
        info(1, "0", (0, 1, 2, 3), 20), info(0, "0", (0, 1, 2, 3), 10),
        info(2, "g2", (2, 3), 30), info(3, "g2", (2, 3), 31),
        info(0, "g1", (0, 1), 15),
    )))
    assert store.groups(JOB, 0) == [
        info(0, "0", (0, 1, 2, 3), 10), info(0, "g1", (0, 1), 15), info(2, "g2", (2, 3), 30),
    ]


def test_exits_are_earliest_first(store: TraceStore) -> None:
    def ex(rank: int, t: int, attempt: int = 0) -> RankExit:
        return RankExit(job=JOB, attempt=attempt, node=NodeId("n"), rank=Rank(rank), pid=rank,
                        exit_code=-15, time_us=t)

    store.insert(Batch(batch_id="b1", records=(ex(2, 30), ex(0, 10), ex(1, 20), ex(0, 5, 1))))
    assert store.exits(JOB, 0) == [ex(0, 10), ex(1, 20), ex(2, 30)]
    assert store.exits(JOB, 1) == [ex(0, 5, 1)]


def incident(job: str, incident_id: str, t: int, **changes: object) -> Incident:
    base = Incident(
        job=JobId(job), incident_id=incident_id, attempt=1, detected_at_us=t,
        kind=IncidentKind.HANG.value, culprit_ranks=(3,), culprit_nodes=("node-1",),
        confidence=0.875, summary="rank 3 stopped at seq 64", verdict_json='{"kind": "hang"}',
    )
    return msgspec.structs.replace(base, **changes)


def action(job: str, incident_id: str, kind: ActionKind, t: int, *, ok: bool = True) -> Action:
    return Action(job=JobId(job), incident_id=incident_id, kind=kind, target="node-1", time_us=t,
                  ok=ok, detail="" if ok else "no such node")


def test_incidents_round_trip_with_their_actions(store: TraceStore) -> None:
    late = incident(JOB, "i-2", 2_000, kind="straggler", culprit_ranks=(), culprit_nodes=(),
                    verdict_json='{"evidence": [1, 2], "text": "quote \' and \\\\"}')
    early = incident(JOB, "i-1", 1_000)
    other = incident("job-b", "i-9", 1_500, confidence=0.0)
    for recorded in (late, early, other):
        store.record_incident(recorded)
    isolate = action(JOB, "i-1", ActionKind.ISOLATE_NODE, 1_100)
    restart = action(JOB, "i-1", ActionKind.RESTART, 1_200, ok=False)
    stop = action("job-b", "i-9", ActionKind.STOP_JOB, 1_600)
    for taken in (restart, stop, isolate):
        store.record_action(taken)

    got = store.incidents(JOB)
    assert got == [
        msgspec.structs.replace(early, actions=(isolate, restart)),
        msgspec.structs.replace(late, actions=()),
    ]
    assert got[1].verdict_json == late.verdict_json
    assert [i.incident_id for i in store.incidents()] == ["i-1", "i-9", "i-2"]
    assert store.incidents()[1].actions == (stop,)
    assert store.incidents(JobId("nobody")) == []


def test_attempts_and_jobs(store: TraceStore) -> None:
    assert store.jobs() == []
    assert store.attempts(JOB) == []
    store.insert(Batch(batch_id="b1", records=(
        collective(0, 1, attempt=2), heartbeat(0, 500, attempt=0),
        ProcessGroupInfo(job=JOB, attempt=5, rank=Rank(0), group=GroupId("0"), ranks=(0,),
                         backend="gloo", time_us=1),
        RankExit(job=JOB, attempt=3, node=NodeId("n"), rank=Rank(0), pid=1, exit_code=0,
                 time_us=1),
        collective(0, 1, job="job-c", attempt=7),
    )))
    store.record_incident(incident("job-b", "i-1", 10))
    assert store.attempts(JOB) == [0, 2, 3, 5]
    assert store.attempts(JobId("job-c")) == [7]
    assert store.jobs() == ["job-a", "job-b", "job-c"]
    assert store.collective_keys(JobId("job-c")) == [CollectiveKey(attempt=7, rank=0, group="0",
                                                                   seq=1)]


@pytest.mark.parametrize("threads", [4])
def test_concurrent_inserts_from_threads(store: TraceStore, threads: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def ship(worker: int) -> InsertReport:
        batch = Batch(batch_id=f"b{worker}",
                      records=tuple(collective(worker, s) for s in range(1, 21)))
        store.insert(batch, maybe_duplicate=True)
        return store.insert(batch, maybe_duplicate=True)

    with ThreadPoolExecutor(threads) as pool:
        reports = list(pool.map(ship, range(threads)))
    assert reports == [InsertReport(inserted=0, skipped=20)] * threads
    assert len(store.collective_keys(JOB)) == 20 * threads
