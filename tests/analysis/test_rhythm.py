"""A job's rhythm (`analysis.rhythm`): where a pause is, and when one is expected."""

from __future__ import annotations

from tracehound.analysis.rhythm import (
    Pause,
    Rhythm,
    history_words,
    place_in,
    place_of,
    waited_s,
)
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict
from tracehound.tracing.events import IncidentKind
from tracehound.tracing.ids import JobId

FRAMES = ("train.py:120 <module>", "train.py:88 main", "ckpt.py:14 save",
          "torch/serialization.py:944 save", "torch/serialization.py:1201 _save")


def stall(rank: int, frames: tuple[str, ...], waited: float) -> Verdict:
    evidence = [
        Evidence(fact=Fact.STACK, rank=rank, node="n1",
                 detail=f"rank {rank} stack, outermost first: " + " > ".join(frames)),
        Evidence(fact=Fact.WAITING, rank=0, node="n0", value=waited,
                 detail=f"rank 0 has waited {waited:.1f} s in all_reduce #9 of group 0"),
    ]
    return Verdict(job=JobId("j"), attempt=0, kind=IncidentKind.STALL, culprit_ranks=(rank,),
                   culprit_nodes=("n1",), confidence=0.85, basis=Basis.CONTROL_DEPENDENCY,
                   summary="stall", evidence=tuple(evidence), observed_at_us=1)


def test_a_place_is_the_users_frames_up_to_the_first_library_frame() -> None:
    assert place_in(FRAMES) == "train.py:120 <module> > train.py:88 main > ckpt.py:14 save"
    # what torch does inside differs from one checkpoint to the next; the place does not
    assert place_of(stall(3, FRAMES, 6.0)) == place_of(stall(3, (*FRAMES[:4], "x.py:1 f"), 2))
    assert place_of(stall(3, (), 6.0)) == ""
    assert waited_s(stall(3, FRAMES, 6.5)) == 6.5


def test_a_pause_with_history_is_expected_up_to_three_times_its_longest() -> None:
    rhythm = Rhythm()
    place = place_in(FRAMES)
    assert not rhythm.expected(3, place, 5.0)  # the first: no history
    rhythm.add(Pause(rank=3, place=place, seconds=5.0, ended_us=1))
    rhythm.add(Pause(rank=3, place=place, seconds=6.0, ended_us=2))
    assert rhythm.expected(3, place, 17.9)
    assert not rhythm.expected(3, place, 18.1)
    assert not rhythm.expected(2, place, 5.0)  # another rank's pause
    assert not rhythm.expected(3, "train.py:88 main > eval.py:3 run", 5.0)
    assert not rhythm.expected(3, "", 5.0)  # unknown place: never the rhythm
    assert history_words(rhythm.history(3, place)) == (
        "paused at this place 2 times before, its peers waiting 5.0-6.0 s")


def test_history_keeps_the_latest_pauses() -> None:
    rhythm = Rhythm(keep=3)
    for i in range(5):
        rhythm.add(Pause(rank=0, place="a.py:1 f", seconds=float(i + 1), ended_us=i))
    assert [p.seconds for p in rhythm.history(0, "a.py:1 f")] == [3.0, 4.0, 5.0]
    rhythm.add(Pause(rank=0, place="", seconds=1.0, ended_us=9))
    assert rhythm.pauses.keys() == {(0, "a.py:1 f")}
