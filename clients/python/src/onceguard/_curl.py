"""The sync client's transport through libcurl (pycurl), when the ``curl`` extra is installed:
the same requests, answers and failures as the urllib3 one in ``_sync/_backend.py``, for about
a quarter of the caller's CPU per exchange (docs/PERFORMANCE.md).

A libcurl easy handle keeps its connection alive between the requests it performs, and checks
before reusing it that the server has not closed it. The transport keeps up to
``max_connections`` idle handles; a thread takes one for a request (or makes one when none is
idle) and gives it back after, so no handle is used by two threads at once.

libcurl sends a request again, on a new connection, when the kept connection it was sent on
closes before any byte of the answer: the server may have processed the first. So a call that is
not idempotent is sent on a connection of its own (``FRESH_CONNECT``), which libcurl never sends
again; a failure of it is :class:`MaybeSent` as through urllib3.
"""

from __future__ import annotations

import ssl
import threading
from typing import Mapping
from urllib.parse import urlsplit

import pycurl

from ._http import MaybeSent, NotSent, Response, Timeout, proxy_for, target


class CurlTransport:
    """Sends requests to one server through libcurl, without redirects and without libcurl's
    reading of the environment: through the proxy :func:`proxy_for` names, or none."""

    def __init__(
        self, base_url: str, headers: Mapping[str, str], *, max_connections: int, verify: bool | str
    ) -> None:
        parts = urlsplit(base_url)
        self._base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        # No `Expect: 100-continue` on a large body: one request, one answer.
        self._headers = _header_lines(headers) + [b"Expect:"]
        self._typed = any(name.lower() == "content-type" for name in headers)
        self._proxy = proxy_for(base_url) or ""
        self._https = parts.scheme == "https"
        self._verify = verify
        self._max_idle = max_connections
        self._idle: list[pycurl.Curl] = []
        self._lock = threading.Lock()
        self._closed = False

    def send(
        self, method: str, path: str, params: Mapping[str, str] | None, body: bytes | None,
        headers: Mapping[str, str] | None, timeout: Timeout, *, idempotent: bool,
    ) -> Response:
        """One try: the answer, or :class:`NotSent` (no byte of the request was sent) /
        :class:`MaybeSent` from libcurl's error. A call that is not ``idempotent`` goes on a new
        connection, so that libcurl never sends it twice (see the module's documentation)."""
        if self._closed:
            raise RuntimeError("the client is closed")
        handle, new = self._take()
        chunks: list[bytes] = []
        head: list[bytes] = []
        try:
            handle.setopt(pycurl.URL, self._base + target(path, params))
            if body is None:
                handle.setopt(pycurl.HTTPGET, 1)
            else:
                handle.setopt(pycurl.POSTFIELDS, body)
            handle.setopt(pycurl.CUSTOMREQUEST, method)
            handle.setopt(pycurl.FRESH_CONNECT, 0 if idempotent else 1)
            sent = self._headers
            if headers:
                sent = sent + _header_lines(headers)
            if body is not None and not (self._typed or any(name.lower() == "content-type" for name in headers or ())):
                sent = sent + [b"Content-Type:"]  # not libcurl's form type: none, as urllib3 sends
            handle.setopt(pycurl.HTTPHEADER, sent)
            handle.setopt(pycurl.CONNECTTIMEOUT_MS, _ms(timeout.connect))
            # libcurl bounds the whole exchange; on a kept connection that is the read.
            total = timeout.read
            if total is not None and new and timeout.connect is not None:
                total += timeout.connect
            handle.setopt(pycurl.TIMEOUT_MS, _ms(total))
            handle.setopt(pycurl.WRITEFUNCTION, chunks.append)
            handle.setopt(pycurl.HEADERFUNCTION, head.append)
            handle.perform()
            status = handle.getinfo(pycurl.RESPONSE_CODE)
        except pycurl.error as e:
            # The handle's connection is closed; so is the handle, not kept for another request.
            sent_bytes = handle.getinfo(pycurl.REQUEST_SIZE)
            handle.close()
            raise (MaybeSent if sent_bytes else NotSent)(str(e)) from e
        except BaseException:
            handle.close()
            raise
        # An idle handle keeps neither this request's body nor this answer alive.
        handle.setopt(pycurl.WRITEFUNCTION, _drop)
        handle.setopt(pycurl.HEADERFUNCTION, _drop)
        if body is not None:
            handle.setopt(pycurl.POSTFIELDS, b"")
        self._give_back(handle)
        return Response(status, _headers(head), b"".join(chunks))

    def close(self) -> None:
        """Close every idle handle and its connection; the transport sends nothing more."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for handle in idle:
            handle.close()

    def _take(self) -> tuple[pycurl.Curl, bool]:
        with self._lock:
            if self._idle:
                return self._idle.pop(), False
        return self._handle(), True

    def _give_back(self, handle: pycurl.Curl) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(handle)
                return
        handle.close()

    def _handle(self) -> pycurl.Curl:
        handle = pycurl.Curl()
        handle.setopt(pycurl.NOSIGNAL, 1)  # timeouts without signals: safe in any thread
        handle.setopt(pycurl.HTTP_VERSION, pycurl.CURL_HTTP_VERSION_1_1)
        # "" is no proxy, the environment's included: the proxy is the one proxy_for chose.
        handle.setopt(pycurl.PROXY, self._proxy)
        handle.setopt(pycurl.NOPROXY, "")
        handle.setopt(pycurl.TCP_NODELAY, 1)
        if self._https:
            handle.setopt(pycurl.SSL_VERIFYPEER, 1 if self._verify else 0)
            handle.setopt(pycurl.SSL_VERIFYHOST, 2 if self._verify else 0)
            if isinstance(self._verify, str):
                handle.setopt(pycurl.CAINFO, self._verify)
            elif self._verify:
                _trust_what_python_trusts(handle)
        return handle


#: The longest timeout libcurl takes (ms, a C long's 2^31 - 1 on every platform): ``None``'s, as
#: close to no limit as it gets (libcurl's own "none" for a connect is 300 s).
_NO_LIMIT_MS = 2**31 - 1


def _ms(seconds: float | None) -> int:
    """libcurl's milliseconds of a timeout, at least 1 ms; :data:`_NO_LIMIT_MS` for ``None``."""
    return _NO_LIMIT_MS if seconds is None else min(_NO_LIMIT_MS, max(1, round(seconds * 1000)))


def _drop(_: bytes) -> None:
    """A handle's callbacks between requests."""


def _header_lines(headers: Mapping[str, str]) -> list[bytes]:
    """``headers`` as libcurl's header lines, in latin-1 as urllib3 sends them; ``name;`` for an
    empty value (libcurl leaves out a ``name:`` line)."""
    return [(f"{name}: {value}" if value else f"{name};").encode("latin-1") for name, value in headers.items()]


def _trust_what_python_trusts(handle: pycurl.Curl) -> None:
    """The authorities Python's ``ssl`` (and so urllib3) trusts by default, where it names
    them as a file or a directory; libcurl's own default otherwise."""
    paths = ssl.get_default_verify_paths()
    if paths.cafile:
        handle.setopt(pycurl.CAINFO, paths.cafile)
    if paths.capath:
        handle.setopt(pycurl.CAPATH, paths.capath)


def _headers(lines: list[bytes]) -> dict[str, str]:
    """The answer's headers, names in lower case, from libcurl's header lines: those after the
    last status line (a proxy's `CONNECT` answer comes before the server's)."""
    out: dict[str, str] = {}
    for line in lines:
        if line.startswith(b"HTTP/"):  # a status line (no header's name has a slash)
            out = {}
            continue
        name, colon, value = line.partition(b":")
        if colon:
            key, text = name.strip().lower().decode("latin-1"), value.strip().decode("latin-1")
            out[key] = f"{out[key]}, {text}" if key in out else text  # repeated: joined, as urllib3 does
    return out
