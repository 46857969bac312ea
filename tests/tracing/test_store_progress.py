"""The dashboard's two views of an attempt, `progress_grid` and `lateness_series`, run against
every adapter (chdb, a real ClickHouse 18.16 server, and that server in cluster mode) on small
jobs whose every cell, bucket and lateness is worked out by hand below."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    GroupProgress,
    Heartbeat,
    Record,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import TraceStore
from tracehound.tracing.store.sql import PLACEHOLDER, UI_CONSTANTS, UI_QUERIES
from tracehound.tracing.summaries import BucketProgress, ProgressCell, ProgressGrid

T0 = 1_700_000_000_000_000
JOB = JobId("job-grid")


def row(rank: int, group: str, seq: int, enqueue_us: int, *, op: str = "all_reduce",
        peer: int = -1, failed: bool = False, attempt: int = 0, job: str = JOB,
        node: str = "") -> CollectiveEvent:
    return CollectiveEvent(
        job=JobId(job), attempt=attempt, node=NodeId(node or f"node-{rank // 2}"),
        rank=Rank(rank), group=GroupId(group), seq=seq, op=op, nbytes=1024, dtype="float32",
        peer=peer, state=CollectiveState.FAILED if failed else CollectiveState.COMPLETED,
        enqueue_us=enqueue_us, complete_us=enqueue_us + 1_000,
    )


def progress(group: str, enqueued: int, completed: int) -> GroupProgress:
    return GroupProgress(group=GroupId(group), last_enqueued=enqueued, last_completed=completed,
                         pending_op="all_reduce" if enqueued > completed else "",
                         last_enqueue_us=T0, last_complete_us=T0)


def beat(rank: int, time_us: int, *groups: GroupProgress, attempt: int = 0) -> Heartbeat:
    return Heartbeat(job=JOB, attempt=attempt, node=NodeId(f"node-{rank // 2}"), rank=Rank(rank),
                     time_us=time_us, pid=100 + rank, step=1, step_us=T0, start_step=0,
                     first_step_us=T0, dropped=0, groups=groups)


# Group "g" of ranks 0..5, seqs 1..5 of attempt 0. Each seq's arrivals are T0 + seq * 10 ms plus
# the rank's offset; seq 5 was completed by ranks 0..3 only (4 and 5 hang in it), and rank 2 was
# first there. Seq 3: rank 1 ran all_gather against the others' all_reduce. Seq 4: a broadcast
# that failed on rank 3.
OFFSETS = {1: [0, 10, 20, 30, 40, 500], 2: [0, 10, 20, 30, 40, 500],
           3: [0, 10, 20, 30, 40, 500], 4: [0, 10, 20, 30, 40, 500], 5: [50, 60, 0, 30]}


def grid_records() -> list[Record]:
    records: list[Record] = []
    for seq, offsets in OFFSETS.items():
        for rank, offset in enumerate(offsets):
            op = ("all_gather" if (seq, rank) == (3, 1)
                  else "broadcast" if seq == 4 else "all_reduce")
            records.append(row(rank, "g", seq, T0 + seq * 10_000 + offset, op=op,
                               failed=(seq, rank) == (4, 3)))
    # Not of group "g" of attempt 0: another group, the same group in attempt 1 (at higher seqs
    # and ranks), another job.
    records += [row(r, "h", 9, T0 + r) for r in range(8)]
    records += [row(r, "g", 50, T0 + 7 * r, attempt=1) for r in (0, 40)]
    records += [row(0, "g", 70, T0, job="other-job")]
    # Heartbeats: each rank's latest (at T0 + 2 s) shows where it is in "g"; an earlier one (at
    # T0 + 1 s) shows higher numbers, so only reading the latest gives the expected buckets. Ranks
    # 4 and 5 report "g" second. Rank 7 reports only "h": it is not of the bucket progress of
    # "g" and widens no bucket.
    latest = {0: (5, 5), 1: (6, 5), 2: (6, 5), 3: (6, 5), 4: (4, 3), 5: (5, 4)}
    for rank, (enqueued, completed) in latest.items():
        other = progress("h", 9, 9)
        now = progress("g", enqueued, completed)
        records.append(beat(rank, T0 + 2_000_000, *((other, now) if rank >= 4 else (now, other))))
        records.append(beat(rank, T0 + 1_000_000, progress("g", 40, 40)))
    records.append(beat(7, T0 + 2_000_000, progress("h", 9, 9)))
    records.append(beat(30, T0 + 2_000_000, progress("g", 90, 90), attempt=1))
    return records


def fill(store: TraceStore, records: list[Record]) -> None:
    store.insert(Batch(batch_id="b-1", records=tuple(records)))


def test_progress_grid_cells_and_buckets(store: TraceStore) -> None:
    fill(store, grid_records())
    got = store.progress_grid(JOB, 0, "g", last_seqs=3, rank_buckets=4)
    # 6 ranks in 4 buckets: width ceil(6 / 4) = 2; the last 3 seqs up to 5
    assert (got.group, got.width, got.seq_lo, got.seq_hi) == ("g", 2, 3, 5)
    assert got.cells == (
        ProgressCell(bucket=0, seq=3, ranks=2, failed=0, late_max_us=10, late_mean_us=5.0,
                     op="all_gather"),
        ProgressCell(bucket=0, seq=4, ranks=2, failed=0, late_max_us=10, late_mean_us=5.0,
                     op="broadcast"),
        ProgressCell(bucket=0, seq=5, ranks=2, failed=0, late_max_us=60, late_mean_us=55.0,
                     op="all_reduce"),
        ProgressCell(bucket=2, seq=3, ranks=2, failed=0, late_max_us=30, late_mean_us=25.0,
                     op="all_reduce"),
        ProgressCell(bucket=2, seq=4, ranks=2, failed=1, late_max_us=30, late_mean_us=25.0,
                     op="broadcast"),
        ProgressCell(bucket=2, seq=5, ranks=2, failed=0, late_max_us=30, late_mean_us=15.0,
                     op="all_reduce"),
        ProgressCell(bucket=4, seq=3, ranks=2, failed=0, late_max_us=500, late_mean_us=270.0,
                     op="all_reduce"),
        ProgressCell(bucket=4, seq=4, ranks=2, failed=0, late_max_us=500, late_mean_us=270.0,
                     op="broadcast"),
    )
    # The hang's wavefront: ranks 0..3 finished seq 5 and 1..3 wait in seq 6; 4 and 5 are still
    # in seq 5 (rank 4 even finished only seq 3).
    assert got.buckets == (
        BucketProgress(bucket=0, ranks=2, min_completed=5, max_completed=5, max_enqueued=6,
                       pending=1),
        BucketProgress(bucket=2, ranks=2, min_completed=5, max_completed=5, max_enqueued=6,
                       pending=2),
        BucketProgress(bucket=4, ranks=2, min_completed=3, max_completed=4, max_enqueued=5,
                       pending=2),
    )


def test_progress_grid_window_and_bucket_widths(store: TraceStore) -> None:
    fill(store, grid_records())
    # every seq stored (1..5), clamped at the lowest: a window of 64 starts at seq 1
    wide = store.progress_grid(JOB, 0, "g", last_seqs=64)
    assert (wide.width, wide.seq_lo, wide.seq_hi) == (1, 1, 5)
    assert [(c.bucket, c.seq, c.ranks) for c in wide.cells if c.seq == 5] == [
        (0, 5, 1), (1, 5, 1), (2, 5, 1), (3, 5, 1)]
    assert len(wide.cells) == 4 * 6 + 4
    assert [(b.bucket, b.ranks, b.pending) for b in wide.buckets] == [
        (0, 1, 0), (1, 1, 1), (2, 1, 1), (3, 1, 1), (4, 1, 1), (5, 1, 1)]
    # one bucket holds every rank: late_max over all 6 ranks of seq 1, mean of 0..40 and 500
    one = store.progress_grid(JOB, 0, "g", last_seqs=1, rank_buckets=1)
    assert (one.width, one.seq_lo, one.seq_hi) == (6, 5, 5)
    assert one.cells == (ProgressCell(bucket=0, seq=5, ranks=4, failed=0, late_max_us=60,
                                      late_mean_us=35.0, op="all_reduce"),)
    assert one.buckets == (BucketProgress(bucket=0, ranks=6, min_completed=3, max_completed=5,
                                          max_enqueued=6, pending=5),)
    # 6 ranks in 5 buckets: width 2, so only 3 are used
    assert store.progress_grid(JOB, 0, "g", rank_buckets=5).width == 2
    # attempt 1: rows of ranks 0 and 40, a heartbeat of rank 30; 41 ranks in 4 buckets: width 11
    later = store.progress_grid(JOB, 1, "g", rank_buckets=4)
    assert (later.width, later.seq_lo, later.seq_hi) == (11, 50, 50)
    assert later.cells == (
        ProgressCell(bucket=0, seq=50, ranks=1, failed=0, late_max_us=0, late_mean_us=0.0,
                     op="all_reduce"),
        ProgressCell(bucket=33, seq=50, ranks=1, failed=0, late_max_us=280,
                     late_mean_us=280.0, op="all_reduce"),
    )
    assert later.buckets == (BucketProgress(bucket=22, ranks=1, min_completed=90,
                                            max_completed=90, max_enqueued=90, pending=0),)


def test_progress_grid_from_heartbeats_alone_and_of_nothing(store: TraceStore) -> None:
    fill(store, [beat(r, T0, progress("g", 1, 0)) for r in range(3)])
    hung = store.progress_grid(JOB, 0, "g", rank_buckets=2)
    # no op of "g" ended yet: no cells, but every rank waits in seq 1
    assert hung == ProgressGrid(group="g", width=2, seq_lo=0, seq_hi=0, cells=(), buckets=(
        BucketProgress(bucket=0, ranks=2, min_completed=0, max_completed=0, max_enqueued=1,
                       pending=2),
        BucketProgress(bucket=2, ranks=1, min_completed=0, max_completed=0, max_enqueued=1,
                       pending=1),
    ))
    empty = ProgressGrid(group="g", width=1, seq_lo=0, seq_hi=0, cells=(), buckets=())
    assert store.progress_grid(JobId("no-such-job"), 0, "g") == empty
    assert store.progress_grid(JOB, 0, "nope") == ProgressGrid(
        group="nope", width=1, seq_lo=0, seq_hi=0, cells=(), buckets=())


LATE = JobId("job-late")
NODES = {0: "node-a", 1: "node-a", 2: "node-b", 3: "node-c"}
START, WIDTH = T0, 1_000
END = START + 3 * WIDTH


def lateness_records() -> list[Record]:
    """Group "w" of ranks 0..3, seqs 1..3 at START + (seq - 1) ms plus the offsets below; group
    "t" of ranks 0 and 1 once; and rows the series must leave out."""
    offsets = {1: [0, 10, 20, 100], 2: [0, 10, 30, 300], 3: [5, 0, 25, 200]}
    records: list[Record] = []
    for seq, per_rank in offsets.items():
        for rank, offset in enumerate(per_rank):
            records.append(row(rank, "w", seq, START + (seq - 1) * WIDTH + offset, job=LATE,
                               node=NODES[rank], failed=(seq, rank) == (2, 2)))
    records += [row(0, "t", 1, START + 400, job=LATE, node=NODES[0]),
                row(1, "t", 1, START + 450, job=LATE, node=NODES[1])]
    # left out: a seq at the end of the window (rank 0 very late), one before its start (rank 1
    # very late), a send/recv pair (rank 1's recv 890 us after the send), another attempt
    records += [row(r, "w", 4, END + (5_000 if r == 0 else 0), job=LATE, node=NODES[r])
                for r in range(4)]
    records += [row(r, "early", 1, START - 900 + (800 if r == 1 else 0), job=LATE, node=NODES[r])
                for r in range(4)]
    records += [row(0, "0:p2p:0-1", 1, START + 10, op="send", peer=1, job=LATE, node=NODES[0]),
                row(1, "0:p2p:0-1", 1, START + 900, op="recv", peer=0, job=LATE,
                    node=NODES[1])]
    records += [row(r, "w", 1, START + 600 * r, job=LATE, attempt=1, node=NODES[r])
                for r in range(4)]
    return records


def test_lateness_series_of_the_top_ranks_and_the_typical_one(store: TraceStore) -> None:
    fill(store, lateness_records())
    got = store.lateness_series(LATE, 0, START, END, WIDTH, top=2)
    # mean lateness: rank 3 (100 + 300 + 200) / 3 = 200, rank 2 (20 + 30 + 25) / 3 = 25,
    # rank 1 (10 + 50 + 10 + 0) / 4 = 17.5, rank 0 (0 + 0 + 0 + 5) / 4 = 1.25
    assert (got.start_us, got.width_us) == (START, WIDTH)
    assert got.top_rank.tolist() == [3, 2]
    assert got.top_node.tolist() == ["node-c", "node-b"]
    assert got.top_mean_us.tolist() == [200.0, 25.0]
    assert got.top_n.tolist() == [3, 3]
    buckets = [START, START, START + WIDTH, START + WIDTH, START + 2 * WIDTH, START + 2 * WIDTH]
    assert got.bucket_us.tolist() == buckets
    assert got.rank.tolist() == [2, 3, 2, 3, 2, 3]
    assert got.mean_us.tolist() == [20.0, 100.0, 30.0, 300.0, 25.0, 200.0]
    assert got.max_us.tolist() == [20, 100, 30, 300, 25, 200]
    assert got.n.tolist() == [1, 1, 1, 1, 1, 1]
    # upper medians: [0, 0, 10, 20, 50, 100] -> 20, [0, 10, 30, 300] -> 30, [0, 5, 25, 200] -> 25
    assert got.typical_bucket_us.tolist() == [START, START + WIDTH, START + 2 * WIDTH]
    assert got.typical_us.tolist() == [20.0, 30.0, 25.0]
    assert got.typical_n.tolist() == [6, 4, 4]
    bucket_us, mean_us, max_us = got.series(3)
    assert (bucket_us.tolist(), mean_us.tolist(), max_us.tolist()) == (
        buckets[::2], [100.0, 300.0, 200.0], [100, 300, 200])

    everyone = store.lateness_series(LATE, 0, START, END, 3 * WIDTH)
    assert everyone.top_rank.tolist() == [3, 2, 1, 0]
    assert everyone.top_mean_us.tolist() == [200.0, 25.0, 17.5, 1.25]
    assert everyone.top_node.tolist() == ["node-c", "node-b", "node-a", "node-a"]
    # one bucket: per rank its mean and max over the window; all 14 rows' upper median is 20
    assert everyone.bucket_us.tolist() == [START] * 4
    assert everyone.rank.tolist() == [0, 1, 2, 3]
    assert everyone.mean_us.tolist() == [1.25, 17.5, 25.0, 200.0]
    assert everyone.max_us.tolist() == [5, 50, 30, 300]
    assert everyone.n.tolist() == [4, 4, 3, 3]
    assert (everyone.typical_us.tolist(), everyone.typical_n.tolist()) == ([20.0], [14])

    # a window starting mid-bucket names buckets from its own start
    shifted = store.lateness_series(LATE, 0, START + 500, END, WIDTH, top=1)
    assert shifted.top_rank.tolist() == [3]
    assert shifted.bucket_us.tolist() == [START + 500, START + 1_500]
    assert shifted.mean_us.tolist() == [300.0, 200.0]


def test_lateness_series_of_nothing(store: TraceStore) -> None:
    fill(store, lateness_records())
    for got in (store.lateness_series(JobId("no-such-job"), 0, START, END, WIDTH),
                store.lateness_series(LATE, 0, END + 10_000, END + 20_000, WIDTH)):
        assert got.top_rank.shape == got.bucket_us.shape == got.typical_us.shape == (0,)
        assert got.top_node.tolist() == []
        assert got.series(3)[0].tolist() == []


def test_bad_arguments_are_refused_naming_them(store: TraceStore) -> None:
    with pytest.raises(ValueError, match="last_seqs: expected at least 1"):
        store.progress_grid(JOB, 0, "g", last_seqs=0)
    with pytest.raises(ValueError, match="rank_buckets: expected at least 1"):
        store.progress_grid(JOB, 0, "g", rank_buckets=0)
    with pytest.raises(ValueError, match="start_us: expected before end_us"):
        store.lateness_series(LATE, 0, END, END, WIDTH)
    with pytest.raises(ValueError, match="width_us: expected a positive"):
        store.lateness_series(LATE, 0, START, END, 0)
    with pytest.raises(ValueError, match="at most 100000 are allowed"):
        store.lateness_series(LATE, 0, START, START + 200_000, 1)
    with pytest.raises(ValueError, match="top: expected at least 1"):
        store.lateness_series(LATE, 0, START, END, WIDTH, top=0)


NOT_ON_18_16 = ("DateTime64", "Map(", "JSON", "TTL", "CODEC", "LowCardinality", "OVER (", "WITH ",
                "FINAL", "toStartOfInterval")


@pytest.mark.parametrize("sql", UI_QUERIES)
def test_view_queries_keep_to_the_portable_subset_and_bind_every_value(sql: str) -> None:
    for banned in NOT_ON_18_16:
        assert not re.search(r"(?<![A-Za-z])" + re.escape(banned), sql), banned
    assert "'" not in sql
    names = {name for name, _ in PLACEHOLDER.findall(sql)}
    assert {"job", "attempt"} <= names
    allowed = {"job", "attempt", "group", "width", "seq_lo", "seq_hi", "start_us", "end_us",
               "origin_us", "width_us", "top"}
    assert names <= allowed | set(UI_CONSTANTS)


def test_views_on_many_ranks_group_into_the_buckets_asked_for(store: TraceStore) -> None:
    """1,000 ranks in 256 buckets: width 4, bucket k * 4 holds ranks 4k..4k+3."""
    ranks = np.arange(1_000)
    fill(store, [row(int(r), "world", 1, T0 + int(r) % 7) for r in ranks]
         + [beat(int(r), T0, progress("world", 2, 1 if r % 3 else 2)) for r in ranks])
    got = store.progress_grid(JOB, 0, "world")
    assert (got.width, got.seq_lo, got.seq_hi) == (4, 1, 1)
    assert [c.bucket for c in got.cells] == list(range(0, 1_000, 4))
    assert {c.ranks for c in got.cells} == {4}
    late = [max(int(r) % 7 for r in range(b, b + 4)) for b in range(0, 1_000, 4)]
    assert [c.late_max_us for c in got.cells] == late
    assert [b.bucket for b in got.buckets] == list(range(0, 1_000, 4))
    assert [b.pending for b in got.buckets] == [
        sum(1 for r in range(b, b + 4) if r % 3) for b in range(0, 1_000, 4)]
