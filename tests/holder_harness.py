"""A process that holds embedded stores and shares them, as `tracehound run` does, for the tests
that read and write a store through another process (`store.client`).

Run as a script it takes one command a line on stdin and answers one line on stdout:

    open chdb:///dir          opens the directory itself, shares it     -> "shared http://..."
    open-bare chdb:///dir     the same without making the schema         -> "shared http://..."
    open-unshared chdb:///dir opens it and shares it with nobody         -> "held"
    close                     stops sharing it and closes it             -> "closed"
    (end of input)            closes what it holds and exits

`StoreHolder` drives one such process from a test session: a store per test costs an open and
a close in it (chdb lets a process hold one directory at a time, and another after closing it),
not a new process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()

SHARED = "shared"
"""The id of the `store_url` parameter of a store another process holds (tests/tracing)."""


def is_shared(request: pytest.FixtureRequest) -> bool:
    """Whether the test runs on the client of a store another process holds."""
    callspec = getattr(request.node, "callspec", None)
    return callspec is not None and callspec.params.get("store_url") == SHARED


class StoreHolder:
    """The holder process of a test session."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(HERE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True,
        )
        self.holding: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def _ask(self, line: str) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        answer = self.process.stdout.readline().strip()
        assert answer, f"the holder process exited ({self.process.wait()}) on {line!r}"
        assert not answer.startswith("error"), answer
        return answer

    def hold(self, url: str, *, create: bool = True, share: bool = True) -> str:
        """Open the store of `url` in the holder (making its schema unless not `create`) and
        share it (unless not `share`); its endpoint's address ("" when not shared)."""
        command = "open" if share and create else "open-bare" if share else "open-unshared"
        answer = self._ask(f"{command} {url}")
        self.holding = url
        return answer.removeprefix("shared ").removeprefix("held")

    def jobs(self, url: str) -> list[str]:
        """The jobs of the store of `url` as the holder process reads them, opening it for this
        one call (itself, or through the process that holds it)."""
        return list(json.loads(self._ask(f"jobs {url}").removeprefix("jobs ")))

    def release(self) -> None:
        """Stop sharing the store and close it."""
        assert self._ask("close") == "closed"
        self.holding = None

    def stop(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def _serve() -> None:
    from tracehound.tracing.store import TraceStore, open_store
    from tracehound.tracing.store.embedded import EmbeddedClickHouseStore
    from tracehound.tracing.store.sharing import Sharing

    held: tuple[TraceStore, Sharing] | None = None
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        try:
            if command in ("open", "open-bare", "open-unshared") and held is None:
                store = open_store(argument, create=command != "open-bare")
                if not isinstance(store, EmbeddedClickHouseStore):
                    raise RuntimeError(f"{argument} is held by another process")
                sharing = Sharing(store)
                if command == "open-unshared":
                    held = (store, sharing)
                    print("held", flush=True)
                    continue
                endpoint = sharing.start()
                assert endpoint is not None
                held = (store, sharing)
                print(f"shared {endpoint.url}", flush=True)
            elif command == "jobs":
                with open_store(argument, create=False) as reader:
                    print(f"jobs {json.dumps(reader.jobs())}", flush=True)
            elif command == "close" and held is not None:
                held[1].stop()
                held[0].close()
                held = None
                print("closed", flush=True)
            else:
                print(f"error: cannot {line.strip()!r} now", flush=True)
        except Exception as exc:
            print(f"error: {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
    if held is not None:
        held[1].stop()
        held[0].close()


if __name__ == "__main__":
    _serve()
