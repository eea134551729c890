"""What the framework helpers share: the key and summary of a tool call, and running it under
a guard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Optional, Union

from ._async import guard as _async_guard
from ._attempts import Policy
from ._sync import guard as _sync_guard
from .client import AsyncClient, Client
from .keys import check_key, digest, jsonable

_PRINTABLE_NAME = frozenset(chr(c) for c in range(0x21, 0x7F)) - {":"}


@dataclass(frozen=True)
class ToolCall:
    """A tool call as the key function sees it."""

    #: The tool's name.
    tool: str
    #: The call's arguments, as JSON values.
    arguments: dict[str, Any]
    #: The run the call belongs to (``None`` if no run id was given).
    run: str | None
    #: The framework's id of this call, when it has one (it differs between repeats of a call).
    call_id: str | None = None


#: A function from a tool call to its idempotency key.
KeyFn = Callable[[ToolCall], str]
#: What a tool call does, for the approver where its namespace requires approval: a string, or
#: a function of the call (``None``: no summary). Never derived from the arguments by default:
#: the server keeps a summary, while it keeps only the fingerprint of the arguments.
Summary = Union[str, Callable[[ToolCall], Optional[str]], None]


def default_key(call: ToolCall) -> str:
    """``<tool>:<sha256 of the canonical {"run", "tool", "arguments"}>``: the same tool called
    with the same arguments in the same run is one effect, whichever call id the model gave it."""
    prefix = call.tool if call.tool and len(call.tool) <= 128 and set(call.tool) <= _PRINTABLE_NAME else "tool"
    return f"{prefix}:{digest({'run': call.run, 'tool': call.tool, 'arguments': call.arguments})}"


def tool_key(call: ToolCall, key_fn: KeyFn | None) -> str:
    return check_key(key_fn(call) if key_fn is not None else default_key(call))


def summary_of(call: ToolCall, summary: Summary) -> str | None:
    return summary(call) if callable(summary) else summary


def run_guarded_sync(
    client: Client, policy: Policy, key: str, call: ToolCall, run: Callable[[], Any], summary: Summary = None
) -> Any:
    """Run ``run()`` once per ``key`` (the tool call's arguments are the request)."""
    about = summary_of(call, summary)
    return _sync_guard.run_guarded(client, policy, key, run, request=call.arguments, run=call.run, summary=about)


async def run_guarded_async(
    client: AsyncClient,
    policy: Policy,
    key: str,
    call: ToolCall,
    run: Callable[[], Awaitable[Any]],
    summary: Summary = None,
) -> Any:
    """Run ``await run()`` once per ``key``."""
    about = summary_of(call, summary)
    return await _async_guard.run_guarded(client, policy, key, run, request=call.arguments, run=call.run, summary=about)


def arguments_of(value: Mapping[str, Any] | None) -> dict[str, Any]:
    out = jsonable(dict(value or {}))
    assert isinstance(out, dict)
    return out


AnyClient = Union[Client, AsyncClient]
