"""Pipeline order is not link slowness. Megatron issues its p2p without batching in parity
order: in the 1F1B steady state a stage sends its output and receives its next block's input in
one call that waits for both, so the send is recorded complete only when the neighbour's next
block has come. On held-out Megatron-shaped jobs (1F1B, 4 stages, TP 4) that read as slow links
on healthy jobs, window after window, which a policy acting on a repeated soft fault would have
evicted a node for.

The simulator plays that order (`Workload.combined_p2p`). A healthy job in it gives no verdict
over 20 consecutive windows, and a real slow link in it is still named."""

from __future__ import annotations

import pytest

from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.sim import consecutive_windows, simulate
from tracehound.tracing.events import IncidentKind


@pytest.mark.parametrize(("workload", "ranks", "seed"), [
    # before links were compared per pipeline boundary, this job got a slow link in 20 of its
    # 20 windows
    ("interleaved", 256, 7_001),
    ("1f1b", 128, 4_096),
])
def test_a_healthy_parity_order_pipeline_gives_no_verdict_over_20_windows(
        workload: str, ranks: int, seed: int) -> None:
    verdicts = []
    for w in consecutive_windows(ranks=ranks, seed=seed, count=20, window_steps=6,
                                 workload=workload, pp=4, tp=4, skew_ms=20.0,
                                 combined_p2p=True):
        assert w.info["combined_p2p"] is True
        verdict = diagnose_observation(w.observation())
        if verdict is not None and verdict.kind is not IncidentKind.STALL:
            verdicts.append((verdict.kind.value, verdict.summary))
    assert verdicts == []


def test_a_slow_link_in_a_parity_order_pipeline_is_still_named() -> None:
    named = 0
    for seed in range(6):
        sim = simulate(ranks=128, fault="slow_link", seed=800 + seed, workload="1f1b", pp=4,
                       tp=4, skew_ms=20.0, combined_p2p=True)
        if sim.truth.size < 1.6:
            continue  # below the size the targets hold from
        verdict = diagnose_observation(sim.observation())
        named += bool(verdict is not None and verdict.kind is IncidentKind.SLOW_LINK
                      and sim.truth.accepts(verdict.culprit_ranks[0],
                                            sim.rank_nodes[verdict.culprit_ranks[0]]))
    assert named >= 2, named
