"""The alert outbox: one file per (receiver, job, incident, status), written atomically under
`pending/<receiver>/`, moved to `sent/` or `failed/` once settled: each incident is announced
once and resolved once per receiver, across restarts of the controller."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import msgspec

from tracehound.controller.alerts.model import Alert, Delivery, Receiver
from tracehound.tracing.durable import fsync_dir, write_atomic

log = logging.getLogger(__name__)


# -- the outbox -------------------------------------------------------------------------------

def delivery_key(alert: Alert) -> str:
    """Names what a delivery announces, (job, incident_id, status), as a file-name-safe hash."""
    named = json.dumps([alert.job, alert.incident_id, alert.status]).encode()
    return hashlib.sha256(named).hexdigest()[:32]


def _write_atomic(path: Path, data: bytes) -> None:
    """`journal.write_atomic` through a hidden `.NAME.tmp` (what `_recover` clears away)."""
    write_atomic(path, data, tmp=path.with_name(f".{path.name}.tmp"))


def _make_dir(directory: Path) -> None:
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(directory.parent)


class Outbox:
    """The deliveries not yet sent, in a directory that outlives the controller:

        pending/<receiver>/<seq>-<key>.json    to send, in seq order
        sent/<receiver>/<key>                  delivered
        failed/<receiver>/<key>.json           refused for good, with the reason

    Thread-safe; one process at a time per directory."""

    def __init__(self, directory: str | os.PathLike[str], receivers: Sequence[Receiver]) -> None:
        self.directory = Path(directory)
        self.receivers: dict[str, Receiver] = {r.name: r for r in receivers}
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Path]] = {}
        """receiver -> key -> file, in enqueue order."""
        self._seq = 0
        self.unreadable = 0
        """Pending files that could not be read and were moved to `failed/`."""
        _make_dir(self.directory)
        os.chmod(self.directory, 0o700)  # alerts name jobs, nodes and what failed: owner only
        for sub in ("pending", "sent", "failed"):
            _make_dir(self.directory / sub)
        self._recover()

    def _dir(self, sub: str, receiver: str) -> Path:
        return self.directory / sub / receiver

    def _done(self, receiver: str, key: str) -> bool:
        """Whether the receiver's delivery `key` was delivered or set aside already."""
        return ((self._dir("sent", receiver) / key).exists()
                or (self._dir("failed", receiver) / f"{key}.json").exists())

    def _recover(self) -> None:
        for receiver_dir in sorted((self.directory / "pending").iterdir()):
            if not receiver_dir.is_dir():
                continue
            files: dict[str, Path] = {}
            for path in sorted(receiver_dir.glob("*.json")):
                if path.name.startswith("."):
                    continue
                seq_text, _, key = path.stem.partition("-")
                if not seq_text.isdigit() or not key:
                    continue
                self._seq = max(self._seq, int(seq_text) + 1)
                if self._done(receiver_dir.name, key):
                    path.unlink()  # done with, then the controller ended before removing it
                    continue
                files[key] = path
            for leftover in receiver_dir.glob(".*.tmp"):
                leftover.unlink()  # an enqueue interrupted before its rename
            if files:
                self._pending[receiver_dir.name] = files

    def enqueue(self, alert: Alert) -> int:
        """Queue `alert` for every receiver that has not had it (pending, delivered or set
        aside); how many deliveries were queued."""
        key = delivery_key(alert)
        queued = 0
        with self._lock:
            for name, receiver in self.receivers.items():
                if not receiver.takes(alert.job) or not receiver.hears(alert.severity):
                    continue
                pending = self._pending.setdefault(name, {})
                if key in pending or self._done(name, key):
                    continue
                directory = self._dir("pending", name)
                _make_dir(directory)
                delivery = Delivery(receiver=name, key=key, seq=self._seq, alert=alert)
                path = directory / f"{self._seq:016d}-{key}.json"
                _write_atomic(path, msgspec.json.encode(delivery))
                self._seq += 1
                pending[key] = path
                queued += 1
        return queued

    def pending_count(self, receiver: str | None = None) -> int:
        """Deliveries waiting (for `receiver`, or for all)."""
        with self._lock:
            if receiver is not None:
                return len(self._pending.get(receiver, {}))
            return sum(len(files) for files in self._pending.values())

    def receivers_with_pending(self) -> list[str]:
        """Receivers (configured or not) that have deliveries waiting."""
        with self._lock:
            return [name for name, files in self._pending.items() if files]

    def head(self, receiver: str) -> Delivery | None:
        """The receiver's oldest pending delivery, None if there is none. A file that cannot be
        read is moved to `failed/` (and counted in `unreadable`)."""
        while True:
            with self._lock:
                files = self._pending.get(receiver)
                if not files:
                    return None
                key, path = next(iter(files.items()))
                try:
                    return msgspec.json.decode(path.read_bytes(), type=Delivery)
                except (OSError, msgspec.DecodeError) as exc:
                    log.error("alert delivery %s for receiver %s cannot be read, set aside: %s",
                              path, receiver, exc)
                    failed = self._dir("failed", receiver)
                    _make_dir(failed)
                    with contextlib.suppress(OSError):
                        os.replace(path, failed / f"{key}.unreadable")
                        fsync_dir(path.parent)
                    del files[key]
                    self.unreadable += 1

    def mark_sent(self, delivery: Delivery) -> None:
        """The receiver has it: keep the marker, drop the pending file."""
        sent = self._dir("sent", delivery.receiver)
        with self._lock:
            _make_dir(sent)
            _write_atomic(sent / delivery.key, b"")
            self._remove(delivery)

    def set_aside(self, delivery: Delivery, reason: str) -> None:
        """The receiver refused it for good: keep it and the reason in `failed/` for a human."""
        failed = self._dir("failed", delivery.receiver)
        record = {"reason": reason, "delivery": msgspec.to_builtins(delivery)}
        with self._lock:
            _make_dir(failed)
            _write_atomic(failed / f"{delivery.key}.json", msgspec.json.encode(record))
            self._remove(delivery)

    def _remove(self, delivery: Delivery) -> None:
        path = self._pending.get(delivery.receiver, {}).pop(delivery.key, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            fsync_dir(path.parent)
