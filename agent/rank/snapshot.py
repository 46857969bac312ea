"""In-memory snapshots of a rank's training state, taken every step at the cost of a copy.

    from tracehound.agent import checkpoint
    checkpoint.snapshot(state, step)                      # every step: memory, with a replica
    checkpoint.snapshot(state, step, persist=True)        # now and then: also to disk

On the training thread, `snapshot` only copies: every tensor in `state` (a DTensor's local shard)
into one CPU buffer (`agent.rank.statecodec.pack`), so training can change its tensors at once.
A writer thread then makes it a snapshot container (`tracing.snapshots`: header and checksum), sends
it to this node's keeper and a replica to another node's (`agent.rank.keepers`), and, when
persisted, writes it to `DIR/step-<08d>/rank-<05d>.snap`; the rank whose file completes the set
writes the completion marker (`checkpoint.MARKER`), so an incomplete step is never loaded.

The writer holds at most one in-memory snapshot waiting: a newer one replaces it (counted as
superseded). Persisted snapshots are never replaced; more than `MAX_WAITING_PERSISTS` waiting
drops the oldest, counted and logged. Nothing here raises into training once it runs: a keeper
away, a full disk or a serialization error is counted (`stats`) and logged, and training goes
on. The one error it raises is at the first snapshot, on the training thread: a state larger
than the own keeper's whole budget (`SnapshotBudgetError`), a configuration to fix.
"""

from __future__ import annotations

import atexit
import copy
import importlib
import io
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracehound.agent.rank.keepers import KeeperClient, KeeperError, Keepers
from tracehound.agent.rank.statecodec import (
    Packed,
    UnsupportedState,
    decode_state,
    pack,
    packed_bytes,
)
from tracehound.tracing import settings as env
from tracehound.tracing.durable import write_atomic
from tracehound.tracing.snapshots import encode

log = logging.getLogger(__name__)

MARKER = "COMPLETE"
"""File written in a checkpoint directory once every rank has saved its part."""

MAX_WAITING_PERSISTS = 2
"""Persisted snapshots waiting for the writer; beyond this the oldest is dropped (counted)."""


class SnapshotBudgetError(ValueError):
    """The state is larger than the whole memory budget of this node's keeper."""


def snapshot_file(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank-{rank:05d}.snap"


def step_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where the checkpoint of `step` lives."""
    return Path(directory) / f"step-{step:08d}"


# -- staging: the only work on the training thread ----------------------------------------------

def stage(value: Any) -> tuple[Any, int]:
    """A copy of `value` whose tensors are detached CPU clones (a DTensor's local shard), and
    how many bytes the tensors hold."""
    torch: Any = importlib.import_module("torch")
    total = 0

    def copy_of(item: Any) -> Any:
        nonlocal total
        if isinstance(item, torch.Tensor):
            local = item.to_local() if hasattr(item, "to_local") else item
            cloned = local.detach().to("cpu", copy=True)
            total += cloned.numel() * cloned.element_size()
            return cloned
        if isinstance(item, dict):
            return {k: copy_of(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            items = [copy_of(v) for v in item]
            return items if isinstance(item, list) else tuple(items)
        if item is None or isinstance(item, (bool, int, float, str, bytes)):
            return item
        return copy.deepcopy(item)

    return copy_of(value), total


def take(state: Any) -> tuple[Packed | Any, int]:
    """The state as the writer will need it, and its tensors' bytes: packed by the state codec
    (one copy into one buffer), or, for a state the codec cannot carry, staged as clones for
    torch.save. All that a snapshot does on the training thread."""
    try:
        packed = pack(state)
    except UnsupportedState:
        return stage(state)
    return packed, packed.nbytes


def serialize(taken: Packed | Any) -> tuple[str, bytes]:
    """(codec, payload) of what `take` took: the state codec's, or torch.save's."""
    if isinstance(taken, Packed):
        return "state", packed_bytes(taken)
    torch: Any = importlib.import_module("torch")  # staged: the codec already refused it
    buffer = io.BytesIO()
    torch.save(taken, buffer)
    return "torch", buffer.getvalue()


def deserialize(codec: str, payload: bytes | memoryview) -> Any:
    """The state in a payload `serialize` made; torch.save's is read with weights_only."""
    if codec == "state":
        return decode_state(payload)
    torch: Any = importlib.import_module("torch")
    return torch.load(io.BytesIO(bytes(payload)), weights_only=True)


# -- the writer thread ---------------------------------------------------------------------------

@dataclass
class SnapshotStats:
    staged: int = 0
    staged_s: float = 0.0
    """Time spent staging on the training thread, in all."""
    superseded: int = 0
    sent_own: int = 0
    sent_replica: int = 0
    send_failed: int = 0
    persisted: int = 0
    persist_failed: int = 0
    persist_dropped: int = 0
    failed: int = 0
    """Snapshots that could not be serialized at all."""
    unheld: int = 0
    """In-memory snapshots skipped: no keeper to hold them (TRACEHOUND_SNAPSHOT_KEEPERS unset)."""


@dataclass(frozen=True)
class Identity:
    job: str
    rank: int
    world: int
    node: str
    attempt: int


@dataclass(frozen=True)
class _Item:
    staged: Any
    step: int
    persist_dir: Path | None


@dataclass
class Snapshotter:
    """Stages on the caller's thread; serializes, sends and persists on its own."""

    identity: Identity
    keepers: Keepers
    clock: Callable[[], float] = time.time
    stats: SnapshotStats = field(default_factory=SnapshotStats)
    _waiting: list[_Item] = field(default_factory=list)
    _busy: bool = False
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _thread: threading.Thread | None = None
    _checked_budget: bool = False
    _warned: set[str] = field(default_factory=set)

    def snapshot(self, state: Any, step: int, *, persist_dir: Path | None = None) -> None:
        if persist_dir is None and self.keepers.own is None and self.keepers.replica is None:
            self.stats.unheld += 1
            self._warn("unheld", "rank %d: no snapshot keeper for node %s (%s unset or without "
                       "it): in-memory snapshots are skipped, persisted ones still go to disk",
                       self.identity.rank, self.identity.node, env.TRACEHOUND_SNAPSHOT_KEEPERS)
            return
        began = time.perf_counter()
        staged, size = take(state)
        if not self._checked_budget:
            self._check_budget(size)
        self.stats.staged += 1
        self.stats.staged_s += time.perf_counter() - began
        with self._cond:
            kept = [i for i in self._waiting if i.persist_dir is not None]
            self.stats.superseded += len(self._waiting) - len(kept)
            if persist_dir is not None and len(kept) >= MAX_WAITING_PERSISTS:
                self.stats.persist_dropped += 1
                self._warn("persist-dropped", "rank %d: the disk is slower than the persisted "
                           "snapshots: the one of step %d was dropped, waiting for disk",
                           self.identity.rank, kept.pop(0).step)
            self._waiting = [*kept, _Item(staged, step, persist_dir)]
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tracehound-snapshots",
                                            daemon=True)
            self._thread.start()
            atexit.register(self.flush, 30.0)

    def _check_budget(self, size: int) -> None:
        self._checked_budget = True
        if self.keepers.own is None:
            return
        try:
            budget = int(self.keepers.own.stats().get("budget_bytes", 0))
        except (KeeperError, ValueError):
            return  # the keeper is away: the writer counts what it cannot send
        if budget and size > budget:
            raise SnapshotBudgetError(
                f"rank {self.identity.rank}: a snapshot of {size / 2**20:.1f} MiB does not fit "
                f"the keeper of node {self.identity.node} ({budget / 2**20:.1f} MiB in all); "
                f"raise {env.TRACEHOUND_SNAPSHOT_BUDGET_MB} or snapshot less state")

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every waiting snapshot is sent and persisted; False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._waiting or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                item = self._waiting.pop(0)
                self._busy = True
            try:
                self._write(item)
            except Exception as exc:
                self.stats.failed += 1
                self._warn("failed", "rank %d: snapshot of step %d failed: %r",
                           self.identity.rank, item.step, exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, item: _Item) -> None:
        who = self.identity
        codec, payload = serialize(item.staged)
        data = encode(job=who.job, rank=who.rank, world=who.world, step=item.step,
                      attempt=who.attempt, node=who.node, created_us=int(self.clock() * 1e6),
                      payload=payload, codec=codec)
        for keeper, counter in ((self.keepers.own, "sent_own"),
                                (self.keepers.replica, "sent_replica")):
            if keeper is not None:
                self._send(keeper, data, counter, item.step)
        if item.persist_dir is not None:
            self._persist(item.persist_dir, item.step, data)

    def _send(self, keeper: KeeperClient, data: bytes, counter: str, step: int) -> None:
        try:
            keeper.put(data)
        except KeeperError as exc:
            self.stats.send_failed += 1
            self._warn(f"send-{keeper.node}", "rank %d: snapshot of step %d not held by node "
                       "%s (counted; later ones are tried again): %s", self.identity.rank, step,
                       keeper.node, exc)
            return
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)

    def _persist(self, directory: Path, step: int, data: bytes) -> None:
        step_dir = step_path(directory, step)
        try:
            step_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(snapshot_file(step_dir, self.identity.rank), data)
            present = sum(1 for p in step_dir.glob("rank-*.snap"))
            if present >= self.identity.world and not (step_dir / MARKER).exists():
                write_atomic(step_dir / MARKER, f"{step}\n".encode())
        except OSError as exc:
            self.stats.persist_failed += 1
            self._warn("persist", "rank %d: snapshot of step %d not persisted to %s (counted; "
                       "the step stays incomplete and is never loaded): %r",
                       self.identity.rank, step, step_dir, exc)
            return
        self.stats.persisted += 1

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """The first of each kind at WARNING, the rest at DEBUG: counted in `stats` either way."""
        level = logging.DEBUG if kind in self._warned else logging.WARNING
        self._warned.add(kind)
        log.log(level, message, *args)
