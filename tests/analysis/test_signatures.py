"""Whole signatures: members of a collective are compared on every tensor they pass in and get
out (shape and dtype) and, for a coalesced call, part by part, from Flight Recorder dumps as
NCCL writes them and from the store's summary. A difference only in the outputs, or only inside
a coalesced call, names the member that differs as a mismatch; an all_to_all with uneven splits
and agreeing dtypes stays healthy.

The dumps are shaped like those of the checks on three ranks where rank 1 was the odd one (a
mismatch only in `output_sizes` or `output_dtypes`, or inside a `*_coalesced` call of parts
[[5,5]] against [[4,4]]), which used to read as a hang of all three ranks.
"""

from __future__ import annotations

from typing import Any

import pytest
from fr_builders import nccl_dump, nccl_entry
from observation_builders import observe

from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import load_observation
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing import flightrecorder as fr
from tracehound.tracing.events import Heartbeat, IncidentKind, ProcessGroupInfo
from tracehound.tracing.ids import JobId
from tracehound.tracing.shapes import (
    MAX_PARTS,
    difference,
    joined,
    shape_text,
    sizes_removed,
)
from tracehound.tracing.store import TraceStore
from tracehound.tracing.wire import Batch

SETTINGS = DetectionSettings()
DUMPED_AT_US = 2_000_000_000_000_000
T_NS = DUMPED_AT_US * 1000 - 30_000_000_000  # 30 s before the dump


# -- the shape text -------------------------------------------------------------------------------


def test_a_shape_text_lists_inputs_then_outputs() -> None:
    text = shape_text([((5, 5), "float32"), ((3,), "float32")], [((10, 5), "bfloat16")])
    assert text == "[5,5]:float32 [3]:float32 -> [10,5]:bfloat16"
    assert shape_text([((), "int64")]) == "[]:int64"
    assert shape_text([]) == ""
    assert sizes_removed(text) == "float32 float32 -> bfloat16"


def test_differences_are_told_where_they_first_are() -> None:
    a = "[5,5]:float32 -> [10,5]:float32"
    assert difference(a, "[5,5]:float32 -> [8,5]:float32") == (
        "output 1 is [10,5]:float32 against [8,5]:float32")
    assert difference("[4,4]:float32 [2]:float32", "[4,4]:float32 [2]:float16") == (
        "input 2 is [2]:float32 against [2]:float16")
    assert difference("[1]:f [1]:f", "[1]:f") == "2 inputs against 1"
    assert difference(a, a) == difference(a, "") == ""


def test_a_coalesced_call_joins_its_parts_inputs_then_outputs() -> None:
    assert joined(["[5,5]:f -> [5,5]:f", "[3]:f -> [3]:f"]) == "[5,5]:f [3]:f -> [5,5]:f [3]:f"
    assert joined(["[5,5]:f", ""]) == ""


def test_a_long_call_keeps_a_checksum_of_what_it_does_not_spell_out() -> None:
    many = [((i,), "float32") for i in range(MAX_PARTS + 10)]
    other = [*many[:-1], ((999,), "float32")]
    text, other_text = shape_text(many), shape_text(other)
    assert text.count(":float32") == MAX_PARTS and "+10 more #" in text
    assert text != other_text  # the last tensor differs, past the spelled-out ones


# -- dumps ----------------------------------------------------------------------------------------


def entry(seq: int, op: str, *, ins: list[list[int]], outs: list[list[int]],
          in_dtype: str = "Float", out_dtype: str = "Float", state: str = "completed",
          record: int | None = None) -> dict[str, Any]:
    return nccl_entry(seq, op, created_ns=T_NS + seq * 1_000_000, ins=ins, outs=outs,
                      in_dtype=in_dtype, out_dtype=out_dtype, state=state, record=record)


def dump(rank: int, entries: list[dict[str, Any]], *, enqueued: int, completed: int
         ) -> fr.FrDump:
    return nccl_dump(rank, entries, world=3, enqueued=enqueued, completed=completed,
                     dumped_at_us=DUMPED_AT_US)


def warmup(n: int = 4) -> list[dict[str, Any]]:
    return [entry(s, "allreduce", ins=[[1024]], outs=[[1024]]) for s in range(1, n + 1)]


def hung_in(last: dict[str, Any] | list[dict[str, Any]], odd: dict[str, Any] | list[Any]
            ) -> list[fr.FrDump]:
    """Three ranks that completed the warm-up and wait in call #5; rank 1 calls it as `odd`."""
    def calls(c: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
        return c if isinstance(c, list) else [c]
    return [dump(r, warmup() + calls(odd if r == 1 else last), enqueued=5, completed=4)
            for r in range(3)]


def snapshot_of(dumps: list[fr.FrDump]) -> JobSnapshot:
    conv = fr.to_records(dumps, job=JobId("sig"), attempt=0)
    return JobSnapshot(
        job=JobId("sig"), attempt=0, now_us=DUMPED_AT_US,
        heartbeats=tuple(r for r in conv.records if isinstance(r, Heartbeat)),
        groups=tuple(r for r in conv.records if isinstance(r, ProcessGroupInfo)),
        expected_ranks={r: "unknown" for r in range(3)},
    )


def verdict_of(dumps: list[fr.FrDump]) -> Any:
    return diagnose_observation(observe(snapshot_of(dumps)), SETTINGS)


def pending(op: str, ins: list[list[int]], outs: list[list[int]], **kw: Any) -> dict[str, Any]:
    return entry(5, op, ins=ins, outs=outs, state="started", **kw)


def test_an_all_gather_that_differs_only_in_its_output_size_is_a_mismatch() -> None:
    verdict = verdict_of(hung_in(
        pending("_allgather_base", [[5, 5]], [[15, 5]]),
        pending("_allgather_base", [[5, 5]], [[10, 5]])))
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH, verdict.summary
    assert verdict.culprit_ranks == (1,)
    assert "output 1 is [10,5]:float32 against [15,5]:float32" in verdict.evidence[0].detail


def test_a_call_that_differs_only_in_its_output_dtype_is_a_mismatch() -> None:
    verdict = verdict_of(hung_in(
        pending("_reduce_scatter_base", [[15, 5]], [[5, 5]]),
        pending("_reduce_scatter_base", [[15, 5]], [[5, 5]], out_dtype="BFloat16")))
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH, verdict.summary
    assert verdict.culprit_ranks == (1,)
    assert "output 1 is [5,5]:bfloat16 against [5,5]:float32" in verdict.evidence[0].detail


def coalesced(part: list[int], second: list[int] | None = None, *, state: str = "started"
              ) -> list[dict[str, Any]]:
    """A reduce_scatter_tensor_coalesced of two parts (`part`, then `second` or `part` again)
    as NCCL records it: a record per part and the end record, all under sequence id 5."""
    parts = [entry(5, "reduce_scatter_tensor", ins=[[3 * p[0], p[1]]], outs=[p], state=state,
                   record=4 + i) for i, p in enumerate((part, second or part))]
    end = entry(5, "reduce_scatter_tensor_coalesced", ins=[], outs=[], state=state, record=6)
    return [*parts, end]


def test_a_coalesced_call_whose_parts_differ_is_a_mismatch_on_that_rank() -> None:
    dumps = hung_in(coalesced([5, 5]), coalesced([4, 4]))
    (one,) = [e for e in dumps[0].entries if e.seq == 5]
    assert one.parts == 3 and one.op == "reduce_scatter_tensor"
    assert one.shape == "[15,5]:float32 [15,5]:float32 -> [5,5]:float32 [5,5]:float32"
    verdict = verdict_of(dumps)
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH, verdict.summary
    assert verdict.culprit_ranks == (1,)
    assert ("waits in reduce_scatter_tensor of 384 B float32 as #5 of group 0 while 2 of its 3 "
            "peers wait in reduce_scatter_tensor of 600 B float32") in verdict.evidence[0].detail


def test_coalesced_parts_in_another_order_are_compared_part_by_part() -> None:
    """The same bytes in all, parts swapped: only the part-by-part comparison sees it."""
    verdict = verdict_of(hung_in(coalesced([5, 5], [4, 4]), coalesced([4, 4], [5, 5])))
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH, verdict.summary
    assert verdict.culprit_ranks == (1,)
    assert "input 1 is [12,4]:float32 against [15,5]:float32" in verdict.evidence[0].detail


def test_agreeing_calls_every_member_waits_in_name_no_culprit() -> None:
    """The negative controls: a gather's root against its non-roots (the root alone has the
    gather list, the others none), a scatter's likewise, an all_to_all with equal splits and an
    all_reduce. Everyone waits in one call that agrees: no mismatch, and a hang that names no
    rank."""
    root = pending("gather", [[5]], [[5], [5], [5]])
    cases = [
        [pending("gather", [[5]], []) if r else root for r in range(3)],
        [pending("scatter", [], [[5]]) if r else pending("scatter", [[5]] * 3, [[5]])
         for r in range(3)],
        [pending("all_to_all", [[4, 4]], [[4, 4]])] * 3,
        [pending("allreduce", [[1024]], [[1024]])] * 3,
    ]
    for calls in cases:
        dumps = [dump(r, [*warmup(), calls[r]], enqueued=5, completed=4) for r in range(3)]
        verdict = verdict_of(dumps)
        assert verdict is not None and verdict.kind is IncidentKind.HANG, verdict
        assert verdict.culprit_ranks == (), verdict.summary
        assert "Not localized" in verdict.summary


def test_an_all_to_all_with_uneven_splits_is_no_mismatch() -> None:
    dumps = [dump(r, [*warmup(), pending("all_to_all", [[r + 1, 4]], [[3 - r, 4]])],
                  enqueued=5, completed=4) for r in range(3)]
    verdict = verdict_of(dumps)
    assert verdict is None or verdict.kind is not IncidentKind.MISMATCH, verdict.summary
    # ... but an output dtype apart is one, sizes or not
    odd = pending("all_to_all", [[2, 4]], [[2, 4]], out_dtype="Half")
    dumps[1] = dump(1, [*warmup(), odd], enqueued=5, completed=4)
    verdict = verdict_of(dumps)
    assert verdict is not None and verdict.kind is IncidentKind.MISMATCH, verdict
    assert verdict.culprit_ranks == (1,)


# -- completed calls, through the store's summary -------------------------------------------------


def stored(store: TraceStore, dumps: list[fr.FrDump], job: str) -> Any:
    conv = fr.to_records(dumps, job=JobId(job), attempt=0)
    store.insert(Batch(batch_id=f"b-{job}", records=conv.records), maybe_duplicate=True)
    obs = load_observation(store, job=JobId(job), attempt=0, now_us=DUMPED_AT_US,
                           window_s=60, expected_ranks={r: "unknown" for r in range(3)})
    return obs, diagnose_observation(obs, SETTINGS)


@pytest.mark.parametrize("odd", ["output", "coalesced"])
def test_completed_calls_that_differ_in_their_outputs_or_parts_are_read_from_the_store(
    store: TraceStore, odd: str,
) -> None:
    """Completed calls disagree in the store's summary (its SQL, on each adapter): on every
    rank the call at #5 completed, and the ring went on to #6, where everyone waits."""
    after = pending("allreduce", [[1024]], [[1024]])
    after["collective_seq_id"] = after["op_id"] = 6
    if odd == "output":
        mine = [entry(5, "_allgather_base", ins=[[5, 5]], outs=[[15, 5]])]
        theirs = [entry(5, "_allgather_base", ins=[[5, 5]], outs=[[10, 5]])]
    else:
        mine, theirs = coalesced([5, 5], state="completed"), coalesced([4, 4], state="completed")
    for c in [*mine, *theirs]:
        c["record_id"] = 4
    dumps = [dump(r, warmup() + (theirs if r == 1 else mine) + [after], enqueued=6,
                  completed=5) for r in range(3)]
    obs, verdict = stored(store, dumps, f"sig-{odd}")
    (d,) = obs.disagreements
    assert (d.group, d.seq, d.ranks) == ("0", 5, (0, 1, 2))
    assert d.shapes[0] == d.shapes[2] != d.shapes[1]
    assert verdict is not None
    assert verdict.kind is IncidentKind.MISMATCH, verdict.summary
    assert verdict.culprit_ranks == (1,)
