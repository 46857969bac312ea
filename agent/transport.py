"""Rank -> node agent transport: a bounded queue drained by a daemon thread onto a unix socket.

The training thread only appends to a deque (`offer`); a daemon thread turns the items into
records, encodes them with `tracing.wire.encode_line` as newline-delimited JSON and writes them
to the node agent's socket, reconnecting with backoff (`tracing.retry`: 0.05 s, doubling, at most
`max_backoff_s`) while the agent is not (yet) there. Records stay buffered up to the bound while
disconnected; beyond it they are dropped and counted.

Every record offered is counted once, in one place: `dropped` (refused, the buffer was full),
`pending` (queued, or encoded and not yet written), `sent` (its last byte was written to the
socket) or `lost` (accepted, then could not be encoded). A write cut short by a lost connection
is resumed on the next one from the start of the line it cut (the agent rejects the fragment it
got), so nothing is sent twice and nothing is skipped. What the kernel took for an agent that
then died is counted as sent: the agent does not acknowledge records.

It must never block or raise into the training thread: `offer` is a length check and an append.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import socket
import threading
import time

from tracehound.agent.recorder import Pending, materialize
from tracehound.tracing import wire
from tracehound.tracing.retry import Backoff, BackoffState
from tracehound.tracing.settings import DEFAULT_BUFFER_RECORDS

log = logging.getLogger(__name__)

_CHUNK = 512
"""Items encoded and written per socket write."""
_FIRST_RECONNECT_S = 0.05
"""Wait after the first failed connection; it doubles up to `max_backoff_s`."""


class SocketTransport:
    """Ships queued items to the node agent listening on the unix socket at `path`."""

    def __init__(
        self,
        path: str,
        *,
        bound: int = DEFAULT_BUFFER_RECORDS,
        poll_s: float = 0.05,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.path = path
        self.bound = bound
        self.poll_s = poll_s
        self.max_backoff_s = max_backoff_s
        self._queue: collections.deque[Pending] = collections.deque()
        self._unsent: bytes = b""
        self._offset = 0
        """Bytes of `_unsent` already written."""
        self._sock: socket.socket | None = None
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._drop_lock = threading.Lock()
        self.dropped = 0
        """Items refused because the queue was full (the training and heartbeat threads both
        offer, so it is counted under a lock, on the drop path only)."""
        self.lost = 0
        """Items accepted, then lost: they could not be encoded, or an unexpected error of the
        sender thread discarded them."""
        self.sent = 0
        """Items whose line was written to the socket in full."""
        self.connects = 0

    # -- training-thread side --------------------------------------------------------------------

    def offer(self, item: Pending) -> bool:
        if len(self._queue) >= self.bound:
            with self._drop_lock:
                self.dropped += 1
            return False
        self._queue.append(item)
        return True

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def pending(self) -> int:
        """Items accepted and not sent yet: queued, or encoded and not written in full (exact
        while the sender is not writing, e.g. while disconnected)."""
        data, offset = self._unsent, self._offset
        return len(self._queue) + data.count(b"\n", offset)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tracehound-transport", daemon=True
                )
                self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s until the queue is empty and written; True if it is."""
        if self._thread is None:
            self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._queue and not self._unsent and self._idle.is_set():
                return True
            self._idle.clear()
            self._wake.set()
            self._idle.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        return not self._queue and not self._unsent

    def close(self, timeout: float = 2.0) -> None:
        self.flush(timeout)
        self._stop = True
        self._wake.set()
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    def forget_thread(self) -> None:
        """After a fork: the child has no sender thread; drop what was queued."""
        self._thread = None
        self._stop = True
        self._queue.clear()

    # -- sender thread ----------------------------------------------------------------------------

    def _connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            return None
        self.connects += 1
        if self.connects > 1:
            log.info("tracehound transport reconnected to %s", self.path)
        return sock

    def _encode(self, count: int) -> bytes:
        lines: list[bytes] = []
        for _ in range(count):
            try:
                item = self._queue.popleft()
            except IndexError:
                break
            try:
                lines.append(wire.encode_line(materialize(item)))
            except Exception as exc:
                self.lost += 1
                log.warning("tracehound transport could not encode %r: %r", item, exc)
        return b"\n".join(lines) + b"\n" if lines else b""

    def _reconnect_policy(self) -> Backoff:
        """Waits between connection attempts while the node agent is not there."""
        return Backoff(initial_s=_FIRST_RECONNECT_S, maximum_s=self.max_backoff_s)

    def _run(self) -> None:
        backoff = BackoffState(self._reconnect_policy())
        while True:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                    if self._sock is None:
                        if self._stop:
                            return
                        self._wake.wait(backoff.failed())
                        self._wake.clear()
                        continue
                    backoff.succeeded()
                if not self._unsent:
                    self._offset = 0
                    self._unsent = self._encode(_CHUNK)
                if self._unsent:
                    self._write(self._sock)
                    continue
                self._idle.set()
                if self._stop:
                    return
                self._wake.wait(self.poll_s)
                self._wake.clear()
            except OSError as exc:
                log.debug("tracehound transport lost %s: %r", self.path, exc)
                sock, self._sock = self._sock, None
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
            except Exception as exc:
                log.warning("tracehound transport error: %r", exc)
                self.lost += self._unsent.count(b"\n", self._offset)
                self._unsent, self._offset = b"", 0
                time.sleep(0.1)

    def _write(self, sock: socket.socket) -> None:
        """Write the rest of `_unsent`, counting each line once its last byte is out. When the
        connection fails, `_offset` goes back to the start of the line it cut (raises OSError)."""
        data = self._unsent
        view = memoryview(data)
        try:
            while self._offset < len(data):
                try:
                    written = sock.send(view[self._offset:])
                except OSError:
                    self._offset = data.rfind(b"\n", 0, self._offset) + 1
                    raise
                self.sent += data.count(b"\n", self._offset, self._offset + written)
                self._offset += written
        finally:
            view.release()
        self._unsent, self._offset = b"", 0
