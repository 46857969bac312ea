"""The entry point: which verdict wins, healthy observations, and the indexed hang search."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
from observation_builders import (
    T0,
    S,
    arrivals,
    beat,
    groups,
    health,
    links,
    observe,
    progress,
    snapshot,
)

from tracehound.analysis.detect import detect_crash, detect_hang
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import HealthSeverity, IncidentKind, RankExit
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.summaries import Disagreement

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S


def test_a_healthy_observation_with_every_part_has_no_verdict() -> None:
    a = arrivals(seed=7, jitter=0.03, spikes=3)
    beats = [beat(r, a.end_us - S // 10, progress(f"tp-{r // 8}", 66, 65, enq_us=a.end_us))
             for r in range(64)]
    rows = [(r, r + 32, 800.0 + 5 * (r % 7)) for r in range(32)]
    obs = observe(snapshot(a.end_us, 64, beats, groups(8, 64)), start_us=a.start_us,
                  ranks=a.ranks, links=links(rows), node_windows=a.node_windows,
                  health=(health("node-3", "ecc_correctable", a.end_us - S,
                                 severity=HealthSeverity.WARNING),))
    assert diagnose_observation(obs, SETTINGS) is None
    assert diagnose_observation(observe(snapshot(NOW, 8))) is None  # nothing at all


def test_a_crash_beats_the_mismatch_and_the_hang_it_causes() -> None:
    kill = NOW - 7 * S
    beats = [beat(r, NOW - S // 5, progress("tp-0", 30, 29, enq_us=kill)) for r in range(3)]
    exit_ = RankExit(job=JobId("j"), attempt=0, node=NodeId("node-0"), rank=Rank(3), pid=1,
                     exit_code=1, time_us=kill)
    d = Disagreement(group="tp-0", seq=29, ranks=(0, 1, 2), ops=("all_reduce",) * 3,
                     nbytes=(8, 8, 4), dtypes=("float32",) * 3)
    obs = observe(replace(snapshot(NOW, 4, beats), exits=(exit_,)), disagreements=(d,))
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.CRASH
    no_crash = diagnose_observation(replace(obs, snapshot=snapshot(NOW, 3, beats)), SETTINGS)
    assert no_crash is not None and no_crash.kind is IncidentKind.MISMATCH
    assert no_crash.culprit_ranks == (2,)


def test_a_hang_beats_a_straggler() -> None:
    a = arrivals(slow={17: 1.5}, seed=0)
    stop = a.end_us - 8 * S
    beats = [beat(r, a.end_us - S // 5, progress("tp-1", 9, 8, enq_us=stop))
             for r in range(8, 16) if r != 12]
    # Rank 12 stopped reporting before it entered #9: frozen.
    beats.append(beat(12, a.end_us - 4 * S, progress("tp-1", 8, 8, enq_us=stop - S)))
    obs = observe(snapshot(a.end_us, 16, beats), start_us=a.start_us, ranks=a.ranks)
    verdict = diagnose_observation(obs, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (12,)
    assert verdict.group == "tp-1"
    alone = diagnose_observation(replace(obs, snapshot=snapshot(a.end_us, 64)), SETTINGS)
    assert alone is not None and alone.kind is IncidentKind.STRAGGLER


def test_a_crash_says_where_the_rank_was_in_its_collectives() -> None:
    kill = NOW - S
    beats = [beat(3, kill - S // 4, progress("tp-0", 812, 811, enq_us=kill - S // 2),
                  progress("dp-3", 40, 40, enq_us=kill - 3 * S))]
    exit_ = RankExit(job=JobId("j"), attempt=0, node=NodeId("node-0"), rank=Rank(3), pid=1,
                     exit_code=-9, time_us=kill)
    verdict = detect_crash(replace(snapshot(NOW, 4, beats), exits=(exit_,)), SETTINGS)
    assert verdict is not None
    assert verdict.summary == (
        "rank 3 on node node-0 killed by signal 9 first inside collective #812 of group tp-0")
    last = verdict.evidence[-1]
    assert (last.fact, last.group, last.seq) == (Fact.WAITING, "tp-0", 812)
    assert last.detail == ("rank 3 on node node-0 was inside all_reduce #812 of group tp-0 "
                           "when it last reported, 0.2 s before it exited")


# -- the indexed waits-for search gives the verdict the edge-by-edge search gave --------------


def _reference_roots(snap: JobSnapshot, settings: DetectionSettings) -> set[int]:
    """The original edge-by-edge construction (O(ranks x group size x groups))."""
    beats = {int(hb.rank): hb for hb in snap.heartbeats}
    hang_us = int(settings.hang.after_s * S)
    silent_after = snap.now_us - int(settings.hang.heartbeat_timeout_s * S)
    members: dict[str, set[int]] = defaultdict(set)
    for info in snap.groups:
        members[info.group].update(info.ranks)
    for hb in beats.values():
        for g in hb.groups:
            members[g.group].add(hb.rank)

    def reached(rank: int, group: str) -> int:
        hb = beats.get(rank)
        return next((g.last_enqueued for g in hb.groups if g.group == group), 0) if hb else 0

    edges: dict[int, set[int]] = defaultdict(set)
    start = set()
    for rank, hb in beats.items():
        for g in hb.groups:
            if not g.pending_op:
                continue
            if hb.time_us >= silent_after and hb.time_us - g.last_enqueue_us >= hang_us:
                start.add(rank)
            for m in members[g.group]:
                if reached(m, g.group) < g.last_enqueued:
                    edges[rank].add(m)
    seen: set[int] = set()
    frontier = [t for s in start for t in edges.get(s, ())]
    while frontier:
        r = frontier.pop()
        if r not in seen:
            seen.add(r)
            frontier.extend(edges.get(r, ()))
    return {r for r in seen if not edges.get(r)} or seen


@pytest.mark.parametrize("seed", range(20))
def test_indexed_hang_search_matches_the_edge_by_edge_one(seed: int) -> None:
    # 128 ranks in TP groups of 8 and DP groups of 16; a few ranks stuck at random places.
    rng = np.random.default_rng(seed)
    members = groups(8, 128)
    stop = NOW - 8 * S
    stuck = set(rng.choice(128, size=int(rng.integers(1, 4)), replace=False).tolist())
    beats = []
    for r in range(128):
        tp, dp = f"tp-{r // 8}", f"dp-{r % 8}"
        if r in stuck:  # stuck in compute before tp #50
            gs = (progress(tp, 49, 49, enq_us=stop), progress(dp, 19, 19, enq_us=stop))
        elif any(s // 8 == r // 8 for s in stuck):  # waits in tp #50 on a stuck peer
            gs = (progress(tp, 50, 49, enq_us=stop), progress(dp, 19, 19, enq_us=stop))
        else:  # finished tp #50, waits in dp #20
            gs = (progress(tp, 50, 50, enq_us=stop), progress(dp, 20, 19, enq_us=stop))
        beats.append(beat(r, NOW - S // 5, *gs))
    snap = snapshot(NOW, 128, beats, members)
    verdict = detect_hang(snap, SETTINGS)
    assert verdict is not None
    assert set(verdict.culprit_ranks) == _reference_roots(snap, SETTINGS) == stuck
    assert verdict.basis is Basis.CONTROL_DEPENDENCY
