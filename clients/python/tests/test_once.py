"""``once`` and ``guarded`` (sync) against a real server: run once, replay, fail, recover, race."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

import onceguard
from onceguard import Acquired, InFlight, Replay, current, guarded, once
from onceguard.keys import canonical_json, derive_key


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def add(self) -> int:
        with self._lock:
            self.n += 1
            return self.n


class CardDeclined(Exception):
    pass


class UpstreamTimeout(Exception):
    pass


def test_first_call_runs_then_every_call_replays_the_same_value(client: onceguard.Client, ns: str) -> None:
    effects = Counter()

    @once(client, ns, version="v1")
    def refund(order: int, amount: int, currency: str = "EUR") -> Any:
        effects.add()
        return {"refund": f"re_{order}", "amount": amount, "legs": (1, 2)}

    first = refund(1234, 25)
    assert first == {"refund": "re_1234", "amount": 25, "legs": [1, 2]}  # as stored: JSON, for every caller
    assert refund(1234, 25) == first
    assert refund(order=1234, amount=25, currency="EUR") == first  # the same bound arguments
    assert refund(amount=25, order=1234) == first
    assert effects.n == 1
    assert refund(1234, 26) != first and effects.n == 2


def test_keys_come_from_canonical_arguments_and_the_version(client: onceguard.Client, ns: str) -> None:
    effects = Counter()

    def make(version: str) -> Any:
        @once(client, ns, version=version, name="send_email")
        def send_email(to: str, body: dict[str, Any]) -> int:
            return effects.add()

        return send_email

    v1, v2 = make("v1"), make("v2")
    assert v1("a@example.com", {"x": 1.0, "y": [1, 2]}) == 1
    assert v1("a@example.com", {"y": [1, 2], "x": 1}) == 1  # key order and number spelling do not matter
    assert v2("a@example.com", {"x": 1, "y": [1, 2]}) == 2  # a new version label: new keys
    key = derive_key("send_email", "v1", {"to": "a@example.com", "body": {"x": 1, "y": [1, 2]}})
    assert key.startswith("send_email:v1:") and len(key) == len("send_email:v1:") + 64
    record = client.get_record(ns, key)
    assert record is not None and record.state == "completed"
    assert canonical_json({"b": 1.0, "a": [True, None]}) == b'{"a":[true,null],"b":1}'


def test_a_key_reused_with_other_arguments_is_a_conflict(client: onceguard.Client, ns: str) -> None:
    @once(client, ns, key=lambda order, amount: f"refund-{order}")
    def refund(order: int, amount: int) -> int:
        return amount

    assert refund(7, 25) == 25
    with pytest.raises(onceguard.KeyConflict) as e:
        refund(7, 2500)
    assert e.value.key == "refund-7" and e.value.namespace == ns


def test_retryable_failure_releases_the_key(client: onceguard.Client, ns: str) -> None:
    attempts: list[int] = []

    @once(client, ns)
    def flaky(x: int) -> str:
        attempts.append(current().attempt)
        if len(attempts) == 1:
            raise ConnectionError("upstream reset")
        return "ok"

    with pytest.raises(ConnectionError):
        flaky(1)
    assert flaky(1) == "ok"
    assert flaky(1) == "ok"
    assert attempts == [1, 2]


def test_permanent_failure_is_stored_and_replayed(client: onceguard.Client, ns: str) -> None:
    effects = Counter()

    @once(client, ns, permanent=(CardDeclined,))
    def charge(card: str) -> str:
        effects.add()
        raise CardDeclined(f"card {card} declined")

    with pytest.raises(onceguard.PermanentFailure) as first:
        charge("4242")
    assert not first.value.replayed and isinstance(first.value.__cause__, CardDeclined)
    with pytest.raises(onceguard.PermanentFailure) as again:
        charge("4242")
    assert again.value.replayed and effects.n == 1
    for failure in (first.value, again.value):
        assert failure.error_type.endswith("CardDeclined") and failure.error_message == "card 4242 declined"


def test_heartbeat_keeps_a_short_lease_while_the_function_runs(
    client: onceguard.Client, ns: str
) -> None:
    seen: dict[str, Any] = {}

    @once(client, ns, key="slow-job", lease=1)
    def slow() -> str:
        time.sleep(1.6)  # past the 1s lease: only the heartbeat keeps it
        seen["during"] = client.claim(ns, "slow-job", request={})
        time.sleep(0.9)
        return "done"

    assert slow() == "done"  # the completion applied: the fence was still the holder's
    assert isinstance(seen["during"], InFlight)
    replay = client.claim(ns, "slow-job", request={})
    assert isinstance(replay, Replay) and replay.result == "done" and replay.attempt == 1


def test_without_heartbeat_a_taken_over_lease_refuses_the_completion(client: onceguard.Client, ns: str) -> None:
    @once(client, ns, key="job", lease=0.3, heartbeat=False)
    def slow() -> str:
        time.sleep(0.5)
        taken = client.claim(ns, "job", request={})  # the lease passed: someone else recovers the key
        assert isinstance(taken, Acquired) and taken.recovery is not None
        return "late"

    with pytest.raises(onceguard.StaleFence) as e:
        slow()
    assert e.value.reason == "superseded"


def test_checkpoint_then_crash_then_the_next_call_recovers(client: onceguard.Client, ns: str) -> None:
    calls: list[Any] = []

    @once(client, ns, key="transfer-9", unknown=(UpstreamTimeout,))
    def transfer(amount: int) -> str:
        attempt = current()
        calls.append((attempt.attempt, attempt.recovery))
        if attempt.recovery is None:
            assert isinstance(attempt, onceguard.Attempt)
            attempt.checkpoint("debited", {"tx": "tx_1"})
            raise UpstreamTimeout("credit call timed out after sending")
        assert attempt.recovery.last_checkpoint is not None
        return f"resumed after {attempt.recovery.last_checkpoint.data['tx']}"

    with pytest.raises(UpstreamTimeout):
        transfer(10)
    assert transfer(10) == "resumed after tx_1"
    (first, none), (second, recovery) = calls
    assert (first, none, second) == (1, None, 2)
    assert recovery.reason == "reported_unknown" and "timed out" in (recovery.detail or "")
    assert recovery.last_checkpoint.name == "debited"


def test_a_process_that_died_holding_the_key_is_recovered_after_its_lease(client: onceguard.Client, ns: str) -> None:
    # The "crashed" process: claimed, saved a checkpoint, and never came back.
    dead = client.claim(ns, "ingest-doc-1", request={"doc": 1}, lease=0.3)
    assert isinstance(dead, Acquired)
    client.checkpoint(ns, "ingest-doc-1", dead.fence, "chunked", {"chunks": 12})
    time.sleep(0.4)

    @once(client, ns, key="ingest-doc-1")
    def ingest(doc: int) -> int:
        recovery = current().recovery
        assert recovery is not None and recovery.reason == "lease_expired"
        assert recovery.last_checkpoint is not None
        return int(recovery.last_checkpoint.data["chunks"])

    assert ingest(doc=1) == 12


def test_two_threads_racing_one_key_run_the_effect_once(client: onceguard.Client, ns: str) -> None:
    effects = Counter()
    barrier = threading.Barrier(2)

    @once(client, ns, wait=10)
    def send(to: str) -> dict[str, Any]:
        n = effects.add()
        time.sleep(0.4)
        return {"message": n}

    results: list[Any] = [None, None]

    def call(i: int) -> None:
        barrier.wait()
        results[i] = send("ops@example.com")

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert effects.n == 1
    assert results[0] == results[1] == {"message": 1}


def test_in_flight_after_the_bounded_wait(client: onceguard.Client, ns: str) -> None:
    holder = client.claim(ns, "busy", request={}, lease=5)
    assert isinstance(holder, Acquired)

    @once(client, ns, key="busy", wait=0.2)
    def effect() -> None:
        raise AssertionError("must not run")

    with pytest.raises(onceguard.InFlightError) as e:
        effect()
    assert 0 < e.value.retry_after <= 5 and e.value.attempt == 1


def test_a_wait_longer_than_the_servers_outlasts_a_crashed_holders_lease(client: onceguard.Client, ns: str) -> None:
    # The holder claims with a 31 s lease and crashes: it never completes. One claim waits at
    # most 30 s on the server, so the call claims again, and recovers the key once its lease passed.
    holder = client.claim(ns, "outlast", request={}, lease=31)
    assert isinstance(holder, Acquired)
    runs = Counter()

    @once(client, ns, key="outlast", wait="45s")
    def effect() -> str | None:
        runs.add()
        recovery = current().recovery
        return None if recovery is None else recovery.reason

    started = time.monotonic()
    assert effect() == "lease_expired"
    assert runs.n == 1
    assert time.monotonic() - started >= 30


def test_guarded_block_runs_once(client: onceguard.Client, ns: str) -> None:
    effects = Counter()
    for _ in range(3):
        with guarded(client, ns, "refund-55", request={"order": 55}) as attempt:
            if not attempt.replayed:
                attempt.checkpoint("started")
                attempt.result = {"refund": effects.add()}
        assert attempt.result == {"refund": 1}
    assert effects.n == 1


def test_the_cost_and_tokens_an_attempt_reports_are_what_its_replays_save(client: onceguard.Client, ns: str) -> None:
    with guarded(client, ns, "answer-1", request={"q": "refund policy"}) as attempt:
        attempt.result = {"answer": "30 days"}
        attempt.cost, attempt.tokens = 2, 1_850
    replay = client.claim(ns, "answer-1", request={"q": "refund policy"})
    assert isinstance(replay, Replay)
    assert (replay.cost, replay.tokens) == (2, 1_850)
    with pytest.raises(ValueError, match="tokens is a whole number"):
        client.complete(ns, "answer-1", replay.fence, 1, tokens=-1)


def test_guarded_block_may_complete_early_and_a_later_error_keeps_the_outcome(
    client: onceguard.Client, ns: str
) -> None:
    with pytest.raises(RuntimeError):
        with guarded(client, ns, "k", request=1) as attempt:
            assert attempt.complete((1, 2)) == [1, 2]
            raise RuntimeError("after the effect was stored")
    with guarded(client, ns, "k", request=1) as again:
        assert again.replayed and again.result == [1, 2]


def test_a_result_that_is_not_json_is_reported_unknown(client: onceguard.Client, ns: str) -> None:
    @once(client, ns, key="odd")
    def odd() -> object:
        return object()

    with pytest.raises(TypeError):
        odd()
    record = client.get_record(ns, "odd")
    assert record is not None and record.state == "in_progress" and record.unknown


def test_a_block_whose_completion_fails_is_reported_unknown_not_released(client: onceguard.Client, ns: str) -> None:
    with pytest.raises(TypeError):
        with guarded(client, ns, "k", request=1) as attempt:
            attempt.complete({"not json": object()})  # the effect is done; only storing it failed
    record = client.get_record(ns, "k")
    assert record is not None and record.state == "in_progress" and record.unknown


def test_methods_ignored_arguments_and_dataclasses(client: onceguard.Client, ns: str) -> None:
    @dataclass
    class Order:
        id: int
        lines: tuple[str, ...]

    class Mailer:
        def __init__(self) -> None:
            self.sent = 0

        @once(client, ns, ignore=("connection",))
        def send(self, order: Order, connection: object = None) -> int:
            self.sent += 1
            return order.id

    a, b = Mailer(), Mailer()
    assert a.send(Order(1, ("x",)), connection=object()) == 1
    assert b.send(Order(1, ("x",)), connection=object()) == 1  # self and the connection are not in the key
    assert (a.sent, b.sent) == (1, 0)


def test_current_outside_a_guard_raises() -> None:
    with pytest.raises(LookupError):
        current()


async def test_sync_function_needs_the_sync_client(aclient: onceguard.AsyncClient, ns: str) -> None:
    with pytest.raises(TypeError):

        @once(aclient, ns)
        def f() -> None: ...
