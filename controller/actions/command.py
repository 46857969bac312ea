"""The `--on-incident CMD` action adapter: a shell command, once per incident.

CMD runs through `/bin/sh -c` with the incident as one JSON object on stdin, with the keys
`job`, `incident`, `kind`, `culprit_ranks`, `culprit_nodes`, `confidence` and `summary`. The same
fields are in its environment as `TRACEHOUND_INCIDENT_<KEY>` (`TRACEHOUND_INCIDENT_JOB`,
`TRACEHOUND_INCIDENT_INCIDENT`, `TRACEHOUND_INCIDENT_CULPRIT_RANKS`, ...), lists comma-separated.
Its stdout and stderr go to a file; its exit status and the tail of that output are the action's
detail. A command still running after `timeout_s` is killed with its whole process group, and
the action says so.

At most once per incident, across watcher restarts too: before CMD starts, a marker naming the
incident is written durably to `state_dir`. A watcher started again that finds the marker of an
incident whose action was never recorded (the watcher was killed while CMD ran, or just after)
does not run CMD again. It records that CMD was started and that its outcome is not known.

It runs in the watcher's process and waits for CMD, so a slow CMD holds up the watching of every
job of that watcher until it ends or times out. Keep CMD short, or let it hand the work on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

from tracehound.analysis.verdict import Verdict
from tracehound.controller.actions.port import ActionsUnavailable, Outcome
from tracehound.controller.policy.recovery import PlannedAction
from tracehound.tracing.durable import write_atomic
from tracehound.tracing.events import ActionKind, Incident, now_us
from tracehound.tracing.kinds import MAX_TEXT

SHELL: Final = "/bin/sh"

RULE: Final = "on_incident"
"""The rule a command step names: it runs for every incident, whatever the policy decided."""

DEFAULT_TIMEOUT_S: Final = 60.0

INCIDENT_ENV_PREFIX: Final = "TRACEHOUND_INCIDENT_"
"""CMD's environment also holds the incident's fields (never read by Tracehound):
TRACEHOUND_INCIDENT_JOB, _INCIDENT, _KIND, _CULPRIT_RANKS, _CULPRIT_NODES (comma-separated),
_CONFIDENCE and _SUMMARY, the same as the JSON object on its stdin."""

KEYS: Final = ("job", "incident", "kind", "culprit_ranks", "culprit_nodes", "confidence",
               "summary")
"""The keys of the JSON object on CMD's stdin, in order."""


def payload(incident: Incident) -> dict[str, Any]:
    """The incident as CMD reads it on stdin."""
    return {"job": incident.job, "incident": incident.incident_id, "kind": incident.kind,
            "culprit_ranks": [int(r) for r in incident.culprit_ranks],
            "culprit_nodes": [str(n) for n in incident.culprit_nodes],
            "confidence": round(float(incident.confidence), 4), "summary": incident.summary}


def variables(incident: Incident) -> dict[str, str]:
    """The same fields as `TRACEHOUND_INCIDENT_<KEY>` variables: lists comma-separated."""
    out = {}
    for key, value in payload(incident).items():
        text = ",".join(str(v) for v in value) if isinstance(value, list) else str(value)
        out[f"{INCIDENT_ENV_PREFIX}{key.upper()}"] = text
    return out


def marker_name(incident_id: str) -> str:
    """The marker's file name for an incident id (ids hold `/`): readable, and distinct for
    distinct ids."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", incident_id)[:100]
    digest = hashlib.sha256(incident_id.encode()).hexdigest()[:12]
    return f"{safe}-{digest}.started"


def _tail(path: Path, chars: int) -> str:
    """The last `chars` characters of a file's text, "" when there is none."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - chars * 4))
            text = handle.read().decode(errors="replace")
    except OSError:
        return ""
    text = text.strip()
    return ("..." + text[-chars:]) if len(text) > chars else text


class CommandActions:
    """Runs CMD once per incident (see the module docstring)."""

    def __init__(self, command: str, *, state_dir: Path, timeout_s: float = DEFAULT_TIMEOUT_S,
                 tail_chars: int = 1500, env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not command.strip():
            raise ValueError("--on-incident: the command is empty; expected a shell command, "
                             "e.g. --on-incident 'notify-oncall.sh'")
        if not timeout_s > 0:
            raise ValueError(f"--on-incident-timeout must be a positive number of seconds, got "
                             f"{timeout_s}")
        self.command = command
        self.state_dir = state_dir
        self.timeout_s = timeout_s
        self.tail_chars = tail_chars
        self.env = env
        self.clock = clock

    @property
    def kinds(self) -> frozenset[ActionKind]:
        return frozenset({ActionKind.COMMAND})

    def describe(self) -> str:
        return f"run `{self.command}` once per incident (timeout {self.timeout_s:g} s)"

    def check(self) -> None:
        if not os.access(SHELL, os.X_OK):
            raise ActionsUnavailable(f"--on-incident needs {SHELL}, which is missing or not "
                                     "executable")

    def plan(self, verdict: Verdict,
             policy: tuple[PlannedAction, ...]) -> tuple[PlannedAction, ...]:
        return (PlannedAction(kind=ActionKind.COMMAND, target=_short(self.command, 200),
                              reason=f"--on-incident for every incident ({verdict.kind.value})",
                              rule=RULE),)

    def take(self, step: PlannedAction, incident: Incident) -> Outcome:
        marker = self.state_dir / marker_name(incident.incident_id)
        if marker.exists():
            return Outcome(False, self._clip(
                f"not run again: {self._started(marker)}, and its outcome was never recorded "
                "(the watcher stopped while it ran); the command runs at most once per "
                "incident"))
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(marker, json.dumps({
                "incident": incident.incident_id, "started_us": now_us(),
                "watcher_pid": os.getpid(), "command": self.command}).encode(),
                tmp=marker.with_name(marker.name + ".tmp"))
        except OSError as exc:
            # without the marker a restart could run it twice: better not to run it at all
            return Outcome(False, self._clip(
                f"not run: its once-per-incident marker {marker} could not be written: {exc}"))
        return self._run(incident)

    def _run(self, incident: Incident) -> Outcome:
        stdin = json.dumps(payload(incident), separators=(",", ":")) + "\n"
        env = {**(os.environ if self.env is None else self.env), **variables(incident)}
        with tempfile.TemporaryDirectory(prefix="th-cmd-") as tmp:
            output = Path(tmp) / "output"
            started = self.clock()
            with open(output, "wb") as sink:
                try:
                    child = subprocess.Popen([SHELL, "-c", self.command], stdin=subprocess.PIPE,
                                             stdout=sink, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
                except OSError as exc:
                    return Outcome(False, self._clip(f"`{self.command}` could not start: {exc}"))
                try:  # (a CMD that does not read its stdin is fine: communicate ignores EPIPE)
                    child.communicate(stdin.encode(), timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    _kill_group(child)
                    took = self.clock() - started
                    return Outcome(False, self._clip(
                        f"`{self.command}` did not finish within {self.timeout_s:g} s: killed "
                        f"with its process group after {took:.1f} s; output: "
                        f"{_tail(output, self.tail_chars) or '(none)'}"))
                except BaseException:  # interrupted: CMD must not outlive the watcher unseen
                    _kill_group(child)
                    raise
            took = self.clock() - started
            code = child.returncode
            how = (f"exited with status {code}" if code >= 0
                   else f"was killed by signal {-code}")
            return Outcome(code == 0, self._clip(
                f"`{self.command}` {how} after {took:.1f} s; output: "
                f"{_tail(output, self.tail_chars) or '(none)'}"))

    @staticmethod
    def _started(marker: Path) -> str:
        try:
            data = json.loads(marker.read_text())
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(data["started_us"] / 1e6))
            return f"it was started at {at} by watcher pid {data['watcher_pid']}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"it was started by an earlier watcher (marker {marker.name})"

    @staticmethod
    def _clip(text: str) -> str:
        return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."

    def close(self) -> None:
        return None


def _short(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars - 3] + "..."


def _kill_group(child: subprocess.Popen[bytes]) -> None:
    """Kill CMD and everything it started (its own session), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        child.kill()
    child.wait()
