"""Shared parts of the shipping fault tests (the ingest endpoint and the controller restarted, a
flooding rank): what each rank says it produced, and the store's rows counted against it.

A rank's own report is the ground truth. `REPORTING` is pasted into a job script after
`import torch.distributed`: it puts a counting pass-through in front of the auto-installed
recorder's transport, so every collective the recorder produced is counted per group, and the
ones the transport refused (its buffer was full) are remembered by key. `write_report` waits for
the transport to have written everything to a node agent (which may be restarting) and writes
the counts as JSON. `RankReport.accepted()` is then exactly the set of collective keys that must
be in the store once, and `tally` compares it with `collective_keys` (every stored row, duplicates
included): lost, duplicated and unexpected rows, each a count.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "agent"))  # for agent_harness

from agent_harness import free_port, rank_env, start_node_agent, stop

from tracehound.tracing.ids import JobId
from tracehound.tracing.store import TraceStore, bulk

__all__ = ["REPORTING", "Key", "RankReport", "Tally", "free_port", "load_reports", "rank_env",
           "refused_segments", "spool_segments", "start_node_agent", "stop", "stored_keys",
           "tally", "tally_ranks"]

Key = tuple[str, int, int, str, int]
"""(job, attempt, rank, group, seq): one rank's part in one collective."""

REPORTING = r'''
import json as _json
import threading as _threading
import time as _time

from tracehound.agent.rank import autoinstall as _autoinstall


class _Counting:
    """Passes every record on to the transport; counts the collectives per group and remembers
    the keys of those the transport refused."""

    def __init__(self, inner):
        self.inner = inner
        self.lock = _threading.Lock()
        self.offered = self.refused = 0
        self.identity = None
        self.produced = {}
        self.last_seq = {}
        self.refused_keys = []

    def offer(self, item):
        accepted = self.inner.offer(item)
        with self.lock:
            self.offered += 1
            self.refused += not accepted
            if isinstance(item, tuple):
                (job, attempt, _, rank), group, seq = item[:3]  # recorder.RawCollective
                self.identity = [job, attempt, rank]
                self.produced[group] = self.produced.get(group, 0) + 1
                self.last_seq[group] = max(self.last_seq.get(group, 0), seq)
                if not accepted:
                    self.refused_keys.append([group, seq])
        return accepted

    def flush(self, timeout):
        return self.inner.flush(timeout)


recorder = _autoinstall.recorder()
assert recorder is not None, "the recorder was not installed"
transport = recorder.sink
counting = recorder.sink = _Counting(transport)


def write_report(path, **extra):
    """Wait until the transport wrote what it holds to a node agent, then write this rank's
    counts to `path` (JSON)."""
    flushed = transport.flush(180.0)

    def snapshot():
        with counting.lock:
            return {
                "identity": counting.identity, "produced": dict(counting.produced),
                "last_seq": dict(counting.last_seq),
                "refused_keys": list(counting.refused_keys), "offered": counting.offered,
                "refused": counting.refused, "sent": transport.sent,
                "pending": transport.pending, "lost": transport.lost,
                "transport_dropped": transport.dropped, "dropped": recorder.dropped,
                "errors": recorder.errors,
            }

    # a heartbeat may be offered while we read: read until two readings agree
    a, b = snapshot(), snapshot()
    while a != b:
        _time.sleep(0.05)
        a, b = b, snapshot()
    a["flushed"] = flushed
    a["extra"] = extra
    with open(path + ".tmp", "w") as handle:
        _json.dump(a, handle)
    import os as _os
    _os.replace(path + ".tmp", path)
'''


@dataclass(frozen=True)
class RankReport:
    """What one rank produced and what became of it, as its `write_report` wrote it."""

    job: str
    attempt: int
    rank: int
    produced: dict[str, int]
    """Collectives the recorder produced, per group."""
    last_seq: dict[str, int]
    refused_keys: frozenset[tuple[str, int]]
    """(group, seq) of the collectives the transport refused (buffer full)."""
    offered: int
    """Records of every kind the recorder offered (collectives, heartbeats, groups)."""
    refused: int
    sent: int
    pending: int
    lost: int
    transport_dropped: int
    dropped: int
    """The recorder's own count of what it lost (what its heartbeats report)."""
    errors: int
    flushed: bool
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: Path) -> RankReport:
        raw = json.loads(path.read_text())
        job, attempt, rank = raw["identity"]
        return cls(
            job=job, attempt=int(attempt), rank=int(rank), produced=raw["produced"],
            last_seq=raw["last_seq"],
            refused_keys=frozenset((str(g), int(s)) for g, s in raw["refused_keys"]),
            offered=raw["offered"], refused=raw["refused"], sent=raw["sent"],
            pending=raw["pending"], lost=raw["lost"],
            transport_dropped=raw["transport_dropped"], dropped=raw["dropped"],
            errors=raw["errors"], flushed=raw["flushed"], extra=raw["extra"],
        )

    @property
    def collectives(self) -> int:
        return sum(self.produced.values())

    @property
    def refused_collectives(self) -> int:
        return len(self.refused_keys)

    def produced_keys(self) -> set[Key]:
        return {(self.job, self.attempt, self.rank, group, seq)
                for group, count in self.produced.items() for seq in range(1, count + 1)}

    def accepted(self) -> Counter[Key]:
        """The collectives the transport took: each must be stored exactly once."""
        return Counter(key for key in self.produced_keys()
                       if (key[3], key[4]) not in self.refused_keys)

    def accounting_errors(self) -> list[str]:
        """Where this rank's own counts do not add up (empty when they do): every collective
        has its sequence id (1..n per group, none skipped), the transport wrote all it took,
        and every refusal is counted once, by the transport and by the recorder alike."""
        errors = []
        if self.produced != self.last_seq:
            errors.append(f"sequence ids skipped: produced {self.produced}, last {self.last_seq}")
        if not self.flushed or self.pending:
            errors.append(f"{self.pending} records still pending after the flush")
        if self.lost or self.errors:
            errors.append(f"transport lost {self.lost}, recorder errors {self.errors}")
        if not self.refused == self.transport_dropped == self.dropped:
            errors.append(f"refused {self.refused}, transport dropped "
                          f"{self.transport_dropped}, recorder dropped {self.dropped}")
        if self.refused_collectives > self.refused:
            errors.append(f"{self.refused_collectives} collectives refused of {self.refused}")
        return errors


def load_reports(directory: Path, pattern: str = "*.json") -> list[RankReport]:
    return [RankReport.load(p) for p in sorted(directory.glob(pattern))]


def stored_keys(store: TraceStore, jobs: Iterable[str]) -> Counter[Key]:
    """Every stored collective row of `jobs` by key; a row stored twice counts 2."""
    counts: Counter[Key] = Counter()
    for job in jobs:
        for k in bulk(store).collective_keys(JobId(job)):
            counts[(job, k.attempt, k.rank, k.group, k.seq)] += 1
    return counts


@dataclass(frozen=True)
class Tally:
    """Stored rows against the rows expected, as counts."""

    expected: int
    stored_rows: int
    lost: int
    """Expected keys with no stored row."""
    duplicated: int
    """Rows beyond the first of a key."""
    unexpected: int
    """Stored keys nobody reported taking (e.g. a refused collective that was stored)."""

    @property
    def exact(self) -> bool:
        return self.lost == self.duplicated == self.unexpected == 0


def tally(expected: Counter[Key], stored: Counter[Key]) -> Tally:
    return Tally(
        expected=sum(expected.values()),
        stored_rows=sum(stored.values()),
        lost=sum(1 for key in expected if key not in stored),
        duplicated=sum(n - 1 for n in stored.values() if n > 1),
        unexpected=sum(n for key, n in stored.items() if key not in expected),
    )


def tally_ranks(reports: Iterable[RankReport], stored: Counter[Key]
                ) -> dict[tuple[str, int], Tally]:
    """A tally per (job, rank) over the stored rows of that rank."""
    out = {}
    for report in reports:
        mine = Counter({k: n for k, n in stored.items()
                        if k[0] == report.job and k[2] == report.rank})
        out[(report.job, report.rank)] = tally(report.accepted(), mine)
    return out


def spool_segments(spool_root: Path) -> int:
    """Sealed segments waiting to be shipped under `spool_root` (every node's spool)."""
    return sum(1 for _ in spool_root.rglob("seg-*.seg")) - sum(
        1 for _ in spool_root.rglob("rejected/seg-*.seg"))


def refused_segments(spool_root: Path) -> int:
    """Segments the sink refused for good (moved to `rejected/`)."""
    return sum(1 for _ in spool_root.rglob("rejected/seg-*.seg"))
