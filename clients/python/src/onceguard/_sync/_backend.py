"""What the sync flavour does its own way: its transport (libcurl through pycurl where the
``curl`` extra is installed, urllib3 otherwise), sleeping, the heartbeats' threads, and calling a
``verify`` hook (a plain function).

Written by hand, with the names of ``_async/_backend.py`` (which uses asyncio); the other
modules of ``_sync`` are generated from ``_async`` by ``scripts/unasync.py``.

The heartbeats of every guarded call of the process share one timing thread and a few worker
threads (started on the first heartbeat, again after a fork): starting and joining a thread for
each call cost a first execution about half a millisecond on a busy machine.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import urllib3
from urllib3.exceptions import ConnectTimeoutError, HTTPError, NewConnectionError

from .._http import MaybeSent, NotSent, Response, Timeout, proxy_for, target

try:
    from .._curl import CurlTransport

    _CURL = True
except ImportError:  # the `curl` extra (pycurl) is not installed
    _CURL = False

log = logging.getLogger("onceguard")


class Urllib3Transport:
    """Sends requests to one server over urllib3's pool of keep-alive connections (safe to
    share between threads), without urllib3's own retries or redirects: the client retries.
    Through the proxy the environment names for the server, if any (:func:`proxy_for`)."""

    def __init__(
        self, base_url: str, headers: Mapping[str, str], *, max_connections: int, verify: bool | str
    ) -> None:
        url = urllib3.util.parse_url(base_url)
        self._prefix = (url.path or "").rstrip("/")
        self._headers = dict(headers)
        tls: dict[str, Any] = {}
        if url.scheme == "https":
            tls = {"cert_reqs": "CERT_REQUIRED" if verify else "CERT_NONE"}
            if isinstance(verify, str):
                tls["ca_certs"] = verify
        self._closed = False
        origin = f"{url.scheme}://{url.netloc}"
        proxy = proxy_for(base_url)
        self._pool: urllib3.HTTPConnectionPool | urllib3.ProxyManager
        if proxy is None:
            # Without a path: the pool is the origin's; each request names its path.
            self._pool = urllib3.connection_from_url(origin, maxsize=max_connections, block=False, **tls)
            self._origin = ""
        else:
            # Through the environment's proxy, each request names the whole URL.
            self._pool = urllib3.ProxyManager(proxy, num_pools=1, maxsize=max_connections, block=False, **tls)
            self._origin = origin

    def send(
        self, method: str, path: str, params: Mapping[str, str] | None, body: bytes | None,
        headers: Mapping[str, str] | None, timeout: Timeout, *, idempotent: bool,
    ) -> Response:
        """One try: the answer, or :class:`NotSent` / :class:`MaybeSent` from urllib3's error.
        urllib3 sends each request once (its retries are off), whatever ``idempotent`` says."""
        if self._closed:
            raise RuntimeError("the client is closed")
        sent = {**self._headers, **headers} if headers else self._headers
        try:
            answer = self._pool.urlopen(
                method,
                self._origin + self._prefix + target(path, params),
                body=body,
                headers=sent,
                retries=False,
                redirect=False,
                assert_same_host=False,
                timeout=urllib3.Timeout(connect=timeout.connect, read=timeout.read),
            )
        except (NewConnectionError, ConnectTimeoutError) as e:  # a refused or unreachable server
            raise NotSent(str(e)) from e
        except HTTPError as e:  # a read timeout, a dropped connection, a broken answer
            raise MaybeSent(str(e)) from e
        return Response(answer.status, answer.headers, answer.data)

    def close(self) -> None:
        """Close every connection of the pool; the transport sends nothing more."""
        self._closed = True
        if isinstance(self._pool, urllib3.ProxyManager):
            self._pool.clear()
        else:
            self._pool.close()


#: The sync client's transport: libcurl's where pycurl is installed (about a quarter of urllib3's
#: CPU per exchange), urllib3's otherwise. Both send, answer and fail alike.
Transport: type[CurlTransport] | type[Urllib3Transport] = CurlTransport if _CURL else Urllib3Transport

#: A function run under a guard: here a plain function, called.
Job = Callable[[], Any]

#: How many beats may run at once (each is one HTTP call of at most the client's timeout).
WORKERS = 4


def sleep(seconds: float) -> None:
    """Wait ``seconds``, blocking the thread."""
    time.sleep(seconds)


def verdict(verify: Callable[..., Any], *args: Any) -> Any:
    """What a ``verify`` hook answers; a coroutine (an async hook on a sync function) is
    refused with ``TypeError``, never left unawaited."""
    out = verify(*args)
    if inspect.isawaitable(out):
        close = getattr(out, "close", None)
        if callable(close):
            close()
        raise TypeError("verify of a sync function is a plain function: it answered an awaitable")
    return out


def can_call(func: Callable[..., Any]) -> bool:
    """Whether this flavour runs ``func`` as a hook or handler: a plain function, not a
    coroutine function (whose coroutine nothing here would await)."""
    return callable(func) and not inspect.iscoroutinefunction(func)


class _Scheduler:
    """One daemon thread that waits for the next beat due and hands it to the workers."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Periodic]] = []
        self._order = itertools.count()
        self._changed = threading.Condition()
        self._pid = -1
        self._workers: ThreadPoolExecutor | None = None

    def add(self, periodic: Periodic, at: float) -> None:
        """Run ``periodic``'s beat at ``at`` (``time.monotonic()``)."""
        with self._changed:
            if self._pid != os.getpid():  # first use, or a forked child: the threads are not here
                self._pid = os.getpid()
                self._due.clear()
                self._workers = ThreadPoolExecutor(WORKERS, thread_name_prefix="onceguard-heartbeat")
                threading.Thread(target=self._run, name="onceguard-heartbeats", daemon=True).start()
            heapq.heappush(self._due, (at, next(self._order), periodic))
            self._changed.notify()

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self._changed:
                if self._pid != pid:
                    return
                now = time.monotonic()
                if not self._due or self._due[0][0] > now:
                    self._changed.wait(self._due[0][0] - now if self._due else None)
                    continue
                _, _, periodic = heapq.heappop(self._due)
                workers = self._workers
            if not periodic.stopped and workers is not None:
                workers.submit(periodic.fire)


_SCHEDULER = _Scheduler()


class Periodic:
    """Calls ``beat()`` every ``interval`` seconds on a heartbeat worker thread, until ``beat``
    answers ``False`` or :meth:`stop` stops it (waiting for a beat under way)."""

    def __init__(self, beat: Callable[[], bool], interval: float, *, name: str) -> None:
        self._beat = beat
        self._interval = interval
        self._name = name
        self._beating = threading.Lock()
        self.stopped = False

    def start(self) -> None:
        """Schedule the first beat."""
        _SCHEDULER.add(self, time.monotonic() + self._interval)

    def fire(self) -> None:
        """One beat (on a worker), and the next one scheduled unless it was the last."""
        with self._beating:
            if self.stopped:
                return
            try:
                again = self._beat()
            except Exception:  # a beat that failed unexpectedly: the next one tries again
                log.exception("onceguard: %s failed", self._name)
                again = True
            if again and not self.stopped:
                _SCHEDULER.add(self, time.monotonic() + self._interval)

    def stop(self) -> None:
        """Stop the beats; when it returns, no beat is under way and none will start."""
        self.stopped = True
        with self._beating:
            pass


#: The work of :func:`onceguard.once_each` over the items still to do: here a plain function,
#: called with the items, answering one result per item.
Work = Callable[[list[Any]], Sequence[Any]]
