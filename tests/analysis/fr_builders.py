"""NCCL-style Flight Recorder dumps for the analysis tests: entries as NCCL 2.27 writes them
(format 2.9) and one rank's dump of one default group, parsed as `import-fr` parses files."""

from __future__ import annotations

from typing import Any

from tracehound.tracing import flightrecorder as fr


def nccl_entry(seq: int, op: str, *, created_ns: int, ins: list[list[int]],
               outs: list[list[int]] | None = None, in_dtype: str = "Float",
               out_dtype: str | None = None, state: str = "completed",
               record: int | None = None) -> dict[str, Any]:
    """One entry of the default group: call #`seq` of `op` (`outs`: default the inputs, in
    place), `state` completed, started or scheduled."""
    outs = ins if outs is None else outs
    return {
        "record_id": seq - 1 if record is None else record, "pg_id": 0,
        "process_group": ("0", "default_pg"), "collective_seq_id": seq, "p2p_seq_id": 0,
        "op_id": seq, "profiling_name": f"nccl:{op}", "time_created_ns": created_ns,
        "input_sizes": ins, "input_dtypes": [in_dtype] * len(ins), "output_sizes": outs,
        "output_dtypes": [out_dtype or in_dtype] * len(outs), "state": state,
        "time_discovered_started_ns": created_ns,
        "time_discovered_completed_ns": created_ns + 500 if state == "completed" else None,
        "is_p2p": False,
    }


def nccl_dump(rank: int, entries: list[dict[str, Any]], *, world: int, enqueued: int,
              completed: int, dumped_at_us: int) -> fr.FrDump:
    """Rank `rank`'s dump: its `entries`, the default group of `world` ranks in pg_config, and
    its counters in pg_status."""
    raw = {"version": "2.9", "rank": rank, "entries": entries,
           "pg_config": {"0": {"name": "0", "desc": "default_pg",
                               "ranks": str(list(range(world)))}},
           "pg_status": {"0": {"last_enqueued_collective": enqueued,
                               "last_started_collective": enqueued,
                               "last_completed_collective": completed}}}
    return fr.parse_dump(raw, source=f"rank{rank}", dumped_at_us=dumped_at_us)
