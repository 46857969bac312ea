"""Node clock offsets and drift estimated from the trace, against known offsets.

The jobs here are built event by event with a known true time for everything, then every
timestamp is written on its node's clock: offset (up to +/-50 ms) plus drift (up to +/-20 ppm).
The estimate must recover the offsets, and the summaries computed on the corrected clocks must
equal those of the unskewed trace to within the estimate's error.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tracehound.analysis.clocks import NO_CLOCKS, clock_bucket_us, estimate_clocks
from tracehound.analysis.detect import detect_crash
from tracehound.analysis.settings import DetectionSettings
from tracehound.analysis.sim import reference
from tracehound.analysis.snapshot import JobSnapshot
from tracehound.analysis.verdict import Fact
from tracehound.tracing.events import RankExit
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore
from tracehound.tracing.summaries import ClockSamples, CollectiveColumns

T0 = 1_800_000_000_000_000
PER_NODE = 4


@dataclasses.dataclass(frozen=True)
class Trace:
    true: CollectiveColumns
    skewed: CollectiveColumns
    node_of_rank: dict[int, str]
    offset_us: dict[str, float]
    """At T0."""
    drift_ppm: dict[str, float]
    start_us: int
    end_us: int


def node_clock(node_of_rank: dict[int, str], offset_us: dict[str, float],
               drift_ppm: dict[str, float], rank: np.ndarray, t: np.ndarray) -> np.ndarray:
    off = np.array([offset_us[node_of_rank[int(r)]] for r in rank])
    drift = np.array([drift_ppm[node_of_rank[int(r)]] for r in rank])
    return np.rint(t + off + drift * (t - T0) / 1e6).astype(np.int64)


def build_trace(seed: int, *, nodes: int = 12, steps: int = 400, skew_ms: float = 50.0,
                drift: float = 20.0, straggler: int | None = None) -> Trace:
    """A data-parallel job: per step every rank computes (jitter, a straggler 1.5x), then an
    all_reduce over all ranks and one over each node's ranks; a pipeline-like send/recv pair
    between node i and i+1 per step."""
    rng = np.random.default_rng(seed)
    ranks = nodes * PER_NODE
    node_of_rank = {r: f"node-{r // PER_NODE:02d}" for r in range(ranks)}
    names = sorted(set(node_of_rank.values()))
    offset = {n: float(rng.uniform(-skew_ms, skew_ms) * 1000) for n in names}
    drifts = {n: float(rng.uniform(-drift, drift)) for n in names}
    rows: dict[str, list] = {k: [] for k in ("rank", "group", "seq", "op", "nbytes", "enq",
                                             "comp")}
    t = np.full(ranks, float(T0))

    def add(rank: int, group: str, seq: int, op: str, enq: float, comp: float) -> None:
        for key, value in (("rank", rank), ("group", group), ("seq", seq), ("op", op),
                           ("nbytes", 1024), ("enq", enq), ("comp", comp)):
            rows[key].append(value)

    for step in range(steps):
        work = 20_000.0 * rng.lognormal(0.0, 0.03, ranks)
        if straggler is not None:
            work[straggler] *= 1.5
        t += work
        done = t.max() + 300.0 * rng.lognormal(0.0, 0.1)
        for r in range(ranks):
            add(r, "0", step + 1, "all_reduce", t[r], done + rng.uniform(0, 8))
        t[:] = done + 8
        for n in range(nodes):
            members = list(range(n * PER_NODE, (n + 1) * PER_NODE))
            t[members] += rng.uniform(50, 150, PER_NODE)
            end = t[members].max() + 40
            for r in members:
                add(r, str(1 + n), step + 1, "all_reduce", t[r], end + rng.uniform(0, 4))
            t[members] = end + 4
        for n in range(nodes - 1):
            a, b = n * PER_NODE, (n + 1) * PER_NODE
            go = max(t[a], t[b])
            end = go + 200.0
            group = f"9:p2p:{a}-{b}"
            add(a, group, step + 1, "send", t[a], end + rng.uniform(0, 5))
            add(b, group, step + 1, "recv", t[b], end + rng.uniform(0, 5))
            t[a], t[b] = end + 5, end + 5
    rank = np.array(rows["rank"], dtype=np.int64)
    enq = np.rint(np.array(rows["enq"])).astype(np.int64)
    comp = np.rint(np.array(rows["comp"])).astype(np.int64)
    true = CollectiveColumns(
        rank=rank, group=np.array(rows["group"], dtype=np.str_),
        seq=np.array(rows["seq"], dtype=np.int64), op=np.array(rows["op"], dtype=np.str_),
        nbytes=np.array(rows["nbytes"], dtype=np.int64),
        dtype=np.full(rank.shape[0], "float32", dtype=np.str_),
        peer=np.full(rank.shape[0], -1, dtype=np.int64),
        completed=np.ones(rank.shape[0], dtype=np.bool_), enqueue_us=enq, complete_us=comp)
    skewed = dataclasses.replace(
        true, enqueue_us=node_clock(node_of_rank, offset, drifts, rank, enq.astype(float)),
        complete_us=node_clock(node_of_rank, offset, drifts, rank, comp.astype(float)))
    return Trace(true=true, skewed=skewed, node_of_rank=node_of_rank, offset_us=offset,
                 drift_ppm=drifts, start_us=T0 - 200_000, end_us=int(t.max()) + 200_000)


def estimate(trace: Trace) -> tuple[float, float, float, object]:
    """(worst offset error us, worst drift error ppm, worst stated uncertainty us, estimate);
    offsets are relative, so both sides are compared after removing their median."""
    samples = reference.clock_samples(trace.skewed, trace.node_of_rank, trace.start_us,
                                      trace.end_us, clock_bucket_us(trace.start_us,
                                                                    trace.end_us))
    est = estimate_clocks(samples)
    truth = np.array([trace.offset_us[n] + trace.drift_ppm[n] * (est.ref_us - T0) / 1e6
                      for n in est.nodes])
    got = np.array(est.offset_us)
    error = (got - np.median(got)) - (truth - np.median(truth))
    error -= np.median(error)
    drift_error = (np.array(est.drift_ppm) - np.median(est.drift_ppm)) - (
        np.array([trace.drift_ppm[n] for n in est.nodes])
        - np.median([trace.drift_ppm[n] for n in est.nodes]))
    drift_error -= np.median(drift_error)
    return (float(np.abs(error).max()), float(np.abs(drift_error).max()),
            est.worst_uncertainty_us(), est)


@pytest.mark.parametrize(("seed", "skew_ms", "drift"), [(1, 50.0, 20.0), (2, 20.0, 5.0),
                                                        (3, 5.0, 1.0), (4, 0.0, 0.0)])
def test_offsets_and_drift_are_recovered(seed: int, skew_ms: float, drift: float) -> None:
    trace = build_trace(seed, skew_ms=skew_ms, drift=drift)
    worst, worst_drift, stated, est = estimate(trace)
    print(f"skew +/-{skew_ms} ms, drift +/-{drift} ppm: worst offset error {worst:.1f} us, "
          f"worst drift error {worst_drift:.2f} ppm, stated uncertainty up to {stated:.1f} us")
    assert len(est.nodes) == 12  # type: ignore[attr-defined]
    assert worst <= 30.0
    assert worst_drift <= 2.0


def test_summaries_on_corrected_clocks_match_the_unskewed_trace() -> None:
    trace = build_trace(5, skew_ms=30.0, drift=10.0, straggler=6)
    est = estimate(trace)[3]
    clock = est.correction()  # type: ignore[attr-defined]
    args = (trace.start_us, trace.end_us)
    raw = reference.rank_stats(trace.skewed, *args)
    fixed = reference.rank_stats(trace.skewed, *args, clock=clock,
                                 node_of_rank=trace.node_of_rank)
    true = reference.rank_stats(trace.true, *args)
    # On the skewed clocks the node that reads latest looks like the straggler; corrected, the
    # real one is last everywhere, as in the unskewed trace.
    assert int(true.rank[np.argmax(true.last_count)]) == 6
    assert int(fixed.rank[np.argmax(fixed.last_count)]) == 6
    assert np.abs(fixed.lateness_mean_us - true.lateness_mean_us).max() < 60.0
    assert np.abs(raw.lateness_mean_us - true.lateness_mean_us).max() > 1_000.0
    links_true = reference.link_stats(trace.true, *args)
    links_fixed = reference.link_stats(trace.skewed, *args, clock=clock,
                                       node_of_rank=trace.node_of_rank)
    assert np.abs(links_fixed.transfer_mean_us - links_true.transfer_mean_us).max() < 60.0


def test_a_window_whose_calls_complete_past_its_end_keeps_the_drift_of_its_own_buckets() -> None:
    """Read as of a moment before the newest records (a replay as of the median rank's last
    report), the calls entered just before that moment complete after it. Their few samples
    are no bucket of their own: they once were, and a node's drift was fitted to them (a
    simulated 1,024-rank pipeline straggler read its node's links as 4.8x slow through a drift
    of 1,700 ppm fitted that way)."""
    trace = build_trace(5, skew_ms=20.0, drift=5.0)
    cut = trace.start_us + (trace.end_us - trace.start_us) * 9 // 10
    width = clock_bucket_us(trace.start_us, cut)
    samples = reference.clock_samples(trace.skewed, trace.node_of_rank, trace.start_us, cut,
                                      width)
    assert samples.bucket.max() == (cut - 1 - trace.start_us) // width
    est = estimate_clocks(samples)
    assert max(abs(d) for d in est.drift_ppm) < 20.0


def test_a_node_seen_in_one_bucket_has_no_drift() -> None:
    """Its slope cannot be told from its offset; it is 0, and its offset is what it showed."""
    rows = [("0", "a", 0, 0.0), ("0", "b", 0, 0.0), ("0", "a", 1, 0.0), ("0", "b", 1, 0.0),
            ("0", "c", 1, 900.0)]
    samples = ClockSamples(
        group=np.array([r[0] for r in rows], dtype=np.str_),
        node=np.array([r[1] for r in rows], dtype=np.str_),
        bucket=np.array([r[2] for r in rows], dtype=np.int64),
        offset_us=np.array([r[3] for r in rows], dtype=np.float64),
        n=np.full(len(rows), 10, dtype=np.int64), start_us=T0, width_us=1_000_000)
    est = estimate_clocks(samples)
    c = est.nodes.index("c")
    assert est.drift_ppm[c] == 0.0
    assert est.offset_us[c] == pytest.approx(900.0, abs=1.0)


def test_no_samples_no_estimate() -> None:
    empty = ClockSamples(group=np.zeros(0, np.str_), node=np.zeros(0, np.str_),
                         bucket=np.zeros(0, np.int64), offset_us=np.zeros(0),
                         n=np.zeros(0, np.int64), start_us=0, width_us=1)
    assert estimate_clocks(empty) == NO_CLOCKS


def exit_of(rank: int, node: str, time_us: int, code: int) -> RankExit:
    return RankExit(job=JobId("j"), attempt=0, node=NodeId(node), rank=Rank(rank),
                    time_us=time_us, exit_code=code, pid=100 + rank)


def test_crash_order_uses_the_common_clock() -> None:
    """Rank 4 on node-01 died first (true time T0); rank 0's peer failure followed 30 ms later,
    but node-00's clock reads 45 ms behind node-01's: on the raw clocks rank 0 looks first."""
    trace = build_trace(6, skew_ms=0.0, drift=0.0)
    skew = {"node-00": -25_000.0, "node-01": 20_000.0}
    offset = {n: skew.get(n, 0.0) for n in trace.offset_us}
    skewed = dataclasses.replace(
        trace.skewed,
        enqueue_us=node_clock(trace.node_of_rank, offset, dict.fromkeys(offset, 0.0),
                              trace.true.rank, trace.true.enqueue_us.astype(float)),
        complete_us=node_clock(trace.node_of_rank, offset, dict.fromkeys(offset, 0.0),
                               trace.true.rank, trace.true.complete_us.astype(float)))
    est = estimate_clocks(reference.clock_samples(
        skewed, trace.node_of_rank, trace.start_us, trace.end_us,
        clock_bucket_us(trace.start_us, trace.end_us)))
    died = trace.end_us
    exits = (exit_of(4, "node-01", died + 20_000, -9), exit_of(0, "node-00", died + 5_000, 1))
    snap = JobSnapshot(job=JobId("j"), attempt=0, now_us=died + 5_000_000, heartbeats=(),
                       exits=exits)
    settings = DetectionSettings()
    naive = detect_crash(snap, settings)
    assert naive is not None and naive.culprit_ranks == (0,)
    verdict = detect_crash(snap, settings, est)
    assert verdict is not None and verdict.culprit_ranks == (4,)
    assert any(e.fact is Fact.CLOCK and "node-01" in e.detail for e in verdict.evidence)


# --- through a store: load_observation estimates the clocks and corrects every summary ------


def test_load_observation_corrects_clocks_and_widens_sparse_windows(store: TraceStore) -> None:
    """Steps of about 2 s leave the median rank 10 collectives in a 10 s window: the window
    widens until it holds at least 24, and lateness is measured on corrected clocks."""
    from tracehound.analysis.observation import load_observation

    trace = build_trace(7, nodes=4, steps=40, skew_ms=40.0, drift=5.0, straggler=5)
    # stretch every step to ~2 s (each step is 20 ms of compute), then skew the clocks
    stretch = 100
    truth = dataclasses.replace(
        trace.true,
        enqueue_us=T0 + (trace.true.enqueue_us - T0) * stretch,
        complete_us=T0 + (trace.true.complete_us - T0) * stretch)
    skewed = dataclasses.replace(truth, **{
        name: node_clock(trace.node_of_rank, trace.offset_us, trace.drift_ppm, truth.rank,
                         getattr(truth, name).astype(float))
        for name in ("enqueue_us", "complete_us")})
    store.insert_columns(JobId("clocked"), 0, skewed, trace.node_of_rank, batch_id="b")
    end = int(truth.complete_us.max()) + 1
    obs = load_observation(store, job=JobId("clocked"), attempt=0, now_us=end, window_s=10.0,
                           expected_ranks=trace.node_of_rank)
    assert obs.ranks is not None and obs.clocks is not None
    width_s = (obs.window_end_us - obs.window_start_us) / 1e6
    print(f"window widened to {width_s:.0f} s; median collectives per rank "
          f"{np.median(obs.ranks.n):.0f}")
    assert width_s > 10.0
    assert np.median(obs.ranks.n) >= 24
    spread = max(trace.offset_us.values()) - min(trace.offset_us.values())
    assert obs.clocks.spread_us() == pytest.approx(spread, abs=stretch * 20.0)
    want = reference.rank_stats(truth, obs.window_start_us, obs.window_end_us)
    assert obs.ranks.rank.tolist() == want.rank.tolist()
    # stretched steps stretch the noise too: within a few stretched microseconds
    assert np.abs(obs.ranks.lateness_mean_us - want.lateness_mean_us).max() < stretch * 60.0
    assert int(obs.ranks.rank[np.argmax(obs.ranks.last_count)]) == 5
    # From `since_us` on only (an attempt's warm-up ends there): the window widens up to it,
    # not past it (41 s above), and holds none of the collectives before it.
    since = end - 30_000_000
    late = load_observation(store, job=JobId("clocked"), attempt=0, now_us=end, window_s=10.0,
                            expected_ranks=trace.node_of_rank, since_us=since)
    assert obs.window_start_us < since == late.window_start_us
    later = load_observation(store, job=JobId("clocked"), attempt=0, now_us=end, window_s=10.0,
                             expected_ranks=trace.node_of_rank, since_us=end - 4_000_000)
    assert later.window_start_us == end - 4_000_000
    assert late.ranks is not None and later.ranks is not None
    assert np.median(later.ranks.n) < np.median(late.ranks.n) < np.median(obs.ranks.n)
