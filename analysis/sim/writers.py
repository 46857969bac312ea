"""Writing a simulated job into a trace store, as its recorders and node agents would have."""

from __future__ import annotations

from tracehound.analysis.sim.records import SimulatedJob
from tracehound.tracing.events import Batch, Record
from tracehound.tracing.store import TraceStore, bulk


def write_to_store(sim: SimulatedJob, store: TraceStore, *, chunk: int = 20_000) -> None:
    """Everything the job reported, into a trace store: the collective columns in one insert
    (the store's bulk path; TypeError for a store without one), the other records in batches of
    `chunk` (batch ids unique per job and attempt)."""
    prefix = f"sim-{sim.job}-{sim.attempt}"
    bulk(store).insert_columns(sim.job, sim.attempt, sim.columns, sim.node_of_rank(),
                               batch_id=f"{prefix}-collectives")
    records: list[Record] = [*sim.groups, *sim.heartbeats, *sim.exits, *sim.stacks, *sim.health]
    for i in range(0, len(records), chunk):
        store.insert(Batch(batch_id=f"{prefix}-records-{i // chunk}",
                           records=tuple(records[i:i + chunk])))
