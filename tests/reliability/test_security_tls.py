"""TLS to ClickHouse and to alert receivers.

ClickHouse: `?secure=1` (with `verify`, `ca_certs`) reaches clickhouse-driver as `secure=True`
and its certificate options; this is checked on the client the store builds, because no TLS
ClickHouse server can run here (Debian's 18.16 package is built without a `tcp_port_secure`
listener we could configure in the tests' time, and there is no other server). What is checked
against the real (plain) server: a TLS connection attempt to it fails at once with a
StoreConfigError that names the URL with its password masked and says which port speaks TLS.

Webhooks: a receiver on https://127.0.0.1:<port>, served here by a TLS server with a
self-signed certificate made with the `openssl` CLI (the `cryptography` package is not
installed), is refused by default (the certificate is checked against the system's CAs: the
delivery waits and is retried, the message says to name the CA in `ca_file`), and delivered
once the receiver's `ca_file` names that certificate.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tracehound.controller.alerts import (
    Alert,
    AlertConfigError,
    Dispatcher,
    Outbox,
    Receiver,
    load_receivers,
)
from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.store.server import ClickHouseServerStore
from tracehound.tracing.store.urls import TlsSpec, parse_server_url


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (and its key), made with openssl."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=120,
    )
    return cert, key


# -- ClickHouse -------------------------------------------------------------------------------

def test_secure_url_options_reach_the_driver(certificate: tuple[Path, Path]) -> None:
    ca = str(certificate[0])
    url = f"clickhouse://u:pw@ch.example:9440/db?secure=1&ca_certs={ca}"
    assert parse_server_url(url).tls == TlsSpec(verify=True, ca_certs=ca)
    assert parse_server_url("clickhouse://ch:9440/db?secure=1&verify=0").tls == TlsSpec(
        verify=False, ca_certs=None)
    assert parse_server_url("clickhouse://ch:9000/db").tls is None
    assert parse_server_url("clickhouse://ch:9000/db?secure=0").tls is None

    store = ClickHouseServerStore(url)
    try:
        connection = store._connection._client.connection
        assert (connection.secure_socket, connection.verify_cert, connection.check_hostname,
                connection.ssl_options) == (True, True, True, {"ca_certs": ca})
    finally:
        store.close()
    store = ClickHouseServerStore("clickhouse://u:pw@ch.example:9440/db?secure=1&verify=0")
    try:
        connection = store._connection._client.connection
        assert (connection.secure_socket, connection.verify_cert,
                connection.check_hostname) == (True, False, False)
    finally:
        store.close()
    store = ClickHouseServerStore("clickhouse://u:pw@ch.example:9000/db")
    try:
        assert store._connection._client.connection.secure_socket is False
    finally:
        store.close()


@pytest.mark.parametrize(("query", "message"), [
    ("secure=maybe", "parameter 'secure' is 'maybe'; expected 1 or 0"),
    ("verify=0", "parameter 'verify' needs TLS"),
    ("ca_certs=/etc/hosts", "parameter 'ca_certs' needs TLS"),
    ("secure=1&ca_certs=/no/such/ca.pem", "ca_certs file '/no/such/ca.pem' does not exist"),
    ("secure=1&secure=1", "parameter 'secure' is given 2 times"),
    ("secur=1", "unknown parameter 'secur'"),
])
def test_bad_tls_parameters_name_the_parameter(query: str, message: str) -> None:
    url = f"clickhouse://u:hunter2-canary@ch:9440/db?{query}"
    with pytest.raises(StoreConfigError) as raised:
        parse_server_url(url)
    assert message in str(raised.value)
    assert "hunter2-canary" not in str(raised.value)
    assert "u:***@ch:9440" in str(raised.value)


@pytest.mark.clickhouse_server
@pytest.mark.parametrize("verify", ["1", "0"])
def test_tls_to_a_plain_server_fails_clearly(clickhouse_url: str, verify: str) -> None:
    from urllib.parse import urlsplit

    port = urlsplit(clickhouse_url).port
    url = f"clickhouse://default:tls-canary@127.0.0.1:{port}/tracehound_tls?secure=1&verify={verify}"
    store = ClickHouseServerStore(url)
    try:
        with pytest.raises(StoreConfigError) as raised:
            store.ensure_schema()
    finally:
        store.close()
    message = str(raised.value)
    assert message.startswith(
        f"ClickHouse at clickhouse://default:***@127.0.0.1:{port}/tracehound_tls?secure=1"
        f"&verify={verify}: TLS handshake failed ("), message
    assert "is this the server's secure native port (tcp_port_secure, usually 9440)?" in message
    assert "tls-canary" not in message


# -- webhooks ---------------------------------------------------------------------------------

@pytest.fixture
def https_receiver(certificate: tuple[Path, Path]) -> Iterator[tuple[str, list[bytes]]]:
    """An https:// receiver on 127.0.0.1 with the self-signed certificate; the bodies it got."""
    bodies: list[bytes] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            bodies.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(certificate[0]), str(certificate[1]))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/hooks/tok-canary", bodies
    finally:
        server.shutdown()
        server.server_close()


def make_alert() -> Alert:
    return Alert(job="tls-job", incident_id="tls-job/0/1", attempt=0, kind="crash",
                 status="firing", summary="rank 0 crashed", culprit_ranks=(0,),
                 culprit_nodes=("n0",), confidence=1.0, severity="critical",
                 at_us=1_700_000_000_000_000)


def test_an_untrusted_certificate_is_refused_and_the_delivery_kept(
        tmp_path: Path, https_receiver: tuple[str, list[bytes]],
        caplog: pytest.LogCaptureFixture) -> None:
    url, bodies = https_receiver
    port = url.split(":")[2].split("/")[0]
    dispatcher = Dispatcher(Outbox(tmp_path, [
        Receiver(name="hook", kind="webhook", url=url, secret="s", timeout_s=5.0)]))
    assert dispatcher.enqueue(make_alert()) == 1
    assert dispatcher.deliver_once(now=0.0) == 0
    counts = dispatcher.counts()
    assert (counts.delivered, counts.retries, counts.failed, counts.pending) == (0, 1, 0, 1)
    assert bodies == []
    (record,) = [r for r in caplog.records if "failed (try 1)" in r.getMessage()]
    message = record.getMessage()
    assert f"https://127.0.0.1:{port}/...: TLS certificate not trusted (" in message
    assert "name its CA in the receiver's ca_file" in message
    assert "tok-canary" not in message


def test_a_receiver_with_its_ca_file_is_delivered_over_tls(
        tmp_path: Path, https_receiver: tuple[str, list[bytes]],
        certificate: tuple[Path, Path]) -> None:
    url, bodies = https_receiver
    (tmp_path / "receivers.json").write_text(json.dumps({"receivers": [
        {"name": "hook", "kind": "webhook", "url": url, "secret": "s",
         "ca_file": str(certificate[0])}]}))
    (receiver,) = load_receivers(tmp_path / "receivers.json")
    assert receiver.ca_file == str(certificate[0])
    dispatcher = Dispatcher(Outbox(tmp_path / "outbox", [receiver]))
    dispatcher.enqueue(make_alert())
    assert dispatcher.deliver_once(now=0.0) == 1
    counts = dispatcher.counts()
    assert (counts.delivered, counts.retries, counts.failed, counts.pending) == (1, 0, 0, 0)
    assert len(bodies) == 1
    assert json.loads(bodies[0])["incident_id"] == "tls-job/0/1"


@pytest.mark.parametrize(("entry", "message"), [
    ({"url": "http://127.0.0.1:1/x", "ca_file": "/etc/hosts"},
     "receivers[0].ca_file: only for an https:// url"),
    ({"url": "https://127.0.0.1:1/x", "ca_file": "/no/such/ca.pem"},
     "receivers[0].ca_file: '/no/such/ca.pem' is not a file"),
    ({"url": "https://127.0.0.1:1/x", "ca_file": 3},
     "receivers[0].ca_file: expected a string, got 3"),
])
def test_bad_ca_files_name_the_field(tmp_path: Path, entry: dict[str, Any],
                                     message: str) -> None:
    path = tmp_path / "receivers.json"
    path.write_text(json.dumps({"receivers": [
        {"name": "hook", "kind": "slack", **entry}]}))
    with pytest.raises(AlertConfigError) as raised:
        load_receivers(path)
    assert str(raised.value) == f"{path}: {message}"
