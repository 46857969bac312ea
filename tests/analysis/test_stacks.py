"""Silent hang: stack traces single out the ranks the collective traces cannot."""

from __future__ import annotations

from dataclasses import replace

from observation_builders import T0, S, beat, observe, progress, snapshot, stack

from tracehound.analysis.confidence import LIKELY, STRONG, UNSURE, between
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.stacks import detect_silent_hang, throughput_collapse
from tracehound.analysis.verdict import Basis, Fact
from tracehound.tracing.events import IncidentKind

SETTINGS = DetectionSettings()
NOW = T0 + 100 * S
WAIT = ("megatron/training.py:900 train_step", "torch/distributed/c10d_logger.py:81 wrapper",
        "torch/distributed/distributed_c10d.py:2805 all_reduce")
LOADER = ("megatron/training.py:702 get_batch", "torch/utils/data/dataloader.py:708 __next__",
          "multiprocessing/queues.py:113 get", "threading.py:359 wait")


def stalled(ranks: int = 16) -> list:  # type: ignore[type-arg]
    """Every rank pending in world all_reduce #40 for 9 s, nobody silent or lagging."""
    return [beat(r, NOW - S // 5, progress("0", 40, 39, enq_us=NOW - 9 * S))
            for r in range(ranks)]


def test_the_rank_stuck_in_the_data_loader_is_the_culprit() -> None:
    stacks = tuple(stack(r, *(LOADER if r == 11 else WAIT)) for r in range(16))
    verdict = diagnose_observation(observe(snapshot(NOW, 16, stalled()), stacks=stacks),
                                   SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.SILENT_HANG
    assert verdict.basis is Basis.MAJORITY_VOTE
    assert verdict.culprit_ranks == (11,)
    assert verdict.culprit_nodes == ("node-1",)
    assert verdict.confidence == between(LIKELY, STRONG, 15 / 16)  # 15 of 16 share a stack
    assert verdict.summary.startswith(
        "rank 11 on node node-1 is in threading.py:359 wait while 15 of 16 ranks are in "
        "torch/distributed/distributed_c10d.py:2805 all_reduce; 16 rank(s) have waited")
    assert [(e.fact, e.rank) for e in verdict.evidence] == [(Fact.STACK, 11)]


def test_a_rank_sampled_in_the_wrapper_around_the_same_call_is_not_an_outlier() -> None:
    stacks = tuple(
        stack(r, *(LOADER if r == 11 else WAIT[:-1] if r in (3, 12) else WAIT)) for r in range(16)
    )
    verdict = detect_silent_hang(observe(snapshot(NOW, 16, stalled()), stacks=stacks), SETTINGS,
                                 stall=diagnose_observation(observe(snapshot(NOW, 16, stalled())),
                                                            SETTINGS))
    assert verdict is not None
    assert verdict.culprit_ranks == (11,)


def test_when_too_many_ranks_differ_the_whole_group_is_named_with_low_confidence() -> None:
    members = {"tp-0": list(range(8)), "tp-1": list(range(8, 16)), "0": list(range(16))}
    other = ("megatron/training.py:702 get_batch", "fsspec/spec.py:1941 read")
    stacks = tuple(
        stack(r, *(LOADER if r in (1, 2) else other if r in (4, 5) else WAIT))
        for r in range(16)
    )
    verdict = diagnose_observation(
        observe(snapshot(NOW, 16, stalled(), members), stacks=stacks), SETTINGS)
    assert verdict is not None
    assert verdict.kind is IncidentKind.SILENT_HANG
    assert verdict.group == "tp-0"
    assert verdict.culprit_ranks[:4] == (1, 2, 4, 5)  # 4 of 16 differ: more than 20%
    assert set(verdict.culprit_ranks) == set(range(8))
    assert verdict.confidence == UNSURE


def test_stacks_of_a_job_that_progresses_prove_nothing() -> None:
    beats = [beat(r, NOW - S // 5, progress("0", 40, 39, enq_us=NOW - S // 10))
             for r in range(16)]
    stacks = tuple(stack(r, *(LOADER if r == 11 else WAIT)) for r in range(16))
    assert diagnose_observation(observe(snapshot(NOW, 16, beats), stacks=stacks),
                                SETTINGS) is None


def test_a_collapse_of_throughput_without_pending_collectives_waits_for_the_busy_grace() -> None:
    # Steps took 0.5 s; nobody has finished one for 30 s and nobody waits in a collective: every
    # rank is busy on its own (a long evaluation looks just like this), so the busy grace holds.
    beats = [beat(r, NOW - S // 5, step=120, step_us=NOW - 30 * S, start_step=0,
                  first_step_us=NOW - 30 * S - 60 * S) for r in range(16)]
    inner = ("megatron/core/optimizer/clip_grads.py:138 get_grad_norm_fp32",
             "torch/cuda/__init__.py:985 synchronize")
    stacks = tuple(stack(r, *(inner if r == 5 else LOADER)) for r in range(16))
    assert throughput_collapse(snapshot(NOW, 16, beats), SETTINGS) is None
    assert diagnose_observation(observe(snapshot(NOW, 16, beats), stacks=stacks),
                                SETTINGS) is None
    # Past the grace, the stacks judge it.
    short = replace(SETTINGS, hang=replace(SETTINGS.hang, busy_grace_s=20.0))
    assert throughput_collapse(snapshot(NOW, 16, beats), short) == (
        "the median rank has finished no step for 29.8 s (a step took 0.50 s before)")
    verdict = diagnose_observation(observe(snapshot(NOW, 16, beats), stacks=stacks), short)
    assert verdict is not None
    assert verdict.kind is IncidentKind.SILENT_HANG
    assert verdict.culprit_ranks == (5,)
    healthy = [beat(r, NOW - S // 5, step=120, step_us=NOW - S // 2, start_step=0,
                    first_step_us=NOW - 60 * S) for r in range(16)]
    assert throughput_collapse(snapshot(NOW, 16, healthy), short) is None


def test_a_collapse_of_throughput_while_ranks_wait_in_collectives_needs_no_grace() -> None:
    # Ranks pass through collectives slowly (each wait below the hang threshold): the job crawls.
    beats = [beat(r, NOW - S // 5, progress("0", 40, 39, enq_us=NOW - 2 * S), step=120,
                  step_us=NOW - 30 * S, start_step=0, first_step_us=NOW - 30 * S - 60 * S)
             for r in range(16)]
    assert throughput_collapse(snapshot(NOW, 16, beats), SETTINGS) == (
        "the median rank has finished no step for 29.8 s (a step took 0.50 s before)")
