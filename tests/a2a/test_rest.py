"""The A2A gateway's HTTP+JSON binding with the a2a-sdk client's REST transport, a kill switch
that revokes leases (the tasks it covers are cancelled upstream), and the gateway's metrics.
The world is test_gateway's (the same agent and store), with a gateway that serves both
bindings (`--rest-upstream`)."""

import asyncio
import re
import time
from contextlib import asynccontextmanager

import httpx
import pytest
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import GetTaskRequest

from test_gateway import (
    KEY_HEADER,
    TENANT,
    UPSTREAM_NAME,
    Gateway,
    World,
    connect,
    error_code,
    message,
    onceguard,
    replayed,
    run,
    send,
    unique,
)


@pytest.fixture(scope="module")
def world():
    w = World()
    w.gateway.stop()
    w.gateway = Gateway(
        w.store, w.upstream, w.dir, UPSTREAM_NAME, "--lease", "5s", "--wait", "10s",
        "--rest-upstream", w.upstream + "rest", command="a2a", path="/",
    )
    yield w
    w.close()


@asynccontextmanager
async def connect_rest(world: World, token: str | None = None):
    """An a2a-sdk client that speaks HTTP+JSON, through the gateway's card."""
    http = httpx.AsyncClient(headers={KEY_HEADER: token or world.token}, timeout=30)
    try:
        card = await A2ACardResolver(http, world.gateway.url).get_agent_card()
        rest = [i.url for i in card.supported_interfaces if i.protocol_binding == "HTTP+JSON"]
        assert rest == [world.gateway.url + "rest"], f"the card sends HTTP+JSON clients to {rest}"
        config = ClientConfig(httpx_client=http, streaming=False, supported_protocol_bindings=["HTTP+JSON"])
        client = ClientFactory(config).create(card)
        yield client
        await client.close()
    finally:
        await http.aclose()


def test_a_duplicate_send_by_http_json_executes_once(world):
    text, mid = f"task {unique('r')}", unique("msg")

    async def go():
        async with connect_rest(world) as client:
            first = await send(client, message(text, mid))
            second = await send(client, message(text, mid))
        async with connect(world) as client:
            by_json_rpc = await send(client, message(text, mid))
        return first, second, by_json_rpc

    first, second, by_json_rpc = run(go())
    assert first.task.id == second.task.id == by_json_rpc.task.id, (first, second)
    assert not replayed(first) and replayed(second) and replayed(by_json_rpc), "both bindings share the key"
    assert world.executions(text=text) == 1


def test_another_callers_task_is_not_found_by_http_json(world):
    text, mid = f"task {unique('r')}", unique("msg")

    async def go():
        async with connect_rest(world) as client:
            first = await send(client, message(text, mid))
        async with connect_rest(world, world.other_token) as other:
            with pytest.raises(Exception) as refused:
                await other.get_task(GetTaskRequest(id=first.task.id))
        return first, refused.value

    first, refused = run(go())
    print(f"another caller's GetTask by HTTP+JSON: {refused!r}")
    assert error_code(refused) == -32001, repr(refused)
    assert world.executions(text=text) == 1


def test_a_refusal_by_http_json_has_the_problems_status_and_kind(world):
    mid = unique("msg")
    body = {"message": {"messageId": mid, "role": "ROLE_USER", "parts": [{"text": f"echo {unique('r')}"}]}}
    headers = {KEY_HEADER: world.token, "A2A-Version": "1.0"}
    first = httpx.post(world.gateway.url + "rest/message:send", json=body, headers=headers, timeout=10)
    body["message"]["parts"] = [{"text": "echo something else"}]
    mismatch = httpx.post(world.gateway.url + "rest/message:send", json=body, headers=headers, timeout=10)
    unknown = httpx.post(world.gateway.url + "rest/message:other", json=body, headers=headers, timeout=10)
    print(mismatch.text)
    assert first.status_code == 200 and "message" in first.json()
    assert mismatch.status_code == 422
    assert mismatch.json()["error"]["details"][0]["reason"] == "FINGERPRINT_MISMATCH"
    assert unknown.status_code == 404, "a path the binding does not name is refused, never forwarded"
    assert world.executions(text="echo something else") == 0


def test_a_switch_that_revokes_leases_cancels_the_tasks_it_covers(world):
    """A `long` task (30 s) started through the gateway; a switch on the sends' namespace with
    --revoke-leases: the gateway sends CancelTask for it (the agent logs one cancel), and a
    duplicate after the release answers the canceled task, never a second execution."""
    namespace = f"a2a/{UPSTREAM_NAME}"
    text, mid = f"long {unique('v')}", unique("msg")

    async def go():
        async with connect(world) as client:
            first = await send(client, message(text, mid), return_immediately=True)
            onceguard_switch("engage", "--revoke-leases", "--reason", "e2e revoke")
            try:
                deadline = time.monotonic() + 10
                while not world.rows(task=first.task.id, step="cancel"):
                    assert time.monotonic() < deadline, "no CancelTask reached the agent within 10 s"
                    await asyncio.sleep(0.2)
            finally:
                onceguard_switch("release")
                await asyncio.sleep(1.0)
            after = await send(client, message(text, mid))
            return first, after

    def onceguard_switch(action: str, *extra: str) -> None:
        onceguard(world.store, "switch", action, "--tenant", TENANT, "--namespace", namespace, *extra)

    first, after = run(go())
    assert after.task.id == first.task.id, after
    assert world.executions(text=text) == 1
    assert len(world.rows(task=first.task.id, step="cancel")) == 1


def test_the_gateway_counts_what_it_did(world):
    text, mid = f"echo {unique('m')}", unique("msg")

    async def go():
        async with connect(world) as client:
            await send(client, message(text, mid))
            await send(client, message(text, mid))

    run(go())
    metrics = httpx.get(world.gateway.url + "_onceguard/metrics", timeout=10).text
    counted = {
        outcome: sum(float(v) for v in re.findall(
            rf'onceguard_a2a_requests_total{{[^}}]*method="SendMessage"[^}}]*outcome="{outcome}"[^}}]*}} (\S+)', metrics))
        for outcome in ("executed", "replayed")
    }
    print(counted)
    assert counted["executed"] >= 1 and counted["replayed"] >= 1, counted


def test_a_stream_cut_before_its_first_event_is_retried_safely(world):
    """A SendStreamingMessage whose caller hangs up as soon as the answer's head arrives (before
    any event); the caller sends the same message again: the agent ran once, and the retry gets
    the first send's task."""
    text, mid = f"task {unique('c')}", unique("msg")
    body = {
        "jsonrpc": "2.0", "id": 1, "method": "SendStreamingMessage",
        "params": {"message": {"messageId": mid, "role": "ROLE_USER", "parts": [{"text": text}]}},
    }
    headers = {KEY_HEADER: world.token, "A2A-Version": "1.0", "Accept": "text/event-stream"}

    async def go():
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", world.gateway.url, json=body, headers=headers) as cut:
                assert cut.status_code == 200
        async with connect(world) as client:
            return await send(client, message(text, mid))

    retried = run(go())
    rows = world.rows(text=text)
    assert world.executions(text=text) == 1
    assert retried.task.id == rows[0]["task"], (retried, rows)


def test_eight_callers_racing_over_two_gateways_execute_once_a_round(world):
    """Six rounds; in each, eight sends of one message at once through two gateway instances on
    one store (five through the first, three through the second), by JSON-RPC and by HTTP+JSON:
    one execution a round, and every send answers the same task."""
    other = Gateway(
        world.store, world.upstream, world.dir, UPSTREAM_NAME, "--lease", "5s", "--wait", "10s",
        "--rest-upstream", world.upstream + "rest", command="a2a", path="/",
    )

    async def one_round(i: int):
        text, mid = f"task {unique(f'race{i}')}", unique("msg")
        async with connect(world) as a, connect(world, url=other.url) as b, connect_rest(world) as c:
            clients = [a, b, c, a, b, c, a, b]
            answers = await asyncio.gather(*(send(client, message(text, mid)) for client in clients))
        return text, answers

    try:
        for i in range(6):
            text, answers = run(one_round(i))
            assert len({a.task.id for a in answers}) == 1, [a.task.id for a in answers]
            assert world.executions(text=text) == 1, f"round {i}"
    finally:
        other.stop()
