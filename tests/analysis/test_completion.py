"""Completion semantics: a member whose work at sequence n has not completed, while its peers
completed n, is stuck at n. It issued that call (its peers could not have completed a
collective it never joined); on a GPU its kernel or device never finished it, and the later
calls its peers wait in are not issued yet. That is a hang, or hardware when the node's health
says so, and never a mismatch ("issued fewer collectives"), which would stop the job as a
program bug. The same from live heartbeats and from NCCL-style Flight Recorder dumps.

The shape is that of a real 16-rank MoE job whose GPUs failed in an all_to_all (NCCL 2.27
dumps): on the failed rank `pg_status` said enqueued 20,536 against completed 20,529, and its
peers had completed through 20,536 and waited in the next calls.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fr_builders import nccl_dump as fr_dump
from fr_builders import nccl_entry
from observation_builders import T0, S, beat, health, observe, progress, snapshot

from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.mismatch import detect_mismatch
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Fact
from tracehound.tracing import flightrecorder as fr
from tracehound.tracing.events import (
    GroupProgress,
    HealthSeverity,
    Heartbeat,
    IncidentKind,
    ProcessGroupInfo,
)
from tracehound.tracing.ids import JobId

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S
SINCE = NOW - 8 * S
GROUP = "ep-3"


def waiting(seq: int) -> GroupProgress:
    """A peer that completed `seq - 1` and waits in all_to_all `seq`."""
    return msgspec.structs.replace(
        progress(GROUP, seq, seq - 1, enq_us=SINCE, op="all_to_all"),
        pending_nbytes=4096, pending_dtype="bfloat16")


def stuck(enqueued: int, completed: int) -> GroupProgress:
    """A member that entered calls through `enqueued` and completed only through `completed`."""
    return msgspec.structs.replace(
        progress(GROUP, enqueued, completed, enq_us=SINCE, op="all_to_all"),
        pending_nbytes=4096, pending_dtype="bfloat16", oldest_seq=completed + 1,
        oldest_op="all_to_all", oldest_nbytes=4096, oldest_dtype="bfloat16")


def gpu_failure(culprits: dict[int, tuple[int, int]], ranks: int = 8) -> JobSnapshot:
    beats = [beat(r, NOW - S // 5, stuck(*culprits[r]) if r in culprits else waiting(20537))
             for r in range(ranks)]
    return snapshot(NOW, ranks, beats, {GROUP: list(range(ranks))})


def test_incomplete_work_its_peers_completed_is_a_hang_on_that_rank_not_a_mismatch() -> None:
    snap = gpu_failure({2: (20536, 20529)})
    assert detect_mismatch(observe(snap), SETTINGS) is None
    verdict = diagnose_observation(observe(snap), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG, verdict.summary
    assert verdict.culprit_ranks == (2,)
    (lagging,) = [e for e in verdict.evidence if e.fact is Fact.LAGGING]
    assert lagging.rank == 2 and lagging.seq == 20537
    assert ("its work from #20530 on (entered through #20536) never completed while its peers "
            "completed through #20536: it is stuck at #20530") in lagging.detail


def test_two_ranks_stuck_at_different_points_are_both_named_in_a_hang() -> None:
    snap = gpu_failure({1: (20536, 20524), 6: (20536, 20533)})
    verdict = diagnose_observation(observe(snap), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG, verdict.summary
    assert set(verdict.culprit_ranks) == {1, 6}


def test_with_an_xid_on_its_gpu_the_stuck_rank_is_hardware() -> None:
    xid = health("node-0", "xid", SINCE + S // 5, value=79.0, device="gpu2",
                 severity=HealthSeverity.CRITICAL, detail="Xid 79: GPU has fallen off the bus")
    verdict = diagnose_observation(observe(gpu_failure({2: (20536, 20529)}), health=(xid,)),
                                   SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HARDWARE, verdict.summary
    assert verdict.culprit_ranks == (2,)


def test_a_rank_that_issued_an_extra_call_is_still_a_mismatch() -> None:
    """The other side: a member pending one call ahead, in a call its peers never completed
    (they wait in the one before), issued a call too many."""
    beats = [beat(r, NOW - S // 5, waiting(10)) for r in range(4) if r != 2]
    beats.append(beat(2, NOW - S // 5, waiting(11)))
    verdict = diagnose_observation(observe(snapshot(NOW, 4, beats, {GROUP: [0, 1, 2, 3]})),
                                   SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.MISMATCH
    assert verdict.culprit_ranks == (2,)


# -- from NCCL-style Flight Recorder dumps ------------------------------------------------------

DUMPED_AT_US = 2_000_000_000
T_NS = DUMPED_AT_US * 1000 - 20_000_000_000  # 20 s before the dump


def entry(seq: int, state: str) -> dict[str, Any]:
    return nccl_entry(seq, "all_to_all", created_ns=T_NS + seq * 1_000_000, ins=[[1024]],
                      in_dtype="BFloat16", state=state)


def nccl_dump(rank: int, completed: int, enqueued: int) -> fr.FrDump:
    entries = [entry(s, "completed" if s <= completed else "started")
               for s in range(1, enqueued + 1)]
    return fr_dump(rank, entries, world=4, enqueued=enqueued, completed=completed,
                   dumped_at_us=DUMPED_AT_US)


def test_from_dumps_the_rank_whose_gpu_never_completed_is_a_hang_not_a_mismatch() -> None:
    # rank 3 entered #3..#7, its GPU completed none of them; ranks 0-2 completed #7 and wait in #8
    dumps = [nccl_dump(r, 7, 8) for r in (0, 1, 2)] + [nccl_dump(3, 2, 7)]
    conv = fr.to_records(dumps, job=JobId("moe"), attempt=0)
    beats = tuple(r for r in conv.records if isinstance(r, Heartbeat))
    (g3,) = next(hb for hb in beats if hb.rank == 3).groups
    assert (g3.last_enqueued, g3.last_completed, g3.oldest_seq) == (7, 2, 3)
    snap = JobSnapshot(
        job=JobId("moe"), attempt=0, now_us=DUMPED_AT_US, heartbeats=beats,
        groups=tuple(r for r in conv.records if isinstance(r, ProcessGroupInfo)),
        expected_ranks={r: "unknown" for r in range(4)},
    )
    assert detect_mismatch(observe(snap), SETTINGS) is None
    verdict = diagnose_observation(observe(snap), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG, verdict.summary
    assert verdict.culprit_ranks == (3,)
    assert any("it is stuck at #3" in e.detail for e in verdict.evidence), verdict.evidence
