"""Reading PyTorch Flight Recorder dumps (`tracing.flightrecorder`; a rank's own ring through
`agent.flightrecorder.read_live`): the restricted unpickler, format versions, where a dump's rank
comes from, unrelated files, and the records made of NCCL-style dumps (group lists, states,
point-to-point). Real gloo dumps are in tests/controller/test_import_fr.py; the dicts here follow
the fields torch's analyzer reads for NCCL dumps, which gloo on this machine cannot produce (it
records no sends, states or groups).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tracehound.tracing import flightrecorder as fr
from tracehound.tracing.events import CollectiveEvent, Heartbeat, ProcessGroupInfo, RankExit
from tracehound.tracing.ids import JobId

JOB = JobId("frjob")


def entry(seq: int, op: str, *, pg: str = "0", desc: str = "default_pg", pg_id: int = 0,
          state: str = "completed", t_ns: int = 1_000_000_000_000, p2p_seq: int = 0,
          record_id: int = 0, size: int = 4) -> dict[str, Any]:
    return {
        "record_id": record_id, "pg_id": pg_id, "process_group": (pg, desc),
        "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": record_id + 1,
        "profiling_name": f"nccl:{op}", "time_created_ns": t_ns + seq * 1_000_000,
        "input_sizes": [[size]], "input_dtypes": ["Float"], "output_sizes": [[size]],
        "output_dtypes": ["Float"], "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": t_ns + seq * 1_000_000 + 500 if state == "completed"
        else None,
        "is_p2p": op.startswith(("send", "recv")),
    }


def dump(rank: int | None, entries: list[dict[str, Any]], *, version: str = "2.10",
         config: dict[str, Any] | None = None) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "version": version,
        "pg_config": config if config is not None else {
            "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}},
        "pg_status": {}, "entries": entries,
    }
    if rank is not None:
        raw["rank"] = rank
    return raw


def write_pickle(path: Path, raw: Any) -> Path:
    path.write_bytes(pickle.dumps(raw, protocol=2))
    return path


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_a_command_is_refused_naming_the_file(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = write_pickle(tmp_path / "trace_rank_0", {"version": "2.10", "x": _Exploit(marker)})
    with pytest.raises(fr.DumpError) as err:
        fr.read_dump_file(evil)
    assert str(evil) in str(err.value)
    assert "refused to unpickle" in str(err.value)
    assert "system" in str(err.value)
    assert not marker.exists()


def test_the_unpickler_takes_plain_data_of_every_protocol() -> None:
    value = {"a": [1, 2.5, None, True], "b": ("x", b"\x00"), "c": {"d": -3}}
    for protocol in range(3, pickle.HIGHEST_PROTOCOL + 1):
        assert fr.restricted_loads(pickle.dumps(value, protocol=protocol)) == value
    # Protocol 2 spells bytes as a call of _codecs.encode: no dump holds bytes, so it is refused
    # like any other call, while the rest of protocol 2 reads.
    plain = {k: v for k, v in value.items() if k != "b"}
    assert fr.restricted_loads(pickle.dumps(plain, protocol=2)) == plain
    with pytest.raises(fr.DumpError, match=r"_codecs\.encode"):
        fr.restricted_loads(pickle.dumps(value, protocol=2))


def test_a_corrupt_pickle_is_an_error_naming_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "rank3.pkl"
    bad.write_bytes(pickle.dumps(dump(3, []), protocol=2)[:20])
    with pytest.raises(fr.DumpError, match=r"rank3\.pkl: corrupt pickle"):
        fr.read_dump_file(bad)


@pytest.mark.parametrize("version", ["2.3", "2.4", "2.7", "2.10"])
def test_versions_2_3_to_2_10_are_read(tmp_path: Path, version: str) -> None:
    path = write_pickle(tmp_path / "d0", dump(0, [entry(1, "all_reduce")], version=version))
    parsed = fr.read_dump_file(path)
    assert parsed.version == tuple(int(p) for p in version.split("."))
    assert [e.op for e in parsed.entries] == ["all_reduce"]


@pytest.mark.parametrize("version", ["2.2", "2.11", "3.0", "1.0", "two"])
def test_other_versions_are_refused_saying_what_is_expected(tmp_path: Path,
                                                             version: str) -> None:
    path = write_pickle(tmp_path / "d0", dump(0, [], version=version))
    with pytest.raises(fr.DumpError) as err:
        fr.read_dump_file(path)
    assert str(path) in str(err.value)
    assert "2.3 to 2.10" in str(err.value) or "MAJOR.MINOR" in str(err.value)


def test_the_rank_is_the_dumps_own_not_the_file_names(tmp_path: Path) -> None:
    path = write_pickle(tmp_path / "nccl_trace_rank_7", dump(2, [entry(1, "all_reduce")]))
    parsed = fr.read_dump_file(path)
    assert (parsed.rank, parsed.rank_from) == (2, "dump")
    # Without a rank key (torch 2.13 writes none), the number the name ends in, as torch does.
    unnamed = write_pickle(tmp_path / "nccl_trace_rank_5", dump(None, []))
    assert (fr.read_dump_file(unnamed).rank, fr.read_dump_file(unnamed).rank_from) == (
        5, "file name")
    nowhere = write_pickle(tmp_path / "trace", dump(None, []))
    with pytest.raises(fr.DumpError, match="no `rank` key"):
        fr.read_dump_file(nowhere)


def test_unrelated_files_are_skipped_and_counted_bad_dumps_listed(tmp_path: Path) -> None:
    write_pickle(tmp_path / "a_rank_1", dump(1, [entry(1, "all_reduce")]))
    (tmp_path / "b_rank_0.json").write_text(json.dumps(dump(0, [entry(1, "all_reduce")])))
    (tmp_path / "launcher.log").write_text("rank 3 exited with code 1\n")
    (tmp_path / "core.bin").write_bytes(b"\x7fELF\x00\x01")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "notes.md").write_text("# notes\n")
    (tmp_path / "config.json").write_text('{"lr": 0.1}')
    (tmp_path / "c_rank_2").write_bytes(b"\x80\x04garbage")
    report = fr.read_dump_dir(tmp_path)
    assert sorted(d.rank for d in report.dumps) == [0, 1]
    assert sorted(Path(f).name for f, _ in report.skipped) == ["core.bin", "launcher.log",
                                                               "notes.md"]
    errors = {Path(f).name: why for f, why in report.errors}
    assert set(errors) == {"config.json", "c_rank_2"}
    assert "not a Flight Recorder dump" in errors["config.json"]
    assert "keys ['lr']" in errors["config.json"]
    assert "corrupt pickle" in errors["c_rank_2"]


def test_two_dumps_of_one_rank_keep_the_first_and_report_the_second(tmp_path: Path) -> None:
    write_pickle(tmp_path / "a", dump(1, []))
    write_pickle(tmp_path / "b", dump(1, []))
    report = fr.read_dump_dir(tmp_path)
    assert [Path(d.source).name for d in report.dumps] == ["a"]
    assert "a second dump of rank 1" in report.errors[0][1]


def test_nccl_dumps_map_onto_groups_collectives_progress_and_pairs(tmp_path: Path) -> None:
    config = {
        "0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
        "5": {"name": "5", "desc": "pp", "ranks": "[2, 3]"},
    }

    def ranks_entries(rank: int) -> list[dict[str, Any]]:
        es = [entry(1, "all_reduce", record_id=0), entry(2, "_allgather_base", record_id=1)]
        if rank == 2:
            es.append({**entry(2, "send 0->1", pg="5", desc="pp", pg_id=1, p2p_seq=1,
                               record_id=2), "collective_seq_id": 0})
        if rank == 3:
            es.append({**entry(2, "recv 1<-0", pg="5", desc="pp", pg_id=1, p2p_seq=1,
                               record_id=2, state="scheduled"), "collective_seq_id": 0})
        # rank 0 is still inside all_reduce #3 (scheduled); 1 and 2 never entered it
        if rank == 0:
            es.append(entry(3, "all_reduce", state="scheduled", record_id=3, size=8))
        return es

    dumps = [fr.parse_dump(dump(r, ranks_entries(r), config=config), source=f"r{r}",
                           dumped_at_us=2_000_000_000) for r in (0, 2, 3)]
    conv = fr.to_records(dumps, job=JOB, attempt=0)
    assert conv.ranks == (0, 2, 3) and conv.missing == (1,)
    assert (conv.world_size, conv.world_from) == (4, "pg_config")
    groups = {(g.rank, g.group): g for g in conv.records if isinstance(g, ProcessGroupInfo)}
    assert groups[(2, "5")].ranks == (2, 3)
    assert groups[(2, "5:p2p:2-3")].ranks == (2, 3) and groups[(2, "5:p2p:2-3")].backend == "p2p"
    assert groups[(0, "0")].ranks == (0, 1, 2, 3)
    events = [e for e in conv.records if isinstance(e, CollectiveEvent)]
    send = next(e for e in events if e.op == "send")
    assert (send.rank, send.group, send.seq, send.peer) == (2, "5:p2p:2-3", 1, 3)
    assert all(e.op != "recv" for e in events)  # rank 3's recv has not completed
    assert {e.op for e in events if e.group == "0"} == {"all_reduce", "all_gather_into_tensor"}
    first = next(e for e in events if e.rank == 0 and e.seq == 1)
    assert (first.nbytes, first.dtype) == (16, "float32")
    assert first.complete_us - first.enqueue_us == 0  # 500 ns, in whole microseconds
    beats = {h.rank: h for h in conv.records if isinstance(h, Heartbeat)}
    assert set(beats) == {0, 2, 3}
    g0 = next(g for g in beats[0].groups if g.group == "0")
    assert (g0.last_enqueued, g0.last_completed, g0.pending_op, g0.pending_nbytes) == (
        3, 2, "all_reduce", 32)
    recv = next(g for g in beats[3].groups if g.group == "5:p2p:2-3")
    assert (recv.last_enqueued, recv.last_completed, recv.pending_op) == (1, 0, "recv")
    assert beats[0].time_us == 2_000_000_000


def test_a_group_name_with_different_members_becomes_two_groups() -> None:
    def d(rank: int, members: str) -> fr.FrDump:
        cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
               "1": {"name": "1", "desc": "dp", "ranks": members}}
        return fr.parse_dump(dump(rank, [entry(1, "all_reduce", pg="1", desc="dp", pg_id=1)],
                                  config=cfg), source=f"r{rank}", dumped_at_us=1)

    conv = fr.to_records([d(0, "[0, 1]"), d(1, "[0, 1]"), d(2, "[2, 3]"), d(3, "[2, 3]")],
                         job=JOB, attempt=0)
    named = {(g.group, g.ranks) for g in conv.records if isinstance(g, ProcessGroupInfo)
             if g.group != "0"}
    assert len(named) == 2
    assert {ranks for _, ranks in named} == {(0, 1), (2, 3)}
    assert all(name.startswith("1#") for name, _ in named)
    assert conv.notes


def test_gloo_completion_comes_from_pg_status_by_operation_counter() -> None:
    # As gloo writes it: every entry scheduled, no times; a recv (not recorded) took op_id 5.
    es = [{**entry(s, "all_reduce", state="scheduled", record_id=s - 1), "op_id": s}
          for s in (1, 2, 3, 4)]
    es.append({**entry(5, "barrier", state="scheduled", record_id=4), "op_id": 6})
    raw = dump(1, es, config={"": {"name": "", "desc": "", "ranks": "[]"}})
    raw["pg_status"] = {"0": {"last_enqueued_collective": "6", "last_started_collective": "-1",
                              "last_completed_collective": "4"}}
    conv = fr.to_records([fr.parse_dump(raw, source="r1", dumped_at_us=1)], job=JOB, attempt=0,
                         world_size=2)
    done = sorted(e.seq for e in conv.records if isinstance(e, CollectiveEvent))
    assert done == [1, 2, 3, 4]
    (beat,) = [h for h in conv.records if isinstance(h, Heartbeat)]
    assert (beat.groups[0].last_enqueued, beat.groups[0].pending_op) == (5, "barrier")
    assert conv.missing == (0,) and conv.inferred_groups == ("0",)


def test_exits_given_become_rank_exit_records() -> None:
    parsed = fr.parse_dump(dump(0, [entry(1, "all_reduce")]), source="r0", dumped_at_us=5)
    conv = fr.to_records([parsed], job=JOB, attempt=2, exits=fr.parse_exits(["3=-9"]))
    (ex,) = [r for r in conv.records if isinstance(r, RankExit)]
    assert (ex.rank, ex.exit_code, ex.attempt) == (3, -9, 2)
    for bad in ("3", "x=1", "3=0"):
        with pytest.raises(ValueError, match="--exit"):
            fr.parse_exits([bad])


def test_read_live_without_torch_returns_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    from tracehound.agent.sources.live_fr import read_live

    assert read_live() is None


def test_the_module_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; "
            "import tracehound.tracing.flightrecorder as m; print(m.NEWEST_VERSION)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "(2, 10)"


LIVE = """
import datetime, json, os
import torch, torch.distributed as dist
from tracehound.agent.sources.live_fr import read_live
before = read_live()
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=20))
t = torch.ones(8)
for _ in range(3):
    dist.all_reduce(t)
dist.broadcast(t, 0)
live = read_live()
print(json.dumps({"before": before is not None, "rank": live.rank, "from": live.rank_from,
                  "ops": [(e.op, e.seq) for e in live.entries], "version": live.version}))
"""


def test_read_live_parses_this_processes_own_ring() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", LIVE], capture_output=True, text=True,
                          check=False, env={**os.environ, "PORT": str(port)})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["rank"] == 0 and out["from"] == "process"
    assert out["ops"] == [["all_reduce", 1], ["all_reduce", 2], ["all_reduce", 3],
                          ["broadcast", 4]]
    assert out["version"] == [2, 10]
