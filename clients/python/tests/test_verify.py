"""Reconciled recoveries: a recovering attempt completes the key with what the downstream system
says happened (``complete(..., reconciled=True)``) instead of running the effect again, and the
guards' ``verify`` hook decides which: ``Happened(result)`` or ``None``.

A recovery is made at once, without waiting for a lease: a first attempt whose exception is in
``unknown`` is reported unknown, and the next claim of its key is a recovery."""

from __future__ import annotations

from typing import Any

import pytest

import onceguard
from onceguard import Acquired, Checkpoint, CompleteItem, Happened, Replay, current, guarded, once


class UpstreamTimeout(Exception):
    pass


def acquired(answer: onceguard.ClaimAnswer) -> Acquired:
    assert isinstance(answer, Acquired), answer
    return answer


def test_a_recovery_may_complete_as_reconciled_and_a_first_attempt_may_not(client: onceguard.Client, ns: str) -> None:
    first = acquired(client.claim(ns, "k", request=1))
    with pytest.raises(onceguard.InvalidRequest) as e:
        client.complete(ns, "k", first.fence, {"tx": 1}, reconciled=True)
    assert e.value.status == 400 and "recovery" in e.value.detail
    with pytest.raises(onceguard.InvalidRequest):
        client.complete_batch([CompleteItem(ns, "k", first.fence, {"tx": 1}, reconciled=True)])
    record = client.get_record(ns, "k")
    assert record is not None and record.state == "in_progress" and not record.reconciled

    client.report_unknown(ns, "k", first.fence, "timed out after sending")
    again = acquired(client.claim(ns, "k", request=1))
    assert again.recovery is not None and again.attempt == 2
    (stored,) = client.complete_batch([CompleteItem(ns, "k", again.fence, {"tx": 1}, cost=4, reconciled=True)])
    assert isinstance(stored, onceguard.Record) and stored.reconciled and stored.state == "completed"
    replay = client.claim(ns, "k", request=1)
    assert isinstance(replay, Replay) and replay.reconciled and replay.result == {"tx": 1} and replay.cost == 4
    record = client.get_record(ns, "k")
    assert record is not None and record.reconciled and record.stored is not None and record.stored.reconciled

    plain = acquired(client.claim(ns, "plain", request=1))
    client.complete(ns, "plain", plain.fence, 1)
    replay = client.claim(ns, "plain", request=1)
    assert isinstance(replay, Replay) and not replay.reconciled
    assert not [r for r in client.iter_records(namespace_prefix=ns) if r.key == "plain"][0].reconciled


def test_verify_happened_stores_its_result_reconciled_and_the_function_does_not_run(
    client: onceguard.Client, ns: str
) -> None:
    runs: list[int] = []
    asked: list[tuple[str, int, Checkpoint | None, Any]] = []

    def verify(key: str, fence: int, checkpoint: Checkpoint | None) -> Happened | None:
        asked.append((key, fence, checkpoint, current().recovery))
        assert checkpoint is not None
        return Happened({"transfer": checkpoint.data["tx"]}, cost=2, tokens=7)

    @once(client, ns, key="transfer-1", unknown=(UpstreamTimeout,), verify=verify)
    def transfer(amount: int) -> dict[str, Any]:
        runs.append(current().attempt)
        current().checkpoint("sent", {"tx": "tx_1"})
        raise UpstreamTimeout("no answer after sending")

    with pytest.raises(UpstreamTimeout):
        transfer(10)
    assert asked == [], "verify is never asked on a first attempt"
    assert transfer(10) == {"transfer": "tx_1"}
    assert runs == [1], "the function did not run again"
    ((key, fence, checkpoint, recovery),) = asked
    record = client.get_record(ns, "transfer-1")
    assert record is not None and record.state == "completed" and record.reconciled
    assert (key, fence, record.attempt) == ("transfer-1", record.fence, 2)
    assert checkpoint is not None and (checkpoint.name, checkpoint.data) == ("sent", {"tx": "tx_1"})
    assert recovery is not None and recovery.reason == "reported_unknown" and "after sending" in (recovery.detail or "")

    assert transfer(10) == {"transfer": "tx_1"}, "then it replays"
    assert len(asked) == 1 and runs == [1]
    replay = client.claim(ns, "transfer-1", request={"amount": 10})
    assert isinstance(replay, Replay) and replay.reconciled and (replay.cost, replay.tokens) == (2, 7)


def test_verify_none_runs_the_function_once(client: onceguard.Client, ns: str) -> None:
    runs: list[int] = []
    asked: list[int] = []

    def verify(key: str, fence: int, checkpoint: Checkpoint | None) -> None:
        asked.append(fence)
        assert checkpoint is None
        return None

    @once(client, ns, unknown=(UpstreamTimeout,), verify=verify)
    def send(to: str) -> str:
        runs.append(current().attempt)
        if len(runs) == 1:
            raise UpstreamTimeout("unknown")
        return f"sent to {to}"

    with pytest.raises(UpstreamTimeout):
        send("ops")
    assert send("ops") == "sent to ops"
    assert send("ops") == "sent to ops"
    assert runs == [1, 2] and len(asked) == 1
    (record,) = list(client.iter_records(namespace_prefix=ns))
    assert record.state == "completed" and not record.reconciled and record.fence == asked[0]


def test_verify_is_not_asked_on_a_first_attempt_nor_on_a_replay(client: onceguard.Client, ns: str) -> None:
    asked: list[str] = []

    @once(client, ns, verify=lambda key, fence, checkpoint: asked.append(key))
    def effect(x: int) -> int:
        return x * 2

    assert effect(2) == 4 and effect(2) == 4
    with guarded(client, ns, "block", request=1, verify=lambda *a: asked.append("block")) as attempt:
        assert not attempt.replayed and not attempt.reconciled
        attempt.result = "done"
    assert asked == []


@pytest.mark.parametrize("answer", ["yes", True, {"result": 1}])
def test_verify_answering_anything_else_is_a_type_error_and_the_key_stays_unknown(
    client: onceguard.Client, ns: str, answer: Any
) -> None:
    runs: list[int] = []
    verdicts: list[Any] = [answer, Happened("found")]

    @once(client, ns, key="k", unknown=(UpstreamTimeout,), verify=lambda *a: verdicts.pop(0))
    def effect() -> str:
        runs.append(1)
        raise UpstreamTimeout("unknown")

    with pytest.raises(UpstreamTimeout):
        effect()
    with pytest.raises(TypeError, match="Happened"):
        effect()
    record = client.get_record(ns, "k")
    assert record is not None and record.state == "in_progress" and record.unknown
    assert "verify failed" in record.unknown
    assert effect() == "found", "the next call is a recovery again, and verifies again"
    assert runs == [1]


def test_a_verify_that_raises_leaves_the_key_unknown(client: onceguard.Client, ns: str) -> None:
    def verify(key: str, fence: int, checkpoint: Checkpoint | None) -> None:
        raise ConnectionError("the ledger is down")

    with pytest.raises(UpstreamTimeout):
        with guarded(client, ns, "k", request=1, unknown=UpstreamTimeout):
            raise UpstreamTimeout("unknown")
    with pytest.raises(ConnectionError):
        with guarded(client, ns, "k", request=1, verify=verify):
            raise AssertionError("must not run")
    record = client.get_record(ns, "k")
    assert record is not None and record.unknown and "the ledger is down" in record.unknown
    second = acquired(client.claim(ns, "k", request=1))
    assert second.recovery is not None and second.attempt == 3


def test_a_guarded_block_whose_verify_found_the_effect_is_replayed_and_reconciled(
    client: onceguard.Client, ns: str
) -> None:
    with pytest.raises(UpstreamTimeout):
        with guarded(client, ns, "ticket-1", request={"title": "disk"}, unknown=UpstreamTimeout):
            raise UpstreamTimeout("unknown")
    with guarded(
        client, ns, "ticket-1", request={"title": "disk"}, verify=lambda key, fence, cp: Happened({"ticket": "T-9"})
    ) as attempt:
        assert attempt.replayed and attempt.reconciled and attempt.completed
        assert attempt.result == {"ticket": "T-9"}
        if not attempt.replayed:
            raise AssertionError("must not run")
    with guarded(client, ns, "ticket-1", request={"title": "disk"}) as again:
        assert again.replayed and again.reconciled and again.result == {"ticket": "T-9"}


async def test_an_async_verify_for_an_async_function(aclient: onceguard.AsyncClient, ns: str) -> None:
    runs: list[int] = []
    asked: list[int] = []

    async def verify(key: str, fence: int, checkpoint: Checkpoint | None) -> Happened | None:
        asked.append(fence)
        return Happened([1, 2]) if key == "found" else None

    def guard(key: str) -> Any:
        @once(aclient, ns, key=key, unknown=(UpstreamTimeout,), verify=verify)
        async def embed(doc: str) -> list[int]:
            runs.append(current().attempt)
            if current().recovery is None:
                raise UpstreamTimeout("unknown")
            return [3]

        return embed

    found, missing = guard("found"), guard("missing")
    for embed in (found, missing):
        with pytest.raises(UpstreamTimeout):
            await embed("d")
    assert asked == []
    assert await found("d") == [1, 2]
    assert await missing("d") == [3]
    assert runs == [1, 1, 2] and len(asked) == 2
    record = await aclient.get_record(ns, "found")
    assert record is not None and record.reconciled
    record = await aclient.get_record(ns, "missing")
    assert record is not None and not record.reconciled

    with onceguard.Client(aclient.base_url, "og_unused") as sync_client:
        with pytest.raises(TypeError, match="verify"):  # an async hook on a sync function: refused at once
            once(sync_client, ns, verify=verify)(lambda: None)


async def test_an_async_guarded_block_with_verify(aclient: onceguard.AsyncClient, ns: str) -> None:
    a = acquired(await aclient.claim(ns, "k", request=1))
    await aclient.report_unknown(ns, "k", a.fence, "crashed")
    async with guarded(aclient, ns, "k", request=1, verify=lambda key, fence, cp: Happened("was done")) as attempt:
        assert attempt.replayed and attempt.reconciled and attempt.result == "was done"
    replay = await aclient.claim(ns, "k", request=1)
    assert isinstance(replay, Replay) and replay.reconciled and replay.result == "was done"
