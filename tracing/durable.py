"""Durable file writes: the one home of write-to-temp, fsync, rename and fsync of the directory.

A crash at any point leaves the old file or the new one, never a part. Used by the controller's
journal and outbox, the checkpoint markers and the snapshots persisted by training ranks. It
never swallows an error: a full disk raises OSError to the caller, which decides what to keep.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_durably(path: Path, data: bytes, *, mode: str = "ab") -> None:
    """Write `data` to `path` (appending by default) and fsync it before returning."""
    with open(path, mode) as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomic(path: Path, data: bytes, *, tmp: Path | None = None) -> None:
    """Replace `path` by `data` so that a crash leaves the old or the new file, never a part:
    written and fsynced to `tmp` (default: a hidden name beside `path` with this process's id,
    so concurrent writers never share one), renamed over `path`, the rename made durable. A
    failed write removes its temporary file."""
    tmp = tmp or path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_durably(tmp, data, mode="wb")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (its entry, not the file's data)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
