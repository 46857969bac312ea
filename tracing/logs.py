"""Log lines that name the job, node and rank they are about.

Every Tracehound process logs through `logging.getLogger(__name__)`; wrap it in `JobLogger` where
a message concerns one job, node or rank, so a line in a thousand-rank log says whose it is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from tracehound.tracing.settings import DEFAULT_LOG_LEVEL, TRACEHOUND_LOG_LEVEL


class JobLogger(logging.LoggerAdapter[logging.Logger]):
    """Prefixes messages with `[job=J node=N rank=R]` (only the parts that are known)."""

    def __init__(
        self, logger: logging.Logger, *, job: str = "", node: str = "", rank: int | None = None
    ) -> None:
        context = {"job": job, "node": node, "rank": rank}
        super().__init__(logger, context)
        parts = [f"job={job}" if job else "", f"node={node}" if node else ""]
        parts.append(f"rank={rank}" if rank is not None else "")
        self._prefix = "[" + " ".join(p for p in parts if p) + "] " if any(parts) else ""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs.setdefault("extra", {}).update(self.extra or {})
        return f"{self._prefix}{msg}", kwargs


def configure(level: str | None = None) -> None:
    """Plain timestamped logging to stderr at TRACEHOUND_LOG_LEVEL (default INFO)."""
    name = (level or os.environ.get(TRACEHOUND_LOG_LEVEL) or DEFAULT_LOG_LEVEL).upper()
    logging.basicConfig(
        level=getattr(logging, name, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
