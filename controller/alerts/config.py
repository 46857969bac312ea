"""Alert receivers read from a YAML or JSON file (`load_receivers`), checked field by field,
global and per job (`merge_receivers`); receiver URLs shown without their secrets
(`shown_url`)."""

from __future__ import annotations

import logging
import math
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import yaml  # type: ignore[import-untyped]  # PyYAML ships no type hints

from tracehound.controller.alerts.model import (
    RECEIVER_KINDS,
    SEVERITIES,
    AlertConfigError,
    Receiver,
)
from tracehound.tracing.errors import shown

log = logging.getLogger(__name__)


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")

# -- configuration ----------------------------------------------------------------------------

_RECEIVER_FIELDS = frozenset(("name", "kind", "url", "routing_key", "secret", "timeout_s",
                              "jobs", "ca_file", "min_severity"))


def shown_url(url: str) -> str:
    """`url` as messages show it: scheme, host and port, and `/...` for a path or query (a
    Slack or generic webhook URL carries its token there), never user info."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:  # an unclosed [ of an IPv6 host; the message may quote the URL's secrets
        return "?"
    try:
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        host, port = "?", ""
    if ":" in host:
        host = f"[{host}]"
    rest = "/..." if parts.path.strip("/") or parts.query else ""
    return f"{parts.scheme}://{host}{port}{rest}"


def load_receivers(path: str | os.PathLike[str]) -> list[Receiver]:
    """The receivers in the YAML or JSON file at `path` (`{"receivers": [...]}`);
    AlertConfigError naming the file and the field when anything in it is wrong."""
    where = os.fspath(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise AlertConfigError(f"{where}: cannot be read: {exc}") from exc
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark is not None else ""
        raise AlertConfigError(f"{where}: not valid YAML or JSON{line}: "
                               f"{getattr(exc, 'problem', None) or exc}") from exc
    except (ValueError, OverflowError, RecursionError) as exc:
        # what PyYAML's constructors let through: a date such as 2024-13-01, an integer of more
        # than 4300 digits, a document nested deeper than Python's recursion limit
        raise AlertConfigError(f"{where}: not a usable YAML or JSON document: "
                               f"{'nested too deep' if isinstance(exc, RecursionError) else exc}"
                               ) from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("receivers"), list):
        raise AlertConfigError(f'{where}: expected an object {{"receivers": [...]}}')
    receivers: list[Receiver] = []
    seen: dict[str, int] = {}
    for index, entry in enumerate(doc["receivers"]):
        receiver = _receiver(entry, f"{where}: receivers[{index}]")
        if receiver.name in seen:
            raise AlertConfigError(
                f"{where}: receivers[{index}].name: {receiver.name!r} is already the name of "
                f"receivers[{seen[receiver.name]}]")
        seen[receiver.name] = index
        receivers.append(receiver)
    return receivers

def _receiver(entry: object, at: str) -> Receiver:
    if not isinstance(entry, dict):
        raise AlertConfigError(f"{at}: expected an object")
    unknown = sorted(str(key) for key in set(entry) - _RECEIVER_FIELDS)
    if unknown:
        raise AlertConfigError(
            f"{at}.{unknown[0]}: unknown field (known: {', '.join(sorted(_RECEIVER_FIELDS))})")

    def text(field: str) -> str:
        value = entry.get(field, "")
        if not isinstance(value, str):
            raise AlertConfigError(f"{at}.{field}: expected a string, got {shown(value)}")
        return value

    name = text("name")
    if not _NAME.fullmatch(name):
        raise AlertConfigError(
            f"{at}.name: required: 1-100 letters, digits, '_', '.' or '-', got {name!r}")
    kind = text("kind")
    if kind not in RECEIVER_KINDS:
        raise AlertConfigError(
            f"{at}.kind: expected one of {', '.join(RECEIVER_KINDS)}, got {kind!r}")
    url = text("url")
    if not url:
        raise AlertConfigError(f"{at}.url: required")
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in ("http", "https") or not rest or rest.startswith("/"):
        raise AlertConfigError(
            f"{at}.url: expected an http:// or https:// URL, got {shown_url(url)!r}")
    ca_file = text("ca_file")
    if ca_file and scheme.lower() != "https":
        raise AlertConfigError(f"{at}.ca_file: only for an https:// url")
    if ca_file and not os.path.isfile(ca_file):
        raise AlertConfigError(f"{at}.ca_file: {ca_file!r} is not a file")
    routing_key, secret = text("routing_key"), text("secret")
    if kind == "pagerduty" and not routing_key:
        raise AlertConfigError(f"{at}.routing_key: required for kind pagerduty")
    if kind != "pagerduty" and routing_key:
        raise AlertConfigError(f"{at}.routing_key: only for kind pagerduty, not {kind}")
    if kind == "webhook" and not secret:
        raise AlertConfigError(f"{at}.secret: required for kind webhook")
    if kind != "webhook" and secret:
        raise AlertConfigError(f"{at}.secret: only for kind webhook, not {kind}")
    timeout = entry.get("timeout_s", 5.0)
    try:
        seconds = (math.nan if isinstance(timeout, bool) or not isinstance(timeout, int | float)
                   else float(timeout))
    except OverflowError:  # an integer too large for a float
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise AlertConfigError(
            f"{at}.timeout_s: expected a number of seconds > 0, got {shown(timeout)}")
    jobs = entry.get("jobs", [])
    if isinstance(jobs, str):
        jobs = [jobs]
    if (not isinstance(jobs, list)
            or not all(isinstance(j, str) and j.strip() for j in jobs)):
        raise AlertConfigError(
            f"{at}.jobs: expected a list of job id patterns (`exp-*`), got {shown(jobs)}")
    severity = entry.get("min_severity", "warning")
    if severity not in SEVERITIES:
        raise AlertConfigError(f"{at}.min_severity: expected one of {', '.join(SEVERITIES)}, "
                               f"got {shown(severity)}")
    return Receiver(name=name, kind=kind, url=url, routing_key=routing_key, secret=secret,
                    timeout_s=float(timeout), jobs=tuple(jobs), ca_file=ca_file,
                    min_severity=severity)


def merge_receivers(*found: tuple[str, Sequence[Receiver]]) -> list[Receiver]:
    """The receivers of several files (`(file, receivers)`, e.g. the global file and a job's
    own); AlertConfigError naming both files when a name is used twice."""
    merged: dict[str, tuple[str, Receiver]] = {}
    for where, receivers in found:
        for receiver in receivers:
            if receiver.name in merged:
                raise AlertConfigError(
                    f"{where}: receiver {receiver.name!r} is already defined in "
                    f"{merged[receiver.name][0]}; names must be unique across both files")
            merged[receiver.name] = (where, receiver)
    return [r for _, r in merged.values()]
