"""Observe mode (``mode: observe`` in a namespace's settings): claims are decided and recorded as
always, but a call that enforcing would not let run is told to ``proceed``; the guards run it,
holding and storing nothing, and switching back to ``enforce`` enforces again."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import onceguard
from onceguard import (
    Acquired,
    ClaimItem,
    KeyConflict,
    PermanentFailure,
    Proceed,
    Replay,
    Settings,
    SwitchTarget,
    current,
    guarded,
    once,
)


class Declined(Exception):
    pass


@pytest.fixture
def observed(admin: onceguard.Client, ns: str) -> Iterator[str]:
    """``ns``, in observe mode for the test (its settings deleted at the end)."""
    entry = admin.put_settings(Settings(mode="observe"), namespace_prefix=ns, why="observe before enforcing")
    assert entry.settings.mode == "observe"
    yield ns
    admin.delete_settings(namespace_prefix=ns)


@pytest.fixture
async def aadmin(server: Any) -> AsyncIterator[onceguard.AsyncClient]:
    async with onceguard.AsyncClient(server.url, server.admin_key) as c:
        yield c


def proceed(answer: onceguard.ClaimAnswer) -> Proceed:
    assert isinstance(answer, Proceed), answer
    return answer


def test_a_replay_runs_again_in_observe_mode_and_replays_once_enforced(
    admin: onceguard.Client, client: onceguard.Client, observed: str
) -> None:
    runs: list[int] = []

    @once(client, observed, key=lambda order: "refund-1")
    def refund(order: int) -> dict[str, Any]:
        runs.append(order)
        return {"refund": f"re_{order}", "runs": len(runs)}

    assert refund(1) == {"refund": "re_1", "runs": 1}  # acquired, completed as always
    first = client.get_record(observed, "refund-1")
    assert first is not None and first.state == "completed"
    assert refund(1) == {"refund": "re_1", "runs": 2}  # would have replayed: runs, stores nothing
    assert runs == [1, 1]
    record = client.get_record(observed, "refund-1")
    assert record is not None and record.state == "completed" and record.fence == first.fence
    assert record.stored is not None and record.stored.result == {"refund": "re_1", "runs": 1}

    assert proceed(client.claim(observed, "refund-1", request={"order": 1})) == Proceed("replay", None)
    assert refund(2) == {"refund": "re_2", "runs": 3}, "a mismatch proceeds too"
    answer = proceed(client.claim(observed, "refund-1", request={"order": 2}))
    assert (answer.would_have_been, answer.reason, answer.mode) == ("mismatch", None, "observe")

    entry = admin.put_settings(Settings(mode="enforce"), namespace_prefix=observed, why="enforce now")
    assert entry.settings.mode == "enforce"
    assert refund(1) == {"refund": "re_1", "runs": 1}, "enforced: the stored outcome replays"
    with pytest.raises(KeyConflict):
        refund(2)
    assert runs == [1, 1, 2]
    assert isinstance(client.claim(observed, "refund-1", request={"order": 1}), Replay)


def test_in_flight_and_denied_calls_proceed_and_a_switch_still_refuses(
    admin: onceguard.Client, client: onceguard.Client, observed: str
) -> None:
    held = client.claim(observed, "busy", request=1, lease="30s")
    assert isinstance(held, Acquired)
    assert proceed(client.claim(observed, "busy", request=1, wait="5s")).would_have_been == "in_flight"

    with guarded(client, observed, "busy", request=1) as beside:
        assert beside.observed is not None and beside.observed.would_have_been == "in_flight"
        beside.result = "ran beside the holder"
    assert beside.result == "ran beside the holder"
    client.complete(observed, "busy", held.fence, "stored")

    run = f"run-{uuid.uuid4().hex[:12]}"
    admin.set_run_budget(run, max_effects=1)
    first = client.claim(observed, "effect-1", request=1, run=run)
    assert isinstance(first, Acquired)
    denied = proceed(client.claim(observed, "effect-2", request=2, run=run))
    assert denied.would_have_been == "denied" and denied.reason and "budget" in denied.reason

    admin.engage_switch(SwitchTarget.namespace(observed), "stop everything")
    try:
        with pytest.raises(onceguard.DeniedError) as e:
            once(client, observed, key="effect-3")(lambda: "never")()
        assert e.value.kind == "switch"
    finally:
        admin.release_switch(SwitchTarget.namespace(observed), "over")


def test_a_guarded_block_that_proceeds_holds_nothing(client: onceguard.Client, observed: str) -> None:
    with guarded(client, observed, "ticket-1", request={"alert": 1}) as attempt:
        assert not attempt.replayed and attempt.observed is None and attempt.fence > 0
        attempt.result = ("ticket", 1)
    assert attempt.result == ["ticket", 1]

    with guarded(client, observed, "ticket-1", request={"alert": 1}) as again:
        assert not again.replayed, "observe mode: the block does the effect again"
        assert again.observed is not None and again.observed.would_have_been == "replay"
        assert (again.fence, again.attempt, again.recovery) == (0, 0, None)
        again.checkpoint("opened", {"ticket": 2})  # nothing is held: saves nothing
        assert current() is again
        again.result = ("ticket", 2)
    assert again.result == ["ticket", 2], "returned as a stored result would be, and not stored"
    record = client.get_record(observed, "ticket-1")
    assert record is not None and record.stored is not None and record.stored.result == ["ticket", 1]
    assert record.checkpoints == ()


def test_a_permanent_failure_that_proceeds_is_raised_and_not_stored(client: onceguard.Client, observed: str) -> None:
    calls: list[int] = []

    @once(client, observed, key="charge", permanent=(Declined,))
    def charge(amount: int) -> int:
        calls.append(amount)
        if len(calls) > 1:
            raise Declined("card declined")
        return amount

    assert charge(5) == 5
    with pytest.raises(PermanentFailure) as e:
        charge(5)
    assert not e.value.replayed and isinstance(e.value.__cause__, Declined)
    record = client.get_record(observed, "charge")
    assert record is not None and record.stored is not None and record.stored.status == "success"

    @once(client, observed, key="other")
    def other() -> None:
        calls.append(0)
        raise RuntimeError("boom")

    other_key = client.claim(observed, "other", request={})
    assert isinstance(other_key, Acquired)
    with pytest.raises(RuntimeError):
        other()  # in flight under enforcement: proceeds, raises, releases nothing
    record = client.get_record(observed, "other")
    assert record is not None and record.state == "in_progress" and record.fence == other_key.fence


def test_batch_claims_proceed_and_once_each_does_every_item(client: onceguard.Client, observed: str) -> None:
    done: list[str] = []

    def work(items: list[str]) -> list[str]:
        done.extend(items)
        return [item.upper() for item in items]

    items = ["a", "b", "c"]
    assert onceguard.once_each(client, observed, items, key=lambda i: i, work=work) == ["A", "B", "C"]
    assert onceguard.once_each(client, observed, items + ["d"], key=lambda i: i, work=work) == ["A", "B", "C", "D"]
    assert sorted(done) == ["a", "a", "b", "b", "c", "c", "d"], "the stored items proceeded: done again"
    stored = {r.key: r.state for r in client.iter_records(namespace_prefix=observed)}
    assert stored == {"a": "completed", "b": "completed", "c": "completed", "d": "completed"}

    answers = client.claim_batch([ClaimItem(observed, "a", request="a"), ClaimItem(observed, "e", request="e")])
    assert proceed(answers[0]).would_have_been == "replay"
    assert isinstance(answers[1], Acquired)


async def test_async_once_proceeds_then_replays_once_enforced(
    aadmin: onceguard.AsyncClient, aclient: onceguard.AsyncClient, ns: str
) -> None:
    await aadmin.put_settings(Settings(mode="observe"), namespace_prefix=ns)
    runs = 0

    @once(aclient, ns)
    async def embed(text: str) -> list[float]:
        nonlocal runs
        runs += 1
        return [float(len(text)), float(runs)]

    try:
        assert await embed("hello") == [5.0, 1.0]
        assert await embed("hello") == [5.0, 2.0]
        async with guarded(aclient, ns, "block", request=1) as a:
            a.result = "first"
        async with guarded(aclient, ns, "block", request=1) as b:
            assert b.observed is not None and b.observed.would_have_been == "replay"
            await b.checkpoint("nothing held")
            assert await b.complete("second") == "second"
        assert b.result == "second"
        await aadmin.put_settings(Settings(mode="enforce"), namespace_prefix=ns)
        assert await embed("hello") == [5.0, 1.0]
        assert runs == 2
    finally:
        await aadmin.delete_settings(namespace_prefix=ns)


def test_a_proceed_is_taken_only_from_a_well_formed_observe_answer() -> None:
    from onceguard import _calls

    ok = {"outcome": "proceed", "mode": "observe", "would_have_been": "replay", "reason": None}
    assert isinstance(_calls.claim_answer(200, ok, None), Proceed)
    for bad in (
        {"outcome": "proceed", "would_have_been": "replay"},
        {"outcome": "proceed", "mode": "enforce", "would_have_been": "replay"},
        {"outcome": "proceed", "mode": "observe", "would_have_been": "acquired"},
        {"outcome": "proceed", "mode": "observe"},
    ):
        with pytest.raises(onceguard.UnexpectedResponse):
            _calls.claim_answer(200, bad, None)
