"""Soak: many simulated ranks stream through real node agents into a real ClickHouse server for
minutes; sustained events per second, every process's memory over time, ship lag, and the exact
count of events lost and stored twice.

The ranks are light emitter processes, not torch jobs (too heavy for a small machine): each hosts
a few ranks, and each rank is the real recorder path of a training process, a
`tracehound.agent.rank.recorder.Recorder` (collectives through `begin`/`end`, heartbeats from its
own thread) handing its records to its own `tracehound.agent.rank.transport.SocketTransport`
connected to its node's agent. The node agents are real `tracehound.agent.node.daemon` processes
(spool, shipper, process watcher) shipping straight into the server (`--sink clickhouse://`).
Each rank emits `--rate` collectives a second (two process groups, alternating) for
`--duration` seconds, paced against the wall clock.

What is measured:
- `events_sent`: collectives the ranks' transports accepted (a full transport queue refuses and
  counts; those are `dropped_by_ranks`, expected 0, and are not expected in the store);
  `events_stored`: distinct (attempt, rank, group, seq) keys stored for the job
  (`BulkStore.collective_keys`, which returns duplicates too); `lost`: sent keys missing from the
  store; `duplicated`: stored rows beyond one per key; `unexpected`: stored keys nobody sent.
- `events_per_s`: events stored / the emission window; `shipped_per_s`: the records (heartbeats
  and the agents' own too) the agents shipped per `--window-s` window, from their stats files.
- `memory`: the RSS of every process (agents, rank emitters, this process, the server when this
  run started it), sampled every `--sample-s`; per process kind: the worst process's start, max
  and end during the emission window, and the slope of its second half (`flat` when the second
  half grows by less than max(2 MB, 2 %)), and its RSS at 11 evenly spaced points of the window
  (`worst_series_mb`). `max_rss_mb` is the max per kind.
- `ship_lag_ms`: a probe rank per agent (a job of its own, `<job>-probe`, through the same
  sockets, spools and shippers) records one collective a second; another thread polls the store
  every 0.1 s and takes the time from a probe record's creation to its first sight there.
- `drain_s`: from the end of emission until every agent had shipped all it spooled.

    .venv/bin/python bench/soak.py                        # 5 min: 32 ranks x 300/s, 4 agents
    .venv/bin/python bench/soak.py --quick --json         # 1 min; one JSON object on stdout
    .venv/bin/python bench/soak.py --duration 600 --ranks 64 --rate 200 \\
        --server clickhouse://default:@127.0.0.1:9000/soak

Without --server it starts a ClickHouse server of its own (tests/clickhouse_harness.py, in a
temp dir) and stops it at the end; `server` in the output says which. It prints figures and never
fails on time (benchmarks do not gate anything); it exits 1 only when it could not run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent
GROUPS = ("0", "1")
"""Process groups every rank's collectives alternate between."""
PROBE_GROUP = "probe"
EMITTER_FLAG = "--emitter"
"""argv[1] of the rank emitter processes this script starts of itself."""
SOAK_DATABASE = "tracehound_soak"
"""Database used on a server this script starts itself."""


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- rank emitters (child processes) -----------------------------------------------------------


class CountingSink:
    """A rank's transport, noting which collectives it refused (full queue), so the store can be
    checked against exactly what was accepted."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.refused: list[tuple[str, int]] = []

    def offer(self, item: Any) -> bool:
        accepted: bool = self.transport.offer(item)
        if not accepted and isinstance(item, tuple):
            self.refused.append((item[1], item[2]))  # (group, seq): recorder.RawCollective
        return accepted

    def flush(self, timeout: float) -> bool:
        done: bool = self.transport.flush(timeout)
        return done

    @property
    def lost(self) -> int:
        lost: int = self.transport.lost
        return lost


def emitter_main(argv: list[str]) -> int:
    """One emitter process: ranks of one node, each with a real Recorder and SocketTransport."""
    from tracehound.agent.rank.recorder import Recorder
    from tracehound.agent.rank.transport import SocketTransport

    parser = argparse.ArgumentParser(prog="soak.py --emitter")
    parser.add_argument("--socket", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--ranks", required=True, help="comma-separated global ranks")
    parser.add_argument("--rate", type=float, required=True)
    parser.add_argument("--start-at", type=float, required=True, help="wall time to start")
    parser.add_argument("--duration", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    ranks = [int(r) for r in args.ranks.split(",")]
    sinks = [CountingSink(SocketTransport(args.socket)) for _ in ranks]
    recorders = [Recorder(job=args.job, attempt=0, node=args.node, rank=r, sink=s)
                 for r, s in zip(ranks, sinks, strict=True)]
    for sink, recorder in zip(sinks, recorders, strict=True):
        sink.transport.start()
        recorder.start()
    emitted = [0] * len(ranks)
    per_group = [dict.fromkeys(GROUPS, 0) for _ in ranks]
    time.sleep(max(0.0, args.start_at - time.time()))
    start = time.monotonic()
    end = start + args.duration
    while True:
        now = time.monotonic()
        due = int(args.rate * args.duration) if now >= end else int(args.rate * (now - start))
        for i, recorder in enumerate(recorders):
            counts = per_group[i]
            while emitted[i] < due:
                group = GROUPS[emitted[i] % len(GROUPS)]
                token = recorder.begin(group, "all_reduce", 1 << 20, "float32")
                recorder.end(token, True)
                counts[group] += 1
                emitted[i] += 1
        if now >= end:
            break
        time.sleep(0.005)
    flush_start = time.monotonic()
    for recorder in recorders:
        recorder.close(timeout=60.0)
    flush_s = time.monotonic() - flush_start
    result = []
    for rank, sink, recorder, counts in zip(ranks, sinks, recorders, per_group, strict=True):
        transport = sink.transport
        result.append({
            "rank": rank, "node": args.node, "groups": counts, "refused": sink.refused,
            "transport_sent": transport.sent, "transport_lost": transport.lost,
            "transport_unsent": transport.pending, "recorder_errors": recorder.errors,
            "transport_connects": transport.connects,
        })
        transport.close(timeout=1.0)
    tmp = f"{args.out}.tmp"
    with open(tmp, "w") as handle:
        json.dump({"ranks": result, "flush_s": flush_s}, handle)
    os.replace(tmp, args.out)
    return 0


# -- process sampling --------------------------------------------------------------------------


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Watched:
    kind: str
    name: str
    pid: int
    samples: list[tuple[float, float]] = field(default_factory=list)
    """(wall time, RSS MB)"""
    cpu_s: float | None = None


class Sampler(threading.Thread):
    """Samples every watched process's RSS and the agents' stats files every `interval_s`."""

    def __init__(self, watched: list[Watched], stats_files: list[Path], interval_s: float) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.watched = watched
        self.stats_files = stats_files
        self.interval_s = interval_s
        self.shipped: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def shipped_now(self) -> int:
        total = 0
        for path in self.stats_files:
            with contextlib.suppress(OSError, ValueError):
                total += int(json.loads(path.read_text())["shipped"])
        return total

    def run(self) -> None:
        while not self.stop.is_set():
            now = time.time()
            for proc in self.watched:
                value = rss_mb(proc.pid)
                if value is not None:
                    proc.samples.append((now, value))
                    used = cpu_s(proc.pid)
                    if used is not None:
                        proc.cpu_s = used
            self.shipped.append((now, self.shipped_now()))
            self.stop.wait(self.interval_s)


def slope_per_min(points: list[tuple[float, float]]) -> float:
    if len(points) < 2:
        return 0.0
    ts = [t for t, _ in points]
    vs = [v for _, v in points]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - mt) ** 2 for t in ts)
    if den == 0:
        return 0.0
    return 60 * sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / den


def memory_summary(proc: Watched, start: float, end: float) -> dict[str, Any]:
    """Start, max and end RSS in the window [start, end], and the second half's trend."""
    inside = [(t, v) for t, v in proc.samples if start <= t <= end] or proc.samples
    if not inside:
        return {"name": proc.name, "samples": 0}
    half = [(t, v) for t, v in inside if t >= (start + end) / 2] or inside
    slope = slope_per_min(half)
    growth = slope * (half[-1][0] - half[0][0]) / 60
    return {
        "name": proc.name, "samples": len(inside), "start_mb": round(inside[0][1], 1),
        "max_mb": round(max(v for _, v in proc.samples), 1), "end_mb": round(inside[-1][1], 1),
        "second_half_mb_per_min": round(slope, 3),
        "second_half_growth_mb": round(growth, 2),
        "flat": growth < max(2.0, 0.02 * inside[-1][1]),
        "series_mb": [round(inside[min(len(inside) - 1, len(inside) * k // 10)][1], 1)
                      for k in range(11)],
    }


def by_kind(watched: list[Watched], start: float, end: float) -> dict[str, dict[str, Any]]:
    """Per kind of process: how many, the worst process's figures (by growth), max, total CPU."""
    out: dict[str, dict[str, Any]] = {}
    for kind in dict.fromkeys(p.kind for p in watched):
        procs = [p for p in watched if p.kind == kind]
        summaries = [memory_summary(p, start, end) for p in procs if p.samples]
        if not summaries:
            continue
        worst = max(summaries, key=lambda s: s["second_half_growth_mb"])
        out[kind] = {
            "processes": len(procs),
            "max_mb": max(s["max_mb"] for s in summaries),
            "start_mb": worst["start_mb"], "end_mb": worst["end_mb"],
            "worst": worst["name"],
            "second_half_mb_per_min": worst["second_half_mb_per_min"],
            "second_half_growth_mb": worst["second_half_growth_mb"],
            "flat": all(s["flat"] for s in summaries),
            "worst_series_mb": worst["series_mb"],
            "cpu_s": round(sum(p.cpu_s or 0.0 for p in procs), 1),
        }
    return out


# -- ship lag probe ----------------------------------------------------------------------------


class Probe(threading.Thread):
    """One probe rank per agent records a collective every `every_s` (in the bench process, over
    the real transport); a watcher thread polls the store for them and notes each one's lag."""

    def __init__(self, url: str, job: str, sockets: list[str], every_s: float) -> None:
        super().__init__(name="soak-probe", daemon=True)
        from tracehound.agent.rank.recorder import Recorder
        from tracehound.agent.rank.transport import SocketTransport

        self.url = url
        self.job = job
        self.every_s = every_s
        self.transports = [SocketTransport(path) for path in sockets]
        self.recorders = [Recorder(job=job, attempt=0, node=f"node-{i}", rank=i, sink=t)
                          for i, t in enumerate(self.transports)]
        self.created: dict[tuple[int, int], float] = {}
        self.seen: dict[tuple[int, int], float] = {}
        self.lags: list[tuple[float, float]] = []
        """(creation wall time, lag s)"""
        self.emitting = threading.Event()
        self.stop = threading.Event()
        self.errors = 0
        self.watcher = threading.Thread(target=self.watch, name="soak-probe-watch", daemon=True)

    def run(self) -> None:
        for transport in self.transports:
            transport.start()
        self.watcher.start()
        i = 0
        while not self.stop.wait(self.every_s / len(self.recorders)):
            if not self.emitting.is_set():
                continue
            rank = i % len(self.recorders)
            recorder = self.recorders[rank]
            token = recorder.begin(PROBE_GROUP, "barrier", 0, "")
            recorder.end(token, True)
            self.created[(rank, token[1])] = time.time()
            i += 1

    def watch(self) -> None:
        from tracehound.tracing.ids import JobId
        from tracehound.tracing.store import bulk, open_store

        store = bulk(open_store(self.url))
        try:
            while not self.stop.wait(0.1):
                try:
                    keys = store.collective_keys(JobId(self.job))
                except Exception:
                    self.errors += 1
                    continue
                now = time.time()
                for key in keys:
                    k = (key.rank, key.seq)
                    if k not in self.seen and k in self.created:
                        self.seen[k] = now
                        self.lags.append((self.created[k], now - self.created[k]))
        finally:
            store.close()

    def close(self) -> None:
        self.stop.set()
        self.watcher.join(timeout=10)
        for transport in self.transports:
            transport.close(timeout=2.0)


def lag_summary(lags: list[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    values = sorted(lag for _, lag in lags)
    if not values:
        return {"samples": 0}

    def pct(p: float, of: list[float]) -> float:
        return round(1000 * of[min(len(of) - 1, int(p * len(of)))], 1)

    second = sorted(lag for t, lag in lags if t >= (start + end) / 2)
    return {
        "samples": len(values), "p50": pct(0.5, values), "p90": pct(0.9, values),
        "p99": pct(0.99, values), "max": round(1000 * values[-1], 1),
        "second_half_p50": pct(0.5, second) if second else None,
        "second_half_max": round(1000 * second[-1], 1) if second else None,
    }


def window_rates(series: list[tuple[float, int]], start: float, end: float,
                 window_s: float) -> dict[str, Any]:
    """Records shipped per second in consecutive windows of the emission period."""
    rates = []
    inside = [(t, n) for t, n in series if start <= t <= end]
    i = 0
    for j in range(1, len(inside)):
        if inside[j][0] - inside[i][0] >= window_s:
            rates.append((inside[j][1] - inside[i][1]) / (inside[j][0] - inside[i][0]))
            i = j
    if not rates:
        return {"windows": 0}
    return {"windows": len(rates), "min": round(min(rates)), "median": round(
        statistics.median(rates)), "max": round(max(rates))}


# -- the run ----------------------------------------------------------------------------------


def load_harness() -> Any:
    spec = importlib.util.spec_from_file_location(
        "clickhouse_harness", ROOT / "tests" / "clickhouse_harness.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("tests/clickhouse_harness.py not found")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def wait_for(predicate: Any, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.1)
    return time.monotonic() - start


def agent_stats(path: Path) -> dict[str, Any]:
    try:
        stats: dict[str, Any] = json.loads(path.read_text())
        return stats
    except (OSError, ValueError):
        return {}


def drained(stats_files: list[Path]) -> bool:
    """Every agent has shipped all it spooled; checked twice, 1.1 s apart, as the stats files
    are rewritten every second."""
    for attempt in range(2):
        if attempt:
            time.sleep(1.1)
        for path in stats_files:
            s = agent_stats(path)
            if not s or s.get("pending_segments") != 0 or s.get("spooled") != s.get("shipped"):
                return False
    return True


def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tracehound.tracing.ids import JobId
    from tracehound.tracing.store import bulk, open_store

    server = None
    if args.server:
        url, server_note = args.server, f"given: {args.server}"
    else:
        server = load_harness().start_server(workdir / "clickhouse")
        url = urlsplit(server.url)._replace(path=f"/{SOAK_DATABASE}").geturl()
        server_note = f"started by this run (clickhouse-server pid {server.pid}), stopped at end"
    log(f"store {url} ({server_note})")
    job = f"soak-{uuid.uuid4().hex[:8]}"
    probe_job = f"{job}-probe"
    procs: list[subprocess.Popen[bytes]] = []
    watched: list[Watched] = [Watched("bench", "bench", os.getpid())]
    if server is not None:
        watched.append(Watched("clickhouse", "clickhouse-server", server.pid))
    try:
        store = bulk(open_store(url))  # creates the schema before the agents ship
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        sockets, stats_files = [], []
        for i in range(args.agents):
            node = f"node-{i}"
            sock = str(workdir / f"agent-{i}.sock")
            stats = workdir / f"agent-{i}.stats.json"
            proc = subprocess.Popen(
                [sys.executable, "-m", "tracehound.agent.node", "--job", job, "--node", node,
                 "--socket", sock, "--spool", str(workdir / "spool" / node), "--sink", url,
                 "--stats-file", str(stats), "--stack-after", "0", "--drain-s", "60"],
                env=env, stdout=subprocess.DEVNULL,
                stderr=open(workdir / f"agent-{i}.log", "wb"),  # noqa: SIM115
            )
            procs.append(proc)
            watched.append(Watched("agent", node, proc.pid))
            sockets.append(sock)
            stats_files.append(stats)
        wait_for(lambda: all(os.path.exists(s) for s in sockets), 60, "agent sockets")
        per_node = -(-args.ranks // args.agents)
        start_at = time.time() + 3.0 + 0.2 * args.ranks / args.ranks_per_process
        outs: list[Path] = []
        emitters: list[subprocess.Popen[bytes]] = []
        for i in range(args.agents):
            node_ranks = list(range(i * per_node, min(args.ranks, (i + 1) * per_node)))
            for k in range(0, len(node_ranks), args.ranks_per_process):
                chunk = node_ranks[k:k + args.ranks_per_process]
                out = workdir / f"emitter-{chunk[0]}.json"
                proc = subprocess.Popen(
                    [sys.executable, str(HERE), EMITTER_FLAG, "--socket", sockets[i], "--job", job,
                     "--node", f"node-{i}", "--ranks", ",".join(map(str, chunk)),
                     "--rate", str(args.rate), "--start-at", str(start_at), "--duration",
                     str(args.duration), "--out", str(out)],
                    env=env, stdout=subprocess.DEVNULL,
                    stderr=open(workdir / f"emitter-{chunk[0]}.log", "wb"),  # noqa: SIM115
                )
                procs.append(proc)
                emitters.append(proc)
                outs.append(out)
                watched.append(Watched("rank", f"ranks {chunk[0]}-{chunk[-1]}", proc.pid))
        sampler = Sampler(watched, stats_files, args.sample_s)
        sampler.start()
        probe = Probe(url, probe_job, sockets, args.probe_s)
        probe.start()
        log(f"job {job}: {args.ranks} ranks in {len(emitters)} emitter processes, "
            f"{args.agents} agents, {args.rate:g} collectives/s per rank for "
            f"{args.duration:g} s")
        time.sleep(max(0.0, start_at - time.time()))
        probe.emitting.set()
        end_at = start_at + args.duration
        next_note = time.time() + 30
        while time.time() < end_at:
            time.sleep(min(1.0, max(0.0, end_at - time.time())))
            if time.time() >= next_note:
                next_note += 30
                log(f"{time.time() - start_at:.0f} s: {sampler.shipped_now()} records shipped")
        probe.emitting.clear()
        for proc in emitters:
            try:
                proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                log(f"emitter {proc.pid} did not finish; killed")
                proc.kill()
        emitted_at = time.time()

        try:
            wait_for(lambda: drained(stats_files), 300, "agents drained")
        except RuntimeError as exc:
            log(str(exc))
        drain_s = time.time() - emitted_at
        time.sleep(0.5)  # the probe's last look
        probe.close()
        sampler.stop.set()
        sampler.join(timeout=10)
        for proc in procs[:args.agents]:
            proc.send_signal(signal.SIGTERM)
        for proc in procs[:args.agents]:
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
        final_stats = [agent_stats(p) for p in stats_files]

        ranks_out: list[dict[str, Any]] = []
        flush_s = []
        for out in outs:
            if out.exists():
                data = json.loads(out.read_text())
                ranks_out.extend(data["ranks"])
                flush_s.append(data["flush_s"])
        expected: set[tuple[int, int, str, int]] = set()
        refused = 0
        for r in ranks_out:
            gone = {(g, s) for g, s in r["refused"]}
            refused += len(gone)
            for group, n in r["groups"].items():
                expected.update((0, r["rank"], group, s) for s in range(1, n + 1)
                                if (group, s) not in gone)
        emitted = sum(sum(r["groups"].values()) for r in ranks_out)
        rows = collections.Counter(
            (k.attempt, k.rank, k.group, k.seq) for k in store.collective_keys(JobId(job)))
        probe_rows = collections.Counter(
            (k.rank, k.seq) for k in store.collective_keys(JobId(probe_job)))
        store.close()
        stored = set(rows)
        window = (start_at, end_at)
        kinds = by_kind(watched, *window)
        return {
            "server": server_note,
            "job": job,
            "duration_s": args.duration,
            "ranks": args.ranks,
            "agents": args.agents,
            "emitter_processes": len(emitters),
            "ranks_per_process": args.ranks_per_process,
            "rate_per_rank": args.rate,
            "ranks_reported": len(ranks_out),
            "events_emitted": emitted,
            "dropped_by_ranks": refused,
            "events_sent": len(expected),
            "events_stored": len(stored),
            "lost": len(expected - stored),
            "duplicated": sum(rows.values()) - len(rows),
            "unexpected": len(stored - expected),
            "events_per_s": round(len(stored) / args.duration, 1),
            "offered_per_s": round(emitted / args.duration, 1),
            "shipped_per_s": window_rates(sampler.shipped, *window, args.window_s),
            "transport": {
                "sent": sum(r["transport_sent"] for r in ranks_out),
                "lost": sum(r["transport_lost"] for r in ranks_out),
                "unsent_at_exit": sum(r["transport_unsent"] for r in ranks_out),
                "recorder_errors": sum(r["recorder_errors"] for r in ranks_out),
                "reconnects": sum(r["transport_connects"] - 1 for r in ranks_out),
                "flush_at_end_max_s": round(max(flush_s), 2) if flush_s else None,
            },
            "agents_final": {
                key: sum(int(s.get(key, 0)) for s in final_stats)
                for key in ("received", "rejected", "spooled", "shipped", "shipped_batches",
                            "retries", "refused_batches", "corrupt_lines", "pending_segments")
            },
            "ship_lag_ms": lag_summary(probe.lags, *window),
            "probe": {"sent": len(probe.created), "seen": len(probe.seen),
                      "lost": len(set(probe.created) - set(probe_rows)),
                      "duplicated": sum(probe_rows.values()) - len(probe_rows),
                      "poll_errors": probe.errors},
            "drain_s": round(drain_s, 1),
            "max_rss_mb": {kind: v["max_mb"] for kind, v in kinds.items()},
            "memory": kinds,
        }
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if server is not None:
            server.stop()


def print_figures(r: dict[str, Any]) -> None:
    print(f"server: {r['server']}")
    print(f"{r['ranks']} ranks ({r['emitter_processes']} processes x {r['ranks_per_process']}) "
          f"-> {r['agents']} node agents -> ClickHouse, {r['rate_per_rank']:g} collectives/s "
          f"per rank for {r['duration_s']:g} s")
    print(f"events: emitted {r['events_emitted']}, dropped by ranks {r['dropped_by_ranks']}, "
          f"sent {r['events_sent']}, stored {r['events_stored']}, lost {r['lost']}, "
          f"duplicated {r['duplicated']}, unexpected {r['unexpected']}")
    ship = r["shipped_per_s"]
    print(f"sustained: {r['events_per_s']:.0f} events/s stored (offered "
          f"{r['offered_per_s']:.0f}/s); records shipped per {ship.get('windows', 0)} windows: "
          f"min {ship.get('min')}, median {ship.get('median')}, max {ship.get('max')} /s")
    lag = r["ship_lag_ms"]
    print(f"ship lag (ms, {lag.get('samples', 0)} probes): p50 {lag.get('p50')}, p90 "
          f"{lag.get('p90')}, p99 {lag.get('p99')}, max {lag.get('max')}; second half p50 "
          f"{lag.get('second_half_p50')}, max {lag.get('second_half_max')}")
    print(f"probe: {r['probe']}; drain after emission {r['drain_s']} s")
    print(f"transport: {r['transport']}")
    print(f"agents: {r['agents_final']}")
    print("memory (RSS MB during emission; worst process of each kind by second-half growth):")
    for kind, m in r["memory"].items():
        print(f"  {kind:<10} x{m['processes']:<3} start {m['start_mb']:>7.1f}  max "
              f"{m['max_mb']:>7.1f}  end {m['end_mb']:>7.1f}  second half "
              f"{m['second_half_mb_per_min']:+.2f} MB/min ({m['second_half_growth_mb']:+.1f} MB)"
              f"  {'flat' if m['flat'] else 'GROWING'}  cpu {m['cpu_s']} s")
        print(f"  {'':<15} over time (11 points): {m['worst_series_mb']}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [EMITTER_FLAG]:
        return emitter_main(argv[1:])
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true",
                        help="60 s of emission unless --duration says otherwise (< 3 min in all)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds of emission (default 300, 60 with --quick)")
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--agents", type=int, default=4, help="node agents (ranks split evenly)")
    parser.add_argument("--ranks-per-process", type=int, default=4)
    parser.add_argument("--rate", type=float, default=300.0, help="collectives/s per rank")
    parser.add_argument("--server", default=None,
                        help="clickhouse://... of a running server (default: start one)")
    parser.add_argument("--sample-s", type=float, default=1.0, help="RSS sampling interval")
    parser.add_argument("--probe-s", type=float, default=1.0, help="seconds between probes")
    parser.add_argument("--window-s", type=float, default=10.0,
                        help="window of the shipped-per-second figures")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, spools)")
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = 60.0 if args.quick else 300.0
    for name in ("ranks", "agents", "ranks_per_process"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.agents > args.ranks:
        parser.error("--agents must not exceed --ranks")
    workdir = Path(tempfile.mkdtemp(prefix="tracehound-soak-"))
    try:
        result = soak(args, workdir)
    except Exception as exc:
        log(f"soak could not run: {exc!r} (logs kept in {workdir})")
        return 1
    if args.keep:
        result["workdir"] = str(workdir)
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print_figures(result)
        sys.stdout.flush()
    if not args.keep:  # a started server's data: can take a while
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
