"""The restore every rank agrees on: the newest step that each rank holds somewhere.

A rank may hold a step in the memory of a keeper (its own node's, or a replica on another's), as
a persisted snapshot file, or as a torch.distributed.checkpoint (DCP) directory; disk steps count
only with their completion marker. `restore` asks what this rank holds, gathers what every rank
holds, and tries the common steps newest first. A copy is loaded only once its checksum holds and
its header names this job, rank, world size and step (`tracing.snapshots`); a damaged or foreign
copy is refused with the reason and the next source tried. All ranks then say whether they have
their part: only if every rank has it is the step loaded, otherwise every rank moves to the next
older common step together. So no job ever resumes from mixed steps.

With torch.distributed not initialized (one process), the agreement is this rank's alone.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracehound.agent.rank.keepers import KeeperError, Keepers
from tracehound.agent.rank.snapshot import MARKER, Identity, deserialize, snapshot_file
from tracehound.tracing.snapshots import SnapshotError, check_identity, decode

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{8,})$")

Gather = Callable[[object], list[Any]]
"""Every rank's value of one object, in rank order (all_gather_object, or [value] alone)."""


@dataclass(frozen=True)
class Source:
    kind: str
    """"keeper" (memory), "file" (a persisted snapshot) or "dcp" (a DCP directory)."""
    where: str
    """The keeper's node, or the path."""


@dataclass(frozen=True)
class Restored:
    step: int
    source: Source

    def describe(self) -> str:
        if self.source.kind == "keeper":
            return f"step {self.step} from the memory of node {self.source.where}"
        return f"step {self.step} from {self.source.where}"


def complete_steps(directory: Path) -> dict[int, Path]:
    """The step directories of `directory` that carry the completion marker."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return {}
    found = {}
    for entry in entries:
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir() and os.path.isfile(os.path.join(entry.path, MARKER)):
            found[int(match.group(1))] = Path(entry.path)
    return found


def held_steps(who: Identity, keepers: Keepers, directory: Path | None) -> dict[int, list[Source]]:
    """Every step this rank can be restored to, with its sources, nearest first."""
    held: dict[int, list[Source]] = {}
    for keeper in keepers.lookup_order():
        try:
            rows = keeper.index(who.job)
        except KeeperError as exc:
            log.warning("rank %d: %s", who.rank, exc)
            continue
        for row in rows:
            if row.get("rank") == who.rank and row.get("world") == who.world:
                held.setdefault(int(row["step"]), []).append(Source("keeper", keeper.node))
    for step, path in (complete_steps(directory) if directory else {}).items():
        if snapshot_file(path, who.rank).is_file():
            held.setdefault(step, []).append(Source("file", str(snapshot_file(path, who.rank))))
        elif (path / ".metadata").is_file():
            held.setdefault(step, []).append(Source("dcp", str(path)))
    return held


def common_steps(every: list[list[int]]) -> list[int]:
    """The steps every rank holds, newest first."""
    if not every:
        return []
    shared = set(every[0]).intersection(*every[1:])
    return sorted(shared, reverse=True)


def _fetch(who: Identity, keepers: Keepers, step: int, source: Source) -> bytes | None:
    if source.kind == "keeper":
        client = next(k for k in keepers.all if k.node == source.where)
        return client.fetch(who.job, who.rank, step)
    return Path(source.where).read_bytes()


def verified_payload(who: Identity, keepers: Keepers, step: int,
                     sources: list[Source]) -> tuple[str, bytes, Source] | None:
    """The payload of the first source whose copy is whole and this rank's; each refusal is
    logged with its reason."""
    for source in sources:
        if source.kind == "dcp":
            continue
        name = f"{source.kind} {source.where}"
        try:
            data = _fetch(who, keepers, step, source)
            if data is None:
                log.warning("rank %d: step %d is no longer held by %s", who.rank, step, name)
                continue
            header, payload = decode(data, source=name)
            check_identity(header, job=who.job, rank=who.rank, world=who.world, step=step,
                           source=name)
        except (KeeperError, OSError, SnapshotError) as exc:
            log.warning("rank %d: not restoring step %d from %s: %s", who.rank, step, name, exc)
            continue
        return header.codec, bytes(payload), source
    return None


def apply(target: Any, loaded: Any) -> Any:
    """Put `loaded` into `target` in place: tensors copied into the existing ones (a DTensor's
    local shard), dicts merged key by key, anything else replaced. Returns the new value."""
    torch: Any = importlib.import_module("torch")
    if isinstance(target, torch.Tensor) and isinstance(loaded, torch.Tensor):
        local = target.to_local() if hasattr(target, "to_local") else target
        if local.shape == loaded.shape:
            with torch.no_grad():
                local.copy_(loaded)
            return target
        return loaded
    if isinstance(target, dict) and isinstance(loaded, dict):
        for key, value in loaded.items():
            target[key] = apply(target[key], value) if key in target else value
        return target
    if isinstance(target, list) and isinstance(loaded, list) and len(target) == len(loaded):
        target[:] = [apply(t, v) for t, v in zip(target, loaded, strict=True)]
        return target
    return loaded


def restore(state: dict[str, Any], who: Identity, keepers: Keepers, directory: Path | None,
            gather: Gather) -> Restored | None:
    """Load the newest step every rank holds into `state`; None when there is none."""
    held = held_steps(who, keepers, directory)
    every = gather(sorted(held))
    common = common_steps(every)
    if not common and any(every):
        log.warning("rank %d: no step is held by every rank (held: %s); starting fresh",
                    who.rank, {r: s[-3:] for r, s in enumerate(every)})
    for step in common:
        found = verified_payload(who, keepers, step, held[step])
        ready = gather(found is not None)
        if all(ready) and found is not None:  # `ready` holds this rank's own answer too
            codec, payload, source = found
            apply(state, deserialize(codec, payload))
            return Restored(step, source)
        dcp_dirs = [s for s in held[step] if s.kind == "dcp"]
        if all(gather(bool(dcp_dirs))):
            dcp: Any = importlib.import_module("torch.distributed.checkpoint")
            dcp.load(state, checkpoint_id=dcp_dirs[0].where)
            return Restored(step, dcp_dirs[0])
        missing = [r for r, ok in enumerate(ready) if not ok]
        log.warning("rank %d: step %d cannot be restored on rank(s) %s; trying an older step",
                    who.rank, step, missing)
    return None
