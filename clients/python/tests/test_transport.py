"""Retries of the client's own transport failures, against real processes: a closed port, a
server restarted mid-test, a server that stops answering for a while."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import urllib3

import onceguard
from onceguard import Acquired, Replay, Retry
from onceguard._http import Response

from .conftest import Server, free_port

FAST = Retry(attempts=40, initial=0.05, max_delay=0.25)


def test_backoff_is_bounded() -> None:
    retry = Retry(attempts=10, initial=0.1, max_delay=1.0, jitter=False)
    assert [retry.delay(n) for n in (1, 2, 3, 4, 5, 9)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert retry.delay(1, retry_after=30) == 1.0  # a Retry-After is honoured up to max_delay
    jittered = Retry(initial=0.4, max_delay=1.0)
    assert all(0.2 <= jittered.delay(2) <= 0.8 for _ in range(50))


def test_a_closed_port_is_a_transport_error_after_the_retries() -> None:
    with onceguard.Client(f"http://127.0.0.1:{free_port()}", "og_x_y", retry=Retry(attempts=3, initial=0.01)) as c:
        with pytest.raises(onceguard.TransportError) as e:
            c.claim("t/a", "k", request=1)
    assert e.value.attempts == 3 and not e.value.maybe_sent
    assert isinstance(e.value.__cause__, urllib3.exceptions.NewConnectionError)
    with onceguard.Client(f"http://127.0.0.1:{free_port()}") as down:
        assert not down.ready()


async def test_async_closed_port_is_a_transport_error() -> None:
    async with onceguard.AsyncClient(f"http://127.0.0.1:{free_port()}", retry=Retry(attempts=2, initial=0.01)) as c:
        with pytest.raises(onceguard.TransportError) as e:
            await c.get_record("t/a", "k")
    assert e.value.attempts == 2 and not e.value.maybe_sent
    assert isinstance(e.value.__cause__, aiohttp.ClientConnectorError)


def test_a_closed_client_refuses_to_send(server: Server) -> None:
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
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server answers a request in absolute form as a forward proxy would pass it on: a client
    # of a host that does not resolve reaches it only through the proxy.
    unresolvable = "http://onceguard.invalid:9"
    monkeypatch.setenv("HTTP_PROXY", server.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("http_proxy", raising=False)
    with onceguard.Client(unresolvable, server.admin_key, retry=onceguard.NO_RETRY) as c:
        assert c.ready(), "through the proxy"
    monkeypatch.setenv("NO_PROXY", "onceguard.invalid")
    with onceguard.Client(unresolvable, server.admin_key, retry=onceguard.NO_RETRY) as c:
        assert not c.ready(), "exempt: sent directly, to a host that does not resolve"


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


def test_calls_ride_out_a_server_restart(binary: Path) -> None:
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


def test_records_survive_a_restart_on_sqlite(sqlite_server: Server) -> None:
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


def test_a_read_timeout_is_retried_for_idempotent_calls_only(memory_server: Server) -> None:
    own_server = memory_server
    timeout = onceguard.Timeout(read=0.3, connect=1.0)
    with onceguard.Client(own_server.url, own_server.admin_key, retry=FAST, timeout=timeout) as c:
        a = c.claim("pause/test", "k", request=1)
        assert isinstance(a, Acquired)
        own_server.pause()  # it accepts connections but answers nothing: read timeouts
        threading.Timer(0.8, own_server.resume).start()
        started = time.monotonic()
        record = c.complete("pause/test", "k", a.fence, "ok")  # idempotent by fence: retried
        assert record.state == "completed" and time.monotonic() - started >= 0.5

        own_server.pause()
        resume = threading.Timer(0.8, own_server.resume)
        resume.start()
        try:
            with pytest.raises(onceguard.TransportError) as e:
                c.create_api_key("agent", "not retried")  # not idempotent: one try
        finally:
            resume.join()
        assert e.value.attempts == 1 and e.value.maybe_sent
        assert isinstance(e.value.__cause__, urllib3.exceptions.ReadTimeoutError)


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
