"""What the framework helpers share: the key of a tool call, and running it under a guard."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping, Union

from ._async import guard as _async_guard
from ._policy import Policy
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


def default_key(call: ToolCall) -> str:
    """``<tool>:<sha256 of the canonical {"run", "tool", "arguments"}>``: the same tool called
    with the same arguments in the same run is one effect, whichever call id the model gave it."""
    prefix = call.tool if call.tool and len(call.tool) <= 128 and set(call.tool) <= _PRINTABLE_NAME else "tool"
    return f"{prefix}:{digest({'run': call.run, 'tool': call.tool, 'arguments': call.arguments})}"


def tool_key(call: ToolCall, key_fn: KeyFn | None) -> str:
    return check_key(key_fn(call) if key_fn is not None else default_key(call))


def run_guarded_sync(client: Client, policy: Policy, key: str, call: ToolCall, run: Callable[[], Any]) -> Any:
    """Run ``run()`` once per ``key`` (the tool call's arguments are the request)."""
    return _sync_guard.run_guarded(client, policy, key, run, request=call.arguments, run=call.run)


async def run_guarded_async(
    client: AsyncClient, policy: Policy, key: str, call: ToolCall, run: Callable[[], Awaitable[Any]]
) -> Any:
    """Run ``await run()`` once per ``key``."""
    return await _async_guard.run_guarded(client, policy, key, run, request=call.arguments, run=call.run)


def arguments_of(value: Mapping[str, Any] | None) -> dict[str, Any]:
    out = jsonable(dict(value or {}))
    assert isinstance(out, dict)
    return out


AnyClient = Union[Client, AsyncClient]
