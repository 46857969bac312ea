"""The snapshot container: one rank's training state at one step, as bytes that say what they are.

A snapshot travels from a training rank to the keeper of its node and to a replica on another
node (`agent.node.keeper`), and to disk when it is persisted (`agent.rank.snapshot`). The same
bytes serve all three, so a copy is checked the same way wherever it was found:

    MAGIC (8 bytes) | header length (4 bytes, big endian) | header (JSON) | payload

The header (`SnapshotHeader`) names the job, rank, world size, step and attempt, and carries the
payload's length and BLAKE2b digest. The payload is opaque here (torch's serialization of the
staged state, made and read in the training process); nothing in this module imports torch.

`decode` never returns a damaged or partly written snapshot: a wrong magic, a short payload or a
digest that does not match raises `SnapshotDamaged`, naming what was wrong. `check_identity`
refuses a snapshot of another job, rank or world size (`SnapshotRefused`).
"""

from __future__ import annotations

import hashlib
import struct

import msgspec

MAGIC = b"THSNAP1\n"
"""The first bytes of every snapshot; a version change gets a new magic."""

_LENGTH = struct.Struct(">I")

FRAME = struct.Struct(">Q")
"""A snapshot on a keeper's stream connection: its length, then its bytes. The keeper answers
each with REPLY (0: held; 1: refused, followed by that many bytes of the reason, UTF-8)."""
REPLY = struct.Struct(">BI")
MAX_HEADER_BYTES = 64 * 1024
"""A header longer than this is taken for damage, not read."""


class SnapshotError(ValueError):
    """A snapshot that cannot be used; the message says which and why."""


class SnapshotDamaged(SnapshotError):
    """The bytes are not a whole snapshot: wrong magic, cut short, or a digest mismatch."""


class SnapshotRefused(SnapshotError):
    """A whole snapshot, but of another job, rank, world size or step than the one asked for."""


class SnapshotHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What a snapshot is: whose state, at which step, and how to check the payload."""

    job: str
    rank: int
    world: int
    step: int
    """The number of steps the state has completed (what `load` returns on resume)."""
    attempt: int
    node: str
    """The node of the rank that made it (a replica names its origin)."""
    created_us: int
    payload_bytes: int
    digest: str
    """BLAKE2b (16 bytes) of the payload, hex."""
    codec: str = "torch"
    """How the payload holds the state: "state" (a manifest and raw tensor bytes, no pickle:
    `agent.rank.statecodec`) or "torch" (`torch.save`, read with weights_only)."""

    def describe(self) -> str:
        return (f"snapshot of job {self.job!r} rank {self.rank}/{self.world} step {self.step} "
                f"(attempt {self.attempt}, node {self.node})")


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(SnapshotHeader)


def digest_of(payload: bytes | memoryview) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def encode(*, job: str, rank: int, world: int, step: int, attempt: int, node: str,
           created_us: int, payload: bytes, codec: str = "torch") -> bytes:
    """The container of `payload` with its header."""
    header = SnapshotHeader(job=job, rank=rank, world=world, step=step, attempt=attempt,
                            node=node, created_us=created_us, payload_bytes=len(payload),
                            digest=digest_of(payload), codec=codec)
    head = _ENCODER.encode(header)
    return b"".join((MAGIC, _LENGTH.pack(len(head)), head, payload))


def read_header(data: bytes | memoryview, *,
                source: str = "snapshot") -> tuple[SnapshotHeader, int]:
    """The header and the payload's offset, without checking the payload; SnapshotDamaged when
    the bytes do not start like a snapshot."""
    view = memoryview(data)
    start = len(MAGIC) + _LENGTH.size
    if len(view) < start or bytes(view[:len(MAGIC)]) != MAGIC:
        raise SnapshotDamaged(f"{source}: not a Tracehound snapshot (no {MAGIC!r} magic)")
    (length,) = _LENGTH.unpack(view[len(MAGIC):start])
    if length > MAX_HEADER_BYTES or start + length > len(view):
        raise SnapshotDamaged(f"{source}: header of {length} bytes is cut short or too long")
    try:
        header = _DECODER.decode(view[start:start + length])
    except msgspec.ValidationError as exc:
        raise SnapshotDamaged(f"{source}: unreadable header: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise SnapshotDamaged(f"{source}: unreadable header: {exc}") from exc
    return header, start + length


def decode(data: bytes | memoryview, *,
           source: str = "snapshot") -> tuple[SnapshotHeader, memoryview]:
    """The header and payload of a whole snapshot; SnapshotDamaged, naming `source`, when it is
    cut short or its digest does not match (a partly written or corrupted copy)."""
    header, offset = read_header(data, source=source)
    payload = memoryview(data)[offset:]
    if len(payload) != header.payload_bytes:
        raise SnapshotDamaged(f"{source}: {header.describe()} holds {len(payload)} payload bytes, "
                              f"its header says {header.payload_bytes}: partly written")
    if digest_of(payload) != header.digest:
        raise SnapshotDamaged(f"{source}: {header.describe()} fails its checksum: damaged")
    return header, payload


def check_identity(header: SnapshotHeader, *, job: str, rank: int, world: int, step: int | None,
                   source: str = "snapshot") -> None:
    """SnapshotRefused unless the snapshot is this job's, this rank's and of this world size
    (and of `step`, when given)."""
    wrong = []
    if header.job != job:
        wrong.append(f"job {header.job!r}, expected {job!r}")
    if header.rank != rank:
        wrong.append(f"rank {header.rank}, expected {rank}")
    if header.world != world:
        wrong.append(f"world size {header.world}, expected {world}")
    if step is not None and header.step != step:
        wrong.append(f"step {header.step}, expected {step}")
    if wrong:
        raise SnapshotRefused(f"{source}: refused, it is of {'; '.join(wrong)}")
