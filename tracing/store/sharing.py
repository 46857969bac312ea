"""An embedded store shared by the processes of one machine.

chdb lets one process open a directory. The process that holds it for a while (`tracehound run`,
`tracehound instrument`, the demo, or the dashboard when it came first) serves the store's calls
to the other processes on its ingest endpoint (`store.ingest`: loopback only, a token on every
request), and says where in a file of the directory:

    <dir>/tracehound-endpoint.json   {"version", "url", "token", "pid", "store", "started_us"}

written atomically (a temporary file renamed over it) with mode 0600, so only its user can read
the token, and removed when the holder stops sharing. `open_store` on a chdb URL
(`open_embedded`) then:

- opens the directory itself when no process holds it; a file a dead holder left behind (its pid
  is gone, or holds no lock on the directory) is stale: it is not trusted, and removed;
- returns a client (`store.client`) when the process that holds the directory's lock is the one
  the file names and its endpoint answers, with the token, for this directory; when nothing
  answers there, it looks again until HOLDER_WAIT_S is over (the holder may be letting go), then
  raises the TemporaryStoreError that says so;
- waits up to HOLDER_WAIT_S for a holder that has not published a file (one that is starting to
  share, or a short command that reads the store and lets go), then fails with a
  StoreConfigError naming its pid.

A file that is not a regular file of this user with mode 0600 is refused, naming it: another
user must not be able to point this process's reads and writes at an endpoint of theirs. Which
process holds the lock is read from /proc/locks, without touching the lock (a probe that takes
it for a moment could make a holder that is starting fail to open the directory).

The serving side runs each call on the endpoint's request thread, under the embedded store's
own lock, never on the thread of whoever started the endpoint, and answers every failure
(`store.calls` says how errors cross) instead of letting it reach the endpoint.
"""

from __future__ import annotations

import contextlib
import http
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from tracehound.tracing.errors import (
    PermanentStoreError,
    StoreConfigError,
    StoreError,
    TemporaryStoreError,
)
from tracehound.tracing.store import calls
from tracehound.tracing.store.ingest import IngestServer, is_loopback
from tracehound.tracing.store.port import TraceStore
from tracehound.tracing.store.urls import embedded_path

logger = logging.getLogger(__name__)

ENDPOINT_FILE = "tracehound-endpoint.json"
"""The file in a shared store's directory that says where its holder serves it."""

HOLDER_WAIT_S = 3.0
"""How long `open_embedded` waits for a process that holds a directory without sharing it yet
(a holder starting up, a short command reading the store) before it gives up."""

POLL_S = 0.05
"""Between two looks at the lock and the endpoint file while waiting."""


class Endpoint(msgspec.Struct, frozen=True, kw_only=True):
    """Where the holder of a directory serves its store (the endpoint file's content)."""

    version: int
    """The call protocol (`calls.PROTOCOL_VERSION`)."""
    url: str
    """`http://127.0.0.1:PORT` of the holder's endpoint."""
    token: str
    """What every request carries (`Authorization: Bearer ...`)."""
    pid: int
    """The holder's process id."""
    store: str
    """The directory it holds."""
    started_us: int


def endpoint_path(directory: str) -> Path:
    return Path(directory) / ENDPOINT_FILE


def write_endpoint(directory: str, endpoint: Endpoint) -> Path:
    """Publish `endpoint` in `directory`: written to a temporary file of mode 0600, synced, and
    renamed over the endpoint file (a reader sees the old file or the new, never a part)."""
    final = endpoint_path(directory)
    temporary = final.with_name(f".{ENDPOINT_FILE}.{os.getpid()}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o600)  # whatever the umask
            out.write(msgspec.json.encode(endpoint))
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, final)
    except OSError as exc:
        raise StoreConfigError(f"embedded store {directory}: cannot write its endpoint file "
                               f"{final}: {exc}") from exc
    return final


def read_endpoint(directory: str) -> Endpoint | None:
    """The endpoint published in `directory`, None when there is no file or it cannot be read
    as one (logged: it is then not trusted). StoreConfigError naming the file when it is not a
    regular file of this user with mode 0600."""
    where = endpoint_path(directory)
    try:
        info = os.lstat(where)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreConfigError(f"endpoint file {where} cannot be read: {exc}") from exc
    if not stat.S_ISREG(info.st_mode):
        raise StoreConfigError(f"endpoint file {where} is not a regular file: not trusted; "
                               "remove it")
    if info.st_uid != os.getuid():
        raise StoreConfigError(f"endpoint file {where} belongs to user id {info.st_uid}, not to "
                               f"this process's ({os.getuid()}): not trusted; remove it")
    if info.st_mode & 0o077:
        raise StoreConfigError(f"endpoint file {where} has mode {stat.S_IMODE(info.st_mode):04o}:"
                               " expected 0600 (only its user may read the token); not trusted; "
                               "remove it")
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as source:
            data = source.read()
    except FileNotFoundError:
        return None  # its holder removed it meanwhile
    except OSError as exc:
        raise StoreConfigError(f"endpoint file {where} cannot be read: {exc}") from exc
    try:
        return msgspec.json.decode(data, type=Endpoint)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        logger.warning("endpoint file %s is not one (%s): not trusted", where, exc)
        return None


def remove_endpoint(directory: str, endpoint: Endpoint) -> None:
    """Remove the endpoint file if it is still `endpoint`'s (never a newer holder's)."""
    try:
        if read_endpoint(directory) != endpoint:
            return
    except StoreConfigError:
        return  # not ours: someone changed it
    with contextlib.suppress(FileNotFoundError):
        endpoint_path(directory).unlink()


def discard_stale_endpoint(directory: str) -> None:
    """Remove an endpoint file left in `directory` by a holder that is gone, when this process
    has just opened the directory itself (so no other process can be serving it); a file of
    this process (which shares the directory already) stays."""
    where = endpoint_path(directory)
    try:
        endpoint = read_endpoint(directory)
    except StoreConfigError as exc:
        logger.warning("removing %s: %s", where, exc)
        endpoint = None
    else:
        if endpoint is not None and endpoint.pid == os.getpid():
            return
        if endpoint is None and not os.path.lexists(where):
            return
        logger.info("removing the stale endpoint file %s%s, which no longer holds the store",
                    where, f" of pid {endpoint.pid}" if endpoint else "")
    with contextlib.suppress(FileNotFoundError):
        where.unlink()


def _device_and_inode(path: str) -> str | None:
    try:
        info = os.stat(os.path.join(path, "status"))
    except OSError:
        return None
    return f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"


def holder_pid(path: str, *, locks: str = "/proc/locks") -> int | None:
    """The process holding the ClickHouse lock of the directory `path` (0 when it cannot be
    told which), None when no other process holds it (free, or held by this one)."""
    wanted = _device_and_inode(path)
    if wanted is None:
        return None  # no status file: nobody ever opened it, or it is not a store yet
    try:
        with open(locks) as table:
            lines = table.read().splitlines()
    except OSError:
        from tracehound.tracing.store.embedded import lock_holder

        held = lock_holder(path)  # takes the lock for a moment: only where /proc/locks is not
        if held is None:
            return None
        return int(held[4:]) if held.startswith("pid ") and held[4:].isdigit() else 0
    for line in lines:
        # "1: FLOCK  ADVISORY  WRITE 24351 fe:00:2147239 0 EOF" (waiters have "->" after "1:")
        fields = line.split()
        if (len(fields) >= 6 and fields[1] == "FLOCK" and fields[5].lower() == wanted
                and fields[4].isdigit()):
            pid = int(fields[4])
            return None if pid == os.getpid() else pid
    return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie, dead but not yet reaped by
    its parent, has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            # "pid (comm) state ...": comm may hold spaces and parentheses
            state = stat_file.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


# --- the holder's side -------------------------------------------------------------------------


class CallServer:
    """Runs the port's calls on one store for its endpoint (an `ingest.StoreCalls`)."""

    def __init__(self, store: TraceStore, directory: str) -> None:
        self.store = store
        self.directory = directory
        self.closing = threading.Event()
        """Set when the holder stops sharing: later calls are told to come back (503)."""

    def __call__(self, method: str, body: bytes) -> tuple[int, bytes, dict[str, str]]:
        if method == calls.HELLO:
            hello = calls.Hello(version=calls.PROTOCOL_VERSION, store=self.directory,
                                pid=os.getpid())
            return http.HTTPStatus.OK, msgspec.msgpack.encode(hello), {}
        if self.closing.is_set():
            return self._closing()
        try:
            found = calls.call(method)
        except TypeError as exc:
            return http.HTTPStatus.NOT_FOUND, calls.encode_error(exc), {}
        try:
            args = calls.decode(body, found.args)
        except TypeError as exc:
            return (http.HTTPStatus.BAD_REQUEST,
                    calls.encode_error(TypeError(f"{method}: arguments {exc}")), {})
        try:
            result = getattr(self.store, method)(**msgspec.structs.asdict(args))
            return http.HTTPStatus.OK, calls.encode(result), {}
        except TemporaryStoreError as exc:
            return (http.HTTPStatus.SERVICE_UNAVAILABLE, calls.encode_error(exc),
                    {"Retry-After": str(max(1, round(exc.retry_after)))})
        except StoreError as exc:
            if self.closing.is_set():  # the store was closed under the call
                return self._closing()
            return http.HTTPStatus.INTERNAL_SERVER_ERROR, calls.encode_error(exc), {}
        except (ValueError, TypeError) as exc:
            return http.HTTPStatus.BAD_REQUEST, calls.encode_error(exc), {}
        except Exception as exc:
            logger.exception("shared store %s: %s failed", self.directory, method)
            failure = PermanentStoreError(f"{method} failed in the holder: "
                                          f"{type(exc).__name__}: {exc}")
            return http.HTTPStatus.INTERNAL_SERVER_ERROR, calls.encode_error(failure), {}

    def _closing(self) -> tuple[int, bytes, dict[str, str]]:
        gone = TemporaryStoreError(f"the holder (pid {os.getpid()}) is closing the store: open "
                                   "it again", retry_after=1.0)
        return http.HTTPStatus.SERVICE_UNAVAILABLE, calls.encode_error(gone), {"Retry-After": "1"}


def _held_directory(store: TraceStore) -> str | None:
    """The directory of `store` when it is an embedded store this process holds."""
    from tracehound.tracing.store.embedded import EmbeddedClickHouseStore

    return store.path if isinstance(store, EmbeddedClickHouseStore) else None


@contextlib.contextmanager
def sharing(store: TraceStore, server: IngestServer) -> Iterator[Endpoint | None]:
    """While the block runs, the running `server` serves `store`'s calls to the other processes
    of this machine and the endpoint file of its directory says so, when `store` is an embedded
    store this process holds. Yields the endpoint, or None when there is nothing to share (a
    server store, or a client of another holder). StoreConfigError when `server` has no token
    or listens beyond loopback."""
    directory = _held_directory(store)
    if directory is None:
        yield None
        return
    if not server.token:
        raise StoreConfigError(f"embedded store {directory}: its endpoint has no token; a store "
                               "is shared only with the callers that read the token from the "
                               "endpoint file")
    if not is_loopback(server.host):
        raise StoreConfigError(f"embedded store {directory}: its endpoint listens on "
                               f"{server.host!r}; a store is shared on loopback only")
    handler = CallServer(store, directory)
    endpoint = Endpoint(version=calls.PROTOCOL_VERSION, url=server.url, token=server.token,
                        pid=os.getpid(), store=directory, started_us=time.time_ns() // 1000)
    server.calls = handler
    try:
        write_endpoint(directory, endpoint)
        logger.info("sharing embedded store %s with this machine's processes at %s",
                    directory, endpoint.url)
        yield endpoint
    finally:
        handler.closing.set()
        remove_endpoint(directory, endpoint)


class Sharing:
    """An endpoint of its own that shares `store` (for a process that has no ingest endpoint,
    such as the dashboard): `start()`, then `stop()` before the store is closed."""

    def __init__(self, store: TraceStore, *, token: str | None = None) -> None:
        self._server = IngestServer(store, token=token or secrets.token_urlsafe(24))
        self._store = store
        self._stack = contextlib.ExitStack()

    def start(self) -> Endpoint | None:
        """Share the store; None (and nothing started) when it is no embedded store this
        process holds."""
        if _held_directory(self._store) is None:
            return None
        self._server.start()
        self._stack.callback(self._server.stop)
        endpoint: Endpoint | None = self._stack.enter_context(sharing(self._store, self._server))
        return endpoint

    def stop(self) -> None:
        self._stack.close()


# --- the other processes' side -----------------------------------------------------------------


def open_embedded(url: str, *, read_only: bool = False, wait_s: float = HOLDER_WAIT_S,
                  clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> TraceStore:
    """The embedded store of `url`: opened here when no other process holds its directory, else
    a client of the process that does (see the module docstring; `read_only`: a client that
    refuses every write, while a directory opened here can be written). StoreConfigError when
    another process holds it and shares it with nobody, or its endpoint refuses the token;
    TemporaryStoreError when the holder does not answer."""
    from tracehound.tracing.store.client import HolderRefused, SharedStoreClient
    from tracehound.tracing.store.embedded import EmbeddedClickHouseStore

    path = embedded_path(url)
    deadline = clock() + wait_s
    while True:
        held_by = holder_pid(path)
        endpoint = None
        refused: HolderRefused | None = None
        if held_by is None:
            try:
                store = EmbeddedClickHouseStore(url)
            except StoreConfigError:
                if holder_pid(path) is None or clock() >= deadline:
                    raise  # not taken by another process meanwhile: a failure of its own
            else:
                discard_stale_endpoint(path)
                return store
        else:
            endpoint = read_endpoint(path)
            if endpoint is not None and endpoint.pid == held_by:
                try:
                    return SharedStoreClient.connect(url, endpoint, read_only=read_only)
                except HolderRefused as exc:  # stopping to share it, about to let go?
                    refused = exc
        if clock() >= deadline:
            if refused is not None:
                raise refused
            raise StoreConfigError(_not_shared(path, held_by, endpoint, wait_s))
        sleep(POLL_S)


def _not_shared(path: str, pid: int | None, endpoint: Endpoint | None, waited_s: float) -> str:
    holder = f"pid {pid}" if pid else "another process"
    if endpoint is None:
        why = f"it shares it with no process (no {ENDPOINT_FILE})"
    else:
        state = "is gone" if not pid_alive(endpoint.pid) else "does not hold it"
        why = f"its {ENDPOINT_FILE} names pid {endpoint.pid}, which {state}: stale, not trusted"
    return (f"embedded store {path} is held by another process ({holder}) and {why}; waited "
            f"{waited_s:g} s. Only one process may open a chdb directory: try again when "
            "it ends, or use a ClickHouse server (clickhouse://...)")
