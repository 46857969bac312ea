"""Small jobs played operation by operation, summarized by the numpy reference of the window
summaries: observations whose busy, blame and link columns mean what the store's do.

`Player` keeps one clock per rank and records every operation as a trace row (enqueue when the
rank issues it, completion when its last member is there plus the transfer): compute moves a
rank's clock, a blocking collective or transfer holds it until completion, a non-blocking one
(a DDP gradient bucket) runs on the rank's communication stream after what it issued before.
`ddp` and `megatron` play the two shapes of job the straggler rule must handle: gradient
buckets overlapping the backward, and tensor x data x pipeline parallel under GPipe. Seeded;
the fault (slow ranks, pauses, slow links) is put in by hand.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from observation_builders import T0, observe, snapshot

from tracehound.analysis.observation import Observation
from tracehound.analysis.sim.reference import link_stats, rank_stats
from tracehound.tracing.summaries import F64, CollectiveColumns


@dataclass
class Player:
    ranks: int
    seed: int = 0
    jitter: float = 0.03
    slow: Mapping[int, float] = field(default_factory=dict)
    """Rank -> compute time multiplier."""
    pauses: Mapping[tuple[int, int], float] = field(default_factory=dict)
    """(rank, step) -> a pause (us) in the rank's first compute segment of that step."""
    slow_links: Mapping[tuple[int, int], float] = field(default_factory=dict)
    """(src, dst) -> transfer time multiplier."""
    slow_kernels: bool = False
    """A slow rank's transfers take as much longer as its compute (its kernels start late)."""

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.t: F64 = T0 + self.rng.uniform(0.0, 50.0, self.ranks)
        self.stream: F64 = self.t.copy()
        self.step = 0
        self.paused: set[tuple[int, int]] = set()
        self.seqs: dict[str, int] = {}
        self.rows: list[tuple[int, str, int, str, float, float]] = []

    def compute(self, ranks: Sequence[int], us: float) -> None:
        for r in ranks:
            dur = us * self.slow.get(r, 1.0) * float(self.rng.lognormal(0.0, self.jitter))
            if (r, self.step) in self.pauses and (r, self.step) not in self.paused:
                dur += self.pauses[(r, self.step)]
                self.paused.add((r, self.step))
            self.t[r] += dur

    def _seq(self, group: str) -> int:
        self.seqs[group] = self.seqs.get(group, 0) + 1
        return self.seqs[group]

    def collective(self, group: str, members: Sequence[int], us: float, *,
                   block: bool = True) -> None:
        seq = self._seq(group)
        enq = {r: float(self.t[r]) for r in members}
        start = max(max(enq[r], float(self.stream[r])) for r in members)
        done = start + us * float(self.rng.lognormal(0.0, 0.05))
        for r in members:
            comp = done + float(self.rng.uniform(0.0, 8.0))
            self.rows.append((r, group, seq, "all_reduce", enq[r], comp))
            if block:
                self.t[r] = comp
                self.stream[r] = comp
            else:
                self.stream[r] = comp

    def wait_stream(self, ranks: Sequence[int]) -> None:
        for r in ranks:
            self.t[r] = max(self.t[r], self.stream[r])

    def transfer(self, src: int, dst: int, us: float) -> None:
        group = f"pp:p2p:{min(src, dst)}-{max(src, dst)}"
        seq = self._seq(group)
        es, er = float(self.t[src]), float(self.t[dst])
        dur = us * self.slow_links.get((src, dst), 1.0) * float(self.rng.lognormal(0.0, 0.05))
        if self.slow_kernels:
            dur *= max(self.slow.get(src, 1.0), self.slow.get(dst, 1.0))
        done = max(es, er) + dur
        cs, cr = done + float(self.rng.uniform(0, 5)), done + float(self.rng.uniform(0, 5))
        self.rows.append((src, group, seq, "send", es, cs))
        self.rows.append((dst, group, seq, "recv", er, cr))
        self.t[src], self.t[dst] = cs, cr

    def columns(self) -> CollectiveColumns:
        rows = self.rows
        return CollectiveColumns(
            rank=np.array([r[0] for r in rows], dtype=np.int64),
            group=np.array([r[1] for r in rows], dtype=np.str_),
            seq=np.array([r[2] for r in rows], dtype=np.int64),
            op=np.array([r[3] for r in rows], dtype=np.str_),
            nbytes=np.full(len(rows), 1024, dtype=np.int64),
            dtype=np.full(len(rows), "bfloat16", dtype=np.str_),
            peer=np.full(len(rows), -1, dtype=np.int64),
            completed=np.ones(len(rows), dtype=np.bool_),
            enqueue_us=np.array([round(r[4]) for r in rows], dtype=np.int64),
            complete_us=np.array([round(r[5]) for r in rows], dtype=np.int64),
        )


def observation(p: Player, members: Mapping[str, Sequence[int]]) -> Observation:
    """The whole run as one window, summarized like a store summarizes it."""
    cols = p.columns()
    start, end = int(cols.enqueue_us.min()), int(cols.complete_us.max()) + 1
    snap = snapshot(end, p.ranks, members=members)
    return observe(snap, start_us=start, ranks=rank_stats(cols, start, end),
                   links=link_stats(cols, start, end))


def ddp(*, ranks: int = 16, steps: int = 8, buckets: int = 8, step_us: float = 100_000.0,
        comm: float = 0.5, **kw: object) -> Observation:
    """Plain data parallel: forward (a third of the step), backward with a gradient bucket
    all_reduce in the world group issued as each bucket is ready (`comm`: the buckets' total
    transfer time as a share of the backward), a wait for them all, a loss all_reduce."""
    p = Player(ranks, **kw)  # type: ignore[arg-type]
    world = list(range(ranks))
    fwd, bwd = step_us / 3, 2 * step_us / 3
    for step in range(steps):
        p.step = step
        p.compute(world, fwd)
        for _ in range(buckets):
            p.compute(world, bwd / buckets)
            p.collective("world", world, comm * bwd / buckets, block=False)
        p.wait_stream(world)
        p.collective("world", world, 50.0)
    return observation(p, {"world": world})


def layout(tp: int, pp: int, dp: int) -> dict[str, list[int]]:
    """Megatron's groups: rank = (stage * dp + replica) * tp + position."""
    grid = np.arange(tp * pp * dp).reshape(pp, dp, tp)
    out: dict[str, list[int]] = {"world": [int(r) for r in grid.ravel()]}
    for s in range(pp):
        for d in range(dp):
            if tp > 1:
                out[f"tp-{s}-{d}"] = [int(r) for r in grid[s, d]]
        for t in range(tp):
            if dp > 1:
                out[f"dp-{s}-{t}"] = [int(r) for r in grid[s, :, t]]
    for d in range(dp):
        for t in range(tp):
            for s in range(pp - 1):
                a, b = int(grid[s, d, t]), int(grid[s + 1, d, t])
                out[f"pp:p2p:{a}-{b}"] = [a, b]
    return out


def megatron(*, tp: int = 4, pp: int = 4, dp: int = 4, microbatches: int = 4,
             steps: int = 4, fwd_us: float = 10_000.0, tp_us: float = 600.0,
             p2p_us: float = 800.0, dp_us: float = 5_000.0, **kw: object) -> Observation:
    """Tensor x data x pipeline parallel under GPipe: per micro-batch and stage a receive from
    the previous stage, two halves of compute each followed by a TP all_reduce, a send to the
    next; the backward (twice as long) the other way; then the DP all_reduce of each stage and
    position and a world all_reduce."""
    p = Player(tp * pp * dp, **kw)  # type: ignore[arg-type]
    grid = np.arange(tp * pp * dp).reshape(pp, dp, tp)
    groups = layout(tp, pp, dp)

    def block(s: int, us: float) -> None:
        for d in range(dp):
            ranks = [int(r) for r in grid[s, d]]
            for _ in range(2):
                p.compute(ranks, us / 2)
                if tp > 1:
                    p.collective(f"tp-{s}-{d}", ranks, tp_us)

    def hand(src: int, dst: int) -> None:
        for d in range(dp):
            for t in range(tp):
                p.transfer(int(grid[src, d, t]), int(grid[dst, d, t]), p2p_us)

    for step in range(steps):
        p.step = step
        for _ in range(microbatches):
            for s in range(pp):
                block(s, fwd_us)
                if s + 1 < pp:
                    hand(s, s + 1)
        for _ in range(microbatches):
            for s in reversed(range(pp)):
                block(s, 2 * fwd_us)
                if s > 0:
                    hand(s, s - 1)
        for s in range(pp):
            for t in range(tp):
                if dp > 1:
                    p.collective(f"dp-{s}-{t}", [int(r) for r in grid[s, :, t]], dp_us)
        p.collective("world", groups["world"], 100.0)
    return observation(p, groups)
