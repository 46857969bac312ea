"""Replays snapshots recorded from real fault-injection runs (tests/golden) through the analysis'
entry point, `tracehound.analysis.diagnose_observation`."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracehound.analysis import DetectionSettings, diagnose_observation
from tracehound.analysis.snapshot import snapshot_from_json, snapshot_to_json
from tracehound.analysis.verdict import Basis

GOLDEN = Path(__file__).resolve().parents[1] / "golden"

CASES = [
    ("hang_sigstop_rank3", "hang", (3,), ("node-1",), Basis.CONTROL_DEPENDENCY),
    ("crash_sigkill_rank1", "crash", (1,), ("node-0",), Basis.EXIT_STATUS),
    ("hang_sigstop_rank1_chain", "hang", (1,), ("node-0",), Basis.CONTROL_DEPENDENCY),
    ("hang_sigstop_fsdp2_clip_rank1", "hang", (1,), ("node-2",), Basis.CONTROL_DEPENDENCY),
    ("hang_sigstop_tp_untraced_rank1", "hang", (1,), ("node-2",), Basis.STANDSTILL),
]


@pytest.mark.parametrize(("name", "kind", "ranks", "nodes", "basis"), CASES)
def test_recorded_fault_gives_the_recorded_verdict(
    name: str, kind: str, ranks: tuple[int, ...], nodes: tuple[str, ...], basis: Basis
) -> None:
    snap = snapshot_from_json((GOLDEN / f"{name}.snapshot.json").read_text())
    verdict = diagnose_observation(snap, DetectionSettings())
    assert verdict is not None
    assert verdict.kind.value == kind
    assert verdict.culprit_ranks == ranks
    assert verdict.culprit_nodes == nodes
    assert verdict.basis is basis
    assert verdict.confidence >= 0.9


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_snapshot_json_round_trips(name: str) -> None:
    text = (GOLDEN / f"{name}.snapshot.json").read_text()
    snap = snapshot_from_json(text)
    assert snapshot_from_json(snapshot_to_json(snap)) == snap


def test_one_second_earlier_the_hang_was_not_yet_declared() -> None:
    snap = snapshot_from_json((GOLDEN / "hang_sigstop_rank3.snapshot.json").read_text())
    from dataclasses import replace

    import msgspec

    earlier = replace(
        snap,
        now_us=snap.now_us - 1_000_000,
        heartbeats=tuple(
            msgspec.structs.replace(hb, time_us=hb.time_us - 1_000_000) for hb in snap.heartbeats
        ),
    )
    assert diagnose_observation(earlier, DetectionSettings()) is None


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_every_fact_agrees_with_the_recorded_heartbeats(name: str) -> None:
    """The evidence check of the real-job tests (`evidence_check`) on the recorded verdicts:
    the snapshots hold heartbeats only, so each position fact is held to them."""
    from evidence_check import contradictions

    snap = snapshot_from_json((GOLDEN / f"{name}.snapshot.json").read_text())
    verdict = diagnose_observation(snap, DetectionSettings())
    assert verdict is not None
    found, checked = contradictions([], list(snap.heartbeats),
                                    {"attempt": snap.attempt, "verdict": verdict.to_dict()})
    assert not found
    if verdict.basis is Basis.CONTROL_DEPENDENCY:  # its laggard and waiters at least
        assert checked >= 2
