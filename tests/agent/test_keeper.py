"""The node's snapshot keeper: bounded memory, checked copies, every refusal counted and said.

The HTTP tests run the keeper's real server on a loopback port in this process.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tracehound.agent.node.keeper import BudgetExceeded, SnapshotKeeper, parse_args, serve
from tracehound.agent.rank.keepers import KeeperClient, KeeperError, Keepers, parse_keepers
from tracehound.tracing.settings import SettingError
from tracehound.tracing.snapshots import SnapshotDamaged, encode


def snap(rank: int, step: int, size: int = 100, job: str = "j") -> bytes:
    return encode(job=job, rank=rank, world=4, step=step, attempt=0, node="n0", created_us=step,
                  payload=bytes([step % 256]) * size)


def test_keeps_the_newest_snapshots_of_each_rank() -> None:
    keeper = SnapshotKeeper(budget_bytes=10**6, keep=2)
    for step in (1, 2, 3):
        for rank in (0, 1):
            keeper.put(snap(rank, step))
    assert [(r["rank"], r["step"]) for r in keeper.index("j")] == [(0, 2), (1, 2), (0, 3), (1, 3)]
    assert keeper.summary()["evicted"] == 2
    assert keeper.index("other") == []


def test_the_budget_drops_old_steps_before_refusing() -> None:
    one = len(snap(0, 1, size=1000))
    keeper = SnapshotKeeper(budget_bytes=3 * one, keep=5)
    for step in (1, 2, 3, 4):
        keeper.put(snap(0, step, size=1000))
    assert [r["step"] for r in keeper.index("j")] == [2, 3, 4]
    keeper.put(snap(1, 1, size=1000))  # another rank's first: an old step of rank 0 makes room
    assert [(r["rank"], r["step"]) for r in keeper.index("j")] == [(1, 1), (0, 3), (0, 4)]


def test_a_snapshot_that_cannot_fit_beside_every_ranks_newest_is_refused() -> None:
    one = len(snap(0, 1, size=1000))
    keeper = SnapshotKeeper(budget_bytes=2 * one, keep=5)
    keeper.put(snap(0, 1, size=1000))
    keeper.put(snap(1, 1, size=1000))
    with pytest.raises(BudgetExceeded, match="TRACEHOUND_SNAPSHOT_BUDGET_MB"):
        keeper.put(snap(2, 1, size=1000))
    assert keeper.summary()["refused_budget"] == 1
    assert len(keeper.index("j")) == 2  # nothing held was lost for it


def test_a_refused_copy_never_costs_the_one_already_held() -> None:
    keeper = SnapshotKeeper(budget_bytes=len(snap(0, 1, size=1000)) + 10, keep=5)
    first = snap(0, 1, size=1000)
    keeper.put(first)
    with pytest.raises(BudgetExceeded):
        keeper.put(snap(0, 1, size=2000))
    assert keeper.get("j", 0, 1) == first


def test_a_damaged_copy_is_refused_and_counted() -> None:
    keeper = SnapshotKeeper(budget_bytes=10**6)
    data = bytearray(snap(0, 1))
    data[-1] ^= 1
    with pytest.raises(SnapshotDamaged, match="checksum"):
        keeper.put(bytes(data))
    assert keeper.summary()["refused_damaged"] == 1
    assert keeper.index("j") == []


@pytest.fixture
def served() -> Iterator[tuple[SnapshotKeeper, KeeperClient]]:
    keeper = SnapshotKeeper(budget_bytes=50_000, keep=2)
    server = serve(keeper, host="127.0.0.1", port=0, node="n0")
    client = KeeperClient(node="n0", url=f"http://127.0.0.1:{server.port}")
    try:
        yield keeper, client
    finally:
        client.close()
        server.close()


def test_over_http_put_list_and_fetch(served: tuple[SnapshotKeeper, KeeperClient]) -> None:
    _, client = served
    data = snap(2, 7, job="job with/odd name")
    client.put(data)
    assert client.index("job with/odd name") == [
        {"rank": 2, "step": 7, "world": 4, "attempt": 0, "node": "n0", "bytes": len(data)}]
    assert client.fetch("job with/odd name", 2, 7) == data
    assert client.fetch("job with/odd name", 2, 8) is None
    assert client.stats()["stored"] == 1


def test_refusals_say_why_on_the_stream_and_over_http(
        served: tuple[SnapshotKeeper, KeeperClient]) -> None:
    _, client = served
    with pytest.raises(KeeperError, match=r"refused a snapshot: .*not a Tracehound"):
        client.put(b"garbage")
    with pytest.raises(KeeperError, match=r"refused a snapshot: .*exceeds the keeper's budget"):
        client.put(snap(0, 1, size=60_000))
    client.put(snap(0, 2))  # the same connection goes on after both refusals
    for body, status, words in ((b"garbage", 400, "not a Tracehound"),
                                (snap(0, 1, size=60_000), 507, "exceeds the keeper's budget")):
        request = urllib.request.Request(client.url + "/v1/snapshots", data=body, method="PUT")
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(request)
        assert answer.value.code == status and words in json.loads(answer.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(client.url + "/v1/snapshots")
    assert "say which job" in json.loads(answer.value.read())["error"]
    stats = client.stats()
    assert (stats["refused_budget"], stats["refused_damaged"], stats["stored"]) == (2, 2, 1)


def test_a_keeper_that_is_gone_is_a_keeper_error_naming_it() -> None:
    client = KeeperClient(node="node-9", url="http://127.0.0.1:9", timeout_s=1)
    with pytest.raises(KeeperError, match="keeper of node node-9"):
        client.index("j")


def test_keeper_settings_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([], {"TRACEHOUND_SNAPSHOT_BUDGET_MB": "lots"})
    assert "TRACEHOUND_SNAPSHOT_BUDGET_MB='lots': expected a number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--keep", "0"], {})
    assert "--keep 0: expected at least 1" in capsys.readouterr().err


def test_replicas_go_half_the_ring_away_and_never_to_the_own_node() -> None:
    clients = parse_keepers(",".join(f"node-{i}=http://127.0.0.1:{7000 + i}" for i in range(4)))
    placed = {c.node: Keepers.place(clients, c.node).replica for c in clients}
    assert {n: r.node for n, r in placed.items() if r} == {
        "node-0": "node-2", "node-1": "node-3", "node-2": "node-0", "node-3": "node-1"}
    two = clients[:2]
    assert Keepers.place(two, "node-0").replica == two[1]
    assert Keepers.place(clients[:1], "node-0").replica is None
    assert Keepers.place(clients, "node-0", replicas=False).replica is None
    stranger = Keepers.place(clients, "node-7")
    assert stranger.own is None and stranger.replica is None
    order = Keepers.place(clients, "node-2").lookup_order()
    assert [c.node for c in order] == ["node-2", "node-0", "node-1", "node-3"]


@pytest.mark.parametrize("text", ["node-0", "node-0=ftp://x:1", "=http://127.0.0.1:1",
                                  "node-0=http://127.0.0.1"])
def test_a_bad_keeper_list_names_the_variable_and_the_form(text: str) -> None:
    with pytest.raises(SettingError, match=r"TRACEHOUND_SNAPSHOT_KEEPERS=.*NODE=http://HOST:PORT"):
        parse_keepers(text)
