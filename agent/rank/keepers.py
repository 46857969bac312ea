"""The training rank's side of the node keepers (`agent.node.keeper`): where they are, and HTTP.

`Keepers.from_env` reads TRACEHOUND_SNAPSHOT_KEEPERS (`node-0=http://host:port,...`, in node
order) and names this rank's own keeper and the one that holds its replicas: the node half the
list away (so a job whose parallel groups span neighbouring nodes keeps a snapshot and its replica
apart more often than with the next node). `KeeperClient` puts, lists and fetches snapshots.

Nothing here raises into training once configured: the callers catch and count `KeeperError`.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tracehound.tracing import settings as env
from tracehound.tracing.snapshots import FRAME, REPLY


class KeeperError(OSError):
    """A keeper that did not answer, or refused; the message names the keeper and the reason."""


@dataclass(eq=False)
class KeeperClient:
    """One keeper over HTTP/1.1, on one kept-alive connection (a snapshot a step costs no new
    connection, nor a new thread in the keeper)."""

    node: str
    url: str
    timeout_s: float = 10.0
    _conn: http.client.HTTPConnection | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _stream: socket.socket | None = field(default=None, repr=False)
    _stream_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            parts = urllib.parse.urlsplit(self.url)
            self._conn = _NoDelayConnection(parts.hostname or "127.0.0.1", parts.port or 80,
                                            timeout=self.timeout_s)
        return self._conn

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        with self._lock:
            for attempt in (1, 2):  # a kept connection the keeper closed meanwhile: once more
                conn = self._connection()
                try:
                    conn.request(method, path, body=body, headers=headers)
                    response = conn.getresponse()
                    return response.status, response.read()
                except (OSError, http.client.HTTPException) as exc:
                    conn.close()
                    self._conn = None
                    if attempt == 2 or isinstance(exc, (ConnectionRefusedError, TimeoutError)):
                        raise KeeperError(f"keeper of node {self.node} at {self.url}: "
                                          f"{exc!r}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _stream_socket(self) -> socket.socket | None:
        if self._stream is None:
            port = int(self.stats().get("stream_port") or 0)
            if not port:
                return None
            host = urllib.parse.urlsplit(self.url).hostname or "127.0.0.1"
            sock = socket.create_connection((host, port), timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._stream = sock
        return self._stream

    def _close_stream(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        with self._stream_lock:
            self._close_stream()

    def put(self, data: bytes) -> None:
        """Hand the keeper a snapshot: on its stream (one kept connection, no HTTP), or by HTTP
        PUT where it names no stream port."""
        with self._stream_lock:
            for attempt in (1, 2):  # a kept connection the keeper closed meanwhile: once more
                try:
                    sock = self._stream_socket()
                    if sock is None:
                        break
                    sock.sendall(FRAME.pack(len(data)))
                    sock.sendall(data)
                    status, size = REPLY.unpack(_receive(sock, REPLY.size))
                    reason = _receive(sock, size).decode(errors="replace") if size else ""
                except KeeperError:
                    self._close_stream()
                    raise
                except OSError as exc:
                    self._close_stream()
                    if attempt == 2 or isinstance(exc, ConnectionRefusedError):
                        raise KeeperError(f"keeper of node {self.node} at {self.url}: "
                                          f"{exc!r}") from exc
                    continue
                if status != 0:
                    raise KeeperError(f"keeper of node {self.node} refused a snapshot: {reason}")
                return
        status, body = self._request("PUT", "/v1/snapshots", data)
        if status != 201:
            raise KeeperError(f"keeper of node {self.node} refused a snapshot ({status}): "
                              f"{_error_of(body)}")

    def index(self, job: str) -> list[dict[str, Any]]:
        status, body = self._request("GET", "/v1/snapshots?" + urllib.parse.urlencode({"job": job}))
        if status != 200:
            raise KeeperError(f"keeper of node {self.node}: listing answered {status}: "
                              f"{_error_of(body)}")
        rows = json.loads(body)
        return rows if isinstance(rows, list) else []

    def fetch(self, job: str, rank: int, step: int) -> bytes | None:
        path = f"/v1/snapshots/{urllib.parse.quote(job, safe='')}/{rank}/{step}"
        status, body = self._request("GET", path)
        if status == 404:
            return None
        if status != 200:
            raise KeeperError(f"keeper of node {self.node}: fetch answered {status}: "
                              f"{_error_of(body)}")
        return body

    def stats(self) -> dict[str, Any]:
        status, body = self._request("GET", "/v1/stats")
        if status != 200:
            raise KeeperError(f"keeper of node {self.node}: stats answered {status}")
        value = json.loads(body)
        return value if isinstance(value, dict) else {}


def _receive(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes; ConnectionError when the keeper closed before."""
    chunks, left = [], size
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionError("the keeper closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class _NoDelayConnection(http.client.HTTPConnection):
    """http.client sends a request's headers and body apart: with Nagle's algorithm on a kept
    connection each request then waits for the keeper's delayed ACK (about 40 ms)."""

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _error_of(body: bytes) -> str:
    try:
        return str(json.loads(body).get("error", body[:200]))
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def parse_keepers(text: str, *, name: str = env.TRACEHOUND_SNAPSHOT_KEEPERS) -> list[KeeperClient]:
    """`node-0=http://host:port,node-1=...` -> clients in that order; SettingError otherwise."""
    clients: list[KeeperClient] = []
    for item in (p.strip() for p in text.split(",") if p.strip()):
        node, sep, url = item.partition("=")
        parts = urllib.parse.urlsplit(url)
        if not sep or not node or parts.scheme != "http" or not parts.hostname or not parts.port:
            raise env.SettingError(f"{name}={text!r}: expected NODE=http://HOST:PORT entries "
                                   f"separated by commas, e.g. node-0=http://127.0.0.1:7070")
        clients.append(KeeperClient(node=node, url=url))
    return clients


@dataclass(frozen=True)
class Keepers:
    """The job's keepers, and which of them are this rank's own and its replica holder."""

    all: tuple[KeeperClient, ...]
    own: KeeperClient | None
    replica: KeeperClient | None

    @classmethod
    def from_env(cls, node: str, environ: Mapping[str, str] | None = None) -> Keepers:
        clients = parse_keepers(env.env_str(env.TRACEHOUND_SNAPSHOT_KEEPERS, env=environ))
        replicas = env.env_int(env.TRACEHOUND_SNAPSHOT_REPLICAS, env.DEFAULT_SNAPSHOT_REPLICAS,
                               env=environ)
        return cls.place(clients, node, replicas=replicas > 0)

    @classmethod
    def place(cls, clients: list[KeeperClient], node: str, *, replicas: bool = True) -> Keepers:
        nodes = [c.node for c in clients]
        if node not in nodes:
            return cls(all=tuple(clients), own=None, replica=None)
        mine = nodes.index(node)
        replica = None
        if replicas and len(clients) > 1:
            replica = clients[(mine + max(1, len(clients) // 2)) % len(clients)]
        return cls(all=tuple(clients), own=clients[mine], replica=replica)

    def lookup_order(self) -> list[KeeperClient]:
        """Own keeper first (its memory is the nearest), then the others in node order."""
        return ([self.own] if self.own else []) + [c for c in self.all if c is not self.own]
