"""Every view of the dashboard, run headless (Streamlit's AppTest) on stores filled by the
simulator (a 1,024-rank hang, a 512-rank straggler), by a real demo run and through a ClickHouse
server; and stored text that must never become markup."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from ui_harness import (
    EXPECTED,
    HOSTILE,
    UNLOCALIZED,
    FilledStore,
    app,
    charts,
    database_url,
    drop_database,
    fill_simulated,
    tables,
    texts,
)

VIEWS = ("jobs", "incident", "progress", "stragglers", "health")


def _culprit_cells(at: Any) -> set[str]:
    """The rank rows the progress chart outlines as the culprit's."""
    (chart,) = charts(at)
    rows = _chart_rows(chart)
    return {r["ranks"].removesuffix(" culprit") for r in rows if r["culprit"]}


def _chart_rows(chart: dict[str, Any]) -> list[dict[str, Any]]:
    import pyarrow as pa

    rows: list[dict[str, Any]] = []
    for dataset in chart["_datasets"].values():
        table = pa.ipc.open_stream(dataset.data.data).read_all()
        rows += table.to_pylist()
    return rows


def test_jobs_view_lists_every_job_with_its_state_and_incidents(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(sim_store.url, "jobs", monkeypatch)
    (jobs,) = tables(at)
    by_job = jobs.set_index("job")
    assert set(by_job.index) == {"sim-hang", "sim-straggler", HOSTILE, "live", UNLOCALIZED}
    assert by_job.loc["live", "state"] == "stalled"
    # simulated traces have no controller behind them; the hostile job failed after 2 s
    assert by_job.loc["sim-hang", "state"] == "no controller state"
    assert by_job.loc["sim-hang", "incidents"] == 1
    assert by_job.loc[HOSTILE, "state"] == "failed"
    assert by_job.loc[HOSTILE, "training time"] == "50.0 %"
    # the live job's earlier checkpoint, a pause of its rhythm: shown, not an incident
    shown = "\n".join(texts(at))
    assert "live:\n" in shown and EXPECTED in shown
    assert by_job.loc["live", "incidents"] == 1


@pytest.mark.parametrize("job", ["sim-hang", "sim-straggler"])
def test_incident_view_names_the_culprit_with_evidence_and_timeline(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch, job: str) -> None:
    truth = sim_store.truth[job]
    at = app(sim_store.url, "incident", monkeypatch, job=job)
    shown = "\n".join(texts(at))
    culprit = truth["culprit_ranks"][0]
    node = truth["culprit_nodes"][0]
    assert f"Culprit ranks={culprit}" in shown.split("\n")
    assert f"culprit nodes: {node}" in shown
    timeline, evidence, *_ = tables(at)
    assert list(timeline["step"]) == ["detect", "decide: stop"]
    assert list(timeline["rule"])[1] == "rules.hang.stop"
    assert len(evidence) > 0 and culprit in set(evidence["rank"])


def test_progress_view_shows_the_hang_wavefront_with_the_culprit_outlined(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    culprit = sim_store.truth["sim-hang"]["culprit_ranks"][0]
    at = app(sim_store.url, "progress", monkeypatch, job="sim-hang", group="0")
    assert f"culprit (incident sim-hang/0/1, hang): ranks {culprit}" in "\n".join(texts(at))
    outlined = _culprit_cells(at)
    (bucket,) = outlined
    lo, hi = (int(x) for x in bucket.split("-"))
    assert lo <= culprit <= hi
    rows = _chart_rows(charts(at)[0])
    assert len({r["ranks"] for r in rows}) <= 128  # 1,024 ranks in at most 128 rows
    statuses = {r["status"] for r in rows}
    assert "completed" in statuses


def test_stragglers_view_puts_the_slow_rank_first(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    culprit = sim_store.truth["sim-straggler"]["culprit_ranks"][0]
    at = app(sim_store.url, "stragglers", monkeypatch, job="sim-straggler")
    late, *_ = tables(at)
    assert int(late["rank"].iloc[0]) == culprit
    assert bool(late["culprit"].iloc[0]) is True
    assert charts(at), "the lateness chart is drawn"


def test_a_stall_is_shown_as_such_with_where_the_busy_rank_is(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(sim_store.url, "incident", monkeypatch, job="live")
    shown = "\n".join(texts(at))
    assert "A stall: peers wait while the ranks below are alive and busy" in shown
    busy = tables(at)[0]
    assert list(busy["fact"]) == ["busy", "stack"] and set(busy["rank"]) == {5}
    assert "writing" in busy["detail"].iloc[0]
    assert "save (torch/serialization.py:652)\ncheckpoint (train.py:88)" in shown
    timeline = tables(at)[1]
    assert list(timeline["step"]) == ["detect", "decide: observe"]
    (jobs,) = tables(app(sim_store.url, "jobs", monkeypatch))
    assert jobs.set_index("job").loc["live", "open incidents"] == 1


def test_an_unlocalized_hang_is_shown_with_its_suspects_and_no_culprit(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(sim_store.url, "incident", monkeypatch, job=UNLOCALIZED)
    shown = "\n".join(texts(at))
    assert "hang, not localized, no culprit rank; suspects node-0, node-1" in shown
    assert "Suspect the network or the collective library of group 0" in shown


def test_a_running_job_is_redrawn_by_default_an_ended_one_is_not(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def refresh(job: str) -> bool:
        at = app(sim_store.url, "incident", monkeypatch, job=job)
        (toggle,) = at.toggle
        return bool(toggle.value)

    assert refresh("live") is True
    assert refresh(HOSTILE) is False  # failed
    assert refresh("sim-hang") is False  # traces without a controller: nothing moves


def test_the_node_filter_keeps_the_late_ranks_of_the_nodes_picked(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    truth = sim_store.truth["sim-straggler"]
    at = app(sim_store.url, "stragglers", monkeypatch, job="sim-straggler")
    (nodes,) = [m for m in at.multiselect if m.label == "Nodes"]
    others = [n for n in nodes.options if n != truth["culprit_nodes"][0]]
    nodes.set_value(others[:1]).run()
    late, *_ = tables(at)
    assert set(late["node"]) == set(others[:1])
    assert truth["culprit_ranks"][0] not in set(late["rank"])


def test_health_view_draws_the_nodes_metrics(
        sim_store: FilledStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(sim_store.url, "health", monkeypatch, job="sim-hang")
    shown = "\n".join(texts(at))
    assert "Node health" in shown
    nodes = at.get("multiselect")[0].value
    culprit_node = sim_store.truth["sim-hang"]["culprit_nodes"][0]
    assert culprit_node in nodes  # the culprit's node is preselected


def test_stored_text_is_never_markup(sim_store: FilledStore,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for view in VIEWS:
        at = app(sim_store.url, view, monkeypatch, job=HOSTILE, incident="h/0/1")
        for el in [*at.get("markdown"), *at.get("header"), *at.get("subheader"),
                   *at.get("caption"), *at.get("warning"), *at.get("info")]:
            value = str(el.value)
            # Markdown never carries stored text (its escapes do not stop autolinks)
            assert "bold" not in value and "e.invalid" not in value and "img" not in value, value
    at = app(sim_store.url, "incident", monkeypatch, job=HOSTILE, incident="h/0/1")
    shown = texts(at)
    assert HOSTILE in shown  # the summary, verbatim, as plain text
    assert f"File x.py, line 1\n{HOSTILE}" in shown  # the stack, as code
    assert f"mismatch on {HOSTILE}" in shown  # the headline
    timeline = tables(at)[0]
    assert HOSTILE in set(timeline["target"])


@pytest.mark.clickhouse_server
def test_a_store_that_refuses_the_login_is_a_plain_error(clickhouse_url: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from urllib.parse import urlsplit

    parts = urlsplit(clickhouse_url)
    url = parts._replace(netloc=f"nobody:Sekr3tPw@{parts.hostname}:{parts.port}").geturl()
    at = app(url, "jobs", monkeypatch)
    shown = "\n".join(texts(at))
    assert "The trace store cannot be" in shown
    assert "Sekr3tPw" not in shown and "nobody:***@" in shown


@pytest.mark.clickhouse_server
def test_views_work_on_a_clickhouse_server(clickhouse_url: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    url = database_url(clickhouse_url, f"tracehound_ui{uuid.uuid4().hex[:10]}")
    try:
        truth = fill_simulated(url)
        culprit = truth["sim-hang"]["culprit_ranks"][0]
        for view in VIEWS:
            at = app(url, view, monkeypatch, job="sim-hang")
            assert texts(at)
        at = app(url, "progress", monkeypatch, job="sim-hang", group="0")
        (bucket,) = _culprit_cells(at)
        lo, hi = (int(x) for x in bucket.split("-"))
        assert lo <= culprit <= hi
    finally:
        drop_database(url)


@pytest.mark.e2e
def test_every_view_on_a_real_demo_run(demo_store: FilledStore,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    at = app(demo_store.url, "jobs", monkeypatch)
    (jobs,) = tables(at)
    row = jobs.set_index("job").loc["demo-hang"]
    assert row["state"] == "finished" and row["restarts"] == 1
    assert row["isolated nodes"] == "node-1"
    ratio = float(str(row["training time"]).rstrip(" %"))
    assert 0 < ratio < 100
    # the hang's incident and attempt by name: a loaded machine can add a newer one, a
    # straggler in the restarted attempt (tests/controller/test_demo_e2e.py)
    hang = {"incident": "demo-hang/0/1", "attempt": "0"}
    at = app(demo_store.url, "incident", monkeypatch, job="demo-hang", **hang)
    shown = "\n".join(texts(at))
    assert "Culprit ranks=3" in shown and "culprit nodes: node-1" in shown
    timeline = tables(at)[0]
    assert list(timeline["step"]) == ["detect", "decide: stop", "isolate", "restart", "resumed"]
    # by default the group the incident names: the world group, or DDP's communication counted
    # in `0:ddp` when the hang came in a step whose buckets were not recorded one by one
    at = app(demo_store.url, "progress", monkeypatch, job="demo-hang", **hang)
    rows = _chart_rows(charts(at)[0])
    last = max(r["seq"] for r in rows)
    # ranks 0-2 wait in the last call, or one call short of it, or are done with the last one:
    # rank 3 stopped in the middle of a ring all-reduce leaves the peers that had its last chunk
    # done with that call and a peer that had not still inside it (seen: ranks 0 and 1 inside
    # 121, rank 2 inside 120; rank 0 done with 24 while 1 and 2 waited in it); rank 3 was
    # stopped before it entered the last call or inside it, and never completed it
    column = {seq: {r["ranks"].removesuffix(" culprit"): r["status"] for r in rows
                    if r["seq"] == seq}
              for seq in (last - 1, last)}
    assert all("waiting" in (column[last].get(r), column[last - 1].get(r))
               or column[last].get(r) == "completed" for r in "012"), column
    assert [column[last].get(r) for r in "012"].count("waiting") >= 1, column
    assert column[last].get("3") not in ("completed", "completed, not recorded"), column
    # the culprit's row says so in its label, and its cell at the hang its own state there
    assert {r["ranks"] for r in rows if r["culprit"]} == {"3 culprit"}
    own = [r for r in rows if r["status"].startswith("culprit: ")]
    assert len(own) == 1 and own[0]["ranks"] == "3 culprit", own
    assert own[0]["state"].startswith("rank 3: "), own
    shown = "\n".join(texts(at))
    assert f"rank 3 at #{own[0]['seq']} of group " in shown
    behind = tables(at)[0]
    assert behind["ranks"].iloc[0] == "3" and behind["evidence"].iloc[0].startswith(
        "culprit rank 3: "), behind
    assert column[last]["3"] in ("not entered", "waiting", "culprit: not entered",
                                 "culprit: pending", "culprit: frozen")
    assert _culprit_cells(at) == {"3"}
    for view in ("stragglers", "health"):
        assert texts(app(demo_store.url, view, monkeypatch, job="demo-hang", **hang))
