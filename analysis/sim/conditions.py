"""How hard a simulated job is: the clocks, layouts, fault sizes and harmless noise it runs in.

`LAB` is the simulator as the detectors were first built against: node clocks within tens of
microseconds, Megatron GPipe jobs with TP 4 or 8 and 100..450 ms steps, faults drawn just above
what a detector needs, rare harmless noise. Unit tests of one detection mechanism use it.
`FIELD` (the default of `simulate`) is what a new user's job looks like: node clocks off by
milliseconds and drifting, every common layout (plain DDP, 1F1B, interleaved, ZeRO-3, MoE; TP
1..8; 4 or 8 GPUs per node) with steps from 50 ms to 30 s, fault sizes across the grey zone
starting anywhere in the window, and the harmless noise real jobs have (heavy-tailed compute,
long pauses, health warnings on any node including the culprit's, slow checkpoints, evaluation
on rank 0, GPUs a little slower than their peers).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Conditions:
    """The knobs of one simulated environment (see the module docstring)."""

    name: str
    skew_ms: float
    """Sigma of each node's clock offset (all ranks of a node share it), in milliseconds."""
    drift_ppm: float
    """Sigma of each node's clock drift, in parts per million (applied over the window)."""
    field_layouts: bool
    """Draw the workload kind, TP 1..8, 4 or 8 GPUs per node and steps of 50 ms..30 s; False:
    Megatron GPipe, TP 4 or 8, 8 GPUs per node, 100..450 ms steps."""
    grey_zone: bool
    """Fault sizes down to barely noticeable (straggler 1.05x, slow link 1.2x, NVLink 1.3x,
    thermal 1.1x); False: sizes a detector sees plainly."""
    onset_mid_window: bool
    """Faults that build up (straggler, slow link, slow NVLink, thermal) start at any step of
    the window's first half (the first with chance 0.3); False: at the first step or the
    second. Not later: a fault shown in only the last step or two of a window looks like a
    pause there, and the supervisor judges it in its next window, where it shows throughout;
    one window per scenario stands for that by holding the fault at least half its steps."""
    tail_p: float
    """Chance per compute segment of a heavy-tailed (Pareto) slowdown of up to 3x."""
    pauses_per_window: float
    """Expected 50..200 ms pauses (GC, page cache, a noisy neighbour) over all ranks per
    window (`WINDOW_STEPS` steps)."""
    warnings_per_window: float
    """Expected harmless health warnings (corrected ECC, PCIe replays, NIC errors) per window
    on random nodes."""
    warning_on_culprit_p: float
    """Chance of one more harmless warning on the culprit's node."""
    checkpoint_p: float
    """Chance that some ranks write a checkpoint for 1..4 s while the others wait."""
    evaluation_p: float
    """Chance that rank 0 evaluates for 0.5..4 s outside any collective while the others
    wait."""
    slow_gpus: float
    """Expected GPUs 2..6% slower than their peers (the lab draws one, sometimes)."""

    @property
    def noisy(self) -> bool:
        """Whether any of the field's harmless noise is switched on."""
        return bool(self.pauses_per_window or self.warnings_per_window or self.checkpoint_p
                    or self.evaluation_p or self.slow_gpus)


WINDOW_STEPS = 6
"""The steps of one window, the unit the per-window rates of `Conditions` count in."""


LAB = Conditions(
    name="lab", skew_ms=0.03, drift_ppm=0.0, field_layouts=False, grey_zone=False,
    onset_mid_window=False, tail_p=0.0, pauses_per_window=0.0, warnings_per_window=0.0,
    warning_on_culprit_p=0.0, checkpoint_p=0.0, evaluation_p=0.0, slow_gpus=0.0,
)
"""The simulator the detectors were first built against."""

FIELD = Conditions(
    name="field", skew_ms=5.0, drift_ppm=3.0, field_layouts=True, grey_zone=True,
    onset_mid_window=True, tail_p=0.02, pauses_per_window=4.0, warnings_per_window=1.5,
    warning_on_culprit_p=0.4, checkpoint_p=0.25, evaluation_p=0.25, slow_gpus=1.0,
)
"""What jobs look like in the field (ordinary NTP clocks, every common layout)."""
