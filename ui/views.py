"""The dashboard's views over a store: jobs, incident, progress, stragglers and links, health.

`render` draws the sidebar (view, job, time range, nodes, auto-refresh) and the chosen view; the
address's query parameters (`view`, `job`, `incident`, `group`) preselect them and follow the
choices, so every view can be linked to. Stored text reaches the page only as table cells,
`st.text` and `st.code`, never through Markdown (whose escapes GitHub-style autolinks ignore):
a job name or a stack frame is never markup, and nothing stored is ever part of a query (the
store binds every value).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import altair as alt
import pandas as pd
import streamlit as st

from tracehound.tracing.events import Incident, JobState, now_us
from tracehound.tracing.ids import JobId
from tracehound.tracing.jobs import TERMINAL, latest_run
from tracehound.tracing.store import TraceStore
from tracehound.tracing.summaries import COUNTED_SUFFIX, group_order
from tracehound.ui import data

VIEWS = {
    "jobs": "Jobs",
    "incident": "Incident",
    "progress": "Collective progress",
    "stragglers": "Stragglers and links",
    "health": "Node health",
}

MAX_NODES_SHOWN = 16
"""Nodes preselected in the health view of a large job (the filter adds others)."""


def _param(name: str) -> str | None:
    value = st.query_params.get(name)
    return str(value) if value else None


def _choose(label: str, options: Sequence[str], param: str, **kwargs: Any) -> str | None:
    """A sidebar selectbox preselected from the address's `param`, which then follows it."""
    if not options:
        return None
    wanted = _param(param)
    index = list(options).index(wanted) if wanted is not None and wanted in options else 0
    choice = st.sidebar.selectbox(label, options, index=index, key=f"pick-{param}", **kwargs)
    if choice is None:
        return None
    st.query_params[param] = str(choice)
    return str(choice)


def render(store: TraceStore, *, refresh_s: float = 5.0) -> None:
    st.sidebar.title("Tracehound")
    view = _choose("View", list(VIEWS), "view", format_func=VIEWS.__getitem__) or "jobs"
    jobs = [str(j) for j in store.jobs()]
    if not jobs:
        st.header(VIEWS[view])
        st.info("The store holds no job yet. Run `tracehound demo`, or point the dashboard at "
                "another store with `tracehound ui --store URL`.")
        return
    if view == "jobs":
        _refreshing(refresh_s, st.sidebar.toggle("Auto-refresh", value=True, key="refresh"))(
            _jobs_view)(store, jobs)
        return
    job = _choose("Job", jobs, "job")
    assert job is not None
    states = store.job_states(JobId(job))
    ended = bool(states) and latest_run(states)[-1].state in TERMINAL
    refresh = st.sidebar.toggle("Auto-refresh", value=bool(states) and not ended, key="refresh",
                                help="redraw this view every few seconds while the job runs")
    choice = st.sidebar.selectbox("Time range", list(data.RANGES), key="range")
    body = {"incident": _incident_view, "progress": _progress_view,
            "stragglers": _stragglers_view, "health": _health_view}[view]
    _refreshing(refresh_s, refresh)(body)(store, job, states, choice)


def _refreshing(seconds: float, on: bool) -> Any:
    """A view redrawn every `seconds` while `on` (a Streamlit fragment), else drawn once."""
    return st.fragment(run_every=seconds if on else None)


# ------------------------------------------------------------------------------------- jobs

def _jobs_view(store: TraceStore, jobs: Sequence[str]) -> None:
    st.header("Jobs")
    now = now_us()
    rows = [data.job_row(job, store.job_states(JobId(job)), store.incidents(JobId(job)), now)
            for job in jobs]
    st.dataframe(data.jobs_frame(rows), hide_index=True)
    st.caption("training time: the latest run's time in the running and suspect states against "
               "its wall time (launch, detection, stop, isolation, restart and stalls are lost "
               "time)")
    for row in rows:
        if row.open_incidents:
            st.warning(f"{row.open_incidents} open incident(s) of job:")
            st.text(row.job)
    pauses = [(job, found) for job in jobs
              if (found := data.expected_pauses(store.job_states(JobId(job))))]
    if pauses:
        st.subheader("Expected pauses")
        st.caption("pauses at a place where the job paused before, about as long (its "
                   "checkpoints, its evaluations): recorded here, not as incidents, and not "
                   "alerted; one three times as long as before is a stall incident")
        for job, found in pauses:
            st.text(f"{job}:\n" + "\n".join(found))
    latest = [(job, incidents[-1]) for job in jobs
              if (incidents := store.incidents(JobId(job)))]
    if latest:
        st.subheader("Latest incident of each job")
        st.text("\n".join(f"{job}: {data.incident_line(i)}" for job, i in latest))


# ---------------------------------------------------------------------------------- incident

def _pick_incident(incidents: Sequence[Incident]) -> Incident | None:
    if not incidents:
        return None
    newest_first = list(reversed(incidents))
    ids = [i.incident_id for i in newest_first]
    labels = {i.incident_id: data.incident_label(i) for i in newest_first}
    chosen = _choose("Incident", ids, "incident", format_func=labels.__getitem__)
    return next(i for i in newest_first if i.incident_id == chosen)


def _incident_view(store: TraceStore, job: str, states: Sequence[JobState], _range: str) -> None:
    st.header("Incident")
    incident = _pick_incident(store.incidents(JobId(job)))
    if incident is None:
        st.info("No incident of this job is stored.")
        return
    verdict = data.verdict_of(incident)
    st.subheader("Verdict")
    st.text(f"{incident.kind} on {', '.join(incident.culprit_nodes)}" if incident.culprit_ranks
            else f"{incident.kind}, {data.unlocalized_words(incident)}")
    st.text(incident.summary)
    cols = st.columns(4)
    cols[0].metric("Culprit ranks", ", ".join(str(r) for r in incident.culprit_ranks[:8]) or "-")
    cols[1].metric("Culprit nodes", len(incident.culprit_nodes))
    cols[2].metric("Confidence", f"{incident.confidence:.2f}")
    cols[3].metric("Attempt", incident.attempt)
    st.text(f"culprit nodes: {', '.join(incident.culprit_nodes)}\n"
            f"basis: {verdict.get('basis', '')}    detected: {data.when(incident.detected_at_us)}"
            f"    incident: {incident.incident_id}")
    if incident.kind == "stall":
        busy = data.evidence_frame(verdict, facts=("busy", "stack"))
        st.info("A stall: peers wait while the ranks below are alive and busy outside "
                "collectives (a checkpoint, evaluation, data loading). It becomes a hang only "
                "if they stay there past the busy grace; the machine is not implicated.")
        st.dataframe(busy, hide_index=True)
    st.subheader("Timeline")
    st.dataframe(data.timeline_frame(incident), hide_index=True)
    st.subheader("Evidence")
    st.dataframe(data.evidence_frame(verdict, exclude=("stack", "clock")), hide_index=True)
    stacks = data.evidence_frame(verdict, facts=("stack",))
    if len(stacks):
        st.subheader("Stacks")
        for _, row in stacks.iterrows():
            st.text(f"rank {row['rank']} on node {row['node']}")
            st.code(str(row["detail"]), language=None)
    clocks = data.evidence_frame(verdict, facts=("clock",))
    if len(clocks):
        st.subheader("Clock offsets")
        st.dataframe(clocks, hide_index=True)
    st.subheader("Alerts")
    alerts = data.alerts_frame(incident)
    if len(alerts):
        st.dataframe(alerts, hide_index=True)
    else:
        st.text("No alert delivery is recorded for this incident.")


# ---------------------------------------------------------------------------------- progress

def _attempt(store: TraceStore, job: str, states: Sequence[JobState]) -> int | None:
    """The attempt to show: chosen in the sidebar; by default the one of the job's latest
    incident (where the fault is), else the latest."""
    attempts = store.attempts(JobId(job))
    if not attempts:
        return None
    incidents = [i for i in store.incidents(JobId(job)) if i.attempt in attempts]
    default = incidents[-1].attempt if incidents else attempts[-1]
    labels = [str(a) for a in attempts]
    if _param("attempt") not in labels:
        st.query_params["attempt"] = str(default)
    return int(_choose("Attempt", labels, "attempt") or default)


def _culprits(store: TraceStore, job: str, attempt: int) -> tuple[Incident | None, list[int]]:
    of_attempt = [i for i in store.incidents(JobId(job)) if i.attempt == attempt]
    if not of_attempt:
        return None, []
    last = of_attempt[-1]
    return last, [int(r) for r in last.culprit_ranks]


def _progress_view(store: TraceStore, job: str, states: Sequence[JobState], _range: str) -> None:
    st.header("Collective progress")
    attempt = _attempt(store, job, states)
    if attempt is None:
        st.info("No collective of this job is stored.")
        return
    groups = sorted({g.group for g in store.groups(JobId(job), attempt)}, key=group_order)
    incident, culprits = _culprits(store, job, attempt)
    where = data.incident_group(incident)
    if _param("group") not in groups and where in groups:
        st.query_params["group"] = where  # by default the group the incident names
    group = _choose("Process group", groups, "group") if groups else "0"
    assert group is not None
    seqs = st.sidebar.slider("Sequence ids", 8, 256, 64, step=8, key="seqs")
    grid = store.progress_grid(JobId(job), attempt, group, last_seqs=seqs, rank_buckets=128)
    if not grid.cells and not grid.buckets:
        st.info("No collective of this group and attempt is stored.")
        return
    at_hang = data.culprit_states(incident)
    frame = data.progress_frame(grid, culprits, at_hang)
    lo, hi = data.seq_window(grid)
    if incident is not None and culprits:
        st.text(f"culprit (incident {incident.incident_id}, {incident.kind}): ranks "
                f"{', '.join(str(r) for r in culprits[:8])} on "
                f"{', '.join(incident.culprit_nodes[:4])}")
        for own in list(at_hang.values())[:4]:
            st.text(f"rank {own.rank} at #{own.seq} of group {own.group}: {own.words}")
    elif incident is not None:
        st.text(f"incident {incident.incident_id}, {incident.kind}: "
                f"{data.unlocalized_words(incident)}")
    st.text(f"group {group}, attempt {attempt}: sequence ids "
            f"{lo}-{hi}, {grid.width} rank(s) per row; a culprit's rows say so in their "
            "label, and its cell at the collective of the incident its state there")
    if group.endswith(COUNTED_SUFFIX):
        st.caption("This group counts DDP's own communication (gradient buckets, buffer "
                   "broadcasts): its ids are operations, and one is recorded per training "
                   "step, so the ids between are `completed, not recorded` by design.")
    st.altair_chart(_progress_chart(frame), width="stretch")
    st.subheader("Furthest behind")
    st.dataframe(data.behind_frame(grid, culprits=culprits, states=at_hang), hide_index=True)


def _progress_chart(frame: pd.DataFrame) -> alt.Chart:
    colour = alt.Color("status:N", scale=alt.Scale(domain=list(data.STATUSES),
                                                   range=list(data.COLOURS)))
    order = sorted(set(frame["bucket"]))
    y = alt.Y("ranks:N", sort=[frame.loc[frame["bucket"] == b, "ranks"].iloc[0] for b in order],
              title="ranks")
    base = alt.Chart(frame).encode(x=alt.X("seq:O", title="sequence id"), y=y)
    cells = base.mark_rect().encode(
        color=colour,
        tooltip=["ranks", "seq", "status", "op", "recorded", "late max (ms)", "state"])
    return cast(alt.Chart, cells.properties(height=max(160, min(14 * len(order), 900))))


# -------------------------------------------------------------------------------- stragglers

def _stragglers_view(store: TraceStore, job: str, states: Sequence[JobState],
                     choice: str) -> None:
    st.header("Stragglers and links")
    attempt = _attempt(store, job, states)
    if attempt is None:
        st.info("No collective of this job is stored.")
        return
    span = data.window(_span(store, job, states, attempt), choice)
    width = data.bucket_width_us(span)
    series = store.lateness_series(JobId(job), attempt, span.start_us, span.end_us, width,
                                   top=8)
    _, culprits = _culprits(store, job, attempt)
    frame = data.lateness_frame(series)
    nodes = sorted({str(n) for n in series.top_node})
    picked = st.sidebar.multiselect("Nodes", nodes, key="late-nodes",
                                    help="show only the late ranks of these nodes (all when "
                                         "none is picked)")
    if picked:
        frame = frame[frame["node"].isin(picked) | (frame["rank"] == "typical")]
    if frame.empty:
        st.info("No collective of this attempt falls in the time range.")
    else:
        st.caption("arrival lateness: how long after the first member of each collective the "
                   "rank arrived; the 8 latest ranks against the typical (median) one")
        if culprits:
            st.text(f"culprit ranks: {', '.join(str(r) for r in culprits[:8])}")
        st.altair_chart(
            alt.Chart(frame).mark_line(point=True).encode(
                x=alt.X("time:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S")),
                y=alt.Y("lateness (ms):Q"),
                color=alt.Color("rank:N"),
                strokeDash=alt.StrokeDash("kind:N"),
                tooltip=["rank", "node", "time", "lateness (ms)", "collectives"],
            ), width="stretch")
        late = data.late_ranks_frame(series, culprits)
        st.dataframe(late[late["node"].isin(picked)] if picked else late, hide_index=True)
    st.subheader("Link latency")
    links = store.link_stats(JobId(job), attempt, span.start_us, span.end_us)
    matrix = data.links_frame(links)
    if matrix.empty:
        st.info("No point-to-point transfer (send/recv) in the time range: the link matrix "
                "needs pipeline traffic.")
        return
    st.altair_chart(
        alt.Chart(matrix).mark_rect().encode(
            x=alt.X("dst:O", title="to rank"), y=alt.Y("src:O", title="from rank"),
            color=alt.Color("mean (ms):Q", scale=alt.Scale(scheme="orangered")),
            tooltip=["src", "dst", "transfers", "mean (ms)", "max (ms)"],
        ), width="stretch")


def _span(store: TraceStore, job: str, states: Sequence[JobState], attempt: int) -> data.Span:
    return data.job_span(states, store.incidents(JobId(job)),
                         store.latest_heartbeats(JobId(job), attempt), now_us())


# ------------------------------------------------------------------------------------ health

def _health_view(store: TraceStore, job: str, states: Sequence[JobState], choice: str) -> None:
    st.header("Node health")
    attempts = store.attempts(JobId(job))
    run = latest_run(states)
    beats = store.latest_heartbeats(JobId(job), attempts[-1]) if attempts else []
    nodes = data.job_nodes(run, beats)
    if not nodes:
        st.info("No node of this job is known to the store.")
        return
    default = [n for n in nodes if any(n in i.culprit_nodes
                                       for i in store.incidents(JobId(job)))]
    default += [n for n in nodes if n not in default][:MAX_NODES_SHOWN - len(default)]
    picked = st.sidebar.multiselect("Nodes", nodes, default=default, key="nodes")
    span = data.window(data.job_span(states, store.incidents(JobId(job)), beats, now_us()),
                       choice)
    samples = store.health(picked, span.start_us, span.end_us)
    if not samples:
        st.info("No health sample of these nodes in the time range (node agents sample GPUs "
                "and the host when nvidia-ml-py or a simulated device is available).")
        return
    frame = data.health_frame(samples)
    metrics = data.metric_order(set(frame["metric"]))
    metric = st.selectbox("Metric", metrics, key="metric")
    shown = frame[frame["metric"] == metric]
    line = alt.Chart(shown).mark_line().encode(
        x=alt.X("time:T", title="time (UTC)", axis=alt.Axis(format="%H:%M:%S")),
        y=alt.Y("value:Q", title=metric),
        color=alt.Color("series:N"), tooltip=["node", "device", "time", "value", "severity"])
    events = data.health_events(frame)
    marks = alt.Chart(events).mark_rule(color="#b22222", strokeWidth=2).encode(
        x="time:T", tooltip=["node", "device", "metric", "value", "severity", "detail"])
    st.altair_chart(alt.layer(line, marks), width="stretch")
    st.subheader("Events")
    if events.empty:
        st.text("No warning or critical health event in the time range.")
    else:
        st.dataframe(events, hide_index=True)
