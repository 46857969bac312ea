"""Filling a store for the dashboard's tests, and reading what an AppTest run drew."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from streamlit.testing.v1 import AppTest

from tracehound.analysis.sim import simulate, write_to_store
from tracehound.controller.cli.explain import diagnose_stored
from tracehound.tracing.events import (
    Action,
    ActionKind,
    Incident,
    JobPhase,
    JobState,
    now_us,
)
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore, open_store


@dataclass(frozen=True)
class FilledStore:
    url: str
    truth: dict[str, dict[str, Any]]
    """Per job: what was injected (kind, culprit_ranks, culprit_nodes)."""


def database_url(server_url: str, database: str) -> str:
    return urlsplit(server_url)._replace(path=f"/{database}").geturl()


def drop_database(url: str) -> None:
    from clickhouse_driver import Client

    client = Client.from_url(urlsplit(url)._replace(path="/default").geturl())
    try:
        client.execute(f"DROP DATABASE IF EXISTS {urlsplit(url).path.strip('/')}")
    finally:
        client.disconnect()


HOSTILE = "<img src=x onerror=alert(1)> **bold** [click](http://e.invalid) :red[r] $x$"
"""A job name and text no page may render as markup."""

SIMULATED = (("sim-hang", "hang", 1024, 3), ("sim-straggler", "straggler", 512, 2))


def record_diagnosis(store: TraceStore, job: str) -> dict[str, Any]:
    """Diagnose a stored job as `tracehound diagnose` does and record the verdict as an
    incident with a stop and an alert, as the supervisor would."""
    verdict = diagnose_stored(store, JobId(job))
    assert verdict is not None
    at = int(verdict["observed_at_us"])
    iid = f"{job}/{verdict['attempt']}/1"
    store.record_incident(Incident(
        job=JobId(job), incident_id=iid, attempt=int(verdict["attempt"]), detected_at_us=at,
        kind=str(verdict["kind"]), culprit_ranks=tuple(verdict["culprit_ranks"]),
        culprit_nodes=tuple(verdict["culprit_nodes"]), confidence=float(verdict["confidence"]),
        summary=str(verdict["summary"]), verdict_json=json.dumps(verdict),
    ))
    store.record_action(Action(job=JobId(job), incident_id=iid, kind=ActionKind.STOP_JOB,
                               target=str(verdict["attempt"]), time_us=at + 200_000, ok=True,
                               detail="stopped every rank", rule="rules.hang.stop"))
    return verdict


def fill_simulated(url: str) -> dict[str, dict[str, Any]]:
    """Simulated jobs with their incidents, and a hostile job, into the store at `url`."""
    truth: dict[str, dict[str, Any]] = {}
    store = open_store(url)
    try:
        for job, fault, ranks, seed in SIMULATED:
            sim = simulate(ranks=ranks, fault=fault, seed=seed, job=job)
            write_to_store(sim, store)
            verdict = record_diagnosis(store, job)
            # the views are checked against the truth, so the diagnosis must have found it
            assert verdict["culprit_ranks"][:1] == list(sim.truth.culprit_ranks[:1]), verdict
            truth[job] = {"kind": sim.truth.kind.value if sim.truth.kind else "healthy",
                          "culprit_ranks": list(sim.truth.culprit_ranks),
                          "culprit_nodes": list(sim.truth.culprit_nodes),
                          "verdict": verdict}
        _hostile(store)
        _live_stall(store)
        _unlocalized_hang(store)
    finally:
        store.close()
    return truth


def _hostile(store: TraceStore) -> None:
    t = now_us() - 60_000_000
    job = JobId(HOSTILE)
    for seq, phase in enumerate((JobPhase.RUNNING, JobPhase.DIAGNOSING, JobPhase.FAILED), 1):
        store.record_state(JobState(job=job, time_us=t + seq * 1_000_000, seq=seq, state=phase,
                                    attempt=0, nodes=(HOSTILE,)))
    verdict = {"basis": "majority_vote", "evidence": [
        {"fact": "differs", "rank": 1, "node": HOSTILE, "detail": HOSTILE, "group": HOSTILE,
         "seq": 7, "value": 2.0},
        {"fact": "stack", "rank": 1, "node": HOSTILE, "detail": f"File x.py, line 1\n{HOSTILE}",
         "group": "", "seq": 0, "value": 0.0}]}
    store.record_incident(Incident(
        job=job, incident_id="h/0/1", attempt=0, detected_at_us=t + 2_000_000,
        kind="mismatch", culprit_ranks=(1,), culprit_nodes=(HOSTILE,), confidence=0.5,
        summary=HOSTILE, verdict_json=json.dumps(verdict)))
    store.record_action(Action(job=job, incident_id="h/0/1", kind=ActionKind.GIVE_UP,
                               target=HOSTILE, time_us=t + 2_500_000, ok=True, detail=HOSTILE))


EXPECTED = ("expected pause: rank 5 at train.py:88 checkpoint, 3.1 s so far; paused at this "
            "place 2 times before, its peers waiting 3.0-3.2 s")
"""The live job's earlier checkpoint, a pause of its rhythm."""


def _live_stall(store: TraceStore) -> None:
    """A running job whose rank 5 has been writing a checkpoint for a while: a stall."""
    t = now_us() - 5_000_000
    job = JobId("live")
    store.record_state(JobState(job=job, time_us=t, seq=1, state=JobPhase.RUNNING, attempt=0,
                                nodes=("node-a", "node-b")))
    store.record_state(JobState(job=job, time_us=t + 1_000_000, seq=2, state=JobPhase.STALLED,
                                attempt=0, nodes=("node-a", "node-b"), detail=EXPECTED))
    store.record_state(JobState(job=job, time_us=t + 3_000_000, seq=3, state=JobPhase.STALLED,
                                attempt=0, incident_id="live/0/1", nodes=("node-a", "node-b")))
    verdict = {"basis": "busy_timeout", "evidence": [
        {"fact": "busy", "rank": 5, "node": "node-b", "group": "", "seq": 0, "value": 42.0,
         "detail": "rank 5 on node node-b is busy outside collectives for 42 s (writing)"},
        {"fact": "stack", "rank": 5, "node": "node-b", "group": "", "seq": 0, "value": 0.0,
         "detail": "save (torch/serialization.py:652)\ncheckpoint (train.py:88)"}]}
    store.record_incident(Incident(
        job=job, incident_id="live/0/1", attempt=0, detected_at_us=t + 3_000_000, kind="stall",
        culprit_ranks=(5,), culprit_nodes=("node-b",), confidence=0.8,
        summary="3 ranks wait on rank 5 on node node-b, busy outside collectives",
        verdict_json=json.dumps(verdict)))
    store.record_action(Action(job=job, incident_id="live/0/1", kind=ActionKind.OBSERVE,
                               target="0", time_us=t + 3_100_000, ok=True, rule="rules.stall"))


UNLOCALIZED = "nowhere"
"""A job whose four ranks all wait in one all_reduce with the same call: no culprit rank."""


def _unlocalized_hang(store: TraceStore) -> None:
    """The verdict the analysis gives when every member waits and none stands out, stored as
    the supervisor stores an incident."""
    from tracehound.analysis.diagnose import diagnose_observation
    from tracehound.analysis.snapshot import JobSnapshot
    from tracehound.tracing.events import GroupProgress, Heartbeat, ProcessGroupInfo
    from tracehound.tracing.ids import GroupId, NodeId, Rank

    t = now_us() - 20_000_000
    job = JobId(UNLOCALIZED)
    waiting = GroupProgress(group=GroupId("0"), last_enqueued=41, last_completed=40,
                            pending_op="all_reduce", last_enqueue_us=t, last_complete_us=t,
                            pending_nbytes=64, pending_dtype="float32")
    node = {r: NodeId(f"node-{r // 2}") for r in range(4)}
    snap = JobSnapshot(
        job=job, attempt=0, now_us=t + 8_000_000,
        heartbeats=tuple(Heartbeat(job=job, attempt=0, node=node[r], rank=Rank(r),
                                   time_us=t + 7_800_000, pid=100 + r, step=10, step_us=t,
                                   start_step=0, first_step_us=t - 9_000_000, dropped=0,
                                   groups=(waiting,)) for r in range(4)),
        groups=tuple(ProcessGroupInfo(job=job, attempt=0, rank=Rank(r), group=GroupId("0"),
                                      ranks=(0, 1, 2, 3), backend="gloo", time_us=t)
                     for r in range(4)),
        expected_ranks=dict(node),
    )
    verdict = diagnose_observation(snap)
    assert verdict is not None and verdict.kind.value == "hang" and not verdict.culprit_ranks
    store.record_state(JobState(job=job, time_us=t, seq=1, state=JobPhase.SUSPECT, attempt=0,
                                incident_id=f"{UNLOCALIZED}/0/1",
                                nodes=tuple(sorted(set(node.values())))))
    store.record_incident(Incident(
        job=job, incident_id=f"{UNLOCALIZED}/0/1", attempt=0, detected_at_us=snap.now_us,
        kind=verdict.kind.value, culprit_ranks=verdict.culprit_ranks,
        culprit_nodes=verdict.culprit_nodes, confidence=verdict.confidence,
        summary=verdict.summary, verdict_json=verdict.to_json()))


def app(url: str, view: str, monkeypatch: Any, **params: str) -> AppTest:
    """The dashboard run once headless on the store at `url`, showing `view`."""
    from tracehound.controller.cli.dashboard import app_path

    monkeypatch.setenv("TRACEHOUND_STORE", url)
    at = AppTest.from_file(app_path(), default_timeout=120)
    at.query_params["view"] = view
    for key, value in params.items():
        at.query_params[key] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(at: AppTest) -> list[str]:
    """Every piece of text the run drew outside tables and charts, as sent to the browser."""
    out = []
    for kind in ("title", "header", "subheader", "text", "caption", "info", "warning", "error",
                 "markdown", "code"):
        out += [str(el.value) for el in at.get(kind)]
    out += [f"{m.label}={m.value}" for m in at.get("metric")]
    return out


def tables(at: AppTest) -> list[Any]:
    """The data frames the run drew."""
    return [df.value for df in at.dataframe]


def charts(at: AppTest) -> list[dict[str, Any]]:
    """The Vega-Lite specs of the charts the run drew, each with its data sets' rows."""
    out = []
    for el in at.get("vega_lite_chart"):
        proto = el.proto
        spec = json.loads(proto.spec)
        spec["_datasets"] = {d.name: d for d in proto.datasets}
        out.append(spec)
    return out
