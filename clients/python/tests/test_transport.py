"""Retries of the client's own transport failures, against real processes: a closed port, a
server restarted mid-test, a server that stops answering for a while; and https. The sync
client's cases run on each of its transports (libcurl's and urllib3's)."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pycurl
import pytest
import trustme
import urllib3

import onceguard
from onceguard import Acquired, Replay, Retry
from onceguard._curl import CurlTransport
from onceguard._http import MaybeSent, Response
from onceguard._sync import _backend

from .conftest import Server, free_port

FAST = Retry(attempts=40, initial=0.05, max_delay=0.25)

#: The sync client's transports, and the error each one's failure carries as its cause: a refused
#: connection, a read timeout.
TRANSPORTS = {
    "curl": (CurlTransport, lambda e: isinstance(e, pycurl.error) and e.args[0] == pycurl.E_COULDNT_CONNECT,
             lambda e: isinstance(e, pycurl.error) and e.args[0] == pycurl.E_OPERATION_TIMEDOUT),
    "urllib3": (_backend.Urllib3Transport, lambda e: isinstance(e, urllib3.exceptions.NewConnectionError),
                lambda e: isinstance(e, urllib3.exceptions.ReadTimeoutError)),
}


@pytest.fixture(params=list(TRANSPORTS))
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The sync client's transport for this test (each in turn)."""
    monkeypatch.setattr(_backend, "Transport", TRANSPORTS[request.param][0])
    return str(request.param)


def test_the_sync_client_sends_through_libcurl_where_pycurl_is_installed() -> None:
    assert _backend.Transport is CurlTransport
    with onceguard.Client("http://127.0.0.1:9") as c:
        assert isinstance(c._transport, CurlTransport)


def test_without_pycurl_the_sync_client_sends_through_urllib3() -> None:
    # A process of its own, where importing pycurl fails as it does where it is not installed.
    check = (
        "import sys; sys.modules['pycurl'] = None\n"
        "import onceguard\n"
        "from onceguard._sync import _backend\n"
        "with onceguard.Client('http://127.0.0.1:9') as c:\n"
        "    assert type(c._transport) is _backend.Urllib3Transport, c._transport\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_backoff_is_bounded() -> None:
    retry = Retry(attempts=10, initial=0.1, max_delay=1.0, jitter=False)
    assert [retry.delay(n) for n in (1, 2, 3, 4, 5, 9)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert retry.delay(1, retry_after=30) == 1.0  # a Retry-After is honoured up to max_delay
    jittered = Retry(initial=0.4, max_delay=1.0)
    assert all(0.2 <= jittered.delay(2) <= 0.8 for _ in range(50))


def test_a_closed_port_is_a_transport_error_after_the_retries(transport: str) -> None:
    with onceguard.Client(f"http://127.0.0.1:{free_port()}", "og_x_y", retry=Retry(attempts=3, initial=0.01)) as c:
        with pytest.raises(onceguard.TransportError) as e:
            c.claim("t/a", "k", request=1)
    assert e.value.attempts == 3 and not e.value.maybe_sent
    assert TRANSPORTS[transport][1](e.value.__cause__), e.value.__cause__
    with onceguard.Client(f"http://127.0.0.1:{free_port()}") as down:
        assert not down.ready()


async def test_async_closed_port_is_a_transport_error() -> None:
    async with onceguard.AsyncClient(f"http://127.0.0.1:{free_port()}", retry=Retry(attempts=2, initial=0.01)) as c:
        with pytest.raises(onceguard.TransportError) as e:
            await c.get_record("t/a", "k")
    assert e.value.attempts == 2 and not e.value.maybe_sent
    assert isinstance(e.value.__cause__, aiohttp.ClientConnectorError)


def test_a_closed_client_refuses_to_send(server: Server, transport: str) -> None:
    c = onceguard.Client(server.url, server.admin_key)
    assert c.ready()
    c.close()
    with pytest.raises(RuntimeError, match="closed"):
        c.ready()


async def test_a_closed_async_client_refuses_to_send(server: Server) -> None:
    c = onceguard.AsyncClient(server.url, server.admin_key)
    assert await c.ready()
    await c.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        await c.ready()


def test_the_environment_s_proxy_is_used_unless_no_proxy_exempts_the_host(
    server: Server, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    # The server answers a request in absolute form as a forward proxy would pass it on: a client
    # of a host that does not resolve reaches it only through the proxy.
    unresolvable = "http://onceguard.invalid:9"
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HTTP_PROXY", "http_proxy"):
        monkeypatch.setenv(name, server.url)
    with onceguard.Client(unresolvable, server.admin_key, retry=onceguard.NO_RETRY) as c:
        assert c.ready(), "through the proxy"
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.setenv(name, "onceguard.invalid")
    with onceguard.Client(unresolvable, server.admin_key, retry=onceguard.NO_RETRY) as c:
        assert not c.ready(), "exempt: sent directly, to a host that does not resolve"
    # The environment is read once, when the client is made: a proxy named after that (here one
    # that refuses connections) is not used.
    for name in ("NO_PROXY", "no_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    with onceguard.Client(server.url, server.admin_key, retry=onceguard.NO_RETRY) as c:
        for name in ("HTTP_PROXY", "http_proxy"):
            monkeypatch.setenv(name, f"http://127.0.0.1:{free_port()}")
        assert c.ready(), "sent directly, as decided when the client was made"


async def test_the_async_client_uses_the_environment_s_proxy(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    unresolvable = "http://onceguard.invalid:9"
    monkeypatch.setenv("HTTP_PROXY", server.url)
    for name in ("NO_PROXY", "no_proxy", "http_proxy"):
        monkeypatch.delenv(name, raising=False)
    async with onceguard.AsyncClient(unresolvable, server.admin_key, retry=onceguard.NO_RETRY) as c:
        assert await c.ready(), "through the proxy"
    monkeypatch.setenv("NO_PROXY", "onceguard.invalid")
    async with onceguard.AsyncClient(unresolvable, server.admin_key, retry=onceguard.NO_RETRY) as c:
        assert not await c.ready()


@pytest.fixture
def sqlite_server(binary: Path, tmp_path: Path) -> Iterator[Server]:
    """A server of this test's own, on SQLite, so that its records survive a restart."""
    srv = Server(binary, store=f"sqlite://{tmp_path}/onceguard.db")
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture
def memory_server(binary: Path) -> Iterator[Server]:
    """A server of this test's own, which it may pause."""
    srv = Server(binary)
    srv.start()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="module")
def tls_server(binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """A server of this module's own serving https with a certificate for 127.0.0.1 of a CA
    made for the test, and the file of that CA."""
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    files = tmp_path_factory.mktemp("tls")
    chain, key, ca_file = files / "chain.pem", files / "key.pem", files / "ca.pem"
    chain.write_bytes(b"".join(blob.bytes() for blob in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    srv = Server(binary, tls=(chain, key))
    srv.start()
    yield srv, ca_file
    srv.cleanup()


def test_https_with_the_server_s_ca_and_without_a_check(tls_server: tuple[Server, Path], transport: str) -> None:
    srv, ca_file = tls_server
    with onceguard.Client(srv.url, srv.admin_key, verify=str(ca_file)) as c:
        assert c.ready()
        held = c.claim("tls/test", f"k-{transport}", request=1)
        assert isinstance(held, Acquired)
        c.complete("tls/test", f"k-{transport}", held.fence, {"over": "tls"})
        again = c.claim("tls/test", f"k-{transport}", request=1)
        assert isinstance(again, Replay) and again.result == {"over": "tls"}
    with onceguard.Client(srv.url, srv.admin_key, verify=False) as unchecked:
        assert unchecked.ready()


def test_https_checks_against_the_authorities_python_trusts_by_default(
    tls_server: tuple[Server, Path], transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, ca_file = tls_server
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))  # Python's ssl then trusts the test's CA
    with onceguard.Client(srv.url, srv.admin_key, retry=onceguard.NO_RETRY) as c:
        assert c.ready()


def test_https_refuses_a_certificate_of_an_authority_it_does_not_trust(
    tls_server: tuple[Server, Path], transport: str
) -> None:
    srv, _ = tls_server
    with onceguard.Client(srv.url, srv.admin_key, retry=onceguard.NO_RETRY) as c:  # the system's authorities
        assert not c.ready()
        with pytest.raises(onceguard.TransportError) as e:
            c.claim("tls/test", "refused", request=1)
    assert "certificate" in str(e.value).lower()
    if transport == "curl":  # the handshake failed: no byte of the request left
        assert not e.value.maybe_sent


async def test_async_https_with_the_server_s_ca(tls_server: tuple[Server, Path]) -> None:
    srv, ca_file = tls_server
    async with onceguard.AsyncClient(srv.url, srv.admin_key, verify=str(ca_file)) as c:
        assert await c.ready()
    async with onceguard.AsyncClient(srv.url, srv.admin_key, retry=onceguard.NO_RETRY) as untrusted:
        assert not await untrusted.ready()


def test_calls_ride_out_a_server_restart(binary: Path, transport: str) -> None:
    # Anonymous access, so that the restarted process (a new memory store) accepts the same caller.
    srv = Server(binary, env={"ONCEGUARD_AUTH__ALLOW_ANONYMOUS": "true"})
    srv.start()
    try:
        with onceguard.Client(srv.url, retry=FAST) as c:
            assert isinstance(c.claim("restart/test", "k", request=1), Acquired)
            srv.stop()  # the pooled keep-alive connection dies with it
            restarter = threading.Timer(0.5, srv.start)
            restarter.start()
            try:
                # Refused connections while it is down are retried until the new process answers.
                answer = c.claim("restart/test", "k2", request=1)
            finally:
                restarter.join()
            assert isinstance(answer, Acquired)
    finally:
        srv.cleanup()


def test_records_survive_a_restart_on_sqlite(sqlite_server: Server, transport: str) -> None:
    own_server = sqlite_server
    with onceguard.Client(own_server.url, own_server.admin_key, retry=FAST) as c:
        a = c.claim("restart/test", "k", request={"n": 1})
        assert isinstance(a, Acquired)

        own_server.stop()
        restarter = threading.Timer(0.5, own_server.start)
        restarter.start()
        try:
            record = c.complete("restart/test", "k", a.fence, {"done": True})  # retried until it is back
        finally:
            restarter.join()
        assert record.state == "completed"
        replay = c.claim("restart/test", "k", request={"n": 1})
        assert isinstance(replay, Replay) and replay.result == {"done": True}


def test_a_read_timeout_is_retried_for_idempotent_calls_only(memory_server: Server, transport: str) -> None:
    own_server = memory_server
    timeout = onceguard.Timeout(read=0.3, connect=1.0)
    with onceguard.Client(own_server.url, own_server.admin_key, retry=FAST, timeout=timeout) as c:
        a = c.claim("pause/test", "k", request=1)
        assert isinstance(a, Acquired)
        own_server.pause()  # it accepts connections but answers nothing: read timeouts
        started = time.monotonic()
        threading.Timer(0.8, own_server.resume).start()
        record = c.complete("pause/test", "k", a.fence, "ok")  # idempotent by fence: retried
        assert record.state == "completed" and time.monotonic() - started >= 0.8

        # Paused until the call has ended: however late the call is sent, the server cannot
        # answer it, so a retry could only time out again.
        own_server.pause()
        try:
            with pytest.raises(onceguard.TransportError) as e:
                c.create_api_key("agent", "not retried")  # not idempotent: one try
        finally:
            own_server.resume()
        assert e.value.attempts == 1 and e.value.maybe_sent
        assert TRANSPORTS[transport][2](e.value.__cause__), e.value.__cause__


def _batch_answer(*items: str) -> Response:
    return Response(200, content=('{"results":[' + ",".join(items) + "]}").encode())


REPLAY = '{{"status":200,"body":{{"outcome":"replay","fence":{f},"attempt":1,"completed_at":"2026-12-01T00:00:00Z","status":"success","content_type":"application/json","result":{r}}}}}'


def test_a_batch_of_replays_gives_each_its_stored_bytes() -> None:
    from onceguard._calls import _read_claim_batch

    results = ['{"v":[1.50, 2e0]}', "[0.10,0.2]", '"result\\":x"', "1.0"]
    answers = _read_claim_batch(_batch_answer(*(REPLAY.format(f=i, r=r) for i, r in enumerate(results))), 4)
    assert [a.raw for a in answers if isinstance(a, Replay)] == [r.encode() for r in results]


def test_a_batch_with_an_acquisition_whose_checkpoint_names_a_result_gives_each_replay_its_own_bytes() -> None:
    from onceguard._calls import _read_claim_batch

    acquired = (
        '{"status":201,"body":{"outcome":"acquired","fence":9,"attempt":2,"lease_expires_at":"2026-12-01T00:00:00Z",'
        '"recovery":{"previous_fence":8,"previous_attempt":1,"reason":"lease_expired","detail":null,'
        '"last_checkpoint":{"name":"n","data":{"result":1.00},"fence":8,"at":"2026-12-01T00:00:00Z"}}}}'
    )
    in_flight = '{"status":409,"body":{"type":"https://onceguard.dev/problems/in-flight","title":"t","status":409,"detail":"\\"result\\": held","retry_after_ms":5}}'
    answers = _read_claim_batch(_batch_answer(acquired, in_flight, REPLAY.format(f=3, r="1.0")), 3)
    assert isinstance(answers[0], Acquired)
    assert isinstance(answers[2], Replay) and answers[2].raw == b"1.0", "the replay's own bytes, not the checkpoint's"


class _Recording(http.server.BaseHTTPRequestHandler):
    """Answers every request `200 ok` (with a header given twice) on a kept connection, and
    notes what it was sent."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {name.lower(): value for name, value in self.headers.items()}
        self.server.seen.append((self.command, self.path, body, headers))  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("content-length", "2")
        self.send_header("x-twice", "a")
        self.send_header("x-twice", "b")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("kind", list(TRANSPORTS))
def test_one_kept_connection_sends_each_request_as_given(kind: str) -> None:
    # Methods with and without bodies in turn on one connection: nothing of a request (its
    # method, body or headers) carries over to the next.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recording)
    server.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    json_body = {"content-type": "application/json"}
    sent: list[tuple[str, str, bytes | None, dict[str, str] | None]] = [
        ("POST", "/a", b'{"x":1}', json_body),
        ("GET", "/b", None, None),
        ("PUT", "/c", b"[2]", json_body),
        ("DELETE", "/d", None, None),
        ("POST", "/e", b"", None),
        ("GET", "/f", None, None),
    ]
    try:
        base = f"http://127.0.0.1:{server.server_port}/base"
        transport = TRANSPORTS[kind][0](base, {"x-user": "José", "x-empty": ""}, max_connections=1, verify=True)
        for method, path, body, headers in sent:
            params = {"q": "a b"} if path == "/f" else None
            answer = transport.send(method, path, params, body, headers, onceguard.Timeout(), idempotent=True)
            assert (answer.status_code, answer.content, answer.headers["x-twice"]) == (200, b"ok", "a, b")
        transport.close()
    finally:
        server.shutdown()
        server.server_close()
    seen = server.seen  # type: ignore[attr-defined]
    assert [(m, p, b) for m, p, b, _ in seen] == [
        ("POST", "/base/a", b'{"x":1}'),
        ("GET", "/base/b", b""),
        ("PUT", "/base/c", b"[2]"),
        ("DELETE", "/base/d", b""),
        ("POST", "/base/e", b""),
        ("GET", "/base/f?q=a%20b", b""),
    ]
    for (method, path, body, headers), (_, _, given, _) in zip(seen, sent):
        assert (headers["x-user"], headers["x-empty"]) == ("José", ""), headers  # latin-1, as urllib3
        assert ("content-type" in headers) == (path in ("/base/a", "/base/c")), (path, headers)
        assert int(headers.get("content-length", "0")) == len(given or b""), (method, path, headers)
        assert "expect" not in headers


@pytest.mark.parametrize("kind", list(TRANSPORTS))
def test_a_call_that_is_not_idempotent_reaches_the_server_once_when_its_connection_drops(kind: str) -> None:
    # The server reads the first `POST /once` whole and closes the connection without answering;
    # it answers every other request. A transport that sent it again would get that answer.
    paths: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        dropped = False
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as reader:
                while line := reader.readline():
                    path, length = line.split()[1].decode(), 0
                    while (header := reader.readline()) not in (b"\r\n", b""):
                        if header.lower().startswith(b"content-length:"):
                            length = int(header.split(b":")[1])
                    reader.read(length)
                    paths.append(path)
                    if path == "/once" and not dropped:
                        dropped = True
                        break
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    threading.Thread(target=serve, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{listener.getsockname()[1]}"
        transport = TRANSPORTS[kind][0](base, {}, max_connections=1, verify=True)
        timeout = onceguard.Timeout(read=5.0, connect=1.0)
        kept = transport.send("POST", "/first", None, b"{}", None, timeout, idempotent=True)
        assert kept.status_code == 200
        with pytest.raises(MaybeSent):
            transport.send("POST", "/once", None, b"{}", None, timeout, idempotent=False)
        after = transport.send("GET", "/after", None, None, None, timeout, idempotent=True)
        assert after.status_code == 200
        transport.close()
    finally:
        listener.close()
    assert paths.count("/once") == 1, paths
