"""The ingest endpoint of an embedded store, and the client node agents use to post to it.

Only one process may open a chdb directory, so the process that owns the embedded store (the
controller) runs an `IngestServer` and node agents `post_batch` to it:

    POST /v1/batches?maybe_duplicate=1     body: tracing.wire.encode_batch(batch)
    200 {"inserted": n, "skipped": n, "rejected": [{"index": i, "reason": "..."}]}
    400 {"error": "..."}      the batch itself is malformed (bad JSON, no batch_id): do not retry
    413 {"error": "..."}      the body is larger than the server accepts
    503 {"error": "..."}      the store is temporarily unavailable; Retry-After says when to retry
    500 {"error": "..."}      the store refused the batch for good

    401 {"error": "..."}      no or a wrong token (when the endpoint has one)

    POST /v1/store/<method>                 body: a call of the TraceStore port (store.calls)
    200 the result; 4xx/5xx the error       both MessagePack, only while the process shares
                                            its store with the other processes of the machine
                                            (store.sharing; 404 otherwise)

Bad records inside a well-formed batch are rejected one by one (and counted in `rejected_total`),
the good ones are stored. The server listens on 127.0.0.1 unless told otherwise. With a token
($TRACEHOUND_INGEST_TOKEN, or `token=`) every request must carry `Authorization: Bearer <token>`
(compared in constant time; `post_body` sends the same variable's token); an endpoint on an
address other than loopback refuses to start without one. It must never run store work on the
caller's thread of `start()`/`stop()` (requests are served on threads of its own), and never lets
a request handler's exception kill the server.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

from tracehound.tracing.errors import (
    PermanentStoreError,
    StoreConfigError,
    StoreError,
    TemporaryStoreError,
)
from tracehound.tracing.events import Batch
from tracehound.tracing.settings import TRACEHOUND_INGEST_TOKEN, env_str
from tracehound.tracing.store.port import TraceStore
from tracehound.tracing.wire import InvalidRecord, Rejection, decode_batch, encode_batch

logger = logging.getLogger(__name__)

BATCHES_PATH = "/v1/batches"
CLOCK_HEADER = "X-Tracehound-Clock"
"""`<received_us>,<replied_us>` on the ingest endpoint's clock, in every answer to a POST."""
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest batch body accepted (413 above it)."""
AUTH_HEADER = "Authorization"
"""`Bearer <token>` on every request to an endpoint that has a token."""
STORE_PATH = "/v1/store/"
"""Followed by a method of the store port: the calls of a shared embedded store."""
MAX_CALL_BYTES = 1 << 30
"""Largest store call accepted (413 above it): a bulk insert of a million collective rows is
about 100 MB."""
CALL_CONTENT_TYPE = "application/msgpack"

StoreCalls = Callable[[str, bytes], tuple[int, bytes, dict[str, str]]]
"""Runs one store call (method name, body) and gives the status, body and extra headers of its
answer (`store.sharing.CallServer`)."""


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or "localhost") can be reached from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (or "" for every address) may be reachable from anywhere


@dataclass(frozen=True, slots=True)
class ClockExchange:
    """The four timestamps of one request (NTP's t1..t4): sent and answered on the sender's
    clock, received and replied on the endpoint's."""

    sent_us: int
    received_us: int
    replied_us: int
    answered_us: int

    @property
    def offset_us(self) -> int:
        """How far the sender's clock reads ahead of the endpoint's."""
        return round(((self.sent_us - self.received_us) + (self.answered_us - self.replied_us))
                     / 2)

    @property
    def delay_us(self) -> int:
        """The round trip without the endpoint's own time: the offset is good to half of it."""
        return max(0, (self.answered_us - self.sent_us) - (self.replied_us - self.received_us))


@dataclass(frozen=True, slots=True)
class IngestResult:
    """What the ingest endpoint did with a posted batch."""

    inserted: int
    skipped: int
    rejected: tuple[Rejection, ...]
    clock: ClockExchange | None = field(default=None, compare=False)
    """The request's timestamps, when the endpoint sent its own (not part of the outcome)."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("ingest %s: %s", self.client_address[0], format % args)

    def handle(self) -> None:
        try:
            super().handle()
        except ConnectionError as e:
            # The sender gave up waiting (its timeout) or went away: what it posted is stored or
            # not as the store said, and a sender that retries is known by its batch id.
            self.server.ingest.note_sender_gone(self.client_address[0], e)

    def _reply(self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
               ) -> None:
        body = json.dumps(payload).encode()
        received = getattr(self, "_received_us", 0)
        self.send_response(status)
        if received:
            # NTP's middle timestamps: the sender works out how far its clock is from ours.
            self.send_header(CLOCK_HEADER, f"{received},{time.time_ns() // 1000}")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        self._received_us = time.time_ns() // 1000
        if not self.server.ingest.authorized(self.headers.get(AUTH_HEADER)):
            self._discard_body()
            self._reply(HTTPStatus.UNAUTHORIZED,
                        {"error": f"this ingest endpoint needs the token of "
                                  f"${TRACEHOUND_INGEST_TOKEN} (Authorization: Bearer ...)"},
                        {"WWW-Authenticate": "Bearer"})
            return
        parts = urlsplit(self.path)
        if parts.path.startswith(STORE_PATH):
            self._store_call(parts.path[len(STORE_PATH):])
            return
        if parts.path != BATCHES_PATH:
            self._discard_body()
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {parts.path!r}; "
                                               f"POST batches to {BATCHES_PATH}"})
            return
        flag = parse_qs(parts.query).get("maybe_duplicate", ["0"])[-1]
        maybe_duplicate = flag.lower() in ("1", "true", "yes")
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self.close_connection = True
            self._reply(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length is required"})
            return
        length = int(length_text)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        {"error": f"batch of {length} bytes exceeds {MAX_BODY_BYTES} bytes"})
            return
        body = self.rfile.read(length)
        self._reply(*self.server.ingest.handle(body, maybe_duplicate=maybe_duplicate))

    def _store_call(self, method: str) -> None:
        calls = self.server.ingest.calls
        if calls is None:
            self._discard_body()
            self._reply(HTTPStatus.NOT_FOUND, {"error": "this endpoint shares no store"})
            return
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self.close_connection = True
            self._reply(HTTPStatus.LENGTH_REQUIRED, {"error": "Content-Length is required"})
            return
        if int(length_text) > MAX_CALL_BYTES:
            self.close_connection = True
            self._reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        {"error": f"a call of {length_text} bytes exceeds {MAX_CALL_BYTES}"})
            return
        body = self.rfile.read(int(length_text))
        status, answer, headers = calls(method, body)
        self.send_response(status)
        self.send_header("Content-Type", CALL_CONTENT_TYPE)
        self.send_header("Content-Length", str(len(answer)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(answer)

    def _discard_body(self) -> None:
        length_text = self.headers.get("Content-Length", "0")
        if length_text.isdigit() and int(length_text) <= MAX_BODY_BYTES:
            self.rfile.read(int(length_text))
        else:
            self.close_connection = True


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64
    """Connections waiting to be accepted: every call of a shared store is one."""
    ingest: IngestServer


class IngestServer:
    """An HTTP endpoint that writes posted batches into `store`, served from a daemon thread.

    `token` (default: $TRACEHOUND_INGEST_TOKEN, none when unset) is required of every request;
    StoreConfigError for a `host` other than loopback without one."""

    def __init__(self, store: TraceStore, host: str = "127.0.0.1", port: int = 0, *,
                 token: str | None = None) -> None:
        self.store = store
        self._address = (host, port)
        self._token = (token if token is not None else env_str(TRACEHOUND_INGEST_TOKEN)).encode()
        if not self._token and not is_loopback(host):
            raise StoreConfigError(
                f"the ingest endpoint would listen on {host or 'every address'!r}, beyond this "
                f"machine, without a token: set ${TRACEHOUND_INGEST_TOKEN} (on the endpoint and "
                "on every node agent) or listen on 127.0.0.1")
        self.unauthorized_total = 0
        """Requests refused for a missing or wrong token."""
        self.calls: StoreCalls | None = None
        """The store calls this endpoint serves (`store.sharing`); None: batches only."""
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._counts_lock = threading.Lock()
        self.batches_total = 0
        self.inserted_total = 0
        self.skipped_total = 0
        self.rejected_total = 0
        """Records refused by the decoder since start, across all batches."""
        self.senders_gone_total = 0
        """Connections whose sender left before its answer was written (broken or reset)."""

    def note_sender_gone(self, host: str, error: ConnectionError) -> None:
        with self._counts_lock:
            self.senders_gone_total += 1
            first = self.senders_gone_total == 1
        # the first at info, the rest at debug: a sender that times out under load does so often
        logger.log(logging.INFO if first else logging.DEBUG,
                   "ingest: sender %s left before its answer (%s); %d so far", host,
                   type(error).__name__, self.senders_gone_total)

    @property
    def url(self) -> str:
        """`http://host:port` of the running server."""
        if self._server is None:
            raise RuntimeError("the ingest server is not running: call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> Self:
        if self._server is not None:
            return self
        server = _Server(self._address, _Handler)
        server.ingest = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.1},
            name="tracehound-ingest", daemon=True,
        )
        self._thread.start()
        logger.info("ingest endpoint listening at %s for %s", self.url, self.store.url)
        return self

    @property
    def token(self) -> str:
        """The token every request must carry ("" when the endpoint takes any local caller)."""
        return self._token.decode()

    @property
    def host(self) -> str:
        """The address the endpoint listens on."""
        return self._address[0]

    def authorized(self, header: str | None) -> bool:
        """Whether a request with this `Authorization` header may post (always, without a
        token); the token is compared in constant time."""
        if not self._token:
            return True
        given = (header or "").strip()
        scheme, _, value = given.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(),
                                                                self._token)
        if not ok:
            with self._counts_lock:
                self.unauthorized_total += 1
        return ok

    def stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()
        self._server = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def handle(self, body: bytes, *, maybe_duplicate: bool
               ) -> tuple[int, dict[str, Any], dict[str, str]]:
        """Status, JSON payload and extra headers for one posted batch body."""
        try:
            decoded = decode_batch(body)
        except InvalidRecord as exc:
            return HTTPStatus.BAD_REQUEST, {"error": f"malformed batch: {exc}"}, {}
        rejected = [{"index": r.index, "reason": r.reason} for r in decoded.rejected]
        if decoded.rejected:
            logger.warning(
                "batch %s: rejected %d of %d records (first: record %d: %s)",
                decoded.batch.batch_id, len(decoded.rejected),
                len(decoded.batch.records) + len(decoded.rejected),
                decoded.rejected[0].index, decoded.rejected[0].reason,
            )
        with self._counts_lock:
            self.batches_total += 1
            self.rejected_total += len(decoded.rejected)
        try:
            report = self.store.insert(decoded.batch, maybe_duplicate=maybe_duplicate)
        except TemporaryStoreError as exc:
            logger.warning("batch %s: store unavailable, asking to retry: %s",
                           decoded.batch.batch_id, exc)
            retry_after = max(1, math.ceil(exc.retry_after))
            return (HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)},
                    {"Retry-After": str(retry_after)})
        except StoreError as exc:
            logger.error("batch %s: store refused it: %s", decoded.batch.batch_id, exc)
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": str(exc)}, {}
        except Exception:
            logger.exception("batch %s: unexpected failure", decoded.batch.batch_id)
            return HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "internal error"}, {}
        with self._counts_lock:
            self.inserted_total += report.inserted
            self.skipped_total += report.skipped
        return (HTTPStatus.OK,
                {"inserted": report.inserted, "skipped": report.skipped, "rejected": rejected}, {})


def _endpoint(url: str) -> str:
    base = url.rstrip("/")
    return base if base.endswith(BATCHES_PATH) else base + BATCHES_PATH


def _error_text(body: bytes) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return body[:200].decode(errors="replace")
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return str(payload["error"])
    return body[:200].decode(errors="replace")


def _exchange(sent_us: int, header: str) -> ClockExchange | None:
    """The request's four timestamps from the endpoint's clock header (None without one)."""
    answered = time.time_ns() // 1000
    parts = header.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        return None
    return ClockExchange(sent_us=sent_us, received_us=int(parts[0]),
                         replied_us=int(parts[1]), answered_us=answered)


def post_batch(url: str, batch: Batch, *, maybe_duplicate: bool, timeout: float = 5.0,
               token: str | None = None) -> IngestResult:
    """Post a batch to an ingest endpoint (`http://host:port`) and say what it did (see
    `post_body`)."""
    return post_body(url, encode_batch(batch), batch.batch_id, maybe_duplicate=maybe_duplicate,
                     timeout=timeout, token=token)


def post_body(url: str, body: bytes, batch_id: str, *, maybe_duplicate: bool,
              timeout: float = 5.0, token: str | None = None) -> IngestResult:
    """Post a batch already in its wire form (`body`, as `tracing.wire` writes it) to an ingest
    endpoint (`http://host:port`) and say what it did. `token` (default:
    $TRACEHOUND_INGEST_TOKEN; none when unset) goes in the `Authorization` header.

    Raises TemporaryStoreError when the endpoint cannot be reached, times out or answers 503 (or
    another 5xx but 500), with `retry_after` from the answer; StoreConfigError when it refuses
    the token (401: retry once the token is right); PermanentStoreError when it refuses the
    batch (another 4xx, 500)."""
    endpoint = _endpoint(url)
    target = endpoint + ("?maybe_duplicate=1" if maybe_duplicate else "")
    if urlsplit(target).scheme not in ("http", "https"):
        raise PermanentStoreError(f"ingest URL {url!r}: expected http://host:port")
    headers = {"Content-Type": "application/json"}
    token = token if token is not None else env_str(TRACEHOUND_INGEST_TOKEN)
    if token:
        headers[AUTH_HEADER] = f"Bearer {token}"
    request = urllib.request.Request(  # noqa: S310 (scheme checked above)
        target, data=body, method="POST", headers=headers)
    sent = time.time_ns() // 1000
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:  # noqa: S310
            body = answer.read()
            clock = _exchange(sent, answer.headers.get(CLOCK_HEADER, ""))
    except urllib.error.HTTPError as exc:
        body = exc.read()
        status = exc.code
        reason = _error_text(body)
        if status == HTTPStatus.UNAUTHORIZED:
            # not the batch's fault: it stays spooled and is sent again once the token is right
            raise StoreConfigError(
                f"ingest endpoint {endpoint} refused batch {batch_id}: no or a wrong token "
                f"(${TRACEHOUND_INGEST_TOKEN}): {reason}") from exc
        if status == HTTPStatus.INTERNAL_SERVER_ERROR or 400 <= status < 500:
            raise PermanentStoreError(
                f"ingest endpoint {endpoint} refused batch {batch_id} ({status}): {reason}"
            ) from exc
        retry_text = exc.headers.get("Retry-After", "") if exc.headers else ""
        try:
            retry_after = float(retry_text)
        except ValueError:
            retry_after = 1.0
        raise TemporaryStoreError(
            f"ingest endpoint {endpoint} is unavailable ({status}): {reason}",
            retry_after=retry_after,
        ) from exc
    except (urllib.error.URLError, OSError) as exc:  # TimeoutError is an OSError
        raise TemporaryStoreError(f"ingest endpoint {endpoint} is unreachable: {exc}") from exc
    try:
        payload = json.loads(body)
        return IngestResult(
            inserted=int(payload["inserted"]),
            skipped=int(payload["skipped"]),
            rejected=tuple(
                Rejection(int(r["index"]), str(r["reason"])) for r in payload["rejected"]
            ),
            clock=clock,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise PermanentStoreError(
            f"{endpoint} did not answer like a Tracehound ingest endpoint: {body[:200]!r}"
        ) from exc
