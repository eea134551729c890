""":class:`AsyncAttempt`, the block :class:`AsyncGuarded` (under a heartbeat,
:mod:`._heartbeat`) and how it settles a failure: the guards of :class:`AsyncClient` calls. The protocol is told in
:mod:`onceguard.guard`; :func:`onceguard.once` and :func:`onceguard.guarded` pick these or the
others by the client's type."""

from __future__ import annotations

import contextvars
import logging
import time
from types import TracebackType
from typing import Any

from .. import _calls
from .._attempts import (
    MAX_CLAIM_WAIT,
    AttemptBase,
    Happened,
    Policy,
    Replayed,
    Verify,
    detail_of,
    failure_of,
    interpret,
    running,
    still_waiting,
)
from .._wire import Duration, RawJson, duration_seconds
from ..errors import OnceguardError, PermanentFailure, StaleFence
from ..keys import check_key, jsonable
from ..models import Acquired, ClaimAnswer, InFlight, PendingApproval, Proceed
from . import _backend
from ._heartbeat import Heartbeat
from .client import AsyncClient

__all__ = ["AsyncAttempt", "AsyncGuarded", "run_guarded"]

log = logging.getLogger("onceguard")


class AsyncAttempt(AttemptBase):
    """The handle of an async guarded call: ``fence``, ``attempt``, ``recovery``, ``checkpoint()`` (awaited)."""

    def __init__(self, client: AsyncClient, policy: Policy, key: str, found: Acquired | Replayed | Proceed) -> None:
        super().__init__(policy, key, found)
        self._client = client

    async def checkpoint(self, name: str, data: Any = None) -> None:
        """Save a recovery point: if this attempt crashes, the next one receives it in
        ``recovery.last_checkpoint``. Raises ``StaleFence`` if the attempt is over. In observe
        mode's ``proceed`` (``observed``), where nothing is held, it saves nothing."""
        self._require_holder()
        if self.observed is not None:
            return
        await self._client.checkpoint(self.namespace, self.key, self.fence, name, jsonable(data))

    async def complete(self, value: Any = None) -> Any:
        """Store ``value`` now (instead of when the block ends), with the compensation of the
        guard's ``undo``; returns it as every caller will see it. Raises ``StaleFence`` if the
        lease was taken over (nothing stored). Once it was called, the effect counts as done: if
        storing fails, the key is reported unknown, never released. In observe mode's
        ``proceed``, nothing is stored."""
        self._require_holder()
        if self._completed:
            raise RuntimeError("the outcome is stored already")
        if self.observed is not None:
            return self._observed_result(value)
        self._effect_done = True
        text = self._serialize(value)
        await self._client.complete(
            self.namespace,
            self.key,
            self.fence,
            RawJson(text),
            cost=self.cost,
            tokens=self.tokens,
            compensation=self._compensation(value, text),
        )
        return self._stored(text)


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
        summary: str | None = None,
    ) -> None:
        self._client = client
        self._policy = policy
        self._key = check_key(key)
        self._request = _calls.MISSING if fingerprint is not None else request
        self._fingerprint = fingerprint
        self._run = run
        self._summary = summary
        self._attempt: AsyncAttempt | None = None
        self._beat: Heartbeat | None = None
        self._token: contextvars.Token[AttemptBase | None] | None = None

    async def __aenter__(self) -> AsyncAttempt:
        p = self._policy
        attempt = AsyncAttempt(self._client, p, self._key, interpret(await self._answer(), p, self._key))
        self._attempt = attempt
        if not attempt.replayed and attempt.observed is None and p.heartbeat:
            self._beat = Heartbeat(self._client, attempt, p.lease)
            self._beat.start()
        self._token = running.set(attempt)
        if attempt.recovery is not None and p.verify is not None:
            await self._verify(attempt, p.verify)
        return attempt

    async def _claim(self, wait: Duration | None) -> ClaimAnswer:
        p = self._policy
        return await self._client.claim(
            p.namespace,
            self._key,
            request=self._request,
            fingerprint=self._fingerprint,
            lease=p.lease,
            retention=p.retention,
            run=self._run,
            wait=wait,
            cost=p.cost,
            summary=self._summary,
            verify_hook=p.verify is not None,
        )

    async def _answer(self) -> ClaimAnswer:
        """The claim's answer. The first claim does not wait: where the namespace requires
        approval, the server would spend that wait on a person's decision, which only
        ``wait_for_approval`` asks for. A key in flight is claimed again until ``wait`` has
        passed (the server waits at most 30 s on one claim: a longer ``wait`` outlasts a crashed
        holder's lease, and the call then recovers the key); a call pending approval, with
        ``wait_for_approval``, claimed again (each claim waiting on the server) until it is
        decided or the time is up."""
        p = self._policy
        answer = await self._claim(None)
        if isinstance(answer, InFlight) and p.wait:
            deadline = time.monotonic() + duration_seconds(p.wait)
            while isinstance(answer, InFlight):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                asked = time.monotonic()
                answer = await self._claim(min(left, MAX_CLAIM_WAIT))
                # Should a server answer before the wait it was given, it is not asked again at once.
                if isinstance(answer, InFlight) and time.monotonic() - asked < min(left, MAX_CLAIM_WAIT) / 2:
                    await _backend.sleep(max(0.0, min(1.0, deadline - time.monotonic())))
        if isinstance(answer, PendingApproval) and p.wait_for_approval:
            deadline = time.monotonic() + p.wait_for_approval
            while still_waiting(answer):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                answer = await self._claim(min(left, MAX_CLAIM_WAIT))
        return answer

    async def _verify(self, a: AsyncAttempt, verify: Verify) -> None:
        """Ask ``verify`` whether the earlier attempts' effect happened downstream; if it did,
        store what it found as the outcome (``reconciled``) and end the attempt as a replay.
        A hook that raises, or answers neither :class:`Happened` nor ``None``, leaves the
        outcome as unknown as it was: the key is reported unknown (the next claim is a recovery
        again, and verifies again) and the error propagates."""
        assert a.recovery is not None
        try:
            verdict = await _backend.verdict(verify, a.key, a.fence, a.recovery.last_checkpoint)
            if verdict is None:
                return
            if not isinstance(verdict, Happened):
                raise TypeError(f"verify answers onceguard.Happened(result) or None, not {verdict!r}")
            a.cost, a.tokens = verdict.cost, verdict.tokens
            text = a._serialize(verdict.result)
            await self._client.complete(
                a.namespace,
                a.key,
                a.fence,
                RawJson(text),
                cost=a.cost,
                tokens=a.tokens,
                reconciled=True,
                compensation=a._compensation(verdict.result, text),
            )
        except BaseException as e:
            await self._leave()
            if not isinstance(e, StaleFence):  # a stale fence: the attempt is over, nothing to report
                await _report_unknown(self._client, a, f"verify failed: {detail_of(e)}"[:1000])
            raise
        a._reconciled(text)

    async def _leave(self) -> None:
        """Leave the attempt's context: ``current()`` no more, the heartbeat stopped."""
        assert self._token is not None
        running.reset(self._token)
        if self._beat is not None:
            await self._beat.stop()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        a = self._attempt
        assert a is not None
        await self._leave()
        if a.replayed or (a.completed and exc is None):
            return
        if a.observed is not None:
            _settle_observed(a, self._policy, exc)
            return
        if exc is None:
            await self._complete(a)
            return
        if a.completed:
            return  # the outcome was stored before the block raised: it stands
        await _settle_failure(self._client, a, self._policy, exc)

    async def _complete(self, a: AsyncAttempt) -> None:
        try:
            text = a._serialize(a.result)
        except (TypeError, ValueError) as e:
            await _report_unknown(self._client, a, f"the result could not be stored: {e}")
            raise
        try:
            undo = a._compensation(a.result, text)
        except Exception as e:  # undo_data raised, or its data is not JSON or too large
            await _report_unknown(self._client, a, f"the compensation could not be made: {detail_of(e)}"[:1000])
            raise
        await self._client.complete(
            a.namespace, a.key, a.fence, RawJson(text), cost=a.cost, tokens=a.tokens, compensation=undo
        )
        a._stored(text)


def _settle_observed(a: AsyncAttempt, policy: Policy, exc: BaseException | None) -> None:
    """End an attempt that observe mode let run holding nothing: nothing to store, release or
    report. The result is what a stored one would be (encoded, then decoded); an exception in
    ``permanent`` raises :class:`PermanentFailure`, as enforcing would (not stored), any other
    propagates."""
    if exc is None:
        a._observed_result(a.result)
        return
    if not a.completed and policy.classify(exc) == "permanent":
        raise PermanentFailure(failure_of(exc), namespace=a.namespace, key=a.key, replayed=False) from exc


async def _report_unknown(client: AsyncClient, a: AsyncAttempt, detail: str) -> None:
    try:
        await client.report_unknown(a.namespace, a.key, a.fence, detail)
    except OnceguardError as e:
        log.warning("onceguard: could not report %s/%s unknown: %s", a.namespace, a.key, e)


async def _settle_failure(client: AsyncClient, a: AsyncAttempt, policy: Policy, exc: BaseException) -> None:
    """Store, report or release after the block raised ``exc``; raises ``PermanentFailure`` for
    a stored failure, else returns so that ``exc`` propagates."""
    kind = "unknown" if a._effect_done else policy.classify(exc)
    if kind == "permanent":
        error = failure_of(exc)
        await client.fail(a.namespace, a.key, a.fence, retryable=False, error=error, cost=a.cost, tokens=a.tokens)
        raise PermanentFailure(error, namespace=a.namespace, key=a.key, replayed=False) from exc
    if kind == "unknown":
        await _report_unknown(client, a, detail_of(exc))
        return
    try:
        await client.fail(a.namespace, a.key, a.fence, retryable=True, error=failure_of(exc), cost=a.cost, tokens=a.tokens)
    except OnceguardError as e:  # the lease will pass; the next claim is then a recovery
        log.warning("onceguard: could not release %s/%s: %s", a.namespace, a.key, e)


async def run_guarded(
    client: AsyncClient,
    policy: Policy,
    key: str,
    job: _backend.Job,
    *,
    request: Any = None,
    run: str | None = None,
    summary: str | None = None,
) -> Any:
    """Run ``job()`` (awaited) once per ``key``, with ``request`` as the claim's request, and
    return its value as stored, or the stored value of an earlier run (or the one the
    policy's ``verify`` found): what :func:`once` and the framework helpers do for each call."""
    async with AsyncGuarded(client, policy, key, request=request, run=run, summary=summary) as attempt:
        if not attempt.replayed:
            value = await job()
            if not attempt.completed:  # unless it completed early through current()
                attempt.result = value
    return attempt.result
