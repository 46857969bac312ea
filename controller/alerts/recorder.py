"""Records each settled delivery in the trace store as an `alert` action of its incident,
through the controller's durable journal (stored once, retried while the store is away)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tracehound.controller.alerts.model import Settled, alert_action
from tracehound.controller.journal import STORE_RETRY, Journal
from tracehound.controller.journal import Outbox as StoreOutbox
from tracehound.tracing.errors import StoreError
from tracehound.tracing.retry import BackoffState
from tracehound.tracing.store import TraceStore

log = logging.getLogger(__name__)


# -- recording in the store -------------------------------------------------------------------

ACTIONS_JOURNAL = "actions.jsonl"
"""The recorder's journal, in the alert outbox's directory."""


class AlertRecorder:
    """Records each settled delivery in the store as an `alert` action of its incident (a
    dispatcher's `on_settled`).

    Calling it only queues (the dispatcher's thread never waits for the store); its own thread
    (`start`/`stop`, or `record_pending` in tests) journals what was queued, fsync'd, and writes
    the journal to the store the way the supervisor writes its actions (`controller.journal`):
    in order, retried while the store is away, each action once. What is left when it stops
    waits in the journal for the next recorder on the same file. A controller killed in the
    instant between a delivery and its journaling loses that record (not the delivery).

    `store` gives the store; it is called in the recorder's thread when first needed (the
    operator opens its store lazily), and called again later if it raised a StoreError."""

    def __init__(
        self,
        store: Callable[[], TraceStore],
        journal_path: Path | None,
        *,
        clock: Callable[[], float] = time.monotonic,
        idle_s: float = 0.5,
    ) -> None:
        self._open = store
        self._clock = clock
        self._idle_s = idle_s
        self._journal = Journal(journal_path)
        self._outbox: StoreOutbox | None = None
        self._open_backoff = BackoffState(STORE_RETRY)
        self._next_open = 0.0
        self._queue: queue.SimpleQueue[Settled] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, settled: Settled) -> None:
        self._queue.put(settled)
        self._wake.set()

    def pending(self) -> int:
        """Actions not yet in the store (journaled or queued); not while the thread runs."""
        return len(self._journal.pending()) + self._queue.qsize()

    def record_pending(self) -> bool:
        """Journal what was queued and write the journal to the store (unless the store's
        retry wait is not over); whether nothing is left. Raises nothing the store raises."""
        actions = []
        while True:
            try:
                actions.append(alert_action(self._queue.get_nowait()))
            except queue.Empty:
                break
        if actions:
            self._journal.append(*actions)
        outbox = self._store_outbox()
        return outbox is not None and outbox.flush()

    def _store_outbox(self) -> StoreOutbox | None:
        """The journal's way to the store, once the store opens (tries spaced as the journal's
        are while the store is away)."""
        if self._outbox is None:
            if self._clock() < self._next_open:
                return None
            try:
                store = self._open()
            except StoreError as exc:
                self._next_open = self._clock() + self._open_backoff.failed(exc)
                if self._open_backoff.failures == 1:
                    log.warning("alert records wait in journal %s until the store opens: %s",
                                self._journal.path or "(memory)", exc)
                return None
            self._outbox = StoreOutbox(self._journal, store, clock=self._clock)
        return self._outbox

    def start(self) -> None:
        """Record in a background thread until `stop`."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="tracehound-alert-records",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Stop the thread, then give the store up to `timeout` s more for what is left;
        whether nothing is (the rest waits in the journal). Stop the dispatcher first."""
        end = self._clock() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("alert records: the recorder's thread did not end; what it has not "
                            "stored waits in journal %s", self._journal.path or "(memory)")
                return False
        try:
            self.record_pending()
            if self._outbox is None:
                return not self.pending()
            return self._outbox.drain(max(0.0, end - self._clock()), time.sleep)
        except Exception:
            log.exception("alert records: could not write the last ones to the store")
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.record_pending()
            except Exception:
                log.exception("alert records: a pass failed; trying again in %.1f s",
                              self._idle_s)
            self._wake.wait(self._idle_s)
