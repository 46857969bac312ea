"""The shared retry policy: waits grow and cap, honour `retry_after`, start afresh after a success;
`call_with_retry` keeps its deadline and lets other errors through. Time is a fake clock."""

from __future__ import annotations

import pytest

from tracehound.tracing.errors import PermanentStoreError, StoreConfigError, TemporaryStoreError
from tracehound.tracing.retry import Backoff, BackoffState, call_with_retry, retry_after_of


class FakeTime:
    """A clock that moves only when slept on; remembers every sleep."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


class Flaky:
    """Raises the given errors in turn, then returns "ok"; counts calls."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def down(retry_after: float = 0.0) -> TemporaryStoreError:
    return TemporaryStoreError("store down", retry_after=retry_after)


def test_waits_grow_by_the_multiplier_and_stop_at_the_maximum() -> None:
    state = BackoffState(Backoff(initial_s=0.5, maximum_s=5.0, multiplier=2.0))
    assert [state.failed() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert state.failures == 6


def test_retry_after_raises_the_wait_but_not_past_the_maximum() -> None:
    state = BackoffState(Backoff(initial_s=0.2, maximum_s=10.0))
    assert state.failed(down(3.0)) == 3.0
    assert state.failed(down(0.0)) == 6.0, "growth goes on from the longer wait"
    assert BackoffState(Backoff(maximum_s=4.0)).failed(down(60.0)) == 4.0


def test_retry_after_is_read_only_when_it_is_a_usable_number() -> None:
    assert retry_after_of(down(2.5)) == 2.5
    assert retry_after_of(ValueError("no retry_after")) == 0.0
    assert retry_after_of(None) == 0.0
    odd = TemporaryStoreError("x")
    odd.retry_after = float("nan")
    assert retry_after_of(odd) == 0.0


def test_a_success_starts_the_waits_afresh() -> None:
    state = BackoffState(Backoff(initial_s=1.0, maximum_s=8.0))
    assert [state.failed() for _ in range(3)] == [1.0, 2.0, 4.0]
    state.succeeded()
    assert state.failures == 0 and state.delay_s == 0.0
    assert state.failed() == 1.0


def test_jitter_shortens_a_wait_but_never_below_retry_after() -> None:
    policy = Backoff(initial_s=4.0, maximum_s=10.0, jitter=0.5)
    assert BackoffState(policy, rng=lambda: 1.0).failed() == 2.0
    assert BackoffState(policy, rng=lambda: 0.0).failed() == 4.0
    assert BackoffState(policy, rng=lambda: 1.0).failed(down(3.0)) == 3.0


def test_a_zero_initial_wait_retries_at_once() -> None:
    state = BackoffState(Backoff(initial_s=0.0, maximum_s=10.0))
    assert [state.failed() for _ in range(3)] == [0.0, 0.0, 0.0]


def test_a_replaced_policy_governs_the_next_wait() -> None:
    state = BackoffState(Backoff(initial_s=1.0, maximum_s=10.0))
    assert state.failed() == 1.0
    state.policy = Backoff(initial_s=1.0, maximum_s=1.5)
    assert state.failed() == 1.5


@pytest.mark.parametrize("changes", [
    {"initial_s": -1.0}, {"maximum_s": float("inf")}, {"multiplier": 0.5}, {"jitter": 1.5},
])
def test_nonsense_policies_are_refused(changes: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="Backoff"):
        Backoff(**changes)


def test_call_with_retry_waits_out_temporary_errors() -> None:
    time = FakeTime()
    fn = Flaky(down(), down(), down(2.0))
    seen: list[tuple[int, float]] = []
    result = call_with_retry(
        fn, policy=Backoff(initial_s=0.5, maximum_s=10.0), clock=time.clock, sleep=time.sleep,
        on_retry=lambda exc, failures, delay: seen.append((failures, delay)),
    )
    assert result == "ok" and fn.calls == 4
    assert time.sleeps == [0.5, 1.0, 2.0]
    assert seen == [(1, 0.5), (2, 1.0), (3, 2.0)]


@pytest.mark.parametrize("error", [PermanentStoreError("bad query"), StoreConfigError("bad url"),
                                   KeyError("bug")])
def test_errors_that_are_not_retryable_propagate_at_once(error: Exception) -> None:
    time = FakeTime()
    fn = Flaky(error)
    with pytest.raises(type(error)):
        call_with_retry(fn, clock=time.clock, sleep=time.sleep)
    assert fn.calls == 1 and time.sleeps == []


def test_retry_on_names_what_is_retried() -> None:
    time = FakeTime()
    fn = Flaky(ConnectionError("reset"))
    assert call_with_retry(fn, retry_on=(ConnectionError,), clock=time.clock,
                           sleep=time.sleep, on_retry=None) == "ok"
    assert fn.calls == 2


def test_the_deadline_cuts_the_last_wait_short_and_then_raises_the_last_error() -> None:
    time = FakeTime()
    fn = Flaky(*(down() for _ in range(100)))
    with pytest.raises(TemporaryStoreError):
        call_with_retry(fn, policy=Backoff(initial_s=1.0, maximum_s=10.0), deadline_s=2.5,
                        clock=time.clock, sleep=time.sleep, on_retry=None)
    assert time.sleeps == [1.0, 1.5], "tries at 0, 1 and 2.5 s: none after the deadline"
    assert fn.calls == 3
    assert time.now == 102.5


def test_no_deadline_means_it_keeps_trying() -> None:
    time = FakeTime()
    fn = Flaky(*(down() for _ in range(50)))
    assert call_with_retry(fn, policy=Backoff(initial_s=1.0, maximum_s=4.0), clock=time.clock,
                           sleep=time.sleep, on_retry=None) == "ok"
    assert fn.calls == 51
    assert time.sleeps[-1] == 4.0
