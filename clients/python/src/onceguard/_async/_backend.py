"""What the async flavour does its own way: sleeping, the heartbeat's asyncio task, and
calling a ``verify`` hook (awaited when it is a coroutine function).

``_sync/_backend.py`` has the same names for the sync flavour (a thread); the other modules of
``_async`` are turned into those of ``_sync`` by ``scripts/unasync.py``.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable, Sequence

#: A function run under a guard: here a coroutine function, called and awaited.
Job = Callable[[], Awaitable[Any]]


async def sleep(seconds: float) -> None:
    """Wait ``seconds``, letting the loop run."""
    await asyncio.sleep(seconds)


async def verdict(verify: Callable[..., Any], *args: Any) -> Any:
    """What a ``verify`` hook answers: a coroutine function's answer awaited, a plain
    function's as it is."""
    out = verify(*args)
    return await out if inspect.isawaitable(out) else out


def can_call(func: Callable[..., Any]) -> bool:
    """Whether this flavour runs ``func`` as a hook or handler: here any function (a coroutine
    function's answer is awaited)."""
    return callable(func)


class Periodic:
    """An asyncio task that awaits ``beat()`` every ``interval`` seconds, until ``beat`` answers
    ``False`` or :meth:`stop` cancels it (and waits for it)."""

    def __init__(self, beat: Callable[[], Awaitable[bool]], interval: float, *, name: str) -> None:
        self._beat = beat
        self._interval = interval
        self._name = name
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the task in the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if not await self._beat():
                return

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # never raises: the caller's own cancellation stays its own


#: The work of :func:`onceguard.once_each` over the items still to do: here a coroutine
#: function, called with the items and awaited, answering one result per item.
Work = Callable[[list[Any]], Awaitable[Sequence[Any]]]
