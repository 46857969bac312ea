"""Sends what the outbox holds, per receiver in order, retrying outages and busy receivers
(`tracing.retry`; `Retry-After` raises the wait), setting aside what a receiver refuses for good;
each settled delivery is told to an `on_settled` callback."""

from __future__ import annotations

import email.utils
import http.client
import logging
import random
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from datetime import UTC
from typing import IO

from tracehound.controller.alerts.config import shown_url
from tracehound.controller.alerts.model import (
    Alert,
    Delivery,
    DeliveryCounts,
    PermanentDeliveryError,
    Receiver,
    Settled,
    TemporaryDeliveryError,
)
from tracehound.controller.alerts.outbox import Outbox
from tracehound.controller.alerts.payloads import render
from tracehound.tracing.retry import Backoff, BackoffState

log = logging.getLogger(__name__)


ALERT_RETRY = Backoff(initial_s=1.0, maximum_s=60.0, jitter=0.2)
"""Waits between tries of a receiver that is down or busy."""

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
        self._last_pass_until: float | None = None
        """The deadline of `stop`'s last pass, while it runs."""
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
                if self._stopped():
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
        while not self._stopped():
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

    def _stopped(self) -> bool:
        """Whether a pass gives up: once `stop` is called, except in its last pass, until
        that pass's deadline."""
        last = self._last_pass_until
        if last is not None:
            return self._clock() >= last
        return self._stop.is_set()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread after its current request, then make one last pass over the
        receivers whose wait is over, within what is left of `timeout` s: an incident that
        resolved as the job ended is told with the run's end, not by whichever dispatcher comes
        next (a loaded run's thread had not woken for it before the stop). Whether the thread
        ended within `timeout` s; what is still pending stays in the outbox for the next
        dispatcher."""
        until = self._clock() + timeout
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._last_pass_until = until
        try:
            self.deliver_once()
        except Exception:
            log.exception("the last alert delivery pass failed; what is pending stays in the "
                          "outbox")
        finally:
            self._last_pass_until = None
        return True

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
