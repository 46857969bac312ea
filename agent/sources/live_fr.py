"""Flight Recorder inside a running rank: its own ring, read in-process as a second view.

`read_live` asks torch for this process' Flight Recorder trace as JSON and parses it like a dump
file (`tracing.flightrecorder`). It imports torch lazily and never raises into the training
process: anything unavailable gives None.
"""

from __future__ import annotations

import json
import logging

from tracehound.tracing.events import now_us
from tracehound.tracing.flightrecorder import FrDump, parse_dump

log = logging.getLogger(__name__)


def read_live() -> FrDump | None:
    """This process' own Flight Recorder ring, parsed like a dump file, or None when torch, a
    process group or the recorder is unavailable. Never raises."""
    try:
        import torch  # heavy, and absent outside training processes
        import torch.distributed as dist

        c10d = torch._C._distributed_c10d
        dump_json = getattr(c10d, "_dump_fr_trace_json", None)
        if dump_json is None:
            return None
        try:
            text = dump_json(True, False, False)  # (collectives, stack traces, only active)
        except TypeError:
            text = dump_json(True, False)  # torch 2.13: (collectives, only active)
        raw = json.loads(text)
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
        return parse_dump(raw, source="this process", dumped_at_us=now_us(), rank_hint=rank,
                          hint_from="process")
    except Exception:  # inside a training process: never raise into it
        log.debug("Flight Recorder trace unavailable", exc_info=True)
        return None
