"""Where the ranks of a simulated job sit and which process groups they form.

Ranks are laid out Megatron-style: tensor parallel (TP) within a node, data parallel (DP)
replicas, pipeline (PP) stages across nodes, expert parallel (EP) groups among the replicas of
a MoE job. `GroupLayout` creates the process groups as the job would and names them as the
recorder does: `torch.distributed` numbers groups in creation order ("0" the world, then "1",
"2", ...), every rank creates every group (also those it is not in), and Megatron creates many
groups that never carry a collective after setup (gloo twins, context parallel, embedding,
model parallel, amax groups). Point-to-point pairs keep the recorder's name
`<pipeline group>:p2p:<low>-<high>`. A plain DDP or ZeRO-3 job without Megatron has only the
world group. Each group also gets an index (its gid) that the engine and the fault drawing use.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tracehound.tracing.summaries import I64

WORLD_GROUP = "0"
"""The id the recorder gives the default (world) process group."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Ranks laid out Megatron-style: tp fastest, then dp, then pp (rank = (p*dp + d)*tp + t).

    `ep`: ranks per expert parallel group (consecutive DP replicas of one stage and TP index;
    1 without experts). `vp`: model chunks per rank of an interleaved pipeline (1 otherwise).
    `megatron`: whether the job builds Megatron's process groups (False: only the world)."""

    ranks: int
    tp: int
    pp: int
    gpus_per_node: int = 8
    ep: int = 1
    vp: int = 1
    megatron: bool = True

    def __post_init__(self) -> None:
        if self.gpus_per_node not in (4, 8):
            raise ValueError(f"gpus_per_node must be 4 or 8, got {self.gpus_per_node}")
        if self.ranks < 16 or self.ranks % self.gpus_per_node:
            raise ValueError(f"ranks must be >= 16 and a multiple of {self.gpus_per_node}, "
                             f"got {self.ranks}")
        if self.tp < 1 or self.gpus_per_node % self.tp or self.ranks % (self.tp * self.pp):
            raise ValueError(f"tp={self.tp} must divide {self.gpus_per_node} and tp*pp must "
                             f"divide ranks={self.ranks}")
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}")
        if self.vp < 1 or (self.vp > 1 and self.pp < 2):
            raise ValueError(f"an interleaved pipeline (vp={self.vp}) needs pp >= 2")
        if not self.megatron and (self.tp, self.pp, self.ep) != (1, 1, 1):
            raise ValueError("a job without Megatron groups has tp = pp = ep = 1")

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

    def node_index(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def node_of(self, rank: int) -> str:
        return node_name(rank // self.gpus_per_node)

    def node_ranks(self, node: int) -> tuple[int, ...]:
        return tuple(range(node * self.gpus_per_node, (node + 1) * self.gpus_per_node))

    def device(self, rank: int) -> str:
        """The GPU a rank drives, as the health sources name it."""
        return f"gpu{rank % self.gpus_per_node}"

    def nic(self, rank: int) -> str:
        """The NIC of a rank's GPU (one per GPU), as the health sources name it."""
        return f"mlx5_{rank % self.gpus_per_node}"


def node_name(index: int) -> str:
    return f"node-{index:04d}"


def default_topology(ranks: int, rng: np.random.Generator, *, need_pp: bool = False) -> Topology:
    """A plausible Megatron layout for `ranks`: TP 8 (sometimes 4) within a node, PP 1..4."""
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
    EP = 4


NO_FAMILY = -1
"""The family of a group that never communicates after setup (a pipeline group only holds the
p2p pair groups; gloo, embedding, amax, ... groups sit idle)."""


class GroupLayout:
    """Every process group of a topology, in creation order. A group's gid indexes `names`,
    `members`, `roles`, `backends` and `family`; the gid arrays give the group of each TP, DP,
    PP, EP and p2p position (-1: none). `roles` says what each group is for ("world", "tp",
    "dp", "pp", "p2p", "ep", or the idle kinds: "dp-gloo", "cp", "mp", "embedding", ...)."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.grid = topo.grid()
        self.names: list[str] = []
        self.members: list[I64] = []
        self.roles: list[str] = []
        self.backends: list[str] = []
        pp, dp, tp = topo.pp, topo.dp, topo.tp
        self.tp_gid = np.full((pp, dp), -1, dtype=np.int64)
        self.dp_gid = np.full((pp, tp), -1, dtype=np.int64)
        self.pp_gid = np.full((dp, tp), -1, dtype=np.int64)
        self.ep_gid = np.full((pp, dp // topo.ep, tp), -1, dtype=np.int64)
        boundaries = pp if topo.vp > 1 else max(pp - 1, 0)
        self.p2p_gid = np.full((boundaries, dp, tp), -1, dtype=np.int64)
        """[boundary, dp, tp]: the pair between stage b and b + 1 (the last boundary of an
        interleaved pipeline wraps from the last stage to the first)."""
        self.world_gid = self._add("world", np.arange(topo.ranks, dtype=np.int64))
        if topo.megatron:
            self._megatron_groups()
        else:
            self.dp_gid[0, 0] = self.world_gid
        self._pairs()
        self.family = self._families()

    def _add(self, role: str, ranks: I64, backend: str = "nccl") -> int:
        gid = len(self.names)
        self.names.append(str(gid))  # numbered groups come before any pair group
        self.members.append(np.asarray(ranks, dtype=np.int64))
        self.roles.append(role)
        self.backends.append(backend)
        return gid

    def _megatron_groups(self) -> None:
        """Megatron's `initialize_model_parallel` order: for each kind, the groups of every
        rank (data parallel with gloo twins, the same with context parallel, context parallel,
        model parallel, tensor parallel, pipeline with embedding groups, the amax groups,
        then the expert groups)."""
        topo, grid = self.topo, self.grid
        pp, dp, tp = topo.pp, topo.dp, topo.tp
        for p in range(pp):
            for t in range(tp):
                self.dp_gid[p, t] = self._add("dp", grid[p, :, t])
                self._add("dp-gloo", grid[p, :, t], "gloo")
        for p in range(pp):
            for t in range(tp):
                self._add("dp-cp", grid[p, :, t])
                self._add("dp-cp-gloo", grid[p, :, t], "gloo")
        for r in range(topo.ranks):
            self._add("cp", np.array([r]))
        for d in range(dp):
            self._add("mp", grid[:, d, :].ravel())
        for p in range(pp):
            for d in range(dp):
                gid = self._add("tp", grid[p, d])
                if tp > 1:
                    self.tp_gid[p, d] = gid
        for d in range(dp):
            for t in range(tp):
                ranks = grid[:, d, t]
                self.pp_gid[d, t] = self._add("pp", ranks)
                self._add("embedding", ranks[[0, -1]] if pp > 1 else ranks)
                self._add("position-embedding", ranks[:1])
        for p in range(pp):
            self._add("tp-dp-cp", grid[p].ravel())
            self._add("tp-dp", grid[p].ravel())
        for p in range(pp):
            for d in range(dp):
                self._add("tp-cp", grid[p, d])
        if topo.ep > 1:
            self._expert_groups()

    def _expert_groups(self) -> None:
        """Expert parallel groups (consecutive replicas), then the expert data parallel ones."""
        topo, grid = self.topo, self.grid
        ep = topo.ep
        for p in range(topo.pp):
            for e in range(topo.dp // ep):
                for t in range(topo.tp):
                    self.ep_gid[p, e, t] = self._add("ep", grid[p, e * ep:(e + 1) * ep, t])
        for p in range(topo.pp):
            for j in range(ep):
                for t in range(topo.tp):
                    ranks = grid[p, j::ep, t]
                    self._add("expert-dp", ranks)
                    self._add("expert-dp-gloo", ranks, "gloo")

    def _pairs(self) -> None:
        """The pair groups the recorder names for sends and receives between stages."""
        topo, grid = self.topo, self.grid
        for b in range(self.p2p_gid.shape[0]):
            nxt = (b + 1) % topo.pp
            if b > 0 and nxt == b - 1:  # two stages: the wrap-around pair is the same pair
                self.p2p_gid[b] = self.p2p_gid[nxt]
                continue
            for d in range(topo.dp):
                for t in range(topo.tp):
                    a, c = int(grid[b, d, t]), int(grid[nxt, d, t])
                    lo, hi = min(a, c), max(a, c)
                    gid = len(self.names)
                    self.names.append(f"{self.names[self.pp_gid[d, t]]}:p2p:{lo}-{hi}")
                    self.members.append(np.array([lo, hi], dtype=np.int64))
                    self.roles.append("p2p")
                    self.backends.append("p2p")
                    self.p2p_gid[b, d, t] = gid

    def _families(self) -> I64:
        family = np.full(len(self.names), NO_FAMILY, dtype=np.int64)
        family[self.tp_gid[self.tp_gid >= 0]] = Family.TP
        family[self.dp_gid[self.dp_gid >= 0]] = Family.DP
        family[self.ep_gid[self.ep_gid >= 0]] = Family.EP
        family[self.p2p_gid.ravel()] = Family.P2P
        family[self.pp_gid[self.pp_gid >= 0]] = NO_FAMILY
        family[self.world_gid] = Family.WORLD
        return family

    def name_of(self, role: str, rank: int) -> str:
        """The id of the group of `role` that `rank` belongs to (KeyError when none)."""
        for gid in self.gids_of(rank):
            if self.roles[gid] == role:
                return self.names[gid]
        raise KeyError(f"rank {rank} has no {role} group")

    def gids_of(self, rank: int) -> Iterator[int]:
        for gid, members in enumerate(self.members):
            if (members == rank).any():
                yield gid

    def dp_groups(self) -> tuple[I64, I64]:
        """The gradient groups as [G, K] ranks and their gids (the world for a job without
        Megatron groups)."""
        topo = self.topo
        if not topo.megatron:
            return np.arange(topo.ranks, dtype=np.int64)[None, :], np.array([self.world_gid])
        groups = self.grid.transpose(0, 2, 1).reshape(topo.pp * topo.tp, topo.dp)
        return groups, self.dp_gid.ravel()

    def ep_groups(self, stage: int) -> tuple[I64, I64]:
        """The expert parallel groups of `stage` as [G, ep] ranks and their gids."""
        topo = self.topo
        ep = topo.ep
        g = self.grid[stage].reshape(topo.dp // ep, ep, topo.tp).transpose(0, 2, 1)
        return g.reshape(-1, ep), self.ep_gid[stage].ravel()

    def rank_slots(self) -> I64:
        """Per rank, the groups it communicates in: world, tp, dp, pp, p2p to the previous and
        to the next stage, the wrap-around pair of an interleaved pipeline, ep (-1: none)."""
        topo = self.topo
        r = np.arange(topo.ranks, dtype=np.int64)
        stage, d, t = r // (topo.tp * topo.dp), (r // topo.tp) % topo.dp, r % topo.tp
        slots = np.full((topo.ranks, 8), -1, dtype=np.int64)
        slots[:, 0] = self.world_gid
        if topo.megatron:
            slots[:, 1] = self.tp_gid[stage, d]
            slots[:, 2] = self.dp_gid[stage, t]
        if topo.pp > 1:
            slots[:, 3] = self.pp_gid[d, t]
            prev, nxt = stage > 0, stage < topo.pp - 1
            slots[prev, 4] = self.p2p_gid[stage[prev] - 1, d[prev], t[prev]]
            slots[nxt, 5] = self.p2p_gid[stage[nxt], d[nxt], t[nxt]]
            if topo.vp > 1 and topo.pp > 2:
                ends = (stage == 0) | (stage == topo.pp - 1)
                slots[ends, 6] = self.p2p_gid[topo.pp - 1, d[ends], t[ends]]
        if topo.ep > 1:
            slots[:, 7] = self.ep_gid[stage, d // topo.ep, t]
        return slots
