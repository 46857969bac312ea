"""The server store in cluster mode, on a real two-shard cluster: the test server defines the
cluster `tracehound_test` on itself (two shards at its own port, each replica with its own
default_database), so every shard's local table can be read directly here.

The contract suite runs in cluster mode too (the `cluster` param of `store_url`); this file checks
what only a cluster has: where the rows land, that reads gather every shard, that a retried
batch is not doubled across shards, retention on every shard, and the errors of a cluster URL.
The ON CLUSTER DDL mode cannot run here (the server has no ZooKeeper): its statements are
checked as text, and its refusal on this server is checked for its advice.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from clickhouse_driver import Client

from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.events import (
    Batch,
    CollectiveEvent,
    CollectiveState,
    Heartbeat,
    JobPhase,
    JobState,
)
from tracehound.tracing.ids import GroupId, JobId, NodeId, Rank
from tracehound.tracing.store import InsertReport, TraceStore, bulk, mask_url, open_store
from tracehound.tracing.store.cluster import ClusterLayout, Replica
from tracehound.tracing.store.schema import COLLECTIVES, HEALTH, table_of, tables
from tracehound.tracing.store.urls import ClusterDdl, ClusterSpec, parse_server_url

# every test here shares the test server's shard databases with the other cluster-mode tests
pytestmark = [pytest.mark.clickhouse_cluster, pytest.mark.xdist_group("clickhouse-cluster")]

JOBS = (JobId("job-a"), JobId("job-b"))
RANKS = range(8)
SEQS = range(1, 6)
DAY_US = 86_400 * 1_000_000
Values = set[tuple[object, ...]]
T0 = int(dt.datetime(2026, 11, 1, 12, tzinfo=dt.UTC).timestamp()) * 1_000_000


def collective(job: JobId, rank: int, seq: int) -> CollectiveEvent:
    return CollectiveEvent(
        job=job, attempt=0, node=NodeId(f"node-{rank // 2}"), rank=Rank(rank),
        group=GroupId("0"), seq=seq, op="all_reduce", nbytes=4096, dtype="float32", peer=-1,
        state=CollectiveState.COMPLETED, enqueue_us=T0 + seq * 1000 + rank,
        complete_us=T0 + seq * 1000 + 500,
    )


def heartbeat(rank: int, time_us: int) -> Heartbeat:
    return Heartbeat(job=JOBS[0], attempt=0, node=NodeId("n"), rank=Rank(rank), time_us=time_us,
                     pid=100 + rank, step=1, step_us=time_us, start_step=0,
                     first_step_us=time_us, dropped=0)


@pytest.fixture
def server(cluster_url: str) -> Iterator[Client]:
    """A plain client of the test server, to look at the shards' local tables directly."""
    address = parse_server_url(cluster_url)
    client = Client(host=address.host, port=address.port, user=address.user,
                    password=address.password)
    try:
        yield client
    finally:
        client.disconnect()


@pytest.fixture
def shard_databases(server: Client, cluster_url: str) -> list[str]:
    """The database of each shard's local tables (its replica's default_database), by shard."""
    spec = parse_server_url(cluster_url).cluster
    assert spec is not None
    rows = server.execute(
        "SELECT shard_num, default_database FROM system.clusters WHERE cluster = %(c)s "
        "ORDER BY shard_num", {"c": spec.name})
    assert [shard for shard, _ in rows] == [1, 2], "the test cluster has two shards"
    return [str(database) for _, database in rows]


@pytest.fixture
def cluster_store(cluster_url: str) -> Iterator[TraceStore]:
    store = open_store(cluster_url)
    try:
        yield store
    finally:
        store.close()


def per_shard(server: Client, databases: list[str], table: str, by: str) -> list[Values]:
    """The distinct values of `by` (a column list) in each shard's `table`_local."""
    return [{tuple(r) for r in server.execute(f"SELECT DISTINCT {by} FROM {db}.{table}_local")}
            for db in databases]


def count_per_shard(server: Client, databases: list[str], table: str) -> list[int]:
    return [server.execute(f"SELECT count() FROM {db}.{table}_local")[0][0] for db in databases]


@pytest.mark.clickhouse_server
def test_rows_are_sharded_by_job_and_rank_over_both_shards(
    cluster_store: TraceStore, server: Client, shard_databases: list[str]
) -> None:
    records = [collective(job, rank, seq) for job in JOBS for rank in RANKS for seq in SEQS]
    assert cluster_store.insert(Batch(batch_id="b1", records=tuple(records))) == InsertReport(
        inserted=len(records), skipped=0)

    counts = count_per_shard(server, shard_databases, "collectives")
    assert sum(counts) == len(records) and min(counts) > 0, counts
    placed = per_shard(server, shard_databases, "collectives", "job, rank")
    assert not placed[0] & placed[1], "one rank's rows all on one shard"
    assert placed[0] | placed[1] == {(job, rank) for job in JOBS for rank in RANKS}
    # The Distributed engine's choice: shard index = key % shards (both weigh 1).
    expected = server.execute(
        "SELECT job, rank, cityHash64(job, rank) % 2 FROM "
        f"{shard_databases[0]}.collectives_local UNION ALL SELECT job, rank, "
        f"cityHash64(job, rank) % 2 FROM {shard_databases[1]}.collectives_local")
    for job, rank, shard in expected:
        assert (job, rank) in placed[shard]
    for job in JOBS:
        assert {r for j, r in placed[0] if j == job} and {r for j, r in placed[1] if j == job}, (
            f"the ranks of {job} spread over both shards")

    # A table without a rank is sharded by job alone.
    for i, job in enumerate(JOBS):
        cluster_store.record_state(JobState(job=job, time_us=T0 + i, seq=1,
                                            state=JobPhase.RUNNING, attempt=0))
    by_job = per_shard(server, shard_databases, "job_states", "job")
    assert sum(count_per_shard(server, shard_databases, "job_states")) == len(JOBS)
    assert not by_job[0] & by_job[1]


@pytest.mark.clickhouse_server
def test_reads_through_the_store_see_every_shard(
    cluster_store: TraceStore, server: Client, shard_databases: list[str]
) -> None:
    records = [collective(job, rank, seq) for job in JOBS for rank in RANKS for seq in SEQS]
    cluster_store.insert(Batch(batch_id="b1", records=tuple(records)))
    assert min(count_per_shard(server, shard_databases, "collectives")) > 0
    assert cluster_store.jobs() == sorted(JOBS)
    for job in JOBS:
        keys = sorted((k.rank, k.seq) for k in bulk(cluster_store).collective_keys(job))
        assert keys == [(rank, seq) for rank in RANKS for seq in SEQS]
        stats = cluster_store.rank_stats(job, 0, T0, T0 + DAY_US)
        assert stats.rank.tolist() == list(RANKS)
        assert stats.n.tolist() == [len(SEQS)] * len(RANKS)
        assert stats.last_count.tolist() == [0] * 7 + [len(SEQS)], "rank 7 enqueues last"
    beats = [heartbeat(rank, T0 + t) for rank in RANKS for t in (1, 2, 3)]
    cluster_store.insert(Batch(batch_id="hb", records=tuple(beats)))
    latest = cluster_store.latest_heartbeats(JOBS[0], 0)
    assert [(h.rank, h.time_us) for h in latest] == [(rank, T0 + 3) for rank in RANKS]


@pytest.mark.clickhouse_server
def test_a_retried_batch_is_not_doubled_across_shards(
    cluster_store: TraceStore, server: Client, shard_databases: list[str]
) -> None:
    records = tuple(collective(JOBS[0], rank, seq) for rank in RANKS for seq in SEQS)
    batch = Batch(batch_id="retried", records=records)
    # A first try that stored only its first steps (both shards hold part of it) ...
    part = tuple(r for r in records if r.seq <= 2)
    cluster_store.insert(Batch(batch_id="retried", records=part))
    assert min(count_per_shard(server, shard_databases, "collectives")) > 0
    # ... then the retry adds only what is missing, and a second retry nothing.
    assert cluster_store.insert(batch, maybe_duplicate=True) == InsertReport(
        inserted=len(records) - len(part), skipped=len(part))
    assert cluster_store.insert(batch, maybe_duplicate=True) == InsertReport(
        inserted=0, skipped=len(records))
    assert sum(count_per_shard(server, shard_databases, "collectives")) == len(records)
    assert len(bulk(cluster_store).collective_keys(JOBS[0])) == len(records)


@pytest.mark.clickhouse_server
def test_retention_drops_old_days_on_every_shard(
    cluster_store: TraceStore, server: Client, shard_databases: list[str]
) -> None:
    for day in range(3):
        beats = tuple(heartbeat(rank, T0 + day * DAY_US) for rank in RANKS)
        cluster_store.insert(Batch(batch_id=f"d{day}", records=beats))

    def days() -> list[Values]:
        return [{tuple(r) for r in server.execute(
            "SELECT DISTINCT partition FROM system.parts WHERE database = %(d)s "
            "AND table = 'heartbeats_local' AND active", {"d": db})} for db in shard_databases]

    assert days() == [{("20261101",), ("20261102",), ("20261103",)}] * 2
    assert cluster_store.drop_days_before(20261103, dry_run=True) == {
        "heartbeats": [20261101, 20261102]}
    assert days() == [{("20261101",), ("20261102",), ("20261103",)}] * 2, "a dry run drops nothing"
    assert cluster_store.drop_days_before(20261103) == {"heartbeats": [20261101, 20261102]}
    assert days() == [{("20261103",)}] * 2
    assert len(cluster_store.latest_heartbeats(JOBS[0], 0)) == len(RANKS)
    assert cluster_store.drop_days_before(20261103) == {}


@pytest.mark.parametrize(
    ("query", "complaint"),
    [
        ("cluster=bad-name", "parameter 'cluster' is 'bad-name'"),
        ("cluster=", "parameter 'cluster' is ''"),
        ("cluster=1st", "parameter 'cluster' is '1st'"),
        ("cluster=c&ddl=sometimes", "parameter 'ddl' is 'sometimes'; expected one of "
         "on_cluster, per_shard"),
        ("ddl=per_shard", "parameter 'ddl' needs a cluster"),
        ("clustr=c", "unknown parameter 'clustr'"),
        ("cluster=a&cluster=b", "parameter 'cluster' is given 2 times"),
    ],
)
def test_a_bad_cluster_parameter_is_refused_naming_it(query: str, complaint: str) -> None:
    url = f"clickhouse://u:secret@ch.example:9000/db?{query}"
    with pytest.raises(StoreConfigError) as caught:
        open_store(url)
    message = str(caught.value)
    assert f"clickhouse://u:***@ch.example:9000/db?{query}" in message
    assert complaint in message
    assert "secret" not in message


def test_the_cluster_and_ddl_mode_come_from_the_url() -> None:
    assert parse_server_url("clickhouse://h/db").cluster is None
    assert parse_server_url("clickhouse://h/db?cluster=c1").cluster == ClusterSpec(
        "c1", ClusterDdl.ON_CLUSTER)
    assert parse_server_url("clickhouse://h/db?cluster=c1&ddl=per_shard").cluster == (
        ClusterSpec("c1", ClusterDdl.PER_SHARD))


@pytest.mark.clickhouse_server
@pytest.mark.parametrize("ddl", ["", "&ddl=per_shard"])
def test_a_cluster_the_server_does_not_define_is_a_clear_error(
    cluster_url: str, test_cluster: str, ddl: str
) -> None:
    url = urlsplit(cluster_url)._replace(query=f"cluster=no_such_cluster{ddl}").geturl()
    with pytest.raises(StoreConfigError) as caught:
        open_store(url)
    message = str(caught.value)
    assert mask_url(url) in message
    assert "parameter 'cluster' names 'no_such_cluster'" in message
    assert f"it defines {test_cluster}" in message


@pytest.mark.clickhouse_server
def test_on_cluster_ddl_on_a_server_without_it_suggests_per_shard(cluster_url: str) -> None:
    url = urlsplit(cluster_url)._replace(query=urlsplit(cluster_url).query.replace(
        "&ddl=per_shard", "")).geturl()
    with pytest.raises(StoreConfigError) as caught:
        open_store(url)
    message = str(caught.value)
    assert mask_url(url) in message and "could not run ON CLUSTER DDL" in message
    assert "&ddl=per_shard" in message


def test_on_cluster_statements() -> None:
    """The ON CLUSTER mode's DDL as text (it cannot run on this server): local tables of the
    same engine on every host, Distributed tables of the plain names over them, sharded by job
    and rank where there is a rank."""
    local = COLLECTIVES.local.create_statement("db", on_cluster="c")
    assert local.startswith("CREATE TABLE IF NOT EXISTS db.collectives_local ON CLUSTER c (")
    assert "ENGINE = ReplacingMergeTree" in local
    distributed = COLLECTIVES.distributed_statement(
        "db", cluster="c", local_database="db", on_cluster="c")
    assert distributed.startswith("CREATE TABLE IF NOT EXISTS db.collectives ON CLUSTER c (")
    assert distributed.endswith(
        "ENGINE = Distributed(c, db, collectives_local, cityHash64(job, rank))")
    assert HEALTH.distributed_statement("db", cluster="c", local_database=None).endswith(
        "ENGINE = Distributed(c, '', health_local, cityHash64(job))")
    assert table_of(JobState).sharding_key == "cityHash64(job)"
    assert all(t.sharding_key.startswith("cityHash64(job") for t in tables())
    with pytest.raises(StoreConfigError):
        COLLECTIVES.distributed_statement("db", cluster="c-1", local_database=None)


def test_per_shard_needs_every_replica_or_none_to_name_a_default_database() -> None:
    def unused(sql: str, params: object) -> list[object]:
        raise AssertionError("no query expected")

    layout = ClusterLayout(ClusterSpec("c", ClusterDdl.PER_SHARD), database="db",
                           shown_url="clickhouse://h/db?cluster=c&ddl=per_shard",
                           entry=unused, connect=unused)  # type: ignore[arg-type]
    named = Replica(shard=1, host="a", port=9000, database="s1", default_database="s1")
    plain = Replica(shard=2, host="b", port=9000, database="db", default_database="")
    assert layout._shard_database([named]) is None
    assert layout._shard_database([plain]) == "db"
    with pytest.raises(StoreConfigError, match=r"not for b:9000 \(shard 2\)"):
        layout._shard_database([named, plain])
