"""``onceguard.a2a`` with the real ``a2a-sdk`` client over its JSON-RPC transport, answered by an
``httpx.MockTransport`` (no server): what reaches the wire is the step's key as
``Idempotency-Key`` and as an empty message's ``messageId``, and the run as
``X-Onceguard-Run-Id``, per request, sent and streamed alike. The gateway's side is
tests/a2a/test_gateway.py."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.types.a2a_pb2 import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
)

from onceguard import derive_key
from onceguard.a2a import OnceA2AClient, step_key
from onceguard.keys import check_key

URL = "http://agent.test/"


class Agent:
    """Answers every JSON-RPC request with one message, and keeps what it was sent."""

    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        body = json.loads(request.content)
        answer = {
            "jsonrpc": "2.0",
            "id": body["id"],
            "result": {"message": {"messageId": "answer-1", "role": "ROLE_AGENT", "parts": [{"text": "ok"}]}},
        }
        if body["method"] == "SendStreamingMessage":
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=f"data: {json.dumps(answer)}\n\n")
        return httpx.Response(200, json=answer)


def connect(agent: Agent, streaming: bool = False) -> tuple[httpx.AsyncClient, Any]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(agent), headers={"x-onceguard-key": "og_test"})
    card = AgentCard(
        name="agent",
        description="",
        version="1",
        supported_interfaces=[AgentInterface(protocol_binding="JSONRPC", url=URL, protocol_version="1.0")],
        capabilities=AgentCapabilities(streaming=True),
    )
    return http, ClientFactory(ClientConfig(httpx_client=http, streaming=streaming)).create(card)


def send_request(text: str, message_id: str = "") -> SendMessageRequest:
    return SendMessageRequest(message=Message(role=Role.ROLE_USER, parts=[Part(text=text)], message_id=message_id))


async def send(wrapper: OnceA2AClient, request: SendMessageRequest, step: str, **kw: Any) -> list[StreamResponse]:
    return [event async for event in wrapper.send_message(request, step=step, **kw)]


def test_a_step_key_is_stable_and_differs_by_run_step_and_version() -> None:
    key = step_key("run-1", "research")
    assert key == step_key("run-1", "research") == derive_key("a2a", "v1", {"run": "run-1", "step": "research"})
    assert key.startswith("a2a:v1:") and len(key) == 71 and check_key(key) == key
    # The TypeScript client's a2aKey("run-1", "research") (onceguard/a2a) is this key too.
    assert key == "a2a:v1:43e05f71b4ab612f05bf762c738cdf94c6a7315bc0fd2eefe36a56a2caf91d54"
    others = {step_key("run-2", "research"), step_key("run-1", "review"), step_key("run-1", "research", version="v2")}
    assert key not in others and len(others) == 3
    assert check_key(step_key("run-1", "étape ünïcode " * 40)), "any step gives a valid key"


@pytest.mark.parametrize("streaming", [False, True], ids=["send", "stream"])
async def test_the_key_and_the_run_go_with_each_send(streaming: bool) -> None:
    agent = Agent()
    http, client = connect(agent, streaming=streaming)
    async with http, OnceA2AClient(client, "run-1") as wrapper:
        request = send_request("refund order 7")
        events = await send(wrapper, request, "refund")
        await send(wrapper, send_request("refund order 7"), "refund")
        await send(wrapper, send_request("review"), "review")

    assert [e.message.parts[0].text for e in events] == ["ok"]
    assert request.message.message_id == "", "the caller's request is not changed"
    first, again, other = agent.requests
    key = step_key("run-1", "refund")
    for sent, expected in ((first, key), (again, key), (other, step_key("run-1", "review"))):
        assert sent.headers.get_list("idempotency-key") == [expected]
        assert sent.headers.get_list("x-onceguard-run-id") == ["run-1"]
        assert sent.headers["x-onceguard-key"] == "og_test", "the http client's own headers still go"
    bodies = agent.bodies()
    assert [b["method"] for b in bodies] == ["SendStreamingMessage" if streaming else "SendMessage"] * 3
    assert [b["params"]["message"]["messageId"] for b in bodies] == [key, key, step_key("run-1", "review")]


async def test_a_message_id_and_the_callers_context_are_kept() -> None:
    agent = Agent()
    http, client = connect(agent)
    context = ClientCallContext(
        timeout=12.0, service_parameters={"A2A-Extensions": "urn:x", "idempotency-key": "mine", "X-ONCEGUARD-RUN-ID": "r"}
    )
    async with http, OnceA2AClient(client, "run-2", version="v7") as wrapper:
        await send(wrapper, send_request("hello", message_id="msg-given"), "greet", context=context)

    (sent,) = agent.requests
    key = step_key("run-2", "greet", version="v7")
    assert sent.headers.get_list("idempotency-key") == [key], "the step's key replaces the context's"
    assert sent.headers.get_list("x-onceguard-run-id") == ["run-2"]
    assert sent.headers["a2a-extensions"] == "urn:x"
    assert sent.extensions["timeout"]["read"] == 12.0, "the context's timeout still applies"
    assert agent.bodies()[0]["params"]["message"]["messageId"] == "msg-given"
    assert context.service_parameters == {"A2A-Extensions": "urn:x", "idempotency-key": "mine", "X-ONCEGUARD-RUN-ID": "r"}


@pytest.mark.parametrize("run_id", ["", "a run", "r" * 129, "runé"])
def test_a_run_id_the_gateway_would_refuse_is_refused_here(run_id: str) -> None:
    with pytest.raises(ValueError, match="run id"):
        OnceA2AClient(object(), run_id)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="run id"):
        step_key(run_id, "research")


def test_an_empty_step_is_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        step_key("run-1", "")
