"""What the sync and async clients share: their settings, headers and timeouts, and the retry
policy with its rules (which failures may be sent again). No I/O: see :mod:`onceguard.client`."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Mapping

import httpx

from ._calls import Call

DEFAULT_URL = "http://127.0.0.1:8080"
USER_AGENT = "onceguard-python/0.1.0"

#: Failures before the request left the client: always safe to send again.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
#: Failures after the request may have been sent: safe again only for idempotent calls.
_MAYBE_SENT = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


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


def may_retry(error: httpx.TransportError, call: Call[Any]) -> bool:
    """Whether ``call`` may be sent again after ``error``."""
    return isinstance(error, _NOT_SENT) or (call.idempotent and isinstance(error, _MAYBE_SENT))


def retry_after_header(response: httpx.Response) -> float | None:
    """The seconds of the answer's ``Retry-After``, if it has one."""
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


def timeout_of(timeout: float | httpx.Timeout) -> httpx.Timeout:
    """The ``httpx.Timeout`` of a client's ``timeout`` argument."""
    if isinstance(timeout, httpx.Timeout):
        return timeout
    return httpx.Timeout(timeout, connect=min(5.0, timeout))


def with_extra(timeout: httpx.Timeout, extra: float) -> httpx.Timeout:
    """``timeout`` with ``extra`` seconds more to read the answer (a claim's ``wait``)."""
    if not extra or timeout.read is None:
        return timeout
    return httpx.Timeout(connect=timeout.connect, read=timeout.read + extra, write=timeout.write, pool=timeout.pool)


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
        timeout: float | httpx.Timeout,
        retry: Retry,
    ) -> None:
        self.base_url = (base_url or os.environ.get("ONCEGUARD_URL") or DEFAULT_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("ONCEGUARD_API_KEY")
        self.timeout = timeout_of(timeout)
        self.retry = retry

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"
