"""Stand-ins for what a Recorder is given in unit tests: a clock that steps on every read and a
sink that keeps what it accepts (or refuses everything)."""

from __future__ import annotations

from tracehound.agent.rank.recorder import Pending


class Clock:
    """Microseconds since the epoch, 10 more at each read."""

    def __init__(self) -> None:
        self.now = 1_000_000

    def __call__(self) -> int:
        self.now += 10
        return self.now


class Sink:
    """Keeps what it accepts; with `full`, refuses everything (a full queue)."""

    def __init__(self, *, full: bool = False) -> None:
        self.items: list[Pending] = []
        self.full = full

    def offer(self, item: Pending) -> bool:
        if self.full:
            return False
        self.items.append(item)
        return True

    def flush(self, timeout: float) -> bool:
        return True
