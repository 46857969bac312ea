"""Store URLs: which store a URL names, and how to show it without its password.

- `clickhouse://user:password@host:9000/database`: a ClickHouse server (`store.server`).
- `chdb:///path/to/dir` (or `chdb://./relative/dir`): ClickHouse embedded in this process
  (`store.embedded`), the zero-setup default on one machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from tracehound.tracing.errors import StoreConfigError

DEFAULT_STORE_DIR = ".tracehound/store"
"""Where the embedded store lives when no URL is given (relative to the working directory)."""


def mask_url(url: str) -> str:
    """`url` with the password replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


@dataclass(frozen=True, slots=True)
class ServerAddress:
    host: str
    port: int
    user: str
    password: str
    database: str


def parse_server_url(url: str) -> ServerAddress:
    """Split a `clickhouse://` URL, naming the part that is wrong when it cannot be used."""
    parts = urlsplit(url)
    shown = mask_url(url)
    if parts.scheme != "clickhouse":
        raise StoreConfigError(f"store URL {shown!r}: expected clickhouse://user:pass@host:9000/db")
    if not parts.hostname:
        raise StoreConfigError(f"store URL {shown!r} names no host (clickhouse://host:9000/db)")
    try:
        port = parts.port or 9000
    except ValueError:
        raise StoreConfigError(
            f"store URL {shown!r} has a bad port: expected a number from 1 to 65535"
        ) from None
    database = parts.path.lstrip("/") or "tracehound"
    if not database.replace("_", "").isalnum():
        raise StoreConfigError(
            f"store URL {shown!r}: database name {database!r} may hold only letters, digits and _"
        )
    return ServerAddress(
        host=parts.hostname,
        port=port,
        user=unquote(parts.username or "default"),
        password=unquote(parts.password or ""),
        database=database,
    )


def embedded_path(url: str) -> str:
    """The directory of a `chdb://` URL (`chdb:///abs/dir` or `chdb://./relative/dir`)."""
    if not url.startswith("chdb://"):
        raise StoreConfigError(f"store URL {url!r}: expected chdb:///path/to/dir")
    path = url[len("chdb://"):]
    if not path:
        raise StoreConfigError(f"store URL {url!r} names no directory: expected chdb:///path/to/dir")
    return os.path.abspath(path)


def default_store_url() -> str:
    return f"chdb://{os.path.abspath(DEFAULT_STORE_DIR)}"


def is_embedded(url: str) -> bool:
    return url.startswith("chdb://")
