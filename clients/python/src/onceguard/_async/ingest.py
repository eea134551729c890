"""``once_each``: many items, each done once per key, in batches: the helper of ingestion
pipelines (embed, index, summarise) whose re-runs must not pay again for what is stored."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from .._calls import ClaimItem, CompleteItem
from .._wire import Duration
from ..errors import (
    AwaitingApproval,
    InFlightError,
    KeyConflict,
    OnceguardError,
    PermanentFailure,
    ResultNotKept,
    denied_error,
)
from ..models import Acquired, Denied, InFlight, Mismatch, PendingApproval, Proceed, Replay
from . import _backend
from .client import AsyncClient

#: What an item's work cost, from the item and its result: cost units, or model tokens.
Spent = Callable[[Any, Any], int | None]


async def once_each(
    client: AsyncClient,
    namespace: str,
    items: Sequence[Any],
    key: Callable[[Any], str],
    work: _backend.Work,
    *,
    request: Callable[[Any], Any] | None = None,
    summary: Callable[[Any], str | None] | None = None,
    cost: Spent | None = None,
    tokens: Spent | None = None,
    lease: Duration | None = None,
    retention: Duration | None = None,
    run: str | None = None,
    batch_size: int = 1_000,
    wait: float = 60.0,
) -> list[Any]:
    """Every item's result, in order: stored ones replayed, the others done by ``work`` once.

    Items are claimed ``batch_size`` at a time (``claim_batch``), each under ``key(item)`` with
    the fingerprint of ``request(item)`` (default: the key itself). ``work`` is called once per
    batch with the items this worker acquired, and answers their results (JSON values) in the
    same order; they are stored (``complete_batch``, with ``cost(item, result)`` cost units and
    ``tokens(item, result)`` model tokens if given, which every replay counts as saved), so a
    re-run, or another worker, replays them. Items another worker holds are waited for (up to
    ``wait`` seconds, then :class:`onceguard.InFlightError` for the first of them) and
    replayed, or done here if that worker gave them up: two workers over the same items never
    do one twice. A replayed result is the stored JSON, decoded.

    In a namespace in observe mode, an item that enforcing would not let this worker do
    (:class:`onceguard.Proceed`: stored already, held by another worker…) is done by ``work``
    all the same, and its result returned, not stored.

    Where the namespace requires approval, ``summary(item)`` tells the approver what the
    item's work does; items pending approval are left undone (nothing acquired), every other
    item is done and stored, then :class:`onceguard.AwaitingApproval` is raised for the first
    pending one: a re-run once they are approved does only them.

    If ``work`` raises, the batch's keys are released (a retry does them again) and the error
    propagates. A key used before with another request raises :class:`onceguard.KeyConflict`,
    a denial (budget, quota, switch) :class:`onceguard.DeniedError` (an approver's
    :class:`onceguard.ApprovalDenied`), a stored failure (stored
    under the key by other code) :class:`onceguard.PermanentFailure`, a replay in a namespace
    that keeps only a digest of each outcome :class:`onceguard.ResultNotKept` (its item is never
    done again). Choose a ``lease`` longer than ``work`` takes for one batch: nothing extends
    it meanwhile.
    """
    if batch_size < 1:
        raise ValueError("batch_size is at least 1")
    results: list[Any] = [None] * len(items)
    awaiting: list[tuple[str, PendingApproval]] = []
    for start in range(0, len(items), batch_size):
        places = list(range(start, min(start + batch_size, len(items))))
        claims = {
            i: ClaimItem(
                namespace,
                key(items[i]),
                request=key(items[i]) if request is None else request(items[i]),
                lease=lease,
                retention=retention,
                run=run,
                summary=None if summary is None else summary(items[i]),
            )
            for i in places
        }
        awaiting += await _each_batch(client, namespace, items, places, results, claims, work, (cost, tokens), wait)
    if awaiting:
        first, pending = awaiting[0]
        raise AwaitingApproval(pending.approval, namespace=namespace, key=first, retry_after=pending.retry_after)
    return results


async def _each_batch(
    client: AsyncClient,
    namespace: str,
    items: Sequence[Any],
    places: list[int],
    results: list[Any],
    claims: dict[int, ClaimItem],
    work: _backend.Work,
    spent: tuple[Spent | None, Spent | None],
    wait: float,
) -> list[tuple[str, PendingApproval]]:
    """Do the batch's items; answers the key and answer of each item pending approval."""
    awaiting: list[tuple[str, PendingApproval]] = []
    deadline = time.monotonic() + wait
    pending = places
    while pending:
        answers = await client.claim_batch([claims[i] for i in pending])
        acquired: list[tuple[int, Acquired]] = []
        proceeding: list[int] = []
        waiting: list[int] = []
        nap = 0.5
        for i, answer in zip(pending, answers):
            if isinstance(answer, Replay):
                if answer.digest is not None:
                    raise ResultNotKept(answer.digest, status=answer.status, namespace=namespace, key=claims[i].key)
                if not answer.succeeded:
                    raise PermanentFailure(answer.result, namespace=namespace, key=claims[i].key, replayed=True)
                results[i] = answer.result
            elif isinstance(answer, Acquired):
                acquired.append((i, answer))
            elif isinstance(answer, Proceed):
                proceeding.append(i)
            elif isinstance(answer, InFlight):
                waiting.append(i)
                nap = min(nap, max(answer.retry_after, 0.05))
            elif isinstance(answer, Mismatch):
                raise KeyConflict(namespace=namespace, key=claims[i].key, detail=answer.detail)
            elif isinstance(answer, Denied):
                raise denied_error(answer, namespace=namespace, key=claims[i].key)
            elif isinstance(answer, PendingApproval):
                awaiting.append((claims[i].key, answer))
        if acquired or proceeding:
            await _work_and_store(client, namespace, items, acquired, proceeding, results, claims, work, spent)
        pending = waiting
        if pending:
            if time.monotonic() >= deadline:
                raise InFlightError(namespace=namespace, key=claims[pending[0]].key, retry_after=nap, attempt=None)
            await _backend.sleep(nap)
    return awaiting


async def _work_and_store(
    client: AsyncClient,
    namespace: str,
    items: Sequence[Any],
    acquired: list[tuple[int, Acquired]],
    proceeding: list[int],
    results: list[Any],
    claims: dict[int, ClaimItem],
    work: _backend.Work,
    spent: tuple[Spent | None, Spent | None],
) -> None:
    """Do the acquired items and those observe mode lets proceed, in one call of ``work``;
    store the acquired ones' results (the others hold nothing)."""
    todo = [i for i, _ in acquired] + proceeding
    try:
        done = list(await work([items[i] for i in todo]))
        if len(done) != len(todo):
            raise ValueError(f"work answered {len(done)} results for {len(todo)} items")
    except BaseException:
        for i, held in acquired:  # released: a retry does them again
            try:
                await client.fail(namespace, claims[i].key, held.fence, retryable=True)
            except OnceguardError:
                pass  # the lease passes by itself
        raise
    for i, value in zip(proceeding, done[len(acquired) :]):
        results[i] = value
    if not acquired:
        return
    cost, tokens = spent
    stored = await client.complete_batch(
        [
            CompleteItem(
                namespace,
                claims[i].key,
                held.fence,
                value,
                cost=None if cost is None else cost(items[i], value),
                tokens=None if tokens is None else tokens(items[i], value),
            )
            for (i, held), value in zip(acquired, done)
        ]
    )
    for (i, _), value, record in zip(acquired, done, stored):
        if isinstance(record, OnceguardError):
            raise record  # the lease passed and another worker took the key over
        results[i] = value
