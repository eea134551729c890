"""What the sync and async clients share: their settings, headers and timeouts, an answer as
the transports give it (:class:`Response`), the two kinds of transport failure, and the retry
policy with its rules (which failures may be sent again). No I/O: each flavour's transport is in
its ``_backend.py`` (libcurl or urllib3 for the sync client, aiohttp for the async one); see
:mod:`onceguard.client`."""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import quote, urlencode, urlsplit
from urllib.request import getproxies, proxy_bypass

DEFAULT_URL = "http://127.0.0.1:8080"
USER_AGENT = "onceguard-python/0.1.0"
#: The header of a request with a body (every body is JSON).
JSON_BODY: Mapping[str, str] = {"content-type": "application/json"}


@dataclass(frozen=True)
class Timeout:
    """Seconds a request may take: to connect, and for each read of its answer (a claim that
    waits gets its ``wait`` on top of ``read``). ``None`` waits without a limit."""

    read: float | None = 10.0
    connect: float | None = 5.0


class Response:
    """An answer: its status, its headers (looked up by names in lower case) and its body's
    bytes."""

    __slots__ = ("status_code", "headers", "content")

    def __init__(self, status_code: int, headers: Mapping[str, str] | None = None, content: bytes = b"") -> None:
        self.status_code = status_code
        self.headers: Mapping[str, str] = headers if headers is not None else {}
        self.content = content

    def json(self) -> Any:
        """The body read as JSON (``ValueError`` if it is not)."""
        return json.loads(self.content)

    def __repr__(self) -> str:
        return f"Response({self.status_code}, {len(self.content)} bytes)"


class NotSent(Exception):
    """The request never left the client (connect refused or timed out): always safe to send
    again. A transport raises it from the HTTP library's error."""


class MaybeSent(Exception):
    """The request may have reached the server (read timeout, dropped connection): safe to send
    again only if the call is idempotent. A transport raises it from the HTTP library's error."""


def proxy_for(base_url: str) -> str | None:
    """The proxy the environment names for the server's scheme (``HTTP_PROXY``, ``HTTPS_PROXY``),
    unless ``NO_PROXY`` exempts its host: read once, when the client is made."""
    parts = urlsplit(base_url)
    proxy = getproxies().get(parts.scheme)
    if not proxy or proxy_bypass(parts.hostname or ""):
        return None
    return proxy


def target(path: str, params: Mapping[str, str] | None) -> str:
    """A call's path with its query (values percent-encoded)."""
    return f"{path}?{urlencode(params, quote_via=quote)}" if params else path


@dataclass(frozen=True)
class Retry:
    """How the client retries its own transport failures and 503s.

    ``attempts`` counts every try, the first included (``1``: no retry). The n-th retry waits
    ``min(max_delay, initial * multiplier ** (n - 1))``, with full jitter when ``jitter``; a
    ``Retry-After`` on a 503 is honoured up to ``max_delay``.
    """

    attempts: int = 6
    initial: float = 0.1
    max_delay: float = 2.0
    multiplier: float = 2.0
    jitter: bool = True

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1 for the first retry)."""
        backoff = min(self.max_delay, self.initial * self.multiplier ** (retry - 1))
        if self.jitter:
            backoff = random.uniform(backoff / 2, backoff)
        if retry_after is not None:
            backoff = max(backoff, min(retry_after, self.max_delay))
        return backoff


#: No retries: one try.
NO_RETRY = Retry(attempts=1)


def may_retry(error: NotSent | MaybeSent, idempotent: bool) -> bool:
    """Whether a call (``idempotent`` or not) may be sent again after ``error``."""
    return isinstance(error, NotSent) or idempotent


def retry_after_header(response: Response) -> float | None:
    """The seconds of the answer's ``Retry-After``, if it has one."""
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def timeout_of(timeout: float | Timeout) -> Timeout:
    """The :class:`Timeout` of a client's ``timeout`` argument: a number is the read timeout,
    and the connect timeout too up to 5 s."""
    if isinstance(timeout, Timeout):
        return timeout
    return Timeout(read=timeout, connect=min(5.0, timeout))


def with_extra(timeout: Timeout, extra: float) -> Timeout:
    """``timeout`` with ``extra`` seconds more to read the answer (a claim's ``wait``)."""
    if not extra or timeout.read is None:
        return timeout
    return Timeout(read=timeout.read + extra, connect=timeout.connect)


def headers_of(api_key: str | None, headers: Mapping[str, str] | None) -> dict[str, str]:
    """The headers of every request: user agent, accept, the API key, then ``headers``."""
    out = {"user-agent": USER_AGENT, "accept": "application/json"}
    if api_key:
        out["authorization"] = f"Bearer {api_key}"
    out.update(headers or {})
    return out


class ClientBase:
    """The settings of a client, sync or async."""

    def __init__(
        self,
        base_url: str | None,
        api_key: str | None,
        timeout: float | Timeout,
        retry: Retry,
    ) -> None:
        self.base_url = (base_url or os.environ.get("ONCEGUARD_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("ONCEGUARD_API_KEY")
        self.timeout = timeout_of(timeout)
        self.retry = retry

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"
