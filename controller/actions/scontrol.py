"""Slurm through its own commands: read node and job states, drain and resume nodes, requeue and
cancel jobs (`scontrol`, and `scancel` beside it).

Every command runs with `subprocess.run` from an argv list (never a shell), with a timeout and
the environment given (SLURM_CONF names the cluster). What `scontrol show ... --oneliner` prints
is read by `parse_records`.

What raises and what returns:

    SlurmError                 a query (check, node_state, job_state, job_nodes) that cannot
                               answer: the command is missing, timed out or failed (the
                               controller does not answer, no such node or job). A step whose
                               command is missing raises it too: nothing can be done here
    StepResult(ok=False)       a step (drain, resume, requeue, cancel) that Slurm refused or that
                               did not finish in time; `detail` says why. Steps are idempotent:
                               the same call again is the retry
    StepResult(changed=False)  the step was already done, and nothing was run

How a step knows it was already done, from what scontrol reports before it acts:

    drain    a node whose State carries DRAIN (IDLE+DRAIN, MIXED+DRAIN, ...) keeps its state and
             its reason; only the others are drained
    resume   a node without DRAIN, DOWN or FAIL is in service already
    requeue  Slurm counts every requeue in the job's `Restarts`: a PENDING job with Restarts > 0
             was requeued and has not started again yet; with Restarts = 0 it never started, so
             there is nothing to requeue. A requeue passes through COMPLETING, as an ending job
             does, so a COMPLETING job is waited for (at most `timeout_s`) before deciding. A
             CANCELLED or COMPLETED job is not requeued (ok=False): someone stopped it, or it
             is done; a FAILED one is (a crashed rank fails the job). Once the requeued job
             runs again, a requeue is a new one: a caller that must not restart a job twice
             for one decision keeps what it did (the job's Restarts are in `scontrol show job`)
    cancel   a job that ended (COMPLETED, CANCELLED, FAILED, ...) or that the controller no
             longer knows (purged MinJobAge after it ended) is left alone. scancel's exit status
             says nothing (22.05 exits 0 for a job id it does not know), so the state is read
             before and after

A requeued job does not start again at once: Slurm makes it eligible after the job credential
lifetime plus a second (AuthInfo `cred_expire`, 120 s by default), and the scheduler starts it at
its next pass after that.

It must never use a shell, and holds nothing between calls but its settings.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INSTALL_HINT = "install slurm-client (Debian and Ubuntu: apt-get install slurm-client)"
ENDED_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "REVOKED", "SPECIAL_EXIT", "TIMEOUT",
})
"""Job states after which a job runs no more (unless requeued)."""
PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD"})
"""Job states of a job waiting to (re)start."""
NOT_REQUEUED_STATES = frozenset({"CANCELLED", "COMPLETED"})
"""Ended jobs that `requeue` leaves alone: someone cancelled it, or it finished its work.
Other ended jobs (FAILED, NODE_FAIL, TIMEOUT, ...) are requeued: a rank's crash fails the
job, and restarting it from its checkpoint is the point."""
_TAIL_CHARS = 500
_KEY = re.compile(r"[A-Z][A-Za-z0-9_:/.]*=")
_NODE_REASON = re.compile(
    r"(?:^|\s)Reason=(.*?) \[([^\[\]\s@]+)@(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)\](?=\s|$)")
_JOB_ID = re.compile(r"^[1-9]\d*(?:_\d+|\+\d+)?$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UNKNOWN_JOB = "Invalid job id specified"
_SETTLE_POLL_S = 0.5


class SlurmError(Exception):
    """A Slurm command failed or is missing; the message names the command line, its exit status
    and its stderr tail."""

    def __init__(self, message: str, *, command: Sequence[str] = (), returncode: int | None = None,
                 stderr: str = "", missing: bool = False) -> None:
        super().__init__(message)
        self.command = tuple(command)
        self.returncode = returncode
        """The exit status; None when the command did not run or did not finish."""
        self.stderr = stderr
        self.missing = missing
        """The command is not installed (or not where it was said to be)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """What one step did."""

    command: tuple[str, ...]
    """The argv that was run (empty when nothing needed running)."""
    ok: bool
    changed: bool
    """False when the step was already done (an idempotent re-run)."""
    detail: str
    """What happened, in words (e.g. "node-1 already IDLE+DRAIN (reason 'tracehound 7')")."""


def parse_records(text: str) -> list[dict[str, str]]:
    """The records of `scontrol show node|job|partition ... --oneliner`: one per non-empty line,
    each a mapping of its `Key=value` fields, in order.

    A value may hold spaces (`OS=Linux 6.1 #1 SMP`, `JobName=my job`): a word that does not start
    with `Key=` (an upper-case letter, then letters, digits or `_:/.`) belongs to the value
    before it. A node's `Reason=... [user@time]` is read whole, whatever it holds, and its user
    and time go to `ReasonUser` and `ReasonTime`. A free-text value of another field that holds
    a word like `Key=...` is cut there (no such field is read here). Lines that do not start
    with `Key=` are not records and are left out: scontrol prints "Node x not found" among
    them."""
    return [parse_record(line) for line in text.splitlines() if _KEY.match(line.strip())]


def parse_record(line: str) -> dict[str, str]:
    """One line of `scontrol show ... --oneliner` (see `parse_records`)."""
    fields: dict[str, str] = {}
    reason = _NODE_REASON.search(line)
    if reason is not None:
        fields["Reason"], fields["ReasonUser"], fields["ReasonTime"] = reason.groups()
        line = line[:reason.start()] + " " + line[reason.end():]
    key = ""
    for word in line.split():
        match = _KEY.match(word)
        if match is not None:
            key = match.group()[:-1]
            fields[key] = word[match.end():]
        elif key:
            fields[key] = f"{fields[key]} {word}" if fields[key] else word
        else:
            raise ValueError(f"scontrol output {line[:120]!r}: expected Key=value fields, "
                             f"got {word!r} first")
    return fields


def node_flags(state: str) -> frozenset[str]:
    """The parts of a node's State as scontrol prints it: "MIXED+DRAIN" -> {MIXED, DRAIN}."""
    return frozenset(part for part in state.upper().split("+") if part)


def is_drained(state: str) -> bool:
    """Whether a node with this State takes no new jobs by an operator's drain."""
    return bool(node_flags(state) & {"DRAIN", "DRAINED", "DRAINING"})


def out_of_service(state: str) -> bool:
    """Whether a node with this State needs a RESUME to take jobs (drained, down or failed)."""
    return is_drained(state) or bool(node_flags(state) & {"DOWN", "FAIL", "FAILING"})


def controller_up(ping: str) -> bool:
    """Whether `scontrol ping` printed that a controller is UP ("Slurmctld(primary) at HOST is
    UP"; a backup's line may follow)."""
    return re.search(r"^Slurmctld\([^)]*\) at \S+ is UP$", ping, re.MULTILINE) is not None


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _TAIL_CHARS else "..." + text[-_TAIL_CHARS:]


def _node_names(nodes: Sequence[str]) -> list[str]:
    if isinstance(nodes, str):
        raise ValueError(f"nodes {nodes!r}: expected a sequence of node names, e.g. "
                         f"[{nodes!r}], not one string")
    names = list(nodes)
    if not names:
        raise ValueError("nodes []: expected at least one node name")
    for name in names:
        if not isinstance(name, str) or not _NODE_NAME.match(name):
            raise ValueError(f"node name {name!r}: expected a Slurm NodeName (letters, digits, "
                             "'.', '_' or '-'; one node each, not a hostlist such as n[1-2])")
    return list(dict.fromkeys(names))


def _job_id(job_id: str) -> str:
    text = str(job_id).strip()
    if not _JOB_ID.match(text):
        raise ValueError(f"job id {job_id!r}: expected a Slurm job id such as 1234, 1234_7 "
                         "(an array task) or 1234+1 (a het job component)")
    return text


def _reason(reason: str) -> str:
    text = " ".join(str(reason).split())
    if not text:
        raise ValueError(f"reason {reason!r}: expected a short text saying why, e.g. "
                         "'tracehound: rank 3 hung'")
    return text


class SlurmControl:
    """Slurm's `scontrol` (and `scancel`) for the watcher.

    `scontrol` is the command or its path; `scancel` is taken from the same directory when a
    path is given, else from PATH. `timeout_s` bounds every command (and the wait for a
    COMPLETING job to settle). `env` is the commands' whole environment (None: this
    process's); its PATH is where the commands are looked for."""

    def __init__(self, *, scontrol: str = "scontrol", timeout_s: float = 30.0,
                 env: Mapping[str, str] | None = None) -> None:
        if not isinstance(scontrol, str) or not scontrol.strip():
            raise ValueError(f"scontrol {scontrol!r}: expected the scontrol command or its path")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s {timeout_s!r}: expected seconds > 0")
        self._scontrol = scontrol
        directory = os.path.dirname(scontrol)
        self._scancel = os.path.join(directory, "scancel") if directory else "scancel"
        self._timeout_s = float(timeout_s)
        self._env = dict(env) if env is not None else None

    # -- running commands -------------------------------------------------------------------

    def _resolve(self, command: str) -> str:
        path = (self._env if self._env is not None else os.environ).get("PATH", os.defpath)
        found = shutil.which(command, path=path)
        if found is not None:
            return found
        if os.path.dirname(command):
            raise SlurmError(f"{command}: no such executable file; {INSTALL_HINT}, or give "
                             "SlurmControl(scontrol=...) the path of scontrol",
                             command=(command,), missing=True)
        raise SlurmError(f"{command}: not found on PATH ({path}); {INSTALL_HINT}, or give "
                         "SlurmControl(scontrol=...) its path", command=(command,), missing=True)

    def _run(self, command: str, *args: str, check: bool = True
             ) -> tuple[tuple[str, ...], subprocess.CompletedProcess[str]]:
        argv = (self._resolve(command), *args)
        shown = " ".join((command, *args))
        try:
            done = subprocess.run(list(argv), capture_output=True, text=True, check=False,
                                  timeout=self._timeout_s, env=self._env,
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) \
                else (exc.stderr or "")
            raise SlurmError(f"`{shown}` did not finish within {self._timeout_s:g} s (is "
                             f"slurmctld overloaded or unreachable?){_said(stderr)}",
                             command=argv, stderr=stderr) from exc
        except OSError as exc:
            raise SlurmError(f"`{shown}` could not be started: {exc}", command=argv) from exc
        if check and done.returncode != 0:
            raise SlurmError(f"`{shown}` exited with status {done.returncode}"
                             f"{_said(done.stderr or done.stdout)}",
                             command=argv, returncode=done.returncode, stderr=done.stderr)
        return argv, done

    def _show(self, what: str, name: str) -> dict[str, str]:
        _, done = self._run(self._scontrol, "show", what, name, "--oneliner")
        records = parse_records(done.stdout)
        if len(records) != 1:
            raise SlurmError(f"`scontrol show {what} {name} --oneliner` printed {len(records)} "
                             f"records, expected one: {_tail(done.stdout)!r}",
                             command=(self._scontrol, "show", what, name))
        return records[0]

    def _nodes(self, names: Sequence[str]) -> dict[str, dict[str, str]]:
        """Every named node's record; SlurmError naming the unknown ones."""
        argv, done = self._run(self._scontrol, "show", "node", ",".join(names), "--oneliner",
                               check=False)
        records = {r.get("NodeName", ""): r for r in parse_records(done.stdout)}
        unknown = [n for n in names if n not in records]
        if unknown or done.returncode != 0:
            said = "\n".join([line for line in done.stdout.splitlines()
                              if line.strip() and not _KEY.match(line.strip())]
                             + done.stderr.splitlines())
            raise SlurmError(
                f"`scontrol show node {','.join(names)} --oneliner` exited with status "
                f"{done.returncode}" + (f"; unknown node(s): {', '.join(unknown)}" if unknown
                                        else "") + _said(said),
                command=argv, returncode=done.returncode, stderr=done.stderr)
        return records

    def _job(self, job_id: str, *, settle: bool) -> dict[str, str]:
        """The job's record; with `settle`, once it is no longer COMPLETING (or `timeout_s`
        passed)."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            record = self._show("job", job_id)
            if not settle or record.get("JobState") != "COMPLETING" \
                    or time.monotonic() >= deadline:
                return record
            time.sleep(_SETTLE_POLL_S)

    # -- queries ----------------------------------------------------------------------------

    def check(self) -> None:
        """SlurmError when scontrol is missing or the controller does not answer (`scontrol
        ping`), saying which."""
        try:
            _, done = self._run(self._scontrol, "ping", check=False)
        except SlurmError as exc:
            if exc.missing:
                raise
            raise SlurmError(f"slurmctld does not answer: {exc}", command=exc.command,
                             stderr=exc.stderr) from exc
        # without scontrol's banner of asterisks ("** RESTORE SLURMCTLD DAEMON TO SERVICE **")
        said = "\n".join(line for line in (done.stdout + done.stderr).splitlines()
                         if line.strip() and not line.lstrip().startswith("*"))
        if done.returncode != 0 or not controller_up(done.stdout):
            conf = (self._env if self._env is not None else os.environ).get("SLURM_CONF")
            raise SlurmError(
                f"slurmctld does not answer: `scontrol ping` exited with status "
                f"{done.returncode}{_said(said)} (SLURM_CONF={conf or 'unset'})",
                command=(self._scontrol, "ping"), returncode=done.returncode, stderr=done.stderr)

    def node_state(self, node: str) -> str:
        """The node's State as scontrol reports it: "IDLE", "ALLOCATED", "MIXED+DRAIN", ..."""
        (name,) = _node_names([node])
        return self._nodes([name])[name].get("State", "")

    def job_state(self, job_id: str) -> str:
        """The job's JobState: "PENDING", "RUNNING", "COMPLETED", ..."""
        return self._show("job", _job_id(job_id)).get("JobState", "")

    def job_nodes(self, job_id: str) -> list[str]:
        """The job's nodes, one name each (its NodeList expanded by `scontrol show hostnames`);
        empty while it has none (pending)."""
        nodelist = self._show("job", _job_id(job_id)).get("NodeList", "")
        if nodelist in ("", "(null)", "None assigned"):
            return []
        _, done = self._run(self._scontrol, "show", "hostnames", nodelist)
        return [line.strip() for line in done.stdout.splitlines() if line.strip()]

    # -- steps ------------------------------------------------------------------------------

    def drain(self, nodes: Sequence[str], reason: str) -> StepResult:
        """Drain `nodes` with `reason` (`scontrol update NodeName=a,b State=DRAIN Reason=...`);
        nodes already drained keep their own reason."""
        names, text = _node_names(nodes), _reason(reason)
        try:
            records = self._nodes(names)
        except SlurmError as exc:
            return _refused(exc)
        already = [n for n in names if is_drained(records[n].get("State", ""))]
        kept = [_drained_words(n, records[n]) for n in already]
        todo = [n for n in names if n not in already]
        if not todo:
            return StepResult(command=(), ok=True, changed=False, detail="; ".join(kept))
        try:
            argv, _ = self._run(self._scontrol, "update", f"NodeName={','.join(todo)}",
                                "State=DRAIN", f"Reason={text}")
        except SlurmError as exc:
            return _refused(exc)
        logger.info("drained %s (reason %r)", ",".join(todo), text)
        detail = "; ".join([f"drained {', '.join(todo)} (reason {text!r})", *kept])
        return StepResult(command=argv, ok=True, changed=True, detail=detail)

    def resume(self, nodes: Sequence[str]) -> StepResult:
        """Return drained or down `nodes` to service (`State=RESUME`); nodes in service are
        left alone."""
        names = _node_names(nodes)
        try:
            records = self._nodes(names)
        except SlurmError as exc:
            return _refused(exc)
        todo = [n for n in names if out_of_service(records[n].get("State", ""))]
        kept = [f"{n} already in service ({records[n].get('State', '?')})"
                for n in names if n not in todo]
        if not todo:
            return StepResult(command=(), ok=True, changed=False, detail="; ".join(kept))
        try:
            argv, _ = self._run(self._scontrol, "update", f"NodeName={','.join(todo)}",
                                "State=RESUME")
        except SlurmError as exc:
            return _refused(exc)
        logger.info("resumed %s", ",".join(todo))
        was = ", ".join(f"{n} was {records[n].get('State', '?')}" for n in todo)
        detail = "; ".join([f"resumed {', '.join(todo)} ({was})", *kept])
        return StepResult(command=argv, ok=True, changed=True, detail=detail)

    def requeue(self, job_id: str) -> StepResult:
        """Requeue a batch job (`scontrol requeue JOBID`): it is stopped where it runs and
        starts again as a new run of the same job id. Already requeued and not started again,
        or never started: changed=False (see the module's docstring)."""
        job = _job_id(job_id)
        try:
            record = self._job(job, settle=True)
        except SlurmError as exc:
            return _refused(exc)
        state, restarts = record.get("JobState", ""), _restarts(record)
        waiting = _waiting(job, record)
        if waiting is not None:
            return StepResult(command=(), ok=True, changed=False, detail=waiting)
        if state in NOT_REQUEUED_STATES:
            return StepResult(command=(), ok=False, changed=False,
                              detail=f"job {job} is {state}: not requeued (a job that finished "
                                     "or was cancelled is not started again by a watcher)")
        if state == "COMPLETING":
            return StepResult(command=(), ok=False, changed=False,
                              detail=f"job {job} is still COMPLETING after {self._timeout_s:g} "
                                     "s: whether it ends or is being requeued is not known yet; "
                                     "try again")
        try:
            argv, _ = self._run(self._scontrol, "requeue", job)
        except SlurmError as exc:
            try:
                now = self._job(job, settle=False)
            except SlurmError:
                now = {}
            if _restarts(now) > restarts and now.get("JobState") in (
                    PENDING_STATES | {"COMPLETING", "RUNNING"}):
                return StepResult(command=(), ok=True, changed=False,
                                  detail=f"job {job} was requeued meanwhile by someone else "
                                         f"(Restarts {restarts} -> {_restarts(now)}, now "
                                         f"{now.get('JobState')})")
            if record.get("Requeue") == "0":
                return _refused(exc, f"job {job} was submitted with --no-requeue (Requeue=0)")
            return _refused(exc)
        logger.info("requeued job %s (was %s, restarts %d)", job, state, restarts)
        return StepResult(command=argv, ok=True, changed=True,
                          detail=f"requeued job {job} (was {state}, Restarts {restarts} -> "
                                 f"{restarts + 1}); Slurm starts it again once the job "
                                 "credential lifetime has passed (AuthInfo cred_expire, 120 s "
                                 "by default)")

    def cancel(self, job_id: str) -> StepResult:
        """Cancel the job (`scancel JOBID`); a job that ended already is left alone."""
        job = _job_id(job_id)
        try:
            record = self._job(job, settle=True)
        except SlurmError as exc:
            if _UNKNOWN_JOB in exc.stderr and not exc.missing:
                return StepResult(command=(), ok=True, changed=False,
                                  detail=f"job {job} is not known to the controller: it ended "
                                         "and was purged (MinJobAge after its end), or it never "
                                         "existed")
            return _refused(exc)
        state = record.get("JobState", "")
        if state in ENDED_STATES:
            return StepResult(command=(), ok=True, changed=False,
                              detail=f"job {job} already ended ({state})")
        try:
            argv, _ = self._run(self._scancel, job)
            after = self._job(job, settle=False).get("JobState", "")
        except SlurmError as exc:
            return _refused(exc)
        if after not in ENDED_STATES and after != "COMPLETING":
            return StepResult(command=argv, ok=False, changed=False,
                              detail=f"scancel {job} exited 0 but job {job} is still {after}")
        logger.info("cancelled job %s (was %s)", job, state)
        return StepResult(command=argv, ok=True, changed=True,
                          detail=f"cancelled job {job} (was {state}, now {after})")


def _said(text: str) -> str:
    tail = _tail(text)
    return f": {tail}" if tail else ""


def _refused(exc: SlurmError, why: str = "") -> StepResult:
    """A step that could not be done: a missing command raises, anything else is ok=False."""
    if exc.missing:
        raise exc
    return StepResult(command=exc.command if exc.returncode is not None else (),
                      ok=False, changed=False, detail=f"{why}: {exc}" if why else str(exc))


def _restarts(record: Mapping[str, str]) -> int:
    try:
        return int(record.get("Restarts", "0"))
    except ValueError:
        return 0


def _waiting(job: str, record: Mapping[str, str]) -> str | None:
    """Words for a job that waits to (re)start, so that a requeue has nothing to do; None for
    any other."""
    state, restarts = record.get("JobState", ""), _restarts(record)
    if state not in PENDING_STATES:
        return None
    reason = record.get("Reason", "None")
    why = f" (reason {reason})" if reason not in ("", "None") else ""
    if restarts > 0:
        return (f"job {job} already requeued: {state}{why} after {restarts} restart(s), "
                f"eligible {record.get('EligibleTime', 'Unknown')}")
    return f"job {job} is {state}{why} and has not started yet: nothing to requeue"


def _drained_words(name: str, record: Mapping[str, str]) -> str:
    reason = record.get("Reason", "")
    said = f" (reason {reason!r})" if reason else ""
    return f"{name} already {record.get('State', 'DRAIN')}{said}"

