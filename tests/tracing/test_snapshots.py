"""The snapshot container: a round trip holds, and every damaged or foreign copy is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tracehound.tracing.snapshots import (
    MAGIC,
    SnapshotDamaged,
    SnapshotRefused,
    check_identity,
    decode,
    encode,
    read_header,
)


def make(payload: bytes = b"state", **over: object) -> bytes:
    fields: dict[str, object] = {"job": "j1", "rank": 3, "world": 4, "step": 17, "attempt": 1,
                                 "node": "node-1", "created_us": 5, "payload": payload}
    fields.update(over)
    return encode(**fields)  # type: ignore[arg-type]


@given(payload=st.binary(max_size=4096), job=st.text(max_size=20),
       rank=st.integers(0, 10_000), step=st.integers(0, 10**9))
def test_round_trip(payload: bytes, job: str, rank: int, step: int) -> None:
    header, body = decode(make(payload, job=job, rank=rank, step=step))
    assert bytes(body) == payload
    assert (header.job, header.rank, header.step, header.payload_bytes) == (
        job, rank, step, len(payload))


def test_a_cut_copy_is_refused_as_partly_written() -> None:
    data = make(b"x" * 1000)
    with pytest.raises(SnapshotDamaged, match="partly written"):
        decode(data[:-10], source="keeper node-0")


def test_a_flipped_byte_fails_the_checksum_and_names_the_source() -> None:
    data = bytearray(make(b"x" * 1000))
    data[-1] ^= 0xFF
    with pytest.raises(SnapshotDamaged, match=r"file /x/rank-00003.snap: .*rank 3/4 step 17 .*"
                                              r"fails its checksum"):
        decode(bytes(data), source="file /x/rank-00003.snap")


@pytest.mark.parametrize("data", [b"", b"not a snapshot at all", MAGIC + b"\xff\xff\xff\xff"])
def test_what_is_not_a_snapshot_is_damaged_not_a_crash(data: bytes) -> None:
    with pytest.raises(SnapshotDamaged):
        read_header(data)


def test_another_job_rank_or_world_is_refused_with_each_reason() -> None:
    header, _ = decode(make())
    check_identity(header, job="j1", rank=3, world=4, step=17)
    with pytest.raises(SnapshotRefused, match=r"job 'j1', expected 'j2'; world size 4, "
                                              r"expected 8"):
        check_identity(header, job="j2", rank=3, world=8, step=None)
    with pytest.raises(SnapshotRefused, match="step 17, expected 18"):
        check_identity(header, job="j1", rank=3, world=4, step=18)
