"""When the supervisor reads the window summaries that soft faults are judged on: every
`summaries_every_s`, and not before a whole window has passed since the attempt's warm-up."""

from __future__ import annotations

from tracehound.controller.supervision.supervisor import SupervisorSettings, summaries_due

S = 1_000_000
WARM = 100 * S  # the warm-up ended here


def due(settings: SupervisorSettings, now_s: float, last_s: float = 0.0) -> bool:
    return summaries_due(settings, now_us=WARM + int(now_s * S), judged_from_us=WARM,
                         last_us=WARM + int(last_s * S) if last_s else 0)


def test_the_first_summaries_wait_for_a_whole_window_after_the_warm_up() -> None:
    settings = SupervisorSettings()  # a 10 s window, summaries every 2 s
    assert not due(settings, 2.0)  # a 2 s window: too little of a rank's work
    assert not due(settings, 9.9)
    assert due(settings, 10.0)


def test_then_they_come_every_interval() -> None:
    settings = SupervisorSettings()
    assert not due(settings, 11.0, last_s=10.0)
    assert due(settings, 12.0, last_s=10.0)


def test_an_interval_longer_than_the_window_is_the_wait() -> None:
    settings = SupervisorSettings(window_s=1.0, summaries_every_s=5.0)
    assert not due(settings, 4.0)
    assert due(settings, 5.0)
