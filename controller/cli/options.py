"""What the commands share: the store and detection flags, the supervisor's settings from them,
JSON output and a run's own ingest token."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import secrets
from collections.abc import Iterator
from typing import Any

from tracehound.tracing.settings import TRACEHOUND_INGEST_TOKEN


def store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store", metavar="URL",
        help="trace store: clickhouse://user:pass@host:9000/db or chdb:///dir "
             "(default: $TRACEHOUND_STORE, else chdb://./.tracehound/store)",
    )


def detection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hang-after", type=float, default=5.0, metavar="S",
                   help="ranks waiting this long in one collective on a rank that is frozen "
                        "(stopped, gone, silent) or stuck in an operation is a hang "
                        "(default: 5)")
    p.add_argument("--busy-grace", type=float, default=600.0, metavar="S",
                   help="ranks waiting on a rank that is alive and busy outside collectives "
                        "(checkpoint, evaluation, compilation, data loading) is a stall: "
                        "recorded, never acted on until it lasts this long; also how long an "
                        "unsure verdict is watched before a restart that evicts nobody "
                        "(default: 600, like torch's watchdog)")
    p.add_argument("--idle-grace", type=float, default=30.0, metavar="S",
                   help="such a rank that does nothing at all (asleep, no CPU, no storage I/O, "
                        "the same stack: a dead data loader, a deadlock in its own code) is a "
                        "hang after this long, or after 3 times the longest pause the job made "
                        "at that place before; restarted, its machine not evicted "
                        "(default: 30)")


def supervisor_settings(args: argparse.Namespace, **overrides: Any) -> Any:
    """The supervisor's settings from the detection flags; ValueError naming a bad flag."""
    from tracehound.analysis.settings import DetectionSettings, HangSettings
    from tracehound.controller.policy.recovery import PolicySettings
    from tracehound.controller.supervision.supervisor import SupervisorSettings

    if not args.hang_after > 0:
        raise ValueError(f"--hang-after must be a positive number of seconds, "
                         f"got {args.hang_after}")
    if not args.busy_grace >= args.hang_after:
        raise ValueError(f"--busy-grace must be at least --hang-after "
                         f"({args.hang_after} s), got {args.busy_grace}")
    idle_grace = getattr(args, "idle_grace", 30.0)
    if not args.hang_after <= idle_grace:
        raise ValueError(f"--idle-grace must be at least --hang-after "
                         f"({args.hang_after} s), got {idle_grace}")
    policy_file = getattr(args, "policy", None)
    if policy_file is not None:
        from tracehound.controller.policy.file import load_policy

        policy = load_policy(policy_file)  # PolicyConfigError (a ValueError) names the field
        if getattr(args, "max_restarts", None) is not None:
            policy = dataclasses.replace(policy, max_restarts=args.max_restarts)
    else:
        max_restarts = getattr(args, "max_restarts", None)
        policy = PolicySettings(watch_s=args.busy_grace,
                                max_restarts=3 if max_restarts is None else max_restarts)
    return SupervisorSettings(
        detection=DetectionSettings(
            hang=HangSettings(after_s=args.hang_after, busy_grace_s=args.busy_grace,
                              idle_grace_s=min(idle_grace, args.busy_grace))),
        policy=policy, **overrides,
    )


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=None, sort_keys=False))


@contextlib.contextmanager
def own_ingest_token() -> Iterator[str]:
    """Give this run's loopback ingest endpoint a token of its own while the block runs, when
    none is configured: the node agents it starts inherit it, and another user of the machine
    cannot post batches into the job's store. A configured token is kept; the one made here is
    removed again at the end (`main` may run in a longer-lived process)."""
    configured = os.environ.get(TRACEHOUND_INGEST_TOKEN)
    if configured:
        yield configured
        return
    token = secrets.token_urlsafe(24)
    os.environ[TRACEHOUND_INGEST_TOKEN] = token
    try:
        yield token
    finally:
        if os.environ.get(TRACEHOUND_INGEST_TOKEN) == token:
            del os.environ[TRACEHOUND_INGEST_TOKEN]

