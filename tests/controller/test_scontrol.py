"""The scontrol adapter without a cluster: its parser on what scontrol 22.05 really printed
(data/scontrol, captured from the test cluster of tests/slurm_harness.py), the node-state
predicates, the refusal of bad input with a message naming it, and the errors when scontrol is
missing or the controller cannot be reached. The same adapter against the real cluster:
tests/slurm/test_scontrol_cluster.py."""

from __future__ import annotations

import os
import socket
import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tracehound.controller.actions.scontrol import (
    SlurmControl,
    SlurmError,
    controller_up,
    is_drained,
    node_flags,
    out_of_service,
    parse_record,
    parse_records,
)

DATA = Path(__file__).parent / "data" / "scontrol"


def captured(name: str) -> str:
    return (DATA / name).read_text()


# -- the parser, on captured output -------------------------------------------------------------


def test_idle_nodes() -> None:
    nodes = parse_records(captured("nodes-idle.txt"))
    assert [n["NodeName"] for n in nodes] == ["node-1", "node-2"]
    assert [n["State"] for n in nodes] == ["IDLE", "IDLE"]
    assert nodes[0]["NodeAddr"] == "10.116.66.11" and nodes[0]["CPUTot"] == "2"
    # a value with spaces, '#' and '@' in it, followed by a double space
    assert nodes[0]["OS"] == "Linux 6.18.44-fc-v669 #1 SMP PREEMPT_DYNAMIC @0"
    assert nodes[0]["RealMemory"] == "1"
    # empty values stay empty, and do not swallow the next field
    assert nodes[0]["AllocTRES"] == "" and nodes[0]["CapWatts"] == "n/a"
    assert "Reason" not in nodes[0]


def test_drained_nodes_keep_their_whole_reason() -> None:
    # drained with Reason="tracehound 7: Rank=3 hung [on purpose]": a word like a key and a
    # bracket of its own, then scontrol's own [user@time]
    nodes = parse_records(captured("nodes-drained.txt"))
    assert [n["State"] for n in nodes] == ["MIXED+DRAIN", "IDLE+DRAIN"]
    for node in nodes:
        assert node["Reason"] == "tracehound 7: Rank=3 hung [on purpose]"
        assert node["ReasonUser"] == "root"
        assert node["ReasonTime"] == "2026-11-29T15:00:41"
        assert "Rank" not in node
        assert node["ExtSensorsTemp"] == "n/s"  # the field before the reason ends where it did


def test_resumed_nodes_are_not_responding_for_a_moment() -> None:
    nodes = parse_records(captured("nodes-resumed.txt"))
    assert [n["State"] for n in nodes] == ["MIXED+NOT_RESPONDING", "IDLE+NOT_RESPONDING"]


def test_a_line_that_is_no_record_is_left_out() -> None:
    nodes = parse_records(captured("nodes-one-unknown.txt"))
    assert [n["NodeName"] for n in nodes] == ["node-1"]
    assert "Node bogus not found" in captured("nodes-one-unknown.txt")


def test_a_running_job() -> None:
    (job,) = parse_records(captured("job-running.txt"))
    assert job["JobId"] == "3" and job["JobState"] == "RUNNING" and job["Restarts"] == "0"
    # submitted as --job-name "train step=7 run": a lower-case word with '=' is no key
    assert job["JobName"] == "train step=7 run"
    assert job["UserId"] == "root(0)"
    assert job["NodeList"] == "node-1" and job["BatchHost"] == "node-1"
    # keys with ':' and '/' in them
    assert job["AllocNode:Sid"] == "localhost:19097"
    assert job["ReqB:S:C:T"] == "0:0:*:*" and job["CPUs/Task"] == "1"
    assert job["TRES"] == "cpu=1,node=1,billing=1"
    assert job["Power"] == ""


def test_a_job_through_its_requeue() -> None:
    completing, pending, cancelled = (
        parse_record(captured(name).strip()) for name in (
            "job-requeue-completing.txt", "job-requeued-pending.txt", "job-cancelled.txt"))
    assert (completing["JobState"], completing["Restarts"]) == ("COMPLETING", "1")
    assert (pending["JobState"], pending["Reason"], pending["Restarts"]) == (
        "PENDING", "BeginTime", "1")
    assert pending["NodeList"] == ""
    # pending until the credential lifetime (10 s on the test cluster) and a second are over
    assert pending["EligibleTime"] > pending["SubmitTime"]
    assert cancelled["JobState"] == "CANCELLED"


def test_a_line_that_starts_with_no_key_is_refused_with_its_text() -> None:
    with pytest.raises(ValueError, match=r"'Node bogus not found'.*expected Key=value"):
        parse_record("Node bogus not found")


_keys = st.text(string.ascii_letters + string.digits + "_:/.", min_size=0, max_size=12).map(
    lambda rest: "K" + rest)
_words = st.text(string.ascii_lowercase + string.digits + "=()[]*,.-@#", min_size=1,
                 max_size=10)


@given(st.dictionaries(_keys, st.lists(_words, max_size=4).map(" ".join), max_size=12))
def test_fields_come_back_as_they_were_printed(fields: dict[str, str]) -> None:
    # values of lower-case words (with '=' and brackets in them) separated by single spaces
    line = " ".join(f"{k}={v}" for k, v in fields.items())
    assert parse_records(line) == ([fields] if fields else [])


def test_what_ping_says() -> None:
    assert controller_up(captured("ping-up.txt"))
    assert not controller_up(captured("ping-down.txt"))
    assert not controller_up("")


@pytest.mark.parametrize(("state", "flags", "drained", "out"), [
    ("IDLE", {"IDLE"}, False, False),
    ("ALLOCATED", {"ALLOCATED"}, False, False),
    ("MIXED+DRAIN", {"MIXED", "DRAIN"}, True, True),
    ("IDLE+DRAIN", {"IDLE", "DRAIN"}, True, True),
    ("DOWN+NOT_RESPONDING", {"DOWN", "NOT_RESPONDING"}, False, True),
    ("IDLE+NOT_RESPONDING", {"IDLE", "NOT_RESPONDING"}, False, False),
    ("IDLE+FAIL", {"IDLE", "FAIL"}, False, True),
    ("DRAINED", {"DRAINED"}, True, True),
])
def test_node_states(state: str, flags: set[str], drained: bool, out: bool) -> None:
    assert node_flags(state) == flags
    assert is_drained(state) is drained
    assert out_of_service(state) is out


# -- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("call", "message"), [
    (lambda c: c.drain("node-1", "why"),
     r"nodes 'node-1': expected a sequence of node names, e\.g\. \['node-1'\]"),
    (lambda c: c.drain([], "why"), r"nodes \[\]: expected at least one node name"),
    (lambda c: c.resume(["node-[1-2]"]), r"node name 'node-\[1-2\]': expected a Slurm NodeName"),
    (lambda c: c.drain(["a,b"], "why"), r"node name 'a,b': expected"),
    (lambda c: c.drain(["node-1"], "  "), r"reason '  ': expected a short text"),
    (lambda c: c.node_state("node 1"), r"node name 'node 1'"),
    (lambda c: c.job_state("abc"), r"job id 'abc': expected a Slurm job id such as 1234"),
    (lambda c: c.requeue("12;rm"), r"job id '12;rm'"),
    (lambda c: c.cancel(""), r"job id '': expected"),
    (lambda c: c.job_nodes("0"), r"job id '0'"),
])
def test_bad_input_is_refused_before_anything_runs(call, message: str,  # type: ignore[no-untyped-def]
                                                   tmp_path: Path) -> None:
    # no scontrol on this PATH: the input is checked first
    control = SlurmControl(env={"PATH": str(tmp_path)})
    with pytest.raises(ValueError, match=message):
        call(control)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"timeout_s 0: expected seconds > 0"):
        SlurmControl(timeout_s=0)
    with pytest.raises(ValueError, match=r"scontrol '': expected the scontrol command"):
        SlurmControl(scontrol="")


# -- scontrol missing, or no controller ----------------------------------------------------------


def test_missing_scontrol_is_named_with_what_to_install(tmp_path: Path) -> None:
    control = SlurmControl(env={"PATH": str(tmp_path)})
    with pytest.raises(SlurmError) as raised:
        control.check()
    assert str(raised.value).startswith(f"scontrol: not found on PATH ({tmp_path}); install "
                                        "slurm-client")
    assert raised.value.missing
    # a step cannot do anything either: it raises rather than report a failed step
    for step in (lambda: control.drain(["node-1"], "why"), lambda: control.resume(["node-1"]),
                 lambda: control.requeue("7"), lambda: control.cancel("7")):
        with pytest.raises(SlurmError, match="scontrol: not found on PATH"):
            step()


def test_a_scontrol_path_that_is_not_there(tmp_path: Path) -> None:
    control = SlurmControl(scontrol=str(tmp_path / "bin" / "scontrol"))
    with pytest.raises(SlurmError, match=r"bin/scontrol: no such executable file; install "
                                         r"slurm-client"):
        control.job_state("7")


def test_scancel_is_taken_from_beside_a_scontrol_path(tmp_path: Path) -> None:
    # scontrol there, scancel not: the job's state is read, then scancel is missing
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho JobId=7 JobState=RUNNING Restarts=0\n")
    (tmp_path / "scontrol").chmod(0o755)
    control = SlurmControl(scontrol=str(tmp_path / "scontrol"), env={"PATH": "/nonexistent"})
    with pytest.raises(SlurmError, match=rf"{tmp_path}/scancel: no such executable file"):
        control.cancel("7")


def test_a_controller_that_cannot_be_reached(tmp_path: Path) -> None:
    # the real scontrol with a configuration whose controller is nowhere (a port nothing
    # listens on)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=nowhere\nSlurmctldHost=localhost(127.0.0.1)\n"
        f"SlurmctldPort={port}\nAuthType=auth/munge\n"
        f"AuthInfo=socket={tmp_path / 'munge.socket'}\n"
        "NodeName=n1 CPUs=1\nPartitionName=p Nodes=n1\n")
    control = SlurmControl(env={**os.environ, "SLURM_CONF": str(conf)}, timeout_s=60)
    with pytest.raises(SlurmError) as raised:
        control.check()
    message = str(raised.value)
    assert message.startswith("slurmctld does not answer: `scontrol ping` exited with status 1: "
                              "Slurmctld(primary) at ")
    assert message.endswith(f" is DOWN (SLURM_CONF={conf})")
    assert not raised.value.missing and raised.value.returncode == 1
