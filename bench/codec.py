"""How fast records are encoded and decoded (with validation): the hand-written codec that
Tracehound had before records were declared once (`bench/legacy_wire.py`) against the msgspec
codec derived from the declarations (`tracehound.tracing.wire`), side by side in one run on the
same records; and how many records per second the node agent takes in from its ranks.

    .venv/bin/python bench/codec.py              # 200,000 records, best of 3 rounds
    .venv/bin/python bench/codec.py --records 50000 --json

The mix is what a node agent sees: mostly collective events, a heartbeat per rank every half
second (with its groups' progress), and a few process and stack samples. The "embedded path"
figure is the decode and encode work a record costs from the rank's line to the ingest endpoint:
before, the agent validated it, the shipper decoded it again from the spool and re-encoded the
batch, and the endpoint decoded it a third time; now the agent validates it, the shipper checks
the line is whole JSON and joins lines, and the endpoint decodes it once. Figures only; nothing
here fails on time.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import legacy_wire as old

from tracehound.agent.node.daemon import NodeAgent
from tracehound.agent.node.spool import Spool
from tracehound.tracing import wire as new
from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    Heartbeat,
    ProcessSample,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank

T0 = 1_800_000_000_000_000


def mix(n: int) -> list[Any]:
    """`n` records: 90% collectives, 8% heartbeats with 4 groups, 1% process, 1% stack samples."""
    job, node = JobId("bench"), NodeId("node-0001")
    out: list[Any] = []
    for i in range(n):
        rank = Rank(i % 8)
        kind = i % 100
        if kind < 90:
            out.append(CollectiveEvent(
                job=job, attempt=0, node=node, rank=rank, group=GroupId(f"dp-{i % 4}"),
                seq=1 + i // 8, op="all_reduce", nbytes=1 << 20, dtype="bfloat16", peer=-1,
                state=CollectiveState.COMPLETED, enqueue_us=T0 + i * 10,
                complete_us=T0 + i * 10 + 900))
        elif kind < 98:
            out.append(Heartbeat(
                job=job, attempt=0, node=node, rank=rank, time_us=T0 + i * 10, pid=4000 + rank,
                step=i // 800, step_us=T0 + i * 9, start_step=0, first_step_us=T0 + 5,
                dropped=0, groups=tuple(
                    GroupProgress(group=GroupId(f"g{g}"), last_enqueued=i, last_completed=i - 1,
                                  pending_op="all_reduce", last_enqueue_us=T0 + i,
                                  last_complete_us=T0 + i - 5)
                    for g in range(4))))
        elif kind < 99:
            out.append(ProcessSample(
                job=job, attempt=0, node=node, rank=rank, pid=4000 + rank, time_us=T0 + i * 10,
                state="R", cpu_s=12.5, cpu_rate=0.97, read_bytes=1 << 30, write_bytes=1 << 20,
                io_rate=1e6))
        else:
            out.append(StackSample(
                job=job, attempt=0, node=node, rank=rank, time_us=T0 + i * 10,
                frames=tuple(f"/opt/train/model.py:{100 + f} layer_{f}" for f in range(24))))
    return out


def best(rounds: int, work: Callable[[], object]) -> float:
    """The fastest of `rounds` runs of `work`, in seconds."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times)


def old_line(record: Any) -> bytes:
    return json.dumps(old.encode(record), separators=(",", ":")).encode()


def old_embedded_path(lines: list[bytes]) -> None:
    """Agent validation, spool read decode, batch re-encode, ingest decode (the old code)."""
    validated = [old.decode(json.loads(line)) for line in lines]  # node agent
    del validated
    spooled = [old.decode(json.loads(line)) for line in lines]  # shipper reads the segment
    body = old.encode_batch(Batch(batch_id="b", records=tuple(spooled)))
    old.decode_batch(body)  # ingest endpoint


def new_embedded_path(lines: list[bytes]) -> None:
    """Agent validation, a syntax scan of the spool lines, joining, one ingest decode."""
    import msgspec

    for line in lines:  # node agent
        new.decode_line(line)
    for line in lines:  # shipper reads the segment
        msgspec.json.decode(line, type=msgspec.Raw)
    new.decode_batch(new.batch_of_lines("b", lines))  # ingest endpoint


class _NullSink:
    def send(self, batch: Any, *, maybe_duplicate: bool) -> int:
        return 0


def agent_ingest_rate(lines: list[bytes], rounds: int) -> float:
    """Records per second `NodeAgent.receive` validates and appends to its spool on disk."""
    logging.getLogger("tracehound").setLevel(logging.ERROR)
    chunk = 512
    best_s = float("inf")
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as tmp:
            spool = Spool(Path(tmp) / "spool", node="node-0001", seal_records=5000)
            agent = NodeAgent(job="bench", node="node-0001", socket_path=f"{tmp}/s",
                              spool=spool, sink=_NullSink())
            start = time.perf_counter()
            for i in range(0, len(lines), chunk):
                agent.receive(lines[i:i + chunk])
            spool.maybe_seal(force=True)
            best_s = min(best_s, time.perf_counter() - start)
            spool.close()
    return len(lines) / best_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    records = mix(args.records)
    new_lines = [new.encode_line(r) for r in records]
    old_lines = [old_line(r) for r in records]
    # Both codecs read each other's lines: the wire form did not change.
    assert [json.loads(a) for a in old_lines[:500]] == [json.loads(b) for b in new_lines[:500]]
    assert [new.decode_line(line) for line in old_lines[:500]] == records[:500]
    n = len(records)
    figures = {
        "records": n,
        "encode_old_per_s": n / best(args.rounds, lambda: [old_line(r) for r in records]),
        "encode_new_per_s": n / best(args.rounds, lambda: [new.encode_line(r) for r in records]),
        "decode_old_per_s": n / best(args.rounds, lambda: [
            old.decode(json.loads(line)) for line in old_lines]),
        "decode_new_per_s": n / best(args.rounds, lambda: [
            new.decode_line(line) for line in new_lines]),
        "batch_decode_old_per_s": n / best(args.rounds, lambda: old.decode_batch(
            old.encode_batch(Batch(batch_id="b", records=tuple(records))))),
        "batch_decode_new_per_s": n / best(args.rounds, lambda: new.decode_batch(
            new.batch_of_lines("b", new_lines))),
        "embedded_path_old_per_s": n / best(args.rounds, lambda: old_embedded_path(old_lines)),
        "embedded_path_new_per_s": n / best(args.rounds, lambda: new_embedded_path(new_lines)),
        "node_agent_ingest_per_s": agent_ingest_rate(new_lines, args.rounds),
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"{n} records (90% collectives, 8% heartbeats, 1% process, 1% stack samples), "
          f"best of {args.rounds} rounds, one core")
    print(f"{'':28} {'old (json + hand-written)':>26} {'new (msgspec)':>15} {'ratio':>7}")
    for label, key in (("encode, records/s", "encode"), ("decode + validate, records/s",
                       "decode"), ("batch decode, records/s", "batch_decode"),
                       ("embedded path, records/s", "embedded_path")):
        o, w = figures[f"{key}_old_per_s"], figures[f"{key}_new_per_s"]
        print(f"{label:28} {o:26,.0f} {w:15,.0f} {w / o:6.1f}x")
    print(f"node agent ingest (validate + spool to disk): "
          f"{figures['node_agent_ingest_per_s']:,.0f} records/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
