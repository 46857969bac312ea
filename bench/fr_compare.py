"""Flight Recorder dumps read by torch's own analyzer and by Tracehound, side by side.

Each case is a directory of NCCL-style dumps (format 2.9, pickled, `rank_<r>` files, one group
of four ranks with its members in `pg_config` and its counters in `pg_status`), written by this
script with one fault put in by hand, or none:

- op, size and dtype mismatches, with the odd rank last, in the middle or first (torch's
  analyzer takes the first rank it reads as right, so an odd rank 0 shows who it blames);
- a mismatch only in an output's size or dtype, and one inside a coalesced call (its parts'
  records and its end under one sequence id);
- a missing rank (frozen: it left no dump, the others wait in its collective);
- GPU-style incomplete completion: one rank's work from #3 on never completed while its peers
  completed through #7 and wait in #8 (NCCL's `pg_status`: enqueued 7, completed 2);
- negative controls: everyone waits in one call that agrees (an all_reduce, a gather's root
  against its non-roots), and a healthy ring of all_to_all calls with uneven splits.

Tracehound reads each with `tracehound import-fr DIR --job J --store URL --dumped-at S` and
`tracehound diagnose --job J --store URL --json` (one embedded store for the run); torch's with
`python -m torch.distributed.flight_recorder.fr_trace DIR` (plus `--allow-incomplete-ranks` where
a dump is missing), whose log lines are read for the ranks it blames ("Culprit rank N", "missing
ranks"). A case is right when the kind and the culprit ranks are the expected ones; for the
controls, when no rank is named.

    python bench/fr_compare.py [--json] [--cases NAME,...] [--keep DIR]

Exit status 1 when Tracehound is wrong on any case. What it leaves out: the dumps are written
here, by the same hands as the importer; the checks on real NCCL dumps are the golden traces'
and the issue's. One group and four ranks: no sibling groups, no pipeline.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WORLD = 4
T_NS = 1_790_000_000_000_000_000
"""When the first call of every ring was created (ns)."""
DUMPED_AT_S = T_NS / 1e9 + 60
"""When the dumps were written: a minute after the first call, long past any hang threshold."""

Raw = dict[str, Any]


# -- dumps ---------------------------------------------------------------------------------------


def call(seq: int, op: str, ins: list[list[int]], outs: list[list[int]] | None = None, *,
         dtype: str = "Float", out_dtype: str | None = None, done: bool = True,
         record: int | None = None) -> Raw:
    """One Flight Recorder entry as NCCL writes it (`outs` default: the inputs, in place)."""
    created = T_NS + seq * 10_000_000
    outs = ins if outs is None else outs
    return {
        "record_id": seq - 1 if record is None else record, "pg_id": 0,
        "process_group": ("0", "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0,
        "op_id": seq, "profiling_name": f"nccl:{op}", "time_created_ns": created,
        "input_sizes": ins, "input_dtypes": [dtype] * len(ins), "output_sizes": outs,
        "output_dtypes": [out_dtype or dtype] * len(outs),
        "state": "completed" if done else "started",
        "time_discovered_started_ns": created,
        "time_discovered_completed_ns": created + 200_000 if done else None,
        "duration_ms": 0.2 if done else None, "retired": done, "is_p2p": False,
        "timeout_ms": 600_000, "frames": [],
    }


def dump(rank: int, entries: list[Raw]) -> Raw:
    ids = [e["collective_seq_id"] for e in entries]
    completed = max((e["collective_seq_id"] for e in entries if e["state"] == "completed"),
                    default=0)
    return {
        "version": "2.9", "rank": rank, "entries": entries, "nccl_version": "2.27.3",
        "pg_config": {"0": {"name": "0", "desc": "default_pg",
                            "ranks": str(list(range(WORLD)))}},
        "pg_status": {"0": {"last_enqueued_collective": max(ids, default=0),
                            "last_started_collective": max(ids, default=0),
                            "last_completed_collective": completed}},
    }


def warmup(n: int = 4) -> list[Raw]:
    return [call(s, "all_reduce", [[1024]]) for s in range(1, n + 1)]


def waiting_in(odd: int | None, mine: Raw, theirs: Raw | None = None) -> dict[int, Raw]:
    """Every rank completed the warm-up and waits in call #5: `theirs` on rank `odd`, `mine`
    on the others."""
    return {r: dump(r, [*warmup(), theirs if r == odd and theirs else mine])
            for r in range(WORLD)}


def coalesced(first: list[int], second: list[int]) -> list[Raw]:
    """A reduce_scatter_tensor_coalesced of two parts, pending: a record per part, then the
    end, all under sequence id 5."""
    parts = [call(5, "_reduce_scatter_base", [[WORLD * p[0], p[1]]], [p], done=False,
                  record=4 + i) for i, p in enumerate((first, second))]
    return [*parts, call(5, "reduce_scatter_tensor_coalesced", [], [], done=False, record=6)]


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    """The expected kind: mismatch, hang, or healthy."""
    culprits: tuple[int, ...]
    make: Callable[[], dict[int, Raw]]
    what: str
    notes: list[str] = field(default_factory=list)


def _pending(op: str, ins: list[list[int]], outs: list[list[int]] | None = None,
             **kw: Any) -> Raw:
    return call(5, op, ins, outs, done=False, **kw)


def _gpu_incomplete() -> dict[int, Raw]:
    out = {}
    for r in range(WORLD):
        if r == 3:  # entered #1..#7, its GPU completed #1..#2 only
            entries = [call(s, "all_to_all", [[64, 8]], done=s <= 2) for s in range(1, 8)]
        else:  # completed #1..#7, waits in #8
            entries = [call(s, "all_to_all", [[64, 8]], done=s <= 7) for s in range(1, 9)]
        out[r] = dump(r, entries)
    return out


def _missing() -> dict[int, Raw]:
    ranks = waiting_in(None, _pending("all_reduce", [[1024]]))
    del ranks[2]  # frozen: it could not write its dump
    return ranks


def _gather() -> dict[int, Raw]:
    return {r: dump(r, [*warmup(), _pending("gather", [[256]], [[256]] * WORLD if r == 0
                                                else [])]) for r in range(WORLD)}


def _uneven() -> dict[int, Raw]:
    return {r: dump(r, [call(s, "all_to_all", [[8 * (1 + (s + r) % 3), 16]],
                             [[8 * (1 + (s + 2 * r) % 3), 16]]) for s in range(1, 9)])
            for r in range(WORLD)}


def cases() -> list[Case]:
    ar = _pending("all_reduce", [[1024]])
    return [
        Case("op-odd-last", "mismatch", (3,),
             lambda: waiting_in(3, ar, _pending("broadcast", [[1024]])),
             "rank 3 broadcasts where ranks 0-2 all_reduce"),
        Case("op-odd-first", "mismatch", (0,),
             lambda: waiting_in(0, ar, _pending("broadcast", [[1024]])),
             "rank 0 broadcasts where ranks 1-3 all_reduce"),
        Case("size-odd-middle", "mismatch", (2,),
             lambda: waiting_in(2, ar, _pending("all_reduce", [[512]])),
             "rank 2 reduces 512 elements, the others 1024"),
        Case("size-odd-first", "mismatch", (0,),
             lambda: waiting_in(0, ar, _pending("all_reduce", [[512]])),
             "rank 0 reduces 512 elements, the others 1024"),
        Case("dtype-odd-last", "mismatch", (3,),
             lambda: waiting_in(3, ar, _pending("all_reduce", [[1024]], dtype="BFloat16")),
             "rank 3 reduces bfloat16, the others float32"),
        Case("dtype-odd-first", "mismatch", (0,),
             lambda: waiting_in(0, ar, _pending("all_reduce", [[1024]], dtype="BFloat16")),
             "rank 0 reduces bfloat16, the others float32"),
        Case("output-size", "mismatch", (1,),
             lambda: waiting_in(1, _pending("_all_gather_base", [[5, 5]], [[20, 5]]),
                                _pending("_all_gather_base", [[5, 5]], [[15, 5]])),
             "rank 1's all_gather output is [15,5], the others' [20,5]"),
        Case("output-dtype", "mismatch", (2,),
             lambda: waiting_in(2, _pending("_reduce_scatter_base", [[20, 5]], [[5, 5]]),
                                _pending("_reduce_scatter_base", [[20, 5]], [[5, 5]],
                                         out_dtype="BFloat16")),
             "rank 2's reduce_scatter output is bfloat16, the others' float32"),
        Case("coalesced", "mismatch", (1,),
             lambda: {r: dump(r, [*warmup(), *coalesced([4, 4] if r == 1 else [5, 5],
                                                        [5, 5])]) for r in range(WORLD)},
             "rank 1's first coalesced part is [4,4], the others' [5,5]"),
        Case("missing-rank", "hang", (2,), _missing,
             "rank 2 left no dump; ranks 0, 1, 3 wait in all_reduce #5"),
        Case("gpu-incomplete", "hang", (3,), _gpu_incomplete,
             "rank 3 entered #1-#7 and completed #2; its peers completed #7 and wait in #8"),
        Case("control-agreeing", "hang", (), lambda: waiting_in(None, ar),
             "everyone waits in all_reduce #5 with one signature"),
        Case("control-gather", "hang", (), _gather,
             "everyone waits in gather #5: the root with its gather list, the others without"),
        Case("control-uneven-all_to_all", "healthy", (), _uneven,
             "eight all_to_all calls with uneven splits, all completed"),
    ]


def write(case: Case, directory: Path) -> None:
    directory.mkdir(parents=True)
    for rank, raw in case.make().items():
        (directory / f"rank_{rank}").write_bytes(pickle.dumps(raw))


# -- the two readers -----------------------------------------------------------------------------


def tracehound(directory: Path, job: str, store: str) -> dict[str, Any]:
    base = [sys.executable, "-m", "tracehound.controller.cli"]
    imported = subprocess.run(
        [*base, "import-fr", str(directory), "--job", job, "--store", store,
         "--dumped-at", str(DUMPED_AT_S), "--world-size", str(WORLD), "--json"],
        capture_output=True, text=True, check=False)
    if imported.returncode != 0:
        return {"kind": "error", "culprit_ranks": [], "detail": imported.stderr.strip()[-300:]}
    done = subprocess.run([*base, "diagnose", "--job", job, "--store", store, "--json"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"kind": "error", "culprit_ranks": [], "detail": done.stderr.strip()[-300:]}
    verdict = json.loads(done.stdout)
    return {"kind": verdict["kind"], "culprit_ranks": verdict["culprit_ranks"],
            "detail": verdict["summary"]}


_CULPRIT = re.compile(r"Culprit rank (\d+); Error type: (\w+)")
_MISSING = re.compile(r"missing ranks: \{([0-9, ]*)\}")
_UNDECIDED = re.compile(r"missed FR dumps from ranks \(\{([0-9, ]*)\}\)")


def fr_trace(directory: Path, incomplete: bool) -> dict[str, Any]:
    """What torch's analyzer says: the ranks its log lines blame, and of what."""
    args = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(directory)]
    if incomplete:
        args.append("--allow-incomplete-ranks")
    done = subprocess.run(args, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    blamed = [(int(r), kind) for r, kind in _CULPRIT.findall(text)]
    missing = [int(r) for m in _MISSING.findall(text) for r in m.split(",") if r.strip()]
    if done.returncode != 0:
        last = [line for line in text.splitlines() if line.strip()][-1:]
        return {"kind": "error", "culprit_ranks": [], "detail": " ".join(last)[:300]}
    if blamed:
        return {"kind": "mismatch", "culprit_ranks": sorted({r for r, _ in blamed}),
                "detail": ", ".join(sorted({k for _, k in blamed}))}
    if missing:
        return {"kind": "not all ranks joined", "culprit_ranks": sorted(set(missing)),
                "detail": "Not all ranks joining collective"}
    undecided = sorted({int(r) for m in _UNDECIDED.findall(text) for r in m.split(",")
                        if r.strip()})
    if undecided:
        return {"kind": "undecided", "culprit_ranks": [],
                "detail": f"cannot decide: missed the dumps of ranks {undecided}"}
    return {"kind": "nothing found", "culprit_ranks": [], "detail": ""}


def right(case: Case, verdict: dict[str, Any]) -> bool:
    if not case.culprits:  # a control: no rank named, no mismatch, no error
        return not verdict["culprit_ranks"] and verdict["kind"] not in ("mismatch", "error")
    return verdict["kind"] == case.kind and tuple(verdict["culprit_ranks"]) == case.culprits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--keep", type=Path, help="write the dumps and the store here (kept)")
    args = parser.parse_args()
    chosen = [c for c in cases() if not args.cases or c.name in args.cases.split(",")]
    if not chosen:
        parser.error(f"--cases {args.cases!r}: no such case; the cases are "
                     + ", ".join(c.name for c in cases()))
    with tempfile.TemporaryDirectory(prefix="fr-compare-") as tmp:
        root = args.keep or Path(tmp)
        store = f"chdb://{root / 'store'}"
        rows = []
        started = time.monotonic()
        for i, case in enumerate(chosen, 1):
            directory = root / "dumps" / case.name
            write(case, directory)
            ours = tracehound(directory, f"fr-{case.name}", store)
            theirs = fr_trace(directory, incomplete=len(list(directory.iterdir())) < WORLD)
            rows.append({
                "case": case.name, "what": case.what,
                "expected": {"kind": case.kind, "culprit_ranks": list(case.culprits)},
                "tracehound": {**ours, "right": right(case, ours)},
                "fr_trace": {**theirs, "right": right(case, theirs)},
            })
            print(f"[{i}/{len(chosen)}] {case.name}: tracehound {ours['kind']} "
                  f"{ours['culprit_ranks']}, fr_trace {theirs['kind']} {theirs['culprit_ranks']}"
                  f" ({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    result = {
        "cases": rows,
        "tracehound_right": sum(r["tracehound"]["right"] for r in rows),
        "fr_trace_right": sum(r["fr_trace"]["right"] for r in rows),
        "total": len(rows),
    }
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{'case':<26} {'expected':<16} {'tracehound':<22} fr_trace")
        for r in rows:
            def cell(v: dict[str, Any]) -> str:
                mark = "" if v.get("right", True) else " (wrong)"
                return f"{v['kind']} {v['culprit_ranks']}{mark}"
            print(f"{r['case']:<26} {cell(r['expected']):<16} {cell(r['tracehound']):<22} "
                  f"{cell(r['fr_trace'])}")
        print(f"right: tracehound {result['tracehound_right']}/{len(rows)}, "
              f"fr_trace {result['fr_trace_right']}/{len(rows)}")
    return 0 if result["tracehound_right"] == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
