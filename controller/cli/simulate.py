"""`tracehound simulate`: a simulated job's traces, with a fault injected, written to a store."""

from __future__ import annotations

import argparse
from typing import Any

from tracehound.controller.cli.options import print_json, store_arg
from tracehound.tracing.store.urls import mask_url


def add_parser(sub: Any) -> None:
    sim = sub.add_parser(
        "simulate", help="write a simulated job's traces (with a fault) to a store",
        description="Simulate one detection window of a large job (DDP, ZeRO-3, MoE or a "
                    "Megatron pipeline; 4 or 8 ranks per node; skewed node clocks, pauses, "
                    "checkpoints and harmless warnings) with a fault injected, and write its "
                    "traces to a store so that `tracehound diagnose` can be run on it.",
        epilog="example:\n  tracehound simulate --ranks 4096 --fault straggler --seed 7 "
               "--job-id s7\n  tracehound diagnose --job s7",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sim.add_argument("--ranks", type=int, required=True, help="ranks in the job (8 to 32768)")
    sim.add_argument("--fault", required=True, metavar="CLASS",
                     help="hang, crash, mismatch, straggler, slow_link, hardware, silent_hang "
                          "or healthy")
    sim.add_argument("--seed", type=int, default=0, help="scenario seed (default: 0)")
    sim.add_argument("--job-id", help="job id (default: sim-<fault>-<ranks>-<seed>)")
    sim.add_argument("--skew-ms", type=float, default=None, metavar="MS",
                     help="sigma of the node clock offsets in ms (default: 5, ordinary NTP)")
    sim.add_argument("--lab", action="store_true",
                     help="lab conditions: clocks within microseconds, Megatron layouts only, "
                          "faults well above the detectors' thresholds, little noise (default: "
                          "field conditions)")
    sim.add_argument("--json", action="store_true", help="print what was written as JSON")
    store_arg(sim)
    sim.set_defaults(handler=cmd_simulate)


def cmd_simulate(args: argparse.Namespace) -> int:
    from tracehound.analysis.sim import FAULT_KINDS, FIELD, LAB, simulate, write_to_store
    from tracehound.controller.cli.session import resolve_store_url
    from tracehound.tracing.store import open_store

    classes = [k.value for k in FAULT_KINDS] + ["healthy"]
    if args.fault not in classes:
        raise ValueError(f"--fault {args.fault!r}: expected one of {', '.join(classes)}")
    if not 8 <= args.ranks <= 32_768:
        raise ValueError(f"--ranks {args.ranks}: expected a number of ranks from 8 to 32768")
    job = args.job_id or f"sim-{args.fault}-{args.ranks}-{args.seed}"
    if args.skew_ms is not None and not 0 <= args.skew_ms <= 1_000:
        raise ValueError(f"--skew-ms {args.skew_ms}: expected milliseconds from 0 to 1000")
    sim = simulate(ranks=args.ranks, fault=args.fault, seed=args.seed, job=job,
                   conditions=LAB if args.lab else FIELD, skew_ms=args.skew_ms)
    store = open_store(resolve_store_url(args.store))
    try:
        write_to_store(sim, store)
        shown = store.url
    finally:
        store.close()
    truth = sim.truth
    written = {
        "job": job, "store": shown, "ranks": args.ranks, "fault": args.fault,
        "seed": args.seed, "collectives": len(sim.columns),
        "nodes": len(set(sim.rank_nodes.values())),
        "truth": {
            "kind": truth.kind.value if truth.kind else "healthy",
            "culprit_ranks": list(truth.culprit_ranks), "culprit_nodes": list(truth.culprit_nodes),
            "link": list(truth.link) if truth.link else None, "variant": truth.variant,
            "size": truth.size,
        },
        "conditions": "lab" if args.lab else "field",
        "workload": sim.info.get("workload"),
    }
    if args.json:
        print_json(written)
    else:
        print(f"wrote job {job}: {args.ranks} ranks on {written['nodes']} nodes, "
              f"{written['collectives']} collective events, injected {written['truth']['kind']} "
              f"({truth.variant or '-'}) at ranks {list(truth.culprit_ranks)[:8]} to {shown}")
        print(f"now: tracehound diagnose --job {job}"
              + (f" --store {mask_url(args.store)}" if args.store else ""))
    return 0
