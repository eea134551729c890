"""Work through a rolled-back run's compensations: :func:`run_compensations`, the worker.

``client.rollback(run, why)`` (admin) starts a rollback: each completed effect of the run that
registered a compensation becomes a task. Workers, in any process and with any role, take
those tasks one at a time, newest effect first, each task once across every worker. The worker
of each flavour is written in ``_async/rollback.py`` (the sync one is generated from it);
:func:`run_compensations` picks it by the client's type, as :func:`onceguard.once` does.
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine, Mapping, overload

from ._async import rollback as _async_rollback
from ._attempts import ExceptionClasses
from ._sync import rollback as _sync_rollback
from ._wire import Duration
from .client import AsyncClient, Client
from .models import CompensationReport

__all__ = ["run_compensations"]


@overload
def run_compensations(
    client: Client,
    run: str,
    handlers: Mapping[str, Callable[[Any], Any]] | None = None,
    *,
    max_tasks: int | None = None,
    idle_timeout: float = 60.0,
    lease: Duration = 30.0,
    retryable: ExceptionClasses = (),
) -> CompensationReport: ...


@overload
def run_compensations(
    client: AsyncClient,
    run: str,
    handlers: Mapping[str, Callable[[Any], Any]] | None = None,
    *,
    max_tasks: int | None = None,
    idle_timeout: float = 60.0,
    lease: Duration = 30.0,
    retryable: ExceptionClasses = (),
) -> Coroutine[Any, Any, CompensationReport]: ...


def run_compensations(
    client: Client | AsyncClient,
    run: str,
    handlers: Mapping[str, Callable[[Any], Any]] | None = None,
    *,
    max_tasks: int | None = None,
    idle_timeout: float = 60.0,
    lease: Duration = 30.0,
    retryable: ExceptionClasses = (),
) -> CompensationReport | Coroutine[Any, Any, CompensationReport]:
    """Work on a run's rollback (a worker; any role) with ``client`` (awaited for an
    :class:`AsyncClient`): claim a task, call the handler of its compensation's name with its
    data (from ``handlers`` first, else the undo functions registered by ``@once``/``guarded``;
    with an :class:`AsyncClient` a coroutine function is awaited, with a :class:`Client` it is
    refused with a ``TypeError``), and complete the task with the handler's answer (JSON;
    ``None`` is ``null``). A handler that raises fails the task permanently (kept and shown,
    never handed out again), unless its exception is of a class in ``retryable``, which hands it
    out again; a compensation with no handler here fails permanently, saying so. The handler
    runs under a heartbeat extending the task's ``lease``; :func:`onceguard.current` gives its
    attempt (``recovery`` when an earlier worker died holding it, ``checkpoint()``).

    It stops when the rollback answers ``done``, after ``max_tasks`` tasks, or after
    ``idle_timeout`` seconds in a row of other workers holding every task left (claiming again
    after each ``retry_after``: a task whose worker died is recovered once its lease passes),
    and answers what this worker did. Raises :class:`onceguard.NotFound` if the run is not
    being rolled back.

    .. code-block:: python

        report = onceguard.run_compensations(client, run)
        report = await onceguard.run_compensations(async_client, run)
    """
    if isinstance(client, AsyncClient):
        return _async_rollback.run_compensations(
            client, run, handlers, max_tasks=max_tasks, idle_timeout=idle_timeout, lease=lease, retryable=retryable
        )
    return _sync_rollback.run_compensations(
        client, run, handlers, max_tasks=max_tasks, idle_timeout=idle_timeout, lease=lease, retryable=retryable
    )
