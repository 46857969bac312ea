"""Diagnosis: pure functions from trace observations to verdicts that say who is at fault and why.

One entry point, `diagnose_observation(observation_or_snapshot, settings)`: the supervisor,
`tracehound diagnose`, the benchmarks and the recorded golden traces all go through it. An
`Observation` is read from a store with `load_observation` (or built by the simulator); a
`Verdict` names the kind, culprit ranks and nodes, a confidence on the scale of
`analysis.confidence`, the basis and the evidence.

Nothing here acts, sleeps or reads the clock: the caller passes the time in. Nothing here imports
torch, the agent or the controller. The job simulator that tests and benches feed the diagnosis
with lives apart in `tracehound.analysis.sim`; no diagnosis module imports it.
"""

from tracehound.analysis.confidence import (
    CERTAIN,
    LEVELS,
    LIKELY,
    STRONG,
    UNSURE,
    WEAK,
    Level,
    level_of,
)
from tracehound.analysis.diagnose import diagnose_observation
from tracehound.analysis.observation import Observation, load_observation
from tracehound.analysis.settings import (
    CrashSettings,
    DetectionSettings,
    HangSettings,
    HardwareSettings,
    LinkSettings,
    MismatchSettings,
    OutlierSettings,
    StackSettings,
    StragglerSettings,
)
from tracehound.analysis.snapshot import (
    JobSnapshot,
    load_snapshot,
    snapshot_from_json,
    snapshot_to_json,
)
from tracehound.analysis.verdict import Basis, Evidence, Fact, Verdict

__all__ = [
    "CERTAIN",
    "LEVELS",
    "LIKELY",
    "STRONG",
    "UNSURE",
    "WEAK",
    "Basis",
    "CrashSettings",
    "DetectionSettings",
    "Evidence",
    "Fact",
    "HangSettings",
    "HardwareSettings",
    "JobSnapshot",
    "Level",
    "LinkSettings",
    "MismatchSettings",
    "Observation",
    "OutlierSettings",
    "StackSettings",
    "StragglerSettings",
    "Verdict",
    "diagnose_observation",
    "level_of",
    "load_observation",
    "load_snapshot",
    "snapshot_from_json",
    "snapshot_to_json",
]
