"""Hand-built observations for the detector tests: small, seeded, with the fault put in by hand.

`arrivals` plays a tensor-parallel x data-parallel job step by step (compute, then a collective
that completes when its last member arrives) and summarizes it exactly as `tracing.summaries`
defines RankStats and NodeWindows, so the tests feed the detectors the numbers a real window
gives, healthy timing noise included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from tracehound.analysis.observation import Observation
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.tracing.events import (
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    ProcessGroupInfo,
    ProcessSample,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.summaries import LinkStats, NodeWindows, RankStats

S = 1_000_000
T0 = 1_700_000_000 * S
GPUS_PER_NODE = 8


def node_of(rank: int) -> str:
    return f"node-{rank // GPUS_PER_NODE}"


def groups(tp: int, ranks: int) -> dict[str, list[int]]:
    """TP groups of consecutive ranks (one node when tp = 8) and DP groups across them."""
    grid = np.arange(ranks).reshape(-1, tp)
    out = {f"tp-{i}": [int(r) for r in row] for i, row in enumerate(grid)}
    out.update({f"dp-{j}": [int(r) for r in col] for j, col in enumerate(grid.T)})
    return out


def group_infos(members: Mapping[str, Sequence[int]]) -> tuple[ProcessGroupInfo, ...]:
    return tuple(
        ProcessGroupInfo(job=JobId("j"), attempt=0, rank=Rank(min(ms)), group=GroupId(g),
                         ranks=tuple(ms), backend="nccl", time_us=T0)
        for g, ms in members.items()
    )


def progress(group: str, enq: int, comp: int, *, enq_us: int, op: str = "all_reduce"
             ) -> GroupProgress:
    return GroupProgress(
        group=GroupId(group), last_enqueued=enq, last_completed=comp,
        pending_op=op if enq > comp else "", last_enqueue_us=enq_us, last_complete_us=enq_us,
    )


def beat(rank: int, at_us: int, *gs: GroupProgress, step: int = 10, step_us: int = 0,
         start_step: int = 0, first_step_us: int = T0) -> Heartbeat:
    return Heartbeat(
        job=JobId("j"), attempt=0, node=NodeId(node_of(rank)), rank=Rank(rank), time_us=at_us,
        pid=1000 + rank, step=step, step_us=step_us or at_us, start_step=start_step,
        first_step_us=first_step_us, dropped=0, groups=gs,
    )


def snapshot(now_us: int, ranks: int, beats: Sequence[Heartbeat] = (),
             members: Mapping[str, Sequence[int]] | None = None) -> JobSnapshot:
    return JobSnapshot(
        job=JobId("j"), attempt=0, now_us=now_us, heartbeats=tuple(beats),
        groups=group_infos(members or {}),
        expected_ranks={r: node_of(r) for r in range(ranks)},
    )


def observe(snap: JobSnapshot, *, start_us: int | None = None, **parts: object) -> Observation:
    return Observation(
        snapshot=snap, window_start_us=start_us if start_us is not None else snap.now_us - 60 * S,
        window_end_us=snap.now_us, **parts,  # type: ignore[arg-type]
    )


def health(node: str, metric: str, at_us: int, *,
           severity: HealthSeverity = HealthSeverity.CRITICAL, value: float = 79.0,
           device: str = "gpu3", detail: str = "") -> HealthSample:
    return HealthSample(job=JobId("j"), node=NodeId(node), device=device, time_us=at_us,
                        source="simulated", metric=metric, value=value, severity=severity,
                        detail=detail)


def stack(rank: int, *frames: str, at_us: int = T0) -> StackSample:
    return StackSample(job=JobId("j"), attempt=0, node=NodeId(node_of(rank)), rank=Rank(rank),
                       time_us=at_us, frames=("train.py:10 main", "train.py:50 step", *frames))


@dataclass(frozen=True)
class Arrivals:
    ranks: RankStats
    node_windows: NodeWindows
    start_us: int
    end_us: int


def arrivals(
    *,
    ranks: int = 64,
    tp: int = 8,
    steps: int = 30,
    tp_per_step: int = 7,
    compute_us: float = 10_000.0,
    jitter: float = 0.025,
    slow: Mapping[int, float] | None = None,
    spikes: int = 3,
    windows: int = 6,
    seed: int = 0,
) -> Arrivals:
    """A job of `ranks` ranks: per step `tp_per_step` TP all_reduces then one DP all_reduce, each
    after a compute segment of `compute_us` x the rank's `slow` factor x (1 + N(0, jitter)), plus
    `spikes` random pauses of 100-400 ms; collectives complete 300 us after the last arrival."""
    rng = np.random.default_rng(seed)
    speed = np.ones(ranks)
    for r, f in (slow or {}).items():
        speed[r] = f
    grid = np.arange(ranks).reshape(-1, tp)
    kinds = [grid] * tp_per_step + [grid.T]
    total = steps * len(kinds)
    spike_at = {(int(rng.integers(total)), int(rng.integers(ranks))): float(rng.uniform(1e5, 4e5))
                for _ in range(spikes)}
    t = np.zeros(ranks)
    enq_rows, late_rows, last_rows, wait_rows = [], [], [], []
    k = 0
    for _ in range(steps):
        for grp in kinds:
            compute = compute_us * speed * (1.0 + jitter * rng.standard_normal(ranks))
            for (kk, r), pause in spike_at.items():
                if kk == k:
                    compute[r] += pause
            enq = t + compute
            e = enq[grp]
            first, last = e.min(axis=1, keepdims=True), e.max(axis=1, keepdims=True)
            done = last + 300.0
            late = np.zeros(ranks)
            is_last = np.zeros(ranks)
            wait = np.zeros(ranks)
            late[grp] = e - first
            is_last[grp] = e == last
            wait[grp] = done - e
            t = np.zeros(ranks)
            t[grp] = np.broadcast_to(done, grp.shape)
            enq_rows.append(enq)
            late_rows.append(late)
            last_rows.append(is_last)
            wait_rows.append(wait)
            k += 1
    enq_a, late_a = np.array(enq_rows), np.array(late_rows)
    last_a, wait_a = np.array(last_rows), np.array(wait_rows)
    end = float(t.max())
    stats = RankStats(
        rank=np.arange(ranks, dtype=np.int64), n=np.full(ranks, total, dtype=np.int64),
        lateness_mean_us=late_a.mean(axis=0), last_count=last_a.sum(axis=0).astype(np.int64),
        wait_mean_us=wait_a.mean(axis=0),
        span_us=(enq_a.max(axis=0) - enq_a.min(axis=0)).astype(np.int64),
    )
    # per node and window: rows of the node's ranks whose enqueue falls in the window
    width = end / windows
    bucket = np.minimum((enq_a // width).astype(np.int64), windows - 1)
    nodes = ranks // GPUS_PER_NODE
    node_idx = np.arange(ranks) // GPUS_PER_NODE
    feats = np.full((windows, nodes, 3), np.nan)
    for w in range(windows):
        for nd in range(nodes):
            sel = (bucket == w) & (node_idx == nd)[None, :]
            if sel.any():
                feats[w, nd] = (late_a[sel].mean(), last_a[sel].mean(), wait_a[sel].mean())
    nw = NodeWindows(
        nodes=tuple(node_of(nd * GPUS_PER_NODE) for nd in range(nodes)),
        window_start_us=T0 + (np.arange(windows) * width).astype(np.int64), features=feats,
    )
    return Arrivals(ranks=stats, node_windows=nw, start_us=T0, end_us=T0 + int(end))


def links(rows: Sequence[tuple[int, int, float]], *, n: int = 24, max_factor: float = 1.2
          ) -> LinkStats:
    """LinkStats from (src, dst, mean transfer us) rows, each over `n` transfers."""
    rows = sorted(rows)
    mean = np.array([m for *_, m in rows])
    return LinkStats(
        src=np.array([s for s, *_ in rows], dtype=np.int64),
        dst=np.array([d for _, d, _ in rows], dtype=np.int64),
        n=np.full(len(rows), n, dtype=np.int64), transfer_mean_us=mean,
        transfer_max_us=mean * max_factor,
    )


def proc(rank: int, state: str, at_us: int, *, cpu_rate: float = 0.0,
         io_rate: float = 0.0) -> ProcessSample:
    """The node agent's sample of a rank's process: its state letter (`T` stopped, `S`
    sleeping, ...) and its CPU and I/O rates."""
    return ProcessSample(
        job=JobId("j"), attempt=0, node=NodeId(node_of(rank)), rank=Rank(rank), pid=1000 + rank,
        time_us=at_us, state=state, cpu_s=10.0, cpu_rate=cpu_rate, read_bytes=0,
        write_bytes=0, io_rate=io_rate,
    )
