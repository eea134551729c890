"""``guard_function_tool`` with the real OpenAI Agents SDK and a scripted ``Model`` (no network):
the model emits the same tool call twice in one turn (two call ids) and again in a later turn;
the tool's effect happens once and every call gets the replayed result."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agents import Agent, ModelResponse, RunConfig, Runner, Usage, function_tool, set_tracing_disabled
from agents.models.interface import Model
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText

import onceguard
from onceguard.openai_agents import guard_function_tool

set_tracing_disabled(True)


def tool_call(name: str, args: dict[str, Any], call_id: str) -> ResponseFunctionToolCall:
    return ResponseFunctionToolCall(
        arguments=json.dumps(args), call_id=call_id, name=name, type="function_call", id=f"fc_{call_id}", status="completed"
    )


def message(text: str) -> ResponseOutputMessage:
    return ResponseOutputMessage(
        id="msg_1",
        content=[ResponseOutputText(text=text, type="output_text", annotations=[])],
        role="assistant",
        status="completed",
        type="message",
    )


class ScriptedModel(Model):
    """Plays a fixed list of turns; records the tool outputs it was sent."""

    def __init__(self, turns: list[list[Any]]) -> None:
        self.turns = list(turns)
        self.inputs: list[Any] = []

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        self.inputs.append(input)
        return ModelResponse(output=self.turns.pop(0), usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        raise NotImplementedError



class Ledger:
    def __init__(self) -> None:
        self.sent: list[str] = []


def send_invoice_tool(ledger: Ledger) -> Any:
    @function_tool
    def send_invoice(customer: str, amount: int) -> str:
        """Send an invoice."""
        ledger.sent.append(customer)
        return f"invoice {len(ledger.sent)} sent to {customer} for {amount}"

    return send_invoice


def script() -> list[list[Any]]:
    args = {"customer": "acme", "amount": 100}
    return [
        [tool_call("send_invoice", args, "call_1"), tool_call("send_invoice", args, "call_2")],
        [tool_call("send_invoice", args, "call_3")],
        [message("Invoice sent.")],
    ]


@pytest.mark.parametrize("client_kind", ["async", "sync"])
async def test_agent_repeats_a_tool_call_and_the_effect_happens_once(
    client_kind: str, client: onceguard.Client, aclient: onceguard.AsyncClient, ns: str
) -> None:
    ledger = Ledger()
    guard_client = aclient if client_kind == "async" else client
    tool = guard_function_tool(send_invoice_tool(ledger), guard_client, ns, run_id="run-agents-1")
    assert tool.name == "send_invoice" and "customer" in json.dumps(tool.params_json_schema)

    model = ScriptedModel(script())
    agent = Agent(name="billing", instructions="Bill customers.", tools=[tool], model=model)
    result = await Runner.run(agent, "bill acme", run_config=RunConfig(tracing_disabled=True))

    assert result.final_output == "Invoice sent."
    assert ledger.sent == ["acme"]
    outputs = [o for inputs in model.inputs for o in _outputs(inputs)]
    assert len(_outputs(model.inputs[-1])) == 3  # three calls answered
    assert set(outputs) == {"invoice 1 sent to acme for 100"}
    records = [r async for r in aclient.iter_records(namespace_prefix=ns, run="run-agents-1")]
    assert len(records) == 1 and records[0].state == "completed"


def _outputs(inputs: Any) -> list[str]:
    if not isinstance(inputs, list):
        return []
    return [i["output"] for i in inputs if isinstance(i, dict) and i.get("type") == "function_call_output"]


async def test_a_failing_tool_is_not_stored_and_the_model_sees_the_error(aclient: onceguard.AsyncClient, ns: str) -> None:
    attempts = []

    @function_tool
    def flaky(x: int) -> str:
        """Fails the first time."""
        attempts.append(x)
        if len(attempts) == 1:
            raise ConnectionError("upstream reset")
        return "ok"

    tool = guard_function_tool(flaky, aclient, ns, run_id="r")
    model = ScriptedModel(
        [[tool_call("flaky", {"x": 1}, "c1")], [tool_call("flaky", {"x": 1}, "c2")], [message("done")]]
    )
    agent = Agent(name="a", tools=[tool], model=model)
    await Runner.run(agent, "go", run_config=RunConfig(tracing_disabled=True))
    outputs = [o for inputs in model.inputs for o in _outputs(inputs)]
    assert attempts == [1, 1]  # the error released the key: the repeat ran again
    assert "error" in outputs[0].lower() and outputs[-1] == "ok"


async def test_a_call_already_running_is_told_to_the_model_in_one_sentence(
    aclient: onceguard.AsyncClient, ns: str
) -> None:
    """A call whose key another caller holds, still after the guard's wait, does not run: the
    model reads one sentence saying it is already running and when to call again."""
    held = await aclient.claim(ns, "invoice-acme", request={"customer": "acme", "amount": 100}, lease="30s")
    assert isinstance(held, onceguard.Acquired)
    ledger = Ledger()
    tool = guard_function_tool(
        send_invoice_tool(ledger), aclient, ns, run_id="run-held", key_fn=lambda call: "invoice-acme", wait=None
    )
    model = ScriptedModel([[tool_call("send_invoice", {"customer": "acme", "amount": 100}, "c1")], [message("later")]])
    agent = Agent(name="billing", tools=[tool], model=model)
    await Runner.run(agent, "bill acme", run_config=RunConfig(tracing_disabled=True))
    (told,) = [o for inputs in model.inputs for o in _outputs(inputs)]
    assert told.startswith("This call is already running"), told
    assert "call the tool again with the same arguments in" in told
    assert ledger.sent == []
