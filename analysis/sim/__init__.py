"""Simulated training jobs with injected faults: realistic traces for tests, benches and demos.

`simulate(ranks=..., fault=..., seed=...)` plays a detection window of a training job with
numpy over all ranks at once (`engine`) and returns what the recorders, the node agents and
the health sources would have reported by `now_us` (`records`): the collective events of the
window as columns, each rank's latest heartbeat, the exits, the process groups, the latest
stack samples and the health samples, plus the ground truth of the injected fault.
`SimulatedJob.observation()` feeds it to the analysis through the numpy summaries of
`reference` (`observation(end_us=...)` as of an earlier moment); `write_to_store()` feeds it to
a trace store, from which `load_observation` reads the same window back.
`consecutive_windows(...)` plays one long job (healthy, or with a fault that starts mid-run)
window after window, for false-positive rates per window (`runs`).

How hard the job is comes from its `Conditions` (`conditions`): `FIELD`, the default, has
node clocks off by milliseconds and drifting, every common layout and schedule, fault sizes
across the grey zone starting anywhere in the window, and the harmless noise of real jobs;
`LAB` is the simulator the detectors were first built against (clocks within tens of
microseconds, Megatron GPipe with TP 4 or 8, faults just above a detector's threshold), for
unit tests of one mechanism.

Layouts (`topology`, `workloads`): plain DDP and ZeRO-3 with only the world group; Megatron
jobs (GPipe, 1F1B, interleaved 1F1B, MoE with uneven expert parallel all_to_all) with TP 1..8
within a node, PP 1..8 and every group Megatron creates, numbered as torch numbers them (most
of them idle after setup); 4 or 8 GPUs per node, one NIC per GPU; steps of 50 ms to 30 s.

How faults are injected (`faults`): from the seed, one culprit rank and the step it strikes in
are drawn, then the form of the fault (`Truth.variant`) and, for a graded fault, its size
(`Truth.size`). The fault becomes a plan the engine plays: a rank that stops computing or
stops altogether at some point of a step, a rank that computes slower, groups whose
collectives or transfers take longer, one rank's call that differs from its peers', or a
collective that never completes. A collective completes for every member when its last member
has entered, so one stuck rank leaves its peers pending: its TP group, the next pipeline stage,
then every DP replica. The fault classes:

- hang: one rank stuck in a GPU kernel (heartbeats go on, no pending op) or frozen (SIGSTOP;
  heartbeats stop, possibly inside a collective);
- crash: one rank dies (OOM kill, segfault, abort, exception); the ranks waiting on it fail with
  connection errors 20 ms to a few seconds later, the launcher kills the rest after seconds;
- mismatch: one rank calls a different op (all hang at one sequence id, its pending op differs),
  a different size or dtype (the collective completes, the events disagree), or skips a
  gradient bucket (events disagree, then the job hangs);
- straggler: one rank computes slower (lab 1.2..2x, field 1.05..2x);
- slow_link: one pipeline pair transfers slower (lab 1.6..4x, field 1.2..4x), or every link of
  one node 1.5..3x (lab), or one GPU's NIC 1.2..3x (field);
- hardware: a thermal slowdown, an Xid 79/48 hang, NVLink errors slowing (lab 3..8x, field
  1.3..8x) or hanging one node's TP collectives, each with the health event on that node;
- silent_hang: every rank pending in the same world collective, nobody silent or lagging, the
  culprits' stacks stuck in a data loader, a storage read or a CUDA synchronize.

Every job carries some harmless noise a naive detector trips over: per-segment jitter, rare GC
and I/O pauses, a GPU a few percent slower than its peers, network hiccups, benign health
warnings; the field adds heavy tails, frequent 50..200 ms pauses, warnings on the culprit's
node too, slow checkpoints and evaluations on rank 0 that everybody else waits for.

Bench and test side only: no diagnosis module imports this package (import-linter checks it),
and it never runs inside a training process. Deterministic per seed.
"""

from tracehound.analysis.sim.conditions import FIELD, LAB, Conditions
from tracehound.analysis.sim.faults import FAULT_KINDS, Truth
from tracehound.analysis.sim.records import BASE_EPOCH_US, SimulatedJob
from tracehound.analysis.sim.runs import consecutive_windows
from tracehound.analysis.sim.scenario import simulate
from tracehound.analysis.sim.topology import Topology, default_topology, node_name
from tracehound.analysis.sim.workloads import WORKLOADS
from tracehound.analysis.sim.writers import write_to_store

__all__ = [
    "BASE_EPOCH_US",
    "FAULT_KINDS",
    "FIELD",
    "LAB",
    "WORKLOADS",
    "Conditions",
    "SimulatedJob",
    "Topology",
    "Truth",
    "consecutive_windows",
    "default_topology",
    "node_name",
    "simulate",
    "write_to_store",
]
