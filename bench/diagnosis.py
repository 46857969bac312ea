"""Diagnosis benchmark: how often the analysis names the right fault and the right rank.

Runs seeded simulated scenarios (`tracehound.analysis.sim`) of every fault class and healthy
runs, 64 to 4,096 ranks, through `diagnose_observation` and scores the verdicts:

- top1: fraction of a class's scenarios whose verdict names a true culprit first (for a slow
  link either end of the link, for a slow node or a hardware fault any rank of that node);
- recall: fraction of a class's scenarios with a verdict of that kind and a right top-1;
- precision: among all verdicts of that kind over all scenarios, the fraction that were right
  (right kind and right top-1); null when no verdict of that kind was given;
- healthy_fp_rate: fraction of healthy runs with any verdict;
- by_level: per level of the confidence scale (`tracehound.analysis.confidence`; a verdict
  counts at the highest level its confidence reaches), how many verdicts were given and the
  share whose first culprit was a true one (right_kind: and of the right kind), over every
  scenario, healthy runs included: the measurement behind the levels' documented meaning.

A hang whose culprit is stuck in computation while it keeps reporting (variant compute_stuck)
looks exactly like a rank busy with a checkpoint or an evaluation: the analysis gives a `stall`
naming it at once and a hang only once the busy grace has passed. For that variant a stall
verdict with the right top-1 counts as the right kind; `by_variant` shows the variant apart.

The scenarios run under field conditions (`tracehound.analysis.sim.FIELD`: node clocks
offset by `--skew-ms` and drifting, every common layout, steps from 50 ms to 30 s, fault sizes
across the grey zone, gradual faults starting at any step up to the window's middle, harmless
pauses, checkpoints, evaluation and health warnings), and the benchmark reports what it does not
know as well as what it does. One window per scenario: a gradual fault that starts in a window's
last steps looks like a pause there and is judged in the supervisor's next window, which the
scenario's window stands for by holding the fault for at least half its steps (the figures
below say nothing of a gradual fault's first window after its start):

- skew_ms: the sigma of the node clock offsets the scenarios ran with;
- bars: precision and recall of the graded classes above the size the issue asks for (straggler
  >= 1.3x, slow link >= 1.6x); scenarios of the class below the bar count neither way;
- recall_by_size: per graded class (straggler, slow link, hardware), recall per band of fault
  size (the slowdown or latency factor): a curve, not one number;
- over_time: the graded classes as the supervisor meets them, window after window of long
  jobs whose fault starts mid-run: the share named within 1, 2, 3... windows of the first
  window that holds the fault, the share named in two windows in a row (what the default
  policy acts on for a soft fault), and the windows naming a wrong culprit of the class;
- by_skew: every class at clock offsets of 0, 5 and 20 ms (not with --quick);
- fp_per_window: consecutive detection windows (at least 10 s and 6 steps each, as the
  supervisor widens its window) of long healthy jobs (>= 1,000 windows without --quick), the
  share with any verdict, by kind, and what that rate means per job-day; stalls (a busy rank
  named, nothing done) are counted apart from actionable kinds;
- by_layout: per layout (DDP, ZeRO-3, MoE, Megatron pp 2, 1F1B pp 4, and Megatron's
  non-batched p2p in parity order at pp 4 and interleaved pp 4 and 8: `LAYOUTS`), at 256
  ranks, the false verdicts over consecutive healthy windows and the straggler recall below and
  from 1.3x.

It also times ONE `diagnose_observation` call on a healthy window of 1,024, 10,240 and 32,768
ranks, pinned to one core (the observation is built outside the timed region), and with
`--store chdb` runs one scenario per class through a trace store (`write_to_store`, then the
store's SQL summaries via `load_observation`) to show that both paths give the same summaries
and the same verdicts.

    .venv/bin/python bench/diagnosis.py                # readable table (about 5 minutes)
    .venv/bin/python bench/diagnosis.py --json         # ONE JSON object on stdout
    .venv/bin/python bench/diagnosis.py --quick        # a smaller sample, under a minute
    .venv/bin/python bench/diagnosis.py --store chdb   # also the store path
    .venv/bin/python bench/diagnosis.py --json --skew-ms 20   # clocks N(0, 20 ms) apart

Progress and the confusion summary go to stderr. Figures are printed, never asserted.
"""

from __future__ import annotations

import os

# One core: set before numpy loads its BLAS.
os.environ["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
os.environ["OPENBLAS_NUM_THREADS"] = os.environ.get("OPENBLAS_NUM_THREADS", "1")
os.environ["MKL_NUM_THREADS"] = os.environ.get("MKL_NUM_THREADS", "1")

import argparse
import gc
import itertools
import json
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracehound.analysis.clocks import clock_bucket_us, estimate_clocks
from tracehound.analysis.confidence import LEVELS, level_of
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import Observation, load_observation, window_health
from tracehound.analysis.settings import UNEVEN_OPS
from tracehound.analysis.sim import (
    FAULT_KINDS,
    SimulatedJob,
    consecutive_windows,
    simulate,
    write_to_store,
)
from tracehound.analysis.sim import reference as summaries
from tracehound.analysis.verdict import Verdict
from tracehound.tracing.store import open_store

CLASSES = tuple(k.value for k in FAULT_KINDS)
HEALTHY = "healthy"
RANKS = (64, 128, 256, 512, 1024, 2048, 4096)
RANK_WEIGHTS = (0.2, 0.2, 0.2, 0.15, 0.12, 0.08, 0.05)
QUICK_RANKS = (64, 128, 256, 512)
QUICK_WEIGHTS = (0.3, 0.3, 0.25, 0.15)
TIMED_RANKS = (1024, 10_240, 32_768)


@dataclass(frozen=True, slots=True)
class Outcome:
    cls: str
    variant: str
    ranks: int
    seed: int
    verdict_kind: str | None
    top1_right: bool
    named: int | None
    truth: tuple[int, ...]
    seconds: float
    confidence: float | None = None
    size: float = 0.0
    skew_ms: float = 0.0


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def plan(quick: bool) -> list[tuple[str, int, int]]:
    """(class, seed, ranks) of every scenario, deterministic."""
    per_class, healthy = (5, 9) if quick else (36, 60)
    ranks, weights = (QUICK_RANKS, QUICK_WEIGHTS) if quick else (RANKS, RANK_WEIGHTS)
    rng = np.random.default_rng(20_240)
    out: list[tuple[str, int, int]] = []
    for ci, cls in enumerate((*CLASSES, HEALTHY)):
        for i in range(healthy if cls == HEALTHY else per_class):
            n = int(rng.choice(ranks, p=np.asarray(weights) / sum(weights)))
            out.append((cls, 1_000 * (ci + 1) + i, n))
    return out


def right(sim: SimulatedJob, verdict: Verdict | None) -> bool:
    if verdict is None or not verdict.culprit_ranks:
        return False
    rank = verdict.culprit_ranks[0]
    return sim.truth.accepts(rank, sim.rank_nodes.get(rank, ""))


def run_one(cls: str, seed: int, ranks: int, skew_ms: float = 0.0) -> Outcome:
    started = time.perf_counter()
    sim = simulate(ranks=ranks, fault=None if cls == HEALTHY else cls, seed=seed,
                   skew_ms=skew_ms)
    verdict = diagnose_observation(sim.observation())
    kind = verdict.kind.value if verdict else None
    if cls == "hang" and sim.truth.variant == "compute_stuck" and kind == "stall":
        kind = "hang"  # busy until the grace: localized at once as a stall (module docstring)
    return Outcome(
        cls=cls, variant=sim.truth.variant, ranks=ranks, seed=seed,
        verdict_kind=kind,
        top1_right=right(sim, verdict),
        named=verdict.culprit_ranks[0] if verdict and verdict.culprit_ranks else None,
        truth=sim.truth.culprit_ranks[:3], seconds=time.perf_counter() - started,
        confidence=verdict.confidence if verdict else None,
        size=float(sim.truth.size), skew_ms=skew_ms,
    )


def score(outcomes: list[Outcome]) -> dict[str, Any]:
    classes: dict[str, dict[str, Any]] = {}
    for cls in CLASSES:
        mine = [o for o in outcomes if o.cls == cls]
        given = [o for o in outcomes if o.verdict_kind == cls]
        n = len(mine)
        classes[cls] = {
            "top1": _ratio(sum(o.top1_right for o in mine), n),
            "precision": _ratio(sum(o.cls == cls and o.top1_right for o in given), len(given)),
            "recall": _ratio(sum(o.verdict_kind == cls and o.top1_right for o in mine), n),
            "n": n,
        }
    healthy = [o for o in outcomes if o.cls == HEALTHY]
    return {
        "classes": classes,
        "healthy_fp_rate": _ratio(sum(o.verdict_kind is not None for o in healthy),
                                  len(healthy)),
        "healthy_n": len(healthy),
    }


BARS = {"straggler": 1.3, "slow_link": 1.6}
"""The smallest fault size the accuracy targets hold from (the grey zone lies below)."""
SIZE_BANDS = {
    "straggler": (1.0, 1.1, 1.2, 1.3, 1.5, 2.01),
    "slow_link": (1.0, 1.4, 1.6, 2.0, 3.0, 4.01),
    "hardware": (1.0, 1.3, 1.8, 3.0, 8.01),
}
"""Band edges of fault size per graded class (a hardware fault without a size, a hang, is 0)."""


def bars(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Precision and recall of the graded classes from their bar up."""
    out: dict[str, dict[str, Any]] = {}
    for cls, bar in BARS.items():
        mine = [o for o in outcomes if o.cls == cls and o.size >= bar]
        grey = {id(o) for o in outcomes if o.cls == cls and o.size < bar}
        given = [o for o in outcomes if o.verdict_kind == cls and id(o) not in grey]
        out[cls] = {
            "min_size": bar, "n": len(mine),
            "recall": _ratio(sum(o.verdict_kind == cls and o.top1_right for o in mine),
                             len(mine)),
            "precision": _ratio(sum(o.cls == cls and o.top1_right for o in given), len(given)),
        }
    return out


def recall_by_size(outcomes: list[Outcome]) -> dict[str, list[dict[str, Any]]]:
    """Per graded class and band of fault size: scenarios and the share found (right kind and
    first culprit)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for cls, edges in SIZE_BANDS.items():
        rows = []
        for lo, hi in itertools.pairwise(edges):
            mine = [o for o in outcomes if o.cls == cls and lo <= o.size < hi]
            rows.append({
                "from": lo, "to": round(hi, 1), "n": len(mine),
                "recall": _ratio(sum(o.verdict_kind == cls and o.top1_right for o in mine),
                                 len(mine)),
            })
        unsized = [o for o in outcomes if o.cls == cls and o.size < edges[0]]
        if unsized:
            rows.append({"from": 0.0, "to": 0.0, "n": len(unsized), "unsized": True,
                         "recall": _ratio(sum(o.verdict_kind == cls and o.top1_right
                                              for o in unsized), len(unsized))})
        out[cls] = rows
    return out


def supervisor_windows(ranks: int, seed: int, count: int, skew_ms: float,
                       fault: str | None = None, **shape: Any) -> Iterator[SimulatedJob]:
    """`count` consecutive windows of one job as the supervisor and `tracehound diagnose`
    judge them: 10 s, or 6 steps where that is longer (the supervisor widens its window to hold
    enough collectives). `shape`: the layout's arguments of `consecutive_windows`."""
    probe = next(consecutive_windows(ranks=ranks, seed=seed, count=1, window_steps=6,
                                     skew_ms=skew_ms, fault=fault, **shape))
    six_steps_s = (probe.now_us - probe.window_start_us) / 1e6
    width: dict[str, Any] = {"window_steps": 6} if six_steps_s >= 10.0 else {"window_s": 10.0}
    return consecutive_windows(ranks=ranks, seed=seed, count=count, skew_ms=skew_ms,
                               fault=fault, **width, **shape)


OVER_TIME_WINDOWS = 6
"""Windows each job of `over_time` is played for (its fault starts in one of the first half)."""


def over_time(jobs: int, seed: int, skew_ms: float) -> dict[str, dict[str, Any]]:
    """The graded classes as the supervisor meets them: `jobs` long jobs per class (64..1,024
    ranks) whose fault starts mid-run, judged window after window. Per class, over the jobs
    whose fault is at least its bar (`BARS`; hardware: all): the share whose culprit was
    named (right kind and first culprit) within 1, 2, 3... windows of the first window that
    holds the fault; the share named so in two consecutive windows (what the default policy
    acts on for a soft fault) within as many; and the verdicts, once the fault struck, of its
    kind naming a wrong culprit."""
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, Any]] = {}
    for cls in ("straggler", "slow_link", "hardware"):
        named: list[int | None] = []
        twice: list[int | None] = []
        wrong = judged = 0
        for _ in range(jobs):
            ranks = int(rng.choice((64, 128, 256, 512, 1024)))
            job_seed = int(rng.integers(1 << 30))
            since: list[tuple[bool, bool]] = []  # (right, wrong culprit) per struck window
            size = 0.0
            for window in supervisor_windows(ranks, job_seed, OVER_TIME_WINDOWS, skew_ms,
                                             fault=cls):
                if window.truth.kind is None:
                    continue
                size = float(window.truth.size)
                verdict = diagnose_observation(window.observation())
                mine = verdict is not None and verdict.kind.value == cls
                since.append((mine and right(window, verdict),
                              mine and not right(window, verdict)))
            if size < BARS.get(cls, 0.0):
                continue
            judged += len(since)
            wrong += sum(w for _, w in since)
            hits = [i for i, (r, _) in enumerate(since) if r]
            named.append(hits[0] + 1 if hits else None)
            pairs = [i + 1 for i in hits if i + 1 < len(since) and since[i + 1][0]]
            twice.append(pairs[0] + 1 if pairs else None)
        n = len(named)
        out[cls] = {
            "min_size": BARS.get(cls, 0.0), "n": n,
            "named_within": {k: _ratio(sum(x is not None and x <= k for x in named), n)
                             for k in range(1, OVER_TIME_WINDOWS)},
            "named_twice_within": {k: _ratio(sum(x is not None and x <= k for x in twice), n)
                                   for k in range(2, OVER_TIME_WINDOWS)},
            "wrong_culprit_windows": wrong, "windows": judged,
        }
        say(f"over time: {cls} {out[cls]}")
    return out


def fp_per_window(windows: int, seed: int, skew_ms: float,
                  per_job: int = 25) -> dict[str, Any]:
    """Consecutive detection windows of long healthy jobs (64..256 ranks, field conditions,
    `per_job` windows each, every window at least 10 s and 6 steps wide): how many gave a
    verdict, of which kind, and how many repeated the previous window's (kind and a culprit):
    those a soft-fault policy would act on."""
    rng = np.random.default_rng(seed)
    kinds: Counter[str] = Counter()
    seen = jobs = repeated = 0
    seconds = 0.0
    started = time.monotonic()
    while seen < windows:
        ranks = int(rng.choice((64, 128, 256), p=(0.5, 0.3, 0.2)))
        job_seed = int(rng.integers(1 << 30))
        count = min(per_job, windows - seen)
        jobs += 1
        before: Verdict | None = None
        for window in supervisor_windows(ranks, job_seed, count, skew_ms):
            verdict = diagnose_observation(window.observation())
            kinds[verdict.kind.value if verdict else "none"] += 1
            if (verdict is not None and before is not None and verdict.kind == before.kind
                    and verdict.kind.value != "stall"
                    and set(verdict.culprit_ranks) & set(before.culprit_ranks)):
                repeated += 1
            before = verdict
            seconds += (window.now_us - window.window_start_us) / 1e6
            seen += 1
        if jobs % 5 == 0:
            say(f"healthy windows: {seen}/{windows} ({jobs} jobs, "
                f"{time.monotonic() - started:.0f} s)")
    flagged = sum(n for k, n in kinds.items() if k not in ("none", "stall"))
    rate = flagged / seen if seen else 0.0
    mean_s = seconds / seen if seen else 0.0
    return {
        "windows": seen, "jobs": jobs, "verdicts": flagged,
        "rate": round(rate, 5), "stalls": kinds.get("stall", 0),
        "by_kind": dict(sorted(kinds.items())),
        "mean_window_s": round(mean_s, 1),
        "per_day": round(rate * 86_400 / mean_s, 1) if mean_s else None,
        # the same kind naming a same rank in two consecutive windows: what the default
        # policy acts on for soft faults (controller.policy SOFT_REPEATS)
        "repeated": repeated,
        "repeated_per_day": round(repeated / seen * 86_400 / mean_s, 2) if mean_s else None,
    }


LAYOUTS: tuple[tuple[str, str, int, int, bool], ...] = (
    ("ddp", "ddp", 1, 1, False),
    ("zero3", "zero3", 1, 1, False),
    ("moe pp2", "moe", 4, 2, False),
    ("megatron pp2", "1f1b", 4, 2, False),
    ("1f1b pp4, sends posted", "1f1b", 4, 4, False),
    ("megatron pp4, parity order", "1f1b", 4, 4, True),
    ("interleaved pp4, parity order", "interleaved", 4, 4, True),
    ("interleaved pp8, parity order", "interleaved", 2, 8, True),
    ("megatron pp8, parity order", "1f1b", 4, 8, True),
)
"""(name, workload, tp, pp, combined_p2p) of the layouts judged one by one; "parity order":
Megatron's non-batched p2p (`Workload.combined_p2p`)."""


def by_layout(jobs: int, windows: int, stragglers: int, skew_ms: float,
              ranks: int = 256) -> dict[str, dict[str, Any]]:
    """Per layout (`LAYOUTS`), at `ranks` ranks: `jobs` healthy jobs judged over `windows`
    consecutive windows each (as wide as the supervisor's: `supervisor_windows`), the windows
    with a verdict (stalls apart: observed only) and of which kind; and `stragglers` straggler
    scenarios, recall below and from 1.3x (the right kind and first culprit), and what the
    missed ones got instead."""
    out: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for li, (name, kind, tp, pp, combined) in enumerate(LAYOUTS):
        shape = {"workload": kind, "tp": tp if kind not in ("ddp", "zero3") else None,
                 "pp": pp if kind not in ("ddp", "zero3") else None}
        kinds: Counter[str] = Counter()
        judged = 0
        for j in range(jobs):
            for w in supervisor_windows(ranks, 90_000 + 100 * li + j, windows, skew_ms,
                                        combined_p2p=combined, **shape):
                verdict = diagnose_observation(w.observation())
                judged += 1
                if verdict is not None and verdict.kind.value != "stall":
                    kinds[verdict.kind.value] += 1
        found: dict[str, list[bool]] = {"below_1.3": [], "from_1.3": []}
        instead: Counter[str] = Counter()
        for k in range(stragglers):
            sim = simulate(ranks=ranks, fault="straggler", seed=95_000 + 100 * li + k,
                           skew_ms=skew_ms, combined_p2p=combined, **shape)
            verdict = diagnose_observation(sim.observation())
            hit = verdict is not None and verdict.kind.value == "straggler" and right(sim,
                                                                                       verdict)
            found["from_1.3" if sim.truth.size >= 1.3 else "below_1.3"].append(hit)
            if not hit:
                instead[verdict.kind.value if verdict else "none"] += 1
        out[name] = {
            "healthy_windows": judged, "false_verdicts": sum(kinds.values()),
            "by_kind": dict(sorted(kinds.items())),
            "straggler_recall": {band: {"n": len(hits), "recall": _ratio(sum(hits), len(hits))}
                                 for band, hits in found.items()},
            "stragglers_missed_as": dict(sorted(instead.items())),
        }
        say(f"layout {name}: {sum(kinds.values())} false verdicts in {judged} healthy windows; "
            f"stragglers {out[name]['straggler_recall']} ({time.monotonic() - started:.0f} s)")
    return out


def by_skew(scenarios: list[tuple[str, int, int]]) -> dict[str, dict[str, Any]]:
    """Every class at clock offsets of 0, 5 and 20 ms (the same scenarios each time)."""
    out: dict[str, dict[str, Any]] = {}
    for skew in (0.0, 5.0, 20.0):
        outcomes = [run_one(cls, seed, ranks, skew) for cls, seed, ranks in scenarios]
        result = score(outcomes)
        out[f"{skew:g}"] = {
            "classes": {c: {"top1": m["top1"], "recall": m["recall"],
                            "precision": m["precision"], "n": m["n"]}
                        for c, m in result["classes"].items()},
            "healthy_fp_rate": result["healthy_fp_rate"],
        }
        say(f"skew {skew:g} ms: " + ", ".join(
            f"{c} {m['recall']}" for c, m in out[f"{skew:g}"]["classes"].items()))
    return out


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 3) if den else None


def by_level(outcomes: list[Outcome]) -> dict[str, dict[str, Any]]:
    """Per confidence level: verdicts given, how many named a true culprit first (and of the
    right kind), and that share (the level's measured precision; null without verdicts)."""
    out: dict[str, dict[str, Any]] = {}
    for level in LEVELS:
        mine = [o for o in outcomes
                if o.confidence is not None and level_of(o.confidence) == level]
        right = sum(o.top1_right for o in mine)
        out[level.name] = {
            "floor": level.floor, "verdicts": len(mine), "right": right,
            "right_kind": sum(o.top1_right and o.verdict_kind == o.cls for o in mine),
            "precision": _ratio(right, len(mine)),
        }
    return out


def confusion(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """Per true class: how many verdicts of each kind ("none": no verdict), and how many of the
    right kind named a wrong rank first ("<kind>:wrong_rank")."""
    out: dict[str, dict[str, int]] = {}
    for cls in (*CLASSES, HEALTHY):
        counts: Counter[str] = Counter()
        for o in outcomes:
            if o.cls != cls:
                continue
            kind = o.verdict_kind or "none"
            counts[kind] += 1
            if o.verdict_kind == cls and not o.top1_right:
                counts[f"{kind}:wrong_rank"] += 1
        out[cls] = dict(sorted(counts.items()))
    return out


def by_variant(outcomes: list[Outcome]) -> dict[str, dict[str, str]]:
    """Per class and variant: right verdicts (kind and top-1) out of scenarios."""
    table: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for o in outcomes:
        cell = table[o.cls][o.variant]
        cell[1] += 1
        ok = o.verdict_kind is None if o.cls == HEALTHY else (
            o.verdict_kind == o.cls and o.top1_right)
        cell[0] += ok
    return {cls: {v: f"{a}/{b}" for v, (a, b) in sorted(vs.items())}
            for cls, vs in table.items()}


@contextmanager
def one_core() -> Iterator[None]:
    getter = getattr(os, "sched_getaffinity", None)
    setter = getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:
        yield
        return
    before = getter(0)
    setter(0, {min(before)})
    try:
        yield
    finally:
        setter(0, before)


def analysis_seconds(sizes: tuple[int, ...]) -> dict[str, float]:
    """Wall time of ONE diagnose_observation call per size (healthy window: every detector
    runs to the end), after a warm-up call on a small window."""
    diagnose_observation(simulate(ranks=64, fault=None, seed=1).observation())
    out: dict[str, float] = {}
    for n in sizes:
        sim = simulate(ranks=n, fault=None, seed=7)
        obs = sim.observation()
        rows = len(sim.columns)
        del sim
        gc.collect()
        with one_core():
            started = time.perf_counter()
            diagnose_observation(obs)
            out[str(n)] = round(time.perf_counter() - started, 3)
        say(f"analysis time {n} ranks ({rows} collective rows): {out[str(n)]} s")
        del obs
        gc.collect()
    return out


# -- the store path ---------------------------------------------------------------------------


def store_check(url: str | None) -> dict[str, Any]:
    """One scenario per class (and a healthy one) through a trace store: the store's summaries
    and verdict against the numpy ones over the same windows."""
    store_url = url if url and url != "chdb" else f"chdb://{tempfile.mkdtemp(prefix='th-')}"
    results: list[dict[str, Any]] = []
    store = open_store(store_url)
    try:
        for i, cls in enumerate((*CLASSES, HEALTHY)):
            sim = simulate(ranks=(64, 128, 256)[i % 3], fault=None if cls == HEALTHY else cls,
                           seed=90_000 + i)
            started = time.perf_counter()
            write_to_store(sim, store)
            wrote = time.perf_counter() - started
            window_s = -(-(sim.now_us - sim.window_start_us) // 1_000_000)
            node_window_s = max(1.0, window_s / 4)
            from_store = load_observation(
                store, job=sim.job, attempt=sim.attempt, now_us=sim.now_us,
                window_s=window_s, node_window_s=node_window_s, expected_ranks=sim.rank_nodes,
                min_collectives=0)  # the simulated window as it is: no widening
            from_numpy = numpy_like_store(sim, window_s=window_s, node_window_s=node_window_s)
            same = compare(from_store, from_numpy)
            v_store = diagnose_observation(from_store)
            v_numpy = diagnose_observation(from_numpy)
            agree = (v_store is None and v_numpy is None) or (
                v_store is not None and v_numpy is not None and v_store.kind == v_numpy.kind
                and v_store.culprit_ranks == v_numpy.culprit_ranks)
            results.append({
                "class": cls, "ranks": sim.topology.ranks, "rows": len(sim.columns),
                "write_s": round(wrote, 3), "summaries_equal": same,
                "verdicts_equal": agree, "verdict": v_store.kind.value if v_store else None,
                "right": right(sim, v_store) if cls != HEALTHY else v_store is None,
            })
            say(f"store {cls}: {results[-1]}")
    finally:
        store.close()
    return {"scenarios": results,
            "all_equal": all(r["summaries_equal"] and r["verdicts_equal"] for r in results)}


def numpy_like_store(sim: SimulatedJob, *, window_s: int, node_window_s: float) -> Observation:
    """The observation `load_observation` reads, computed with the numpy summaries (clock
    offsets estimated over the same reach, every summary on the clocks they correct)."""
    end = sim.now_us
    start = end - window_s * 1_000_000
    reach = end - 4 * window_s * 1_000_000
    cols, nodes_of = sim.columns, sim.rank_nodes
    clocks = estimate_clocks(summaries.clock_samples(cols, nodes_of, reach, end,
                                                     clock_bucket_us(reach, end)))
    clock = clocks.correction() if clocks.nodes else None
    nodes = sorted(set(nodes_of.values()))
    found = summaries.disagreements(cols, start, end, uneven_ops=UNEVEN_OPS)
    return Observation(
        snapshot=sim.snapshot(), window_start_us=start, window_end_us=end, clocks=clocks,
        ranks=summaries.rank_stats(cols, start, end, clock=clock, node_of_rank=nodes_of),
        links=summaries.link_stats(cols, start, end, clock=clock, node_of_rank=nodes_of),
        disagreements=tuple(found), disagreements_dropped=found.dropped,
        stacks=tuple(sorted((s for s in sim.stacks if s.time_us >= start),
                            key=lambda s: s.rank)),
        health=tuple(sorted((h for h in window_health(sim.health, start, end)
                             if h.node in nodes), key=lambda h: h.time_us)),
        node_windows=summaries.node_windows(cols, nodes_of, reach, end,
                                            int(node_window_s * 1_000_000), clock=clock),
    )


def compare(a: Observation, b: Observation) -> bool:
    def arrays(x: Any) -> list[Any]:
        return [getattr(x, f) for f in x.__slots__] if x is not None else []

    ok = all(np.allclose(p, q, equal_nan=True) for p, q in
             zip(arrays(a.ranks) + arrays(a.links), arrays(b.ranks) + arrays(b.links),
                 strict=True))
    ok &= set(a.disagreements) == set(b.disagreements)
    if a.node_windows is not None and b.node_windows is not None:
        ok &= a.node_windows.nodes == b.node_windows.nodes and np.allclose(
            a.node_windows.features, b.node_windows.features, equal_nan=True)
    ok &= len(a.stacks) == len(b.stacks) and len(a.health) == len(b.health)
    ok &= len(a.snapshot.heartbeats) == len(b.snapshot.heartbeats)
    return bool(ok)


# -- main ---------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a smaller sample (< 1 minute)")
    parser.add_argument("--store", help="also run the store path: 'chdb' (a temporary embedded "
                                        "store) or a ClickHouse server URL")
    parser.add_argument("--no-timing", action="store_true", help="skip the analysis timings")
    parser.add_argument("--skew-ms", type=float, default=5.0, metavar="MS",
                        help="sigma of the node clock offsets in milliseconds (default 5: "
                             "ordinary NTP)")
    parser.add_argument("--windows", type=int, default=None, metavar="N",
                        help="consecutive healthy windows for the per-window false-positive "
                             "rate (default 1000; 150 with --quick)")
    args = parser.parse_args()
    started = time.monotonic()
    scenarios = plan(args.quick)
    say(f"{len(scenarios)} scenarios, clocks N(0, {args.skew_ms:g} ms)")
    outcomes: list[Outcome] = []
    for i, (cls, seed, ranks) in enumerate(scenarios):
        o = run_one(cls, seed, ranks, args.skew_ms)
        outcomes.append(o)
        mark = "ok" if (o.verdict_kind is None if cls == HEALTHY else
                        o.verdict_kind == cls and o.top1_right) else "MISS"
        say(f"[{i + 1}/{len(scenarios)}] {cls}/{o.variant} {ranks} ranks seed {seed}: "
            f"{o.verdict_kind} named {o.named} (truth {list(o.truth)}) "
            f"{o.seconds:.2f} s {mark}")
    result = score(outcomes)
    result["skew_ms"] = args.skew_ms
    result["bars"] = bars(outcomes)
    result["recall_by_size"] = recall_by_size(outcomes)
    windows = args.windows if args.windows is not None else (150 if args.quick else 1000)
    result["fp_per_window"] = fp_per_window(windows, 31_337, args.skew_ms)
    result["over_time"] = over_time(4 if args.quick else 24, 4_242, args.skew_ms)
    result["by_layout"] = (by_layout(1, 5, 3, args.skew_ms) if args.quick
                           else by_layout(3, 20, 16, args.skew_ms))
    if not args.quick:
        result["by_skew"] = by_skew(scenarios[::3])
    result["analysis_s"] = {} if args.no_timing else analysis_seconds(TIMED_RANKS)
    result["confusion"] = confusion(outcomes)
    result["by_variant"] = by_variant(outcomes)
    result["by_level"] = by_level(outcomes)
    result["scenarios"] = len(outcomes)
    result["quick"] = args.quick
    if args.store:
        result["store"] = store_check(args.store)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    say("confusion (true class -> verdict kinds):")
    for cls, counts in result["confusion"].items():
        say(f"  {cls:12} {counts}")
    say("right verdicts by variant:")
    for cls, variants in result["by_variant"].items():
        say(f"  {cls:12} {variants}")
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result))
    return 0


def table(result: dict[str, Any]) -> str:
    def fmt(x: float | None) -> str:
        return "  -  " if x is None else f"{x:5.2f}"

    lines = [f"{'class':12} {'n':>4} {'top1':>6} {'prec':>6} {'recall':>6}"]
    for cls, m in result["classes"].items():
        lines.append(f"{cls:12} {m['n']:4d} {fmt(m['top1']):>6} {fmt(m['precision']):>6} "
                     f"{fmt(m['recall']):>6}")
    lines.append(f"healthy false-positive rate: {fmt(result['healthy_fp_rate'])} "
                 f"(n={result['healthy_n']}); clocks N(0, {result['skew_ms']:g} ms)")
    for cls, m in result["bars"].items():
        lines.append(f"{cls} from {m['min_size']}x: precision {fmt(m['precision'])}, recall "
                     f"{fmt(m['recall'])} (n={m['n']})")
    lines.append("recall by fault size:")
    for cls, rows in result["recall_by_size"].items():
        cells = ", ".join(f"{r['from']}-{r['to']}x {fmt(r['recall']).strip()} (n={r['n']})"
                          for r in rows if not r.get("unsized"))
        lines.append(f"  {cls:10} {cells}")
    w = result["fp_per_window"]
    lines.append(f"healthy windows with a verdict: {w['verdicts']}/{w['windows']} "
                 f"(rate {w['rate']}; windows of {w['mean_window_s']} s on average, so "
                 f"{w['per_day']} false verdicts per job-day; stalls watched {w['stalls']}); "
                 f"kinds {w['by_kind']}")
    lines.append("over consecutive windows (share named within k windows of the fault's first;"
                 " named twice in a row within k):")
    for cls, m in result["over_time"].items():
        within = " ".join(f"{k}:{fmt(v).strip()}" for k, v in m["named_within"].items())
        twice = " ".join(f"{k}:{fmt(v).strip()}" for k, v in m["named_twice_within"].items())
        lines.append(f"  {cls:10} from {m['min_size']}x (n={m['n']}): named {within}; twice "
                     f"{twice}; wrong culprit in {m['wrong_culprit_windows']}/{m['windows']} "
                     "windows")
    for skew, m in result.get("by_skew", {}).items():
        lines.append(f"at {skew} ms: " + ", ".join(
            f"{c} {fmt(v['recall']).strip()}" for c, v in m["classes"].items())
            + f", healthy fp {fmt(m['healthy_fp_rate']).strip()}")
    lines.append("precision by confidence level (first culprit right):")
    lines.append(f"  {'level':8} {'floor':>5} {'verdicts':>8} {'right':>6} {'prec':>6}")
    for name, m in result["by_level"].items():
        lines.append(f"  {name:8} {m['floor']:5.2f} {m['verdicts']:8d} {m['right']:6d} "
                     f"{fmt(m['precision']):>6}")
    for n, s in result["analysis_s"].items():
        lines.append(f"diagnose_observation at {n} ranks: {s:.3f} s")
    if "store" in result:
        lines.append(f"store path agrees with numpy path: {result['store']['all_equal']}")
    lines.append(f"{result['scenarios']} scenarios in {result['elapsed_s']} s")
    for name, m in result.get("by_layout", {}).items():
        rec = m["straggler_recall"]
        lines.append(f"layout {name}: {m['false_verdicts']} false verdicts in "
                     f"{m['healthy_windows']} healthy windows; stragglers >= 1.3x "
                     f"{fmt(rec['from_1.3']['recall']).strip()} (n={rec['from_1.3']['n']}), "
                     f"below {fmt(rec['below_1.3']['recall']).strip()} "
                     f"(n={rec['below_1.3']['n']})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
