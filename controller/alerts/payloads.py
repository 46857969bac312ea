"""Request bodies and headers for each kind of receiver: Alertmanager, Slack, PagerDuty and a
signed generic webhook (`sign`, `verify_signature`). Pure functions."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from tracehound.controller.alerts.model import Alert, Receiver

log = logging.getLogger(__name__)


SIGNATURE_HEADER = "X-Tracehound-Signature"
TIMESTAMP_HEADER = "X-Tracehound-Timestamp"
USER_AGENT = "tracehound-alerts/1"

_PAGERDUTY_SUMMARY_MAX = 1024
_SLACK_HEADER_MAX = 150

_SIGNATURE = re.compile(r"v1=([0-9a-f]{64})")

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
