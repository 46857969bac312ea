"""Store URLs: which store a URL names, and how to show it without its password.

- `clickhouse://user:password@host:9000/database`: a ClickHouse server (`store.server`).
- `clickhouse://user:password@host:9000/database?cluster=NAME`: the same server as the entry to
  the ClickHouse cluster NAME of its `remote_servers`: local tables on every shard, Distributed
  tables over them (`store.cluster`). The shards' tables are created with `ON CLUSTER` DDL,
  which needs the cluster's ZooKeeper; add `&ddl=per_shard` on a cluster without one, and the
  store creates them on each replica `system.clusters` names, over its own connections.
- `clickhouse://user:password@host:9440/database?secure=1`: over TLS (the server's
  `tcp_port_secure`), the certificate checked against the system's CAs, or against the CA file
  of `&ca_certs=/path/ca.pem`; `&verify=0` turns the check off (a test server only).
- `chdb:///path/to/dir` (or `chdb://./relative/dir`): ClickHouse embedded in this process
  (`store.embedded`), the zero-setup default on one machine.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import parse_qs, unquote, urlsplit

from tracehound.tracing.errors import StoreConfigError

DEFAULT_STORE_DIR = ".tracehound/store"
"""Where the embedded store lives when no URL is given (relative to the working directory)."""


_USER_INFO = re.compile(r"(?P<head>[^:@]*:/*[^:@/]*:).*@", re.S)
"""`scheme:[//]user:<password>@`, however malformed the rest: what `mask_url` hides when
urlsplit cannot read the URL (`clickhouse://u:pw@[::1`) or finds no password in it
(`clickhouse:u:pw@host`, a `//` missing)."""


def mask_url(url: str) -> str:
    """`url` with the password replaced by ***; never raises."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # an unclosed [ of an IPv6 host, a host that NFKC turns into / ? # @ :
        password = None
    if password is not None:
        netloc = parts.netloc.replace(f":{password}@", ":***@", 1)
        return parts._replace(netloc=netloc).geturl()
    return _USER_INFO.sub(lambda m: f"{m['head']}***@", url, count=1)


class ClusterDdl(StrEnum):
    """How a cluster-mode store creates and changes the tables on the shards (`?ddl=`)."""

    ON_CLUSTER = "on_cluster"
    """`CREATE/ALTER/DROP ... ON CLUSTER`, run by the servers themselves (distributed DDL: the
    cluster needs ZooKeeper and a `distributed_ddl` section). The client reaches only the URL's
    server."""
    PER_SHARD = "per_shard"
    """The store connects to every replica `system.clusters` names and runs the DDL there, for
    clusters without ZooKeeper. The client must reach each replica with the URL's user."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The cluster a store URL names (`?cluster=NAME[&ddl=per_shard]`)."""

    name: str
    """A cluster of the server's `remote_servers` (a plain identifier)."""
    ddl: ClusterDdl = ClusterDdl.ON_CLUSTER


@dataclass(frozen=True, slots=True)
class TlsSpec:
    """TLS to a ClickHouse server (`?secure=1[&verify=0][&ca_certs=/path/ca.pem]`): passed to
    clickhouse-driver as `secure=True, verify=..., ca_certs=...`."""

    verify: bool = True
    """Check the server's certificate and host name (off only with `verify=0`)."""
    ca_certs: str | None = None
    """A PEM file of the CAs to trust instead of the system's."""


@dataclass(frozen=True, slots=True)
class ServerAddress:
    host: str
    port: int
    user: str
    password: str
    database: str
    cluster: ClusterSpec | None = None
    """The cluster the store spreads its tables over, None for tables on this server alone."""
    tls: TlsSpec | None = None
    """How to speak TLS to the server (`?secure=1`), None for a plain connection."""


_CLUSTER_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")
_DATABASE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""What `tracing.store.schema.check_identifier` takes (ASCII: `isalnum` also passes `é`)."""
_URL_PARAMETERS = ("cluster", "ddl", "secure", "verify", "ca_certs")
_FLAGS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def _parameters(query: str, shown: str) -> dict[str, list[str]]:
    """A server URL's query parameters; StoreConfigError naming the parameter for anything
    unknown (an unknown parameter is refused rather than ignored, so a misspelt `?clustr=` or
    `?secur=1` cannot silently give a single-server or a plain-text store)."""
    try:
        values = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise StoreConfigError(
            f"store URL {shown!r}: cannot read its parameters {query!r}: expected "
            "?cluster=NAME, ?cluster=NAME&ddl=per_shard or ?secure=1"
        ) from None
    for name, given in values.items():
        if name not in _URL_PARAMETERS:
            raise StoreConfigError(
                f"store URL {shown!r}: unknown parameter {name!r}; expected one of "
                f"{', '.join(_URL_PARAMETERS)}"
            )
        if len(given) > 1:
            raise StoreConfigError(f"store URL {shown!r}: parameter {name!r} is given "
                                   f"{len(given)} times; expected it once")
    return values


def _flag(values: dict[str, list[str]], name: str, shown: str, default: bool) -> bool:
    raw = values.get(name, [""])[0].strip().lower()
    if not raw:
        return default
    if raw not in _FLAGS:
        raise StoreConfigError(f"store URL {shown!r}: parameter {name!r} is {raw!r}; "
                               "expected 1 or 0")
    return _FLAGS[raw]


def _tls_of(values: dict[str, list[str]], shown: str) -> TlsSpec | None:
    """The TLS a server URL asks for (`secure=1`, `verify`, `ca_certs`), or None."""
    secure = _flag(values, "secure", shown, False)
    if not secure:
        for name in ("verify", "ca_certs"):
            if name in values:
                raise StoreConfigError(f"store URL {shown!r}: parameter {name!r} needs TLS: "
                                       f"expected ?secure=1&{name}=...")
        return None
    ca_certs = values.get("ca_certs", [""])[0] or None
    if ca_certs is not None and not os.path.isfile(ca_certs):
        raise StoreConfigError(f"store URL {shown!r}: ca_certs file {ca_certs!r} does not exist")
    return TlsSpec(verify=_flag(values, "verify", shown, True), ca_certs=ca_certs)


def _cluster_of(values: dict[str, list[str]], shown: str) -> ClusterSpec | None:
    """The cluster named by a server URL's parameters, or None; StoreConfigError naming the
    parameter when it cannot be used."""
    if "cluster" not in values:
        if "ddl" in values:
            raise StoreConfigError(f"store URL {shown!r}: parameter 'ddl' needs a cluster: "
                                   "expected ?cluster=NAME&ddl=...")
        return None
    name = values["cluster"][0]
    if not _CLUSTER_NAME.fullmatch(name):
        raise StoreConfigError(
            f"store URL {shown!r}: parameter 'cluster' is {name!r}; expected the name of a "
            "cluster of the server's remote_servers (letters, digits and _, not starting with "
            "a digit)"
        )
    ddl = values.get("ddl", [ClusterDdl.ON_CLUSTER.value])[0]
    try:
        return ClusterSpec(name=name, ddl=ClusterDdl(ddl))
    except ValueError:
        raise StoreConfigError(
            f"store URL {shown!r}: parameter 'ddl' is {ddl!r}; expected one of "
            f"{', '.join(d.value for d in ClusterDdl)}"
        ) from None


def parse_server_url(url: str) -> ServerAddress:
    """Split a `clickhouse://` URL, naming the part that is wrong when it cannot be used."""
    shown = mask_url(url)
    try:
        parts = urlsplit(url)
    except ValueError:  # its message may quote the password
        raise StoreConfigError(
            f"store URL {shown!r} cannot be read: expected clickhouse://user:pass@host:9000/db "
            "(an IPv6 host in [brackets], a host name of letters, digits, - and .)") from None
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
    if not _DATABASE.fullmatch(database):
        raise StoreConfigError(
            f"store URL {shown!r}: database name {database!r} may hold only letters, digits and "
            "_, not starting with a digit"
        )
    values = _parameters(parts.query, shown)
    return ServerAddress(
        host=parts.hostname,
        port=port,
        user=unquote(parts.username or "default"),
        password=unquote(parts.password or ""),
        database=database,
        cluster=_cluster_of(values, shown),
        tls=_tls_of(values, shown),
    )


def embedded_path(url: str) -> str:
    """The directory of a `chdb://` URL (`chdb:///abs/dir` or `chdb://./relative/dir`)."""
    if not url.startswith("chdb://"):
        raise StoreConfigError(f"store URL {url!r}: expected chdb:///path/to/dir")
    path = url[len("chdb://"):]
    if not path:
        raise StoreConfigError(f"store URL {url!r} names no directory: expected chdb:///path/to/dir")
    if "\x00" in path:
        raise StoreConfigError(f"store URL {url!r}: a directory name cannot hold a NUL character")
    return os.path.abspath(path)


def default_store_url() -> str:
    return f"chdb://{os.path.abspath(DEFAULT_STORE_DIR)}"


def is_embedded(url: str) -> bool:
    return url.startswith("chdb://")
