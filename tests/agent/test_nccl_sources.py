"""The NCCL sources of the node agent (agent/nccl.py): RAS status and Inspector logs.

RAS: a real TCP server on loopback speaks NCCL's RAS client protocol and answers `STATUS` with
the sample JSON of tests/agent/data/nccl (SAMPLES written to NCCL's documented format, not
captured from a GPU: no NCCL job can run here). Inspector: real files in a temporary directory,
written line by line, cut mid-line, truncated and replaced while the source reads them.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tracehound.agent.sources import SourcePoller
from tracehound.agent.sources.nccl import (
    HostNodes,
    LocalRanks,
    NcclFormatError,
    NcclInspectorSource,
    NcclRasSource,
    NcclRasTimeout,
    RankOf,
    parse_inspector_line,
    parse_ras_addr,
    parse_ras_status,
    ras_addr_from_env,
)
from tracehound.analysis.hardware import HealthKind, health_kind
from tracehound.tracing.events import (
    CollectiveEvent,
    CollectiveState,
    HealthSample,
    HealthSeverity,
    Heartbeat,
    ProcessGroupInfo,
    Record,
)
from tracehound.tracing.ids import JobId, NodeId, Rank
from tracehound.tracing.wire import decode_line, encode_line

DATA = Path(__file__).resolve().parent / "data" / "nccl"
T0 = 1_762_178_531_000_000


# -- a RAS server on loopback ---------------------------------------------------------------------


class RasServer:
    """Speaks NCCL's RAS client protocol on 127.0.0.1: `CLIENT PROTOCOL n`, `TIMEOUT s`,
    `SET FORMAT json|text` and `STATUS` (answered with `answer`, then the connection is closed,
    as NCCL does). `json_format=False` answers like an NCCL older than 2.28.7."""

    def __init__(self, answer: str, *, json_format: bool = True, listen: bool = True,
                 stall: bool = False) -> None:
        self.answer = answer
        self.json_format = json_format
        self.stall = stall
        self.commands: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        if listen:
            self.listen()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def listen(self) -> None:
        """Start accepting (until then, a bound port that refuses connections)."""
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(5)
        reader = conn.makefile("rb")
        while True:
            line = reader.readline()
            if not line:
                return
            cmd = line.decode().strip()
            self.commands.append(cmd)
            upper = cmd.upper()
            if upper.startswith("CLIENT PROTOCOL "):
                conn.sendall(b"SERVER PROTOCOL 2\n")
            elif upper.startswith("TIMEOUT ") or (
                upper.startswith("SET FORMAT ") and self.json_format
            ):
                conn.sendall(b"OK\n")
            elif upper == "STATUS" and self.stall:
                self._stop.wait(10)  # RAS waiting on peers that do not answer
                return
            elif upper == "STATUS":
                conn.sendall(self.answer.encode())
                return  # NCCL closes the connection after the status
            else:
                conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        self.sock.close()


@pytest.fixture
def faults_json() -> str:
    return (DATA / "ras_status_faults.json").read_text()


@pytest.fixture
def healthy_json() -> str:
    return (DATA / "ras_status_healthy.json").read_text()


@pytest.fixture
def server(faults_json: str) -> Iterator[RasServer]:
    srv = RasServer(faults_json)
    yield srv
    srv.close()


def ras_source(addr: str, **kwargs: object) -> NcclRasSource:
    names = HostNodes("node-a", known={"10.0.0.12": "node-b"})
    return NcclRasSource(job="j1", node="node-a", addr=addr, node_names=names,
                         timeout_s=2.0, **kwargs)  # type: ignore[arg-type]


def by_metric(samples: list[Record]) -> dict[tuple[str, str, str], HealthSample]:
    out = {}
    for s in samples:
        assert isinstance(s, HealthSample)
        out[(s.metric, s.node, s.device)] = s
    return out


def roundtrip(records: list[Record]) -> None:
    for r in records:
        assert decode_line(encode_line(r)) == r


# -- RAS ------------------------------------------------------------------------------------------


def test_ras_protocol_and_healthy_answer_gives_no_samples(healthy_json: str) -> None:
    srv = RasServer(healthy_json)
    try:
        source = ras_source(srv.addr)
        assert source.poll(T0) == []
    finally:
        srv.close()
    assert srv.commands == ["CLIENT PROTOCOL 2", "TIMEOUT 2", "SET FORMAT json", "STATUS"]
    assert source.stats.polls == 1 and source.stats.unavailable == 0


def test_ras_problems_become_health_samples_on_their_node_and_gpu(server: RasServer) -> None:
    source = ras_source(server.addr)
    samples = source.poll(T0)
    got = by_metric(samples)
    assert set(got) == {
        ("nccl_rank_dead", "node-b", "gpu3"),        # missing rank 3, NVML device 3
        ("nccl_async_error", "node-b", "gpu0"),      # rank 2: ncclRemoteError
        ("nccl_comm_aborted", "node-b", "gpu0"),
        ("nccl_ops_behind", "node-a", "gpu1"),       # rank 1: 337 AllReduce, peers 341
        ("nccl_rank_missing", "node-a", "gpu1"),     # 2-rank comm: rank 1 unresponsive
    }
    dead = got[("nccl_rank_dead", "node-b", "gpu3")]
    assert dead.severity is HealthSeverity.CRITICAL and dead.source == "nccl_ras"
    assert dead.job == "j1" and dead.time_us == T0
    assert "0x5d3a9c1e2b7f4410" in dead.detail and "pid 5204" in dead.detail
    assert got[("nccl_async_error", "node-b", "gpu0")].value == 6.0
    assert "ncclRemoteError" in got[("nccl_async_error", "node-b", "gpu0")].detail
    behind = got[("nccl_ops_behind", "node-a", "gpu1")]
    assert behind.value == 4.0 and behind.severity is HealthSeverity.INFO
    assert got[("nccl_rank_missing", "node-a", "gpu1")].severity is HealthSeverity.WARNING
    roundtrip(samples)


def test_ras_metrics_are_context_only_for_the_analysis(server: RasServer) -> None:
    samples = ras_source(server.addr).poll(T0)
    assert samples
    for s in samples:
        assert isinstance(s, HealthSample)
        assert health_kind(s) is HealthKind.UNKNOWN, s.metric


def test_ras_lasting_problems_repeat_only_when_changed_or_due(server: RasServer) -> None:
    source = ras_source(server.addr, repeat_s=60.0)
    assert len(source.poll(T0)) == 5
    # Same answer 10 s later: nothing new, except the rank behind that launched nothing since.
    again = source.poll(T0 + 10_000_000)
    assert [(s.metric, s.severity) for s in again if isinstance(s, HealthSample)] == [
        ("nccl_ops_behind", HealthSeverity.WARNING)]
    assert "launched nothing since the previous poll" in again[0].detail  # type: ignore[union-attr]
    assert source.poll(T0 + 20_000_000) == []
    # A minute after they were emitted, lasting problems are emitted again.
    assert len(source.poll(T0 + 61_000_000)) == 4
    assert source.stats.polls == 4


def test_ras_not_listening_is_reported_once_and_counted(
    caplog: pytest.LogCaptureFixture, faults_json: str
) -> None:
    srv = RasServer(faults_json, listen=False)  # bound, not listening: connections refused
    try:
        source = ras_source(srv.addr)
        with caplog.at_level(logging.INFO, logger="tracehound.agent.sources.nccl"):
            for i in range(3):
                assert source.poll(T0 + i) == []
        assert source.stats.unavailable == 3
        notes = [r for r in caplog.records if "logged once" in r.getMessage()]
        assert len(notes) == 1 and srv.addr in notes[0].getMessage()
        # NCCL starts: the next poll reads it, and says so once.
        srv.listen()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="tracehound.agent.sources.nccl"):
            assert len(source.poll(T0 + 10)) == 5
        assert any("answers (NCCL 2.28.7)" in r.getMessage() for r in caplog.records)
        assert source.stats.unavailable == 3
    finally:
        srv.close()


def test_ras_unavailable_through_the_poller_is_not_an_error(faults_json: str) -> None:
    srv = RasServer(faults_json, listen=False)
    got: list[Record] = []
    clock = [0.0]
    try:
        source = ras_source(srv.addr)
        poller = SourcePoller([source], got.extend, clock=lambda: clock[0], wall_us=lambda: T0)
        for _ in range(3):
            poller.tick()
            clock[0] += source.interval_s
        assert poller.stats.errors == {} and got == []
        srv.listen()
        poller.tick()
        assert poller.stats.records == {"nccl_ras": 5}
    finally:
        srv.close()


def test_ras_connection_closed_at_once_counts_as_unavailable() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    port = sock.getsockname()[1]

    def close_each() -> None:
        for _ in range(2):
            conn, _ = sock.accept()
            conn.close()

    thread = threading.Thread(target=close_each, daemon=True)
    thread.start()
    try:
        source = ras_source(f"127.0.0.1:{port}")
        assert source.poll(T0) == [] and source.poll(T0 + 1) == []
        assert source.stats.unavailable == 2
    finally:
        thread.join(timeout=2)
        sock.close()


def test_ras_older_than_json_gives_a_clear_error(faults_json: str) -> None:
    srv = RasServer(faults_json, json_format=False)
    try:
        source = ras_source(srv.addr)
        with pytest.raises(NcclFormatError, match=r"SET FORMAT json.*2\.28\.7"):
            source.poll(T0)
        assert source.stats.unavailable == 0
    finally:
        srv.close()


def test_ras_that_does_not_answer_in_time_raises_a_timeout(faults_json: str) -> None:
    srv = RasServer(faults_json, stall=True)
    try:
        source = NcclRasSource(job="j1", node="node-a", addr=srv.addr, timeout_s=0.2)
        with pytest.raises(NcclRasTimeout, match="no complete answer within"):
            source.poll(T0)
        assert srv.commands[-2:] == ["SET FORMAT json", "STATUS"]
    finally:
        srv.close()


def test_ras_text_or_broken_answers_name_what_was_expected() -> None:
    with pytest.raises(NcclFormatError, match=r"not JSON.*text answer"):
        parse_ras_status("NCCL version 2.28.7 compiled with CUDA 12.8\n")
    with pytest.raises(NcclFormatError, match="no 'communicators' field"):
        parse_ras_status('{"nccl_version": "2.28.7"}')
    with pytest.raises(NcclFormatError, match=r"communicators\[0\]\.ranks\[0\] has no .status."):
        parse_ras_status('{"communicators": [{"hash": "0x1", "size": 1, "ranks": [{"rank": 0}]}]}')
    with pytest.raises(NcclFormatError, match=r"communicators\[0\]\.size should be int"):
        parse_ras_status('{"communicators": [{"hash": "0x1", "size": "4"}]}')


def test_ras_broken_answer_through_the_poller_is_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    srv = RasServer('{"communicators": 3}\n')
    clock = [0.0]
    try:
        source = ras_source(srv.addr)
        poller = SourcePoller([source], lambda records: None, clock=lambda: clock[0])
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                poller.tick()
                clock[0] += source.interval_s
        assert poller.stats.errors == {"nccl_ras": 3}
        warnings = [r for r in caplog.records if "source nccl_ras failed" in r.getMessage()]
        assert len(warnings) == 1 and "communicators should be list" in warnings[0].getMessage()
    finally:
        srv.close()


def test_ras_address_from_env_and_argument() -> None:
    assert ras_addr_from_env({}) == ("localhost", 28028)
    assert ras_addr_from_env({"NCCL_RAS_ADDR": "10.1.2.3:29000"}) == ("10.1.2.3", 29000)
    assert parse_ras_addr("[::1]:28028") == ("::1", 28028)
    with pytest.raises(ValueError, match=r"NCCL_RAS_ADDR='nohost'.*host:port"):
        ras_addr_from_env({"NCCL_RAS_ADDR": "nohost"})
    source = NcclRasSource(job="j", node="n", env={"NCCL_RAS_ADDR": "127.0.0.1:1234"})
    assert (source.host, source.port) == ("127.0.0.1", 1234)
    assert NcclRasSource(job="j", node="n", addr="h:5", env={}).port == 5


# -- Inspector ------------------------------------------------------------------------------------


def sample_lines(pid: int) -> list[str]:
    return (DATA / f"gpu-node-0-pid{pid}.log").read_text().splitlines(keepends=True)


def heartbeat(pid: int, rank: int, *, job: str = "j1", attempt: int = 0) -> Heartbeat:
    return Heartbeat(job=JobId(job), attempt=attempt, node=NodeId("node-a"), rank=Rank(rank),
                     time_us=T0, pid=pid, step=0, step_us=0, start_step=0, first_step_us=0,
                     dropped=0)


@pytest.fixture
def ranks() -> LocalRanks:
    resolver = LocalRanks(job="j1", hostname="gpu-node-0")
    resolver.observe(heartbeat(4101, 0))
    resolver.observe(heartbeat(4102, 1))
    return resolver


def inspector(directory: Path, ranks: LocalRanks) -> NcclInspectorSource:
    return NcclInspectorSource(directory, job="j1", node="node-a", ranks=ranks)


def collectives(records: list[Record]) -> list[CollectiveEvent]:
    return [r for r in records if isinstance(r, CollectiveEvent)]


def append(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def test_inspector_reads_growing_files_with_partial_lines(
    tmp_path: Path, ranks: LocalRanks, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "inspector"
    source = inspector(directory, ranks)
    with caplog.at_level(logging.INFO, logger="tracehound.agent.sources.nccl"):
        assert source.poll(T0) == [] and source.poll(T0) == []
    assert source.stats.dir_missing == 2
    assert len([r for r in caplog.records if "logged once" in r.getMessage()]) == 1

    directory.mkdir()
    path = directory / "gpu-node-0-pid4101.log"
    lines = sample_lines(4101)
    append(path, lines[0] + lines[1][:57])  # one line and a half
    first = source.poll(T0)
    assert [(c.group, c.seq, c.op) for c in collectives(first)] == [
        ("nccl:0x7f8c496ae9f661/AllReduce", 1, "all_reduce")]
    c = collectives(first)[0]
    assert (c.job, c.attempt, c.node, c.rank) == ("j1", 0, "node-a", 0)
    assert c.nbytes == 268435456 and c.state is CollectiveState.COMPLETED
    assert c.dtype == "" and c.peer == -1
    assert (c.enqueue_us, c.complete_us) == (T0 + 1000 - 4120, T0 + 1000)
    assert source.poll(T0) == []  # the half line waits for its end

    append(path, lines[1][57:] + "".join(lines[2:]))
    more = collectives(source.poll(T0))
    assert [(c.group, c.seq) for c in more] == [
        ("nccl:0x7f8c496ae9f661/AllReduce", 2),
        ("nccl:0x7f8c496ae9f661/AllGather", 1),
        ("nccl:0x7f8c496ae9f661/AllReduce", 3),
    ]
    # The verbose line: start from the trace, completion at the last kernel stop.
    verbose = more[-1]
    start = T0 + 14000 - 4101 - 900
    assert (verbose.enqueue_us, verbose.complete_us) == (start, start + 40 + 4101)
    assert source.stats.lines == 4 and source.stats.collectives == 4
    assert source.stats.bad_lines == 0
    roundtrip(first + more)  # type: ignore[arg-type]


def test_inspector_second_file_completes_the_communicator(
    tmp_path: Path, ranks: LocalRanks
) -> None:
    path0 = tmp_path / "gpu-node-0-pid4101.log"
    path0.write_text("".join(sample_lines(4101)))
    source = inspector(tmp_path, ranks)
    first = source.poll(T0)
    assert len(collectives(first)) == 4
    assert not [r for r in first if isinstance(r, ProcessGroupInfo)]  # rank 1 not seen yet

    shutil.copy(DATA / "gpu-node-0-pid4102.log", tmp_path / "gpu-node-0-pid4102.log")
    second = source.poll(T0 + 5)
    assert [(c.rank, c.group, c.seq) for c in collectives(second)] == [
        (1, "nccl:0x7f8c496ae9f661/AllReduce", 1),
        (1, "nccl:0x7f8c496ae9f661/AllReduce", 2),
        (1, "nccl:0x7f8c496ae9f661/AllGather", 1),
    ]
    groups = sorted((g.group, g.rank, g.ranks, g.backend, g.time_us)
                    for g in second if isinstance(g, ProcessGroupInfo))
    assert groups == [
        ("nccl:0x7f8c496ae9f661/AllGather", 0, (0, 1), "nccl", T0 + 5),
        ("nccl:0x7f8c496ae9f661/AllGather", 1, (0, 1), "nccl", T0 + 5),
        ("nccl:0x7f8c496ae9f661/AllReduce", 0, (0, 1), "nccl", T0 + 5),
        ("nccl:0x7f8c496ae9f661/AllReduce", 1, (0, 1), "nccl", T0 + 5),
    ]
    assert source.poll(T0 + 6) == []  # announced once
    # The hang's gap: rank 0 completed AllReduce 3, rank 1 never wrote it.
    last = {}
    for c in collectives(first + second):
        if c.op == "all_reduce":
            last[c.rank] = max(last.get(c.rank, 0), c.seq)
    assert last == {0: 3, 1: 2}
    roundtrip(second)


def test_inspector_truncated_and_replaced_files_are_read_again(
    tmp_path: Path, ranks: LocalRanks, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gpu-node-0-pid4101.log"
    lines = sample_lines(4101)
    path.write_text("".join(lines))
    source = inspector(tmp_path, ranks)
    assert len(collectives(source.poll(T0))) == 4

    path.write_text(lines[0])  # truncated in place (same inode), shorter than what was read
    with caplog.at_level(logging.INFO, logger="tracehound.agent.sources.nccl"):
        again = collectives(source.poll(T0))
    assert [c.seq for c in again] == [1]
    assert source.stats.restarts == 1
    assert any("truncated" in r.getMessage() for r in caplog.records)

    # Rotated: a new file under the same name (a new inode), longer than the old one.
    fresh = tmp_path / "next.tmp"
    fresh.write_text(lines[2] + lines[3] + lines[0])
    os.replace(fresh, path)
    rotated = collectives(source.poll(T0))
    assert [(c.op, c.seq) for c in rotated] == [("all_gather", 1), ("all_reduce", 3),
                                                 ("all_reduce", 1)]
    assert source.stats.restarts == 2

    path.unlink()
    assert source.poll(T0) == []


def test_inspector_bad_lines_are_skipped_and_nothing_else_is_lost(
    tmp_path: Path, ranks: LocalRanks, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "gpu-node-0-pid4101.log"
    lines = sample_lines(4101)
    path.write_text(lines[0] + "this is not json\n" + '{"header": {"id": "0x1"}}\n' + lines[1])
    source = inspector(tmp_path, ranks)
    with caplog.at_level(logging.WARNING, logger="tracehound.agent.sources.nccl"):
        got = collectives(source.poll(T0))
        append(path, "[1, 2]\n" + lines[2])
        got += collectives(source.poll(T0))
    assert [(c.op, c.seq) for c in got] == [("all_reduce", 1), ("all_reduce", 2),
                                            ("all_gather", 1)]
    assert source.stats.bad_lines == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1  # once per file
    assert f"{path}:2" in warnings[0] and "not JSON" in warnings[0]
    assert "expected one object with header, metadata and coll_perf" in warnings[0]


def test_inspector_line_errors_name_the_field_and_the_format() -> None:
    good = sample_lines(4101)[0]
    rec = parse_inspector_line(good)
    assert (rec.comm, rec.comm_rank, rec.n_ranks, rec.pid, rec.coll, rec.coll_sn) == (
        "0x7f8c496ae9f661", 0, 2, 4101, "AllReduce", 0)
    assert rec.busbw_gbs == pytest.approx(65.15)
    with pytest.raises(NcclFormatError, match=r"no coll_perf\.coll_sn .*expected NCCL Inspector"):
        parse_inspector_line(good.replace('"coll_sn":0,', ""))
    with pytest.raises(NcclFormatError, match=r"header\.rank should be int, got '0'"):
        parse_inspector_line(good.replace('"rank":0', '"rank":"0"'))
    with pytest.raises(NcclFormatError, match="no metadata object"):
        parse_inspector_line('{"header": {}, "coll_perf": {}}')


def test_inspector_unknown_pids_and_other_hosts_are_counted_not_emitted(
    tmp_path: Path, ranks: LocalRanks
) -> None:
    lines = sample_lines(4101)
    (tmp_path / "gpu-node-0-pid9999.log").write_text(lines[0].replace('"pid":4101', '"pid":9999'))
    (tmp_path / "gpu-node-7-pid4101.log").write_text(
        lines[0].replace('"hostname":"gpu-node-0"', '"hostname":"gpu-node-7"'))
    source = inspector(tmp_path, ranks)
    assert source.poll(T0) == []
    assert (source.stats.unmapped, source.stats.other_host) == (1, 1)


def test_local_ranks_read_the_environment_of_a_real_process() -> None:
    env = {**os.environ, "RANK": "5", "TRACEHOUND_JOB_ID": "jobx", "TRACEHOUND_ATTEMPT": "2"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
        env=env, stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"  # exec'd
        resolver = LocalRanks(job="fallback")
        assert resolver(socket.gethostname(), child.pid) == RankOf("jobx", 2, 5)
        assert resolver("some-other-host", child.pid) is None
        assert resolver(socket.gethostname(), os.getpid()) in (
            None, RankOf(os.environ.get("TRACEHOUND_JOB_ID", "fallback"), 0,
                         int(os.environ.get("RANK", "-1"))))
    finally:
        child.kill()
        child.wait()


def test_inspector_directory_from_env_or_a_clear_error(tmp_path: Path) -> None:
    source = NcclInspectorSource(job="j", node="n", env={"NCCL_INSPECTOR_DUMP_DIR": str(tmp_path)})
    assert source.directory == tmp_path
    with pytest.raises(ValueError, match="NCCL_INSPECTOR_DUMP_DIR is not set"):
        NcclInspectorSource(job="j", node="n", env={})


def test_both_sources_through_the_poller(
    tmp_path: Path, ranks: LocalRanks, server: RasServer
) -> None:
    (tmp_path / "gpu-node-0-pid4101.log").write_text("".join(sample_lines(4101)))
    got: list[Record] = []
    poller = SourcePoller([ras_source(server.addr), inspector(tmp_path, ranks)], got.extend,
                          clock=lambda: 0.0, wall_us=lambda: T0)
    poller.tick()
    assert poller.stats.records == {"nccl_ras": 5, "nccl_inspector": 4}
    assert poller.stats.errors == {}
    roundtrip(got)
