"""An embedded store held by one real process and used by another (this test process) through the
holder's endpoint (`tracing.store.sharing`, `tracing.store.client`): the endpoint file, what
each side sees of the other's writes, a file left by a dead holder, a wrong token, a holder that
stops answering or dies during a call, and one that shares nothing."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from holder_harness import StoreHolder
from test_store_contract import JOB, collective, heartbeat, incident

from tracehound.tracing.errors import PermanentStoreError, StoreConfigError, TemporaryStoreError
from tracehound.tracing.events import Batch
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import InsertReport, open_store
from tracehound.tracing.store.client import SharedStoreClient
from tracehound.tracing.store.embedded import EmbeddedClickHouseStore
from tracehound.tracing.store.ingest import IngestServer
from tracehound.tracing.store.sharing import (
    ENDPOINT_FILE,
    Endpoint,
    endpoint_path,
    open_embedded,
    read_endpoint,
    sharing,
    write_endpoint,
)


@pytest.fixture
def holder(store_holder: StoreHolder) -> Iterator[StoreHolder]:
    """The session's holder process, holding nothing again after the test."""
    yield store_holder
    if store_holder.holding is not None:
        store_holder.release()


def test_the_holder_and_a_reader_process_share_one_store(holder: StoreHolder,
                                                         tmp_path: Path) -> None:
    url = f"chdb://{tmp_path / 'store'}"
    address = holder.hold(url)
    where = endpoint_path(str(tmp_path / "store"))
    # the endpoint file: the holder's, its user's alone
    info = os.stat(where)
    assert (oct(info.st_mode & 0o777), info.st_uid) == (oct(0o600), os.getuid())
    published = json.loads(where.read_text())
    assert (published["pid"], published["url"], published["store"]) == (
        holder.pid, address, str(tmp_path / "store"))
    assert len(published["token"]) >= 32
    assert not list((tmp_path / "store").glob(f".{ENDPOINT_FILE}*"))  # no temporary left

    reader = open_store(url)
    assert isinstance(reader, SharedStoreClient)
    beat = heartbeat(0, 1_700_000_000_000_000)
    batch = Batch(batch_id="b1", records=(collective(0, 1), collective(1, 1), beat))
    assert reader.insert(batch) == InsertReport(inserted=3, skipped=0)
    reader.record_incident(incident(JOB, "i-1", 1_000))
    assert reader.jobs() == [JOB]

    # The holder stops sharing and closes (its file goes), then shares again (a new port and
    # token) before the reader calls: the reader follows the file to it.
    holder.release()
    assert not where.exists()
    again = holder.hold(url)
    assert again != address
    assert reader.latest_heartbeats(JOB, 0) == [beat]
    assert reader.endpoint.url == again

    # The holder lets go for good (a job's `tracehound instrument` ends with the job, while a
    # watcher or the dashboard goes on): the reader's next call, refused before it was sent,
    # finds no process holding the directory. It opens the store itself, runs the call there
    # and shares the store in turn, so the machine's other processes read it through this one.
    holder.release()
    assert reader.jobs() == [JOB]
    taken = read_endpoint(str(tmp_path / "store"))
    assert taken is not None and taken.pid == os.getpid()
    assert holder.jobs(url) == [JOB]
    reader.record_incident(incident(JOB, "i-2", 2_000))
    reader.close()  # it stops sharing and lets go
    assert not where.exists()

    # Nobody holds the directory: this process opens it itself and finds what went through.
    with open_store(url) as direct:
        assert isinstance(direct, EmbeddedClickHouseStore)
        assert direct.jobs() == [JOB]
        assert [i.incident_id for i in direct.incidents(JOB)] == ["i-1", "i-2"]
        assert len(direct.collective_keys(JOB)) == 2
    with pytest.raises(PermanentStoreError, match="this client is closed"):
        reader.jobs()


def test_a_file_naming_a_live_process_that_holds_nothing_is_stale(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    with open_store(f"chdb://{directory}"):
        pass  # a store made and let go
    forged = Endpoint(version=1, url="http://127.0.0.1:9", token="t" * 32, pid=os.getppid(),
                      store=str(directory), started_us=1)
    write_endpoint(str(directory), forged)
    with open_store(f"chdb://{directory}") as store:
        assert isinstance(store, EmbeddedClickHouseStore)  # opened here, the file not trusted
        assert not endpoint_path(str(directory)).exists()  # and removed


def test_a_wrong_token_or_an_open_file_is_refused(holder: StoreHolder, tmp_path: Path) -> None:
    directory = str(tmp_path / "store")
    url = f"chdb://{directory}"
    holder.hold(url)
    true = read_endpoint(directory)
    assert true is not None
    write_endpoint(directory, msgspec.structs.replace(true, token="not-the-token"))
    with pytest.raises(StoreConfigError) as caught:
        open_store(url)
    message = str(caught.value)
    assert url in message and f"held by pid {holder.pid}" in message
    assert f"refused the token of {endpoint_path(directory)}" in message
    assert "not-the-token" not in message

    write_endpoint(directory, true)
    endpoint_path(directory).chmod(0o644)
    with pytest.raises(StoreConfigError) as caught:
        open_store(url)
    assert f"endpoint file {endpoint_path(directory)} has mode 0644" in str(caught.value)
    assert "expected 0600" in str(caught.value)
    endpoint_path(directory).chmod(0o600)
    with open_store(url) as reader:
        assert isinstance(reader, SharedStoreClient) and reader.jobs() == []


def test_the_holders_refusals_keep_their_class(holder: StoreHolder, tmp_path: Path) -> None:
    url = f"chdb://{tmp_path / 'store'}"
    holder.hold(url, create=False)  # no schema: every query is refused
    reader = open_store(url, create=False)
    assert isinstance(reader, SharedStoreClient)
    with pytest.raises(PermanentStoreError) as caught:
        reader.exits(JobId("j"), 0)
    message = str(caught.value)
    assert f"embedded store {url} (held by pid {holder.pid}, shared at" in message
    assert f"embedded store {tmp_path / 'store'} refused the request" in message
    reader.ensure_schema()
    assert reader.exits(JobId("j"), 0) == []
    with pytest.raises(ValueError, match="rank_buckets: expected at least 1"):
        reader.progress_grid(JOB, 0, "0", rank_buckets=0)
    with pytest.raises(TypeError, match="a batch may not carry 'incident' records"):
        reader.insert(Batch(batch_id="x", records=(incident(JOB, "i", 1),)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="day: expected a date as YYYYMMDD"):
        reader.drop_days_before(5)


def test_a_holder_that_shares_nothing_is_waited_for_then_named(holder: StoreHolder,
                                                               tmp_path: Path) -> None:
    directory = str(tmp_path / "store")
    holder.hold(f"chdb://{directory}", share=False)
    ticks = itertools.count()
    waits: list[float] = []
    with pytest.raises(StoreConfigError) as caught:
        open_embedded(f"chdb://{directory}", wait_s=3.0, clock=lambda: next(ticks) * 0.5,
                      sleep=waits.append)
    message = str(caught.value)
    assert f"embedded store {directory} is held by another process (pid " \
           f"{holder.pid})" in message
    assert f"shares it with no process (no {ENDPOINT_FILE})" in message
    assert waits and all(w == waits[0] for w in waits)  # it looked again, then gave up

    # A file left by an earlier holder names a process that does not hold it: not trusted.
    write_endpoint(directory, Endpoint(version=1, url="http://127.0.0.1:9", token="x" * 32,
                                       pid=os.getpid(), store=directory, started_us=1))
    ticks = itertools.count()
    with pytest.raises(StoreConfigError) as caught:
        open_embedded(f"chdb://{directory}", wait_s=1.0, clock=lambda: next(ticks) * 0.5,
                      sleep=lambda _s: None)
    assert f"names pid {os.getpid()}, which does not hold it: stale, not trusted" in str(
        caught.value)

    # A file naming the holder, but nothing answers at its address: looked at again, then said.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{closed.getsockname()[1]}"
    write_endpoint(directory, Endpoint(version=1, url=nobody, token="x" * 32, pid=holder.pid,
                                       store=directory, started_us=1))
    ticks = itertools.count()
    looks: list[float] = []
    with pytest.raises(TemporaryStoreError) as refused:
        open_embedded(f"chdb://{directory}", wait_s=1.0, clock=lambda: next(ticks) * 0.5,
                      sleep=looks.append)
    assert f"(held by pid {holder.pid}, shared at {nobody})" in str(refused.value)
    assert "nothing answers there (connection refused)" in str(refused.value)
    assert looks


def _connected_to(port: int) -> bool:
    """Whether a TCP connection to `port` on this machine is established (its far side may be a
    stopped process: the kernel accepts it anyway)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in rows.read().splitlines()[1:]:
                fields = row.split()
                if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                    return True
    return False


def test_a_holder_that_stops_answering_then_dies_during_a_call(tmp_path: Path) -> None:
    holder = StoreHolder()
    url = f"chdb://{tmp_path / 'store'}"
    try:
        holder.hold(url)
        endpoint = read_endpoint(str(tmp_path / "store"))
        assert endpoint is not None
        patient = open_store(url)
        impatient = SharedStoreClient.connect(url, endpoint, timeout_s=0.5)
        assert isinstance(patient, SharedStoreClient) and patient.jobs() == []

        os.kill(holder.pid, signal.SIGSTOP)
        with pytest.raises(TemporaryStoreError) as caught:
            impatient.jobs()
        message = str(caught.value)
        assert f"{url} (held by pid {holder.pid}" in message
        assert "no answer to jobs within 0.5 s" in message
        assert f"pid {holder.pid} is still running" in message

        outcome: list[BaseException | object] = []

        def call() -> None:
            try:
                outcome.append(patient.attempts(JOB))
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        port = int(endpoint.url.rsplit(":", 1)[1])
        while caller.is_alive() and not _connected_to(port):
            caller.join(0.01)
        os.kill(holder.pid, signal.SIGKILL)  # while the call waits for its answer
        holder.process.wait()
        caller.join()
        assert len(outcome) == 1 and isinstance(outcome[0], TemporaryStoreError), outcome
        message = str(outcome[0])
        assert f"{url} (held by pid {holder.pid}" in message
        assert "the connection broke during attempts" in message
        assert "a write may or may not have landed" in message
    finally:
        if holder.process.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
        holder.process.wait()

    # The dead holder's file is still there: stale. This process opens the store itself.
    assert endpoint_path(str(tmp_path / "store")).exists()
    with open_store(url) as store:
        assert isinstance(store, EmbeddedClickHouseStore)
        assert store.jobs() == []
    assert not endpoint_path(str(tmp_path / "store")).exists()


def test_a_store_is_shared_on_loopback_with_a_token_only(tmp_path: Path) -> None:
    store = open_store(f"chdb://{tmp_path / 'store'}")
    try:
        tokenless = IngestServer(store, token="")
        with pytest.raises(StoreConfigError, match="its endpoint has no token"), \
                sharing(store, tokenless):
            pass
        everywhere = IngestServer(store, host="0.0.0.0", token="t" * 32)
        with pytest.raises(StoreConfigError, match="shared on loopback only"), \
                sharing(store, everywhere):
            pass
        assert not endpoint_path(str(tmp_path / "store")).exists()
    finally:
        store.close()
