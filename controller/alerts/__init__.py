"""Alerts: tell people (Alertmanager, Slack, PagerDuty, any JSON webhook) that an
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

from tracehound.controller.alerts.config import (
    load_receivers,
    merge_receivers,
    shown_url,
)
from tracehound.controller.alerts.dispatcher import (
    ALERT_RETRY,
    Dispatcher,
    retry_after_s,
)
from tracehound.controller.alerts.model import (
    RECEIVER_KINDS,
    SEVERITIES,
    SEVERITY,
    Alert,
    AlertConfigError,
    AlertError,
    Delivery,
    DeliveryCounts,
    DeliveryError,
    PermanentDeliveryError,
    Receiver,
    ReceiverKind,
    Settled,
    Severity,
    Status,
    TemporaryDeliveryError,
    alert_action,
    alert_for,
)
from tracehound.controller.alerts.outbox import (
    Outbox,
    delivery_key,
)
from tracehound.controller.alerts.payloads import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    USER_AGENT,
    Payload,
    format_alertmanager,
    format_pagerduty,
    format_slack,
    format_webhook,
    pagerduty_dedup_key,
    render,
    rfc3339,
    sign,
    verify_signature,
)
from tracehound.controller.alerts.recorder import (
    ACTIONS_JOURNAL,
    AlertRecorder,
)

__all__ = [
    "ACTIONS_JOURNAL",
    "ALERT_RETRY",
    "RECEIVER_KINDS",
    "SEVERITIES",
    "SEVERITY",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "USER_AGENT",
    "Alert",
    "AlertConfigError",
    "AlertError",
    "AlertRecorder",
    "Delivery",
    "DeliveryCounts",
    "DeliveryError",
    "Dispatcher",
    "Outbox",
    "Payload",
    "PermanentDeliveryError",
    "Receiver",
    "ReceiverKind",
    "Settled",
    "Severity",
    "Status",
    "TemporaryDeliveryError",
    "alert_action",
    "alert_for",
    "delivery_key",
    "format_alertmanager",
    "format_pagerduty",
    "format_slack",
    "format_webhook",
    "load_receivers",
    "merge_receivers",
    "pagerduty_dedup_key",
    "render",
    "retry_after_s",
    "rfc3339",
    "shown_url",
    "sign",
    "verify_signature",
]
