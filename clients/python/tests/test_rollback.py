"""Compensations and rollbacks: ``undo=`` on the guards registers each effect's compensation when
it completes; ``rollback`` starts undoing a run; ``run_compensations`` workers run its
compensations once each, newest effect first, keep a permanent failure failed, and recover the
task of a worker that died once its lease passes."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import Counter
from typing import Any

import pytest

import onceguard
from onceguard import (
    Acquired,
    Compensation,
    CompensationsBusy,
    CompensationsDone,
    CompensationTask,
    Recovery,
    current,
    guarded,
    once,
)


class GatewayTimeout(Exception):
    pass


def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def task(answer: onceguard.CompensationClaim) -> CompensationTask:
    assert isinstance(answer, CompensationTask), answer
    return answer


def test_effects_register_compensations_and_a_worker_undoes_them_newest_first(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()
    undone: list[str] = []

    def refund(data: dict[str, Any]) -> dict[str, str]:
        undone.append(data["charge"])
        return {"refunded": data["charge"]}

    @once(client, ns, run=run, undo=refund, undo_data=lambda result: {"charge": result["charge"]})
    def charge(order: int) -> dict[str, Any]:
        return {"charge": f"ch_{order}", "amount": 10 * order}

    @once(client, ns, run=run)
    def notify(order: int) -> str:
        return f"told {order}"

    for order in (1, 2, 3):
        charge(order)
    notify(1)
    assert onceguard.undo_handlers()[onceguard.undo_name(refund)] is refund
    before = client.get_run(run)
    assert before is not None and before.rollback is None
    assert client.rollback_status(run) is None

    started = admin.rollback(run, "runaway agent")
    assert (started.run, started.why, started.effects, started.not_compensable) == (run, "runaway agent", 4, 1)
    assert (started.pending, started.compensated, started.failed, started.done) == (3, 0, 0, False)
    assert [t.compensation for t in started.tasks] == [
        Compensation(onceguard.undo_name(refund), {"charge": f"ch_{order}"}) for order in (3, 2, 1)
    ], "newest effect first"
    assert [t.effect.namespace for t in started.tasks] == [ns] * 3
    assert all(t.state == "pending" and t.effect.completed_at is not None for t in started.tasks)
    again = admin.rollback(run, "a second start")
    assert again.why == "runaway agent" and again.started_at == started.started_at

    with pytest.raises(onceguard.DeniedError) as e:  # the run is switched off
        charge(4)
    assert e.value.kind == "switch"

    report = onceguard.run_compensations(client, run)
    assert report == onceguard.CompensationReport(compensated=3, failed=0, released=0, done=True)
    assert undone == ["ch_3", "ch_2", "ch_1"]

    status = client.rollback_status(run)
    assert status is not None and status.done and (status.compensated, status.pending, status.in_progress) == (3, 0, 0)
    assert [t.state for t in status.tasks] == ["compensated"] * 3
    first = status.tasks[0]
    record = client.get_record(first.namespace, first.key)
    assert record is not None and record.stored is not None and record.stored.result == {"refunded": "ch_3"}
    view = client.get_run(run)
    assert view is not None and view.rollback is not None and view.rollback.compensated == 3
    assert view.rollback.tasks == ()
    assert onceguard.run_compensations(client, run) == onceguard.CompensationReport(done=True)
    assert undone == ["ch_3", "ch_2", "ch_1"]


def test_the_task_calls_by_hand(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    run = run_id()
    claim = client.claim(ns, "charge-1", request={"amount": 5}, run=run)
    assert isinstance(claim, Acquired)
    client.complete(ns, "charge-1", claim.fence, {"charge": "ch_1"}, compensation=("refund-charge", {"charge": "ch_1"}))
    plain = client.claim(ns, "charge-2", request={"amount": 6}, run=run)
    assert isinstance(plain, Acquired)
    client.complete(ns, "charge-2", plain.fence, {"charge": "ch_2"}, compensation=Compensation("refund-charge"))
    with pytest.raises(onceguard.NotFound):
        client.claim_compensation(run)

    admin.rollback(run, "by hand")
    held = task(client.claim_compensation(run, lease="10s"))
    assert held.effect.key == "charge-2" and held.compensation == Compensation("refund-charge", None)
    assert held.recovery is None and held.attempt == 1 and held.namespace != ns
    client.checkpoint(held.namespace, held.key, held.fence, "asked the bank", {"step": 1})
    client.extend(held.namespace, held.key, held.fence, "10s")
    client.complete(held.namespace, held.key, held.fence, None)

    other = task(client.claim_compensation(run))
    assert other.effect == onceguard.EffectRef(ns, "charge-1", claim.fence, other.effect.completed_at)
    assert other.compensation.data == {"charge": "ch_1"}
    busy = client.claim_compensation(run)
    assert isinstance(busy, CompensationsBusy) and busy.in_progress == 1 and busy.retry_after > 0
    client.fail(other.namespace, other.key, other.fence, retryable=False, error={"message": "the bank refused"})
    done = client.claim_compensation(run)
    assert done == CompensationsDone(compensated=1, failed=1)
    status = client.rollback_status(run)
    assert status is not None and status.done and (status.compensated, status.failed) == (1, 1)
    assert {t.effect.key: t.state for t in status.tasks} == {"charge-2": "compensated", "charge-1": "failed"}


def test_two_workers_at_once_run_each_compensation_once(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()
    undone: Counter[int] = Counter()
    lock = threading.Lock()

    def cancel_order(data: int) -> None:
        with lock:
            undone[data] += 1

    @once(client, ns, run=run, undo=cancel_order)
    def place_order(order: int) -> int:
        return order

    @once(client, ns, run=run)
    def log_order(order: int) -> str:
        return f"logged {order}"

    orders = list(range(12))
    for order in orders:
        place_order(order)
    log_order(0)
    admin.rollback(run, "two workers")

    reports: list[onceguard.CompensationReport] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            reports.append(onceguard.run_compensations(client, run, idle_timeout=30))
        except BaseException as e:  # pragma: no cover - surfaced by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert undone == Counter({order: 1 for order in orders}), "each compensation ran exactly once"
    assert sum(r.compensated for r in reports) == len(orders) and all(r.done and r.failed == 0 for r in reports)
    status = client.rollback_status(run)
    assert status is not None and status.done and status.compensated == len(orders) and status.not_compensable == 1


async def test_async_workers_at_once_with_an_async_undo(
    admin: onceguard.Client, aclient: onceguard.AsyncClient, ns: str
) -> None:
    run = run_id()
    undone: list[str] = []

    async def release_seat(data: dict[str, str]) -> str:
        await asyncio.sleep(0.01)
        undone.append(data["seat"])
        return f"released {data['seat']}"

    @once(aclient, ns, run=run, undo=release_seat)
    async def book(seat: str) -> dict[str, str]:
        return {"seat": seat}

    async with guarded(aclient, ns, "seat-z", request={"seat": "z"}, run=run, undo=release_seat) as attempt:
        attempt.result = {"seat": "z"}
    seats = ["a", "b", "c", "d", "e", "f"]
    for seat in seats:
        await book(seat)
    admin.rollback(run, "overbooked")

    reports = await asyncio.gather(*(onceguard.run_compensations(aclient, run, idle_timeout=30) for _ in range(2)))
    assert sorted(undone) == sorted(seats + ["z"]) and len(undone) == len(set(undone))
    assert sum(r.compensated for r in reports) == 7 and all(r.done for r in reports)
    status = await aclient.rollback_status(run)
    assert status is not None and status.done and status.compensated == 7


def test_a_permanent_failure_is_kept_shown_and_not_run_again(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()
    calls: list[str] = []

    def void_invoice(data: str) -> str:
        calls.append(data)
        if data == "inv_2":
            raise ValueError("invoice inv_2 is paid: it cannot be voided")
        return f"voided {data}"

    @once(client, ns, run=run, undo=void_invoice)
    def send_invoice(number: int) -> str:
        return f"inv_{number}"

    @once(client, ns, run=run, undo_name="no-such-handler")
    def ship(order: int) -> str:
        return f"shipped {order}"

    for number in (1, 2, 3):
        send_invoice(number)
    ship(7)
    admin.rollback(run, "wrong customer")

    report = onceguard.run_compensations(client, run)
    assert report == onceguard.CompensationReport(compensated=2, failed=2, released=0, done=True)
    assert calls == ["inv_3", "inv_2", "inv_1"], "the unknown handler is never skipped silently, nor run"
    status = client.rollback_status(run)
    assert status is not None and status.done and (status.compensated, status.failed) == (2, 2)
    failed = {t.compensation.name: t for t in status.tasks if t.state == "failed"}
    assert set(failed) == {"no-such-handler", onceguard.undo_name(void_invoice)}
    paid = client.get_record(failed[onceguard.undo_name(void_invoice)].namespace, failed[onceguard.undo_name(void_invoice)].key)
    assert paid is not None and paid.stored is not None and paid.stored.status == "failure"
    assert paid.stored.result == {"type": "builtins.ValueError", "message": "invoice inv_2 is paid: it cannot be voided"}
    unknown = client.get_record(failed["no-such-handler"].namespace, failed["no-such-handler"].key)
    assert unknown is not None and unknown.stored is not None and unknown.stored.status == "failure"
    assert "no handler is known" in unknown.stored.result["message"]

    assert onceguard.run_compensations(client, run, {"no-such-handler": lambda data: calls.append("late")}) == (
        onceguard.CompensationReport(done=True)
    ), "a second worker runs neither failure again"
    assert calls == ["inv_3", "inv_2", "inv_1"]


def test_a_retryable_failure_hands_the_task_out_again(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()
    tries: list[int] = []

    def cancel_booking(data: int) -> str:
        tries.append(data)
        if len(tries) == 1:
            raise GatewayTimeout("the airline did not answer")
        return "cancelled"

    guarded_booking = guarded(client, ns, "booking-1", request={"flight": 1}, run=run, undo=cancel_booking)
    with guarded_booking as attempt:
        attempt.result = 1
    admin.rollback(run, "trip cancelled")

    report = onceguard.run_compensations(client, run, retryable=(GatewayTimeout,))
    assert report == onceguard.CompensationReport(compensated=1, failed=0, released=1, done=True)
    assert tries == [1, 1]
    status = client.rollback_status(run)
    assert status is not None and status.tasks[0].state == "compensated" and status.tasks[0].attempt == 2


def test_the_task_of_a_crashed_worker_is_recovered_once_its_lease_passes(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()
    undone: list[tuple[int, Recovery | None]] = []

    def unpublish(data: int) -> None:
        undone.append((data, current().recovery))
        current().checkpoint("unpublished", {"post": data})

    @once(client, ns, run=run, undo=unpublish)
    def publish(post: int) -> int:
        return post

    for post in (1, 2, 3):
        publish(post)
    admin.rollback(run, "spam")

    crashed = task(client.claim_compensation(run, lease="1s"))  # then the worker dies
    assert crashed.compensation.data == 3

    report = onceguard.run_compensations(client, run, idle_timeout=30)
    assert report == onceguard.CompensationReport(compensated=3, failed=0, released=0, done=True)
    assert [post for post, _ in undone] == [2, 1, 3], "the held task last, once its lease passed"
    recovered = undone[-1][1]
    assert undone[0][1] is None and recovered is not None
    assert recovered.reason == "lease_expired" and recovered.previous_fence == crashed.fence
    with pytest.raises(onceguard.StaleFence):
        client.complete(crashed.namespace, crashed.key, crashed.fence, "too late")
    status = client.rollback_status(run)
    assert status is not None and status.done and status.compensated == 3


def test_max_tasks_and_the_idle_timeout_stop_a_worker(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()
    handlers = {"undo-step": lambda data: data}
    for step in range(3):
        claim = client.claim(ns, f"step-{step}", request=step, run=run)
        assert isinstance(claim, Acquired)
        client.complete(ns, f"step-{step}", claim.fence, step, compensation=("undo-step", step))
    admin.rollback(run, "stop")

    assert onceguard.run_compensations(client, run, handlers, max_tasks=1) == onceguard.CompensationReport(compensated=1)
    held = task(client.claim_compensation(run, lease="30s"))
    assert onceguard.run_compensations(client, run, handlers, idle_timeout=0.2) == onceguard.CompensationReport(compensated=1)
    client.complete(held.namespace, held.key, held.fence, "by hand")
    assert onceguard.run_compensations(client, run, handlers) == onceguard.CompensationReport(done=True)


def test_undo_names(client: onceguard.Client) -> None:
    def plain(data: Any) -> None: ...

    assert onceguard.undo_name(plain) == "test_undo_names.<locals>.plain"
    with pytest.raises(ValueError, match="lambda"):
        onceguard.undo_name(lambda data: None)

    def rückgängig(data: Any) -> None: ...

    name = onceguard.undo_name(rückgängig)
    assert name.isascii() and name.isprintable() and 1 <= len(name) <= 128
    assert name != onceguard.undo_name(plain)
    def long_named(data: Any) -> None: ...

    long_named.__qualname__ = "X" * 200
    assert len(onceguard.undo_name(long_named)) == 128 and onceguard.undo_name(long_named).startswith("X" * 111 + "~")

    assert onceguard.register_undo(plain, "test-undo-names") == "test-undo-names"
    assert onceguard.register_undo(plain, "test-undo-names") == "test-undo-names"

    def other(data: Any) -> None: ...

    with pytest.raises(ValueError, match="registered for"):
        onceguard.register_undo(other, "test-undo-names")
    with pytest.raises(ValueError, match="printable ASCII"):
        once(client, "ns", undo=plain, undo_name="")
    with pytest.raises(TypeError, match="undo_data"):
        once(client, "ns", undo_data=lambda r: r)
