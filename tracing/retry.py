"""One retry policy for every retry loop: how long to wait after each failure of a call that may
succeed later.

What is retried: only errors the caller names as temporary, by default `TemporaryStoreError` (the
store is unreachable or busy). What is not: everything else, `PermanentStoreError` and
`StoreConfigError` included; those propagate at once, since the same request fails again.

The delays: the first failure waits `initial_s`, each further failure `multiplier` times the
previous wait, never more than `maximum_s`. An error's `retry_after` (a server's "come back in
N s") raises the wait to at least that, still capped at `maximum_s` so that a loop stays
responsive. `jitter` shortens each wait by up to that fraction, at random, so that many clients
retrying the same server spread out; it never shortens a wait below the error's `retry_after`.
A success starts the sequence afresh. The defaults (0.2 s, doubling, at most 10 s, no jitter)
are the node agent's shipper's; each loop chooses its own:

    shipper (node agent -> store)        0.2 s, doubling, at most 10 s   `agent.spool.Shipper`
    transport (rank -> node agent)       0.05 s, doubling, at most 1 s   `agent.transport`
    supervisor journal (controller)      0.5 s, doubling, at most 5 s    `controller.journal`

`BackoffState` is the policy's state in a loop that does its own waiting (`failed` gives the next
wait, `succeeded` resets); `call_with_retry` is the whole loop around one call. Clocks and sleeps
are injected, so tests run without waiting.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tracehound.tracing.errors import TemporaryStoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

RetryCallback = Callable[[BaseException, int, float], None]
"""Called before each wait with the error, how many tries failed so far and the wait in s."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Backoff:
    """How long to wait after successive failures (see the module docstring)."""

    initial_s: float = 0.2
    """Wait after the first failure (0 retries at once, unless the error asks for a wait)."""
    maximum_s: float = 10.0
    """No wait is longer, whatever the multiplier or the error's `retry_after` say."""
    multiplier: float = 2.0
    """Each further failure waits this many times the previous wait."""
    jitter: float = 0.0
    """Fraction (0 to 1) by which each wait may be shortened at random."""

    def __post_init__(self) -> None:
        for name in ("initial_s", "maximum_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"Backoff.{name} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise ValueError(f"Backoff.multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"Backoff.jitter must be within [0, 1], got {self.jitter}")

    def next_wait(self, previous_s: float, retry_after_s: float = 0.0) -> float:
        """The wait (before jitter) after a failure that followed a wait of `previous_s`
        (0 for the first failure)."""
        return min(self.maximum_s, max(self.initial_s, previous_s * self.multiplier,
                                       retry_after_s))


def retry_after_of(error: BaseException | None) -> float:
    """How long the error asks the caller to wait (its `retry_after`), 0 if it does not say."""
    value = getattr(error, "retry_after", 0.0)
    if isinstance(value, int | float) and math.isfinite(value) and value > 0:
        return float(value)
    return 0.0


class BackoffState:
    """A policy's state across the tries of one loop: counts failures, gives the next wait."""

    def __init__(self, policy: Backoff, *, rng: Callable[[], float] = random.random) -> None:
        self.policy = policy
        """The policy in force; it may be replaced between tries (the next wait follows it)."""
        self.rng = rng
        self.failures = 0
        """Consecutive failures since the last success."""
        self.delay_s = 0.0
        """The last wait given, before jitter (0 after a success)."""

    def failed(self, error: BaseException | None = None) -> float:
        """Count a failure and return how long to wait before the next try."""
        self.failures += 1
        retry_after = retry_after_of(error)
        self.delay_s = self.policy.next_wait(self.delay_s, retry_after)
        shortened = self.delay_s * (1.0 - self.policy.jitter * self.rng())
        return max(shortened, min(retry_after, self.delay_s))

    def succeeded(self) -> None:
        """The call went through: the next failure starts from `initial_s` again."""
        self.failures = 0
        self.delay_s = 0.0


def log_retry(error: BaseException, failures: int, delay_s: float) -> None:
    """The default `on_retry`: one warning per failed try."""
    log.warning("try %d failed, retrying in %.1f s: %s", failures, delay_s, error)


def call_with_retry(
    fn: Callable[[], T],
    *,
    policy: Backoff | None = None,
    retry_on: tuple[type[BaseException], ...] = (TemporaryStoreError,),
    deadline_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: RetryCallback | None = log_retry,
) -> T:
    """Call `fn` until it returns, waiting as `policy` says after each error of a `retry_on`
    type; any other error propagates at once.

    With `deadline_s`, no try starts later than that many seconds (on `clock`) after the first
    one: a wait is cut short to end at the deadline, and a failure at or after it raises that
    last error."""
    state = BackoffState(policy or Backoff())
    end = None if deadline_s is None else clock() + deadline_s
    while True:
        try:
            return fn()
        except retry_on as exc:
            delay = state.failed(exc)
            if end is not None:
                left = end - clock()
                if left <= 0:
                    raise
                delay = min(delay, left)
            if on_retry is not None:
                on_retry(exc, state.failures, delay)
            sleep(delay)
