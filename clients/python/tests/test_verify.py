"""Reconciled recoveries: a recovering attempt completes the key with what the downstream system
says happened (``complete(..., reconciled=True)``) instead of running the effect again, and the
guards' ``verify`` hook decides which: ``Happened(result)`` or ``None``.

A recovery is made at once, without waiting for a lease: a first attempt whose exception is in
``unknown`` is reported unknown, and the next claim of its key is a recovery."""

from __future__ import annotations

import time
from typing import Any

import pytest

import onceguard
from onceguard import Acquired, Checkpoint, CompleteItem, Happened, Replay, Settings, current, guarded, once


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


def test_under_the_recovery_policy_verify_only_a_call_with_a_verify_hook_recovers(
    client: onceguard.Client, admin: onceguard.Client, ns: str
) -> None:
    """A first attempt whose outcome is unknown leaves a key that may have been charged: under
    ``recovery: verify`` a call without a ``verify`` hook is refused with a clear error and does
    not run; one with a hook recovers it, and its hook decides."""
    prefix = f"{ns}/pay"
    entry = admin.put_settings(Settings(recovery="verify"), namespace_prefix=prefix, why="payments")
    assert entry.settings.recovery == "verify"
    runs: list[int] = []
    try:

        @once(client, prefix, key="charge-1", unknown=(UpstreamTimeout,))
        def charge(amount: int) -> dict[str, Any]:
            runs.append(current().attempt)
            raise UpstreamTimeout("no answer after sending")

        with pytest.raises(UpstreamTimeout):
            charge(20)
        for _ in range(2):
            with pytest.raises(onceguard.RecoveryNeedsVerify) as e:
                charge(20)
            assert "verify" in str(e.value) and e.value.kind == "recovery"
            assert e.value.reason["previous_attempt"] == 1
        assert runs == [1], "the function did not run again"
        record = client.get_record(prefix, "charge-1")
        assert record is not None and record.state == "in_progress" and record.attempt == 1

        @once(client, prefix, key="charge-1", verify=lambda key, fence, checkpoint: Happened({"charge": "ch_1"}))
        def charge_checked(amount: int) -> dict[str, Any]:
            runs.append(current().attempt)
            return {"charge": "again"}

        assert charge_checked(20) == {"charge": "ch_1"}
        assert runs == [1]
        record = client.get_record(prefix, "charge-1")
        assert record is not None and record.reconciled and record.attempt == 2
    finally:
        admin.delete_settings(namespace_prefix=prefix)


def test_under_the_recovery_policy_ask_a_person_decides_and_the_call_runs_at_most_once(
    client: onceguard.Client, admin: onceguard.Client, ns: str
) -> None:
    """Under ``recovery: ask`` a recovery waits for a person: the call answers an approval of
    the recovery (``AwaitingApproval``); approved, the next call re-runs it once; marked done
    (``reconcile``), the next call replays the result given."""
    prefix = f"{ns}/mail"
    admin.put_settings(Settings(recovery="ask"), namespace_prefix=prefix, why="emails")
    runs: list[str] = []
    try:

        @once(client, prefix, unknown=(UpstreamTimeout,))
        def send(to: str) -> str:
            runs.append(to)
            if runs.count(to) == 1:
                raise UpstreamTimeout("the mail server did not answer")
            return f"sent to {to}"

        for to in ("ops", "sales"):
            with pytest.raises(UpstreamTimeout):
                send(to)
            with pytest.raises(onceguard.AwaitingApproval) as e:
                send(to)
            approval = e.value.approval
            assert approval.recovery is not None and approval.recovery["previous_attempt"] == 1
            assert approval.recovery["reason"] == "reported_unknown"
            with pytest.raises(onceguard.AwaitingApproval):
                send(to)
            assert runs.count(to) == 1, "nothing ran while a person decides"
            if to == "ops":
                decided = admin.approve(approval.id, why="the mail server lost it")
                assert decided.state == "approved"
                assert send(to) == "sent to ops"
                assert send(to) == "sent to ops"
                assert runs.count(to) == 2, "re-run once"
            else:
                decided = admin.reconcile(approval.id, why="the mail log shows it", result="sent to sales (log)")
                assert decided.state == "reconciled" and decided.decision is not None and decided.decision.reconciled
                assert send(to) == "sent to sales (log)"
                assert runs.count(to) == 1, "never run again"
    finally:
        admin.delete_settings(namespace_prefix=prefix)


_CRASHING_CHARGE = """
import pathlib, sys, time
import onceguard

url, token, namespace, effects = sys.argv[1:5]
client = onceguard.Client(url, token)

@onceguard.once(client, namespace, key="charge-7", lease="1s")
def charge(amount):
    with open(effects, "a") as f:
        f.write("charged\\n")
    print("charged", flush=True)
    time.sleep(120)  # SIGKILLed here, after its effect and before its outcome is stored
    return {"charge": "ch_7"}

charge(20)
"""


def test_under_ask_a_process_killed_after_its_effect_is_recovered_only_once_a_person_approves(
    server: Any, agent_key: str, client: onceguard.Client, admin: onceguard.Client, ns: str, tmp_path: Any
) -> None:
    """The case the policy is for: a process charges, is SIGKILLed before storing the outcome,
    and the orchestrator runs the call again. Under ``recovery: ask`` nothing runs until a person
    decides; approved, eight concurrent calls re-run it once."""
    import signal
    import subprocess
    import sys
    import threading

    prefix = f"{ns}/pay"
    admin.put_settings(Settings(recovery="ask"), namespace_prefix=prefix, why="payments")
    effects = tmp_path / "effects"
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _CRASHING_CHARGE, server.url, agent_key, prefix, str(effects)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "charged"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)

        @once(client, prefix, key="charge-7", lease="1s")
        def charge(amount: int) -> dict[str, Any]:
            with open(effects, "a") as f:
                f.write("charged\n")
            return {"charge": "ch_7b"}

        # The killed holder's lease (1 s, no longer extended) passes; until then the key is in flight.
        deadline = time.monotonic() + 10
        while True:
            try:
                charge(20)
            except onceguard.InFlightError:
                assert time.monotonic() < deadline, "the killed holder's lease never passed"
                time.sleep(0.2)
                continue
            except onceguard.AwaitingApproval as e:
                approval = e.approval
                break
            raise AssertionError("the recovery ran without a person's decision")
        assert approval.recovery is not None and approval.recovery["reason"] == "lease_expired"
        assert effects.read_text().count("charged") == 1, "nothing ran while a person decides"
        admin.approve(approval.id, why="the provider shows no charge")

        answers: list[Any] = []

        def call() -> None:
            try:
                answers.append(charge(20))
            except onceguard.InFlightError as e:
                answers.append(e)

        threads = [threading.Thread(target=call) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert effects.read_text().count("charged") == 2, "approved once, run once"
        assert {"charge": "ch_7b"} in answers, answers
        assert charge(20) == {"charge": "ch_7b"}
        assert effects.read_text().count("charged") == 2
    finally:
        admin.delete_settings(namespace_prefix=prefix)
