"""Run a function or a block once per key: :func:`once` and :func:`guarded`.

The protocol, the same for both and for the framework helpers:

1. **claim** the key (with the request, so that a key reused for another request is caught),
   waiting up to ``wait`` on the server if another caller holds it;
2. the claim answers
   - ``replay``: the stored outcome is returned (decoded from the stored JSON) without running
     anything; a stored permanent failure raises :class:`PermanentFailure` again; where the
     namespace keeps only a digest of each outcome, :class:`ResultNotKept` (it ran once, and
     there is no result to return);
   - ``acquired``: the function runs while a **heartbeat** (on shared threads, or an asyncio task)
     extends the lease every third of it; the handle :func:`current` gives the fence, the
     attempt number, the ``recovery`` of a crashed earlier attempt and ``checkpoint()``;
     If the claim is a **recovery** and a ``verify`` hook is given, it is asked first whether
     the earlier attempt's effect happened downstream: if it answers :class:`Happened`, its
     result is stored as the outcome (``reconciled``) and returned, and the function does not
     run; if ``None``, the function runs;
   - ``in_flight`` after the wait: :class:`InFlightError`; ``mismatch``: :class:`KeyConflict`;
     ``denied``: :class:`DeniedError` (:class:`ApprovalDenied` for an approver's refusal);
     ``pending_approval`` (after ``wait_for_approval``, if given): :class:`AwaitingApproval`;
   - ``proceed`` (a namespace in **observe mode**, where enforcing would not have let the call
     run): the function runs holding nothing (no heartbeat, no fence), and its result is
     returned (encoded and decoded, as every caller gets a stored one); nothing is completed,
     failed or reported; an exception in
     ``permanent`` raises :class:`PermanentFailure` (nothing stored), any other propagates;
3. the heartbeat is stopped (and joined), then
   - a return value is serialized as JSON and **completed**; every caller, the first included,
     gets the value decoded from those stored bytes, so all callers see the same value; a
     ``stale`` answer (the lease was taken over meanwhile) raises :class:`StaleFence`: the
     result is **not** stored; with an ``undo``, the completion registers the effect's
     **compensation** (its name, and ``undo_data(result)`` or the result as data), which a
     rollback of the run hands to ``run_compensations``;
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

import functools
import inspect
from typing import Any, Awaitable, Callable, ParamSpec, Sequence, TypeVar, Union, cast, overload

# The async guards are written in _async/guard.py; the sync ones are generated from it
# (scripts/unasync.py).
from ._async import guard as _async_guard
from ._async.guard import AsyncAttempt, AsyncGuarded
from ._attempts import ExceptionClasses, Happened, Policy, Verify, failure_of, running  # failure_of: as before
from ._sync import guard as _sync_guard
from ._sync.guard import Attempt, Guarded
from ._wire import Duration
from .client import AsyncClient, Client
from .keys import bound_arguments, check_key, check_label, function_name, key_of_json

__all__ = ["Attempt", "AsyncAttempt", "Guarded", "AsyncGuarded", "Happened", "current", "guarded", "once"]

P = ParamSpec("P")
R = TypeVar("R")


def current() -> Attempt | AsyncAttempt:
    """The attempt of the guarded function (or block) running in this context.

    Raises ``LookupError`` outside of one. In a sync function it is an :class:`Attempt`, in a
    coroutine an :class:`AsyncAttempt`.
    """
    attempt = running.get()
    if attempt is None:
        raise LookupError("onceguard.current() is only available inside a function guarded by once()/guarded()")
    return cast(Union[Attempt, AsyncAttempt], attempt)


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
    summary: str | None = None,
    wait_for_approval: Duration | None = None,
    verify: Verify | None = None,
    undo: Callable[..., Any] | None = None,
    undo_name: str | None = None,
    undo_data: Callable[[Any], Any] | None = None,
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
    summary: str | None = None,
    wait_for_approval: Duration | None = None,
    verify: Verify | None = None,
    undo: Callable[..., Any] | None = None,
    undo_name: str | None = None,
    undo_data: Callable[[Any], Any] | None = None,
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
    summary: str | None = None,
    wait_for_approval: Duration | None = None,
    verify: Verify | None = None,
    undo: Callable[..., Any] | None = None,
    undo_name: str | None = None,
    undo_data: Callable[[Any], Any] | None = None,
) -> Guarded | AsyncGuarded:
    """A block that runs once per ``key`` (``with`` for a :class:`Client`, ``async with`` for an
    :class:`AsyncClient`). The block always runs, so check ``replayed``:

    .. code-block:: python

        with guarded(client, "prod/payments-agent", f"refund-{order}", request=args) as attempt:
            if not attempt.replayed:
                attempt.result = payments.refund(order, amount)   # stored when the block ends
        receipt = attempt.result                                  # the same for every caller

    ``request`` is what the block's effect means (JSON; its fingerprint catches a key reused for
    another request), or give ``fingerprint``. ``summary`` is a string. The other options are
    those of :func:`once`; where ``verify`` found the effect happened, the attempt is
    ``replayed`` (and ``reconciled``), with its ``result``, so the block must not do it again.
    In a namespace in observe mode, a block that enforcing would not let run enters with
    ``observed`` set (the claim's :class:`Proceed`) and ``replayed`` false: it runs, and its
    ``result`` is not stored. ``undo`` (with ``undo_name``, ``undo_data``) registers a
    compensation when the block's outcome is stored, as for :func:`once`.
    Entering raises :class:`InFlightError`, :class:`KeyConflict`, :class:`DeniedError`
    (:class:`ApprovalDenied`), :class:`AwaitingApproval`, :class:`PermanentFailure` (a stored
    failure), or :class:`ResultNotKept` (it ran once, in a namespace that keeps only a digest);
    leaving raises :class:`StaleFence` if the lease was taken over, and
    :class:`PermanentFailure` for an exception in ``permanent``.
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
        wait_for_approval=wait_for_approval,
        verify=verify,
        undo=undo,
        undo_name=undo_name,
        undo_data=undo_data,
    )
    if isinstance(client, AsyncClient):
        return AsyncGuarded(client, policy, key, request=request, fingerprint=fingerprint, run=run, summary=summary)
    if verify is not None and inspect.iscoroutinefunction(verify):
        raise TypeError("a block guarded with an onceguard.Client needs a verify that is not a coroutine function")
    return Guarded(client, policy, key, request=request, fingerprint=fingerprint, run=run, summary=summary)


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
    summary: str | Callable[..., str | None] | None = None,
    wait_for_approval: Duration | None = None,
    verify: Verify | None = None,
    undo: Callable[..., Any] | None = None,
    undo_name: str | None = None,
    undo_data: Callable[[Any], Any] | None = None,
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
      (default: the server's, 24h), ``wait`` (how long a call waits for another caller holding
      the key, default 10s; the server waits at most 30s on one claim, so a longer wait claims
      again until it has passed, and outlasts a crashed holder's lease), ``cost`` (cost units
      declared to the run's budget).
    - ``permanent`` / ``unknown``: exception classes stored as a failure / reported unknown;
      other exceptions release the key.
    - ``ignore``: parameter names left out of the key and the request (e.g. a connection).
    - ``encode`` / ``decode``: turn the result into JSON values / rebuild it from them
      (default: :func:`onceguard.keys.jsonable` / as stored). Every caller, the first included,
      gets ``decode(stored JSON)``: the same value, whether run or replayed.
    - ``heartbeat``: extend the lease while the function runs (default on).
    - ``summary``: what the call does, for the person who approves it where the namespace
      requires approval (a string, or a function of the arguments; at most 1,024 bytes, no
      control characters but newlines). A call pending approval raises
      :class:`AwaitingApproval` (nothing was done); ``wait_for_approval`` (a duration) waits
      for the decision instead, claiming again until then: approved, the function runs (once);
      denied, :class:`ApprovalDenied`.
    - ``verify``: a function of ``(key, fence, last_checkpoint)`` (``async def`` for a
      coroutine), asked on a **recovery** only (an earlier attempt crashed, or its outcome was
      reported unknown), before the function runs: did the effect happen downstream? It answers
      ``Happened(result)`` (optionally with ``cost``, ``tokens``): the result is stored as the
      outcome with ``reconciled=True`` and returned, and the function does not run; or ``None``:
      the function runs. ``fence`` is the recovering attempt's; :func:`current` gives its whole
      ``recovery``. A hook that raises or answers anything else (a ``TypeError``) leaves the
      key reported unknown, so the next call verifies again.
    - ``undo``: the function that undoes the effect, called by a compensation worker
      (:func:`onceguard.run_compensations`) with the compensation's data when the run is rolled back.
      Each successful completion registers the compensation ``undo_name`` (default: the undo
      function's ``__qualname__``; a lambda needs one) with ``undo_data(result)`` as data if
      given, else the result as stored (JSON, at most 16 KiB). The function is registered in
      this process under that name (:func:`onceguard.undo_handlers`). ``undo_name`` alone
      registers the compensation for a handler that a worker elsewhere knows by that name. If
      ``undo_data`` raises, or its data cannot be sent, the key is reported unknown (the effect
      happened) and the error propagates.

    In a namespace in observe mode (``mode: observe`` in its settings), a call that enforcing
    would not let run (a replay, in flight, a mismatch, a denial, pending approval) runs anyway
    holding nothing, and returns the function's result (as ``decode`` gives a stored one),
    stored nowhere.
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
        wait_for_approval=wait_for_approval,
        verify=verify,
        undo=undo,
        undo_name=undo_name,
        undo_data=undo_data,
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
        if not is_async and verify is not None and inspect.iscoroutinefunction(verify):
            raise TypeError(f"{fname} is not a coroutine function: its verify must not be one either")

        def claim_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, Any, str | None, str | None]:
            """The claim's key, request, run and summary for these arguments."""
            arguments = bound_arguments(signature, args, kwargs, ignore)
            if key is None:
                k = key_of_json(fname, version, arguments)
            elif isinstance(key, str):
                k = key
            else:
                k = check_key(key(*args, **kwargs))
            r = run(*args, **kwargs) if callable(run) else run
            about = summary(*args, **kwargs) if callable(summary) else summary
            return k, arguments, r, about

        if is_async:
            async_func = cast(Callable[..., Awaitable[Any]], func)

            @functools.wraps(func)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                k, request, r, about = claim_of(args, kwargs)
                return await _async_guard.run_guarded(
                    cast(AsyncClient, client),
                    policy,
                    k,
                    lambda: async_func(*args, **kwargs),
                    request=request,
                    run=r,
                    summary=about,
                )

            return cast(Callable[P, R], run_async)

        @functools.wraps(func)
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            k, request, r, about = claim_of(args, kwargs)
            return _sync_guard.run_guarded(
                cast(Client, client), policy, k, lambda: func(*args, **kwargs), request=request, run=r, summary=about
            )

        return cast(Callable[P, R], run_sync)

    return decorate
