"""What the dashboard shows, shaped from store records into rows and frames. No Streamlit here:
every view's content is computed by these functions, which the tests call directly too.

Nothing read from the store is markup: the views show stored text only through tables,
`st.text` and `st.code`.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from tracehound.analysis.rhythm import EXPECTED_PAUSE
from tracehound.analysis.verdict import suspect_nodes
from tracehound.tracing.events import (
    ActionKind,
    HealthSample,
    Heartbeat,
    Incident,
    JobPhase,
    JobState,
)
from tracehound.tracing.jobs import TERMINAL, latest_run, open_incidents, training_time
from tracehound.tracing.summaries import LatenessSeries, LinkStats, ProgressCell, ProgressGrid

US = 1_000_000

def when(us: int) -> str:
    """A time in UTC to the millisecond ("" for 0)."""
    if us <= 0:
        return ""
    stamp = dt.datetime.fromtimestamp(us / US, tz=dt.UTC)
    return stamp.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


# ----------------------------------------------------------------------------------------- jobs

@dataclass(frozen=True, slots=True)
class JobRow:
    job: str
    state: str
    attempt: int | None
    restarts: int
    isolated: tuple[str, ...]
    open_incidents: int
    incidents: int
    training_ratio: float | None
    since_us: int
    ended: bool


def job_row(job: str, states: Sequence[JobState], incidents: Sequence[Incident],
            now_us: int) -> JobRow:
    """A job's line in the jobs table. A job without stored states (simulated traces, a trace
    file loaded into the store) has no state and no training time."""
    run = latest_run(states)
    latest = run[-1] if run else None
    return JobRow(
        job=job,
        state=latest.state.value if latest else "no controller state",
        attempt=latest.attempt if latest else None,
        restarts=sum(1 for s in run if s.state is JobPhase.RESTARTING),
        isolated=latest.isolated if latest else (),
        open_incidents=len(open_incidents(states, incidents)),
        incidents=len(incidents),
        training_ratio=training_time(states, now_us).ratio,
        since_us=latest.time_us if latest else 0,
        ended=bool(latest and latest.state in TERMINAL),
    )


def expected_pauses(states: Sequence[JobState], limit: int = 5) -> list[str]:
    """The latest `limit` pauses of the job's rhythm (`analysis.rhythm`: a checkpoint, an
    evaluation, paused at one place as before), noted on its states and not as incidents,
    newest last, each with its time."""
    notes = [s for s in states if s.detail.startswith(EXPECTED_PAUSE)]
    return [f"{when(s.time_us)}  {s.detail}" for s in notes[-limit:]]


def jobs_frame(rows: Iterable[JobRow]) -> pd.DataFrame:
    return pd.DataFrame(
        [{
            "job": r.job, "state": r.state,
            "attempt": r.attempt if r.attempt is not None else pd.NA,
            "restarts": r.restarts, "isolated nodes": ", ".join(r.isolated),
            "open incidents": r.open_incidents, "incidents": r.incidents,
            "training time": (f"{100 * r.training_ratio:.1f} %"
                              if r.training_ratio is not None else ""),
            "since": when(r.since_us),
        } for r in rows],
        columns=["job", "state", "attempt", "restarts", "isolated nodes", "open incidents",
                 "incidents", "training time", "since"],
    )


# ------------------------------------------------------------------------------------ incidents

def verdict_of(incident: Incident) -> dict[str, Any]:
    """The incident's stored verdict as a dict ({} when it is missing or unreadable)."""
    try:
        verdict = json.loads(incident.verdict_json) if incident.verdict_json else {}
    except ValueError:
        return {}
    return verdict if isinstance(verdict, dict) else {}


def suspects_of(incident: Incident) -> list[str]:
    """The suspect nodes of an incident that names no culprit rank (an unlocalized hang: every
    member waits and none stands out), from its verdict's `suspect` evidence."""
    if incident.culprit_ranks:
        return []
    return suspect_nodes(verdict_of(incident).get("evidence") or [])


def unlocalized_words(incident: Incident) -> str:
    """"not localized, suspects node-1, node-2" for an incident without culprit ranks."""
    suspects = suspects_of(incident)
    shown = ", ".join(suspects[:4]) + ("..." if len(suspects) > 4 else "")
    return "not localized, no culprit rank" + (f"; suspects {shown}" if suspects else "")


def incident_label(incident: Incident) -> str:
    culprits = ", ".join(str(r) for r in incident.culprit_ranks[:4])
    more = "..." if len(incident.culprit_ranks) > 4 else ""
    who = f"rank {culprits}{more}" if culprits else unlocalized_words(incident)
    return f"{when(incident.detected_at_us)}  {incident.kind}  {who}  ({incident.incident_id})"


def incident_line(incident: Incident) -> str:
    """One line: when, what, the culprit ranks and nodes (or the suspects of an unlocalized
    one), and how sure."""
    if not incident.culprit_ranks:
        return (f"{when(incident.detected_at_us)} {incident.kind}: "
                f"{unlocalized_words(incident)} (confidence {incident.confidence:.2f})")
    ranks = ", ".join(str(r) for r in incident.culprit_ranks[:8])
    nodes = ", ".join(incident.culprit_nodes[:4])
    more = "..." if len(incident.culprit_ranks) > 8 or len(incident.culprit_nodes) > 4 else ""
    return (f"{when(incident.detected_at_us)} {incident.kind}: rank {ranks} on {nodes}{more} "
            f"(confidence {incident.confidence:.2f})")


def evidence_frame(verdict: Mapping[str, Any], *, facts: Iterable[str] | None = None,
                   exclude: Iterable[str] = ()) -> pd.DataFrame:
    """The verdict's evidence, one row per piece, optionally only some facts."""
    keep = set(facts) if facts is not None else None
    drop = set(exclude)
    rows = []
    for e in verdict.get("evidence") or ():
        if not isinstance(e, Mapping):
            continue
        fact = str(e.get("fact", ""))
        if (keep is not None and fact not in keep) or fact in drop:
            continue
        rows.append({"fact": fact, "rank": e.get("rank"), "node": str(e.get("node", "")),
                     "group": str(e.get("group", "")), "seq": e.get("seq") or None,
                     "value": e.get("value"), "detail": str(e.get("detail", ""))})
    return pd.DataFrame(rows, columns=["fact", "rank", "node", "group", "seq", "value",
                                       "detail"])


STEPS: dict[ActionKind | None, str] = {
    ActionKind.STOP_JOB: "decide: stop",
    ActionKind.OBSERVE: "decide: observe",
    ActionKind.ISOLATE_NODE: "isolate",
    ActionKind.RESTART: "restart",
    ActionKind.RESUMED: "resumed",
    ActionKind.GIVE_UP: "give up",
}


def _action_kind(kind: str) -> ActionKind | None:
    try:
        return ActionKind(kind)
    except ValueError:  # a newer kind than this code knows
        return None


def timeline_frame(incident: Incident) -> pd.DataFrame:
    """detect -> decide -> isolate -> restart -> resumed (or give up), with the time of each step
    after the detection; alerts are listed apart (`alerts_frame`)."""
    rows = [{"step": "detect", "at": when(incident.detected_at_us), "after (s)": 0.0,
             "target": ", ".join(incident.culprit_nodes), "ok": True,
             "detail": incident.summary, "rule": ""}]
    for a in sorted(incident.actions, key=lambda a: a.time_us):
        kind = str(a.kind)
        if kind == "alert":
            continue
        step = STEPS.get(_action_kind(kind), kind)
        rows.append({"step": step, "at": when(a.time_us),
                     "after (s)": round((a.time_us - incident.detected_at_us) / US, 3),
                     "target": a.target, "ok": a.ok, "detail": a.detail, "rule": a.rule})
    return pd.DataFrame(rows, columns=["step", "at", "after (s)", "target", "ok", "detail",
                                       "rule"])


def alerts_frame(incident: Incident) -> pd.DataFrame:
    rows = [{"receiver": a.target, "at": when(a.time_us), "delivered": a.ok, "detail": a.detail}
            for a in sorted(incident.actions, key=lambda a: a.time_us) if str(a.kind) == "alert"]
    return pd.DataFrame(rows, columns=["receiver", "at", "delivered", "detail"])


# ------------------------------------------------------------------------------------- progress

STATUSES = ("completed", "late", "failed", "completed, not recorded", "waiting", "not entered",
            "no record", "culprit: not entered", "culprit: pending", "culprit: frozen")
"""Cell statuses of the progress view, in legend order; the last three are the culprit's own
state at the collective its incident names (`CulpritState`)."""
COLOURS = ("#4c9a5f", "#e8a33d", "#b22222", "#a6cfa9", "#d95f5f", "#5a5a5a", "#dddddd",
           "#000000", "#7b3294", "#1f4e9c")


@dataclass(frozen=True, slots=True)
class CulpritState:
    """Where a culprit rank of an incident was at the collective the incident names, by its
    evidence: `status` is a `STATUSES` culprit status, `words` the evidence in brief."""

    rank: int
    group: str
    seq: int
    status: str
    words: str


_LIFE_FACTS = ("frozen", "silent", "exit")


def culprit_states(incident: Incident | None) -> dict[int, CulpritState]:
    """Per culprit rank, its state at the collective the incident's evidence places it
    (a `lagging` fact): not entered (it never entered it, or its records end before it),
    frozen (entered, and its process is stopped or gone) or pending (entered, not completed).
    Ranks without such a fact are left out."""
    if incident is None:
        return {}
    facts = [e for e in verdict_of(incident).get("evidence", []) if isinstance(e, dict)]
    out: dict[int, CulpritState] = {}
    for rank in (int(r) for r in incident.culprit_ranks):
        mine = [e for e in facts if e.get("rank") == rank]
        lag = next((e for e in mine if e.get("fact") == "lagging" and e.get("group")
                    and "other rank(s)" not in str(e.get("detail", ""))), None)
        if lag is None:
            continue
        life = next((e for e in mine if e.get("fact") in _LIFE_FACTS), None)
        seq, group = int(lag.get("seq", 0)), str(lag["group"])
        if float(lag.get("value", 0.0)) > 0:
            status, where = "culprit: not entered", f"not entered #{seq}"
        elif life is not None and life.get("fact") != "silent":
            status, where = "culprit: frozen", f"entered #{seq}, not completed"
        else:
            status, where = "culprit: pending", f"entered #{seq}, not completed"
        known = _first_bracketed(str(lag.get("detail", "")))
        words = where + (f" ({known})" if known else "")
        if life is not None:
            words += f"; {_life_words(str(life.get('detail', '')), str(life.get('fact')))}"
        out[rank] = CulpritState(rank=rank, group=group, seq=seq, status=status, words=words)
    return out


def _first_bracketed(text: str) -> str:
    """What the first parentheses of `text` hold, nested ones included ("" for none)."""
    start = text.find("(")
    depth = 0
    for i in range(max(start, 0), len(text) if start >= 0 else 0):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1:i]
    return ""


def _life_words(detail: str, fact: str) -> str:
    """A rank's process as its frozen, silent or exit fact says, in a few words."""
    lowered = detail.lower()
    for needle, words in (("stopped", "its process is stopped"), ("gone", "its process is gone"),
                          ("exited", "it exited"), ("silent", "it fell silent")):
        if needle in lowered:
            return words
    return {"frozen": "frozen", "silent": "it fell silent", "exit": "it exited"}.get(fact, fact)

LATE_MIN_US = 5_000
"""A cell is late only if its ranks arrived at least this long after the first rank."""
LATE_FACTOR = 3.0
"""... and later than this many times the typical cell of its sequence id."""


def incident_group(incident: Incident | None) -> str:
    """The process group an incident's verdict names: "" for none, no incident or an unreadable
    verdict."""
    group = verdict_of(incident).get("group", "") if incident is not None else ""
    return group if isinstance(group, str) else ""


def progress_frame(grid: ProgressGrid, culprits: Iterable[int] = (),
                   states: Mapping[int, CulpritState] | None = None) -> pd.DataFrame:
    """One row per (rank bucket, sequence id) of the grid's window (`seq_window`) with its
    status:

    - recorded by every rank of the bucket (or by those reporting it completed): `failed`,
      `late` (arrival lateness well above the sequence id's typical cell), `completed`. Rows
      outrank heartbeats, which can be older than the rows (a rank frozen just after a flush);
    - else from the bucket's ranks' latest heartbeats: a call no rank of the bucket entered is
      `not entered`; one not completed by every rank is `waiting` (a hang's wavefront: the
      culprit's bucket stops a column before its peers); completed but not recorded (dropped,
      or not stored yet) is `completed, not recorded`;
    - without rows or heartbeats, `no record`.

    `culprit` marks the buckets that hold a culprit rank, and their `ranks` label says so
    (the cells stay as they are). The cell of a culprit's bucket at the collective its
    incident names shows the culprit's own state there (`states`, `culprit_states`: not
    entered, pending or frozen, by the incident's evidence), in this grid's group; `state`
    gives it in words."""
    width = max(grid.width, 1)
    culprit_buckets = {(r // width) * width for r in culprits}
    at = {((st.rank // width) * width, st.seq): st for st in (states or {}).values()
          if st.group == grid.group}
    cells = {(c.bucket, c.seq): c for c in grid.cells}
    beats = {b.bucket: b for b in grid.buckets}
    buckets = sorted({b for b, _ in cells} | set(beats))
    seq_lo, seq_hi = seq_window(grid)
    typical: dict[int, float] = {}
    for seq in range(seq_lo, seq_hi + 1):
        lates = sorted(c.late_mean_us for (_, s), c in cells.items() if s == seq)
        typical[seq] = lates[len(lates) // 2] if lates else 0.0
    rows = []
    for bucket in buckets:
        beat = beats.get(bucket)
        for seq in range(seq_lo, seq_hi + 1):
            cell = cells.get((bucket, seq))
            whole = cell is not None and (beat is None or cell.ranks >= beat.ranks
                                          or seq <= beat.min_completed)
            if cell is not None and whole:
                status = _recorded_status(cell, typical[seq])
            elif beat is not None and cell is None and seq > beat.max_enqueued:
                status = "not entered"
            elif beat is not None and seq > beat.min_completed:
                status = "waiting"
            elif beat is not None:
                status = "completed, not recorded"
            else:
                status = "no record"
            own = at.get((bucket, seq))
            if own is not None:
                status = own.status
            rows.append({
                "ranks": _bucket_label(bucket, width)
                + (" culprit" if bucket in culprit_buckets else ""),
                "bucket": bucket, "seq": seq, "status": status,
                "op": cell.op if cell else "",
                "recorded": cell.ranks if cell else 0,
                "late max (ms)": round(cell.late_max_us / 1000, 3) if cell else math.nan,
                "culprit": bucket in culprit_buckets,
                "state": f"rank {own.rank}: {own.words}" if own is not None else "",
            })
    return pd.DataFrame(rows, columns=["ranks", "bucket", "seq", "status", "op", "recorded",
                                       "late max (ms)", "culprit", "state"])


def _bucket_label(bucket: int, width: int) -> str:
    """A row of ranks as the progress view and "Furthest behind" name it: `8-15`, or `8`."""
    return f"{bucket}-{bucket + width - 1}" if width > 1 else str(bucket)


def _recorded_status(cell: ProgressCell, typical_us: float) -> str:
    if cell.failed:
        return "failed"
    if cell.late_mean_us >= max(LATE_MIN_US, LATE_FACTOR * typical_us):
        return "late"
    return "completed"


def seq_window(grid: ProgressGrid) -> tuple[int, int]:
    """The grid's sequence ids, moved on to the newest call a rank has entered (collectives are
    recorded when they end, so the call a hang waits in is known only from heartbeats), as many
    as the grid holds."""
    entered = max((b.max_enqueued for b in grid.buckets), default=0)
    if entered <= grid.seq_hi:
        return grid.seq_lo, grid.seq_hi
    return max(1, entered - (grid.seq_hi - grid.seq_lo)), entered


def behind_frame(grid: ProgressGrid, limit: int = 10, culprits: Sequence[int] = (),
                 states: Mapping[int, CulpritState] | None = None) -> pd.DataFrame:
    """The buckets furthest behind in the group, by the evidence first: the buckets of the
    incident's culprits in its order, with the culprit's state from its evidence (a culprit
    stopped mid-burst reports an older heartbeat than its peers wait on: the heartbeat columns
    alone would show it no further behind than they are), then the others by lowest completed
    sequence id (their heartbeats)."""
    width = max(grid.width, 1)
    rank_of = {(r // width) * width: r for r in reversed(culprits)}  # its first culprit
    first = {b: i for i, b in enumerate(dict.fromkeys((r // width) * width for r in culprits))}
    rows = sorted(grid.buckets, key=lambda b: (first.get(b.bucket, len(first)),
                                               b.min_completed, b.bucket))[:limit]

    def evidence(bucket: int) -> str:
        if bucket not in rank_of:
            return ""
        own = (states or {}).get(rank_of[bucket])
        if own is None or own.group != grid.group:
            return f"culprit rank {rank_of[bucket]}"
        return f"culprit rank {own.rank}: {own.words}"

    return pd.DataFrame(
        [{"ranks": _bucket_label(b.bucket, width),
          "evidence": evidence(b.bucket),
          "lowest completed": b.min_completed, "highest entered": b.max_enqueued,
          "ranks pending": b.pending, "ranks reporting": b.ranks} for b in rows],
        columns=["ranks", "evidence", "lowest completed", "highest entered", "ranks pending",
                 "ranks reporting"],
    )


# --------------------------------------------------------------------------------- time ranges

@dataclass(frozen=True, slots=True)
class Span:
    """The time a job's records cover."""

    start_us: int
    end_us: int


RANGES = {"whole run": 0, "last 5 minutes": 300, "last 15 minutes": 900, "last hour": 3600,
          "last day": 86_400}


def job_span(states: Sequence[JobState], incidents: Sequence[Incident],
             beats: Sequence[Heartbeat], now_us: int) -> Span:
    """From the latest run's first state (or the earliest first step a rank reported, or the
    first incident) to its terminal state (or now while it runs; the newest record for a job
    without states)."""
    run = latest_run(states)
    if run:
        end = run[-1].time_us if run[-1].state in TERMINAL else now_us
        return Span(run[0].time_us, max(end, run[0].time_us + 1))
    times = [b.first_step_us for b in beats if b.first_step_us] + [
        i.detected_at_us for i in incidents]
    ends = [b.time_us for b in beats] + [i.detected_at_us for i in incidents]
    if not times:
        return Span(now_us - 3600 * US, now_us)
    return Span(min(times) - 60 * US, max(ends) + 60 * US)


def window(span: Span, choice: str) -> Span:
    """The part of `span` a time-range choice selects (the last N seconds of it)."""
    seconds = RANGES.get(choice, 0)
    if not seconds:
        return span
    return Span(max(span.start_us, span.end_us - seconds * US), span.end_us)


def bucket_width_us(span: Span, buckets: int = 60) -> int:
    """A round bucket width that cuts `span` into about `buckets` pieces."""
    raw = max((span.end_us - span.start_us) // max(buckets, 1), 1)
    for step in (100_000, 250_000, 500_000, 1_000_000, 2_000_000, 5_000_000, 10_000_000,
                 30_000_000, 60_000_000, 300_000_000, 600_000_000, 3_600_000_000):
        if raw <= step:
            return step
    return int(raw)


# ------------------------------------------------------------------------- stragglers, links

def lateness_frame(series: LatenessSeries) -> pd.DataFrame:
    """The top ranks' mean lateness per time bucket, and the typical (median) rank's."""
    nodes = {int(r): str(n) for r, n in zip(series.top_rank, series.top_node, strict=True)}
    rows = [{"time": pd.Timestamp(int(b), unit="us", tz="UTC"), "rank": f"rank {int(r)}",
             "node": nodes.get(int(r), ""), "kind": "rank",
             "lateness (ms)": round(float(m) / 1000, 3), "collectives": int(n)}
            for b, r, m, n in zip(series.bucket_us, series.rank, series.mean_us, series.n,
                                  strict=True)]
    rows += [{"time": pd.Timestamp(int(b), unit="us", tz="UTC"), "rank": "typical",
              "node": "", "kind": "typical (median)",
              "lateness (ms)": round(float(t) / 1000, 3), "collectives": int(n)}
             for b, t, n in zip(series.typical_bucket_us, series.typical_us, series.typical_n,
                                strict=True)]
    return pd.DataFrame(rows, columns=["time", "rank", "node", "kind", "lateness (ms)",
                                       "collectives"])


def late_ranks_frame(series: LatenessSeries, culprits: Iterable[int] = ()) -> pd.DataFrame:
    blamed = set(culprits)
    return pd.DataFrame(
        [{"rank": int(r), "node": str(n), "mean lateness (ms)": round(float(m) / 1000, 3),
          "collectives": int(c), "culprit": int(r) in blamed}
         for r, n, m, c in zip(series.top_rank, series.top_node, series.top_mean_us,
                               series.top_n, strict=True)],
        columns=["rank", "node", "mean lateness (ms)", "collectives", "culprit"],
    )


def links_frame(links: LinkStats) -> pd.DataFrame:
    return pd.DataFrame(
        {"src": links.src.astype(int), "dst": links.dst.astype(int),
         "transfers": links.n.astype(int),
         "mean (ms)": (links.transfer_mean_us / 1000).round(3),
         "max (ms)": (links.transfer_max_us / 1000).round(3)},
        columns=["src", "dst", "transfers", "mean (ms)", "max (ms)"],
    )


# ------------------------------------------------------------------------------------ health

def job_nodes(run: Sequence[JobState], beats: Sequence[Heartbeat]) -> list[str]:
    """The nodes of a job's latest run (its attempts' and the isolated ones), else those its
    ranks reported from."""
    nodes = {n for s in run for n in (*s.nodes, *s.isolated)}
    if not nodes:
        nodes = {str(b.node) for b in beats}
    return sorted(nodes)


def health_frame(samples: Sequence[HealthSample]) -> pd.DataFrame:
    return pd.DataFrame(
        [{"time": pd.Timestamp(s.time_us, unit="us", tz="UTC"), "node": str(s.node),
          "device": s.device, "series": f"{s.node} {s.device}", "metric": s.metric,
          "value": s.value, "severity": str(s.severity), "source": s.source,
          "detail": s.detail} for s in samples],
        columns=["time", "node", "device", "series", "metric", "value", "severity", "source",
                 "detail"],
    )


PREFERRED_METRICS = ("temp", "util", "power", "memory", "ecc", "xid")
"""The health view opens on the first metric whose name holds one of these, in this order."""


def metric_order(metrics: Iterable[str]) -> list[str]:
    """Metrics sorted by name, the most telling one first (`PREFERRED_METRICS`)."""
    names = sorted(metrics)
    for hint in PREFERRED_METRICS:
        first = next((m for m in names if hint in m.lower()), None)
        if first is not None:
            return [first, *(m for m in names if m != first)]
    return names


EVENT_SEVERITIES = ("warning", "critical")


def health_events(frame: pd.DataFrame) -> pd.DataFrame:
    """The samples that are events (warning or critical), oldest first."""
    events = frame[frame["severity"].isin(EVENT_SEVERITIES)]
    return events.drop(columns=["series"]).reset_index(drop=True)
