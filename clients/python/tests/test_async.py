"""The async client, ``once`` on coroutines and ``async with guarded`` against a real server."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import onceguard
from onceguard import Acquired, InFlight, Mismatch, Replay, current, guarded, once


class Declined(Exception):
    pass


async def test_async_client_answers(aclient: onceguard.AsyncClient, ns: str) -> None:
    a = await aclient.claim(ns, "k", request={"a": 1}, lease=5)
    assert isinstance(a, Acquired)
    assert isinstance(await aclient.claim(ns, "k", request={"a": 1}), InFlight)
    assert isinstance(await aclient.claim(ns, "k", request={"a": 2}), Mismatch)
    await aclient.checkpoint(ns, "k", a.fence, "step", [1])
    await aclient.extend(ns, "k", a.fence, 10)
    await aclient.complete(ns, "k", a.fence, onceguard.RawJson('{"ok" : true}'))
    replay = await aclient.claim(ns, "k", request={"a": 1})
    assert isinstance(replay, Replay) and replay.raw == b'{"ok" : true}'
    record = await aclient.get_record(ns, "k")
    assert record is not None and record.stored is not None and record.stored.raw == b'{"ok" : true}'
    assert [r.key async for r in aclient.iter_records(namespace_prefix=ns)] == ["k"]
    with pytest.raises(onceguard.StaleFence):
        await aclient.fail(ns, "k", a.fence + 1, retryable=True)


async def test_async_once_runs_once_and_replays(aclient: onceguard.AsyncClient, ns: str) -> None:
    effects = 0

    @once(aclient, ns, version="v1")
    async def embed(doc: str, model: str = "small") -> list[float]:
        nonlocal effects
        effects += 1
        await asyncio.sleep(0)
        return [0.5, 1.0]

    assert await embed("doc-1") == [0.5, 1.0]
    assert await embed(doc="doc-1", model="small") == [0.5, 1.0]
    assert effects == 1


async def test_concurrent_tasks_racing_one_key_run_once(aclient: onceguard.AsyncClient, ns: str) -> None:
    effects = 0

    @once(aclient, ns, wait=10)
    async def send(to: str) -> dict[str, Any]:
        nonlocal effects
        effects += 1
        await asyncio.sleep(0.3)
        return {"sent": to}

    results = await asyncio.gather(*(send("ops@example.com") for _ in range(5)))
    assert effects == 1
    assert results == [{"sent": "ops@example.com"}] * 5


async def test_async_heartbeat_keeps_a_short_lease(aclient: onceguard.AsyncClient, ns: str) -> None:
    seen: dict[str, Any] = {}

    @once(aclient, ns, key="slow", lease=0.6)
    async def slow() -> str:
        await asyncio.sleep(1.0)  # past the lease: only the heartbeat keeps it
        seen["during"] = await aclient.claim(ns, "slow", request={})
        await asyncio.sleep(0.5)
        return "done"

    assert await slow() == "done"
    assert isinstance(seen["during"], InFlight)


async def test_async_permanent_failure_and_retryable_failure(aclient: onceguard.AsyncClient, ns: str) -> None:
    runs = 0

    @once(aclient, ns, permanent=Declined)
    async def charge(card: str) -> None:
        nonlocal runs
        runs += 1
        if card == "flaky" and runs == 1:
            raise ConnectionError("reset")
        raise Declined("no")

    with pytest.raises(ConnectionError):
        await charge("flaky")
    with pytest.raises(onceguard.PermanentFailure) as e:
        await charge("flaky")
    assert not e.value.replayed
    with pytest.raises(onceguard.PermanentFailure) as e:
        await charge("flaky")
    assert e.value.replayed and runs == 2


async def test_cancelled_call_is_reported_unknown_and_recovered(aclient: onceguard.AsyncClient, ns: str) -> None:
    started = asyncio.Event()

    @once(aclient, ns, key="long")
    async def long_job() -> str:
        attempt = current()
        if attempt.recovery is None:
            assert isinstance(attempt, onceguard.AsyncAttempt)
            await attempt.checkpoint("half", {"done": 50})
            started.set()
            await asyncio.sleep(30)
        assert attempt.recovery is not None and attempt.recovery.reason == "reported_unknown"
        assert attempt.recovery.last_checkpoint is not None
        return f"resumed at {attempt.recovery.last_checkpoint.data['done']}"

    task = asyncio.create_task(long_job())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await long_job() == "resumed at 50"


async def test_async_guarded_block(aclient: onceguard.AsyncClient, ns: str) -> None:
    effects = 0
    for _ in range(2):
        async with guarded(aclient, ns, "ticket-1", request={"title": "disk full"}) as attempt:
            if not attempt.replayed:
                effects += 1
                attempt.result = {"ticket": "T-1"}
        assert attempt.result == {"ticket": "T-1"}
    assert effects == 1


async def test_coroutine_needs_the_async_client(client: onceguard.Client, ns: str) -> None:
    with pytest.raises(TypeError):

        @once(client, ns)
        async def f() -> None: ...
