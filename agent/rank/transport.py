"""Rank -> node agent transport: a bounded queue drained by a daemon thread onto a unix socket.

The training thread only appends to a deque (`offer`); a daemon thread wakes every `poll_s`
(TRACEHOUND_SEND_S), or at once when nudged (`nudge`), and turns the items queued by then into
records, encodes them with `tracing.wire.encode_line` as newline-delimited JSON and writes them
to the node agent's socket, reconnecting with backoff (`tracing.retry`: 0.05 s, doubling, at most
`max_backoff_s`) while the agent is not (yet) there. Records stay buffered up to the bound while
disconnected; beyond it they are dropped and counted.

The node agent acknowledges what it has put in its spool: on each connection it first sends
`0\n`, then, after each read it spooled, the number of lines it has taken from that connection
(`<n>\n`, cumulative, so a skipped acknowledgement is covered by the next). Lines written and
not yet acknowledged stay here (at most `_CHUNK` of them) and are written again on the next
connection when the agent goes away, so an agent killed with lines in its socket buffer loses
none of them. Only an agent killed between spooling lines and acknowledging them (a window of
microseconds) makes the next one receive them twice. A peer that sends nothing within
`_HELLO_S` of the connection does not acknowledge: lines written to it count as sent.

Every record offered is counted once, in one place: `dropped` (refused, the buffer was full),
`pending` (queued, or encoded and not yet acknowledged), `sent` (the agent acknowledged it, or
its last byte was written to a peer that does not acknowledge) or `lost` (accepted, then could
not be encoded). A line is always written whole on one connection: a write cut short by a lost
connection is written again from the start of the first unacknowledged line (the agent rejects
the fragment it got).

It must never block or raise into the training thread: `offer` is a length check and an append
(which the recorder's hot path does itself on `direct_queue`).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import select
import socket
import threading
import time

from tracehound.agent.rank.recorder import Pending, materialize
from tracehound.tracing import wire
from tracehound.tracing.retry import Backoff, BackoffState
from tracehound.tracing.settings import DEFAULT_BUFFER_RECORDS, DEFAULT_SEND_S

log = logging.getLogger(__name__)

_CHUNK = 512
"""Items encoded and written per socket write."""
_FIRST_RECONNECT_S = 0.05
"""Wait after the first failed connection; it doubles up to `max_backoff_s`."""
_HELLO_S = 1.0
"""A peer that sent nothing this long after the connection does not acknowledge lines."""


class SocketTransport:
    """Ships queued items to the node agent listening on the unix socket at `path`."""

    def __init__(
        self,
        path: str,
        *,
        bound: int = DEFAULT_BUFFER_RECORDS,
        poll_s: float = DEFAULT_SEND_S,
        max_backoff_s: float = 1.0,
    ) -> None:
        self.path = path
        self.bound = bound
        self.poll_s = poll_s
        self.max_backoff_s = max_backoff_s
        self._queue: collections.deque[Pending] = collections.deque()
        self._unsent = bytearray()
        """Encoded lines not yet sent (written and unacknowledged, or not yet written), whole
        lines from the first one the agent has not acknowledged."""
        self._lines = 0
        """Lines in `_unsent`."""
        self._offset = 0
        """Bytes of `_unsent` written on the current connection."""
        self._acking: bool | None = None
        """Whether the current connection's peer acknowledges (None: not known yet)."""
        self._hello_by = 0.0
        self._acked = 0
        """Lines the current connection's peer has acknowledged."""
        self._replies = b""
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
        """Items the agent acknowledged (or, to a peer that does not acknowledge, whose line was
        written in full)."""
        self.connects = 0

    # -- training-thread side --------------------------------------------------------------------

    def offer(self, item: Pending) -> bool:
        if len(self._queue) >= self.bound:
            with self._drop_lock:
                self.dropped += 1
            return False
        self._queue.append(item)
        return True

    def direct_queue(self) -> tuple[collections.deque[Pending], int]:
        """(the queue, its bound) for the recorder's hot path, which appends to it itself while
        it is below the bound and calls `offer` when it is not (`recorder.RecordSink`)."""
        return self._queue, self.bound

    def nudge(self) -> None:
        """Send what is queued now rather than at the next `poll_s` tick (for a record the
        node agent should see at once: a heartbeat of a rank with a call long in flight)."""
        self._wake.set()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def pending(self) -> int:
        """Items accepted and not sent yet: queued, or encoded and not acknowledged (exact
        while the sender is not writing, e.g. while disconnected)."""
        return len(self._queue) + self._lines

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="tracehound-transport", daemon=True
                )
                self._thread.start()

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` s until everything queued was sent (acknowledged by the agent);
        True if it was."""
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
        # everything not acknowledged is written again, from its first line
        self._offset = 0
        self._acked = 0
        self._acking = None
        self._hello_by = time.monotonic() + _HELLO_S
        self._replies = b""
        return sock

    def _encode(self, count: int) -> None:
        """Encode up to `count` queued items onto the end of `_unsent`."""
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
        if lines:
            self._unsent += b"\n".join(lines) + b"\n"
            self._lines += len(lines)

    def _reconnect_policy(self) -> Backoff:
        """Waits between connection attempts while the node agent is not there."""
        return Backoff(initial_s=_FIRST_RECONNECT_S, maximum_s=self.max_backoff_s)

    def _run(self) -> None:
        backoff = BackoffState(self._reconnect_policy())
        while True:
            try:
                if self._sock is None:
                    if self._stop and not self._queue and not self._unsent:
                        return  # closed with nothing left: no new connection for nothing
                    self._sock = self._connect()
                    if self._sock is None:
                        if self._stop:
                            return
                        self._wake.wait(backoff.failed())
                        self._wake.clear()
                        continue
                    backoff.succeeded()
                sock = self._sock
                if self._offset == len(self._unsent) and self._lines < _CHUNK and self._queue:
                    self._encode(_CHUNK - self._lines)
                if self._offset < len(self._unsent):
                    self._write(sock)
                    self._read_replies(sock, 0.0)
                    continue
                if self._unsent:  # all written, not all acknowledged yet
                    self._read_replies(sock, self.poll_s)
                    continue
                self._idle.set()
                if self._stop:
                    return
                self._wake.wait(self.poll_s)
                self._wake.clear()
            except OSError as exc:
                log.debug("tracehound transport lost %s: %r", self.path, exc)
                lost, self._sock = self._sock, None
                if lost is not None:
                    with contextlib.suppress(OSError):
                        self._read_replies(lost, 0.0)  # what the agent acknowledged before
                    with contextlib.suppress(OSError):
                        lost.close()
            except Exception as exc:
                log.warning("tracehound transport error: %r", exc)
                self.lost += self._lines
                self._unsent, self._lines, self._offset = bytearray(), 0, 0
                time.sleep(0.1)

    def _write(self, sock: socket.socket) -> None:
        """Write the unwritten rest of `_unsent` (raises OSError when the connection fails).
        To a peer that does not acknowledge, the lines written in full count as sent."""
        view = memoryview(self._unsent)
        try:
            while self._offset < len(view):
                self._offset += sock.send(view[self._offset:])
        finally:
            view.release()
            if self._acking is False:
                self._forget(self._unsent.count(b"\n", 0, self._offset))

    def _read_replies(self, sock: socket.socket, wait_s: float) -> None:
        """Read what the peer sent (waiting up to `wait_s` for something) and take its
        acknowledgements. Raises OSError when the peer closed the connection."""
        if self._acking is None and time.monotonic() >= self._hello_by:
            self._acking = False
            log.debug("tracehound transport: %s does not acknowledge", self.path)
            self._forget(self._unsent.count(b"\n", 0, self._offset))
        if self._acking is None:
            wait_s = min(wait_s, max(0.0, self._hello_by - time.monotonic()))
        readable, _, _ = select.select([sock], [], [], wait_s)
        if not readable:
            return
        data = sock.recv(4096)
        if not data:
            raise ConnectionResetError(f"{self.path} closed the connection")
        if self._acking is False:
            return
        self._acking = True
        *replies, self._replies = (self._replies + data).split(b"\n")
        if replies:
            try:
                acked = int(replies[-1])
            except ValueError:
                log.warning("tracehound transport: %s sent %r, not an acknowledgement",
                            self.path, replies[-1][:100])
                return
            if acked > self._acked:
                self._forget(acked - self._acked)
                self._acked = acked

    def _forget(self, lines: int) -> None:
        """The first `lines` lines of `_unsent` are sent: drop them and count them."""
        if lines <= 0:
            return
        lines = min(lines, self._lines)
        end = 0
        for _ in range(lines):
            end = self._unsent.index(b"\n", end) + 1
        del self._unsent[:end]
        self._offset = max(0, self._offset - end)
        self._lines -= lines
        self.sent += lines
