"""The thresholds of the detectors, one frozen settings class per detector, nested in
`DetectionSettings`. The defaults are tuned so that healthy timing noise (a few ms, occasional
spikes) never yields a verdict; each detector's module gives the reasoning behind its own.

    DetectionSettings(hang=HangSettings(after_s=10.0), straggler=StragglerSettings(min_excess=1.2))

Pure data: no I/O; nothing here reads the environment (the controller's flags and policy file
fill these in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tracehound.tracing.settings import DEFAULT_HEARTBEAT_S

UNEVEN_OPS = (
    "gather", "scatter", "all_to_all", "all_to_all_single", "alltoall", "alltoall_base",
    "all_gather_v", "reduce_scatter_v",
)
"""Ops whose members legitimately pass different sizes: the default of
`MismatchSettings.size_exempt_ops`."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HangSettings:
    """Hangs and stalls (`analysis.detect`, `analysis.standstill`, `analysis.liveness`)."""

    after_s: float = 5.0
    """A rank waiting this long inside one collective means the job hangs. Training steps take
    milliseconds to seconds; raise it for jobs with longer legitimate waits."""
    heartbeat_timeout_s: float = 5 * DEFAULT_HEARTBEAT_S
    """A rank silent for this long (five heartbeats missed at the default rate,
    `tracing.settings.DEFAULT_HEARTBEAT_S`) is not reporting."""
    busy_grace_s: float = 600.0
    """Peers may wait this long on a rank that is alive and busy outside collectives (writing a
    checkpoint, evaluating, compiling, loading data) before it counts as a hang; until then it is
    a stall, recorded and watched. Like torch's own watchdog, 10 minutes by default."""
    idle_grace_s: float = 30.0
    """Peers may wait this long on a rank that is alive, outside collectives and idle (asleep,
    no CPU, no storage I/O, the same stack: `analysis.idle`) before it counts as a hang, or
    `rhythm_factor` times its longest past pause at that place, if longer. Never more than the
    busy grace."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CrashSettings:
    """Crashes (`analysis.detect.detect_crash`)."""

    settle_s: float = 0.3
    """How long after the first failed exit to wait for earlier exits still in flight."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MismatchSettings:
    """Mismatched collectives (`analysis.mismatch`)."""

    size_exempt_ops: tuple[str, ...] = UNEVEN_OPS
    """Ops whose members legitimately pass different sizes (uneven splits, the root of a gather):
    a size difference alone is no mismatch for them. The store leaves such collectives out of
    its disagreements before their limit (`load_observation(uneven_ops=...)`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StragglerSettings:
    """Stragglers (`analysis.straggler`)."""

    min_excess: float = 1.15
    """A straggler's longest gap between its operations and its other gaps (as a share of its
    active time) are both at least this multiple of its role peers' (its compute: a slow GPU
    lengthens both, a pause only the longest): 2-5% slower GPUs stay below, 1.3x stragglers
    above; 1.05-1.3x is a grey zone, reported with low confidence when found, never forced."""
    min_excess_us: float = 2_000.0
    """...and at least this much more of it in the window (us), so that microsecond jitter of
    a quiet job never counts..."""
    min_excess_gaps: float = 3.0
    """...and its gaps other than the longest add up to this many of its peers' longest gaps
    more than theirs: a pause, or one step in which the rank arrived last (its compute, hidden
    at its peers behind their non-blocking operations, then shows), adds one or two; a slow GPU
    adds some in every step (fewer are asked of windows of few gaps, `analysis.straggler`)..."""
    min_blame: float = 0.03
    """...and its groups waited on it alone (it the only last arrival) for at least this share
    of its active time: a slow rank nobody waits for costs the job nothing."""
    busy_min_collectives: int = 4
    """A rank needs this many collectives in the window to be judged on its compute (a window
    of 23-second steps holds about four)..."""
    min_active_us: float = 500_000.0
    """...spread over at least this long (us): a fraction of a second of a rank's work is
    noise, not a straggler (at the edge of an attempt four ranks on two cores showed healthy
    ranks 1.16x and 1.29x their peers over 0.15 and 0.26 s)."""
    min_collectives: int = 20
    """Without the busy columns (an older source), a rank needs this many collectives in the
    window to be judged by its arrivals; the rest of the straggler settings below serve that
    rule."""
    min_last_z: float = 6.0
    """How far (binomial z-score) a rank's count of last arrivals must exceed what the median
    rank's rate predicts. Healthy ranks of 10,000 stay below 5."""
    min_last_fraction: float = 0.5
    """...and the fraction of its collectives it arrived last at must be at least this..."""
    min_last_ratio: float = 2.0
    """...and at least this multiple of the median rank's fraction."""
    min_lateness_us: float = 500.0
    """Its mean lateness must exceed the median rank's by this much (us), so that a quiet job's
    jitter never counts..."""
    min_slowdown: float = 0.1
    """...and by this share of the median rank's time between collectives (its compute): a GPU
    2-5% slower than its peers is last often too but costs little; one 20% slower is evicted."""
    consistent_ratio: float = 6.0
    """A compute straggler is also last at this multiple of the median rank's share of its
    collectives (or at half of those the median rank is not last at): in a
    data-parallel window of 1,500 collectives over 64 ranks, a healthy rank hit by more
    heavy-tailed slow moments than its peers is last up to about 5x its share."""
    min_step_cost: float = 0.05
    """A compute straggler's extra compute per training step (from the heartbeats' step times)
    is at least this share of a step. Where collectives overlap compute (gradient buckets)
    busy time understates it: a 1.3x straggler's shows as 5-15% of a step."""
    min_lag: float = 0.1
    """...and its groups waited on it, on average over the collectives it arrived last at, at
    least this share of a step: a GPU 2-6% slower than its peers is last at many collectives
    but by a few percent of a step and is no straggler to act on; one 1.3x slower keeps the job
    waiting 12-40% of a step."""
    one_group_min_last: float = 0.3
    """Where every rank does the same work in one group (plain DDP, ZeRO), a compute straggler
    is last at at least this share of its collectives..."""
    one_group_clear_ratio: float = 1.4
    """...or at half that share when it computes at least this many times as long as its peers
    (a GPU a few percent slower never does; a 1.5x straggler hidden for part of the window
    behind pauses elsewhere, rank 0's evaluation, a checkpoint, is last less often)."""
    consistent_margin: float = 0.1
    """...or, whichever is less, last at this share of its collectives more than the median
    rank."""
    shadow_ratio: float = 0.7
    """A candidate sharing a group with a stronger one (later on average, last more often) is its
    shadow (it waited for the straggler in one group, then arrived late in the next) unless its
    own last fraction is at least this share of the stronger one's."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkSettings:
    """Slow links (`analysis.links`)."""

    min_transfers: int = 3
    """A link needs this many transfers in the window to be judged."""
    min_comparable: int = 6
    """Links are only compared within a class (intra-node, inter-node) holding this many."""
    min_z: float = 6.0
    """A slow link's mean transfer time is this many robust deviations above its class median..."""
    min_ratio: float = 1.5
    """...and at least this multiple of the median (its mean taken without its worst transfer;
    two network hiccups among a dozen transfers still lift a healthy link to ~1.45x)."""
    full_margin_transfers: float = 16.0
    """Links of up to this many transfers need all of `min_ratio`; one of n more needs
    1 + (link_min_ratio - 1) x this / n, and at least `node_min_ratio`."""
    node_min_ratio: float = 1.25
    """A node's links count as slow from this multiple on (with the same z-score): many links
    together need less margin each than one."""
    node_fraction: float = 0.75
    """When at least this share of a node's links (and at least two) is slow, the node (its NIC)
    is blamed rather than one link."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareSettings:
    """Hardware correlation (`analysis.hardware`)."""

    throttle_min_excess: float = 1.08
    """A GPU that reports throttling or slowed clocks is a hardware verdict when its rank
    computes at least this many times as long as its role peers, over more than one pause's
    worth (`analysis.hardware.detect_throttled_gpu`): the event makes a smaller slowdown than a
    straggler's credible, the measured slowdown makes the event matter."""
    health_slack_s: float = 30.0
    """Health events this long before the window (or after it) still count as coinciding; for a
    stop, this long before the culprits' last activity or after their peers started waiting."""
    health_gpu_by_local_rank: bool = True
    """A rank drives the GPU of its index among its node's ranks (torchrun's LOCAL_RANK as
    `cuda:LOCAL_RANK`), so a GPU's health sample explains only its own rank's slowness or stop.
    Turn off for jobs that map devices otherwise (a CUDA_VISIBLE_DEVICES per rank, several GPUs
    per process): samples then match at node level, with one notch less confidence."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StackSettings:
    """Silent hangs and throughput collapse (`analysis.stacks`)."""

    step_stall_factor: float = 10.0
    """Throughput collapse: the median rank has not finished a step for this many typical step
    times..."""
    step_stall_min_s: float = 10.0
    """...and for at least this long."""
    frames: int = 3
    """Stacks are clustered by their innermost this many frames."""
    outlier_ratio: float = 4.0
    """A stack cluster at most 1/this of the largest one is an outlier."""
    max_outlier_fraction: float = 0.2
    """Outliers covering more of the ranks than this are no sure localization: the analysis then
    names the first outlier's whole (smallest) group with low confidence."""
    min_dominant_fraction: float = 0.5
    """...as it does when the largest cluster covers less than this share of the ranks."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutlierSettings:
    """Machine-level outliers (`analysis.outliers`)."""

    windows: int = 4
    """The model looks at this many most recent windows..."""
    min_flagged: int = 3
    """...and flags a node only when it is an outlier in at least this many of them."""
    z: float = 5.0
    """In a flagged window the node's lateness and its last fraction are both this many robust
    deviations above the median node's (the bad direction: a node that arrives early and waits
    more is a healthy, faster node; one last more often but not later sits at a pipeline
    boundary)..."""
    lof: float = 1.5
    """...and its local outlier factor (scikit-learn LocalOutlierFactor over the per-window
    standardized features) is at least this."""
    neighbors: int = 35
    """LocalOutlierFactor's n_neighbors (fewer when there are fewer points)."""
    min_nodes: int = 8
    """Fewer nodes than this give no population to compare against."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DetectionSettings:
    """Thresholds of every detector, one group per detector."""

    hang: HangSettings = field(default_factory=HangSettings)
    crash: CrashSettings = field(default_factory=CrashSettings)
    mismatch: MismatchSettings = field(default_factory=MismatchSettings)
    straggler: StragglerSettings = field(default_factory=StragglerSettings)
    link: LinkSettings = field(default_factory=LinkSettings)
    hardware: HardwareSettings = field(default_factory=HardwareSettings)
    stacks: StackSettings = field(default_factory=StackSettings)
    outliers: OutlierSettings = field(default_factory=OutlierSettings)
    max_evidence: int = 32
    """At most this many evidence items of one fact per verdict (culprits' facts first), so a
    verdict over 10,000 ranks stays readable and small."""
