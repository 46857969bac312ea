"""Node clock offsets and drift, estimated from the trace itself.

Lateness, last arrivals, transfer times and exit order compare timestamps written by different
nodes; an ordinary NTP-synced cluster has nodes milliseconds apart, which is more than a slow
link or a straggler adds. The members of a collective without a root (all_reduce, all_gather,
reduce_scatter, all_to_all, barrier) and both ends of a point-to-point transfer leave it within
a short interval of each other, so their completion times, read on their own clocks, differ by
about their clocks' offsets.

The store reports per (group, node, time bucket) the median distance of the node's completions
from its collectives' centers (`tracing.summaries.ClockSamples`): d[g, n] = o[n] - b[g] plus
noise, where o is the node's offset and b the offset of group g's center (the median member of
each collective: unknown, different per group). Per bucket the offsets are the robust
least-squares solution of that bipartite system (alternating weighted means with Huber weights,
anchored so that the median node sits at 0: only differences matter); across buckets a line per
node gives its offset at the reference time and its drift. The uncertainty of a node is its
residual spread over the square root of its samples, plus how far its buckets stray from its
line.

Nodes no collective links to the others get no estimate from the trace; where their node agent
measured its clock against the collector (`ClockReading`, from the round trips of its
shipments), that reading stands in (`with_readings`). Nodes with neither stay uncorrected.
Pure numpy; no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from tracehound.tracing.events import ClockReading
from tracehound.tracing.summaries import F64, I64, ClockCorrection, ClockSamples

_HUBER_US = 200.0
"""Residuals beyond this many microseconds weigh less (a late completion: a network hiccup, a
descheduled thread)."""
_FLOOR_US = 5.0
"""No estimate is claimed to be better than this."""


@dataclass(frozen=True, slots=True)
class ClockEstimate:
    """Estimated clock offset and drift per node, for one window."""

    ref_us: int
    """The time (on the common clock) the offsets are given at."""
    nodes: tuple[str, ...]
    offset_us: tuple[float, ...]
    """How far each node's clock reads ahead of the common clock at ref_us."""
    drift_ppm: tuple[float, ...]
    uncertainty_us: tuple[float, ...]
    samples: tuple[int, ...]
    """How many completions each node's estimate rests on (0: from its agent's reading)."""

    def correction(self) -> ClockCorrection:
        return ClockCorrection(
            ref_us=self.ref_us, nodes=self.nodes, offset_us=self.offset_us,
            drift=tuple(d * 1e-6 for d in self.drift_ppm),
        )

    def of(self, node: str) -> tuple[float, float] | None:
        """(offset_us, uncertainty_us) of a node, None when it has no estimate."""
        try:
            i = self.nodes.index(node)
        except ValueError:
            return None
        return self.offset_us[i], self.uncertainty_us[i]

    def spread_us(self) -> float:
        """The largest offset difference between two nodes (0 without estimates)."""
        return float(max(self.offset_us) - min(self.offset_us)) if self.offset_us else 0.0

    def worst_uncertainty_us(self) -> float:
        return float(max(self.uncertainty_us)) if self.uncertainty_us else 0.0

    def words(self, node: str) -> str:
        """`clock +12.35 ms (+/- 0.02 ms)` or `clock unknown`."""
        known = self.of(node)
        if known is None:
            return "clock offset unknown"
        offset, err = known
        agent = " by its agent" if self.samples[self.nodes.index(node)] == 0 else ""
        return f"clock {offset / 1000:+.2f} ms (+/- {err / 1000:.2f} ms){agent}"


def clock_bucket_us(start_us: int, end_us: int) -> int:
    """The width of the time buckets clock samples are taken in over [start_us, end_us): four
    buckets (so drift shows), none shorter than a second."""
    return max(1_000_000, -(-(end_us - start_us) // 4))


NO_CLOCKS = ClockEstimate(ref_us=0, nodes=(), offset_us=(), drift_ppm=(), uncertainty_us=(),
                          samples=())


def _solve(samples: ClockSamples, *, group: I64, node: I64, x: F64, n_nodes: int,
           n_cells: int, sloped: npt.NDArray[np.bool_]) -> tuple[F64, F64, F64, F64]:
    """Per node the offset a (at x = 0) and slope s, with d ~ a[node] + s[node] * x - b[cell]
    (cell: the row's group and bucket), by least squares reweighted for outliers (Huber),
    anchored so that the median node has offset and slope 0; a node not `sloped` (its rows'
    x all 0) keeps slope 0. Returns (a, s, residuals, weights)."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.linalg import lsqr

    rows = len(samples)
    d = samples.offset_us
    base = samples.n.astype(np.float64)
    weight = base.copy()
    idx = np.arange(rows)
    # columns: a (n_nodes), s (n_nodes), b (n_cells); two anchor rows keep the sums at 0
    a = s = np.zeros(n_nodes)
    residual = np.zeros(rows)
    for _ in range(4):
        root = np.sqrt(weight)
        data = np.concatenate([root, root * x, -root, np.full(n_nodes, 1e3),
                               np.where(sloped, 1e3, 0.0)])
        r = np.concatenate([idx, idx, idx, np.full(n_nodes, rows), np.full(n_nodes, rows + 1)])
        c = np.concatenate([node, n_nodes + node, 2 * n_nodes + group, np.arange(n_nodes),
                            n_nodes + np.arange(n_nodes)])
        matrix = coo_matrix((data, (r, c)), shape=(rows + 2, 2 * n_nodes + n_cells)).tocsr()
        rhs = np.concatenate([root * d, np.zeros(2)])
        solution = lsqr(matrix, rhs, atol=1e-12, btol=1e-12, iter_lim=20_000)[0]
        a, s = solution[:n_nodes], solution[n_nodes:2 * n_nodes]
        b = solution[2 * n_nodes:]
        residual = d - (a[node] + s[node] * x - b[group])
        weight = base * np.minimum(1.0, _HUBER_US / np.maximum(np.abs(residual), 1e-9))
    slope = (np.where(sloped, s - float(np.median(s[sloped])), 0.0) if sloped.any()
             else np.zeros(n_nodes))
    return a - float(np.median(a)), slope, residual, weight


def estimate_clocks(samples: ClockSamples) -> ClockEstimate:
    """Per-node offset (at the window's middle), drift and uncertainty from clock samples (see
    the module docstring); `NO_CLOCKS` when there are none."""
    if len(samples) == 0:
        return NO_CLOCKS
    node_names, ncode = np.unique(samples.node, return_inverse=True)
    ncode = ncode.reshape(-1).astype(np.int64)
    cells, ccode = np.unique(
        np.char.add(np.char.add(samples.group.astype(np.str_), "\x00"),
                    samples.bucket.astype(np.str_)), return_inverse=True)
    ccode = ccode.reshape(-1).astype(np.int64)
    n_nodes = node_names.shape[0]
    lo, hi = int(samples.bucket.min()), int(samples.bucket.max())
    ref = int(samples.start_us + (lo + hi + 1) / 2.0 * samples.width_us)
    centers = samples.start_us + (samples.bucket.astype(np.float64) + 0.5) * samples.width_us
    # a node seen in one bucket only has no slope to speak of: its rows leave its slope at 0
    first = np.full(n_nodes, np.iinfo(np.int64).max)
    last = np.full(n_nodes, np.iinfo(np.int64).min)
    np.minimum.at(first, ncode, samples.bucket)
    np.maximum.at(last, ncode, samples.bucket)
    sloped = last > first
    x = np.where(sloped[ncode], (centers - ref) / 1e6, 0.0)  # seconds from ref
    a, slope, residual, weight = _solve(samples, group=ccode, node=ncode, x=x, n_nodes=n_nodes,
                                         n_cells=cells.shape[0], sloped=sloped)
    total = np.bincount(ncode, weights=samples.n.astype(np.float64), minlength=n_nodes)
    rms = np.sqrt(np.bincount(ncode, weights=weight * residual**2, minlength=n_nodes)
                  / np.maximum(np.bincount(ncode, weights=weight, minlength=n_nodes), 1e-9))
    error = np.maximum(_FLOOR_US, 2.0 * rms / np.sqrt(np.maximum(
        np.bincount(ncode, minlength=n_nodes), 1)))
    return ClockEstimate(
        ref_us=ref, nodes=tuple(str(n) for n in node_names),
        offset_us=tuple(round(float(v), 3) for v in a),
        drift_ppm=tuple(round(float(v), 4) for v in slope),
        uncertainty_us=tuple(round(float(v), 3) for v in error),
        samples=tuple(int(v) for v in total),
    )


READING_SLACK_US = 100.0
"""Added to half a reading's round trip: the collector's own clock reading and scheduling."""


def with_readings(estimate: ClockEstimate, readings: Sequence[ClockReading],
                  *, now_us: int) -> ClockEstimate:
    """The estimate completed with the node agents' own clock readings (`ClockReading`: the
    offset against the collector from a shipment's round trip) for nodes the trace gives no
    estimate for. Readings are moved into the estimate's frame by the median difference over
    the nodes both know; with no estimate at all they are the estimate, centered on their
    median."""
    known = set(estimate.nodes)
    extra = [r for r in readings if str(r.node) not in known]
    if not extra:
        return estimate
    common = [(estimate.offset_us[estimate.nodes.index(str(r.node))], float(r.offset_us))
              for r in readings if str(r.node) in known]
    if common:
        shift = float(np.median([mine - theirs for mine, theirs in common]))
    else:
        shift = -float(np.median([float(r.offset_us) for r in readings]))
    rows = sorted(
        [(n, o, d, u, k) for n, o, d, u, k in zip(
            estimate.nodes, estimate.offset_us, estimate.drift_ppm, estimate.uncertainty_us,
            estimate.samples, strict=True)]
        + [(str(r.node), round(float(r.offset_us) + shift, 3), 0.0,
            round(r.delay_us / 2 + READING_SLACK_US, 3), 0) for r in extra])
    return ClockEstimate(
        ref_us=estimate.ref_us if estimate.nodes else now_us,
        nodes=tuple(r[0] for r in rows), offset_us=tuple(r[1] for r in rows),
        drift_ppm=tuple(r[2] for r in rows), uncertainty_us=tuple(r[3] for r in rows),
        samples=tuple(r[4] for r in rows),
    )
