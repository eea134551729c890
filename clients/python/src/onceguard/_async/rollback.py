"""The compensation worker for an :class:`AsyncClient` (:func:`onceguard.run_compensations`
picks it by the client's type): it runs the compensations of a run being rolled back, one task
at a time, until none is left.

Each task is held as an acquired claim of its own key: the handler runs under a heartbeat that
extends the lease, with :func:`onceguard.current` giving the task's attempt (its ``recovery``
when an earlier worker died holding it, and ``checkpoint()``); then the task is completed with
the handler's answer, or failed. A failure is permanent (kept, shown in the rollback, never
handed out again) unless its exception is of a class in ``retryable``, which hands the task
out again; a task whose compensation has no handler here fails permanently, saying so, and is
never skipped. An interruption (``KeyboardInterrupt``, cancellation) leaves the task held: once
its lease passes, the next worker recovers it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

from .._attempts import ExceptionClasses, Policy, exception_classes, failure_of, running
from .._undo import find_undo
from .._wire import Duration, RawJson, dumps, duration_seconds
from ..errors import StaleFence
from ..keys import jsonable
from ..models import CompensationReport, CompensationsBusy, CompensationsDone, CompensationTask
from . import _backend
from ._heartbeat import Heartbeat
from .client import AsyncClient
from .guard import AsyncAttempt

__all__ = ["run_compensations"]

log = logging.getLogger("onceguard")

#: What a task's handler made of it.
COMPENSATED, FAILED, RELEASED = "compensated", "failed", "released"


async def run_compensations(
    client: AsyncClient,
    run: str,
    handlers: Mapping[str, Callable[[Any], Any]] | None = None,
    *,
    max_tasks: int | None = None,
    idle_timeout: float = 60.0,
    lease: Duration = 30.0,
    retryable: ExceptionClasses = (),
) -> CompensationReport:
    """Run the compensations of ``run`` until the rollback answers ``done``, this worker has
    taken ``max_tasks`` tasks, or other workers have held every task left for
    ``idle_timeout`` seconds in a row (it claims again after each ``retry_after``, so a task
    whose worker died is recovered here once its lease passes). ``lease`` is each task's,
    extended while its handler runs. Answers what this worker did."""
    if max_tasks is not None and max_tasks < 0:
        raise ValueError("max_tasks is at least 0")
    explicit = dict(handlers or {})
    for name, given in explicit.items():
        if not _backend.can_call(given):
            raise TypeError(f"the handler of {name!r} is a coroutine function: the asyncio client's run_compensations runs it")
    seconds = duration_seconds(lease)
    again = exception_classes(retryable)
    counts = {COMPENSATED: 0, FAILED: 0, RELEASED: 0}
    taken = 0
    idle_since: float | None = None
    while max_tasks is None or taken < max_tasks:
        answer = await client.claim_compensation(run, seconds)
        if isinstance(answer, CompensationsDone):
            return CompensationReport(counts[COMPENSATED], counts[FAILED], counts[RELEASED], done=True)
        if isinstance(answer, CompensationsBusy):
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            left = idle_since + idle_timeout - now
            if left <= 0:
                break
            await _backend.sleep(min(max(answer.retry_after, 0.05), left))
            continue
        idle_since = None
        taken += 1
        name = answer.compensation.name
        handler = explicit.get(name) or find_undo(name)
        counts[await _compensate(client, answer, handler, seconds, again)] += 1
    return CompensationReport(counts[COMPENSATED], counts[FAILED], counts[RELEASED], done=False)


async def _compensate(
    client: AsyncClient,
    task: CompensationTask,
    handler: Callable[[Any], Any] | None,
    lease: float,
    retryable: tuple[type[BaseException], ...],
) -> str:
    """Run one task's handler and finish the task; answers what became of it."""
    name = task.compensation.name
    if handler is None:
        error = {
            "type": "onceguard.NoHandler",
            "message": f"no handler is known for the compensation {name!r}: pass one in handlers, "
            "or import the module whose @once or guarded declares it as undo",
        }
        log.error("onceguard: %s/%s: %s", task.namespace, task.key, error["message"])
        return await _fail(client, task, retryable=False, error=error)
    if not _backend.can_call(handler):
        error = {"type": "TypeError", "message": f"the handler of {name!r} is a coroutine function"}
        await _fail(client, task, retryable=True, error=error)  # another (async) worker may run it
        raise TypeError(f"the handler of {name!r} is a coroutine function: the asyncio client's run_compensations runs it")
    attempt = AsyncAttempt(client, Policy.of(task.namespace, lease=lease), task.key, task.acquired)
    beat = Heartbeat(client, attempt, lease)
    beat.start()
    token = running.set(attempt)
    try:
        try:
            value = await _backend.verdict(handler, task.compensation.data)
        finally:
            running.reset(token)
            await beat.stop()
    except Exception as exc:
        again = isinstance(exc, retryable)
        log.warning(
            "onceguard: compensation %r of %s/%s failed (%s): %r",
            name,
            task.effect.namespace,
            task.effect.key,
            "retryable" if again else "permanent",
            exc,
        )
        return await _fail(client, task, retryable=again, error=failure_of(exc))
    if attempt.completed:  # the handler completed it itself, through current()
        return COMPENSATED
    try:
        text = dumps(jsonable(value))
    except (TypeError, ValueError) as e:
        error = {"type": type(e).__qualname__, "message": f"the compensation ran, and its answer is not JSON: {e}"}
        return await _fail(client, task, retryable=False, error=error)
    try:
        await client.complete(task.namespace, task.key, task.fence, RawJson(text))
    except StaleFence as e:
        log.warning("onceguard: compensation %s/%s was taken over meanwhile: %s", task.namespace, task.key, e)
        return RELEASED
    return COMPENSATED


async def _fail(client: AsyncClient, task: CompensationTask, *, retryable: bool, error: Any) -> str:
    try:
        await client.fail(task.namespace, task.key, task.fence, retryable=retryable, error=error)
    except StaleFence as e:
        log.warning("onceguard: compensation %s/%s was taken over meanwhile: %s", task.namespace, task.key, e)
        return RELEASED
    return RELEASED if retryable else FAILED
