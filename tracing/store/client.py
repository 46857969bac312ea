"""The trace store of an embedded directory that another process of this machine holds: every
call of the port goes to that process's endpoint (`store.sharing` finds it and serves it).

`open_store` returns one of these for a chdb URL whose directory a live process holds and
shares, so the commands that read a store (`diagnose`, `incidents`, `status`, the dashboard)
work on a running job's store unchanged. It implements the whole port, `BulkStore` included;
`store.calls` says how arguments, results and errors cross.

Every call has a timeout ($TRACEHOUND_STORE_CALL_TIMEOUT_S), and what goes wrong is a store
error naming the store, the holder and what happened: the holder not answering, gone or dying
during a call is a TemporaryStoreError (a write may or may not have landed: retry it with
`maybe_duplicate`), a token it refuses is a StoreConfigError, a call it refuses keeps the class
the store raised. This module never retries a call that may have reached the holder; it tries a
call again only when the connection was refused before it was sent, and then
- sends it to the new holder the endpoint file names, or
- when no process holds the directory any more (the holder ended: a job's `tracehound
  instrument` exits with the job while a watcher or a dashboard goes on), opens the directory
  itself and runs the call there: the client becomes the holder and shares the store in turn
  (`sharing.Sharing`), so the machine's other clients follow it.
Closing a client closes only the client (and the store, if it took the store over): a holder
that is another process keeps the store.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import urlsplit

from tracehound.tracing.errors import (
    PermanentStoreError,
    StoreConfigError,
    StoreError,
    TemporaryStoreError,
)
from tracehound.tracing.events import (
    Action,
    Batch,
    ClockReading,
    CollectiveEvent,
    HealthSample,
    Heartbeat,
    Incident,
    JobState,
    ProcessGroupInfo,
    ProcessSample,
    RankExit,
    StackSample,
)
from tracehound.tracing.ids import JobId
from tracehound.tracing.kinds import RecordBase
from tracehound.tracing.settings import (
    DEFAULT_STORE_CALL_TIMEOUT_S,
    MIN_STORE_CALL_TIMEOUT_S,
    TRACEHOUND_STORE_CALL_TIMEOUT_S,
    env_float,
)
from tracehound.tracing.store import calls, sharing
from tracehound.tracing.store.ingest import AUTH_HEADER, CALL_CONTENT_TYPE, STORE_PATH
from tracehound.tracing.store.port import FOREVER_US, CollectiveKey, InsertReport
from tracehound.tracing.store.urls import embedded_path
from tracehound.tracing.summaries import (
    ClockCorrection,
    ClockSamples,
    CollectiveColumns,
    Disagreements,
    LatenessSeries,
    LinkStats,
    NodeWindows,
    ProgressGrid,
    RankStats,
)

if TYPE_CHECKING:
    from tracehound.tracing.store.embedded import EmbeddedClickHouseStore

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0
"""The longest wait for the holder's first answer when the store is opened."""

WRITES = frozenset({"ensure_schema", "insert", "insert_columns", "record_incident",
                    "record_action", "record_state", "drop_days_before"})
"""The calls that change the store: refused by a client opened read-only (the dashboard's)."""


class SharedStoreClient:
    """A TraceStore (and BulkStore) whose directory another process of this machine holds."""

    def __init__(self, url: str, endpoint: sharing.Endpoint, *,
                 timeout_s: float | None = None, read_only: bool = False) -> None:
        self._url = url
        self._read_only = read_only
        self._path = embedded_path(url)
        self._endpoint = endpoint
        self._timeout_s = timeout_s if timeout_s is not None else env_float(
            TRACEHOUND_STORE_CALL_TIMEOUT_S, DEFAULT_STORE_CALL_TIMEOUT_S,
            minimum=MIN_STORE_CALL_TIMEOUT_S)
        self._lock = threading.Lock()
        self._closed = False
        self._own: EmbeddedClickHouseStore | None = None
        """The store, once this client took it over from a holder that ended."""
        self._sharing: sharing.Sharing | None = None

    @classmethod
    def connect(cls, url: str, endpoint: sharing.Endpoint, *, timeout_s: float | None = None,
                read_only: bool = False) -> SharedStoreClient:
        """A client of the holder `endpoint` names, once it answered for the directory of
        `url` in the protocol this one speaks (StoreConfigError otherwise). A `read_only`
        client refuses every call that would change the store (PermanentStoreError), as the
        server refuses a read-only server store's."""
        client = cls(url, endpoint, timeout_s=timeout_s, read_only=read_only)
        client.hello()
        return client

    @property
    def url(self) -> str:
        return self._url

    @property
    def endpoint(self) -> sharing.Endpoint:
        """Where the holder serves the store now."""
        return self._endpoint

    def _context(self, endpoint: sharing.Endpoint) -> str:
        return (f"embedded store {self._url} (held by pid {endpoint.pid}, shared at "
                f"{endpoint.url})")

    def hello(self) -> calls.Hello:
        """Ask the holder who it is; StoreConfigError unless it holds this directory and speaks
        this protocol."""
        endpoint = self._endpoint
        status, body = self._post(endpoint, calls.HELLO, b"",
                                  min(self._timeout_s, HELLO_TIMEOUT_S))
        context = self._context(endpoint)
        if status != http.HTTPStatus.OK:
            raise self._refusal(endpoint, calls.HELLO, status, body)
        try:
            hello: calls.Hello = calls.decode(body, calls.Hello)
        except TypeError as exc:
            raise StoreConfigError(f"{context}: it does not answer as a Tracehound store "
                                   f"endpoint ({exc})") from exc
        if hello.version != calls.PROTOCOL_VERSION:
            raise StoreConfigError(f"{context}: the holder speaks version {hello.version} of the "
                                   f"store calls, this process {calls.PROTOCOL_VERSION}: run the "
                                   "same Tracehound version in both")
        if hello.store != self._path or hello.pid != endpoint.pid:
            raise StoreConfigError(f"{context}: the endpoint answers for pid {hello.pid} and "
                                   f"{hello.store}, not for this store: the endpoint file is "
                                   "stale, not trusted")
        return hello

    # --- one call -------------------------------------------------------------------------

    def _post(self, endpoint: sharing.Endpoint, method: str, body: bytes,
              timeout_s: float) -> tuple[int, bytes]:
        parts = urlsplit(endpoint.url)
        connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                                timeout=timeout_s)
        context = self._context(endpoint)
        try:
            try:
                connection.connect()
            except ConnectionRefusedError as exc:
                raise HolderRefused(f"{context}: nothing answers there (connection refused); "
                               f"{_holder_state(endpoint)}") from exc
            connection.request("POST", STORE_PATH + method, body=body, headers={
                AUTH_HEADER: f"Bearer {endpoint.token}",
                "Content-Type": CALL_CONTENT_TYPE,
                "Connection": "close",
            })
            answer = connection.getresponse()
            return answer.status, answer.read()
        except HolderRefused:
            raise
        except TimeoutError as exc:
            raise TemporaryStoreError(
                f"{context}: no answer to {method} within {timeout_s:g} s "
                f"(${TRACEHOUND_STORE_CALL_TIMEOUT_S}); {_holder_state(endpoint)}; a write may "
                "still land there") from exc
        except (http.client.HTTPException, OSError) as exc:
            gone = "" if sharing.pid_alive(endpoint.pid) else f"; pid {endpoint.pid} is gone"
            raise TemporaryStoreError(
                f"{context}: the connection broke during {method} ({type(exc).__name__}: "
                f"{exc}){gone}; a write may or may not have landed") from exc
        finally:
            connection.close()

    def _refusal(self, endpoint: sharing.Endpoint, method: str, status: int,
                 body: bytes) -> Exception:
        context = self._context(endpoint)
        if status == http.HTTPStatus.UNAUTHORIZED:
            return StoreConfigError(
                f"{context}: the holder refused the token of "
                f"{sharing.endpoint_path(self._path)}: the file is stale or was changed")
        wire = calls.decode_error(body)
        if wire is None:
            return PermanentStoreError(f"{context}: {method} failed with HTTP {status}: "
                                       f"{body[:200]!r}")
        return calls.error_of(wire, context)

    def _call(self, method: str, *, result: Any = None, **args: Any) -> Any:
        if self._closed:
            raise PermanentStoreError(f"embedded store {self._url}: this client is closed")
        if self._read_only and method in WRITES:
            raise PermanentStoreError(f"embedded store {self._url}: this client was opened "
                                      f"read-only and refuses {method}")
        if self._own is not None:
            return getattr(self._own, method)(**args)
        found = calls.call(method)
        try:
            body = calls.encode(found.args(**args))
        except NotImplementedError as exc:
            raise TypeError(f"{method}: {exc}") from None
        endpoint = self._endpoint
        try:
            status, answer = self._post(endpoint, method, body, self._timeout_s)
        except HolderRefused:
            # never sent: safe to send again if another process holds and shares it now, or to
            # run here once this client took the store over
            fresh = self._new_holder(endpoint)
            if fresh is None:
                return getattr(self._own, method)(**args)
            endpoint = fresh
            status, answer = self._post(endpoint, method, body, self._timeout_s)
        if status != http.HTTPStatus.OK:
            raise self._refusal(endpoint, method, status, answer)
        try:
            return calls.decode(answer, found.result if result is None else result)
        except TypeError as exc:
            raise PermanentStoreError(f"{self._context(endpoint)}: the answer to {method} "
                                      f"cannot be read: {exc}") from exc

    def _new_holder(self, old: sharing.Endpoint) -> sharing.Endpoint | None:
        """The endpoint of the process that holds the directory now, when another one than
        `old`'s shares it; None when nobody held it and this client took the store over; else
        the refusal is raised as a TemporaryStoreError."""
        refused = TemporaryStoreError(f"{self._context(old)}: nothing answers there (connection "
                                      f"refused); {_holder_state(old)}; open the store again")
        with self._lock:
            if self._own is not None:  # another thread of this process took it over
                return None
            holder = sharing.holder_pid(self._path)
            if holder is None:
                self._take_over(old, refused)
                return None
            try:
                fresh = sharing.read_endpoint(self._path)
            except StoreConfigError:
                raise refused from None
            if fresh is None or fresh == old or fresh.pid != holder:
                raise refused
            self._endpoint = fresh
            return fresh

    def _take_over(self, old: sharing.Endpoint, refused: TemporaryStoreError) -> None:
        """Open the directory that no process holds any more, and share it (under the lock)."""
        from tracehound.tracing.store.embedded import EmbeddedClickHouseStore

        try:
            store = EmbeddedClickHouseStore(self._url)
        except StoreError as exc:  # taken by another process meanwhile: its endpoint next time
            raise refused from exc
        sharing.discard_stale_endpoint(self._path)
        share = sharing.Sharing(store)
        shared = True
        try:
            share.start()
        except StoreError as exc:
            logger.warning("embedded store %s: this process holds it now but cannot share it: "
                           "%s", self._path, exc)
            share.stop()
            shared = False
        self._own, self._sharing = store, share
        logger.warning("embedded store %s: its holder, pid %d, %s; this process (pid %d) holds "
                       "it now%s", self._path, old.pid, "ended" if not sharing.pid_alive(old.pid)
                       else "let it go", os.getpid(), " and shares it" if shared else "")

    # --- the port ---------------------------------------------------------------------------

    def ensure_schema(self) -> None:
        self._call("ensure_schema")

    def insert(self, batch: Batch, *, maybe_duplicate: bool = False) -> InsertReport:
        report: InsertReport = self._call("insert", batch=batch, maybe_duplicate=maybe_duplicate)
        return report

    def latest_heartbeats(self, job: JobId, attempt: int,
                          until_us: int = FOREVER_US) -> list[Heartbeat]:
        found: list[Heartbeat] = self._call("latest_heartbeats", job=job, attempt=attempt,
                                            until_us=until_us)
        return found

    def exits(self, job: JobId, attempt: int) -> list[RankExit]:
        found: list[RankExit] = self._call("exits", job=job, attempt=attempt)
        return found

    def groups(self, job: JobId, attempt: int) -> list[ProcessGroupInfo]:
        found: list[ProcessGroupInfo] = self._call("groups", job=job, attempt=attempt)
        return found

    def attempts(self, job: JobId) -> list[int]:
        found: list[int] = self._call("attempts", job=job)
        return found

    def jobs(self) -> list[JobId]:
        found: list[JobId] = self._call("jobs")
        return found

    def rank_stats(self, job: JobId, attempt: int, start_us: int, end_us: int, *,
                   clock: ClockCorrection | None = None) -> RankStats:
        found: RankStats = self._call("rank_stats", job=job, attempt=attempt,
                                      start_us=start_us, end_us=end_us, clock=clock)
        return found

    def link_stats(self, job: JobId, attempt: int, start_us: int, end_us: int, *,
                   clock: ClockCorrection | None = None) -> LinkStats:
        found: LinkStats = self._call("link_stats", job=job, attempt=attempt,
                                      start_us=start_us, end_us=end_us, clock=clock)
        return found

    def clock_readings(self, job: JobId, since_us: int) -> list[ClockReading]:
        found: list[ClockReading] = self._call("clock_readings", job=job, since_us=since_us)
        return found

    def clock_samples(self, job: JobId, attempt: int, start_us: int, end_us: int,
                      width_us: int) -> ClockSamples:
        found: ClockSamples = self._call("clock_samples", job=job, attempt=attempt,
                                         start_us=start_us, end_us=end_us, width_us=width_us)
        return found

    def disagreements(
        self, job: JobId, attempt: int, start_us: int, end_us: int, limit: int = 100, *,
        uneven_ops: tuple[str, ...] = (),
    ) -> Disagreements:
        found: Disagreements = self._call("disagreements", job=job, attempt=attempt,
                                          start_us=start_us, end_us=end_us, limit=limit,
                                          uneven_ops=uneven_ops)
        return found

    def node_windows(
        self, job: JobId, attempt: int, start_us: int, end_us: int, window_us: int, *,
        clock: ClockCorrection | None = None,
    ) -> NodeWindows:
        found: NodeWindows = self._call("node_windows", job=job, attempt=attempt,
                                        start_us=start_us, end_us=end_us, window_us=window_us,
                                        clock=clock)
        return found

    def progress_grid(self, job: JobId, attempt: int, group: str, *, last_seqs: int = 64,
                      rank_buckets: int = 256) -> ProgressGrid:
        found: ProgressGrid = self._call("progress_grid", job=job, attempt=attempt, group=group,
                                         last_seqs=last_seqs, rank_buckets=rank_buckets)
        return found

    def lateness_series(self, job: JobId, attempt: int, start_us: int, end_us: int,
                        width_us: int, *, top: int = 8) -> LatenessSeries:
        found: LatenessSeries = self._call("lateness_series", job=job, attempt=attempt,
                                           start_us=start_us, end_us=end_us, width_us=width_us,
                                           top=top)
        return found

    def recorded_reach(self, job: JobId, attempt: int, group: str, ranks: Sequence[int], *,
                       from_seq: int, until_us: int) -> dict[int, int]:
        found: dict[int, int] = self._call("recorded_reach", job=job, attempt=attempt,
                                           group=group, ranks=list(ranks), from_seq=from_seq,
                                           until_us=until_us)
        return found

    def latest_stacks(self, job: JobId, attempt: int, since_us: int) -> list[StackSample]:
        found: list[StackSample] = self._call("latest_stacks", job=job, attempt=attempt,
                                              since_us=since_us)
        return found

    def latest_processes(self, job: JobId, attempt: int, since_us: int) -> list[ProcessSample]:
        found: list[ProcessSample] = self._call("latest_processes", job=job, attempt=attempt,
                                                since_us=since_us)
        return found

    def health(self, nodes: Sequence[str], start_us: int, end_us: int, *,
               events_since_us: int | None = None) -> list[HealthSample]:
        found: list[HealthSample] = self._call("health", nodes=list(nodes), start_us=start_us,
                                               end_us=end_us, events_since_us=events_since_us)
        return found

    def record_incident(self, incident: Incident) -> None:
        self._call("record_incident", incident=incident)

    def record_action(self, action: Action) -> None:
        self._call("record_action", action=action)

    def drop_days_before(self, day: int, *, dry_run: bool = False) -> dict[str, list[int]]:
        found: dict[str, list[int]] = self._call("drop_days_before", day=day, dry_run=dry_run)
        return found

    def record_state(self, state: JobState) -> None:
        self._call("record_state", state=state)

    def job_states(self, job: JobId) -> list[JobState]:
        found: list[JobState] = self._call("job_states", job=job)
        return found

    def incidents(self, job: JobId | None = None) -> list[Incident]:
        found: list[Incident] = self._call("incidents", job=job)
        return found

    # --- the bulk paths -----------------------------------------------------------------

    def collective_keys(self, job: JobId) -> list[CollectiveKey]:
        found: list[CollectiveKey] = self._call("collective_keys", job=job)
        return found

    def insert_columns(
        self,
        job: JobId,
        attempt: int,
        cols: CollectiveColumns,
        node_of_rank: Mapping[int, str],
        *,
        batch_id: str,
    ) -> int:
        written: int = self._call("insert_columns", job=job, attempt=attempt, cols=cols,
                                  node_of_rank={int(r): str(n) for r, n in node_of_rank.items()},
                                  batch_id=batch_id)
        return written

    def collectives(self, job: JobId, attempt: int) -> list[CollectiveEvent]:
        found: list[CollectiveEvent] = self._call("collectives", job=job, attempt=attempt)
        return found

    def records(self, kind: type[RecordBase], job: JobId, *,
                stored_by_us: int | None = None) -> list[Any]:
        found: list[Any] = self._call("records", kind=kind, job=job, stored_by_us=stored_by_us,
                                      result=list[kind])  # type: ignore[valid-type]
        return found

    def close(self) -> None:
        self._closed = True
        with self._lock:
            own, share, self._own, self._sharing = self._own, self._sharing, None, None
        if share is not None:
            share.stop()
        if own is not None:
            own.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HolderRefused(TemporaryStoreError):
    """Nothing answers at the holder's endpoint (the connection was refused): the call was never
    sent."""


def _holder_state(endpoint: sharing.Endpoint) -> str:
    if sharing.pid_alive(endpoint.pid):
        return f"pid {endpoint.pid} is still running"
    return f"pid {endpoint.pid} is gone"
