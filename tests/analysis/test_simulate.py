"""The simulator: deterministic, a sane topology, and every fault shows the symptom it should.

Small jobs only (64..256 ranks); nothing here measures time.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import load_observation
from tracehound.analysis.sim import (
    FAULT_KINDS,
    SimulatedJob,
    Topology,
    simulate,
    write_to_store,
)
from tracehound.analysis.sim.reference import rank_stats
from tracehound.tracing.events import HealthSeverity, Heartbeat, IncidentKind
from tracehound.tracing.store import TraceStore
from tracehound.tracing.summaries import NodeWindows

S = 1_000_000
HANG_AFTER_US = 5 * S
SILENT_AFTER_US = int(2.5 * S)


def pending(sim: SimulatedJob) -> dict[int, list[tuple[str, int, str, int]]]:
    """rank -> [(group, seq, op, waited_us)] of the ops it waits in at its last heartbeat."""
    out: dict[int, list[tuple[str, int, str, int]]] = {}
    for hb in sim.heartbeats:
        for g in hb.groups:
            if g.pending_op:
                out.setdefault(hb.rank, []).append(
                    (g.group, g.last_enqueued, g.pending_op, hb.time_us - g.last_enqueue_us))
    return out


def beat(sim: SimulatedJob, rank: int) -> Heartbeat:
    return next(hb for hb in sim.heartbeats if hb.rank == rank)


def tp_durations(sim: SimulatedJob) -> dict[str, float]:
    """TP group -> mean time from the last member's arrival to completion of its collectives."""
    c = sim.columns
    spans: dict[tuple[str, int], list[int]] = {}
    for g, s, e, done in zip(c.group.tolist(), c.seq.tolist(), c.enqueue_us.tolist(),
                             c.complete_us.tolist(), strict=True):
        if g.startswith("tp-"):
            span = spans.setdefault((g, s), [0, 0])
            span[0], span[1] = max(span[0], e), max(span[1], done)
    out: dict[str, list[int]] = {}
    for (g, _), (last, done) in spans.items():
        out.setdefault(g, []).append(done - last)
    return {g: float(np.mean(v)) for g, v in out.items()}


def stalled_ranks(sim: SimulatedJob) -> set[int]:
    return {r for r, waits in pending(sim).items() if any(w >= HANG_AFTER_US for *_, w in waits)}


# -- determinism and shape ------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [None, *FAULT_KINDS])
def test_same_seed_same_job(fault: IncidentKind | None) -> None:
    a = simulate(ranks=64, fault=fault, seed=11)
    b = simulate(ranks=64, fault=fault, seed=11)
    assert a.truth == b.truth and a.now_us == b.now_us
    for name in a.columns.__slots__:
        assert np.array_equal(getattr(a.columns, name), getattr(b.columns, name)), name
    assert a.heartbeats == b.heartbeats
    assert a.exits == b.exits and a.stacks == b.stacks and a.health == b.health
    c = simulate(ranks=64, fault=fault, seed=12)
    assert not np.array_equal(a.columns.enqueue_us[:100], c.columns.enqueue_us[:100])


def test_topology_and_groups() -> None:
    sim = simulate(ranks=128, fault=None, seed=3, tp=4, pp=2)
    topo = sim.topology
    assert (topo.tp, topo.pp, topo.dp, topo.nodes) == (4, 2, 16, 16)
    groups = {g.group: g.ranks for g in sim.groups}
    assert groups["0"] == tuple(range(128))
    kinds = Counter(name.split("-")[0] if ":p2p:" not in name else "p2p" for name in groups)
    assert kinds == {"0": 1, "tp": 32, "dp": 8, "pp": 64, "p2p": 64}
    for name, ranks in groups.items():
        if name.startswith("tp-"):
            assert len(ranks) == 4 and len({sim.rank_nodes[r] for r in ranks}) == 1
        elif ":p2p:" in name:
            low, high = ranks
            assert name == f"{topo.pp_group(low)}:p2p:{low}-{high}"
            assert topo.pp_group(low) == topo.pp_group(high)
            assert topo.coords(high)[0] == topo.coords(low)[0] + 1
            assert sim.rank_nodes[low] != sim.rank_nodes[high]
        elif name.startswith("dp-"):
            assert len(ranks) == 16 and len({topo.coords(r)[0] for r in ranks}) == 1
    # Every rank is in exactly one group of each kind (besides its pairs).
    for rank in range(128):
        mine = [n for n, rs in groups.items() if rank in rs and ":p2p:" not in n]
        assert sorted(n.split("-")[0] for n in mine) == ["0", "dp", "pp", "tp"]
        assert {g.group for g in beat(sim, rank).groups} >= set(mine)
    assert sim.rank_nodes[0] == "node-0000" and sim.rank_nodes[127] == "node-0015"


def test_bad_topologies_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 8"):
        Topology(ranks=100, tp=8, pp=1)
    with pytest.raises(ValueError, match="tp=3"):
        Topology(ranks=64, tp=3, pp=1)
    with pytest.raises(ValueError, match="pp >= 2"):
        simulate(ranks=64, fault="slow_link", seed=1, pp=1)
    with pytest.raises(ValueError, match="cannot simulate"):
        simulate(ranks=64, fault="node_outlier", seed=1)


def test_events_are_consistent() -> None:
    sim = simulate(ranks=128, fault=None, seed=5, tp=8, pp=2)
    c = sim.columns
    assert len(c) > 0
    assert (c.complete_us >= c.enqueue_us).all()
    assert (c.enqueue_us >= sim.window_start_us).all() and (c.complete_us <= sim.now_us).all()
    # One row per member per (group, seq), with the same op, size and dtype.
    groups = {g.group: g.ranks for g in sim.groups}
    keys = Counter(zip(c.group.tolist(), c.seq.tolist(), strict=True))
    complete = [n == len(groups[g]) for (g, _), n in keys.items()]
    assert sum(complete) / len(complete) > 0.9  # the rest are still running at now_us
    p2p = np.char.find(c.group, ":p2p:") >= 0
    assert set(c.op[p2p].tolist()) == {"send", "recv"}
    assert (c.peer[~p2p] == -1).all() and (c.peer[p2p] >= 0).all()
    hb_times = np.array([hb.time_us for hb in sim.heartbeats])
    assert (sim.now_us - hb_times <= S // 2).all()
    steps = {hb.step for hb in sim.heartbeats}
    assert max(steps) - min(steps) <= 1


def test_observation_shapes() -> None:
    sim = simulate(ranks=128, fault=None, seed=8, tp=8, pp=2)
    obs = sim.observation()
    assert obs.window_end_us == sim.now_us and obs.snapshot.now_us == sim.now_us
    assert obs.ranks is not None and obs.ranks.rank.tolist() == list(range(128))
    assert obs.links is not None and len(obs.links.src) == 2 * 64  # both directions per pair
    nw = obs.node_windows
    assert isinstance(nw, NodeWindows)
    assert nw.features.shape == (4, 16, len(NodeWindows.FEATURES))
    assert len(obs.snapshot.heartbeats) == 128 and obs.snapshot.expected_ranks[127] == "node-0015"
    assert {h.metric for h in obs.health} >= {"temperature_c", "sm_clock_mhz"}
    later = sim.observation(window_us=(sim.now_us - sim.window_start_us) // 2)
    assert later.window_start_us > obs.window_start_us
    assert later.ranks is not None and later.ranks.n.sum() < obs.ranks.n.sum()


# -- each fault shows its symptom -----------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_healthy_runs_have_no_symptom(seed: int) -> None:
    sim = simulate(ranks=128, fault=None, seed=seed)
    assert sim.truth.kind is None and not sim.truth.culprit_ranks
    assert sim.exits == () and sim.stacks == ()
    assert all(w < S for waits in pending(sim).values() for *_, w in waits)
    assert all(sim.now_us - hb.time_us <= S // 2 for hb in sim.heartbeats)
    obs = sim.observation()
    assert obs.disagreements == ()
    assert all(h.severity is not HealthSeverity.CRITICAL for h in sim.health)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_hang_stops_everyone_behind_the_culprit(seed: int) -> None:
    sim = simulate(ranks=128, fault="hang", seed=seed)
    culprit = sim.truth.culprit_ranks[0]
    stalled = stalled_ranks(sim)
    assert culprit not in stalled and len(stalled) > 64
    me = beat(sim, culprit)
    tp_peers = {g.group: g.last_enqueued for g in beat(sim, culprit ^ 1).groups}
    mine = {g.group: g.last_enqueued for g in me.groups}
    group = sim.topology.tp_group(culprit)
    if sim.truth.variant == "compute_stuck":
        assert sim.now_us - me.time_us <= S // 2  # it still reports
        assert not any(g.pending_op for g in me.groups)
        assert mine[group] < tp_peers[group]  # its TP peers entered an op it never reached
    else:
        assert sim.truth.variant == "sigstop"
        assert sim.now_us - me.time_us > SILENT_AFTER_US
    assert sim.exits == ()
    assert len(sim.stacks) == 128


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_crash_exits_first_then_its_peers(seed: int) -> None:
    sim = simulate(ranks=128, fault="crash", seed=seed)
    culprit = sim.truth.culprit_ranks[0]
    assert sim.exits[0].rank == culprit and sim.exits[0].exit_code != 0
    times = [e.time_us for e in sim.exits]
    assert times == sorted(times)
    if len(sim.exits) > 1:
        assert sim.exits[1].time_us - sim.exits[0].time_us >= 15_000
        assert {e.exit_code for e in sim.exits[1:]} <= {1, -15}
    failed = ~sim.columns.completed
    assert set(sim.columns.rank[failed].tolist()) <= {e.rank for e in sim.exits if e.exit_code == 1}
    assert culprit not in sim.columns.rank[failed]


@pytest.mark.parametrize("variant", ["op_hang", "size", "dtype", "skip"])
def test_mismatch_shows_in_events_or_pending_ops(variant: str) -> None:
    sim = simulate(ranks=128, fault="mismatch", seed=4, variant=variant)
    culprit = sim.truth.culprit_ranks[0]
    obs = sim.observation()
    if variant == "op_hang":
        waits = pending(sim)
        group, seq, op, _ = waits[culprit][0]
        members = next(g.ranks for g in sim.groups if g.group == group)
        others = [next(w for w in waits[r] if w[0] == group) for r in members if r != culprit]
        assert {(g, s) for g, s, _, _ in others} == {(group, seq)}
        assert {o for _, _, o, _ in others} == {"all_reduce"} and op != "all_reduce"
        assert obs.disagreements == ()
        return
    (d,) = obs.disagreements
    i = d.ranks.index(culprit)
    rows = list(zip(d.ops, d.nbytes, d.dtypes, strict=True))
    assert Counter(rows)[rows[i]] == 1 and len(set(rows)) == 2
    if variant == "dtype":
        assert d.dtypes[i] == "float32"
    if variant == "skip":
        assert len(stalled_ranks(sim)) > 0


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_straggler_arrives_last(seed: int) -> None:
    sim = simulate(ranks=128, fault="straggler", seed=seed)
    culprit = sim.truth.culprit_ranks[0]
    stats = sim.observation().ranks
    assert stats is not None
    i = int(np.searchsorted(stats.rank, culprit))
    assert stats.last_count[i] == stats.last_count.max()
    tp = [int(np.searchsorted(stats.rank, r)) for r in range(culprit - culprit % 8,
                                                                  culprit - culprit % 8 + 8)]
    assert stats.lateness_mean_us[i] >= stats.lateness_mean_us[tp].max() - 1e-9
    assert sim.exits == () and not stalled_ranks(sim)


@pytest.mark.parametrize("variant", ["pair", "node"])
def test_slow_link_transfers_are_slower(variant: str) -> None:
    sim = simulate(ranks=128, fault="slow_link", seed=2, variant=variant)
    links = sim.observation().links
    assert links is not None
    ratio = links.transfer_mean_us / np.median(links.transfer_mean_us)
    if variant == "pair":
        assert sim.truth.link is not None
        lo, hi = sim.truth.link
        mine = ((links.src == lo) & (links.dst == hi)) | ((links.src == hi) & (links.dst == lo))
        assert mine.sum() == 2 and ratio[mine].min() > 1.4
        assert ratio[~mine].max() < ratio[mine].min()
    else:
        node = set(sim.topology.node_ranks(int(sim.truth.culprit_nodes[0][5:])))
        touches = np.isin(links.src, list(node)) | np.isin(links.dst, list(node))
        assert ratio[touches].min() > 1.3 and ratio[~touches].max() < ratio[touches].min()


@pytest.mark.parametrize("variant", ["thermal", "xid_hang", "nvlink_slow", "nvlink_hang"])
def test_hardware_fault_has_a_health_event_and_a_symptom(variant: str) -> None:
    sim = simulate(ranks=128, fault="hardware", seed=5, variant=variant)
    node = sim.truth.culprit_nodes[0]
    events = [h for h in sim.health if h.severity is not HealthSeverity.INFO]
    assert node in {h.node for h in events}
    # Elsewhere at most a benign warning (a red herring), never a critical event.
    assert all(h.severity is HealthSeverity.WARNING for h in events if h.node != node)
    culprit = sim.truth.culprit_ranks[0]
    assert sim.rank_nodes[culprit] == node
    if variant in ("xid_hang", "nvlink_hang"):
        assert any(h.severity is HealthSeverity.CRITICAL and h.metric == "xid" for h in events)
        assert stalled_ranks(sim)
    else:
        stats = sim.observation().ranks
        assert stats is not None and not stalled_ranks(sim)
        if variant == "thermal":
            assert stats.last_count[culprit] == stats.last_count.max()
        else:  # the node's TP collectives take longer (some of it hides in pipeline bubbles)
            took = tp_durations(sim)
            mine = {sim.topology.tp_group(r) for r in sim.topology.node_ranks(int(node[5:]))}
            assert min(took[g] for g in mine) > 2 * max(
                us for g, us in took.items() if g not in mine)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_silent_hang_is_localized_only_by_stacks(seed: int) -> None:
    sim = simulate(ranks=128, fault="silent_hang", seed=seed)
    waits = pending(sim)
    assert len(waits) == 128  # everybody waits...
    assert {(g, s) for ws in waits.values() for g, s, _, _ in ws} == {
        ("0", next(iter(waits.values()))[0][1])}  # ...in the same world collective
    assert all(sim.now_us - hb.time_us <= S // 2 for hb in sim.heartbeats)  # nobody is silent
    assert sim.exits == () and sim.observation().disagreements == ()
    frames = Counter(s.frames for s in sim.stacks)
    dominant = frames.most_common(1)[0][0]
    culprits = set(sim.truth.culprit_ranks)
    for s in sim.stacks:
        assert (s.frames != dominant) or s.rank not in culprits
        if s.rank in culprits:
            assert not any("all_reduce" in f for f in s.frames)


# -- into the analysis and into the store ---------------------------------------------------------


@pytest.mark.parametrize("fault", [None, *FAULT_KINDS])
def test_diagnosis_names_the_injected_fault(fault: IncidentKind | None) -> None:
    """Three seeded scenarios per class through `diagnose_observation`: at least two must get
    the right kind and a right first culprit (healthy: no verdict). The bench measures rates."""
    right = 0
    for seed in (1, 2, 3):
        sim = simulate(ranks=128, fault=fault, seed=seed)
        verdict = diagnose_observation(sim.observation())
        if fault is None:
            right += verdict is None
        elif verdict is not None and verdict.kind == fault:
            rank = verdict.culprit_ranks[0]
            right += sim.truth.accepts(rank, sim.rank_nodes[rank])
    assert right >= 2


def test_the_store_path_gives_the_same_observation(store: TraceStore) -> None:
    sim = simulate(ranks=64, fault="hang", seed=2)
    write_to_store(sim, store)
    window_s = -(-(sim.now_us - sim.window_start_us) // S)
    obs = load_observation(store, job=sim.job, attempt=sim.attempt, now_us=sim.now_us,
                           window_s=window_s, expected_ranks=sim.rank_nodes)
    start = sim.now_us - window_s * S
    ref = rank_stats(sim.columns, start, sim.now_us)
    assert obs.ranks is not None
    assert np.array_equal(obs.ranks.rank, ref.rank) and np.array_equal(obs.ranks.n, ref.n)
    assert np.allclose(obs.ranks.lateness_mean_us, ref.lateness_mean_us)
    assert len(obs.snapshot.heartbeats) == 64 and len(obs.stacks) == 64
    assert sorted(obs.snapshot.heartbeats, key=lambda hb: hb.rank) == sorted(
        sim.heartbeats, key=lambda hb: hb.rank)
    from_store = diagnose_observation(obs)
    from_numpy = diagnose_observation(sim.observation())
    assert from_store is not None and from_numpy is not None
    assert (from_store.kind, from_store.culprit_ranks) == (
        from_numpy.kind, from_numpy.culprit_ranks)
