"""Readers of `/proc`, the kernel's view of a node's processes: pure parsers of its files, shared
by the process watcher (`agent.node.procwatch`) and the sources that find a rank's settings in
its environment (`nccl`). Nothing here opens a file."""

from __future__ import annotations


def parse_stat(text: str, clock_ticks: int) -> tuple[str, float, int]:
    """(state letter, user+system CPU seconds, start time in ticks) from `/proc/PID/stat`.

    The command name (field 2, in parentheses) may hold spaces and parentheses, so fields are
    counted after the LAST ')'. Raises ValueError on a line that is not a stat line."""
    close = text.rfind(")")
    if close < 0:
        raise ValueError(f"not a /proc/PID/stat line (no ')'): {text[:100]!r}")
    fields = text[close + 1 :].split()
    # fields[0] is field 3 of proc(5) (state); field n is fields[n - 3].
    if len(fields) < 20:
        raise ValueError(f"/proc/PID/stat line with {len(fields) + 2} fields: {text[:100]!r}")
    utime, stime, start = int(fields[11]), int(fields[12]), int(fields[19])
    return fields[0], (utime + stime) / clock_ticks, start


def parse_environ(raw: bytes) -> dict[str, str]:
    """The variables of a `/proc/PID/environ` (NUL-separated NAME=value; undecodable bytes
    replaced)."""
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            out[name.decode(errors="replace")] = value.decode(errors="replace")
    return out


def parse_io(text: str) -> tuple[int, int]:
    """(read_bytes, write_bytes) from `/proc/PID/io`; raises ValueError if either is missing."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("read_bytes", "write_bytes"):
            values[name.strip()] = int(value)
    if len(values) != 2:
        raise ValueError(f"no read_bytes/write_bytes in /proc/PID/io: {text[:100]!r}")
    return values["read_bytes"], values["write_bytes"]
