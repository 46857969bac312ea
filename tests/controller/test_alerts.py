"""Alert delivery (`controller.alerts`) against real HTTP receivers on 127.0.0.1.

The receivers are `http.server`s in threads: one that records what it is sent, one that answers
503 a few times and then 200, one that answers after longer than the receiver's timeout, one
that answers slowly but in time, one that answers 400, and a port where nothing listens (later
served, as a receiver that comes back).

Covered:
- each payload: Alertmanager v2 labels/annotations/times, Slack blocks, PagerDuty trigger and
  resolve under one dedup_key, the signed webhook; the signature verifies, and a tampered body,
  a wrong secret, an old timestamp and malformed headers do not;
- nothing lost while a receiver is down: the deliveries wait in the outbox, and a new dispatcher
  on the same directory (a restarted controller) sends each of them, once and in order;
- each incident announced once and resolved once per receiver however often it is enqueued; a
  resolve never overtakes its trigger; a resolve never announced as firing is still sent;
- retries on 503/429 (with Retry-After, capped by the backoff) and timeouts, a slow answer
  within the timeout delivered, 400 and redirects set aside in failed/ and counted, unreadable
  or orphaned pending files, a restart between an answer and its cleanup, the background
  thread's start/stop;
- receivers files with a wrong field name the file and the field;
- each delivered or set-aside delivery told to `on_settled` once, with its receiver, job,
  incident, status, tries and reason; a callback that raises does not stop delivery;
- `AlertRecorder` stores each as an `alert` action of its incident on every store adapter
  (once, across a restart, and after the store could not be opened); `tracehound run` with a
  receivers file leaves the incident's alerts on it; an `alert` action changes no decision.

Time: the dispatcher is driven with explicit `now` values, or by its thread with tiny backoffs
and polled conditions; nothing asserts on how long anything took.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tracehound.controller.alerts import (
    ACTIONS_JOURNAL,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Alert,
    AlertConfigError,
    AlertRecorder,
    DeliveryCounts,
    Dispatcher,
    Outbox,
    Receiver,
    Settled,
    alert_action,
    format_alertmanager,
    format_pagerduty,
    format_slack,
    format_webhook,
    load_receivers,
    merge_receivers,
    retry_after_s,
    verify_signature,
)
from tracehound.controller.cli.main import main
from tracehound.controller.policy.recovery import PlannedAction
from tracehound.controller.supervision.jobstate import History, done_steps
from tracehound.tracing.errors import TemporaryStoreError
from tracehound.tracing.events import Action, ActionKind, Incident, JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.jobs import open_incidents
from tracehound.tracing.retry import Backoff
from tracehound.tracing.store import TraceStore, open_store

FAST = Backoff(initial_s=0.01, maximum_s=0.05, jitter=0.5)
"""Waits short enough for the dispatcher's own thread to retry at once."""

AT_US = 1_795_000_000_123_456


def make_alert(**changes: Any) -> Alert:
    values: dict[str, Any] = {
        "job": "exp7", "incident_id": "inc-1", "attempt": 2, "kind": "hang",
        "status": "firing", "summary": "rank 3 on node-b stopped inside all_reduce",
        "culprit_ranks": (3,), "culprit_nodes": ("node-b",), "confidence": 0.93,
        "severity": "critical", "at_us": AT_US,
    }
    values.update(changes)
    return Alert(**values)


# -- real receivers ---------------------------------------------------------------------------

@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0


class Endpoint:
    """An HTTP receiver on 127.0.0.1 that records each POST and answers from `script` (one
    answer per request, then `default`)."""

    def __init__(self, *, port: int = 0, script: list[Answer] | None = None,
                 default: Answer | None = None) -> None:
        self.requests: list[Request] = []
        self.script = list(script or [])
        self.default = default or Answer()
        self.released = threading.Event()
        """Set at teardown: ends every delayed answer at once."""
        self._lock = threading.Lock()
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with endpoint._lock:
                    endpoint.requests.append(Request(self.path, dict(self.headers), body))
                    answer = endpoint.script.pop(0) if endpoint.script else endpoint.default
                if answer.delay_s:
                    endpoint.released.wait(answer.delay_s)
                self.send_response(answer.status)
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass  # a client that timed out and left

        self.server = Server(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def url(self, path: str = "/") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[Callable[..., Endpoint]]:
    started: list[Endpoint] = []

    def start(**options: Any) -> Endpoint:
        started.append(Endpoint(**options))
        return started[-1]

    yield start
    for one in started:
        one.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def webhook(name: str, url: str, **changes: Any) -> Receiver:
    return Receiver(name=name, kind="webhook", url=url, secret="s3cret", **changes)


def wait_for(condition: Callable[[], bool], *, deadline_s: float = 10.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise AssertionError("condition not met before the deadline")
        time.sleep(0.01)


def statuses(endpoint: Endpoint) -> list[tuple[str, str]]:
    return [(r.json()["incident_id"], r.json()["status"]) for r in endpoint.requests]


# -- payloads ---------------------------------------------------------------------------------

def test_alertmanager_payload_firing_and_resolved() -> None:
    body, headers = format_alertmanager(make_alert(link="http://ui/incidents/inc-1",
                                                   culprit_nodes=("node-b", "node-c"),
                                                   culprit_ranks=(3, 5)))
    assert headers["Content-Type"] == "application/json"
    [item] = json.loads(body)
    assert item["labels"] == {
        "alertname": "TracehoundHang", "job": "exp7", "incident_id": "inc-1", "kind": "hang",
        "severity": "critical", "nodes": "node-b,node-c",
    }
    assert item["annotations"] == {
        "summary": "rank 3 on node-b stopped inside all_reduce", "ranks": "3,5",
        "confidence": "0.93",
    }
    assert item["startsAt"] == "2026-11-18T11:06:40.123456Z"
    assert item["generatorURL"] == "http://ui/incidents/inc-1"
    assert "endsAt" not in item

    resolved_at = AT_US + 60_000_000
    [done] = json.loads(format_alertmanager(
        make_alert(status="resolved", at_us=resolved_at, kind="slow_link"))[0])
    assert done["endsAt"] == "2026-11-18T11:07:40.123456Z"
    assert done["labels"]["alertname"] == "TracehoundSlowLink"
    assert "generatorURL" not in done


def test_slack_payload() -> None:
    body, _ = format_slack(make_alert(summary="rank 3 <stuck> & silent", link="http://ui/x"))
    message = json.loads(body)
    assert message["text"].startswith("[FIRING] hang in job exp7")
    header, summary, details, context = message["blocks"]
    assert header == {"type": "header",
                      "text": {"type": "plain_text", "text": "[FIRING] hang in job exp7"}}
    assert summary["text"]["text"] == "rank 3 &lt;stuck&gt; &amp; silent"
    fields = [f["text"] for f in details["fields"]]
    for expected in ("*Job:*\nexp7", "*Kind:*\nhang", "*Status:*\nfiring",
                     "*Culprit nodes:*\nnode-b", "*Culprit ranks:*\n3"):
        assert expected in fields
    assert "http://ui/x" in context["elements"][0]["text"]

    resolved = json.loads(format_slack(make_alert(status="resolved"))[0])
    assert resolved["text"].startswith("[RESOLVED]")
    assert len(resolved["blocks"]) == 3


def test_pagerduty_trigger_and_resolve_share_the_dedup_key() -> None:
    trigger = json.loads(format_pagerduty(make_alert(summary="x" * 2000), "rk-1")[0])
    assert trigger["routing_key"] == "rk-1"
    assert trigger["event_action"] == "trigger"
    assert trigger["dedup_key"] == "tracehound/exp7/inc-1"
    payload = trigger["payload"]
    assert len(payload["summary"]) == 1024
    assert payload["source"] == "node-b"
    assert payload["severity"] == "critical"
    assert payload["timestamp"] == "2026-11-18T11:06:40.123456Z"
    assert (payload["component"], payload["group"], payload["class"]) == ("exp7", "hang", "hang")
    assert payload["custom_details"]["culprit_ranks"] == [3]
    assert payload["custom_details"]["attempt"] == 2

    no_node = json.loads(format_pagerduty(make_alert(culprit_nodes=()), "rk-1")[0])
    assert no_node["payload"]["source"] == "exp7"

    resolve = json.loads(format_pagerduty(make_alert(status="resolved"), "rk-1")[0])
    assert resolve == {"routing_key": "rk-1", "event_action": "resolve",
                       "dedup_key": "tracehound/exp7/inc-1"}


def test_webhook_signature_verifies_and_rejects_tampering_and_replays() -> None:
    alert = make_alert()
    now = 1_795_000_000.0
    body, headers = format_webhook(alert, "s3cret", now_s=now)
    assert msgspec.json.decode(body, type=Alert) == alert
    stamp, signature = headers[TIMESTAMP_HEADER], headers[SIGNATURE_HEADER]
    assert stamp == "1795000000"
    assert signature.startswith("v1=")

    assert verify_signature("s3cret", stamp, body, signature, now_s=now + 10)
    assert not verify_signature("s3cret", stamp, body.replace(b"exp7", b"exp8"), signature,
                                now_s=now)
    assert not verify_signature("other", stamp, body, signature, now_s=now)
    assert not verify_signature("s3cret", stamp, body, signature, now_s=now + 301)
    assert not verify_signature("s3cret", stamp, body, signature, now_s=now - 301)
    assert verify_signature("s3cret", stamp, body, signature, now_s=now + 3600,
                            tolerance_s=3600)
    # the timestamp is signed: moving it forward breaks the signature
    assert not verify_signature("s3cret", str(int(now) + 100), body, signature, now_s=now + 100)
    for bad_stamp in (None, "", "12.5", "-5", "abc"):
        assert not verify_signature("s3cret", bad_stamp, body, signature, now_s=now)
    for bad_signature in (None, "", signature[3:], "v2=" + signature[3:], signature[:-1],
                          signature.upper()):
        assert not verify_signature("s3cret", stamp, body, bad_signature, now_s=now)


def test_retry_after_header() -> None:
    assert retry_after_s("7", now_s=0) == 7.0
    assert retry_after_s(None, now_s=0) == 0.0
    assert retry_after_s("soon", now_s=0) == 0.0
    assert retry_after_s("Thu, 01 Jan 1970 00:01:40 GMT", now_s=40.0) == 60.0


# -- delivery to real receivers ---------------------------------------------------------------

def test_every_kind_delivered_by_the_background_thread(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint()
    receivers = [
        Receiver(name="am", kind="alertmanager", url=server.url("/api/v2/alerts")),
        Receiver(name="slack", kind="slack", url=server.url("/slack")),
        Receiver(name="pd", kind="pagerduty", url=server.url("/pd"), routing_key="rk"),
        webhook("hook", server.url("/hook")),
    ]
    dispatcher = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    dispatcher.start()
    try:
        assert dispatcher.enqueue(make_alert()) == 4
        wait_for(lambda: dispatcher.counts().delivered == 4)
    finally:
        assert dispatcher.stop(timeout=5)
    by_path = {r.path: r for r in server.requests}
    assert sorted(by_path) == ["/api/v2/alerts", "/hook", "/pd", "/slack"]
    assert by_path["/api/v2/alerts"].json()[0]["labels"]["job"] == "exp7"
    assert by_path["/pd"].json()["event_action"] == "trigger"
    assert "blocks" in by_path["/slack"].json()
    hook = by_path["/hook"]
    assert verify_signature("s3cret", hook.headers[TIMESTAMP_HEADER], hook.body,
                            hook.headers[SIGNATURE_HEADER], now_s=time.time())
    assert dispatcher.counts() == DeliveryCounts(
        delivered=4, retries=0, failed=0, pending=0)
    assert len(list((tmp_path / "sent").rglob("*"))) == 8  # 4 directories, 4 markers


def test_nothing_lost_while_the_receiver_is_down_and_a_restarted_dispatcher_sends_it_once(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    port = free_port()
    receivers = [webhook("hook", f"http://127.0.0.1:{port}/in")]
    first = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    first.enqueue(make_alert())
    first.enqueue(make_alert(incident_id="inc-2"))
    first.enqueue(make_alert(status="resolved", at_us=AT_US + 5))
    for now in (0.0, 1.0, 2.0):
        assert first.deliver_once(now=now) == 0
    assert first.counts().retries == 3
    assert first.counts().pending == 3
    assert first.counts().delivered == 0
    del first  # the controller ends while the receiver is away

    server = endpoint(port=port)
    second = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    assert second.counts().pending == 3
    second.enqueue(make_alert())  # announced again after the restart: still pending, not doubled
    assert second.deliver_once(now=100.0) == 3
    assert statuses(server) == [("inc-1", "firing"), ("inc-2", "firing"), ("inc-1", "resolved")]

    third = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    assert third.counts().pending == 0
    assert third.enqueue(make_alert()) == 0
    assert third.deliver_once(now=200.0) == 0
    assert len(server.requests) == 3


def test_each_incident_announced_once_and_resolved_once(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint()
    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url())]), backoff=FAST)
    assert dispatcher.enqueue(make_alert()) == 1
    assert dispatcher.enqueue(make_alert(at_us=AT_US + 1)) == 0  # pending
    dispatcher.deliver_once(now=0.0)
    assert dispatcher.enqueue(make_alert(at_us=AT_US + 2)) == 0  # delivered
    assert dispatcher.enqueue(make_alert(status="resolved")) == 1
    assert dispatcher.enqueue(make_alert(status="resolved")) == 0
    dispatcher.deliver_once(now=1.0)
    assert dispatcher.enqueue(make_alert(status="resolved")) == 0
    assert dispatcher.enqueue(make_alert()) == 0
    dispatcher.deliver_once(now=2.0)
    assert statuses(server) == [("inc-1", "firing"), ("inc-1", "resolved")]
    assert dispatcher.counts().delivered == 2


def test_global_and_per_job_receivers_take_only_their_jobs(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    everyone, exp_only, other = endpoint(), endpoint(), endpoint()
    outbox = Outbox(tmp_path, [webhook("all", everyone.url()),
                               webhook("exp", exp_only.url(), jobs=("exp*",)),
                               webhook("other", other.url(), jobs=("prod-*", "nightly"))])
    dispatcher = Dispatcher(outbox, backoff=FAST)
    assert dispatcher.enqueue(make_alert(job="exp7")) == 2
    assert dispatcher.enqueue(make_alert(job="nightly", incident_id="inc-2")) == 2
    dispatcher.deliver_once(now=0.0)
    assert statuses(everyone) == [("inc-1", "firing"), ("inc-2", "firing")]
    assert statuses(exp_only) == [("inc-1", "firing")]
    assert statuses(other) == [("inc-2", "firing")]


def test_info_alerts_go_only_to_receivers_that_ask_for_them(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    """A stall is recorded and watched: its alert is info-level, which a receiver takes only
    with `min_severity: info` (a job's normal pauses would otherwise page someone)."""
    quiet, chatty = endpoint(), endpoint()
    outbox = Outbox(tmp_path, [webhook("quiet", quiet.url()),
                               webhook("chatty", chatty.url(), min_severity="info")])
    dispatcher = Dispatcher(outbox, backoff=FAST)
    assert dispatcher.enqueue(make_alert(kind="stall", severity="info")) == 1
    assert dispatcher.enqueue(make_alert(incident_id="inc-2", severity="warning")) == 2
    dispatcher.deliver_once(now=0.0)
    assert statuses(quiet) == [("inc-2", "firing")]
    assert statuses(chatty) == [("inc-1", "firing"), ("inc-2", "firing")]
    config = write_config(tmp_path, {"receivers": [
        {"name": "a", "kind": "slack", "url": "http://a/"},
        {"name": "b", "kind": "slack", "url": "http://b/", "min_severity": "info"}]})
    assert [r.min_severity for r in load_receivers(config)] == ["warning", "info"]
    bad = write_config(tmp_path, {"receivers": [
        {"name": "x", "kind": "slack", "url": "http://x/", "min_severity": "loud"}]})
    with pytest.raises(AlertConfigError, match=r"receivers\[0\]\.min_severity: expected one of "
                                               "critical, error, warning, info, got 'loud'"):
        load_receivers(bad)


def test_receivers_of_the_global_file_and_the_jobs_file_merge_with_unique_names(
        tmp_path: Path) -> None:
    (tmp_path / "g").mkdir()
    (tmp_path / "j").mkdir()
    glob_file = write_config(tmp_path / "g", {"receivers": [
        {"name": "oncall", "kind": "slack", "url": "http://s/", "jobs": ["prod-*"]}]})
    job_file = write_config(tmp_path / "j", {"receivers": [
        {"name": "mine", "kind": "slack", "url": "http://m/", "jobs": "exp7"}]})
    merged = merge_receivers(("global", load_receivers(glob_file)),
                             ("job", load_receivers(job_file)))
    assert [(r.name, r.jobs) for r in merged] == [("oncall", ("prod-*",)), ("mine", ("exp7",))]
    with pytest.raises(AlertConfigError, match="job: receiver 'oncall' is already defined in "
                                               "global"):
        merge_receivers(("global", load_receivers(glob_file)),
                        ("job", load_receivers(glob_file)))
    bad = write_config(tmp_path, {"receivers": [
        {"name": "x", "kind": "slack", "url": "http://x/", "jobs": [3]}]})
    with pytest.raises(AlertConfigError, match=r"receivers\[0\]\.jobs: expected a list"):
        load_receivers(bad)


def test_a_resolve_never_announced_as_firing_is_sent(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint()
    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url())]), backoff=FAST)
    assert dispatcher.enqueue(make_alert(status="resolved")) == 1
    assert dispatcher.deliver_once(now=0.0) == 1
    assert statuses(server) == [("inc-1", "resolved")]


def test_a_resolve_waits_behind_its_failing_trigger(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint(script=[Answer(503)])
    other = endpoint()
    receivers = [webhook("flaky", server.url()), webhook("fine", other.url())]
    dispatcher = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    dispatcher.enqueue(make_alert())
    dispatcher.enqueue(make_alert(status="resolved"))
    assert dispatcher.deliver_once(now=0.0) == 2  # both to "fine"; "flaky" waits
    assert statuses(server) == [("inc-1", "firing")]
    assert statuses(other) == [("inc-1", "firing"), ("inc-1", "resolved")]
    assert dispatcher.counts().pending == 2
    assert dispatcher.deliver_once(now=0.0) == 0  # its wait is not over
    assert dispatcher.deliver_once(now=1.0) == 2
    assert statuses(server) == [("inc-1", "firing"), ("inc-1", "firing"), ("inc-1", "resolved")]


def test_503_with_retry_after_waits_then_delivers(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint(script=[Answer(503, {"Retry-After": "30"}), Answer(429), Answer(503)])
    policy = Backoff(initial_s=1.0, maximum_s=40.0)
    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url())]), backoff=policy)
    dispatcher.enqueue(make_alert())
    assert dispatcher.deliver_once(now=0.0) == 0
    assert dispatcher.next_due(now=0.0) == 30.0  # the receiver's Retry-After
    assert dispatcher.deliver_once(now=29.0) == 0
    assert len(server.requests) == 1
    assert dispatcher.deliver_once(now=30.0) == 0  # 429: doubled wait, 60 capped at 40
    assert dispatcher.next_due(now=30.0) == 40.0
    assert dispatcher.deliver_once(now=70.0) == 0  # 503 again: capped
    assert dispatcher.deliver_once(now=110.0) == 1
    assert len(server.requests) == 4
    assert len({r.body for r in server.requests}) == 1
    assert dispatcher.counts().retries == 3
    assert dispatcher.counts().delivered == 1


def test_503_a_few_times_then_200_through_the_background_thread(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint(script=[Answer(503, {"Retry-After": "5"})] * 3)
    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url())]), backoff=FAST)
    dispatcher.start()
    try:
        dispatcher.enqueue(make_alert())
        wait_for(lambda: dispatcher.counts().delivered == 1)
    finally:
        assert dispatcher.stop(timeout=5)
    assert len(server.requests) == 4
    assert dispatcher.counts().retries == 3
    assert dispatcher.counts().pending == 0


def test_a_receiver_that_times_out_is_retried_and_a_slow_one_is_not(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    stuck = endpoint(default=Answer(delay_s=5.0))
    slow = endpoint(default=Answer(delay_s=0.1))
    receivers = [webhook("stuck", stuck.url(), timeout_s=0.2),
                 webhook("slow", slow.url(), timeout_s=3.0)]
    dispatcher = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    dispatcher.enqueue(make_alert())
    assert dispatcher.deliver_once(now=0.0) == 1
    assert len(slow.requests) == 1
    assert len(stuck.requests) == 1
    counts = dispatcher.counts()
    assert (counts.delivered, counts.retries, counts.pending) == (1, 1, 1)
    assert dispatcher.outbox.pending_count("stuck") == 1


def test_a_refused_delivery_is_set_aside_and_counted(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint(default=Answer(400))
    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url())]), backoff=FAST)
    dispatcher.enqueue(make_alert())
    dispatcher.enqueue(make_alert(incident_id="inc-2"))
    assert dispatcher.deliver_once(now=0.0) == 0
    counts = dispatcher.counts()
    assert (counts.delivered, counts.retries, counts.failed, counts.pending) == (0, 0, 2, 0)
    failed = sorted((tmp_path / "failed" / "hook").glob("*.json"))
    assert len(failed) == 2
    record = json.loads(failed[0].read_bytes())
    assert "HTTP 400" in record["reason"]
    assert record["delivery"]["alert"]["job"] == "exp7"
    assert dispatcher.deliver_once(now=10.0) == 0
    assert dispatcher.enqueue(make_alert()) == 0  # set aside for a human, not sent again
    assert len(server.requests) == 2


def test_a_restart_between_the_answer_and_the_cleanup_sends_nothing_twice(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint()
    receivers = [webhook("hook", server.url())]
    dispatcher = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    dispatcher.enqueue(make_alert())
    [pending] = (tmp_path / "pending" / "hook").glob("*.json")
    kept = pending.read_bytes()
    dispatcher.deliver_once(now=0.0)
    pending.write_bytes(kept)  # as if the controller ended before removing it
    restarted = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    assert restarted.counts().pending == 0
    assert not pending.exists()
    assert len(server.requests) == 1


def test_an_unreadable_pending_file_is_set_aside(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint()
    receivers = [webhook("hook", server.url())]
    Outbox(tmp_path, receivers).enqueue(make_alert())
    (tmp_path / "pending" / "hook" / f"{0:016d}-{'0' * 32}.json").write_bytes(b"{torn")
    dispatcher = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST)
    assert dispatcher.deliver_once(now=0.0) == 1
    assert dispatcher.counts().failed == 1
    assert len(list((tmp_path / "failed" / "hook").glob("*.unreadable"))) == 1


def test_a_redirect_is_refused_not_followed(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    target = endpoint()
    server = endpoint(default=Answer(302, {"Location": target.url("/elsewhere")}))
    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url())]), backoff=FAST)
    dispatcher.enqueue(make_alert())
    dispatcher.deliver_once(now=0.0)
    assert dispatcher.counts().failed == 1
    assert target.requests == []


def test_deliveries_for_a_receiver_no_longer_configured_are_set_aside(tmp_path: Path) -> None:
    Outbox(tmp_path, [webhook("gone", "http://127.0.0.1:9/")]).enqueue(make_alert())
    settled: list[Settled] = []
    dispatcher = Dispatcher(Outbox(tmp_path, []), backoff=FAST, on_settled=settled.append,
                            wall_clock=lambda: 1_800_000_000.0)
    assert dispatcher.counts().pending == 1
    dispatcher.deliver_once(now=0.0)
    assert dispatcher.counts().failed == 1
    assert dispatcher.counts().pending == 0
    assert len(list((tmp_path / "failed" / "gone").glob("*.json"))) == 1
    assert settled == [Settled(
        receiver="gone", receiver_kind="", job="exp7", incident_id="inc-1", status="firing",
        ok=False, tries=0, reason="receiver 'gone' is no longer configured",
        at_us=1_800_000_000_000_000)]
    assert settled[0].describe() == ("firing alert to gone set aside: receiver 'gone' is no "
                                     "longer configured")


def test_an_alert_queued_as_the_dispatcher_stops_goes_out_in_its_last_pass(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    """A job that ends resolves its incident a moment before the run stops its dispatcher;
    a loaded CI run's thread had not woken for that alert by then. Here the thread sleeps for
    a minute and is not woken: `stop` still delivers it, in its last pass."""
    server = endpoint()
    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url("/hook"))]),
                            backoff=FAST, idle_s=60.0)
    dispatcher.start()
    time.sleep(0.5)  # its first pass, on an empty outbox; then it sleeps for a minute
    assert dispatcher.outbox.enqueue(make_alert(status="resolved")) == 1  # no wake
    assert dispatcher.stop(timeout=5)
    assert statuses(server) == [("inc-1", "resolved")]
    assert dispatcher.counts().pending == 0


def test_stop_returns_while_the_receiver_is_down(tmp_path: Path) -> None:
    receivers = [webhook("hook", f"http://127.0.0.1:{free_port()}/")]
    dispatcher = Dispatcher(Outbox(tmp_path, receivers),
                            backoff=Backoff(initial_s=60.0, maximum_s=60.0))
    dispatcher.start()
    dispatcher.enqueue(make_alert())
    wait_for(lambda: dispatcher.counts().retries >= 1)
    assert dispatcher.stop(timeout=5)
    assert dispatcher.counts().pending == 1


# -- configuration ----------------------------------------------------------------------------

GOOD = [
    {"name": "am", "kind": "alertmanager", "url": "http://am:9093/api/v2/alerts"},
    {"name": "pd", "kind": "pagerduty", "url": "https://events.pagerduty.com/v2/enqueue",
     "routing_key": "rk", "timeout_s": 2},
]


def write_config(tmp_path: Path, doc: Any) -> Path:
    path = tmp_path / "alerts.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


def test_load_receivers(tmp_path: Path) -> None:
    am, pd = load_receivers(write_config(tmp_path, {"receivers": GOOD}))
    assert am == Receiver(name="am", kind="alertmanager", url="http://am:9093/api/v2/alerts")
    assert (pd.routing_key, pd.timeout_s) == ("rk", 2.0)


@pytest.mark.parametrize(("second", "message"), [
    ({"name": "x", "kind": "email", "url": "http://x/"}, "receivers[1].kind: expected one of"),
    ({"name": "x", "kind": "slack"}, "receivers[1].url: required"),
    ({"name": "x", "kind": "slack", "url": "ftp://x/"}, "receivers[1].url: expected an http"),
    ({"name": "x", "kind": "slack", "url": "http://"}, "receivers[1].url: expected an http"),
    ({"name": "x", "kind": "pagerduty", "url": "http://x/"},
     "receivers[1].routing_key: required for kind pagerduty"),
    ({"name": "x", "kind": "webhook", "url": "http://x/"},
     "receivers[1].secret: required for kind webhook"),
    ({"name": "am", "kind": "slack", "url": "http://x/"},
     "receivers[1].name: 'am' is already the name of receivers[0]"),
    ({"name": "x", "kind": "slack", "url": "http://x/", "timeout_s": 0},
     "receivers[1].timeout_s: expected a number of seconds > 0"),
    ({"name": "x", "kind": "slack", "url": "http://x/", "timeout_s": -1},
     "receivers[1].timeout_s"),
    ({"name": "x", "kind": "slack", "url": "http://x/", "timeout_s": "5"},
     "receivers[1].timeout_s"),
    ({"name": "x", "kind": "slack", "url": "http://x/", "timout_s": 5},
     "receivers[1].timout_s: unknown field"),
    ({"name": "x/y", "kind": "slack", "url": "http://x/"}, "receivers[1].name"),
    ({"kind": "slack", "url": "http://x/"}, "receivers[1].name: required"),
    ("not an object", "receivers[1]: expected an object"),
])
def test_bad_receivers_name_the_file_and_field(
        tmp_path: Path, second: Any, message: str) -> None:
    path = write_config(tmp_path, {"receivers": [GOOD[0], second]})
    with pytest.raises(AlertConfigError) as error:
        load_receivers(path)
    assert f"{path}: {message}" in str(error.value)
    assert isinstance(error.value, ValueError)


@pytest.mark.parametrize(("doc", "message"), [
    ("{not json", "not valid YAML or JSON (line 1)"),
    ("receivers:\n  - name: a\n kind: slack", "not valid YAML or JSON (line 3)"),
    ({"receiver": []}, 'expected an object {"receivers": [...]}'),
    ([], 'expected an object {"receivers": [...]}'),
])
def test_bad_receivers_files(tmp_path: Path, doc: Any, message: str) -> None:
    path = write_config(tmp_path, doc)
    with pytest.raises(AlertConfigError) as error:
        load_receivers(path)
    assert f"{path}: " in str(error.value)
    assert message in str(error.value)


# -- what became of each delivery -------------------------------------------------------------

WALL_S = 1_800_000_000.25


def test_a_delivered_and_a_set_aside_delivery_are_each_told_once(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    busy_then_fine = endpoint(script=[Answer(503)])
    refusing = endpoint(default=Answer(400))
    receivers = [Receiver(name="oncall-slack", kind="slack", url=busy_then_fine.url()),
                 Receiver(name="pager", kind="pagerduty", url=refusing.url("/pd"),
                          routing_key="rk")]
    settled: list[Settled] = []
    dispatcher = Dispatcher(Outbox(tmp_path, receivers), backoff=FAST,
                            on_settled=settled.append, wall_clock=lambda: WALL_S)
    dispatcher.enqueue(make_alert(status="resolved"))
    assert dispatcher.deliver_once(now=0.0) == 0  # slack: 503, tried again later
    assert settled == [Settled(
        receiver="pager", receiver_kind="pagerduty", job="exp7", incident_id="inc-1",
        status="resolved", ok=False, tries=1,
        # the URL without its path, which may hold a token
        reason=f"HTTP 400 from {refusing.url('/...')}: ok", at_us=1_800_000_000_250_000)]
    assert dispatcher.deliver_once(now=1.0) == 1
    assert dispatcher.deliver_once(now=2.0) == 0
    assert settled[1:] == [Settled(
        receiver="oncall-slack", receiver_kind="slack", job="exp7", incident_id="inc-1",
        status="resolved", ok=True, tries=2, at_us=1_800_000_000_250_000)]
    assert dispatcher.counts() == DeliveryCounts(delivered=1, retries=1, failed=1, pending=0)

    refused, delivered = (alert_action(s) for s in settled)
    assert refused == Action(
        job=JobId("exp7"), incident_id="inc-1", kind=ActionKind.ALERT, target="pager",
        time_us=1_800_000_000_250_000, ok=False, rule="",
        detail=f"resolved alert to pager (pagerduty) set aside after 1 try: HTTP 400 from "
               f"{refusing.url('/...')}: ok")
    assert (delivered.target, delivered.ok, delivered.detail) == (
        "oncall-slack", True, "resolved alert delivered to oncall-slack (slack) after 2 tries")


def test_an_on_settled_that_raises_never_stops_delivery(
        tmp_path: Path, endpoint: Callable[..., Endpoint]) -> None:
    server = endpoint()
    told: list[Settled] = []

    def broken(settled: Settled) -> None:
        told.append(settled)
        raise RuntimeError("the store is on fire")

    dispatcher = Dispatcher(Outbox(tmp_path, [webhook("hook", server.url())]), backoff=FAST,
                            on_settled=broken)
    dispatcher.enqueue(make_alert())
    dispatcher.enqueue(make_alert(incident_id="inc-2"))
    assert dispatcher.deliver_once(now=0.0) == 2
    assert statuses(server) == [("inc-1", "firing"), ("inc-2", "firing")]
    assert [s.incident_id for s in told] == ["inc-1", "inc-2"]
    assert dispatcher.counts() == DeliveryCounts(delivered=2, retries=0, failed=0, pending=0,
                                                 callback_errors=2)
    dispatcher.start()  # and its thread goes on too
    try:
        dispatcher.enqueue(make_alert(status="resolved"))
        wait_for(lambda: dispatcher.counts().delivered == 3)
    finally:
        assert dispatcher.stop(timeout=5)
    assert dispatcher.counts().callback_errors == 3


# -- recorded on the incident -----------------------------------------------------------------

JOB = JobId("exp7")


def stored_incident(store: TraceStore, incident_id: str = "exp7/0/1") -> Incident:
    incident = Incident(job=JOB, incident_id=incident_id, attempt=0,
                        detected_at_us=1_799_999_990_000_000, kind="hang", culprit_ranks=(3,),
                        culprit_nodes=("node-b",), confidence=0.9, summary="rank 3 stopped",
                        verdict_json="{}")
    store.record_incident(incident)
    return incident


def settled_of(incident_id: str, at_us: int, *, receiver: str = "oncall",
               ok: bool = True) -> Settled:
    return Settled(receiver=receiver, receiver_kind="slack", job=JOB, incident_id=incident_id,
                   status="firing", ok=ok, tries=1, reason="" if ok else "HTTP 400",
                   at_us=at_us)


def test_the_recorder_stores_each_settled_delivery_once_as_an_alert_action(
        store: TraceStore, tmp_path: Path) -> None:
    incident = stored_incident(store)
    journal = tmp_path / ACTIONS_JOURNAL
    recorder = AlertRecorder(lambda: store, journal)
    recorder(settled_of(incident.incident_id, 1_800_000_000_000_000))
    recorder(settled_of(incident.incident_id, 1_800_000_000_000_001, receiver="pager",
                        ok=False))
    assert recorder.record_pending()
    assert recorder.pending() == 0
    (read,) = store.incidents(JOB)
    assert [(a.kind, a.target, a.ok, a.rule) for a in read.actions] == [
        (ActionKind.ALERT, "oncall", True, ""), (ActionKind.ALERT, "pager", False, "")]
    assert read.actions[1].detail == "firing alert to pager (slack) set aside after 1 try: " \
                                     "HTTP 400"
    assert journal.read_bytes() == b""

    # a controller killed after the store took it and before the journal said so: the next
    # recorder on the journal finds it stored and does not store it twice
    journal.write_text(json.dumps({"n": 1, "put": "action", "record": msgspec.to_builtins(
        alert_action(settled_of(incident.incident_id, 1_800_000_000_000_000)))}) + "\n")
    again = AlertRecorder(lambda: store, journal)
    assert again.pending() == 1
    assert again.record_pending()
    (read,) = store.incidents(JOB)
    assert len(read.actions) == 2


def test_records_wait_in_the_journal_until_the_store_opens(
        store: TraceStore, tmp_path: Path) -> None:
    incident = stored_incident(store)
    now = [0.0]
    opens: list[str] = []

    def open_later() -> TraceStore:
        opens.append("try")
        if len(opens) == 1:
            raise TemporaryStoreError("connection refused")
        return store

    recorder = AlertRecorder(open_later, tmp_path / ACTIONS_JOURNAL, clock=lambda: now[0])
    recorder(settled_of(incident.incident_id, 1_800_000_000_000_000))
    assert not recorder.record_pending()
    assert recorder.pending() == 1
    assert (tmp_path / ACTIONS_JOURNAL).read_bytes()  # journaled, on disk
    assert not recorder.record_pending()  # its wait is not over: not tried again
    assert len(opens) == 1
    now[0] = 60.0
    assert recorder.record_pending()
    (read,) = store.incidents(JOB)
    assert [a.target for a in read.actions] == ["oncall"]


@pytest.mark.e2e
def test_tracehound_run_records_each_alert_on_its_incident(
        tmp_path: Path, endpoint: Callable[..., Endpoint],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A real `tracehound run`: the script's only rank exits 3 in attempt 0 (a crash) and
    finishes in attempt 1; the receivers file names one webhook on 127.0.0.1."""
    monkeypatch.delenv("TRACEHOUND_ALERTS", raising=False)
    server = endpoint()
    script = tmp_path / "train.py"
    script.write_text("import os, sys\n"
                      "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0':\n"
                      "    sys.exit(3)\n")
    receivers = write_config(tmp_path, {"receivers": [
        {"name": "oncall-hook", "kind": "webhook", "url": server.url("/in"),
         "secret": "s3cret"}]})
    store_url = f"chdb://{tmp_path / 'store'}"
    assert main(["run", "--job-id", "alerted", "--nnodes", "1", "--nproc-per-node", "1",
                 "--workdir", str(tmp_path / "w"), "--store", store_url, "--timeout", "120",
                 "--alerts", str(receivers), str(script)]) == 0

    assert ("alerted/0/1", "firing") in statuses(server)
    store = open_store(store_url)
    try:
        (incident,) = store.incidents(JobId("alerted"))
    finally:
        store.close()
    assert incident.kind == "crash"
    alerts = [a for a in incident.actions if a.kind is ActionKind.ALERT]
    assert ("oncall-hook", True, "firing alert delivered to oncall-hook (webhook) after 1 try",
            "") in [(a.target, a.ok, a.detail, a.rule) for a in alerts]
    assert {a.target for a in alerts} == {"oncall-hook"} and all(a.ok for a in alerts)
    # what the controller did is what it does without alerts
    assert [a.kind for a in incident.actions if a.kind is not ActionKind.ALERT] == [
        ActionKind.STOP_JOB, ActionKind.RESTART]
    assert (tmp_path / "w" / "alerted" / "alerts" / ACTIONS_JOURNAL).read_bytes() == b""


def test_an_alert_action_changes_no_decision() -> None:
    """The decisions that read an incident's actions read the same with an `alert` on it: the
    steps of a plan already taken, the times of restarts, the open incidents."""
    at = 1_000_000

    def incident(*kinds: ActionKind, alert_at: int | None = None) -> Incident:
        """An incident with actions of `kinds` at at+1, at+2, ..., and an alert at `alert_at`."""
        iid = "exp7/0/1"
        actions = [Action(job=JOB, incident_id=iid, kind=k, target="t", time_us=at + i, ok=True)
                   for i, k in enumerate(kinds, 1)]
        if alert_at is not None:
            actions.append(Action(job=JOB, incident_id=iid, kind=ActionKind.ALERT,
                                  target="oncall", time_us=alert_at, ok=True))
        return Incident(
            job=JOB, incident_id=iid, attempt=0, detected_at_us=at, kind="hang",
            culprit_ranks=(3,), culprit_nodes=("node-b",), confidence=0.9, summary="s",
            verdict_json="{}", actions=tuple(sorted(actions, key=lambda a: a.time_us)))

    plan = (PlannedAction(kind=ActionKind.STOP_JOB, target="t", reason="r"),
            PlannedAction(kind=ActionKind.RESTART, target="t", reason="r"))
    states = [JobState(job=JOB, time_us=at - 1, seq=1, state=JobPhase.RUNNING, attempt=1)]
    cases = [(ActionKind.STOP_JOB,), (ActionKind.OBSERVE,), (ActionKind.RESTART,),
             (ActionKind.RESTART, ActionKind.RESUMED), ()]
    for kinds in cases:
        without = incident(*kinds)
        for alerted in (incident(*kinds, alert_at=at), incident(*kinds, alert_at=at + 99)):
            assert done_steps(plan, alerted.actions) == done_steps(plan, without.actions)
            assert (History(states, [alerted]).times(ActionKind.RESTART)
                    == History(states, [without]).times(ActionKind.RESTART))
            for attempt in (0, 1):
                assert (len(open_incidents(states, [msgspec.structs.replace(
                            alerted, attempt=attempt)]))
                        == len(open_incidents(states, [msgspec.structs.replace(
                            without, attempt=attempt)])))
