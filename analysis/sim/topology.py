"""Where the ranks of a simulated job sit and which process groups they form.

Ranks are laid out Megatron-style: tensor parallel (TP) within a node, data parallel (DP)
replicas, pipeline (PP) stages across nodes. `GroupLayout` names every process group the way the
recorder does and gives each one an id (its gid) that the engine and the fault drawing index by.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from tracehound.tracing.summaries import I64

WORLD_GROUP = "0"
"""The id the recorder gives the default (world) process group."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Ranks laid out Megatron-style: tp fastest, then dp, then pp (rank = (p*dp + d)*tp + t)."""

    ranks: int
    tp: int
    pp: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.ranks < 16 or self.ranks % self.gpus_per_node:
            raise ValueError(f"ranks must be >= 16 and a multiple of {self.gpus_per_node}, "
                             f"got {self.ranks}")
        if self.gpus_per_node % self.tp or self.ranks % (self.tp * self.pp):
            raise ValueError(f"tp={self.tp} must divide {self.gpus_per_node} and tp*pp must "
                             f"divide ranks={self.ranks}")

    @property
    def dp(self) -> int:
        return self.ranks // (self.tp * self.pp)

    @property
    def nodes(self) -> int:
        return self.ranks // self.gpus_per_node

    def grid(self) -> I64:
        """Global ranks as [pp, dp, tp]."""
        return np.arange(self.ranks, dtype=np.int64).reshape(self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(stage, replica, tp index) of a rank."""
        return rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp

    def node_of(self, rank: int) -> str:
        return node_name(rank // self.gpus_per_node)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return tuple(range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node))

    def device(self, rank: int) -> str:
        """The GPU a rank drives, as the health sources name it."""
        return f"gpu{rank % self.gpus_per_node}"

    def tp_group(self, rank: int) -> str:
        return f"tp-{rank // self.tp}"

    def dp_group(self, rank: int) -> str:
        stage, _, t = self.coords(rank)
        return f"dp-{stage * self.tp + t}"

    def pp_group(self, rank: int) -> str:
        _, d, t = self.coords(rank)
        return f"pp-{d * self.tp + t}"

    def p2p_group(self, a: int, b: int) -> str:
        """The pair group the recorder names for a send/recv between a and b."""
        return f"{self.pp_group(a)}:p2p:{min(a, b)}-{max(a, b)}"


def node_name(index: int) -> str:
    return f"node-{index:04d}"


def default_topology(ranks: int, rng: np.random.Generator, *, need_pp: bool = False) -> Topology:
    """A plausible layout for `ranks`: TP 8 (sometimes 4) within a node, PP 1..4."""
    tp = 8 if rng.random() < 0.7 else 4
    stages = [p for p in (1, 2, 4) if ranks % (tp * p) == 0 and ranks // (tp * p) >= 2]
    if need_pp:
        stages = [p for p in stages if p >= 2] or stages
    return Topology(ranks=ranks, tp=tp, pp=int(rng.choice(stages)))


class Family(enum.IntEnum):
    """The kinds of process group that communicate, each with its own sequence numbers."""

    TP = 0
    DP = 1
    P2P = 2
    WORLD = 3


NO_FAMILY = -1
"""The family of a pipeline group: it only holds the p2p pair groups and never communicates."""


class GroupLayout:
    """Every process group of a topology. A group's gid indexes `names`, `members` and
    `family`; the gid arrays give the group of each TP, DP, PP and p2p position (-1: none)."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.grid = topo.grid()
        self.names: list[str] = []
        self.members: list[I64] = []
        self.world_gid = self._add(WORLD_GROUP, np.arange(topo.ranks, dtype=np.int64))
        self.tp_gid = self._tp_groups()
        self.dp_gid = self._dp_groups()
        self.pp_gid, self.p2p_gid = self._pipeline_groups()
        self.family = self._families()

    def _add(self, name: str, ranks: I64) -> int:
        self.names.append(name)
        self.members.append(ranks)
        return len(self.names) - 1

    def _tp_groups(self) -> I64:
        """[pp, dp]: the TP group of each replica of each stage (none when tp == 1)."""
        topo, grid = self.topo, self.grid
        gids = np.full((topo.pp, topo.dp), -1, dtype=np.int64)
        if topo.tp > 1:
            for p in range(topo.pp):
                for d in range(topo.dp):
                    gids[p, d] = self._add(topo.tp_group(int(grid[p, d, 0])), grid[p, d])
        return gids

    def _dp_groups(self) -> I64:
        """[pp, tp]: the DP group of each TP position of each stage."""
        topo, grid = self.topo, self.grid
        gids = np.full((topo.pp, topo.tp), -1, dtype=np.int64)
        for p in range(topo.pp):
            for t in range(topo.tp):
                gids[p, t] = self._add(topo.dp_group(int(grid[p, 0, t])), grid[p, :, t])
        return gids

    def _pipeline_groups(self) -> tuple[I64, I64]:
        """[dp, tp] pipeline groups and [pp - 1, dp, tp] pair groups between neighbouring
        stages (none with a single stage)."""
        topo, grid = self.topo, self.grid
        pp_gid = np.full((topo.dp, topo.tp), -1, dtype=np.int64)
        p2p_gid = np.full((max(topo.pp - 1, 0), topo.dp, topo.tp), -1, dtype=np.int64)
        if topo.pp == 1:
            return pp_gid, p2p_gid
        for d in range(topo.dp):
            for t in range(topo.tp):
                pp_gid[d, t] = self._add(topo.pp_group(int(grid[0, d, t])), grid[:, d, t])
        for b in range(topo.pp - 1):
            for d in range(topo.dp):
                for t in range(topo.tp):
                    lo, hi = int(grid[b, d, t]), int(grid[b + 1, d, t])
                    p2p_gid[b, d, t] = self._add(topo.p2p_group(lo, hi),
                                                 np.array([lo, hi], dtype=np.int64))
        return pp_gid, p2p_gid

    def _families(self) -> I64:
        family = np.empty(len(self.names), dtype=np.int64)
        family[self.world_gid] = Family.WORLD
        family[self.tp_gid[self.tp_gid >= 0]] = Family.TP
        family[self.dp_gid.ravel()] = Family.DP
        family[self.pp_gid[self.pp_gid >= 0]] = NO_FAMILY
        family[self.p2p_gid.ravel()] = Family.P2P
        return family

    def rank_slots(self) -> I64:
        """Per rank, the groups it belongs to: world, tp, dp, pp, p2p to the previous and to
        the next stage (-1 where there is none)."""
        topo = self.topo
        r = np.arange(topo.ranks, dtype=np.int64)
        stage, d, t = r // (topo.tp * topo.dp), (r // topo.tp) % topo.dp, r % topo.tp
        slots = np.full((topo.ranks, 6), -1, dtype=np.int64)
        slots[:, 0] = self.world_gid
        slots[:, 1] = self.tp_gid[stage, d]
        slots[:, 2] = self.dp_gid[stage, t]
        if topo.pp > 1:
            slots[:, 3] = self.pp_gid[d, t]
            prev, nxt = stage > 0, stage < topo.pp - 1
            slots[prev, 4] = self.p2p_gid[stage[prev] - 1, d[prev], t[prev]]
            slots[nxt, 5] = self.p2p_gid[stage[nxt], d[nxt], t[nxt]]
        return slots
