"""The backends' own progress (agent/backend.py), from Flight Recorder states played by hand: a
group is reported as `<group>:c10d` only once its backend has held a collective in flight for
`inflight_s` while nothing of the group is pending in the trace, and then at every look; its
collective is named from the Flight Recorder's entries, read once for it."""

from __future__ import annotations

import json

from recorder_fakes import Sink

from tracehound.agent.rank.backend import BackendProgress
from tracehound.agent.rank.recorder import Recorder
from tracehound.tracing.events import Heartbeat, ProcessGroupInfo
from tracehound.tracing.ids import Rank

S = 1_000_000


class FlightRecorder:
    """`_dump_fr_trace_json` of a rank: pg_status as set, entries counted when read."""

    def __init__(self) -> None:
        self.status: dict[str, tuple[int, int]] = {}
        self.entries: list[dict[str, object]] = []
        self.entry_reads = 0

    def __call__(self, with_entries: bool) -> bytes:
        out: dict[str, object] = {"pg_status": {
            uid: {"last_enqueued_collective": str(e), "last_completed_collective": str(c),
                  "last_started_collective": "-1"}
            for uid, (e, c) in self.status.items()}}
        if with_entries:
            self.entry_reads += 1
            out["entries"] = self.entries
        return json.dumps(out).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1_000 * S

    def __call__(self) -> int:
        return self.now


def setup(counted: tuple[str, ...] = ()) -> tuple[Recorder, Sink, FlightRecorder, Clock,
                                                   BackendProgress]:
    sink, clock, fr = Sink(), Clock(), FlightRecorder()
    recorder = Recorder(job="j", attempt=0, node="n", rank=0, sink=sink, clock=clock,
                        heartbeat_s=0.5, inflight_s=1.0)
    progress = BackendProgress(recorder, status=fr, ranks_of=lambda name: (0, 1),
                               counted=lambda name: name in counted)
    return recorder, sink, fr, clock, progress


def looks(progress: BackendProgress, clock: Clock, seconds: float) -> None:
    """Heartbeat wakes every 0.1 s for `seconds`."""
    for _ in range(round(seconds / 0.1)):
        clock.now += S // 10
        progress.look()


def backend_group(recorder: Recorder) -> dict[str, object] | None:
    beat = recorder.heartbeat_record()
    found = [g for g in beat.groups if g.group == "7:c10d"]
    return None if not found else {"enqueued": found[0].last_enqueued,
                                   "completed": found[0].last_completed,
                                   "op": found[0].pending_op,
                                   "since": found[0].last_enqueue_us}


def test_an_untraced_collective_in_flight_for_a_second_is_reported_and_named() -> None:
    recorder, sink, fr, clock, progress = setup()
    fr.entries = [{"pg_id": 3, "process_group": ["7", "undefined"], "collective_seq_id": 4,
                   "profiling_name": "gloo:all_reduce"},
                  {"pg_id": 3, "process_group": ["7", "undefined"], "collective_seq_id": 5,
                   "profiling_name": "gloo:all_gather"}]
    fr.status = {"3": (4, 3)}
    start = clock.now
    looks(progress, clock, 0.8)
    assert backend_group(recorder) is None  # in flight, not for a second yet
    looks(progress, clock, 0.6)
    seen = backend_group(recorder)
    assert seen is not None
    assert seen["enqueued"] == 4 and seen["completed"] == 3 and seen["op"] == "all_reduce"
    assert 0 < int(str(seen["since"])) - start <= S  # first seen at the first look
    infos = [i for i in sink.items if isinstance(i, ProcessGroupInfo)]
    assert [(i.group, i.ranks, i.backend) for i in infos] == [("7:c10d", (0, 1), "c10d")]
    assert fr.entry_reads == 1
    # from then on every look reports it: completed, then the next one, named once it waited
    fr.status = {"3": (4, 4)}
    looks(progress, clock, 0.5)
    assert backend_group(recorder) == {"enqueued": 4, "completed": 4, "op": "",
                                       "since": seen["since"]}
    fr.status = {"3": (5, 4)}
    looks(progress, clock, 0.5)
    assert backend_group(recorder)["op"] == "untraced"  # type: ignore[index]
    looks(progress, clock, 1.0)
    assert backend_group(recorder)["op"] == "all_gather"  # type: ignore[index]
    assert fr.entry_reads == 2
    looks(progress, clock, 3.0)
    assert fr.entry_reads == 2  # once for each collective that stays in flight


def test_a_group_with_a_traced_call_pending_or_counted_by_ddp_is_left_alone() -> None:
    recorder, _, fr, clock, progress = setup()
    fr.entries = [{"pg_id": 3, "process_group": ["7", ""], "collective_seq_id": 4,
                   "profiling_name": "gloo:all_reduce"}]
    fr.status = {"3": (4, 3)}
    token = recorder.begin("7", "all_reduce", 4, "float32")  # the traced call in flight
    looks(progress, clock, 3.0)
    assert backend_group(recorder) is None
    recorder.end(token, True)
    looks(progress, clock, 0.3)
    assert backend_group(recorder) is not None  # still in flight at the backend: reported
    recorder, _, fr, clock, progress = setup(counted=("7",))
    fr.entries, fr.status = [{"pg_id": 3, "process_group": ["7", ""]}], {"3": (4, 3)}
    looks(progress, clock, 3.0)
    assert backend_group(recorder) is None


def test_looks_are_a_heartbeat_apart_and_nothing_in_flight_reads_no_entry() -> None:
    recorder, _, fr, clock, progress = setup()
    calls = []

    def status(with_entries: bool) -> bytes:
        calls.append(with_entries)
        return fr(with_entries)

    progress.status = status
    fr.status = {"3": (9, 9), "4": (2, 2)}
    looks(progress, clock, 5.0)
    assert calls.count(True) == 0
    assert 9 <= len(calls) <= 12  # 0.5 s heartbeats over 5 s, not 50 wakes
    heartbeat: Heartbeat = recorder.heartbeat_record()
    assert heartbeat.groups == () and heartbeat.rank == Rank(0)
