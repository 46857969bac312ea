"""What an alert is: the announcement of an incident (`Alert`, `alert_for`), where it goes
(`Receiver`), one delivery of it (`Delivery`) and its outcome (`Settled`, `alert_action`), and the
errors of alerting by what the caller can do about them."""

from __future__ import annotations

import fnmatch
import logging
from typing import Literal

import msgspec

from tracehound.tracing.events import Action, ActionKind, Incident
from tracehound.tracing.ids import JobId
from tracehound.tracing.kinds import MAX_TEXT

log = logging.getLogger(__name__)


Status = Literal["firing", "resolved"]
Severity = Literal["critical", "error", "warning", "info"]
ReceiverKind = Literal["alertmanager", "slack", "pagerduty", "webhook"]

RECEIVER_KINDS: tuple[ReceiverKind, ...] = ("alertmanager", "slack", "pagerduty", "webhook")
SEVERITIES: tuple[Severity, ...] = ("critical", "error", "warning", "info")

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
    min_severity: Severity = "warning"
    """The quietest alerts it takes: info-level ones (a stall, recorded and watched) only when
    this says `info`."""

    def takes(self, job: str) -> bool:
        return not self.jobs or any(fnmatch.fnmatchcase(job, p) for p in self.jobs)

    def hears(self, severity: str) -> bool:
        """Whether alerts of `severity` are loud enough for it (`SEVERITIES` is loudest
        first)."""
        order: dict[str, int] = {s: i for i, s in enumerate(SEVERITIES)}
        return order.get(severity, 0) <= order[self.min_severity]


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

SEVERITY: dict[str, Severity] = {
    "crash": "critical", "hang": "critical", "hardware": "critical", "silent_hang": "critical",
    "mismatch": "error", "straggler": "warning", "slow_link": "warning",
    "node_outlier": "warning", "stall": "info",
}
"""How loud each incident kind is; a kind not listed (a newer one) is an error."""


def alert_for(incident: Incident, *, status: Status, at_us: int, link: str = "",
              severity: Severity | None = None) -> Alert:
    """The alert announcing that `incident` fired, or resolved at `at_us`; as loud as its
    kind (`SEVERITY`) unless `severity` says otherwise."""
    return Alert(
        job=incident.job, incident_id=incident.incident_id, attempt=incident.attempt,
        kind=incident.kind, status=status, summary=incident.summary,
        culprit_ranks=tuple(int(r) for r in incident.culprit_ranks),
        culprit_nodes=tuple(incident.culprit_nodes), confidence=incident.confidence,
        severity=severity or SEVERITY.get(incident.kind, "error"),
        at_us=incident.detected_at_us if status == "firing" else at_us, link=link,
    )
