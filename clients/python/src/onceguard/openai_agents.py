"""Guard OpenAI Agents SDK function tools: each tool call's effect happens once per run, tool
and arguments, however often the model re-emits the call or the run is resumed.

.. code-block:: python

    from agents import Agent, function_tool
    from onceguard.openai_agents import guard_function_tool

    @function_tool
    def refund(order: int, amount: int) -> str: ...

    agent = Agent(name="payments", tools=[
        guard_function_tool(refund, client, "prod/payments-agent", run_id=lambda ctx: ctx.context.run_id),
    ])

Needs the ``openai-agents`` extra (``pip install 'onceguard[openai-agents]'``).
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any, Callable, Optional, Union

from agents import FunctionTool
from agents.tool_context import ToolContext

from ._attempts import ExceptionClasses, Policy
from ._tools import KeyFn, Summary, ToolCall, arguments_of, run_guarded_async, run_guarded_sync, tool_key
from ._wire import Duration
from .client import AsyncClient, Client
from .errors import AwaitingApproval, InFlightError

__all__ = ["guard_function_tool", "ToolCall"]

RunId = Union[str, Callable[[ToolContext[Any]], Optional[str]], None]


def _raising_copy(tool: FunctionTool) -> FunctionTool:
    """A copy of ``tool`` whose invocation raises the tool's exceptions instead of turning them
    into a message for the model, so that the guard sees the failure (and does not store the
    message as the tool's result)."""
    inner = copy.copy(tool)
    try:
        from agents.tool import set_function_tool_failure_error_function
    except ImportError:  # pragma: no cover - older SDKs: their invoker raises as it is
        return inner
    set_function_tool_failure_error_function(inner, None)
    return inner


async def _as_model_message(tool: FunctionTool, ctx: ToolContext[Any], error: Exception) -> Any:
    """The tool's own failure policy, applied outside the guard: a message for the model, or
    ``None`` to raise."""
    try:
        from agents.tool import maybe_invoke_function_tool_failure_error_function
    except ImportError:  # pragma: no cover
        return None
    return await maybe_invoke_function_tool_failure_error_function(function_tool=tool, context=ctx, error=error)


def _answers_the_model(tool: FunctionTool, ctx: ToolContext[Any]) -> bool:
    """Whether the tool's failure policy gives the model a message (rather than raising)."""
    try:
        from agents.tool import resolve_function_tool_failure_error_function
    except ImportError:  # pragma: no cover - older SDKs
        return getattr(tool, "_failure_error_function", True) is not None
    return resolve_function_tool_failure_error_function(tool, ctx) is not None


def guard_function_tool(
    tool: FunctionTool,
    client: Client | AsyncClient,
    namespace: str,
    *,
    run_id: RunId = None,
    key_fn: KeyFn | None = None,
    lease: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration | None = 10.0,
    cost: int | None = None,
    permanent: ExceptionClasses = (),
    unknown: ExceptionClasses = (),
    summary: Summary = None,
) -> FunctionTool:
    """A tool like ``tool`` (same name, description and schema) whose every call is guarded.

    - The key is ``key_fn(ToolCall)`` if given, else ``<tool>:<sha256 of the canonical
      {"run", "tool", "arguments"}>``; the model's arguments (JSON) are also the claim's request.
      A repeated call (another call id, same run, tool and arguments) replays the first one's
      stored result.
    - ``run_id``: a string, or a function of the ``ToolContext`` (e.g. an id kept in your run
      context); it is in the key and charged with the run's budget.
    - An :class:`AsyncClient` is used directly; a sync :class:`Client` runs in a worker thread.
    - Failures follow ``once`` (``permanent`` stored, ``unknown`` reported, others release the
      key); then the tool's own failure policy applies, outside the guard, so an error message
      for the model is never stored as the tool's result.
    - Where the namespace requires approval, ``summary`` (a string, or a function of the
      :class:`ToolCall`) tells the approver what the call does. A call pending approval does
      not run: where the tool's failure policy answers the model (the default), the tool
      answers that the call awaits a person's approval (its id), that nothing was done, and to
      call again later with the same arguments (``AwaitingApproval.model_message``); a tool
      without one (``failure_error_function=None``) raises :class:`onceguard.AwaitingApproval`.
    """
    inner = _raising_copy(tool)
    policy = Policy.of(
        namespace, lease=lease, retention=retention, wait=wait, cost=cost, permanent=permanent, unknown=unknown
    )

    async def on_invoke_tool(ctx: ToolContext[Any], input: str) -> Any:
        try:
            arguments = arguments_of(json.loads(input) if input.strip() else {})
            run = run_id(ctx) if callable(run_id) else run_id
            call = ToolCall(tool=tool.name, arguments=arguments, run=run, call_id=getattr(ctx, "tool_call_id", None))
            key = tool_key(call, key_fn)

            async def invoke() -> Any:
                return await inner.on_invoke_tool(ctx, input)

            if isinstance(client, AsyncClient):
                return await run_guarded_async(client, policy, key, call, invoke, summary)

            loop = asyncio.get_running_loop()

            def invoke_in_loop() -> Any:  # the guard runs in a worker thread, the tool in the loop
                return asyncio.run_coroutine_threadsafe(invoke(), loop).result()

            return await asyncio.to_thread(run_guarded_sync, client, policy, key, call, invoke_in_loop, summary)
        except (AwaitingApproval, InFlightError) as e:
            if not _answers_the_model(tool, ctx):
                raise
            return e.model_message
        except Exception as e:
            message = await _as_model_message(tool, ctx, e)
            if message is None:
                raise
            return message

    guarded = copy.copy(tool)
    guarded.on_invoke_tool = on_invoke_tool
    return guarded
