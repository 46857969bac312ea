"""Recorder overhead: what tracing costs a training job, in step time and per recorded event.

Two measurements, printed as figures (a benchmark, never a test; nothing here gates on time):

1. Step time, tracing on and off interleaved inside one job (`step_time_ratio`). A 4-rank gloo DDP
   job (torchrun under `tracehound instrument`: the recorder in every rank, a node agent
   shipping to the embedded store) trains three identical models in blocks of steps, round by
   round, in rotating order (see bench/overhead_job.py): `traced` (as the recorder's settings
   in force make it: by default DDP's own C++ all-reduce, each step counted and some recorded;
   with TRACEHOUND_DDP_TRACE_EVERY=1 every bucket routed through the recorder's process group,
   recorded and shipped), `hook` (torch's own Python `allreduce_hook`, each bucket recorded
   through the wrapped `dist.all_reduce`) and `plain` (DDP's own C++ all-reduce, nothing
   recorded). The default model (width 512, four hidden layers, batch 64, 1 MB buckets: four
   buckets and ~60 ms a step here) is small next to real training steps of 100s of ms;
   `--width 64 --layers 1 --batch 32 --bucket-cap-mb 25 --block-steps 120` is the worst case
   (~7 ms steps: the recorder's fixed cost per step weighs most). Each round gives one ratio per
   pair of models (block times averaged over the ranks); a run's ratio is the median of its
   rounds, and
   `step_time_ratio` (traced / plain) is the median over all rounds of all --runs runs, printed
   with each run's ratio (`run_ratios`, the run-to-run spread) and the rounds' spread.
   `python_hook_ratio` (hook / plain) is what a Python comm hook recording each bucket costs in
   the same job (the way Tracehound traced DDP before its process group), and
   `traced_vs_python_hook_ratio` (traced / hook) compares the two; `cpu_ratio` compares the
   ranks' CPU time per block (traced / plain). With --control a first run has the traced model
   untraced too: `control_ratio` is the noise floor. With --step-times every step is timed:
   `steps` compares the median step (a cost every step pays) with the mean (slow steps too).
   The agent and store run through every block (their work on a traced block's records can
   spill into the next one), so this is the cost
   inside the ranks plus what of the agent's falls in the traced blocks.

   --separate-jobs N adds the whole-system figure: the demo job run again and again, recorder on
   and off (TRACEHOUND_DISABLE=1), in alternating order (`separate_jobs.step_time_ratio`, the
   median of N pair ratios). The node agents run in both modes; with the recorder off they
   receive nothing. Separate jobs drift apart by several percent on a shared machine.

2. Per-event cost (`record_us`), in a child process: a real gloo process group of one rank,
   the recorder's real wrappers (`hooks.install_distributed`) and a real SocketTransport
   connected to a real node agent process. `record_us` is the time a wrapped call costs the
   training thread on top of the call itself: the wrapper put around a no-op with
   `all_reduce`'s signature, minus the bare no-op, over 1-element tensors. It includes the
   wrapper's argument handling, what `Recorder.enter`/`returned` do (a synchronous call's
   path, inline in the wrapper: two clock reads, the sequence id, the tuple) and
   `SocketTransport.offer`; the other threads
   are kept off the GIL while it is timed (sys.setswitchinterval). What the sender thread
   later spends on each record (turning it into a record, JSON, the socket write) is
   `sender_us`, CPU time measured while the training thread waits: it runs off the training
   thread but holds the GIL. `drain_us` is the wall time per record of that drain, which the
   node agent's reading pace bounds. `record_us_contended` is the same wrapped no-op with the
   sender running alongside (a training thread that never releases the GIL), and
   `all_reduce_*` compare a real wrapped and unwrapped gloo all_reduce of one rank (noisy: the
   gloo call itself varies by more than the recorder costs). `functional_record_us` is the
   same for a functional collective (agent/functional.py: the group resolved from what funcol
   accepts, the call entered and ended under the recorder's lock): the wrapper around a no-op
   with funcol all_reduce's signature, minus the bare no-op; `functional_all_reduce_*` compare
   a real funcol all_reduce and the wait on its result, wrapped and bare. `parts_us` times
   pieces of the hot path alone: two clock reads, the transport's offer, and
   `Recorder.enter`/`returned` called as methods (the wrapper does the same work inline,
   without the two calls).

    python bench/overhead.py [--runs R] [--rounds N] [--block-steps S] [--control] [--step-times]
                             [--separate-jobs N] [--calls C] [--blocks B]
                             [--skip-job] [--skip-hot-path] [--json]

With --json it prints one JSON object (progress goes to stderr); `step_time_ratio` and
`record_us` are always in it (null for a part that was skipped).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RATE = re.compile(r"rank \d+/\d+: \d+ steps at ([0-9.]+) steps/s")


# -- 1. step time of a real job, recorder on and off ----------------------------------------------


def job_env(*, recorder: bool = True) -> dict[str, str]:
    """This environment for a timed job: one thread per rank, the recorder on or off."""
    env = dict(os.environ)
    env.pop("TRACEHOUND_DISABLE", None)
    env["OMP_NUM_THREADS"] = "1"
    if not recorder:
        env["TRACEHOUND_DISABLE"] = "1"
    return env


def instrumented(script: list[str], *, job: str, ranks: int, workdir: Path,
                 env: dict[str, str], timeout_s: float) -> tuple[str, str]:
    """Run `script` as `ranks` torchrun ranks under `tracehound instrument` (the recorder and a
    node agent shipping to an embedded store in `workdir`); its stdout and stderr.

    Not check=True: a rank that printed its figures and then hung in torch's gloo teardown at
    exit (a GIL deadlock inside ~ProcessGroupGloo) measured its steps all the same; what was
    printed decides."""
    command = [
        sys.executable, "-m", "tracehound.controller.cli", "--log-level", "WARNING",
        "instrument", "--job", job, "--node", "n0", "--store", f"chdb://{workdir / 'store'}",
        "--workdir", str(workdir / "instrument"), "--", sys.executable, "-m",
        "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *script,
    ]
    try:
        done = subprocess.run(command, env=env, check=False, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return out, ""
    return done.stdout, done.stderr


def one_run(*, recorder: bool, steps: int, sleep_ms: float, nnodes: int, nproc: int,
            workdir: Path, width: int = 64, batch: int = 32, launcher: str = "instrument"
            ) -> float:
    """One job run; its step time in ms (1000 / the mean steady-state rate of its ranks)."""
    from tracehound.controller.cli.demo import training_script

    env = job_env(recorder=recorder)
    job = "on" if recorder else "off"
    script = [training_script(), "--steps", str(steps), "--checkpoint-every", "0",
              "--print-every", "0", "--sync-loss-every", "0", "--step-sleep-ms", str(sleep_ms),
              "--width", str(width), "--batch", str(batch)]
    if launcher == "run":
        subprocess.run(
            [sys.executable, "-m", "tracehound.controller.cli", "--log-level", "WARNING", "run",
             "--nnodes", str(nnodes), "--nproc-per-node", str(nproc), "--job-id", job,
             "--store", f"chdb://{workdir / 'store'}", "--workdir", str(workdir), *script],
            env=env, check=True, capture_output=True, timeout=900,
        )
        logs = sorted((workdir / job / "logs" / "attempt-0").glob("rank-*.log"))
        # each rank's log: the rate it printed last
        rates = [float(found[-1]) for found in (RATE.findall(log.read_text()) for log in logs)
                 if found]
    else:
        # torchrun's ranks: the recorder and a node agent that ships to the store, no analysis
        # beside the job
        out, _ = instrumented(script, job=job, ranks=nnodes * nproc, workdir=workdir, env=env,
                              timeout_s=300)
        rates = [float(r) for r in RATE.findall(out)]
    if len(rates) != nnodes * nproc:
        raise RuntimeError(f"{len(rates)} ranks reported a rate, expected {nnodes * nproc}")
    return 1000.0 / statistics.mean(rates)


KINDS = ("traced", "hook", "plain")
"""The models of bench/overhead_job.py: traced through the recorder's process group, torch's
Python allreduce_hook (recorded through the wrapped dist.all_reduce), DDP's C++ all-reduce
(untraced)."""


def interleaved_run(args: argparse.Namespace, workdir: Path, *, control: bool
                    ) -> list[dict[str, float]]:
    """One run of bench/overhead_job.py; per round, the block time of each model kind and its
    CPU (`cpu_<kind>`), averaged over the ranks, in seconds."""
    script = [
        str(Path(__file__).with_name("overhead_job.py")), "--rounds", str(args.rounds),
        "--block-steps", str(args.block_steps), "--width", str(args.width),
        "--batch", str(args.batch), "--layers", str(args.layers),
        "--bucket-cap-mb", str(args.bucket_cap_mb), *(["--control"] if control else []),
        *(["--step-times"] if args.step_times else []),
    ]
    out, err = instrumented(script, job="overhead", ranks=args.nnodes * args.nproc_per_node,
                            workdir=workdir, env=job_env(), timeout_s=1800)
    line = next((x for x in out.splitlines() if x.startswith("overhead-blocks ")), None)
    if line is None:
        raise RuntimeError(f"the overhead job printed no block times:\n{out[-2000:]}{err[-2000:]}")
    ranks: list[list[dict[str, list[float]]]] = json.loads(line.split(" ", 1)[1])["ranks"]
    rounds = []
    for i in range(len(ranks[0])):
        times = {kind: statistics.mean(r[i][kind][0] for r in ranks) for kind in KINDS}
        times.update({f"cpu_{kind}": statistics.mean(r[i][kind][1] for r in ranks)
                      for kind in KINDS})
        if args.step_times:
            # each step's time, the mean over the ranks (they step together)
            times.update({f"steps_{kind}": [statistics.mean(col) for col in
                                            zip(*(r[i][kind][2] for r in ranks), strict=True)]
                          for kind in KINDS})
        rounds.append(times)
    return rounds


def ratios(rounds: list[dict[str, float]], top: str, bottom: str) -> list[float]:
    return [r[top] / r[bottom] for r in rounds]


def spread(values: list[float]) -> dict[str, Any]:
    """The median of per-round ratios with their quartiles."""
    return {"median": round(statistics.median(values), 4),
            "iqr": [round(x, 4) for x in quartiles(values)]}


def interleaved(args: argparse.Namespace) -> dict[str, Any]:
    def run(control: bool) -> list[dict[str, float]]:
        with tempfile.TemporaryDirectory(prefix="tracehound-overhead-") as tmp:
            return interleaved_run(args, Path(tmp), control=control)

    result: dict[str, Any] = {}
    if args.control:
        rounds = run(True)
        result["control_ratio"] = spread(ratios(rounds, "traced", "plain"))["median"]
        result["control_round_ratio_iqr"] = spread(ratios(rounds, "traced", "plain"))["iqr"]
        progress(f"control run (the traced model untraced too): ratio {result['control_ratio']}")
    every: list[dict[str, float]] = []
    per_run: list[float] = []
    for i in range(args.runs):
        rounds = run(False)
        every += rounds
        per_run.append(statistics.median(ratios(rounds, "traced", "plain")))
        progress(f"run {i + 1}/{args.runs}: traced/plain {per_run[-1]:.4f}, torch's Python hook/"
                 f"plain {statistics.median(ratios(rounds, 'hook', 'plain')):.4f} over "
                 f"{len(rounds)} rounds of {args.block_steps}-step blocks")
    traced = ratios(every, "traced", "plain")
    plain_ms = statistics.median(r["plain"] for r in every) * 1000 / args.block_steps
    result.update({
        "step_time_ratio": round(statistics.median(traced), 4),
        "run_ratios": [round(r, 4) for r in per_run],
        "round_ratio_iqr": spread(traced)["iqr"],
        "round_ratio_min_max": [round(min(traced), 4), round(max(traced), 4)],
        "python_hook_ratio": spread(ratios(every, "hook", "plain"))["median"],
        "python_hook_round_ratio_iqr": spread(ratios(every, "hook", "plain"))["iqr"],
        "traced_vs_python_hook_ratio": spread(ratios(every, "traced", "hook"))["median"],
        "traced_vs_python_hook_round_ratio_iqr": spread(ratios(every, "traced", "hook"))["iqr"],
        "cpu_ratio": spread(ratios(every, "cpu_traced", "cpu_plain"))["median"],
        "python_hook_cpu_ratio": spread(ratios(every, "cpu_hook", "cpu_plain"))["median"],
        "plain_step_ms": round(plain_ms, 3),
        "rounds_per_run": args.rounds,
        "block_steps": args.block_steps,
        "width": args.width,
        "layers": args.layers,
        "bucket_cap_mb": args.bucket_cap_mb,
        "ranks": args.nnodes * args.nproc_per_node,
        "launcher": "instrument",
    })
    if args.step_times:
        result["steps"] = step_spread(every)
    return result


def step_spread(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """From each step's time (--step-times): whether the traced model's extra time is in every
    step or in a few slow ones. Per kind, the quantiles of all its steps; traced / plain of the
    median step (`median_ratio`: a cost every step pays) and of the mean (`mean_ratio`: with
    the slow steps), each the median over the rounds."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        steps = sorted(x for r in rounds for x in r[f"steps_{kind}"])
        q = statistics.quantiles(steps, n=100, method="inclusive")
        out[f"{kind}_us"] = {"p10": round(q[9]), "p50": round(q[49]), "p90": round(q[89]),
                             "p99": round(q[98]), "mean": round(statistics.mean(steps))}
    for kind in ("traced", "hook"):
        medians = [statistics.median(r[f"steps_{kind}"]) / statistics.median(r["steps_plain"])
                   for r in rounds]
        means = [statistics.mean(r[f"steps_{kind}"]) / statistics.mean(r["steps_plain"])
                 for r in rounds]
        out[f"{kind}_median_ratio"] = spread(medians)
        out[f"{kind}_mean_ratio"] = spread(means)
    return out


def quartiles(values: Sequence[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def step_time(args: argparse.Namespace) -> dict[str, Any]:
    def run(recorder: bool) -> float:
        with tempfile.TemporaryDirectory(prefix="tracehound-overhead-") as tmp:
            return one_run(recorder=recorder, steps=args.steps, sleep_ms=args.step_sleep_ms,
                           nnodes=args.nnodes, nproc=args.nproc_per_node, workdir=Path(tmp),
                           width=args.width, batch=args.batch, launcher=args.launcher)

    for i in range(args.warmup):
        ms = run(i % 2 == 0)
        progress(f"warm-up run {i + 1}/{args.warmup}: {ms:.3f} ms/step (not counted)")
    on: list[float] = []
    off: list[float] = []
    for i in range(args.pairs):
        pair: dict[bool, float] = {}
        for recorder in ((True, False) if i % 2 == 0 else (False, True)):
            pair[recorder] = run(recorder)
        on.append(pair[True])
        off.append(pair[False])
        progress(f"pair {i + 1}/{args.pairs}: on {pair[True]:.3f} ms/step, "
                 f"off {pair[False]:.3f} ms/step, ratio {pair[True] / pair[False]:.4f}")
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    q1, q3 = quartiles(ratios)
    return {
        "step_time_ratio": round(statistics.median(ratios), 4),
        "step_time_ratio_of_medians": round(statistics.median(on) / statistics.median(off), 4),
        "pair_ratios": [round(r, 4) for r in ratios],
        "pair_ratio_min": round(min(ratios), 4),
        "pair_ratio_max": round(max(ratios), 4),
        "pair_ratio_iqr": [round(q1, 4), round(q3, 4)],
        "pairs": args.pairs,
        "ranks": args.nnodes * args.nproc_per_node,
        "launcher": args.launcher,
        "steps_per_run": args.steps,
        "step_ms_on": [round(x, 3) for x in on],
        "step_ms_off": [round(x, 3) for x in off],
    }


# -- 2. per-event cost, in a child process ---------------------------------------------------------


def per_call_us(fn: Callable[..., Any], args: tuple[Any, ...], calls: int) -> float:
    """Mean time of one call of fn(*args) over `calls` calls, in microseconds."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn(*args)
    return (time.perf_counter_ns() - start) / calls / 1000.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_agent(tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """A real node agent process listening in `tmp`, and its socket once it listens. Nothing
    listens at its sink: it spools to disk and retries shipping in the back."""
    path = tmp / "agent.sock"
    agent = subprocess.Popen(
        [sys.executable, "-m", "tracehound.agent.node", "--job", "bench", "--node", "n0",
         "--socket", str(path), "--spool", str(tmp / "spool"),
         "--sink", f"http://127.0.0.1:{free_port()}",
         "--proc-interval", "0", "--stack-after", "0", "--drain-s", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not path.exists():
        if time.monotonic() > deadline or agent.poll() is not None:
            stop_agent(agent)
            raise RuntimeError("the node agent did not start")
        time.sleep(0.05)
    return agent, path


def stop_agent(agent: subprocess.Popen[bytes]) -> None:
    agent.terminate()
    try:
        agent.wait(timeout=15)
    except subprocess.TimeoutExpired:
        agent.kill()


def hot_path_worker(calls: int, blocks: int) -> dict[str, Any]:
    """Runs in a child process (it patches torch.distributed); returns the figures."""
    import torch
    import torch.distributed as dist

    from tracehound.agent.rank import hooks
    from tracehound.agent.rank.recorder import Recorder
    from tracehound.agent.rank.transport import SocketTransport
    from tracehound.tracing.events import now_us

    tmp = Path(tempfile.mkdtemp(prefix="tracehound-hotpath-"))
    agent, path = start_agent(tmp)
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0,
                                world_size=1)
        transport = SocketTransport(str(path), bound=max(4 * calls, 65536))
        recorder = Recorder(job="bench", attempt=0, node="n0", rank=0, sink=transport)

        def activate() -> None:
            transport.start()
            recorder.start()

        c10d = dist.distributed_c10d
        real = dist.all_reduce

        def noop(*args: Any, **kwargs: Any) -> None:
            return None

        noop.__signature__ = inspect.signature(real)  # type: ignore[attr-defined]
        dist.all_reduce = c10d.all_reduce = noop
        hooks.install_distributed(recorder, on_group=activate)
        wrapped_noop = dist.all_reduce
        dist.all_reduce = c10d.all_reduce = real
        hooks.install_distributed(recorder, on_group=activate)
        wrapped_real = dist.all_reduce
        if wrapped_noop is noop or wrapped_real is real:
            raise RuntimeError("install_distributed did not wrap all_reduce")
        tensor = torch.ones(1)
        one = (tensor,)
        switch = sys.getswitchinterval()

        def settle() -> tuple[float, float]:
            """Let the sender send everything queued: (wall s, CPU s of this process) it took.
            The training thread only waits meanwhile: the CPU is the sender's (and the odd
            heartbeat's)."""
            wall, cpu = time.perf_counter(), time.process_time()
            if not transport.flush(30.0):
                raise RuntimeError("the transport did not drain within 30 s")
            return time.perf_counter() - wall, time.process_time() - cpu

        def quiet(fn: Callable[..., Any], n: int, args: tuple[Any, ...] = one) -> float:
            sys.setswitchinterval(30.0)  # the other threads wait for the GIL until we are done
            try:
                return per_call_us(fn, args, n)
            finally:
                sys.setswitchinterval(switch)

        # warm up every path once
        for fn in (noop, wrapped_noop, real, wrapped_real):
            per_call_us(fn, one, 2000)
        settle()

        bare: list[float] = []
        traced: list[float] = []
        sender: list[float] = []
        drain: list[float] = []
        contended: list[float] = []
        for i in range(blocks):
            order = (0, 1) if i % 2 == 0 else (1, 0)
            for which in order:
                if which == 0:
                    bare.append(quiet(noop, calls))
                else:
                    sent = transport.sent
                    traced.append(quiet(wrapped_noop, calls))
                    wall, cpu = settle()
                    count = max(1, transport.sent - sent)
                    sender.append(cpu * 1e6 / count)
                    drain.append(wall * 1e6 / count)
            contended.append(per_call_us(wrapped_noop, one, calls))
            settle()
        diffs = [t - b for t, b in zip(traced, bare, strict=True)]
        contended_diffs = [c - b for c, b in zip(contended, bare, strict=True)]

        ar_calls = max(200, calls // 20)
        ar_bare: list[float] = []
        ar_traced: list[float] = []
        for i in range(blocks):
            for which in ((0, 1) if i % 2 == 0 else (1, 0)):
                if which == 0:
                    ar_bare.append(per_call_us(real, one, ar_calls))
                else:
                    ar_traced.append(per_call_us(wrapped_real, one, ar_calls))
            settle()
        ar_diffs = [t - b for t, b in zip(ar_traced, ar_bare, strict=True)]

        # Functional collectives (DTensor, tensor parallelism): funcol's all_reduce and the wait
        # on its result, bare and through the recorder's wrappers (agent/functional.py), and
        # the wrapper alone around a no-op with funcol's signature that returns its input
        # (a result already waited for: the call is entered and ended at once).
        import torch.distributed._functional_collectives as funcol

        from tracehound.agent.rank import functional

        world = dist.group.WORLD
        bare_fc = funcol.all_reduce
        op_wait = torch.ops._c10d_functional.wait_tensor

        def fc_bare(t: Any) -> Any:
            return op_wait(bare_fc(t, "sum", world).elem)

        def fc_noop(self: Any, reduceOp: str, group: Any, tag: str = "") -> Any:
            return self

        functional.install_functional(recorder)
        traced_fc, traced_wait = funcol.all_reduce, funcol.wait_tensor
        state = functional._state
        if traced_fc is bare_fc or state is None:
            raise RuntimeError("install_functional did not wrap funcol.all_reduce")
        fc_wrapped_noop = functional._wrap_call(state, "all_reduce", fc_noop,
                                                torch.compiler.is_compiling)

        def fc_traced(t: Any) -> Any:
            return traced_wait(traced_fc(t, "sum", world).elem)

        def fc_noop_bare(t: Any) -> Any:
            return fc_noop(t, "sum", world)

        def fc_noop_traced(t: Any) -> Any:
            return fc_wrapped_noop(t, "sum", world)

        fc_calls = max(200, calls // 20)
        for fn in (fc_bare, fc_traced):
            per_call_us(fn, one, 200)
        fc_pairs: list[tuple[float, float]] = []
        noop_pairs: list[tuple[float, float]] = []
        for i in range(blocks):
            first_bare = i % 2 == 0
            b = t = 0.0
            for which in ((0, 1) if first_bare else (1, 0)):
                if which == 0:
                    b = per_call_us(fc_bare, one, fc_calls)
                else:
                    t = per_call_us(fc_traced, one, fc_calls)
            fc_pairs.append((t, b))
            nb = quiet(fc_noop_bare, calls)
            nt = quiet(fc_noop_traced, calls)
            noop_pairs.append((nt, nb))
            settle()
        fc_diffs = [t - b for t, b in fc_pairs]
        fc_record = [t - b for t, b in noop_pairs]

        # The hot path by part, each timed alone (the queue is a fresh, unstarted transport).
        def fresh() -> SocketTransport:
            return SocketTransport(str(tmp / "nowhere.sock"), bound=calls + 10)

        item = (("bench", 0, "n0", 0), "0", 1, "all_reduce", 4, "float32", -1, False, 1, 2)
        offer = statistics.median(quiet(fresh().offer, calls, (item,)) for _ in range(blocks))

        def enter_returned(_: Any) -> None:  # a synchronous call's path
            rec.returned(rec.enter("0", "all_reduce", 4, "float32"))

        parts_er: list[float] = []
        for _ in range(blocks):
            rec = Recorder(job="bench", attempt=0, node="n0", rank=0, sink=fresh())
            parts_er.append(quiet(enter_returned, calls))

        def two_clocks(_: Any) -> None:
            now_us()
            now_us()

        clocks = statistics.median(quiet(two_clocks, calls) for _ in range(blocks))
        nothing = statistics.median(quiet(lambda _: None, calls) for _ in range(blocks))
        enter_returned_us = statistics.median(parts_er) - nothing
        record = statistics.median(diffs)
        q1, q3 = quartiles(diffs)
        recorder.close(timeout=5.0)
        transport.close(timeout=5.0)
        dropped = transport.dropped
        return {
            "record_us": round(record, 3),
            "record_us_iqr": [round(q1, 3), round(q3, 3)],
            "record_us_min_max": [round(min(diffs), 3), round(max(diffs), 3)],
            "record_blocks": blocks,
            # (traced, bare) per block, in order: this machine's speed changes by up to ~1.8x
            # for minutes at a time, and both move with it
            "record_block_pairs_us": [[round(t, 3), round(b, 3)]
                                      for t, b in zip(traced, bare, strict=True)],
            "record_calls_per_block": calls,
            "noop_us": round(statistics.median(bare), 3),
            "sender_us": round(statistics.median(sender), 3),
            "drain_us": round(statistics.median(drain), 3),
            "record_us_contended": round(statistics.median(contended_diffs), 3),
            "all_reduce_us": round(statistics.median(ar_bare), 3),
            "all_reduce_traced_us": round(statistics.median(ar_traced), 3),
            "all_reduce_diff_us": round(statistics.median(ar_diffs), 3),
            "all_reduce_diff_iqr": [round(x, 3) for x in quartiles(ar_diffs)],
            "functional_record_us": round(statistics.median(fc_record), 3),
            "functional_record_iqr": [round(x, 3) for x in quartiles(fc_record)],
            "functional_all_reduce_us": round(statistics.median(b for _, b in fc_pairs), 3),
            "functional_all_reduce_traced_us": round(statistics.median(t for t, _ in fc_pairs),
                                                     3),
            "functional_all_reduce_diff_us": round(statistics.median(fc_diffs), 3),
            "functional_all_reduce_diff_iqr": [round(x, 3) for x in quartiles(fc_diffs)],
            "parts_us": {
                "clock_reads_x2": round(clocks - nothing, 3),
                "transport_offer": round(offer - nothing, 3),
                "recorder_enter_returned_incl_offer_and_clocks": round(enter_returned_us, 3),
            },
            "transport_dropped": dropped,
            "records_sent": transport.sent,
        }
    finally:
        stop_agent(agent)
        if dist.is_initialized():
            dist.destroy_process_group()


def hot_path(args: argparse.Namespace) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEHOUND_")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [sys.executable, __file__, "--hot-path-worker", "--calls", str(args.calls),
         "--blocks", str(args.blocks)],
        env=env, check=True, capture_output=True, text=True, timeout=900,
    )
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


# -- main ---------------------------------------------------------------------------------------


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2,
                        help="runs of the interleaved job (default 2)")
    parser.add_argument("--rounds", type=int, default=40,
                        help="rounds per run, one block of each model per round (default 40; "
                             "a round's ratio scatters by several percent on a shared machine)")
    parser.add_argument("--block-steps", type=int, default=25,
                        help="steps per block (default 25, about 1.5 s of the default model)")
    parser.add_argument("--step-times", action="store_true",
                        help="also time every step: `steps` in the output tells a cost every "
                             "step pays from one in a few slow steps")
    parser.add_argument("--control", action="store_true",
                        help="first a run with the traced model untraced too: the noise floor")
    parser.add_argument("--separate-jobs", type=int, default=0, metavar="N",
                        help="also N pairs of separate traced and untraced jobs (default 0)")
    parser.add_argument("--steps", type=int, default=800,
                        help="steps per separate job (default 800)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="uncounted separate jobs first (default 1)")
    parser.add_argument("--nnodes", type=int, default=2)
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("--launcher", choices=["instrument", "run"], default="instrument",
                        help="for --separate-jobs: instrument (default): torchrun's ranks with "
                             "the recorder and a "
                             "node agent shipping to the store, what a training node pays; "
                             "run: under `tracehound run`, whose analysis and embedded store "
                             "share this machine's cores with the ranks")
    parser.add_argument("--width", type=int, default=512,
                        help="hidden width of the model (default 512; 64 with --layers 1 "
                             "--batch 32 --bucket-cap-mb 25 --block-steps 120 is the worst "
                             "case: steps of ~7 ms, one bucket)")
    parser.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    parser.add_argument("--layers", type=int, default=4,
                        help="hidden layers of the interleaved job's model (default 4)")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0,
                        help="DDP's bucket_cap_mb in the interleaved job (default 1: with "
                             "width 512 a bucket per hidden layer; 25 is DDP's own)")
    parser.add_argument("--step-sleep-ms", type=float, default=0.0,
                        help="extra time per step, as a stand-in for a heavier model")
    parser.add_argument("--calls", type=int, default=20000,
                        help="calls per timed block of the per-event cost (default 20000)")
    parser.add_argument("--blocks", type=int, default=15,
                        help="timed blocks per variant of the per-event cost (default 15)")
    parser.add_argument("--skip-job", action="store_true", help="per-event cost only")
    parser.add_argument("--skip-hot-path", action="store_true", help="step time only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--hot-path-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hot_path_worker:
        print(json.dumps(hot_path_worker(args.calls, args.blocks)))
        return 0
    result: dict[str, Any] = {"step_time_ratio": None, "record_us": None}
    if not args.skip_hot_path:
        progress("per-event cost ...")
        result.update(hot_path(args))
        progress(f"record_us {result['record_us']} (sender_us {result['sender_us']})")
    if not args.skip_job:
        result.update(interleaved(args))
        if args.separate_jobs > 0:
            args.pairs = args.separate_jobs
            result["separate_jobs"] = step_time(args)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
