"""Simulated training jobs with injected faults: realistic traces for tests, benches and demos.

`simulate(ranks=..., fault=..., seed=...)` plays a detection window of a Megatron-style job
(tensor parallel within a node, pipeline stages across nodes, data parallel replicas; see
`topology`) step by step under a GPipe schedule (`workloads`), with numpy over all ranks at once
(`engine`), and returns what the recorders, the node agents and the health sources would have
reported by `now_us` (`records`): the collective events of the window as columns, each rank's
latest heartbeat, the exits, the process groups, the latest stack samples and the health
samples, plus the ground truth of the injected fault. `SimulatedJob.observation()` feeds it to
the analysis through the numpy summaries of `reference`; `write_to_store()` feeds it to a trace
store, from which `load_observation` reads the same window back.

How faults are injected (`faults`): from the seed, one culprit rank and the step it strikes in
are drawn, then the form of the fault (`Truth.variant`). The fault becomes a plan the engine
plays: a rank that stops computing or stops altogether at some point of a step, a rank that
computes slower, groups whose collectives or transfers take longer, one rank's call that
differs from its peers', or a collective that never completes. A collective completes for
every member when its last member has entered, so one stuck rank leaves its peers pending: its
TP group, the next pipeline stage, then every DP replica. The fault classes:

- hang: one rank stuck in a GPU kernel (heartbeats go on, no pending op) or frozen (SIGSTOP;
  heartbeats stop, possibly inside a collective);
- crash: one rank dies (OOM kill, segfault, abort, exception); the ranks waiting on it fail with
  connection errors 20 ms to a few seconds later, the launcher kills the rest after seconds;
- mismatch: one rank calls a different op (all hang at one sequence id, its pending op differs),
  a different size or dtype (the collective completes, the events disagree), or skips a DP
  bucket (events disagree, then the job hangs);
- straggler: one rank computes 20..100% slower;
- slow_link: one pipeline pair transfers 1.6..4x slower, or every link of one node 1.5..3x;
- hardware: a thermal slowdown, an Xid 79/48 hang, NVLink errors slowing or hanging one node's
  TP collectives, each with the health event on that node;
- silent_hang: every rank pending in the same world all_reduce, nobody silent or lagging, the
  culprits' stacks stuck in a data loader, a storage read or a CUDA synchronize.

Healthy runs carry the noise a naive detector trips over: per-segment jitter, rare GC and I/O
spikes of up to 400 ms, a GPU a few percent slower than its peers, network hiccups and benign
health warnings.

Bench and test side only: no diagnosis module imports this package (import-linter checks it),
and it never runs inside a training process. Deterministic per seed.
"""

from tracehound.analysis.sim.faults import FAULT_KINDS, Truth
from tracehound.analysis.sim.records import BASE_EPOCH_US, SimulatedJob
from tracehound.analysis.sim.scenario import simulate
from tracehound.analysis.sim.topology import Topology, default_topology, node_name
from tracehound.analysis.sim.writers import write_to_store

__all__ = [
    "BASE_EPOCH_US",
    "FAULT_KINDS",
    "SimulatedJob",
    "Topology",
    "Truth",
    "default_topology",
    "node_name",
    "simulate",
    "write_to_store",
]
