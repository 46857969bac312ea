"""A job that stands still with nothing traced pending is never healthy: hand-built snapshots
shaped like the FSDP2 job whose stopped rank went unseen for 15 minutes (its peers blocked in a
functional all_reduce of `clip_grad_norm_`, which the recorder did not trace), and the healthy
pauses such a rule must leave alone."""

from __future__ import annotations

from dataclasses import replace

from observation_builders import T0, S, beat, node_of, proc, progress, snapshot, stack

from tracehound.analysis.detect import detect_hang
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.liveness import collective_wait
from tracehound.analysis.observation import Observation
from tracehound.analysis.settings import DetectionSettings, HangSettings
from tracehound.analysis.standstill import detect_standstill
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind, RankExit
from tracehound.tracing.ids import JobId, NodeId, Rank

SETTINGS = DetectionSettings(
    hang=HangSettings(after_s=5.0, heartbeat_timeout_s=2.5, busy_grace_s=600.0))
NOW = T0 + 1000 * S

FUNCOL = "torch/distributed/_functional_collectives.py"
WAIT_TENSOR = ("torch/nn/utils/clip_grad.py:97 clip_grad_norm_",
               "torch/distributed/tensor/placement_types.py:905 _NormPartial._reduce_value",
               f"{FUNCOL}:1115 AsyncCollectiveTensor.trigger_wait",
               f"{FUNCOL}:142 wait_tensor",
               "torch/_ops.py:1279 OpOverloadPacket.__call__")
CHECKPOINT = ("train.py:80 save", "torch/serialization.py:900 _save",
              "torch/serialization.py:700 write")


def still_job(idle_s: float, *, stopped: int | None = 2, waiting: tuple[int, ...] = (0, 1, 3),
              busy: tuple[int, ...] = (), silent_s: float = 0.0, ranks: int = 4
              ) -> Observation:
    """`ranks` ranks whose last step (87) and last traced collective (#736 of group 0,
    completed) ended `idle_s` ago; `stopped` SIGSTOPped (its heartbeats ended then, its
    process state T) unless `silent_s` makes it only silent; `waiting` ranks' stacks in a
    functional collective's wait, `busy` ones' in a checkpoint write."""
    last = NOW - int(idle_s * S)
    beats = []
    for r in range(ranks):
        at = (last + S // 10) if r == stopped else NOW - S // 5
        if r == stopped and silent_s:
            at = NOW - int(silent_s * S)
        beats.append(beat(r, at, progress("0", 736, 736, enq_us=last - 2000), step=87,
                          step_us=last))
    stacks = [stack(r, *WAIT_TENSOR, at_us=NOW - S) for r in waiting]
    stacks += [stack(r, *CHECKPOINT, at_us=NOW - S) for r in busy]
    processes = [proc(r, "S", NOW - S // 2) for r in range(ranks) if r != stopped]
    if stopped is not None and not silent_s:
        processes.append(proc(stopped, "T", NOW - S // 2))
    snap = replace(snapshot(NOW, ranks, beats), processes=tuple(processes),
                   stacks=tuple(stacks))
    return Observation.of(snap)


def test_a_stopped_rank_behind_peers_in_an_untraced_collective_is_a_hang() -> None:
    verdict = diagnose_observation(still_job(12.0), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (2,)
    assert verdict.culprit_nodes == (node_of(2),)
    assert verdict.basis is Basis.STANDSTILL
    assert verdict.confidence == 0.95
    assert "no traced collective is pending" in verdict.summary
    assert "stopped (state T)" in verdict.summary
    frozen = [e for e in verdict.evidence if e.fact is Fact.FROZEN]
    assert [e.rank for e in frozen] == [2]
    assert "step 87; last collective #736 of group 0, completed" in frozen[0].detail
    # the peers' stacks are the evidence of where they wait
    stacks = {e.rank: e.detail for e in verdict.evidence if e.fact is Fact.STACK}
    assert sorted(stacks) == [0, 1, 3]
    assert all("wait_tensor" in d and "clip_grad_norm_" in d for d in stacks.values())


def test_peers_still_within_the_hang_threshold_are_left_alone() -> None:
    assert detect_standstill(still_job(3.0).snapshot, SETTINGS) is None
    assert diagnose_observation(still_job(3.0), SETTINGS) is None


def test_one_rank_that_progresses_means_the_job_does_not_stand_still() -> None:
    obs = still_job(12.0)
    snap = obs.snapshot
    moving = beat(3, NOW - S // 5, progress("0", 740, 739, enq_us=NOW - S), step=88,
                  step_us=NOW - S)
    beats = tuple(hb if hb.rank != 3 else moving for hb in snap.heartbeats)
    assert detect_standstill(replace(snap, heartbeats=beats), SETTINGS) is None


def test_silence_alone_needs_as_long_and_a_peer_seen_waiting() -> None:
    """No process samples (the node agent could not read /proc): rank 2 is frozen by its
    silence alone. With the peers' stacks in a collective and 6 s of silence it is a hang, less
    sure than a stopped process; with no stack showing a wait (every rank may be writing a
    checkpoint while heartbeats are not relayed) or a shorter silence, nothing."""
    def without_processes(obs: Observation) -> Observation:
        return Observation.of(replace(obs.snapshot, processes=()))

    verdict = detect_standstill(without_processes(still_job(12.0, silent_s=6.0)).snapshot,
                                SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (2,)
    assert verdict.confidence < 0.95
    assert verdict.evidence[0].fact is Fact.SILENT
    quiet = without_processes(still_job(12.0, silent_s=6.0, waiting=()))
    assert detect_standstill(quiet.snapshot, SETTINGS) is None
    brief = without_processes(still_job(12.0, silent_s=3.0))
    assert detect_standstill(brief.snapshot, SETTINGS) is None


def test_a_stopped_rank_that_never_reported_is_named_from_its_launched_process() -> None:
    """The shape a CI run found: rank 1, handed to a new process on a spare node, trained and
    stopped itself, but no heartbeat of it ever reached the store; rank 0 waits in a process
    group's own `Work.wait()`, which its stack shows as the user's line only (busy, not a
    collective wait). The node agent samples rank 1's process from its launch (the launcher's
    note of its pid): stopped, so the standstill is a hang on rank 1. Without that sample the
    never-reporting rank is frozen by silence alone, which needs a peer seen waiting: nothing."""
    obs = still_job(12.0, ranks=2, stopped=1, waiting=(), busy=(0,))
    snap = obs.snapshot
    launched = replace(snap, heartbeats=tuple(hb for hb in snap.heartbeats if hb.rank != 1))
    verdict = detect_standstill(launched, SETTINGS)
    assert verdict is not None and verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (1,) and verdict.basis is Basis.STANDSTILL
    assert "stopped (state T)" in verdict.summary
    unsampled = replace(launched, processes=tuple(p for p in launched.processes if p.rank != 1))
    assert detect_standstill(unsampled, SETTINGS) is None


def test_nobody_frozen_a_busy_rank_behind_waiting_peers_is_a_stall_then_a_hang() -> None:
    verdict = diagnose_observation(still_job(12.0, stopped=None, busy=(2,)), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.STALL
    assert verdict.culprit_ranks == (2,)
    assert verdict.basis is Basis.STANDSTILL
    busy = [e for e in verdict.evidence if e.fact is Fact.BUSY]
    assert busy and busy[0].rank == 2 and "serialization.py" in busy[0].detail
    past_grace = diagnose_observation(still_job(700.0, stopped=None, busy=(2,)), SETTINGS)
    assert past_grace is not None
    assert past_grace.kind is IncidentKind.HANG
    assert past_grace.basis is Basis.BUSY_TIMEOUT
    assert past_grace.culprit_ranks == (2,)


def test_every_rank_waiting_with_nobody_frozen_is_an_unlocalized_hang() -> None:
    obs = still_job(12.0, stopped=None, waiting=(0, 1, 2, 3))
    verdict = detect_standstill(obs.snapshot, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.basis is Basis.UNLOCALIZED
    assert verdict.confidence <= 0.3


def test_every_rank_busy_on_its_own_is_a_hang_only_past_the_busy_grace() -> None:
    """A checkpoint written by every rank: nobody waits, nobody is frozen: nothing at the hang
    threshold; past the busy grace a hang on every rank (the program's, no machine's), which
    the stacks localize when one rank is elsewhere."""
    obs = still_job(12.0, stopped=None, waiting=(), busy=(0, 1, 2, 3))
    assert detect_standstill(obs.snapshot, SETTINGS) is None
    assert diagnose_observation(obs, SETTINGS) is None
    stuck = diagnose_observation(still_job(700.0, stopped=None, waiting=(), busy=(0, 1, 2, 3)),
                                 SETTINGS)
    assert stuck is not None
    assert stuck.kind is IncidentKind.HANG and stuck.basis is Basis.BUSY_TIMEOUT
    assert stuck.culprit_ranks == (0, 1, 2, 3) and stuck.confidence <= 0.3
    odd = still_job(700.0, stopped=None, waiting=(), busy=tuple(range(8)), ranks=8)
    stacks = tuple(s if s.rank != 2 else stack(2, "train.py:300 evaluate", at_us=NOW - S)
                   for s in odd.snapshot.stacks)
    localized = diagnose_observation(
        replace(Observation.of(replace(odd.snapshot, stacks=stacks)), stacks=stacks), SETTINGS)
    assert localized is not None and localized.culprit_ranks == (2,), localized


def test_a_job_with_an_exited_rank_is_left_to_the_crash_detector() -> None:
    obs = still_job(12.0)
    gone = RankExit(job=JobId("j"), attempt=0, node=NodeId(node_of(1)), rank=Rank(1),
                    pid=1001, time_us=NOW - 3 * S, exit_code=0)
    assert detect_standstill(replace(obs.snapshot, exits=(gone,)), SETTINGS) is None


def test_a_rank_seen_waiting_in_an_untraced_collective_passes_the_chain_on() -> None:
    """Ranks 0 and 1 wait 10 s in traced all_reduce #5 of group a = {0, 1, 3}; rank 3 never
    entered it. Its stack shows it in a functional collective's wait (untraced), and rank 2 (not
    in group a) is stopped: the chain runs 0 -> 3 -> 2. Without that stack rank 3 would be the
    busy end of the chain (a stall on it)."""
    stop = NOW - 12 * S
    beats = [
        beat(0, NOW - S // 5, progress("a", 5, 4, enq_us=NOW - 10 * S)),
        beat(1, NOW - S // 5, progress("a", 5, 4, enq_us=NOW - 10 * S)),
        beat(3, NOW - S // 5, progress("a", 4, 4, enq_us=NOW - 11 * S)),
        beat(2, stop, progress("b", 9, 9, enq_us=stop - S)),
    ]
    members = {"a": [0, 1, 3], "b": [2, 3]}
    base = snapshot(NOW, 4, beats, members)
    procs = (proc(2, "T", NOW - S // 2), proc(3, "S", NOW - S // 2))
    blind = detect_hang(replace(base, processes=procs), SETTINGS)
    assert blind is not None and blind.culprit_ranks[0] == 3
    seen = replace(base, processes=procs, stacks=(stack(3, *WAIT_TENSOR, at_us=NOW - S),))
    verdict = detect_hang(seen, SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.HANG
    assert verdict.culprit_ranks == (2,)
    assert verdict.confidence == 0.95
    notes = [e.detail for e in verdict.evidence if e.fact is Fact.STACK]
    assert any(d.startswith("rank 3") and "trace does not show" in d for d in notes)


def test_collective_waits_are_told_from_other_frames() -> None:
    assert collective_wait(WAIT_TENSOR).endswith("OpOverloadPacket.__call__") is False
    assert "wait_tensor" in collective_wait(WAIT_TENSOR)
    sync = ("train.py:13 <module>", "torch/distributed/c10d_logger.py:83 wrapper",
            "torch/distributed/distributed_c10d.py:3252 all_reduce")
    assert collective_wait(sync) == sync[-1]
    wrapped = ("train.py:13 <module>", "<tracehound wrapper of barrier>:40 wrapper")
    assert collective_wait(wrapped) == wrapped[-1]
    assert collective_wait(CHECKPOINT) == ""
    assert collective_wait(("train.py:15 <module>",)) == ""  # a C++ Work.wait() shows nothing
