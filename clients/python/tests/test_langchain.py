"""``guard_tool`` with real LangChain / LangGraph and a scripted fake chat model (no network):
the model emits the same tool call twice in one turn and again in a later turn; the tool's
effect happens once and every call gets the replayed result."""

from __future__ import annotations

import threading
import warnings
from typing import Any

import pytest

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import ToolException, tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode

import onceguard
from onceguard.langchain import guard_tool


class ToolCallingFakeModel(FakeMessagesListChatModel):
    """The scripted model: agents bind tools to it; it ignores them and plays its script."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        return self


class Payments:
    def __init__(self) -> None:
        self.refunds: list[tuple[int, int]] = []
        self._lock = threading.Lock()

    def refund(self, order: int, amount: int) -> dict[str, Any]:
        with self._lock:
            self.refunds.append((order, amount))
            return {"refund": f"re_{len(self.refunds)}", "order": order, "amount": amount}


def refund_tool(payments: Payments) -> Any:
    @tool
    def refund(order: int, amount: int) -> dict[str, Any]:
        """Refund an order."""
        return payments.refund(order, amount)

    return refund


def call(tool_name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"name": tool_name, "args": args, "id": call_id, "type": "tool_call"}


def script() -> list[AIMessage]:
    args = {"order": 1234, "amount": 25}
    return [
        AIMessage(content="", tool_calls=[call("refund", args, "call_1"), call("refund", args, "call_2")]),
        AIMessage(content="", tool_calls=[call("refund", args, "call_3")]),  # the model repeats itself
        AIMessage(content="Refunded order 1234."),
    ]


def tool_contents(messages: list[Any]) -> list[str]:
    return [m.content for m in messages if isinstance(m, ToolMessage)]


def make_agent(model: Any, tools: list[Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent moved in newer releases; it still works
        from langgraph.prebuilt import create_react_agent

        return create_react_agent(model, tools)


def test_prebuilt_agent_repeats_a_tool_call_and_the_effect_happens_once(client: onceguard.Client, ns: str) -> None:
    payments = Payments()
    guarded = guard_tool(refund_tool(payments), client, ns, run_id="run-lc-1")
    assert guarded.name == "refund" and "order" in guarded.args

    agent = make_agent(ToolCallingFakeModel(responses=script()), [guarded])
    out = agent.invoke({"messages": [HumanMessage("refund order 1234")]})

    assert payments.refunds == [(1234, 25)]
    contents = tool_contents(out["messages"])
    assert len(contents) == 3 and len(set(contents)) == 1 and "re_1" in contents[0]
    assert out["messages"][-1].content == "Refunded order 1234."
    records = list(client.iter_records(namespace_prefix=ns, run="run-lc-1"))
    assert len(records) == 1 and records[0].state == "completed" and records[0].key.startswith("refund:")


async def test_tool_node_async_with_the_async_client_and_run_id_from_the_config(
    aclient: onceguard.AsyncClient, ns: str
) -> None:
    payments = Payments()
    guarded = guard_tool(
        refund_tool(payments), aclient, ns, run_id=lambda config: config["configurable"]["thread_id"]
    )
    graph = StateGraph(MessagesState)
    graph.add_node("tools", ToolNode([guarded]))
    graph.add_edge(START, "tools")
    graph.add_edge("tools", END)
    node = graph.compile()
    message = script()[0]
    config = {"configurable": {"thread_id": "thread-7"}}
    first = await node.ainvoke({"messages": [message]}, config)
    second = await node.ainvoke({"messages": [message]}, config)  # the graph re-runs the node
    other_thread = await node.ainvoke({"messages": [message]}, {"configurable": {"thread_id": "thread-8"}})

    assert payments.refunds == [(1234, 25), (1234, 25)]  # once per run (thread)
    contents = tool_contents(first["messages"]) + tool_contents(second["messages"])
    assert len(contents) == 4 and len(set(contents)) == 1
    assert tool_contents(other_thread["messages"])[0] != contents[0]


def test_a_failing_tool_releases_the_key_and_its_error_message_is_not_stored(client: onceguard.Client, ns: str) -> None:
    attempts: list[int] = []

    @tool
    def flaky(x: int) -> str:
        """Fails the first time."""
        attempts.append(x)
        if len(attempts) == 1:
            raise ToolException("upstream reset")
        return "ok"

    flaky.handle_tool_error = True  # the model sees the error as a message
    guarded = guard_tool(flaky, client, ns, run_id="r")
    assert "upstream reset" in guarded.invoke({"x": 1})
    assert guarded.invoke({"x": 1}) == "ok"  # the key was released: it ran again
    assert guarded.invoke({"x": 1}) == "ok"
    assert attempts == [1, 1]


def test_custom_key_function(client: onceguard.Client, ns: str) -> None:
    payments = Payments()
    guarded = guard_tool(refund_tool(payments), client, ns, key_fn=lambda c: f"refund-{c.arguments['order']}")
    guarded.invoke({"order": 5, "amount": 1})
    guarded.invoke({"order": 5, "amount": 1})
    with pytest.raises(onceguard.KeyConflict):
        guarded.invoke({"order": 5, "amount": 2})
    assert payments.refunds == [(5, 1)]


def test_a_call_already_running_tells_the_model_when_to_call_again(client: onceguard.Client, ns: str) -> None:
    """A call whose key another caller holds (still after the guard's wait) does not run; with
    the tool's ``handle_tool_error``, the model is told in one sentence that the call is already
    running and when to call again, not a stack of errors."""
    holder = client.claim(ns, "refund-7", request={"order": 7, "amount": 1}, lease="30s")
    assert isinstance(holder, onceguard.Acquired)
    payments = Payments()
    inner = refund_tool(payments)
    inner.handle_tool_error = True
    guarded = guard_tool(inner, client, ns, key_fn=lambda c: "refund-7", wait=None)
    told = guarded.invoke({"order": 7, "amount": 1})
    assert isinstance(told, str) and told.startswith("This call is already running"), told
    assert "call the tool again with the same arguments in" in told and "Error" not in told
    assert payments.refunds == []
    strict = guard_tool(refund_tool(payments), client, ns, key_fn=lambda c: "refund-7", wait=None)
    with pytest.raises(onceguard.InFlightError):
        strict.invoke({"order": 7, "amount": 1})
