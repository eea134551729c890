"""What the async flavour does its own way: its transport (aiohttp), sleeping, the heartbeat's
asyncio task, and calling a ``verify`` hook (awaited when it is a coroutine function).

``_sync/_backend.py`` has the same names for the sync flavour (a thread); the other modules of
``_async`` are turned into those of ``_sync`` by ``scripts/unasync.py``.
"""

from __future__ import annotations

import asyncio
import inspect
import ssl
from typing import Any, Awaitable, Callable, Mapping, Sequence

import aiohttp
import yarl

from .._http import MaybeSent, NotSent, Response, Timeout, proxy_for, target

#: A function run under a guard: here a coroutine function, called and awaited.
Job = Callable[[], Awaitable[Any]]


class Transport:
    """Sends requests to one server over an aiohttp session's pool of keep-alive connections,
    without redirects: the client retries. The session is made on the first request, in the
    running event loop. Through the proxy the environment names for the server, if any
    (:func:`proxy_for`: read once, not per request as aiohttp's ``trust_env`` would)."""

    def __init__(
        self, base_url: str, headers: Mapping[str, str], *, max_connections: int, verify: bool | str
    ) -> None:
        self._base = base_url.rstrip("/")
        self._headers = dict(headers)
        self._max_connections = max_connections
        self._ssl: ssl.SSLContext | bool = True
        if verify is False:
            self._ssl = False
        elif isinstance(verify, str):
            self._ssl = ssl.create_default_context(cafile=verify)
        self._proxy = proxy_for(base_url)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise RuntimeError("the client is closed")
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, ssl=self._ssl)
            self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, auto_decompress=False, skip_auto_headers=("accept-encoding",)
            )
        return self._session

    async def send(
        self, method: str, path: str, params: Mapping[str, str] | None, body: bytes | None,
        headers: Mapping[str, str] | None, timeout: Timeout, *, idempotent: bool,
    ) -> Response:
        """One try: the answer, or :class:`NotSent` / :class:`MaybeSent` from aiohttp's error.
        aiohttp sends each request once, whatever ``idempotent`` says."""
        # The target as built (percent-encoded once), not normalized again.
        url = yarl.URL(self._base + target(path, params), encoded=True)
        limits = aiohttp.ClientTimeout(total=None, sock_connect=timeout.connect, sock_read=timeout.read)
        try:
            async with self._open().request(
                method, url, data=body, headers=headers, timeout=limits, allow_redirects=False, proxy=self._proxy
            ) as answer:
                return Response(answer.status, answer.headers, await answer.read())
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:  # refused, unreachable
            raise NotSent(str(e)) from e
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # a read timeout, a dropped connection
            raise MaybeSent(str(e) or type(e).__name__) from e

    async def close(self) -> None:
        """Close the session and its connections."""
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None


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
