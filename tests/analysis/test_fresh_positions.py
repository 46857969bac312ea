"""Where a lagging rank got to, from the freshest source.

A rank beats its heart about once a second and ships its collective records as it completes
them. In a burst (FSDP2 runs dozens of collectives a second) a rank stopped mid-burst leaves a
last heartbeat tens of collectives behind the records it shipped. The shape here is the one a
real FSDP2 job showed: rank 2 of 4 stopped by SIGSTOP; its last heartbeat says it entered #655
of group 0; its records run through #704; its peers wait in #705. The fact must say #704 and
where that came from, never "last entered #655".
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from observation_builders import T0, S, beat, observe, proc, progress, snapshot

from tracehound.analysis.detect import detect_hang
from tracehound.analysis.diagnose import diagnose_with_records
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import (
    JobSnapshot,
    snapshot_from_json,
    snapshot_to_json,
    with_recorded,
)
from tracehound.analysis.verdict import Fact
from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    Heartbeat,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore

SETTINGS = DetectionSettings()
NOW = T0 + 60 * S
STOPPED_AT = NOW - 30 * S


def stale_snapshot() -> JobSnapshot:
    """Ranks 0, 1 and 3 wait in #705 of group 0 for 30 s; rank 2's process is stopped and its
    last heartbeat, from before its last burst, says #655."""
    waiting = [
        beat(r, NOW - S // 2, progress("0", 705, 704, enq_us=STOPPED_AT, op="all_gather"))
        for r in (0, 1, 3)
    ]
    stale = beat(2, STOPPED_AT - S, progress("0", 655, 655, enq_us=STOPPED_AT - S))
    snap = snapshot(NOW, 4, [*waiting, stale], {"0": [0, 1, 2, 3]})
    return replace(snap, processes=(proc(2, "T", NOW - S),))


def lag_fact(snap: JobSnapshot) -> tuple[int, str, float]:
    verdict = detect_hang(snap, SETTINGS)
    assert verdict is not None and verdict.culprit_ranks == (2,), verdict
    fact = next(e for e in verdict.evidence if e.fact is Fact.LAGGING and e.rank == 2)
    return fact.seq, fact.detail, fact.value


def test_a_heartbeat_from_before_a_burst_alone_says_the_rank_is_fifty_behind() -> None:
    seq, detail, value = lag_fact(stale_snapshot())
    assert (seq, value) == (705, 50.0)
    assert "last entered #655" in detail


def test_stored_records_ahead_of_the_heartbeat_are_the_position_and_the_words_say_so() -> None:
    snap = replace(stale_snapshot(), recorded={(2, "0"): 704})
    seq, detail, value = lag_fact(snap)
    assert (seq, value) == (705, 1.0)
    assert "was not seen entering collective #705 of group 0" in detail
    assert "completed #704 by its stored records" in detail
    assert "its last heartbeat, 49 collective(s) older, said #655" in detail
    assert "#655 on" not in detail and "last entered #655" not in detail


def test_records_behind_the_heartbeat_change_nothing() -> None:
    plain = lag_fact(stale_snapshot())
    assert lag_fact(replace(stale_snapshot(), recorded={(2, "0"): 600})) == plain


def test_the_recorded_positions_survive_the_snapshots_json() -> None:
    snap = replace(stale_snapshot(), recorded={(2, "0"): 704, (1, "7"): 3})
    assert snapshot_from_json(snapshot_to_json(snap)).recorded == snap.recorded


def _records(ranks: range, seqs: range, *, group: str = "0") -> Batch:
    return Batch(batch_id=f"b-{ranks}-{seqs}-{group}", records=tuple(
        CollectiveEvent(
            job=JobId("j"), attempt=0, node=NodeId("node-0"), rank=Rank(r), group=GroupId(group),
            seq=s, op="all_gather", nbytes=4096, dtype="float32", peer=-1,
            state=CollectiveState.COMPLETED,
            enqueue_us=STOPPED_AT - (800 - s) * 1_000, complete_us=STOPPED_AT - (800 - s) * 900,
        )
        for r in ranks for s in seqs
    ))


def test_diagnosing_from_a_store_reads_the_laggards_records(store: TraceStore) -> None:
    store.insert(_records(range(4), range(600, 705)))
    verdict, obs = diagnose_with_records(store, observe(stale_snapshot()), SETTINGS)
    assert verdict is not None and verdict.culprit_ranks == (2,)
    assert obs.snapshot.recorded == {(2, "0"): 704}
    fact = next(e for e in verdict.evidence if e.fact is Fact.LAGGING and e.rank == 2)
    assert (fact.seq, fact.value) == (705, 1.0)
    assert "completed #704 by its stored records" in fact.detail


def test_records_enqueued_after_the_snapshot_do_not_count(store: TraceStore) -> None:
    store.insert(_records(range(2, 3), range(600, 705)))
    snap = replace(stale_snapshot(), now_us=STOPPED_AT - 150_000)  # before #650's enqueue
    read = with_recorded(store, snap, {"0": (656, [2])})
    assert read is snap  # nothing from #656 on was enqueued by then
    later = with_recorded(store, stale_snapshot(), {"0": (656, [2])})
    assert later.recorded == {(2, "0"): 704}


def test_the_evidence_check_finds_a_fact_its_records_disprove_and_passes_the_fresh_one(
    store: TraceStore,
) -> None:
    from evidence_check import check_incidents, contradictions

    store.insert(_records(range(4), range(600, 705)))
    store.insert(Batch(batch_id="beats", records=stale_snapshot().heartbeats))
    records = store.collectives(JobId("j"), 0)
    beats = store.records(Heartbeat, JobId("j"))
    stale = detect_hang(stale_snapshot(), SETTINGS)
    assert stale is not None
    found, checked = contradictions(records, beats, {"attempt": 0, "verdict": stale.to_dict()})
    assert checked >= 4  # rank 2's lag and the three waiting ranks
    assert len(found) == 1 and "rank 2" in found[0] and "completed #704" in found[0], found
    fresh, _ = diagnose_with_records(store, observe(stale_snapshot()), SETTINGS)
    assert fresh is not None
    assert contradictions(records, beats, {"attempt": 0, "verdict": fresh.to_dict()}) == (
        [], checked)
    incident = {"incident_id": "i-1", "attempt": 0, "verdict": stale.to_dict()}
    with pytest.raises(AssertionError, match="its records completed #704"):
        check_incidents(store, "j", [incident])


def test_what_a_fact_says_was_issued_may_be_in_a_row_that_landed_just_before_the_verdict(
    store: TraceStore,
) -> None:
    """The check of a live job holds a fact to the rows the store surely held a second before
    the verdict (not behind them), and what a fact says a rank issued to the rows it might have
    read (stamped up to a second after): arrivals are stamped to the second."""
    from evidence_check import contradictions

    store.insert(_records(range(4), range(600, 705)))
    store.insert(Batch(batch_id="beats", records=stale_snapshot().heartbeats))
    records = store.collectives(JobId("j"), 0)
    beats = store.records(Heartbeat, JobId("j"))
    fresh, _ = diagnose_with_records(store, observe(stale_snapshot()), SETTINGS)
    assert fresh is not None
    incident = {"attempt": 0, "verdict": fresh.to_dict()}
    # the waiters' heartbeats, which show them in #705, landed in the verdict's last second
    found, _ = contradictions(records, [], incident)
    assert found and all("says it issued #705" in f for f in found), found
    assert contradictions(records, [], incident, readable=(records, beats))[0] == []
