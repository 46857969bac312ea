"""Frozen, stuck or busy: the ranks peers wait on, told apart on hand-built snapshots.

Each case is shaped like a real one seen on gloo jobs: a rank SIGSTOPped inside a pipeline recv
while its partner blocks in the matching send, a rank writing a checkpoint while the others wait
in the next all-reduce, a rank whose heartbeat thread is starved by a C call holding the
interpreter lock, and a user-code deadlock outside collectives."""

from __future__ import annotations

from dataclasses import replace

import msgspec
from observation_builders import T0, S, beat, proc, progress, snapshot, stack

from tracehound.analysis.detect import detect_hang
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings, HangSettings
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind

SETTINGS = DetectionSettings(
    hang=HangSettings(after_s=5.0, heartbeat_timeout_s=2.5, busy_grace_s=600.0))
NOW = T0 + 100 * S
PAIR = "0:p2p:1-3"


def test_the_frozen_side_of_a_p2p_pair_is_named_first_whatever_its_number() -> None:
    # Rank 3 was SIGSTOPped inside recv #7 of the pair; rank 1 blocks in the matching send #7.
    stop = NOW - 12 * S
    beats = [
        beat(1, NOW - S // 5, progress(PAIR, 7, 6, enq_us=stop, op="send")),
        beat(3, stop + S // 10, progress(PAIR, 7, 6, enq_us=stop, op="recv")),
    ]
    snap = replace(snapshot(NOW, 4, beats), processes=(proc(3, "T", NOW - S // 2),))
    verdict = detect_hang(snap, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (3,)
    assert verdict.culprit_nodes == ("node-0",)
    assert verdict.confidence == 0.95
    assert "stopped (state T)" in verdict.summary
    # Without the process sample, its silent heartbeats alone say the same.
    alone = detect_hang(snapshot(NOW, 4, beats), SETTINGS)
    assert alone is not None and alone.culprit_ranks == (3,)


def test_two_roots_are_ordered_by_evidence_not_by_rank_number() -> None:
    # Group "a" = {0, 1, 3}: 0 waits in #5; rank 1 is stuck in another op for 20 s, rank 3 is
    # stopped. Both lag in "a"; the stopped one comes first though its number is higher.
    beats = [
        beat(0, NOW - S // 5, progress("a", 5, 4, enq_us=NOW - 10 * S)),
        beat(1, NOW - S // 5, progress("a", 4, 4, enq_us=NOW - 30 * S),
             progress("b", 9, 8, enq_us=NOW - 20 * S)),
        beat(3, NOW - 9 * S, progress("a", 4, 4, enq_us=NOW - 30 * S)),
    ]
    snap = replace(snapshot(NOW, 4, beats), processes=(proc(3, "T", NOW - S),))
    verdict = detect_hang(snap, SETTINGS)
    assert verdict is not None
    assert verdict.culprit_ranks == (3, 1)
    facts = [(e.fact, e.rank) for e in verdict.evidence if e.fact in (Fact.FROZEN, Fact.SILENT,
                                                                       Fact.STUCK)]
    assert facts == [(Fact.FROZEN, 3), (Fact.STUCK, 1)]


def test_a_rank_writing_a_checkpoint_is_a_stall_with_where_it_is() -> None:
    # Rank 0 left all_reduce #40 8 s ago and writes a checkpoint; 1-3 wait in #41 for 7.5 s.
    left = NOW - 8 * S
    beats = [beat(0, NOW - S // 5, progress("0", 40, 40, enq_us=left))]
    beats += [beat(r, NOW - S // 5, progress("0", 41, 40, enq_us=NOW - 7_500_000))
              for r in (1, 2, 3)]
    frames = stack(0, "torch/serialization.py:652 save", "zipfile.py:1200 write",
                   at_us=NOW - 5 * S)
    snap = replace(snapshot(NOW, 4, beats),
                   processes=(proc(0, "D", NOW - S // 2, cpu_rate=0.4, io_rate=80e6),),
                   stacks=(frames,))
    verdict = detect_hang(snap, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.STALL
    assert verdict.culprit_ranks == (0,)
    assert verdict.summary == (
        "rank 0 on node node-0 is busy outside collectives, not hung (at train.py:50 step > "
        "torch/serialization.py:652 save > zipfile.py:1200 write): 3 rank(s) have waited up to "
        "7.3 s in all_reduce #41 of group 0; nothing is done unless it lasts 600 s"
    )
    busy = next(e for e in verdict.evidence if e.fact is Fact.BUSY)
    assert busy.value == 8.0
    assert "process state D, CPU 0.40 s/s, I/O 80.0 MB/s" in busy.detail
    assert any(e.fact is Fact.STACK and e.rank == 0 for e in verdict.evidence)
    # A diagnosis keeps the stall as it is.
    obs = Observation(snapshot=snap, window_start_us=NOW - 10 * S, window_end_us=NOW)
    assert diagnose_observation(obs, SETTINGS) == verdict
    # A stack from before the rank left its collectives says nothing of where it is now.
    old = replace(snap, stacks=(msgspec.structs.replace(frames, time_us=left - S),))
    stale = detect_hang(old, SETTINGS)
    assert stale is not None and "(at " not in stale.summary


def test_a_stack_from_before_the_peers_began_to_wait_does_not_place_a_stall() -> None:
    # Rank 2 waited in DDP's construction (no traced collective: no progress), where its stack
    # was taken, then computes a slow first step; 0, 1 and 3 entered all_reduce #1 6 s ago.
    entered = NOW - 6 * S
    beats = [beat(2, NOW - S // 5, progress("0", 0, 0, enq_us=0))]
    beats += [beat(r, NOW - S // 5, progress("0", 1, 0, enq_us=entered)) for r in (0, 1, 3)]
    in_ddp = stack(2, "torch/nn/parallel/distributed.py:1064 __init__",
                   "torch/distributed/utils.py:286 _verify_param_shape_across_processes",
                   at_us=entered - S)
    snap = replace(snapshot(NOW, 4, beats),
                   processes=(proc(2, "R", NOW - S // 2, cpu_rate=0.95),), stacks=(in_ddp,))
    verdict = detect_hang(snap, SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.STALL
    assert verdict.culprit_ranks == (2,)
    assert "(at " not in verdict.summary and "_verify_param_shape" not in str(verdict.evidence)
    assert not any(e.fact is Fact.STACK for e in verdict.evidence)
    # The capture after the wait began places it.
    computing = stack(2, "train.py:60 busy_for", "train.py:40 <lambda>", at_us=entered + 2 * S)
    placed = detect_hang(replace(snap, stacks=(computing,)), SETTINGS)
    assert placed is not None and "train.py:60 busy_for" in placed.summary
    assert any(e.fact is Fact.STACK and e.rank == 2 for e in placed.evidence)


def test_ranks_gone_silent_inside_the_collective_do_not_outrank_the_one_it_waits_for() -> None:
    # Rank 1 left all_reduce #40 8 s ago and computes outside collectives, reporting; 0, 2 and 3
    # entered #41, and the heartbeats of 2 and 3 stopped 4 s ago (a loaded machine: no process
    # sample since). The collective waits on rank 1 first: a stall of rank 1, not a hang of the
    # silent ones (a CI run of a real job under double load blamed them and restarted).
    entered = NOW - 7 * S
    beats = [beat(1, NOW - S // 5, progress("0", 40, 40, enq_us=NOW - 8 * S)),
             beat(0, NOW - S // 5, progress("0", 41, 40, enq_us=entered))]
    beats += [beat(r, NOW - 4 * S, progress("0", 41, 40, enq_us=entered)) for r in (2, 3)]
    snap = replace(snapshot(NOW, 4, beats), processes=(proc(1, "R", NOW - S, cpu_rate=0.9),))
    verdict = detect_hang(snap, SETTINGS)
    assert verdict is not None
    assert (verdict.kind, verdict.culprit_ranks) == (IncidentKind.STALL, (1,))
    # once rank 1 has entered too, nothing but their silence is left: a hang of 2 and 3
    arrived = [beat(1, NOW - S // 5, progress("0", 41, 40, enq_us=NOW - 6 * S)), *beats[1:]]
    hung = detect_hang(snapshot(NOW, 4, arrived), SETTINGS)
    assert hung is not None
    assert (hung.kind, sorted(hung.culprit_ranks)) == (IncidentKind.HANG, [2, 3])
    # a process state that shows one of them stopped makes it a culprit whoever lags
    stopped = detect_hang(replace(snap, processes=(proc(2, "T", NOW - S),)), SETTINGS)
    assert stopped is not None and 2 in stopped.culprit_ranks


def test_a_busy_rank_past_the_grace_is_a_hang_that_does_not_implicate_the_machine() -> None:
    # A user-code deadlock outside collectives: alive, reporting, never back.
    beats = [beat(0, NOW - S // 5, progress("0", 40, 40, enq_us=NOW - 700 * S))]
    beats += [beat(r, NOW - S // 5, progress("0", 41, 40, enq_us=NOW - 650 * S))
              for r in (1, 2, 3)]
    verdict = detect_hang(snapshot(NOW, 4, beats), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.basis is Basis.BUSY_TIMEOUT
    assert verdict.culprit_ranks == (0,)
    assert "past the 600 s grace" in verdict.summary
    longer_grace = replace(SETTINGS, hang=replace(SETTINGS.hang, busy_grace_s=900.0))
    shorter = detect_hang(snapshot(NOW, 4, beats), longer_grace)
    assert shorter is not None and shorter.kind is IncidentKind.STALL


def test_paused_heartbeats_of_a_running_process_are_busy_not_frozen() -> None:
    # A C call holds the interpreter lock: rank 0's heartbeat thread cannot run for 4 s, but the
    # node agent sees its process running with a full core after its last heartbeat.
    last = NOW - 4 * S
    beats = [beat(0, last, progress("0", 40, 40, enq_us=NOW - 9 * S))]
    beats += [beat(r, NOW - S // 5, progress("0", 41, 40, enq_us=NOW - 8 * S)) for r in (1, 2, 3)]
    running = replace(snapshot(NOW, 4, beats), processes=(proc(0, "R", NOW - S, cpu_rate=0.99),))
    verdict = detect_hang(running, SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.STALL
    assert "heartbeats paused 4.0 s ago but its process runs" in verdict.evidence[0].detail
    # Asleep with no CPU after its last heartbeat: nothing shows life, it is frozen.
    asleep = replace(running, processes=(proc(0, "S", NOW - S),))
    hang = detect_hang(asleep, SETTINGS)
    assert hang is not None and hang.kind is IncidentKind.HANG and hang.culprit_ranks == (0,)
    # A sample from before the last heartbeat proves nothing about the time after it.
    before = replace(running, processes=(proc(0, "R", last - S, cpu_rate=0.99),))
    old = detect_hang(before, SETTINGS)
    assert old is not None and old.kind is IncidentKind.HANG


def test_a_collective_that_has_just_filled_up_is_no_hang() -> None:
    # 1-3 waited 6 s in #41; rank 0 entered it a moment ago: it is about to complete.
    beats = [beat(0, NOW - S // 5, progress("0", 41, 40, enq_us=NOW - S // 2))]
    beats += [beat(r, NOW - S // 5, progress("0", 41, 40, enq_us=NOW - 6 * S)) for r in (1, 2, 3)]
    assert detect_hang(snapshot(NOW, 4, beats), SETTINGS) is None
    # Rank 0 and 3 have already moved on to #42: #41 completed, the waiters' newest heartbeats
    # were sent just before it did (seen on a real job after a checkpoint write).
    moved = [beat(r, NOW - S // 5, progress("0", 42, 41, enq_us=NOW - S // 5)) for r in (0, 3)]
    moved += [beat(r, NOW - S, progress("0", 41, 40, enq_us=NOW - 9 * S)) for r in (1, 2)]
    assert detect_hang(snapshot(NOW, 4, moved), SETTINGS) is None
    # Everyone inside for the hang threshold is a hang nobody can be blamed for (yet).
    stuck = [beat(r, NOW - S // 5, progress("0", 41, 40, enq_us=NOW - 6 * S)) for r in range(4)]
    verdict = detect_hang(snapshot(NOW, 4, stuck), SETTINGS)
    assert verdict is not None and verdict.basis is Basis.UNLOCALIZED


def test_a_process_sample_of_an_earlier_process_is_ignored() -> None:
    stop = NOW - 12 * S
    beats = [
        beat(1, NOW - S // 5, progress(PAIR, 7, 6, enq_us=stop, op="send")),
        beat(3, stop, progress(PAIR, 7, 6, enq_us=stop, op="recv")),
    ]
    other = msgspec.structs.replace(proc(3, "R", NOW - S, cpu_rate=1.0), pid=4242)
    verdict = detect_hang(replace(snapshot(NOW, 4, beats), processes=(other,)), SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (3,)
