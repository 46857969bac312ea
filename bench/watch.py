"""One watcher over many jobs: simulated jobs stream their traces into a ClickHouse server, a
hang is injected into one of them, and one watcher of `tracehound watch --jobs 'prod-*'` (its
`WatchFleet`, in this process, no actions but observing) reads them all through the store's
per-job queries and window summaries.

The jobs are `tracehound.analysis.sim.consecutive_windows` runs: DDP over `--ranks` ranks with
`--step-s` second steps, under the simulator's field conditions (clock skew, jitter, pauses,
slow checkpoints), each with a seed of its own, played window by window (`--window-s`). A writer
process writes each job's window into the store once the clock passes the window's end: its
collectives (the bulk path), heartbeats, stacks, exits, process groups and health events.
Plain health readings (temperatures, clocks: severity info) are left out; they are half the
records and no detector the watcher runs needs them. Job `prod-063` (`--hang-job`) gets a hang:
a rank stopped like SIGSTOP, at a time the simulator draws (79 s into the default run). Every
other job is healthy.

Time: the simulator's clock is mapped onto the wall clock (its run starts when the writer
starts), and the watcher runs on that mapped clock, so it sees each window as its records
arrive: `--window-s` after they were made at the latest, later when the writer falls behind
(`writer_lag_*`). Those delays are part of `detect_s`. Writer, server and watcher share this
machine's cores: the simulated jobs' traces cost the writer and the server far more than the
watching costs the watcher.

Printed (`--json`: one object):
- `jobs`, `ranks`, `duration_s`;
- `windows_per_s`: observations (one job's snapshot, and its window summaries when due) read
  and diagnosed per second over all jobs, and `summaries_per_s` of them with window summaries;
  `poll_interval_s`: the mean time between two polls of one job;
- `detect_s`: from the hang (simulated fault time) to the watcher's incident on that job, and
  whether the incident named the stopped rank (`hang_named`);
- `false_verdicts`: fault incidents on the healthy jobs (should be 0), with their kinds, and
  `false_would_act` of them whose plan the policy would have carried out (stopped, evicted or
  restarted: the watcher here only observes); a soft fault seen in one window is a suspicion
  (the job's state), an incident only when seen in the next window too;
- `stalls_observed`: stall incidents on the healthy jobs, apart: a rank busy outside
  collectives while its peers wait (the simulator's slow checkpoints and evaluations, a step's
  compute up to 3x slower) is recorded and watched, never acted on (`stalls_would_act`);
- `load_avg_1m`: the machine's load average at the start and the end of the watch (the
  machine is shared: what else ran moves every figure);
- `watcher_cpu_share`: this process's CPU seconds (the watcher: its analysis and the store
  client) per wall second; `server_cpu_share`: the ClickHouse server's (the writer's inserts and
  the watcher's queries), when this run started it; `writer_cpu_share`, `writer_lag_max_s` (how
  late the writer wrote a window at worst; `writer_lag_p50_s` and `_p95_s`) and `rows`.

    .venv/bin/python bench/watch.py --json                  # 100 jobs x 256 ranks, 150 s
    .venv/bin/python bench/watch.py --quick --json          # 4 jobs x 32 ranks, 30 s
    .venv/bin/python bench/watch.py --json --store clickhouse://default:@127.0.0.1:9000/wb

Without --store it starts a ClickHouse server of its own (tests/clickhouse_harness.py) in a temp
dir and stops it at the end. It measures a server store only: many jobs' node agents ship to
one. Figures are printed, never asserted; it exits 1 only when it could not run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import dataclasses
import heapq
import json
import multiprocessing as mp
import platform
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
SEED = 7
"""Every job's seed is SEED + 100,000 * i: the simulator starts runs whose seeds agree modulo
100,000 at one time, so the jobs run side by side."""
DATABASE = "watchbench"


def say(msg: str) -> None:
    print(f"[watch-bench] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class JobPlan:
    job: str
    seed: int
    hang: bool


HUNG = 63
"""The job the hang goes to when there are that many: its simulated fault strikes 79 s into a
150 s run of 256-rank jobs, once the watcher has been watching every job for a while (finding
100 jobs that start at once takes it the first half minute or so)."""


def plans(jobs: int, hung: int) -> list[JobPlan]:
    return [JobPlan(f"prod-{i:03d}", SEED + 100_000 * i, i == hung) for i in range(jobs)]


def sim_t0() -> int:
    from tracehound.analysis.sim import BASE_EPOCH_US

    return BASE_EPOCH_US + (SEED % 100_000) * 3_600 * 1_000_000


# -- the writer (a process of its own) -------------------------------------------------------


def writer(url: str, jobs: list[JobPlan], args: dict[str, Any], conn: Any) -> None:
    """Plays every job window by window and writes each window once the clock passes its end;
    sends back the truth of each job, the rows written, its CPU and how late it was at worst."""
    from tracehound.analysis.sim import consecutive_windows
    from tracehound.tracing.events import Batch, HealthSeverity, Record
    from tracehound.tracing.store import bulk, open_store

    store = bulk(open_store(url))
    count = int(args["duration_s"] // args["window_s"])
    runs = {p.job: consecutive_windows(
        ranks=args["ranks"], seed=p.seed, count=count, window_s=args["window_s"], job=p.job,
        workload="ddp", step_s=args["step_s"], fault="hang" if p.hang else None,
        variant="sigstop" if p.hang else None) for p in jobs}
    ahead = {job: next(run) for job, run in runs.items()}  # each run's setup, before the clock
    conn.send(("ready", None))
    wall0_us = conn.recv()
    offset = wall0_us - sim_t0()
    cpu0 = time.process_time()
    due = [(w.now_us + offset, job) for job, w in ahead.items()]
    heapq.heapify(due)
    truth: dict[str, Any] = {}
    rows, lag_max, written = 0, 0.0, 0
    lags: list[float] = []
    announced: set[str] = set()
    while due:
        at, job = heapq.heappop(due)
        wait = (at - time.time_ns() // 1000) / 1e6
        if wait > 0:
            time.sleep(wait)
        lag_max = max(lag_max, -wait)
        lags.append(max(0.0, -wait))
        window = ahead.pop(job)
        store.insert_columns(window.job, window.attempt, window.columns, window.node_of_rank(),
                             batch_id=f"wb-{job}-{written}-c")
        records: list[Record] = [*window.heartbeats, *window.exits, *window.stacks]
        records += [h for h in window.health if h.severity is not HealthSeverity.INFO]
        if job not in announced:
            announced.add(job)
            records += list(window.groups)
        store.insert(Batch(batch_id=f"wb-{job}-{written}-r", records=tuple(records)))
        rows += len(window.columns) + len(records)
        written += 1
        if window.truth.kind is not None:
            truth[job] = {"kind": window.truth.kind.value,
                          "culprit_ranks": list(window.truth.culprit_ranks),
                          "fault_us": window.truth.fault_us, "variant": window.truth.variant}
        nxt = next(runs[job], None)
        if nxt is not None:
            ahead[job] = nxt
            heapq.heappush(due, (nxt.now_us + offset, job))
    store.close()
    conn.send(("done", {"truth": truth, "rows": rows, "windows": written,
                        "cpu_s": time.process_time() - cpu0, "lag_max_s": lag_max,
                        "lag_p50_s": _quantile(lags, 0.5), "lag_p95_s": _quantile(lags, 0.95)}))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


# -- the watcher (this process) ----------------------------------------------------------------


def server_cpu_s(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """With a ClickHouse server of its own unless --store names one (stopped and removed at the
    end)."""
    if args.store:
        if args.store.startswith("chdb"):
            raise SystemExit("bench/watch.py measures a ClickHouse server (the store of many "
                             "jobs' node agents); give one (--store clickhouse://...) or none "
                             "(one is started)")
        return measure(args, workdir, args.store, None)
    # the server's data in memory where there is room (tests/clickhouse_harness.py: on this
    # machine's disk, creating a part's files was most of the server's CPU); removed at the end
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and shutil.disk_usage(shm).free > 8 << 30
    server_dir = Path(tempfile.mkdtemp(dir=shm if roomy else workdir, prefix="watch-bench-ch-"))
    from soak import load_harness  # bench/soak.py, beside this script

    server = load_harness().start_server(server_dir)
    try:
        return measure(args, workdir, urlsplit(server.url)._replace(
            path=f"/{DATABASE}").geturl(), server.pid)
    finally:
        server.stop()
        shutil.rmtree(server_dir, ignore_errors=True)


def measure(args: argparse.Namespace, workdir: Path, url: str,
            server_pid: int | None) -> dict[str, Any]:
    """Stream the jobs into the store at `url` and watch them (see the module docstring)."""
    from tracehound.tracing.store import open_store

    say(f"store {url}")
    jobs = plans(args.jobs, args.hang_job)
    store = open_store(url)  # the schema, before the writer writes
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    params = {"duration_s": args.duration_s, "window_s": args.window_s, "ranks": args.ranks,
              "step_s": args.step_s}
    child = ctx.Process(target=writer, args=(url, jobs, params, there), daemon=True)
    child.start()
    try:
        return watch(args, workdir, url, server_pid, jobs, store, here, child)
    finally:
        if child.is_alive():
            child.terminate()
        child.join()
        store.close()


def watch(args: argparse.Namespace, workdir: Path, url: str, server_pid: int | None,
          jobs: list[JobPlan], store: Any, here: Any, child: Any) -> dict[str, Any]:
    """Run the watcher while the writer streams; the figures."""
    from tracehound.analysis.settings import DetectionSettings, HangSettings
    from tracehound.controller.actions.observe import NOT_ACTED, ObserveActions
    from tracehound.controller.supervision.watcher import (
        EventKind,
        Watcher,
        WatchEvent,
        WatchFleet,
        WatchSettings,
    )
    from tracehound.tracing.events import IncidentKind, now_us
    from tracehound.tracing.ids import JobId

    say(f"{len(jobs)} jobs of {args.ranks} ranks: setting up the simulated runs")
    if here.recv()[0] != "ready":
        raise RuntimeError("the writer did not start")
    wall0_us = now_us() + 1_000_000
    here.send(wall0_us)
    offset = sim_t0() - wall0_us

    def clock() -> int:
        return now_us() + offset

    settings = WatchSettings(supervisor=dataclasses.replace(
        WatchSettings().supervisor, poll_s=args.poll_s,
        detection=DetectionSettings(hang=HangSettings(after_s=5.0))))
    events: list[WatchEvent] = []
    watchers: list[Watcher] = []

    def make(job: JobId) -> Watcher:
        watcher = Watcher(job=job, store=store, actions=ObserveActions(), settings=settings,
                          workdir=workdir / job, clock=clock, on_event=events.append)
        watchers.append(watcher)
        return watcher

    fleet = WatchFleet(store=store, make_watcher=make, pattern="prod-*", settings=settings,
                       clock=clock, on_event=events.append)
    time.sleep(max(0.0, (wall0_us - now_us()) / 1e6))
    say(f"streaming and watching for {args.duration_s:.0f} s")
    end_us = sim_t0() + int(args.duration_s * 1e6)
    load0 = os.getloadavg()[0]
    usage0 = resource.getrusage(resource.RUSAGE_SELF)
    server0, wall0 = server_cpu_s(server_pid), time.monotonic()
    fleet.start()
    last_said = time.monotonic()
    steady: tuple[float, int, int] | None = None
    """When every job was watched: (wall, polls, summaries) then."""
    while clock() < end_us:
        if steady is None and len(watchers) == len(jobs):
            steady = (time.monotonic(), sum(w.polls for w in watchers),
                      sum(w.summarized for w in watchers))
        delay = fleet.step() or 0.0
        if delay > 0:
            time.sleep(min(delay, max(0.0, (end_us - clock()) / 1e6)))
        if time.monotonic() - last_said > 15:
            last_said = time.monotonic()
            say(f"{(clock() - sim_t0()) / 1e6:.0f} s: {len(watchers)} jobs watched, "
                f"{sum(w.polls for w in watchers)} polls, "
                f"{sum(e.kind is EventKind.INCIDENT for e in events)} incidents")
    wall = time.monotonic() - wall0
    usage1 = resource.getrusage(resource.RUSAGE_SELF)
    server1 = server_cpu_s(server_pid)
    cpu = (usage1.ru_utime + usage1.ru_stime) - (usage0.ru_utime + usage0.ru_stime)
    polls = sum(w.polls for w in watchers)
    summarized = sum(w.summarized for w in watchers)
    # the rates over the time every job was watched (before, jobs were still being found)
    since, polls0, summarized0 = steady or (wall0, 0, 0)
    steady_s = max(1e-9, time.monotonic() - since)
    fleet.close(drain_s=5.0)
    try:
        _, written = here.recv()
    except EOFError:
        raise RuntimeError("the writer died (its traceback is above)") from None

    incidents = [e for e in events if e.kind is EventKind.INCIDENT]
    hung = next((p.job for p in jobs if p.hang), None)
    truth = written["truth"].get(hung) if hung else None
    on_hung = [e for e in incidents if e.job == hung]
    detect_s = named = None
    if truth is not None and on_hung:
        first = on_hung[0]
        detect_s = round((first.time_us - truth["fault_us"]) / 1e6, 2)
        named = bool(set(first.data["culprit_ranks"]) & set(truth["culprit_ranks"]))
    others = [e for e in incidents if e.job != hung]
    # a stall is a rank busy outside collectives while its peers wait (the simulator's slow
    # checkpoints, evaluations, compute 3x slower for a step): an observation, never acted on,
    # counted apart from the fault verdicts
    stalls = [e for e in others if e.data["kind"] == IncidentKind.STALL.value]
    false = [e for e in others if e.data["kind"] != IncidentKind.STALL.value]
    acting = {e.data["incident"] for e in events if e.kind is EventKind.ACTION
              and str(e.data["detail"]).startswith(NOT_ACTED)}
    return {
        "jobs": len(jobs), "ranks": args.ranks, "duration_s": args.duration_s,
        "window_s": args.window_s, "step_s": args.step_s, "jobs_watched": len(watchers),
        "windows_per_s": round((polls - polls0) / steady_s, 2),
        "summaries_per_s": round((summarized - summarized0) / steady_s, 2),
        "poll_interval_s": (round(steady_s * len(watchers) / (polls - polls0), 2)
                            if polls > polls0 else None),
        "steady_s": round(steady_s, 1),
        "detect_s": detect_s, "hang_named": named,
        "hang": {"job": hung, **(truth or {}),
                 "polls_after": sum(1 for w in watchers if w.spec.job == hung
                                    for t in w.poll_times if truth and t > truth["fault_us"])},
        "hang_incidents": [{"kind": e.data["kind"], "culprit_ranks": e.data["culprit_ranks"],
                            "summary": e.data["summary"]} for e in on_hung],
        "false_verdicts": len(false),
        "false_would_act": sum(e.data["incident"] in acting for e in false),
        "stalls_observed": len(stalls),
        "stalls_would_act": sum(e.data["incident"] in acting for e in stalls),
        "false_kinds": sorted({f"{e.data['kind']}" for e in false}),
        "false_detail": [{"job": e.job, "kind": e.data["kind"],
                          "culprit_ranks": e.data["culprit_ranks"],
                          "confidence": e.data["confidence"]} for e in false][:20],
        "watcher_cpu_share": round(cpu / wall, 3),
        "server_cpu_share": (round((server1 - server0) / wall, 3)
                             if server1 is not None and server0 is not None else None),
        "writer_cpu_share": round(written["cpu_s"] / wall, 3),
        "writer_lag_max_s": round(written["lag_max_s"], 2),
        "writer_lag_p50_s": round(written["lag_p50_s"], 2),
        "writer_lag_p95_s": round(written["lag_p95_s"], 2),
        "rows": written["rows"], "windows_written": written["windows"],
        "store": ("clickhouse server (started by this run)" if server_pid
                  else "clickhouse server"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_avg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true",
                        help="4 jobs of 32 ranks for 30 s (for a test)")
    parser.add_argument("--jobs", type=int, default=None, help="simulated jobs (default 100)")
    parser.add_argument("--ranks", type=int, default=None, help="ranks per job (default 256)")
    parser.add_argument("--duration-s", type=float, default=None,
                        help="seconds of streaming and watching (default 150)")
    parser.add_argument("--window-s", type=float, default=None,
                        help="seconds of each window the writer writes at once (default 5)")
    parser.add_argument("--step-s", type=float, default=10.0,
                        help="the simulated jobs' step time (default 10)")
    parser.add_argument("--poll-s", type=float, default=1.0,
                        help="the watcher's poll interval per job (default 1)")
    parser.add_argument("--hang-job", type=int, default=None,
                        help=f"the job the hang goes to (default {HUNG}, or the middle one when "
                             "there are fewer jobs)")
    parser.add_argument("--store", help="a ClickHouse server URL (default: start one)")
    args = parser.parse_args()
    quick = {"jobs": 4, "ranks": 32, "duration_s": 30.0, "window_s": 2.0}
    full = {"jobs": 100, "ranks": 256, "duration_s": 150.0, "window_s": 5.0}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.hang_job is None:
        args.hang_job = HUNG if args.jobs > HUNG else args.jobs // 2
    with tempfile.TemporaryDirectory(prefix="watch-bench-") as tmp:
        result = run(args, Path(tmp))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
