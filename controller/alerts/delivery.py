"""Alert delivery: tells people (Alertmanager, Slack, PagerDuty, any JSON webhook) that an
incident fired or resolved, once per incident and receiver, without losing a message to an
outage of the receiver or a restart of the controller.

    Alert --enqueue--> Outbox (a directory) --Dispatcher--> POST to each Receiver

- `Alert` is what is announced (`alert_for` makes one of a stored incident); `Receiver` is where
  it goes, read from a YAML or JSON file (`load_receivers`: `{"receivers": [{"name", "kind",
  "url", ...}]}`). Receivers are global (the file named by $TRACEHOUND_ALERTS, for every job
  the controller runs; `jobs: [patterns]` limits one to some jobs) or per job (`run --alerts`).
- `format_alertmanager`, `format_slack`, `format_pagerduty` and `format_webhook` turn an alert
  into a request body and headers for each kind of receiver (pure functions). A webhook's body is
  signed: `X-Tracehound-Signature: v1=<hex HMAC-SHA256(secret, "<timestamp>." + body)>`, checked
  by `verify_signature`, which also refuses a timestamp too far from now (a replay).
- `Outbox.enqueue` writes one delivery file per (receiver, job, incident, status) with an
  atomic write (temp file, fsync, rename, fsync of the directory) under `pending/<receiver>/`.
  A delivery already pending, delivered (its marker is in `sent/<receiver>/`) or set aside (in
  `failed/<receiver>/`) is not enqueued again: each incident is announced once and resolved once
  per receiver. A resolve for an incident that receiver never heard fire is sent all the same:
  nothing is lost, and every receiver kind ignores or records a resolve it cannot match.
- `Dispatcher` sends what is pending, per receiver in the order it was enqueued (a resolve never
  overtakes its trigger: a receiver's first pending delivery blocks the ones behind it until it
  is delivered or set aside). Connection errors, timeouts, 408, 429 and 5xx are retried after
  waits that follow `tracing.retry` (per receiver; a `Retry-After` raises the wait, never above
  the policy's maximum); any other answer below 200 or from 300 is final and the delivery moves
  to `failed/` with the reason. It runs from `deliver_once` (tests) or its own thread
  (`start`/`stop`), never raises out of that thread, and counts what it delivered, retried and
  set aside (`counts`). Each delivery it settles (delivered, or set aside) is told to its
  `on_settled` callback as a `Settled`; the callback's errors are logged and counted, never
  raised into delivery.
- `AlertRecorder` is such a callback: it records each settled delivery in the trace store as an
  `alert` action of its incident (`alert_action`), so whoever reads an incident sees what was
  said about it and to whom. It only queues in the dispatcher's thread; its own thread writes
  through a `controller.journal` journal (the supervisor's path to the store: durable, retried
  while the store is away, stored once).

Errors, by what the caller can do about them:

    AlertError
    ├── AlertConfigError (also a ValueError)   the receivers file is wrong: fix it
    └── DeliveryError
        ├── PermanentDeliveryError              the receiver refused for good: set aside
        └── TemporaryDeliveryError              try again after `retry_after` seconds

Secrets stay out of logs: a receiver's `secret` and `routing_key` go only into requests, and its
URL (a Slack or generic webhook URL carries its token in the path) is shown in messages, the
`failed/` records and the store's alert actions as `scheme://host:port/...` (`shown_url`).
https URLs are verified against the system's CAs, or the receiver's `ca_file`. The outbox
directory is readable by its owner only (0700).

Delivery is at least once: a controller that ends between a receiver's answer and the `sent/`
marker sends that one delivery again on restart (Alertmanager and PagerDuty merge it by its
labels or dedup_key). Markers in `sent/` and `failed/` are never removed here. This module never
blocks or raises into whoever enqueues beyond the enqueue's own file writes.
"""

from __future__ import annotations

import contextlib
import email.utils
import fnmatch
import hashlib
import hmac
import http.client
import json
import logging
import math
import os
import queue
import random
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any, Literal

import msgspec
import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from tracehound.controller.supervision.journal import STORE_RETRY, Journal, fsync_dir, write_atomic
from tracehound.controller.supervision.journal import Outbox as StoreOutbox
from tracehound.tracing.errors import StoreError, shown
from tracehound.tracing.events import Action, ActionKind, Incident
from tracehound.tracing.ids import JobId
from tracehound.tracing.kinds import MAX_TEXT
from tracehound.tracing.retry import Backoff, BackoffState
from tracehound.tracing.store import TraceStore

log = logging.getLogger(__name__)

Status = Literal["firing", "resolved"]
Severity = Literal["critical", "error", "warning", "info"]
ReceiverKind = Literal["alertmanager", "slack", "pagerduty", "webhook"]

RECEIVER_KINDS: tuple[ReceiverKind, ...] = ("alertmanager", "slack", "pagerduty", "webhook")
SEVERITIES: tuple[Severity, ...] = ("critical", "error", "warning", "info")

ALERT_RETRY = Backoff(initial_s=1.0, maximum_s=60.0, jitter=0.2)
"""Waits between tries of a receiver that is down or busy."""

SIGNATURE_HEADER = "X-Tracehound-Signature"
TIMESTAMP_HEADER = "X-Tracehound-Timestamp"
USER_AGENT = "tracehound-alerts/1"

_PAGERDUTY_SUMMARY_MAX = 1024
_SLACK_HEADER_MAX = 150
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_SIGNATURE = re.compile(r"v1=([0-9a-f]{64})")


# -- errors -----------------------------------------------------------------------------------

class AlertError(Exception):
    """Any failure of alert configuration or delivery."""


class AlertConfigError(AlertError, ValueError):
    """A receivers file that cannot work as given; the message names the file and the field."""


class DeliveryError(AlertError):
    """A delivery did not go through."""


class PermanentDeliveryError(DeliveryError):
    """The receiver answered and refused; the same request would be refused again."""


class TemporaryDeliveryError(DeliveryError):
    """The receiver was unreachable, slow or busy; the same request may go through later."""

    def __init__(self, message: str, *, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        """Seconds the receiver asked us to wait (`Retry-After`), 0 if it did not say."""


# -- records ----------------------------------------------------------------------------------

class Alert(msgspec.Struct, frozen=True, kw_only=True):
    """One announcement: an incident of a job fired or resolved."""

    job: str
    incident_id: str
    attempt: int
    kind: str
    """The incident kind: "hang", "crash", "hardware", "mismatch", "stall", "straggler", ..."""
    status: Status
    summary: str
    """One sentence: what happened and to whom."""
    culprit_ranks: tuple[int, ...]
    culprit_nodes: tuple[str, ...]
    confidence: float
    severity: Severity
    at_us: int
    """Wall-clock microseconds since the epoch when it fired (or resolved)."""
    link: str = ""
    """Where to read more (the dashboard's page for the incident), if anywhere."""


class Receiver(msgspec.Struct, frozen=True, kw_only=True):
    """Where alerts go."""

    name: str
    """Unique among the receivers; letters, digits, `_`, `.` and `-` (it names a directory)."""
    kind: ReceiverKind
    url: str
    """The full URL to POST to (for Alertmanager: `.../api/v2/alerts`)."""
    routing_key: str = ""
    """PagerDuty's integration key (kind pagerduty only, required there)."""
    secret: str = ""
    """The key that signs the body (kind webhook only, required there)."""
    timeout_s: float = 5.0
    """How long to wait for the receiver to connect, and for each read of its answer."""
    ca_file: str = ""
    """A PEM file of the CAs that an https:// receiver's certificate is checked against instead
    of the system's ("": the system's). Certificates are always checked."""
    jobs: tuple[str, ...] = ()
    """The jobs whose alerts it takes: shell-style patterns of job ids (`exp-*`); none: every
    job. A global receivers file ($TRACEHOUND_ALERTS) routes per job this way."""

    def takes(self, job: str) -> bool:
        return not self.jobs or any(fnmatch.fnmatchcase(job, p) for p in self.jobs)


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    """One alert on its way to one receiver, as kept in the outbox."""

    receiver: str
    key: str
    """Names the (job, incident_id, status) the delivery is for; see `delivery_key`."""
    seq: int
    """Enqueue order; a receiver's deliveries go out in this order."""
    alert: Alert


class DeliveryCounts(msgspec.Struct, frozen=True, kw_only=True):
    """What a dispatcher did since it was made, and what waits now."""

    delivered: int
    retries: int
    """Tries that failed for a while and will be made again."""
    failed: int
    """Deliveries set aside for good (in `failed/`)."""
    pending: int
    callback_errors: int = 0
    """Settled deliveries whose `on_settled` call raised (logged; delivery went on)."""


class Settled(msgspec.Struct, frozen=True, kw_only=True):
    """What became of one delivery, told to a dispatcher's `on_settled` once it is delivered or
    set aside for good (a try that will be made again settles nothing)."""

    receiver: str
    receiver_kind: str
    """The receiver's kind; "" when it is no longer configured."""
    job: str
    incident_id: str
    status: Status
    ok: bool
    """Delivered (the receiver answered 2xx); False: set aside in `failed/`."""
    tries: int
    """Requests this dispatcher made for it (one restarted counts afresh); 0 when it was set
    aside without one (its receiver is no longer configured)."""
    reason: str = ""
    """Why it was set aside ("" when delivered)."""
    at_us: int
    """Wall-clock microseconds since the epoch when it settled."""

    def describe(self) -> str:
        """In words: `firing alert delivered to oncall (slack) after 1 try`, `resolved alert to
        pager (pagerduty) set aside after 1 try: HTTP 400 from ...`."""
        to = f"{self.receiver} ({self.receiver_kind})" if self.receiver_kind else self.receiver
        tries = f"after {self.tries} {'try' if self.tries == 1 else 'tries'}"
        if self.ok:
            return f"{self.status} alert delivered to {to} {tries}"
        if not self.tries:
            return f"{self.status} alert to {to} set aside: {self.reason}"
        return f"{self.status} alert to {to} set aside {tries}: {self.reason}"


def alert_action(settled: Settled) -> Action:
    """The `alert` action that records a settled delivery on its incident: the receiver is the
    target, `ok` whether it was delivered, no policy rule."""
    return Action(job=JobId(settled.job), incident_id=settled.incident_id,
                  kind=ActionKind.ALERT, target=settled.receiver, time_us=settled.at_us,
                  ok=settled.ok, detail=settled.describe()[:MAX_TEXT], rule="")


# -- configuration ----------------------------------------------------------------------------

_RECEIVER_FIELDS = frozenset(("name", "kind", "url", "routing_key", "secret", "timeout_s",
                              "jobs", "ca_file"))


def shown_url(url: str) -> str:
    """`url` as messages show it: scheme, host and port, and `/...` for a path or query (a
    Slack or generic webhook URL carries its token there), never user info."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # an unclosed [ of an IPv6 host; the message may quote the URL's secrets
        return "?"
    try:
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        host, port = "?", ""
    if ":" in host:
        host = f"[{host}]"
    rest = "/..." if parts.path.strip("/") or parts.query else ""
    return f"{parts.scheme}://{host}{port}{rest}"


def load_receivers(path: str | os.PathLike[str]) -> list[Receiver]:
    """The receivers in the YAML or JSON file at `path` (`{"receivers": [...]}`);
    AlertConfigError naming the file and the field when anything in it is wrong."""
    where = os.fspath(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise AlertConfigError(f"{where}: cannot be read: {exc}") from exc
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise AlertConfigError(f"{where}: not valid YAML or JSON{line}: "
                               f"{getattr(exc, 'problem', None) or exc}") from exc
    except (ValueError, OverflowError, RecursionError) as exc:
        # what PyYAML's constructors let through: a date such as 2024-13-01, an integer of more
        # than 4300 digits, a document nested deeper than Python's recursion limit
        raise AlertConfigError(f"{where}: not a usable YAML or JSON document: "
                               f"{'nested too deep' if isinstance(exc, RecursionError) else exc}"
                               ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("receivers"), list):
        raise AlertConfigError(f'{where}: expected an object {{"receivers": [...]}}')
    receivers: list[Receiver] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(doc["receivers"]):
        receiver = _receiver(entry, f"{where}: receivers[{index}]")
        if receiver.name in seen:
            raise AlertConfigError(
                f"{where}: receivers[{index}].name: {receiver.name!r} is already the name of "
                f"receivers[{seen[receiver.name]}]")
        seen[receiver.name] = index
        receivers.append(receiver)
    return receivers


SEVERITY: dict[str, Severity] = {
    "crash": "critical", "hang": "critical", "hardware": "critical", "silent_hang": "critical",
    "mismatch": "error", "straggler": "warning", "slow_link": "warning",
    "node_outlier": "warning", "stall": "info",
}
"""How loud each incident kind is; a kind not listed (a newer one) is an error."""


def alert_for(incident: Incident, *, status: Status, at_us: int, link: str = "") -> Alert:
    """The alert announcing that `incident` fired, or resolved at `at_us`."""
    return Alert(
        job=incident.job, incident_id=incident.incident_id, attempt=incident.attempt,
        kind=incident.kind, status=status, summary=incident.summary,
        culprit_ranks=tuple(int(r) for r in incident.culprit_ranks),
        culprit_nodes=tuple(incident.culprit_nodes), confidence=incident.confidence,
        severity=SEVERITY.get(incident.kind, "error"),
        at_us=incident.detected_at_us if status == "firing" else at_us, link=link,
    )


def _receiver(entry: object, at: str) -> Receiver:
    if not isinstance(entry, dict):
        raise AlertConfigError(f"{at}: expected an object")
    unknown = sorted(str(key) for key in set(entry) - _RECEIVER_FIELDS)
    if unknown:
        raise AlertConfigError(
            f"{at}.{unknown[0]}: unknown field (known: {', '.join(sorted(_RECEIVER_FIELDS))})")

    def text(field: str) -> str:
        value = entry.get(field, "")
        if not isinstance(value, str):
            raise AlertConfigError(f"{at}.{field}: expected a string, got {shown(value)}")
        return value

    name = text("name")
    if not _NAME.fullmatch(name):
        raise AlertConfigError(
            f"{at}.name: required: 1-100 letters, digits, '_', '.' or '-', got {name!r}")
    kind = text("kind")
    if kind not in RECEIVER_KINDS:
        raise AlertConfigError(
            f"{at}.kind: expected one of {', '.join(RECEIVER_KINDS)}, got {kind!r}")
    url = text("url")
    if not url:
        raise AlertConfigError(f"{at}.url: required")
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in ("http", "https") or not rest or rest.startswith("/"):
        raise AlertConfigError(
            f"{at}.url: expected an http:// or https:// URL, got {shown_url(url)!r}")
    ca_file = text("ca_file")
    if ca_file and scheme.lower() != "https":
        raise AlertConfigError(f"{at}.ca_file: only for an https:// url")
    if ca_file and not os.path.isfile(ca_file):
        raise AlertConfigError(f"{at}.ca_file: {ca_file!r} is not a file")
    routing_key, secret = text("routing_key"), text("secret")
    if kind == "pagerduty" and not routing_key:
        raise AlertConfigError(f"{at}.routing_key: required for kind pagerduty")
    if kind != "pagerduty" and routing_key:
        raise AlertConfigError(f"{at}.routing_key: only for kind pagerduty, not {kind}")
    if kind == "webhook" and not secret:
        raise AlertConfigError(f"{at}.secret: required for kind webhook")
    if kind != "webhook" and secret:
        raise AlertConfigError(f"{at}.secret: only for kind webhook, not {kind}")
    timeout = entry.get("timeout_s", 5.0)
    try:
        seconds = (math.nan if isinstance(timeout, bool) or not isinstance(timeout, int | float)
                   else float(timeout))
    except OverflowError:  # an integer too large for a float
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise AlertConfigError(
            f"{at}.timeout_s: expected a number of seconds > 0, got {shown(timeout)}")
    jobs = entry.get("jobs", [])
    if isinstance(jobs, str):
        jobs = [jobs]
    if (not isinstance(jobs, list)
            or not all(isinstance(j, str) and j.strip() for j in jobs)):
        raise AlertConfigError(
            f"{at}.jobs: expected a list of job id patterns (`exp-*`), got {shown(jobs)}")
    return Receiver(name=name, kind=kind, url=url, routing_key=routing_key, secret=secret,
                    timeout_s=float(timeout), jobs=tuple(jobs), ca_file=ca_file)


def merge_receivers(*found: tuple[str, Sequence[Receiver]]) -> list[Receiver]:
    """The receivers of several files (`(file, receivers)`, e.g. the global file and a job's
    own); AlertConfigError naming both files when a name is used twice."""
    merged: dict[str, tuple[str, Receiver]] = {}
    for where, receivers in found:
        for receiver in receivers:
            if receiver.name in merged:
                raise AlertConfigError(
                    f"{where}: receiver {receiver.name!r} is already defined in "
                    f"{merged[receiver.name][0]}; names must be unique across both files")
            merged[receiver.name] = (where, receiver)
    return [r for _, r in merged.values()]


# -- payloads ---------------------------------------------------------------------------------

Payload = tuple[bytes, dict[str, str]]
"""A request body and its headers."""

_JSON_HEADERS = {"Content-Type": "application/json", "User-Agent": USER_AGENT}


def rfc3339(at_us: int) -> str:
    """Wall-clock microseconds as an RFC 3339 UTC time (`2026-11-24T10:00:00.123456Z`)."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=at_us)
    return moment.isoformat(timespec="microseconds").replace("+00:00", "Z")


def _json(value: object) -> Payload:
    return msgspec.json.encode(value), dict(_JSON_HEADERS)


def format_alertmanager(alert: Alert) -> Payload:
    """An Alertmanager API v2 `POST /api/v2/alerts` body: a list of one alert. Alertmanager
    matches alerts by their labels, so the resolve (with `endsAt`) ends the firing one."""
    item: dict[str, Any] = {
        "labels": {
            "alertname": f"Tracehound{alert.kind.title().replace('_', '')}",
            "job": alert.job,
            "incident_id": alert.incident_id,
            "kind": alert.kind,
            "severity": alert.severity,
            "nodes": ",".join(alert.culprit_nodes),
        },
        "annotations": {
            "summary": alert.summary,
            "ranks": ",".join(str(rank) for rank in alert.culprit_ranks),
            "confidence": f"{alert.confidence:.2f}",
        },
        "startsAt": rfc3339(alert.at_us),
    }
    if alert.status == "resolved":
        item["endsAt"] = rfc3339(alert.at_us)
    if alert.link:
        item["generatorURL"] = alert.link
    return _json([item])


def _mrkdwn(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _ranks(alert: Alert) -> str:
    return ", ".join(str(rank) for rank in alert.culprit_ranks) or "none named"


def _nodes(alert: Alert) -> str:
    return ", ".join(alert.culprit_nodes) or "none named"


def format_slack(alert: Alert) -> Payload:
    """A Slack incoming-webhook body: fallback `text` and Block Kit `blocks`."""
    state = "FIRING" if alert.status == "firing" else "RESOLVED"
    title = f"[{state}] {alert.kind} in job {alert.job}"
    fields = [
        ("Job", alert.job), ("Kind", alert.kind), ("Status", alert.status),
        ("Severity", alert.severity), ("Culprit nodes", _nodes(alert)),
        ("Culprit ranks", _ranks(alert)), ("Confidence", f"{alert.confidence:.2f}"),
        ("Incident", f"{alert.incident_id} (attempt {alert.attempt})"),
    ]
    blocks: list[dict[str, Any]] = [
        {"type": "header",
         "text": {"type": "plain_text", "text": title[:_SLACK_HEADER_MAX]}},
        {"type": "section", "text": {"type": "mrkdwn", "text": _mrkdwn(alert.summary)}},
        {"type": "section",
         "fields": [{"type": "mrkdwn", "text": f"*{label}:*\n{_mrkdwn(value)}"}
                    for label, value in fields]},
    ]
    if alert.link:
        blocks.append({"type": "context", "elements": [
            {"type": "mrkdwn", "text": f"<{alert.link}|Open in Tracehound>"}]})
    return _json({"text": f"{title}: {alert.summary}", "blocks": blocks})


def pagerduty_dedup_key(alert: Alert) -> str:
    """The key PagerDuty groups an incident's trigger and resolve by."""
    return f"tracehound/{alert.job}/{alert.incident_id}"


def format_pagerduty(alert: Alert, routing_key: str) -> Payload:
    """A PagerDuty Events API v2 body: a trigger with the details, or a bare resolve."""
    event: dict[str, Any] = {
        "routing_key": routing_key,
        "event_action": "trigger" if alert.status == "firing" else "resolve",
        "dedup_key": pagerduty_dedup_key(alert),
    }
    if alert.status == "firing":
        event["payload"] = {
            "summary": alert.summary[:_PAGERDUTY_SUMMARY_MAX],
            "source": alert.culprit_nodes[0] if alert.culprit_nodes else alert.job,
            "severity": alert.severity,
            "timestamp": rfc3339(alert.at_us),
            "component": alert.job,
            "group": alert.kind,
            "class": alert.kind,
            "custom_details": {
                "incident_id": alert.incident_id,
                "attempt": alert.attempt,
                "culprit_ranks": list(alert.culprit_ranks),
                "culprit_nodes": list(alert.culprit_nodes),
                "confidence": alert.confidence,
                "summary": alert.summary,
            },
        }
        event["client"] = "Tracehound"
        if alert.link:
            event["client_url"] = alert.link
            event["links"] = [{"href": alert.link, "text": "Incident in Tracehound"}]
    return _json(event)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp` (unix seconds)."""
    digest = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"v1={digest.hexdigest()}"


def format_webhook(alert: Alert, secret: str, *, now_s: float) -> Payload:
    """The alert as JSON, signed with `secret` at `now_s` (see `verify_signature`)."""
    body, headers = _json(alert)
    timestamp = int(now_s)
    headers[TIMESTAMP_HEADER] = str(timestamp)
    headers[SIGNATURE_HEADER] = sign(secret, timestamp, body)
    return body, headers


def verify_signature(secret: str, timestamp_header: str | None, body: bytes,
                     signature_header: str | None, *, now_s: float,
                     tolerance_s: float = 300) -> bool:
    """Whether a webhook request is genuine: its signature matches `body` and its timestamp is
    within `tolerance_s` of `now_s` (an older one may be a replay). Malformed headers fail."""
    if not timestamp_header or not signature_header:
        return False
    if not timestamp_header.isascii() or not timestamp_header.isdigit():
        return False
    timestamp = int(timestamp_header)
    if abs(now_s - timestamp) > tolerance_s:
        return False
    if not _SIGNATURE.fullmatch(signature_header.strip()):
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature_header.strip())


def render(receiver: Receiver, alert: Alert, *, now_s: float) -> Payload:
    """The request for `alert` to `receiver`, made at wall-clock `now_s`."""
    if receiver.kind == "alertmanager":
        return format_alertmanager(alert)
    if receiver.kind == "slack":
        return format_slack(alert)
    if receiver.kind == "pagerduty":
        return format_pagerduty(alert, receiver.routing_key)
    return format_webhook(alert, receiver.secret, now_s=now_s)


# -- the outbox -------------------------------------------------------------------------------

def delivery_key(alert: Alert) -> str:
    """Names what a delivery announces, (job, incident_id, status), as a file-name-safe hash."""
    named = json.dumps([alert.job, alert.incident_id, alert.status]).encode()
    return hashlib.sha256(named).hexdigest()[:32]


def _write_atomic(path: Path, data: bytes) -> None:
    """`journal.write_atomic` through a hidden `.NAME.tmp` (what `_recover` clears away)."""
    write_atomic(path, data, tmp=path.with_name(f".{path.name}.tmp"))


def _make_dir(directory: Path) -> None:
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        fsync_dir(directory.parent)


class Outbox:
    """The deliveries not yet sent, in a directory that outlives the controller:

        pending/<receiver>/<seq>-<key>.json    to send, in seq order
        sent/<receiver>/<key>                  delivered
        failed/<receiver>/<key>.json           refused for good, with the reason

    Thread-safe; one process at a time per directory."""

    def __init__(self, directory: str | os.PathLike[str], receivers: Sequence[Receiver]) -> None:
        self.directory = Path(directory)
        self.receivers: dict[str, Receiver] = {r.name: r for r in receivers}
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Path]] = {}
        """receiver -> key -> file, in enqueue order."""
        self._seq = 0
        self.unreadable = 0
        """Pending files that could not be read and were moved to `failed/`."""
        _make_dir(self.directory)
        os.chmod(self.directory, 0o700)  # alerts name jobs, nodes and what failed: owner only
        for sub in ("pending", "sent", "failed"):
            _make_dir(self.directory / sub)
        self._recover()

    def _dir(self, sub: str, receiver: str) -> Path:
        return self.directory / sub / receiver

    def _done(self, receiver: str, key: str) -> bool:
        """Whether the receiver's delivery `key` was delivered or set aside already."""
        return ((self._dir("sent", receiver) / key).exists()
                or (self._dir("failed", receiver) / f"{key}.json").exists())

    def _recover(self) -> None:
        for receiver_dir in sorted((self.directory / "pending").iterdir()):
            if not receiver_dir.is_dir():
                continue
            files: dict[str, Path] = {}
            for path in sorted(receiver_dir.glob("*.json")):
                if path.name.startswith("."):
                    continue
                seq_text, _, key = path.stem.partition("-")
                if not seq_text.isdigit() or not key:
                    continue
                self._seq = max(self._seq, int(seq_text) + 1)
                if self._done(receiver_dir.name, key):
                    path.unlink()  # done with, then the controller ended before removing it
                    continue
                files[key] = path
            for leftover in receiver_dir.glob(".*.tmp"):
                leftover.unlink()  # an enqueue interrupted before its rename
            if files:
                self._pending[receiver_dir.name] = files

    def enqueue(self, alert: Alert) -> int:
        """Queue `alert` for every receiver that has not had it (pending, delivered or set
        aside); how many deliveries were queued."""
        key = delivery_key(alert)
        queued = 0
        with self._lock:
            for name, receiver in self.receivers.items():
                if not receiver.takes(alert.job):
                    continue
                pending = self._pending.setdefault(name, {})
                if key in pending or self._done(name, key):
                    continue
                directory = self._dir("pending", name)
                _make_dir(directory)
                delivery = Delivery(receiver=name, key=key, seq=self._seq, alert=alert)
                path = directory / f"{self._seq:016d}-{key}.json"
                _write_atomic(path, msgspec.json.encode(delivery))
                self._seq += 1
                pending[key] = path
                queued += 1
        return queued

    def pending_count(self, receiver: str | None = None) -> int:
        """Deliveries waiting (for `receiver`, or for all)."""
        with self._lock:
            if receiver is not None:
                return len(self._pending.get(receiver, {}))
            return sum(len(files) for files in self._pending.values())

    def receivers_with_pending(self) -> list[str]:
        """Receivers (configured or not) that have deliveries waiting."""
        with self._lock:
            return [name for name, files in self._pending.items() if files]

    def head(self, receiver: str) -> Delivery | None:
        """The receiver's oldest pending delivery, None if there is none. A file that cannot be
        read is moved to `failed/` (and counted in `unreadable`)."""
        while True:
            with self._lock:
                files = self._pending.get(receiver)
                if not files:
                    return None
                key, path = next(iter(files.items()))
                try:
                    return msgspec.json.decode(path.read_bytes(), type=Delivery)
                except (OSError, msgspec.DecodeError) as exc:
                    log.error("alert delivery %s for receiver %s cannot be read, set aside: %s",
                              path, receiver, exc)
                    failed = self._dir("failed", receiver)
                    _make_dir(failed)
                    with contextlib.suppress(OSError):
                        os.replace(path, failed / f"{key}.unreadable")
                        fsync_dir(path.parent)
                    del files[key]
                    self.unreadable += 1

    def mark_sent(self, delivery: Delivery) -> None:
        """The receiver has it: keep the marker, drop the pending file."""
        sent = self._dir("sent", delivery.receiver)
        with self._lock:
            _make_dir(sent)
            _write_atomic(sent / delivery.key, b"")
            self._remove(delivery)

    def set_aside(self, delivery: Delivery, reason: str) -> None:
        """The receiver refused it for good: keep it and the reason in `failed/` for a human."""
        failed = self._dir("failed", delivery.receiver)
        record = {"reason": reason, "delivery": msgspec.to_builtins(delivery)}
        with self._lock:
            _make_dir(failed)
            _write_atomic(failed / f"{delivery.key}.json", msgspec.json.encode(record))
            self._remove(delivery)

    def _remove(self, delivery: Delivery) -> None:
        path = self._pending.get(delivery.receiver, {}).pop(delivery.key, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            fsync_dir(path.parent)


# -- sending ----------------------------------------------------------------------------------

class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer like any other (urllib would re-send a POST as a GET)."""

    def redirect_request(  # noqa: PLR0917 (urllib's signature)
        self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
        headers: http.client.HTTPMessage, newurl: str,
    ) -> urllib.request.Request | None:
        return None


def retry_after_s(value: str | None, *, now_s: float) -> float:
    """A `Retry-After` header's wait in seconds (delta-seconds or an HTTP date), 0 if absent
    or unreadable."""
    if not value:
        return 0.0
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        moment = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return max(0.0, moment.timestamp() - now_s)


def _is_temporary(status: int) -> bool:
    return status in (408, 429) or status >= 500


class Dispatcher:
    """Sends an outbox's deliveries (see the module docstring). Drive it with `deliver_once`
    or run it in its own thread with `start`/`stop`, not both. Receivers are tried one after
    another: one that does not answer delays the others by its `timeout_s` per try.

    `on_settled` is told each delivery once it is delivered or set aside (after the outbox
    recorded it), in the dispatcher's thread: it must return at once (`AlertRecorder` only
    queues). What it raises is logged and counted (`counts().callback_errors`), never raised
    into delivery. A pending file that cannot be read settles without it (nothing says what
    it was)."""

    def __init__(
        self,
        outbox: Outbox,
        *,
        backoff: Backoff = ALERT_RETRY,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        rng: Callable[[], float] = random.random,
        idle_s: float = 1.0,
        on_settled: Callable[[Settled], object] | None = None,
    ) -> None:
        self.outbox = outbox
        self.on_settled = on_settled
        """Told each settled delivery; may be set before `start` (the operator does)."""
        self.backoff = backoff
        self._clock = clock
        self._wall_clock = wall_clock
        self._rng = rng
        self._idle_s = idle_s
        self._states: dict[str, BackoffState] = {}
        self._next_try: dict[str, float] = {}
        """receiver -> when (on `clock`) its next try may start."""
        self._openers: dict[str, urllib.request.OpenerDirector] = {}
        """ca_file ("" for the system's CAs) -> the opener whose https checks against it."""
        self._counts_lock = threading.Lock()
        self._delivered = 0
        self._retries = 0
        self._failed = 0
        self._callback_errors = 0
        self._tries: dict[tuple[str, str], int] = {}
        """(receiver, delivery key) -> requests made for a delivery not yet settled."""
        self._pass_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- state

    def counts(self) -> DeliveryCounts:
        """Delivered, retried and set aside since this dispatcher was made; pending now."""
        with self._counts_lock:
            return DeliveryCounts(delivered=self._delivered, retries=self._retries,
                                  failed=self._failed + self.outbox.unreadable,
                                  pending=self.outbox.pending_count(),
                                  callback_errors=self._callback_errors)

    def next_due(self, now: float | None = None) -> float | None:
        """Seconds until a pending delivery may be tried (0: now), None if nothing waits."""
        now = self._clock() if now is None else now
        waits = [max(0.0, self._next_try.get(name, now) - now)
                 for name in self.outbox.receivers_with_pending()]
        return min(waits) if waits else None

    def enqueue(self, alert: Alert) -> int:
        """`Outbox.enqueue`, and wake the dispatcher's thread."""
        queued = self.outbox.enqueue(alert)
        if queued:
            self._wake.set()
        return queued

    # -- delivering

    def deliver_once(self, now: float | None = None) -> int:
        """Try every receiver whose wait is over, each until its queue is empty or a try fails
        for a while; how many deliveries went through."""
        with self._pass_lock:
            now = self._clock() if now is None else now
            delivered = 0
            for name in self.outbox.receivers_with_pending():
                if self._stop.is_set():
                    break
                receiver = self.outbox.receivers.get(name)
                if receiver is None:
                    self._set_aside_all(name)
                elif self._next_try.get(name, now) <= now:
                    delivered += self._drain(receiver, now)
            return delivered

    def _drain(self, receiver: Receiver, now: float) -> int:
        state = self._states.setdefault(receiver.name, BackoffState(self.backoff, rng=self._rng))
        state.policy = self.backoff
        delivered = 0
        while not self._stop.is_set():
            delivery = self.outbox.head(receiver.name)
            if delivery is None:
                break
            alert = delivery.alert
            tried = (receiver.name, delivery.key)
            self._tries[tried] = self._tries.get(tried, 0) + 1
            try:
                self.send(receiver, alert)
            except TemporaryDeliveryError as exc:
                wait = state.failed(exc)
                self._next_try[receiver.name] = now + wait
                with self._counts_lock:
                    self._retries += 1
                log.warning("alert %s/%s (%s) to receiver %s failed (try %d), retrying in "
                            "%.1f s: %s", alert.job, alert.incident_id, alert.status,
                            receiver.name, state.failures, wait, exc)
                break
            except PermanentDeliveryError as exc:
                self.outbox.set_aside(delivery, str(exc))
                with self._counts_lock:
                    self._failed += 1
                log.error("alert %s/%s (%s) refused by receiver %s, set aside in failed/: %s",
                          alert.job, alert.incident_id, alert.status, receiver.name, exc)
                self._settled(delivery, receiver, ok=False, tries=self._tries.pop(tried),
                              reason=str(exc))
            else:
                self.outbox.mark_sent(delivery)
                state.succeeded()
                self._next_try.pop(receiver.name, None)
                with self._counts_lock:
                    self._delivered += 1
                delivered += 1
                log.info("alert %s/%s (%s) delivered to receiver %s", alert.job,
                         alert.incident_id, alert.status, receiver.name)
                self._settled(delivery, receiver, ok=True, tries=self._tries.pop(tried))
        return delivered

    def _set_aside_all(self, name: str) -> None:
        while (delivery := self.outbox.head(name)) is not None:
            reason = f"receiver {name!r} is no longer configured"
            self.outbox.set_aside(delivery, reason)
            with self._counts_lock:
                self._failed += 1
            log.error("alert %s/%s (%s) for receiver %s, no longer configured, set aside",
                      delivery.alert.job, delivery.alert.incident_id, delivery.alert.status,
                      name)
            self._settled(delivery, None, ok=False,
                          tries=self._tries.pop((name, delivery.key), 0), reason=reason)

    def _settled(self, delivery: Delivery, receiver: Receiver | None, *, ok: bool, tries: int,
                 reason: str = "") -> None:
        """Tell `on_settled`; what it raises is logged and counted, never raised."""
        callback = self.on_settled
        if callback is None:
            return
        alert = delivery.alert
        try:
            callback(Settled(
                receiver=delivery.receiver, receiver_kind=receiver.kind if receiver else "",
                job=alert.job, incident_id=alert.incident_id, status=alert.status, ok=ok,
                tries=tries, reason=reason, at_us=int(self._wall_clock() * 1e6)))
        except Exception:
            with self._counts_lock:
                self._callback_errors += 1
            log.exception("alert %s/%s (%s) to receiver %s: on_settled failed (delivery "
                          "goes on)", alert.job, alert.incident_id, alert.status,
                          delivery.receiver)

    def send(self, receiver: Receiver, alert: Alert) -> None:
        """POST `alert` to `receiver` once; DeliveryError unless it took it (a 2xx)."""
        body, headers = render(receiver, alert, now_s=self._wall_clock())
        request = urllib.request.Request(  # noqa: S310 (http(s) checked by load_receivers)
            receiver.url, data=body, headers=headers, method="POST")
        shown = shown_url(receiver.url)
        try:
            with self._opener(receiver).open(request, timeout=receiver.timeout_s) as response:
                response.read(65536)
                status = int(response.status)
        except urllib.error.HTTPError as exc:
            with exc:
                detail = _snippet(exc)
            message = f"HTTP {exc.code} from {shown}{detail}"
            if _is_temporary(exc.code):
                wait = retry_after_s(exc.headers.get("Retry-After"), now_s=self._wall_clock())
                raise TemporaryDeliveryError(message, retry_after=wait) from exc
            raise PermanentDeliveryError(message) from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ssl.SSLCertVerificationError):
                # kept and tried again (a receiver renews an expired certificate, an operator
                # adds the ca_file and restarts): nothing is lost meanwhile
                raise TemporaryDeliveryError(
                    f"{shown}: TLS certificate not trusted ({reason.verify_message or reason}); "
                    "name its CA in the receiver's ca_file") from exc
            raise TemporaryDeliveryError(
                f"{shown} unreachable: {type(reason).__name__}: {reason}") from exc
        if not 200 <= status < 300:
            raise PermanentDeliveryError(f"HTTP {status} from {shown}")

    def _opener(self, receiver: Receiver) -> urllib.request.OpenerDirector:
        """An opener that follows no redirect and checks https certificates against the
        system's CAs or the receiver's `ca_file` (one per CA file, made on first use)."""
        opener = self._openers.get(receiver.ca_file)
        if opener is None:
            context = ssl.create_default_context(cafile=receiver.ca_file or None)
            opener = urllib.request.build_opener(
                _NoRedirect(), urllib.request.HTTPSHandler(context=context))
            self._openers[receiver.ca_file] = opener
        return opener

    # -- the thread

    def start(self) -> None:
        """Deliver in a background thread until `stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tracehound-alerts", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread after its current request; whether it ended within `timeout` s
        (what is still pending stays in the outbox for the next dispatcher)."""
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            wait = self._idle_s
            try:
                self.deliver_once()
                due = self.next_due()
                if due is not None:
                    wait = min(wait, due)
            except Exception:
                log.exception("alert delivery pass failed; trying again in %.1f s", wait)
            self._wake.wait(wait)


def _snippet(error: urllib.error.HTTPError) -> str:
    try:
        text = error.read(200).decode("utf-8", "replace").strip()
    except (OSError, http.client.HTTPException):
        return ""
    return f": {text}" if text else ""



# -- recording in the store -------------------------------------------------------------------

ACTIONS_JOURNAL = "actions.jsonl"
"""The recorder's journal, in the alert outbox's directory."""


class AlertRecorder:
    """Records each settled delivery in the store as an `alert` action of its incident (a
    dispatcher's `on_settled`).

    Calling it only queues (the dispatcher's thread never waits for the store); its own thread
    (`start`/`stop`, or `record_pending` in tests) journals what was queued, fsync'd, and writes
    the journal to the store the way the supervisor writes its actions (`controller.journal`):
    in order, retried while the store is away, each action once. What is left when it stops
    waits in the journal for the next recorder on the same file. A controller killed in the
    instant between a delivery and its journaling loses that record (not the delivery).

    `store` gives the store; it is called in the recorder's thread when first needed (the
    operator opens its store lazily), and called again later if it raised a StoreError."""

    def __init__(
        self,
        store: Callable[[], TraceStore],
        journal_path: Path | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_s: float = 0.5,
    ) -> None:
        self._open = store
        self._clock = clock
        self._idle_s = idle_s
        self._journal = Journal(journal_path)
        self._outbox: StoreOutbox | None = None
        self._open_backoff = BackoffState(STORE_RETRY)
        self._next_open = 0.0
        self._queue: queue.SimpleQueue[Settled] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, settled: Settled) -> None:
        self._queue.put(settled)
        self._wake.set()

    def pending(self) -> int:
        """Actions not yet in the store (journaled or queued); not while the thread runs."""
        return len(self._journal.pending()) + self._queue.qsize()

    def record_pending(self) -> bool:
        """Journal what was queued and write the journal to the store (unless the store's
        retry wait is not over); whether nothing is left. Raises nothing the store raises."""
        actions = []
        while True:
            try:
                actions.append(alert_action(self._queue.get_nowait()))
            except queue.Empty:
                break
        if actions:
            self._journal.append(*actions)
        outbox = self._store_outbox()
        return outbox is not None and outbox.flush()

    def _store_outbox(self) -> StoreOutbox | None:
        """The journal's way to the store, once the store opens (tries spaced as the journal's
        are while the store is away)."""
        if self._outbox is None:
            if self._clock() < self._next_open:
                return None
            try:
                store = self._open()
            except StoreError as exc:
                self._next_open = self._clock() + self._open_backoff.failed(exc)
                if self._open_backoff.failures == 1:
                    log.warning("alert records wait in journal %s until the store opens: %s",
                                self._journal.path or "(memory)", exc)
                return None
            self._outbox = StoreOutbox(self._journal, store, clock=self._clock)
        return self._outbox

    def start(self) -> None:
        """Record in a background thread until `stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tracehound-alert-records",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread, then give the store up to `timeout` s more for what is left;
        whether nothing is (the rest waits in the journal). Stop the dispatcher first."""
        end = self._clock() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("alert records: the recorder's thread did not end; what it has not "
                            "stored waits in journal %s", self._journal.path or "(memory)")
                return False
        try:
            self.record_pending()
            if self._outbox is None:
                return not self.pending()
            return self._outbox.drain(max(0.0, end - self._clock()), time.sleep)
        except Exception:
            log.exception("alert records: could not write the last ones to the store")
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.record_pending()
            except Exception:
                log.exception("alert records: a pass failed; trying again in %.1f s",
                              self._idle_s)
            self._wake.wait(self._idle_s)
