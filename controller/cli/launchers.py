"""Tracehound under any launcher: `tracehound agent` and `tracehound instrument -- CMD`.

`tracehound agent` is the node agent on its own (agent.node), for jobs that some other launcher
starts: torchrun, srun, Ray, a Kubernetes sidecar or DaemonSet. It takes its settings from flags
or TRACEHOUND_* variables. Ranks find it through TRACEHOUND_AGENT_SOCKET and load the recorder
through the bootstrap directory on PYTHONPATH (`tracehound instrument --env` prints both).

`tracehound instrument -- CMD ...` does all of that for one machine: it opens the store (an
embedded store gets an ingest endpoint in this process), starts a node agent, runs CMD with the
recorder installed into every Python process it starts (torchrun's ranks included), and when CMD
ends stops the agent after it shipped what it holds. It does not restart anything: it records.
When CMD fails it prints the stored diagnosis. Ctrl-C is passed on to CMD, which decides how to
stop (torchrun stops its ranks); the agent still ships what it got.

Inside a Slurm job both take their defaults from Slurm, so that every node of the job records
under one job id and `tracehound watch --slurm` can act on it: the job id is `slurm-$SLURM_JOB_ID`,
the node is `$SLURMD_NODENAME` (the name `scontrol` drains), and a requeued job's
`$SLURM_RESTART_COUNT` is its attempt. `--job`, `--node` and the TRACEHOUND_* variables override
them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from tracehound.controller.orchestrators.local import recorder_env
from tracehound.tracing import settings as env
from tracehound.tracing.ids import JobId
from tracehound.tracing.store.urls import mask_url

EPILOG_AGENT = """\
examples:
  TRACEHOUND_JOB_ID=exp7 TRACEHOUND_SINK=clickhouse://default:@ch:9000/tracehound tracehound agent
  tracehound agent --help      # every option, with its TRACEHOUND_* variable
"""

EPILOG_INSTRUMENT = """\
examples:
  tracehound instrument -- torchrun --nproc-per-node 4 train.py --lr 0.1
  tracehound instrument --job exp7 --store clickhouse://default:@ch:9000/tracehound -- srun ...
  eval "$(tracehound instrument --env --job exp7)"   # the variables, for launchers you drive
"""


def add_parsers(sub: Any, store_arg: Callable[[argparse.ArgumentParser], None]) -> None:
    """The `agent` and `instrument` subcommands."""
    agent = sub.add_parser(
        "agent", help="run a node agent on its own (torchrun, srun, Ray, Kubernetes)",
        description="Receive the records of this node's ranks, watch their processes, sample "
                    "GPU and host health, and ship it all to the trace store. Every option "
                    "has a TRACEHOUND_* variable; ranks reach the agent through "
                    "TRACEHOUND_AGENT_SOCKET. `tracehound agent --help` lists the options.",
        epilog=EPILOG_AGENT, formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False, prefix_chars="\0",
    )
    agent.add_argument("agent_args", nargs=argparse.REMAINDER)
    agent.set_defaults(handler=cmd_agent)

    inst = sub.add_parser(
        "instrument", help="run a command (torchrun ...) with the recorder in every rank",
        description="Start a node agent, run CMD with the recorder installed into every Python "
                    "process it starts, and ship the traces to the store; no `tracehound run` "
                    "needed. Exits with CMD's status.",
        epilog=EPILOG_INSTRUMENT, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    inst.add_argument("--job", help=f"job id (default: ${env.TRACEHOUND_JOB_ID}, else "
                                    "slurm-$SLURM_JOB_ID inside a Slurm job, else "
                                    "job-<date>-<time>)")
    inst.add_argument("--node", help=f"this node's name (default: ${env.TRACEHOUND_NODE_ID}, "
                                     "else $SLURMD_NODENAME inside a Slurm job, else the host "
                                     "name)")
    inst.add_argument("--workdir", type=Path, default=None,
                      help="spool and agent log (default: .tracehound/instrument/JOB)")
    inst.add_argument("--gpu", choices=env.GPU_BACKENDS, default=None,
                      help=f"GPU health backend of the agent (default: ${env.TRACEHOUND_GPU}, "
                           f"else {env.DEFAULT_GPU})")
    inst.add_argument("--env", action="store_true",
                      help="print the variables that install the recorder (shell syntax) and "
                           "exit: for launchers you start yourself next to `tracehound agent`")
    inst.add_argument("--json", action="store_true",
                      help="at the end, print one JSON object (job, store, exit status, agent "
                           "stats)")
    store_arg(inst)
    inst.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD",
                      help="the command to run, after --")
    inst.set_defaults(handler=cmd_instrument)


def cmd_agent(args: argparse.Namespace) -> NoReturn:
    """The node agent replaces this process (the controller never imports the agent): its own
    options, signals and exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "tracehound.agent.node", "--prog",  # noqa: S606
                              "tracehound agent", *args.agent_args])


def _job(args: argparse.Namespace) -> str:
    """--job, else $TRACEHOUND_JOB_ID, else inside a Slurm allocation `slurm-$SLURM_JOB_ID`
    (the same on every node of the job, and the id `tracehound watch --slurm` acts on), else
    job-<date>-<time>."""
    slurm_job = os.environ.get("SLURM_JOB_ID", "")
    return str(args.job or env.env_str(env.TRACEHOUND_JOB_ID)
               or (f"slurm-{slurm_job}" if slurm_job else "")
               or time.strftime("job-%Y%m%d-%H%M%S"))


def _node(args: argparse.Namespace) -> str:
    """--node, else $TRACEHOUND_NODE_ID, else Slurm's name of this node ($SLURMD_NODENAME: the
    name `scontrol` drains), else the host name."""
    return str(args.node or env.env_str(env.TRACEHOUND_NODE_ID)
               or os.environ.get("SLURMD_NODENAME", "") or socket.gethostname())


def _attempt_env() -> dict[str, str]:
    """Inside a Slurm job that was requeued, its restart count as the attempt (unless
    $TRACEHOUND_ATTEMPT says otherwise): the requeued run is the job's next attempt."""
    restarts = os.environ.get("SLURM_RESTART_COUNT", "")
    if restarts.isdigit() and not os.environ.get(env.TRACEHOUND_ATTEMPT):
        return {env.TRACEHOUND_ATTEMPT: restarts}
    return {}


def cmd_instrument(args: argparse.Namespace) -> int:
    from tracehound.controller.cli.session import store_session

    job = _job(args)
    node = _node(args)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.env:
        # the agent's own default socket, so `tracehound agent --job J` with the same job and
        # node listens where these ranks look
        shared = f"/tmp/tracehound-{job}-{node}.sock"
        variables = {**recorder_env(job=job, node=node, socket_path=shared), **_attempt_env()}
        for key, value in variables.items():
            print(f"export {key}={shlex.quote(value)}")
        print(f"# and on this node: tracehound agent --job {shlex.quote(job)} "
              f"--node {shlex.quote(node)} --sink URL")
        return 0
    sock = str(Path(tempfile.gettempdir()) / f"th-{os.getpid()}-{node[:20]}.sock")
    if not command:
        raise ValueError("no command given: expected `tracehound instrument [options] -- CMD "
                         "...`")
    gpu = args.gpu or env.env_choice(env.TRACEHOUND_GPU, env.DEFAULT_GPU, env.GPU_BACKENDS)
    workdir = args.workdir or Path(".tracehound") / "instrument" / job
    workdir.mkdir(parents=True, exist_ok=True)
    with store_session(args.store) as session:
        agent_cmd = [sys.executable, "-m", "tracehound.agent.node", "--job", job,
                     "--node", node, "--socket", sock, "--spool", str(workdir / "spool"),
                     "--gpu", gpu, "--stats-file", str(workdir / "agent-stats.json")]
        with open(workdir / "agent.log", "ab") as agent_log:
            # the sink (it may hold the store's password) in the environment, not on the
            # command line that `ps` shows everybody
            agent = subprocess.Popen(agent_cmd, stdout=agent_log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, env.TRACEHOUND_SINK: session.sink})
        try:
            code = _run_command(command, {**recorder_env(job=job, node=node, socket_path=sock),
                                          **_attempt_env()})
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        stats = _read_json(workdir / "agent-stats.json")
        verdict = None
        if code != 0:
            from tracehound.controller.cli.explain import diagnose_stored, format_verdict

            outcome = diagnose_stored(session.store, JobId(job), None)
            if outcome is not None:
                verdict = outcome
                if not args.json:
                    print(format_verdict(outcome), file=sys.stderr)
        url = mask_url(session.url)
    if args.json:
        print(json.dumps({"job": job, "node": node, "store": url, "exit_status": code,
                          "agent": stats, "diagnosis": verdict}, default=str))
    else:
        print(f"tracehound instrument: job {job}: command exited with status {code}; "
              f"{stats.get('shipped', 0)} records shipped to {url} "
              f"(tracehound diagnose --job {job} --store {url})", file=sys.stderr)
    return code


def _run_command(command: list[str], extra: Mapping[str, str]) -> int:
    """Run `command` with `extra` in its environment; Ctrl-C and SIGTERM go to it, and its exit
    status comes back (128 + signal for a signal, as a shell reports it)."""
    child = subprocess.Popen(command, env={**os.environ, **extra})
    while True:
        try:
            code = child.wait()
            break
        except KeyboardInterrupt:
            # cli turns SIGINT/SIGTERM into KeyboardInterrupt: pass it on, then keep waiting
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
    return code if code >= 0 else 128 - code


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
