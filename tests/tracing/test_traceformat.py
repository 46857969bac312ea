"""The trace file: export from one store kind and load into the other gives the same records;
loading twice stores once; bad lines are named by number and the rest is kept; a newer format
version is refused by name and unknown kinds are counted, not silently dropped."""

from __future__ import annotations

import io
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tracehound.tracing import kinds
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    Incident,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore, bulk, open_store
from tracehound.tracing.traceformat import (
    VERSION,
    TraceFileError,
    export_job,
    load_trace,
)

JOB = JobId("tf")
T = 1_800_000_000_000_000


def every_kind() -> tuple[list[Any], list[Incident], list[Action]]:
    node, group = NodeId("n0"), GroupId("0")
    records: list[Any] = [
        ProcessGroupInfo(job=JOB, attempt=0, rank=Rank(r), group=group, ranks=(0, 1),
                         backend="gloo", time_us=T)
        for r in (0, 1)
    ]
    records += [
        CollectiveEvent(job=JOB, attempt=0, node=node, rank=Rank(r), group=group, seq=s,
                        op="all_reduce", nbytes=64, dtype="float32", peer=-1,
                        state=CollectiveState.COMPLETED, enqueue_us=T + s * 100 + r,
                        complete_us=T + s * 100 + 50)
        for s in range(1, 6) for r in (0, 1)
    ]
    records += [
        Heartbeat(job=JOB, attempt=0, node=node, rank=Rank(r), time_us=T + 900, pid=100 + r,
                  step=5, step_us=T + 800, start_step=0, first_step_us=T + 100, dropped=0,
                  groups=(GroupProgress(group=group, last_enqueued=5, last_completed=5,
                                        pending_op="", last_enqueue_us=T + 500,
                                        last_complete_us=T + 550),))
        for r in (0, 1)
    ]
    records += [
        RankExit(job=JOB, attempt=0, node=node, rank=Rank(1), pid=101, exit_code=-9,
                 time_us=T + 1000),
        HealthSample(job=JOB, node=node, device="gpu0", time_us=T + 950, source="nvml",
                     metric="xid", value=79.0, severity=HealthSeverity.CRITICAL),
        HealthSample(job=JobId(""), node=node, device="host", time_us=T + 960, source="host",
                     metric="temperature_c", value=61.5, severity=HealthSeverity.INFO),
        StackSample(job=JOB, attempt=0, node=node, rank=Rank(0), time_us=T + 970,
                    frames=("train.py:10 main", "torch/distributed.py:1 all_reduce")),
        ProcessSample(job=JOB, attempt=0, node=node, rank=Rank(0), pid=100, time_us=T + 980,
                      state="S", cpu_s=1.5, cpu_rate=0.0, read_bytes=10, write_bytes=20,
                      io_rate=0.0),
    ]
    incident = Incident(job=JOB, incident_id="tf/0/1", attempt=0, detected_at_us=T + 1100,
                        kind="crash", culprit_ranks=(1,), culprit_nodes=("n0",), confidence=0.95,
                        summary="rank 1 killed by signal 9", verdict_json='{"kind": "crash"}')
    actions = [
        Action(job=JOB, incident_id="tf/0/1", kind=ActionKind.ISOLATE_NODE, target="n0",
               time_us=T + 1200, ok=True),
        Action(job=JOB, incident_id="tf/0/1", kind=ActionKind.RESTART, target="1",
               time_us=T + 1300, ok=True, detail="from step 5"),
    ]
    return records, [incident], actions


def fill(store: TraceStore) -> None:
    records, incidents, actions = every_kind()
    store.insert(Batch(batch_id="tf-1", records=tuple(records)))
    for incident in incidents:
        store.record_incident(incident)
    for action in actions:
        store.record_action(action)


def contents(store: TraceStore) -> dict[str, list[Any]]:
    """Every record of the job per kind, in a fixed order, node-wide health included."""
    out: dict[str, list[Any]] = {}
    for layout in kinds.layouts():
        found = bulk(store).records(layout.kind, JOB)
        out[layout.tag] = sorted(found, key=lambda r: json.dumps(kinds.layout(type(r)).rows(
            [r])[0], default=str))
    out["node_wide_health"] = [h for h in store.health(["n0"], 0, 2**62) if not h.job]
    return out


@pytest.fixture
def both_stores(tmp_path: Path, clickhouse_url: str) -> Iterator[dict[str, str]]:
    database = f"tracehound_t{uuid.uuid4().hex[:12]}"
    server = urlsplit(clickhouse_url)._replace(path=f"/{database}").geturl()
    yield {"embedded": f"chdb://{tmp_path / 'chdb'}", "server": server}
    from tracehound.tracing.store.server import ClickHouseServerStore

    cleanup = ClickHouseServerStore(server)
    try:
        cleanup.drop_database()
    finally:
        cleanup.close()


@pytest.mark.clickhouse_server
@pytest.mark.parametrize(("source", "target"), [("embedded", "server"), ("server", "embedded")])
def test_export_then_load_into_the_other_store_kind_gives_the_same_records(
    both_stores: dict[str, str], source: str, target: str
) -> None:
    with open_store(both_stores[source]) as store:
        fill(store)
        before = contents(store)
        file = io.BytesIO()
        exported = export_job(store, JOB, file)
    assert exported.counts["incident"] == 1 and exported.counts["action"] == 2
    assert exported.counts["health"] == 2  # the job's reading and the node-wide one
    with open_store(both_stores[target]) as store:
        file.seek(0)
        report = load_trace(file, "memory", store)
        assert report.rejected == [] and report.unknown_kinds == {}
        assert report.stored == sum(exported.counts.values())
        after = contents(store)
        [incident] = store.incidents(JOB)
        assert [a.kind for a in incident.actions] == [ActionKind.ISOLATE_NODE, ActionKind.RESTART]
        file.seek(0)
        again = load_trace(file, "memory", store)
        assert again.stored == 0
        assert again.already_stored == report.stored
        assert contents(store) == after
    assert after == before


def test_bad_lines_are_named_and_the_rest_is_stored(tmp_path: Path) -> None:
    records, _, _ = every_kind()
    header = json.dumps({"format": "tracehound-trace", "version": VERSION, "job": "tf"})
    lines = [header.encode()]
    from tracehound.tracing.wire import encode_line

    lines += [encode_line(r) for r in records[:4]]
    bad = {**json.loads(encode_line(records[4])), "seq": "three"}
    lines.insert(3, json.dumps(bad).encode())
    lines.insert(2, b'{"type": "gpu_profile_from_the_future", "job": "tf"}')
    lines.insert(2, b"{torn")
    with open_store(f"chdb://{tmp_path / 'chdb'}") as store:
        report = load_trace(io.BytesIO(b"\n".join(lines) + b"\n"), "t.jsonl", store)
        assert report.stored == 4
        assert report.unknown_kinds == {"gpu_profile_from_the_future": 1}
        assert [n for n, _ in report.rejected] == [3, 6]
        assert "field 'seq' must be an integer, got str" in report.rejected[1][1]
        assert len(bulk(store).records(CollectiveEvent, JOB)) == 2


@pytest.mark.parametrize(
    ("first_line", "complaint"),
    [
        (b'{"format": "tracehound-trace", "version": 99, "job": "tf"}',
         "written in trace format version 99; this Tracehound reads versions 1 to 1"),
        (b'{"format": "something-else", "version": 1}', "not a Tracehound trace header"),
        (b"not json", "line 1 is not JSON"),
        (b'{"format": "tracehound-trace", "version": "1", "job": "tf"}',
         "header field 'version' must be a positive integer"),
        (b'{"format": "tracehound-trace", "version": 1}', "header field 'job'"),
    ],
)
def test_a_file_that_is_not_a_readable_trace_is_refused_by_name(
    tmp_path: Path, first_line: bytes, complaint: str
) -> None:
    with open_store(f"chdb://{tmp_path / 'chdb'}") as store, \
            pytest.raises(TraceFileError, match=complaint):
        load_trace(io.BytesIO(first_line + b"\n"), "t.jsonl", store)
