"""Run a function or a block once per key: :func:`once` and :func:`guarded`.

The protocol, the same for both and for the framework helpers:

1. **claim** the key (with the request, so that a key reused for another request is caught),
   waiting up to ``wait`` on the server if another caller holds it;
2. the claim answers
   - ``replay``: the stored outcome is returned (decoded from the stored JSON) without running
     anything; a stored permanent failure raises :class:`PermanentFailure` again;
   - ``acquired``: the function runs while a **heartbeat** (a thread, or an asyncio task)
     extends the lease every third of it; the handle :func:`current` gives the fence, the
     attempt number, the ``recovery`` of a crashed earlier attempt and ``checkpoint()``;
   - ``in_flight`` after the wait: :class:`InFlightError`; ``mismatch``: :class:`KeyConflict`;
     ``denied``: :class:`DeniedError`;
3. the heartbeat is stopped (and joined), then
   - a return value is serialized as JSON and **completed**; every caller, the first included,
     gets the value decoded from those stored bytes, so all callers see the same value; a
     ``stale`` answer (the lease was taken over meanwhile) raises :class:`StaleFence`: the
     result is **not** stored;
   - an exception of a class in ``permanent`` is stored as a failure
     (``{"type": "module.Class", "message": "…"}``) and raised as :class:`PermanentFailure`,
     now and on every replay;
   - an exception of a class in ``unknown``, or an interruption (``KeyboardInterrupt``,
     ``asyncio.CancelledError``: not an ``Exception``), is **reported unknown**: the effect may
     have happened; the next claim is a recovery that is told so;
   - any other exception **releases** the key (``fail`` retryable) and propagates: the next
     call runs again.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Awaitable, Callable, ParamSpec, Sequence, TypeVar, Union, cast, overload

from . import _calls
from ._wire import Duration, RawJson, dumps, duration_seconds
from .client import NO_RETRY, AsyncClient, Client
from .errors import (
    DeniedError,
    InFlightError,
    KeyConflict,
    OnceguardError,
    PermanentFailure,
    StaleFence,
)
from .keys import bound_arguments, check_key, check_label, derive_key, function_name, jsonable
from .models import Acquired, ClaimAnswer, Denied, InFlight, Mismatch, Recovery, Replay

__all__ = ["Attempt", "AsyncAttempt", "Guarded", "AsyncGuarded", "current", "guarded", "once"]

P = ParamSpec("P")
R = TypeVar("R")
log = logging.getLogger("onceguard")

ExceptionClasses = Union[type[BaseException], Sequence[type[BaseException]]]

_current: contextvars.ContextVar[Attempt | AsyncAttempt | None] = contextvars.ContextVar(
    "onceguard_attempt", default=None
)


def current() -> Attempt | AsyncAttempt:
    """The attempt of the guarded function (or block) running in this context.

    Raises ``LookupError`` outside of one. In a sync function it is an :class:`Attempt`, in a
    coroutine an :class:`AsyncAttempt`.
    """
    attempt = _current.get()
    if attempt is None:
        raise LookupError("onceguard.current() is only available inside a function guarded by once()/guarded()")
    return attempt


def _classes(value: ExceptionClasses) -> tuple[type[BaseException], ...]:
    return (value,) if isinstance(value, type) else tuple(value)


@dataclass(frozen=True)
class Policy:
    """How a guard claims, runs and stores (shared by ``once``, ``guarded`` and the helpers)."""

    namespace: str
    lease: float = 30.0
    retention: Duration | None = None
    wait: Duration | None = 10.0
    cost: int | None = None
    permanent: tuple[type[BaseException], ...] = ()
    unknown: tuple[type[BaseException], ...] = ()
    encode: Callable[[Any], Any] = jsonable
    decode: Callable[[Any], Any] = field(default=lambda value: value)
    heartbeat: bool = True

    @classmethod
    def of(
        cls,
        namespace: str,
        *,
        lease: Duration = 30.0,
        retention: Duration | None = None,
        wait: Duration | None = 10.0,
        cost: int | None = None,
        permanent: ExceptionClasses = (),
        unknown: ExceptionClasses = (),
        encode: Callable[[Any], Any] | None = None,
        decode: Callable[[Any], Any] | None = None,
        heartbeat: bool = True,
    ) -> Policy:
        return cls(
            namespace=namespace,
            lease=duration_seconds(lease),
            retention=retention,
            wait=wait,
            cost=cost,
            permanent=_classes(permanent),
            unknown=_classes(unknown),
            encode=encode or jsonable,
            decode=decode or (lambda value: value),
            heartbeat=heartbeat,
        )

    def classify(self, exc: BaseException) -> str:
        """``permanent``, ``unknown`` or ``retryable``."""
        if isinstance(exc, self.permanent):
            return "permanent"
        if isinstance(exc, self.unknown) or not isinstance(exc, Exception):
            return "unknown"
        return "retryable"


def failure_of(exc: BaseException) -> dict[str, str]:
    """The stored JSON of a permanent failure."""
    cls = type(exc)
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "message": str(exc)}


@dataclass
class _Replayed:
    replay: Replay
    value: Any


def _interpret(answer: ClaimAnswer, policy: Policy, key: str) -> Acquired | _Replayed:
    """An acquired claim, or the replayed value; raises for the other answers."""
    ns = policy.namespace
    if isinstance(answer, Acquired):
        return answer
    if isinstance(answer, Replay):
        if answer.status != "success":
            raise PermanentFailure(answer.result, namespace=ns, key=key, replayed=True)
        return _Replayed(answer, policy.decode(answer.result))
    if isinstance(answer, InFlight):
        raise InFlightError(namespace=ns, key=key, retry_after=answer.retry_after, attempt=answer.attempt)
    if isinstance(answer, Mismatch):
        raise KeyConflict(namespace=ns, key=key, detail=answer.detail)
    if isinstance(answer, Denied):
        raise DeniedError(answer, namespace=ns, key=key)
    raise TypeError(f"not a claim answer: {answer!r}")  # pragma: no cover


class _AttemptBase:
    """What sync and async attempts share: the claim's facts and the result."""

    def __init__(self, policy: Policy, key: str, found: Acquired | _Replayed) -> None:
        self.namespace = policy.namespace
        self.key = key
        self._policy = policy
        self._completed = False
        #: complete() was called: the effect happened, so a failure to store it must not release
        #: the key (it is reported unknown instead).
        self._effect_done = False
        self._result: Any = None
        #: Cost units to report when the attempt completes or fails (optional).
        self.cost: int | None = None
        self.recovery: Recovery | None
        self.lease_expires_at: datetime | None
        if isinstance(found, _Replayed):
            self.replayed = True
            self.fence = found.replay.fence
            self.attempt = found.replay.attempt
            self.recovery = None
            self.lease_expires_at = None
            self._result = found.value
            self._completed = True
        else:
            self.replayed = False
            self.fence = found.fence
            self.attempt = found.attempt
            self.recovery = found.recovery
            self.lease_expires_at = found.lease_expires_at
        self._lost: StaleFence | None = None

    @property
    def result(self) -> Any:
        """The replayed value; or, in a block, the value to complete with when it ends (default
        ``None``); after completion, the value decoded from the stored bytes."""
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self._completed:
            raise RuntimeError("the outcome is stored already")
        self._result = value

    @property
    def completed(self) -> bool:
        """Whether the outcome is stored (always, for a replay)."""
        return self._completed

    @property
    def lease_lost(self) -> bool:
        """Whether the heartbeat found the lease taken over (completing will raise StaleFence)."""
        return self._lost is not None

    def _serialize(self, value: Any) -> str:
        return dumps(self._policy.encode(value))

    def _stored(self, text: str) -> Any:
        self._completed = True
        self._result = self._policy.decode(json.loads(text))
        return self._result

    def _require_holder(self) -> None:
        if self.replayed:
            raise RuntimeError("this key replayed: there is no attempt to checkpoint or complete")

    def __repr__(self) -> str:
        state = "replayed" if self.replayed else f"attempt {self.attempt}"
        return f"<{type(self).__name__} {self.namespace}/{self.key} fence={self.fence} {state}>"


class Attempt(_AttemptBase):
    """The handle of a sync guarded call: ``fence``, ``attempt``, ``recovery``, ``checkpoint()``."""

    def __init__(self, client: Client, policy: Policy, key: str, found: Acquired | _Replayed) -> None:
        super().__init__(policy, key, found)
        self._client = client

    def checkpoint(self, name: str, data: Any = None) -> None:
        """Save a recovery point: if this attempt crashes, the next one receives it in
        ``recovery.last_checkpoint``. Raises ``StaleFence`` if the attempt is over."""
        self._require_holder()
        self._client.checkpoint(self.namespace, self.key, self.fence, name, jsonable(data))

    def complete(self, value: Any = None) -> Any:
        """Store ``value`` now (instead of when the block ends); returns it as every caller
        will see it. Raises ``StaleFence`` if the lease was taken over (nothing stored). Once it
        was called, the effect counts as done: if storing fails, the key is reported unknown,
        never released."""
        self._require_holder()
        if self._completed:
            raise RuntimeError("the outcome is stored already")
        self._effect_done = True
        text = self._serialize(value)
        self._client.complete(self.namespace, self.key, self.fence, RawJson(text), cost=self.cost)
        return self._stored(text)


class AsyncAttempt(_AttemptBase):
    """The handle of an async guarded call; ``checkpoint()`` and ``complete()`` are awaited."""

    def __init__(self, client: AsyncClient, policy: Policy, key: str, found: Acquired | _Replayed) -> None:
        super().__init__(policy, key, found)
        self._client = client

    async def checkpoint(self, name: str, data: Any = None) -> None:
        """See :meth:`Attempt.checkpoint`."""
        self._require_holder()
        await self._client.checkpoint(self.namespace, self.key, self.fence, name, jsonable(data))

    async def complete(self, value: Any = None) -> Any:
        """See :meth:`Attempt.complete`."""
        self._require_holder()
        if self._completed:
            raise RuntimeError("the outcome is stored already")
        self._effect_done = True
        text = self._serialize(value)
        await self._client.complete(self.namespace, self.key, self.fence, RawJson(text), cost=self.cost)
        return self._stored(text)


# ------------------------------------------------------------------------------------------------
# Heartbeats
# ------------------------------------------------------------------------------------------------


def _interval(lease: float) -> float:
    return max(lease / 3, 0.03)


class _Heartbeat:
    """A thread that extends the lease every third of it until stopped (and joined)."""

    def __init__(self, client: Client, attempt: Attempt, lease: float) -> None:
        self._client = client
        self._attempt = attempt
        self._lease = lease
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"onceguard-heartbeat {attempt.key[:48]}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        a = self._attempt
        call = _calls.extend(a.namespace, a.key, a.fence, self._lease)
        while not self._stop.wait(_interval(self._lease)):
            try:
                self._client.send(call, retry=NO_RETRY)
            except StaleFence as e:
                a._lost = e
                log.warning("onceguard: lease of %s/%s (fence %d) was taken over: %s", a.namespace, a.key, a.fence, e)
                return
            except OnceguardError as e:  # the next beat tries again
                log.warning("onceguard: could not extend the lease of %s/%s: %s", a.namespace, a.key, e)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class _AsyncHeartbeat:
    """An asyncio task that extends the lease every third of it until stopped (and awaited)."""

    def __init__(self, client: AsyncClient, attempt: AsyncAttempt, lease: float) -> None:
        self._client = client
        self._attempt = attempt
        self._lease = lease
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"onceguard-heartbeat {self._attempt.key[:48]}")

    async def _run(self) -> None:
        a = self._attempt
        call = _calls.extend(a.namespace, a.key, a.fence, self._lease)
        while True:
            await asyncio.sleep(_interval(self._lease))
            try:
                await self._client.send(call, retry=NO_RETRY)
            except StaleFence as e:
                a._lost = e
                log.warning("onceguard: lease of %s/%s (fence %d) was taken over: %s", a.namespace, a.key, a.fence, e)
                return
            except OnceguardError as e:
                log.warning("onceguard: could not extend the lease of %s/%s: %s", a.namespace, a.key, e)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])  # never raises: the caller's own cancellation stays its own


# ------------------------------------------------------------------------------------------------
# The context managers
# ------------------------------------------------------------------------------------------------


class Guarded:
    """``with guarded(client, …) as attempt:`` — see :func:`guarded`."""

    def __init__(
        self,
        client: Client,
        policy: Policy,
        key: str,
        *,
        request: Any = None,
        fingerprint: str | None = None,
        run: str | None = None,
    ) -> None:
        self._client = client
        self._policy = policy
        self._key = check_key(key)
        self._request = _calls.MISSING if fingerprint is not None else request
        self._fingerprint = fingerprint
        self._run = run
        self._attempt: Attempt | None = None
        self._beat: _Heartbeat | None = None
        self._token: contextvars.Token[Attempt | AsyncAttempt | None] | None = None

    def __enter__(self) -> Attempt:
        p = self._policy
        answer = self._client.claim(
            p.namespace,
            self._key,
            request=self._request,
            fingerprint=self._fingerprint,
            lease=p.lease,
            retention=p.retention,
            run=self._run,
            wait=p.wait,
            cost=p.cost,
        )
        attempt = Attempt(self._client, p, self._key, _interpret(answer, p, self._key))
        self._attempt = attempt
        if not attempt.replayed and p.heartbeat:
            self._beat = _Heartbeat(self._client, attempt, p.lease)
            self._beat.start()
        self._token = _current.set(attempt)
        return attempt

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        a = self._attempt
        assert a is not None and self._token is not None
        _current.reset(self._token)
        if self._beat is not None:
            self._beat.stop()
        if a.replayed or (a.completed and exc is None):
            return
        if exc is None:
            self._complete(a)
            return
        if a.completed:
            return  # the outcome was stored before the block raised: it stands
        _settle_failure_sync(self._client, a, self._policy, exc)

    def _complete(self, a: Attempt) -> None:
        try:
            text = a._serialize(a.result)
        except (TypeError, ValueError) as e:
            _report_unknown_sync(self._client, a, f"the result could not be stored: {e}")
            raise
        self._client.complete(a.namespace, a.key, a.fence, RawJson(text), cost=a.cost)
        a._stored(text)


class AsyncGuarded:
    """``async with guarded(async_client, …) as attempt:`` — see :func:`guarded`."""

    def __init__(
        self,
        client: AsyncClient,
        policy: Policy,
        key: str,
        *,
        request: Any = None,
        fingerprint: str | None = None,
        run: str | None = None,
    ) -> None:
        self._client = client
        self._policy = policy
        self._key = check_key(key)
        self._request = _calls.MISSING if fingerprint is not None else request
        self._fingerprint = fingerprint
        self._run = run
        self._attempt: AsyncAttempt | None = None
        self._beat: _AsyncHeartbeat | None = None
        self._token: contextvars.Token[Attempt | AsyncAttempt | None] | None = None

    async def __aenter__(self) -> AsyncAttempt:
        p = self._policy
        answer = await self._client.claim(
            p.namespace,
            self._key,
            request=self._request,
            fingerprint=self._fingerprint,
            lease=p.lease,
            retention=p.retention,
            run=self._run,
            wait=p.wait,
            cost=p.cost,
        )
        attempt = AsyncAttempt(self._client, p, self._key, _interpret(answer, p, self._key))
        self._attempt = attempt
        if not attempt.replayed and p.heartbeat:
            self._beat = _AsyncHeartbeat(self._client, attempt, p.lease)
            self._beat.start()
        self._token = _current.set(attempt)
        return attempt

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        a = self._attempt
        assert a is not None and self._token is not None
        _current.reset(self._token)
        if self._beat is not None:
            await self._beat.stop()
        if a.replayed or (a.completed and exc is None):
            return
        if exc is None:
            try:
                text = a._serialize(a.result)
            except (TypeError, ValueError) as e:
                await _report_unknown_async(self._client, a, f"the result could not be stored: {e}")
                raise
            await self._client.complete(a.namespace, a.key, a.fence, RawJson(text), cost=a.cost)
            a._stored(text)
            return
        if a.completed:
            return
        await _settle_failure_async(self._client, a, self._policy, exc)


def _detail(exc: BaseException) -> str:
    return f"{type(exc).__qualname__}: {exc}"[:1000]


def _report_unknown_sync(client: Client, a: Attempt, detail: str) -> None:
    try:
        client.report_unknown(a.namespace, a.key, a.fence, detail)
    except OnceguardError as e:
        log.warning("onceguard: could not report %s/%s unknown: %s", a.namespace, a.key, e)


async def _report_unknown_async(client: AsyncClient, a: AsyncAttempt, detail: str) -> None:
    try:
        await client.report_unknown(a.namespace, a.key, a.fence, detail)
    except OnceguardError as e:
        log.warning("onceguard: could not report %s/%s unknown: %s", a.namespace, a.key, e)


def _settle_failure_sync(client: Client, a: Attempt, policy: Policy, exc: BaseException) -> None:
    """Store, report or release after the block raised ``exc``; raises ``PermanentFailure`` for
    a stored failure, else returns so that ``exc`` propagates."""
    kind = "unknown" if a._effect_done else policy.classify(exc)
    if kind == "permanent":
        error = failure_of(exc)
        client.fail(a.namespace, a.key, a.fence, retryable=False, error=error, cost=a.cost)
        raise PermanentFailure(error, namespace=a.namespace, key=a.key, replayed=False) from exc
    if kind == "unknown":
        _report_unknown_sync(client, a, _detail(exc))
        return
    try:
        client.fail(a.namespace, a.key, a.fence, retryable=True, error=failure_of(exc), cost=a.cost)
    except OnceguardError as e:  # the lease will pass; the next claim is then a recovery
        log.warning("onceguard: could not release %s/%s: %s", a.namespace, a.key, e)


async def _settle_failure_async(client: AsyncClient, a: AsyncAttempt, policy: Policy, exc: BaseException) -> None:
    """See :func:`_settle_failure_sync`."""
    kind = "unknown" if a._effect_done else policy.classify(exc)
    if kind == "permanent":
        error = failure_of(exc)
        await client.fail(a.namespace, a.key, a.fence, retryable=False, error=error, cost=a.cost)
        raise PermanentFailure(error, namespace=a.namespace, key=a.key, replayed=False) from exc
    if kind == "unknown":
        await _report_unknown_async(client, a, _detail(exc))
        return
    try:
        await client.fail(a.namespace, a.key, a.fence, retryable=True, error=failure_of(exc), cost=a.cost)
    except OnceguardError as e:
        log.warning("onceguard: could not release %s/%s: %s", a.namespace, a.key, e)


@overload
def guarded(
    client: Client,
    namespace: str,
    key: str,
    *,
    request: Any = None,
    fingerprint: str | None = None,
    run: str | None = None,
    lease: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration | None = 10.0,
    cost: int | None = None,
    permanent: ExceptionClasses = (),
    unknown: ExceptionClasses = (),
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
    heartbeat: bool = True,
) -> Guarded: ...


@overload
def guarded(
    client: AsyncClient,
    namespace: str,
    key: str,
    *,
    request: Any = None,
    fingerprint: str | None = None,
    run: str | None = None,
    lease: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration | None = 10.0,
    cost: int | None = None,
    permanent: ExceptionClasses = (),
    unknown: ExceptionClasses = (),
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
    heartbeat: bool = True,
) -> AsyncGuarded: ...


def guarded(
    client: Client | AsyncClient,
    namespace: str,
    key: str,
    *,
    request: Any = None,
    fingerprint: str | None = None,
    run: str | None = None,
    lease: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration | None = 10.0,
    cost: int | None = None,
    permanent: ExceptionClasses = (),
    unknown: ExceptionClasses = (),
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
    heartbeat: bool = True,
) -> Guarded | AsyncGuarded:
    """A block that runs once per ``key`` (``with`` for a :class:`Client`, ``async with`` for an
    :class:`AsyncClient`). The block always runs, so check ``replayed``:

    .. code-block:: python

        with guarded(client, "prod/payments-agent", f"refund-{order}", request=args) as attempt:
            if not attempt.replayed:
                attempt.result = payments.refund(order, amount)   # stored when the block ends
        receipt = attempt.result                                  # the same for every caller

    ``request`` is what the block's effect means (JSON; its fingerprint catches a key reused for
    another request), or give ``fingerprint``. The other options are those of :func:`once`.
    Entering raises :class:`InFlightError`, :class:`KeyConflict`, :class:`DeniedError`, or
    :class:`PermanentFailure` (a stored failure); leaving raises :class:`StaleFence` if the
    lease was taken over, and :class:`PermanentFailure` for an exception in ``permanent``.
    """
    policy = Policy.of(
        namespace,
        lease=lease,
        retention=retention,
        wait=wait,
        cost=cost,
        permanent=permanent,
        unknown=unknown,
        encode=encode,
        decode=decode,
        heartbeat=heartbeat,
    )
    if isinstance(client, AsyncClient):
        return AsyncGuarded(client, policy, key, request=request, fingerprint=fingerprint, run=run)
    return Guarded(client, policy, key, request=request, fingerprint=fingerprint, run=run)


# ------------------------------------------------------------------------------------------------
# The decorator
# ------------------------------------------------------------------------------------------------


def once(
    client: Client | AsyncClient,
    namespace: str,
    *,
    version: str = "v1",
    key: str | Callable[..., str] | None = None,
    name: str | None = None,
    run: str | Callable[..., str | None] | None = None,
    lease: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration | None = 10.0,
    cost: int | None = None,
    permanent: ExceptionClasses = (),
    unknown: ExceptionClasses = (),
    ignore: Sequence[str] = (),
    encode: Callable[[Any], Any] | None = None,
    decode: Callable[[Any], Any] | None = None,
    heartbeat: bool = True,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Make a function (sync, with a :class:`Client`; or ``async def``, with an
    :class:`AsyncClient`) run once per key:

    .. code-block:: python

        @once(client, "prod/payments-agent", version="v1", permanent=(CardDeclined,))
        def refund(order: int, amount: int) -> dict:
            return payments.refund(order, amount)

    - ``key``: by default derived from the bound arguments (see :mod:`onceguard.keys`:
      canonical JSON + ``name`` + ``version``); or a fixed string; or a function of the same
      arguments returning the key. The arguments (as JSON) are sent as the claim's ``request``,
      so a fixed or computed key reused with other arguments raises :class:`KeyConflict`.
    - ``version``: part of derived keys; change it when the function's effect changes meaning.
    - ``name``: part of derived keys (default: the function's ``__qualname__``); pin it to keep
      keys across a rename.
    - ``run``: the run the key is charged to (a string, or a function of the arguments).
    - ``lease`` (default 30s, extended by the heartbeat while the function runs), ``retention``
      (default: the server's, 24h), ``wait`` (how long a call waits on the server for another
      caller holding the key, default 10s, at most 30s), ``cost`` (cost units declared to the
      run's budget).
    - ``permanent`` / ``unknown``: exception classes stored as a failure / reported unknown;
      other exceptions release the key.
    - ``ignore``: parameter names left out of the key and the request (e.g. a connection).
    - ``encode`` / ``decode``: turn the result into JSON values / rebuild it from them
      (default: :func:`onceguard.keys.jsonable` / as stored). Every caller, the first included,
      gets ``decode(stored JSON)``: the same value, whether run or replayed.
    - ``heartbeat``: extend the lease while the function runs (default on).
    """
    policy = Policy.of(
        namespace,
        lease=lease,
        retention=retention,
        wait=wait,
        cost=cost,
        permanent=permanent,
        unknown=unknown,
        encode=encode,
        decode=decode,
        heartbeat=heartbeat,
    )
    check_label("version", version, 32)
    if isinstance(key, str):
        check_key(key)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(func)
        fname = check_label("name", name or function_name(func), 128)
        is_async = inspect.iscoroutinefunction(func)
        if is_async and not isinstance(client, AsyncClient):
            raise TypeError(f"{fname} is a coroutine function: guard it with an onceguard.AsyncClient")
        if not is_async and not isinstance(client, Client):
            raise TypeError(f"{fname} is not a coroutine function: guard it with an onceguard.Client")

        def key_request_run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any, str | None]:
            arguments = bound_arguments(signature, args, kwargs, ignore)
            if key is None:
                k = derive_key(fname, version, arguments)
            elif isinstance(key, str):
                k = key
            else:
                k = check_key(key(*args, **kwargs))
            r = run(*args, **kwargs) if callable(run) else run
            return k, arguments, r

        if is_async:
            async_func = cast(Callable[..., Awaitable[Any]], func)

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                k, request, r = key_request_run(args, kwargs)
                async with AsyncGuarded(cast(AsyncClient, client), policy, k, request=request, run=r) as attempt:
                    if not attempt.replayed:
                        value = await async_func(*args, **kwargs)
                        if not attempt.completed:  # unless it completed early through current()
                            attempt.result = value
                return attempt.result

            return cast(Callable[P, R], run_async)

        @functools.wraps(func)
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            k, request, r = key_request_run(args, kwargs)
            with Guarded(cast(Client, client), policy, k, request=request, run=r) as attempt:
                if not attempt.replayed:
                    value = func(*args, **kwargs)
                    if not attempt.completed:  # unless it completed early through current()
                        attempt.result = value
            return attempt.result

        return cast(Callable[P, R], run_sync)

    return decorate
