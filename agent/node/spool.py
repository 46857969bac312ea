"""The node agent's durable spool and the shipper that empties it into the trace store.

Records received from ranks are appended (as their validated wire JSON, one per line, exactly as
the rank sent it) to an open segment file; a segment is sealed (fsync, rename `.open` -> `.seg`,
fsync of the directory) every `seal_interval_s` (1 s), every N records, or `urgent_interval_s`
(0.2 s) after something urgent was appended (the node agent says what is: a rank that exited, a
failed or long-pending collective, a stack, a health event). One batch a second is what a
ClickHouse table wants from each writer (every insert is a new part, ~10 ms of the store's CPU
whatever its size); what a detector waits for still reaches it within ~0.2 s.

The shipper sends sealed segments in order, one batch per segment, with a batch id that is stable
across retries and restarts: `<node>/<spool-id>/<segment>`, where the spool id is created once and
kept in the spool directory. Before a segment is sent an in-flight marker is written; a segment is
deleted only after the sink accepted it. A segment that might already have landed (an earlier try
failed, or its in-flight marker was found at startup) is sent with `maybe_duplicate=True`, so the
store keeps it exactly once.

A store outage must lose nothing: the shipper retries with backoff (`tracing.retry`: 0.2 s,
doubling, at most 10 s, longer if the sink says `retry_after`) while the spool keeps growing on
disk. A batch the sink refuses for good is moved to `rejected/` (kept for a human, not retried).
Nothing here may raise out of the shipper thread.

A spool that cannot be written (its disk is full: ENOSPC, or any other OSError) drops what is
appended and counts it (`SpoolStats.spool_dropped`, `spool_write_errors`, `spool_error`); the
first failure of an episode is logged once, at ERROR, with the path and the errno, and its end
once more, with the count dropped meanwhile. The episode ends when appends have gone through
for `recover_after_s` (1 s) without a failure: a disk on the edge of full takes a short line
now and then while it refuses longer ones, and that is still one episode. A write cut short is
truncated back, so a record is either in the segment whole or counted as dropped, never both.
Nothing is held in memory for later: what the disk refused is gone, and counted.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from tracehound.tracing.errors import PermanentStoreError, StoreError, TemporaryStoreError
from tracehound.tracing.events import ClockReading
from tracehound.tracing.ids import JobId, NodeId
from tracehound.tracing.retry import Backoff, BackoffState
from tracehound.tracing.store import TraceStore
from tracehound.tracing.wire import DecodedBatch, batch_of_lines, decode_batch, encode_line

log = logging.getLogger(__name__)

SPOOL_ID_FILE = "spool-id"
_OPEN, _SEALED, _INFLIGHT = ".open", ".seg", ".inflight"
REJECTED_DIR = "rejected"
"""Where segments a sink refused for good go, inside a spool directory."""


class SpooledBatch:
    """A sealed segment as a batch: its id and its lines, still the JSON the ranks sent. The
    lines were validated when the node agent received them; they travel as they are and are
    decoded once, where they are stored (`records`, or by the ingest endpoint)."""

    def __init__(self, batch_id: str, lines: tuple[bytes, ...]) -> None:
        self.batch_id = batch_id
        self.lines = lines
        self._decoded: DecodedBatch | None = None

    def body(self) -> bytes:
        """The batch's wire JSON (`tracing.wire` batch form)."""
        return batch_of_lines(self.batch_id, self.lines)

    def decoded(self) -> DecodedBatch:
        if self._decoded is None:
            self._decoded = decode_batch(self.body())
        return self._decoded

    @property
    def records(self) -> tuple[Any, ...]:
        return self.decoded().batch.records


class BatchSink(Protocol):
    """Where sealed segments go. Raises TemporaryStoreError (retry) or PermanentStoreError;
    may return how many records the receiver could not read (counted as corrupt lines)."""

    def send(self, batch: SpooledBatch, *, maybe_duplicate: bool) -> int | None: ...


class StoreSink:
    """Writes batches straight into a trace store (e.g. a ClickHouse server)."""

    def __init__(
        self, store: TraceStore | None = None, *, factory: Callable[[], TraceStore] | None = None
    ) -> None:
        """Give the store, or a factory that opens it on first use (and again after a failure)."""
        if store is None and factory is None:
            raise ValueError("StoreSink needs a store or a factory")
        self._store = store
        self._factory = factory

    def _open(self) -> TraceStore:
        if self._store is None and self._factory is not None:
            self._store = self._factory()  # raises TemporaryStoreError while the server is down
        if self._store is None:
            raise TemporaryStoreError("no store")
        return self._store

    def send(self, batch: SpooledBatch, *, maybe_duplicate: bool) -> int:
        decoded = batch.decoded()
        if decoded.rejected:
            log.warning("batch %s: %d unreadable records not stored (first: %s)",
                        batch.batch_id, len(decoded.rejected), decoded.rejected[0].reason)
        self._open().insert(decoded.batch, maybe_duplicate=maybe_duplicate)
        return len(decoded.rejected)

    def close(self) -> None:
        if self._store is not None:
            self._store.close()


class HttpSink:
    """Posts batches to the ingest endpoint of the process that owns an embedded store. Every
    answer carries the endpoint's clock: `on_clock` (when set) is told each exchange, so the
    node agent can record how far its clock is from the collector's."""

    def __init__(self, url: str, *, timeout: float = 5.0,
                 on_clock: Callable[[Any], None] | None = None) -> None:
        self.url = url
        self.timeout = timeout
        self.on_clock = on_clock

    def send(self, batch: SpooledBatch, *, maybe_duplicate: bool) -> int:
        from tracehound.tracing.store.ingest import post_body

        result: Any = post_body(
            self.url, batch.body(), batch.batch_id, maybe_duplicate=maybe_duplicate,
            timeout=self.timeout,
        )
        exchange = getattr(result, "clock", None)
        if exchange is not None and self.on_clock is not None:
            self.on_clock(exchange)
        rejected = getattr(result, "rejected", ())
        if rejected:
            log.warning("batch %s: the store rejected %d records (first: %s)",
                        batch.batch_id, len(rejected), rejected[0])
        return len(rejected)


class ClockTracker:
    """Turns the clock exchanges of shipments into `ClockReading` records: the first one at
    once (when the agent connects), then the best (shortest round trip) of each period of
    `every_s` seconds. Appends them through `emit` (the agent's own spool)."""

    def __init__(self, *, job: str, node: str, emit: Callable[[list[bytes]], object],
                 every_s: float = 30.0, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.job, self.node, self.emit = job, node, emit
        self.every_s = every_s
        self.monotonic = monotonic
        self._best: Any = None
        self._since: float | None = None
        self._lock = threading.Lock()
        self.readings = 0

    def __call__(self, exchange: Any) -> None:
        with self._lock:
            now = self.monotonic()
            if self._best is None or exchange.delay_us < self._best.delay_us:
                self._best = exchange
            if self._since is not None and now - self._since < self.every_s:
                return
            best, self._best, self._since = self._best, None, now
            self.readings += 1
        reading = ClockReading(
            job=JobId(self.job), node=NodeId(self.node),
            time_us=(best.sent_us + best.answered_us) // 2, offset_us=best.offset_us,
            delay_us=best.delay_us,
        )
        self.emit([encode_line(reading)])


@dataclass
class SpoolStats:
    received: int = 0
    """Valid records received from ranks."""
    rejected: int = 0
    """Lines from ranks that were not valid records."""
    spooled: int = 0
    """Records written to segment files."""
    shipped: int = 0
    """Records in batches the sink accepted."""
    shipped_batches: int = 0
    retries: int = 0
    """Failed tries to ship a batch (each retried later)."""
    refused_batches: int = 0
    """Batches the sink refused for good (moved to rejected/)."""
    corrupt_lines: int = 0
    """Lines of sealed segments that could not be read back (a torn write before a crash) or
    that the receiver could not decode."""
    pending_segments: int = 0
    spool_dropped: int = 0
    """Records that could not be written to the spool (its disk full, or another write error):
    not stored, only counted."""
    spool_write_errors: int = 0
    """Appends that failed (each dropped its records)."""
    spool_error: str = ""
    """The latest write failure, with its path and errno (empty while none happened)."""


class _CutShort(OSError):
    """A write failed midway and could not be cut back: `whole_lines` of it are in the
    segment."""

    def __init__(self, cause: OSError, whole_lines: int) -> None:
        super().__init__(cause.errno, cause.strerror, cause.filename)
        self.whole_lines = whole_lines


def _private(path: str, flags: int) -> int:
    """`open`'s opener for the spool's files: created readable by the agent's user only."""
    return os.open(path, flags, 0o600)


class Spool:
    """Segment files in one directory (0700, its files 0600); safe to append from several
    threads."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        node: str,
        seal_records: int = 5000,
        seal_interval_s: float = 1.0,
        urgent_interval_s: float = 0.2,
        monotonic: Callable[[], float] = time.monotonic,
        recover_after_s: float = 1.0,
    ) -> None:
        """`recover_after_s`: how long appends must go through after a failed one before the
        spool counts as writable again (see the module docstring)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)  # the job's records, names and stacks: the agent's only
        self.node = node
        self.seal_records = seal_records
        self.seal_interval_s = seal_interval_s
        self.urgent_interval_s = min(urgent_interval_s, seal_interval_s)
        self.monotonic = monotonic
        self.stats = SpoolStats()
        self.spool_id = self._spool_id()
        self._lock = threading.Lock()
        self._open_fd: int | None = None
        self._open_number = 0
        self._open_count = 0
        self._open_size = 0
        self._open_since = 0.0
        self._open_urgent = False
        """The open segment holds an urgent line: it is sealed `urgent_interval_s` after it was
        opened."""
        self.recover_after_s = recover_after_s
        self._failing_since_dropped: int | None = None
        """`stats.spool_dropped` when the current episode of write failures began; None while the
        spool can be written."""
        self._ok_since: float | None = None
        """During an episode: when appends began to go through again (None: the last failed)."""
        numbers = [self._number(p) for p in self.directory.iterdir()]
        self._next = max((n for n in numbers if n is not None), default=0) + 1
        for path in sorted(self.directory.glob(f"seg-*{_OPEN}")):
            number = self._number(path)
            if number is not None:
                os.replace(path, self.path(number, _SEALED))
                log.info("sealed segment %d left open by an earlier agent", number)
        self._fsync_dir()
        self.stats.pending_segments = len(self.sealed())

    # -- names ----------------------------------------------------------------------------------

    def _spool_id(self) -> str:
        path = self.directory / SPOOL_ID_FILE
        try:
            text = path.read_text().strip()
            if text:
                return text
        except FileNotFoundError:
            pass
        value = uuid.uuid4().hex
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", opener=_private) as handle:
            handle.write(value + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        self._fsync_dir()
        return value

    @staticmethod
    def _number(path: Path) -> int | None:
        name = path.name
        if not name.startswith("seg-"):
            return None
        stem, _, rest = name[4:].partition(".")
        if not (stem.isascii() and stem.isdigit()) or f".{rest}" not in (_OPEN, _SEALED,
                                                                          _INFLIGHT):
            return None
        # only the names `path` gives: another file (seg-1.seg, seg-٣.seg, seg-0000000001.x.seg)
        # would be listed as a segment that `read` cannot open, retried for ever
        return int(stem) if f"{int(stem):010d}" == stem else None

    def path(self, number: int, suffix: str) -> Path:
        return self.directory / f"seg-{number:010d}{suffix}"

    def batch_id(self, number: int) -> str:
        return f"{self.node}/{self.spool_id}/{number}"

    def _fsync_dir(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- writing --------------------------------------------------------------------------------

    def append(self, lines: list[bytes], *, urgent: bool = False) -> bool:
        """Append validated wire lines (without newlines) to the open segment; `urgent`: they
        should reach the store soon (the segment is sealed `urgent_interval_s` after it was
        opened, not `seal_interval_s`). Never raises: when the spool cannot be written they are
        dropped and counted (see the module docstring); False then."""
        if not lines:
            return True
        data = b"\n".join(lines) + b"\n"
        with self._lock:
            try:
                fd = self._open_fd
                if fd is None:
                    number = self._next
                    fd = os.open(self.path(number, _OPEN), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                 0o600)
                    self._next += 1
                    self._open_fd, self._open_number = fd, number
                    self._open_count = self._open_size = 0
                    self._open_since = self.monotonic()
                    self._open_urgent = False
                self._write_all(fd, data)
            except OSError as exc:
                whole = exc.whole_lines if isinstance(exc, _CutShort) else 0
                self._write_failed(exc, len(lines) - whole)
                return False
            # a crash of the agent loses nothing (the kernel has the bytes); fsync waits for the
            # seal
            self._open_count += len(lines)
            self._open_size += len(data)
            self._open_urgent = self._open_urgent or urgent
            self.stats.spooled += len(lines)
            if self._failing_since_dropped is not None:
                self._recovering()
            if self._open_count >= self.seal_records:
                self._seal_locked()
            return True

    def _write_all(self, fd: int, data: bytes) -> None:
        """Write `data` at the end of the open segment, whole or not at all: a write cut short
        (the disk filled up midway) is truncated back before the error is raised. If even that
        fails, the lines written whole count as spooled (the error's `whole_lines`) and the
        segment is sealed as it is (its torn last line is skipped when it is read)."""
        view = memoryview(data)
        done = 0
        try:
            while done < len(data):
                done += os.write(fd, view[done:])
        except OSError:
            if done:
                try:
                    os.ftruncate(fd, self._open_size)
                except OSError as exc:
                    whole = data.count(b"\n", 0, done)
                    self.stats.spooled += whole
                    self._open_count += whole
                    self._open_size += done
                    log.error("could not cut a partial write back in %s: %r; sealing it as it is",
                              self.path(self._open_number, _OPEN), exc)
                    self._seal_locked()
                    raise _CutShort(exc, whole) from exc
            raise
        finally:
            view.release()

    def _recovering(self) -> None:
        """An append went through during an episode of failures: end it once they have gone
        through for `recover_after_s`."""
        now = self.monotonic()
        if self._ok_since is None:
            self._ok_since = now
        if self._failing_since_dropped is not None and now - self._ok_since >= self.recover_after_s:
            log.warning("the spool at %s is writable again; %d records were dropped while it was "
                        "not", self.directory,
                        self.stats.spool_dropped - self._failing_since_dropped)
            self._failing_since_dropped = self._ok_since = None

    def _write_failed(self, exc: OSError, count: int) -> None:
        """Count `count` records dropped by a failed append; log the first of an episode."""
        self._ok_since = None
        self.stats.spool_dropped += count
        self.stats.spool_write_errors += 1
        name = errno.errorcode.get(exc.errno or 0, "?")
        path = exc.filename or self.path(self._open_number, _OPEN)
        self.stats.spool_error = f"{path}: [Errno {exc.errno}] {name} {exc.strerror}"
        if self._failing_since_dropped is None:
            self._failing_since_dropped = self.stats.spool_dropped - count
            log.error("cannot write the spool at %s: [Errno %s] %s (%s); records are dropped and "
                      "counted (stats: spool_dropped, spool_write_errors) until it can be written "
                      "again", path, exc.errno, exc.strerror, name)

    def maybe_seal(self, *, force: bool = False) -> bool:
        """Seal the open segment if it is old enough (`urgent_interval_s` when it holds an urgent
        line, else `seal_interval_s`), or `force`; True if one was sealed."""
        with self._lock:
            if self._open_fd is None:
                return False
            after = self.urgent_interval_s if self._open_urgent else self.seal_interval_s
            if force or self.monotonic() - self._open_since >= after:
                return self._seal_locked()
            return False

    def _seal_locked(self) -> bool:
        """Close the open segment and seal it; an empty one (every append to it failed) is
        removed instead. True if a segment was sealed."""
        fd, self._open_fd = self._open_fd, None
        if fd is None:
            return False
        open_path = self.path(self._open_number, _OPEN)
        try:
            if self._open_size == 0:
                os.close(fd)
                open_path.unlink(missing_ok=True)
                return False
            try:
                os.fsync(fd)
            except OSError as exc:
                log.warning("could not fsync %s: %r; sealing it anyway", open_path, exc)
            os.close(fd)
            os.replace(open_path, self.path(self._open_number, _SEALED))
            self._fsync_dir()
        except OSError as exc:
            # still `.open`: the next agent started on this directory seals and ships it
            log.error("could not seal %s: %r", open_path, exc)
            return False
        self.stats.pending_segments += 1
        return True

    def close(self) -> None:
        self.maybe_seal(force=True)

    # -- reading --------------------------------------------------------------------------------

    def sealed(self) -> list[int]:
        numbers = (self._number(p) for p in self.directory.glob(f"seg-*{_SEALED}"))
        return sorted(n for n in numbers if n is not None)

    def read(self, number: int) -> SpooledBatch:
        """The batch a sealed segment holds, its lines undecoded. A line that is not whole JSON
        (a write torn by a crash) is counted and skipped: checking that costs a scan, not a
        decode."""
        lines: list[bytes] = []
        with open(self.path(number, _SEALED), "rb") as handle:
            for raw in handle:
                line = raw.strip()
                if not line:
                    continue
                try:
                    msgspec.json.decode(line, type=msgspec.Raw)
                except (msgspec.DecodeError, RecursionError) as exc:
                    # RecursionError: JSON nested deeper than any record (garbage, not a record)
                    self.stats.corrupt_lines += 1
                    log.warning("segment %d: unreadable line skipped: %s", number, exc)
                    continue
                lines.append(line)
        return SpooledBatch(self.batch_id(number), tuple(lines))

    def in_flight(self, number: int) -> bool:
        return self.path(number, _INFLIGHT).exists()

    def mark_in_flight(self, number: int) -> None:
        with open(self.path(number, _INFLIGHT), "wb", opener=_private) as handle:
            handle.flush()
            os.fsync(handle.fileno())
        self._fsync_dir()

    def remove(self, number: int) -> None:
        """The sink has the segment: forget it (segment first, then its marker)."""
        self.path(number, _SEALED).unlink(missing_ok=True)
        self.path(number, _INFLIGHT).unlink(missing_ok=True)
        self.stats.pending_segments = max(0, self.stats.pending_segments - 1)

    def set_aside(self, number: int) -> Path:
        """Move a segment the sink refused for good to `rejected/`."""
        target_dir = self.directory / REJECTED_DIR
        target_dir.mkdir(mode=0o700, exist_ok=True)
        target = target_dir / self.path(number, _SEALED).name
        os.replace(self.path(number, _SEALED), target)
        self.path(number, _INFLIGHT).unlink(missing_ok=True)
        self.stats.pending_segments = max(0, self.stats.pending_segments - 1)
        return target


class ShipResult(enum.Enum):
    IDLE = "idle"
    SHIPPED = "shipped"
    RETRY = "retry"
    REFUSED = "refused"


class Shipper:
    """Sends sealed segments in order; one segment at a time, retried until the sink has it."""

    def __init__(
        self,
        spool: Spool,
        sink: BatchSink,
        *,
        min_backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
    ) -> None:
        self.spool = spool
        self.sink = sink
        self._backoff = BackoffState(Backoff(initial_s=min_backoff_s, maximum_s=max_backoff_s))
        self.backoff_s = 0.0
        """How long to wait before the next try (0 after a success)."""
        self._tried: set[int] = set()
        """Segments with a failed try in this process: they may already have landed."""
        self._lock = threading.Lock()

    @property
    def min_backoff_s(self) -> float:
        """Wait after the first failed try (the retry policy's `initial_s`)."""
        return self._backoff.policy.initial_s

    @min_backoff_s.setter
    def min_backoff_s(self, value: float) -> None:
        self._backoff.policy = dataclasses.replace(self._backoff.policy, initial_s=value)

    @property
    def max_backoff_s(self) -> float:
        """Longest wait between tries (the retry policy's `maximum_s`)."""
        return self._backoff.policy.maximum_s

    @max_backoff_s.setter
    def max_backoff_s(self, value: float) -> None:
        self._backoff.policy = dataclasses.replace(self._backoff.policy, maximum_s=value)

    def _failed(self, exc: BaseException) -> None:
        """Count a failed try; `backoff_s` becomes the wait before the next one."""
        self.backoff_s = self._backoff.failed(exc)

    def _succeeded(self) -> None:
        self._backoff.succeeded()
        self.backoff_s = 0.0

    def ship_once(self) -> ShipResult:
        """Try to ship the oldest sealed segment (one caller at a time)."""
        with self._lock:
            return self._ship_once()

    def _ship_once(self) -> ShipResult:
        spool = self.spool
        numbers = spool.sealed()
        if not numbers:
            return ShipResult.IDLE
        number = numbers[0]
        maybe_duplicate = number in self._tried or spool.in_flight(number)
        try:
            batch = spool.read(number)
            if not maybe_duplicate:
                spool.mark_in_flight(number)
            if batch.lines:
                unreadable = self.sink.send(batch, maybe_duplicate=maybe_duplicate)
                spool.stats.corrupt_lines += unreadable or 0
        except PermanentStoreError as exc:
            target = spool.set_aside(number)
            spool.stats.refused_batches += 1
            self._tried.discard(number)
            log.error("batch %s refused for good, kept in %s: %s",
                      spool.batch_id(number), target, exc)
            return ShipResult.REFUSED
        except (TemporaryStoreError, StoreError, OSError, Exception) as exc:
            self._tried.add(number)
            spool.stats.retries += 1
            self._failed(exc)
            log.warning("batch %s not shipped (%d pending segments), retrying in %.1fs: %s",
                        spool.batch_id(number), spool.stats.pending_segments, self.backoff_s, exc)
            return ShipResult.RETRY
        spool.remove(number)
        self._tried.discard(number)
        self._succeeded()
        spool.stats.shipped += len(batch.lines)
        spool.stats.shipped_batches += 1
        return ShipResult.SHIPPED

    def run(self, stop: threading.Event) -> None:
        """Seal and ship until `stop` is set; never raises."""
        while not stop.is_set():
            try:
                self.spool.maybe_seal()
                result = self.ship_once()
            except Exception as exc:
                log.exception("shipper error: %r", exc)
                result = ShipResult.RETRY
                self._failed(exc)
            if result is ShipResult.RETRY:
                stop.wait(self.backoff_s)
            elif result is ShipResult.IDLE:
                stop.wait(self.spool.urgent_interval_s / 2)

    def drain(self, deadline_s: float, monotonic: Callable[[], float] = time.monotonic) -> bool:
        """Seal what is open and ship until the spool is empty or `deadline_s` seconds passed;
        True if nothing is left."""
        end = monotonic() + deadline_s
        try:
            self.spool.maybe_seal(force=True)
        except Exception as exc:
            log.exception("could not seal the open segment: %r", exc)
        while monotonic() < end:
            result = self.ship_once()
            if result is ShipResult.IDLE:
                return True
            if result is ShipResult.RETRY:
                time.sleep(max(0.0, min(self.backoff_s, end - monotonic())))
        return not self.spool.sealed()


def waiting_segments(root: Path) -> int:
    """Segments under `root` (a spool directory, or a directory of node spools) that an agent
    has sealed or is shipping and has not shipped yet; those a sink refused for good
    (`rejected/`) are not counted."""
    return sum(1 for suffix in (_SEALED, _INFLIGHT) for path in root.rglob(f"seg-*{suffix}")
               if path.parent.name != REJECTED_DIR)

