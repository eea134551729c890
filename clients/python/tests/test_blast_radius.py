"""Runs and budgets, kill switches and the audit log: the client's calls and the guard's
``DeniedError`` / ``StaleFence`` against a real server."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

import pytest

import onceguard
from onceguard import Acquired, Denied, Replay, SwitchTarget, once


def run_id() -> str:
    return f"run-{uuid.uuid4().hex[:12]}"


def test_set_and_get_a_run_budget(admin: onceguard.Client, client: onceguard.Client) -> None:
    run = run_id()
    deadline = datetime.now(timezone.utc) + timedelta(days=1)
    set_ = admin.set_run_budget(run, max_effects=10, max_cost=5000, deadline=deadline)
    assert set_.run == run
    assert (set_.budget.max_effects, set_.budget.max_cost) == (10, 5000)
    assert set_.budget.deadline is not None and abs((set_.budget.deadline - deadline).total_seconds()) < 1
    assert (set_.usage.effects, set_.usage.cost) == (0, 0)
    got = client.get_run(run)
    assert got is not None and got.budget == set_.budget
    assert client.get_run(run_id()) is None


def test_run_ids_are_percent_encoded_in_the_path(admin: onceguard.Client) -> None:
    run = f"run/{uuid.uuid4().hex[:6]}%?#"
    assert admin.set_run_budget(run, max_effects=1).run == run
    got = admin.get_run(run)
    assert got is not None and got.run == run


def test_an_agent_key_may_not_set_a_budget(client: onceguard.Client) -> None:
    with pytest.raises(onceguard.Forbidden):
        client.set_run_budget(run_id(), max_effects=1)


def test_effects_budget_counts_each_key_once(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    run = run_id()
    admin.set_run_budget(run, max_effects=2)
    first = client.claim(ns, "k1", request=1, run=run)
    assert isinstance(first, Acquired)
    client.complete(ns, "k1", first.fence, "one")
    assert isinstance(client.claim(ns, "k1", request=1, run=run), Replay)  # a replay is not charged again
    assert isinstance(client.claim(ns, "k2", request=2, run=run), Acquired)

    denied = client.claim(ns, "k3", request=3, run=run)
    assert isinstance(denied, Denied)
    assert denied.kind == "budget" and denied.reason["reason"] == "budget_exhausted"
    assert denied.reason["limit"] == "effects" and not denied.retryable
    usage = client.get_run(run)
    assert usage is not None and usage.usage.effects == 2


def test_cost_budget_is_charged_at_claim(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    run = run_id()
    admin.set_run_budget(run, max_cost=100)
    assert isinstance(client.claim(ns, "a", request=1, run=run, cost=60), Acquired)
    denied = client.claim(ns, "b", request=1, run=run, cost=60)
    assert isinstance(denied, Denied) and denied.kind == "budget" and denied.reason["limit"] == "cost"
    got = client.get_run(run)
    assert got is not None and got.usage.cost == 60


def test_a_passed_deadline_denies(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    run = run_id()
    admin.set_run_budget(run, deadline=datetime.now(timezone.utc) - timedelta(seconds=1))
    denied = client.claim(ns, "k", request=1, run=run)
    assert isinstance(denied, Denied) and denied.reason.get("limit") == "deadline"


def test_the_decorator_raises_denied_error(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    run = run_id()
    admin.set_run_budget(run, max_effects=1)

    @once(client, ns, run=run)
    def send(to: str) -> str:
        return to

    assert send("a") == "a"
    assert send("a") == "a"  # replayed: not charged
    with pytest.raises(onceguard.DeniedError) as e:
        send("b")
    assert e.value.kind == "budget" and e.value.reason["limit"] == "effects"


def test_a_namespace_switch_refuses_claims_until_released(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    target = SwitchTarget.namespace(ns)
    engaged = admin.engage_switch(target, "runaway refunds")
    assert engaged.target == target and engaged.reason == "runaway refunds" and engaged.engaged_at is not None
    assert engaged.engaged_by
    try:
        assert target in [s.target for s in client.list_switches()]
        denied = client.claim(ns, "k", request=1)
        assert isinstance(denied, Denied) and denied.kind == "switch"
        assert denied.reason["reason"] == "switch_engaged" and denied.reason["why"] == "runaway refunds"
    finally:
        released = admin.release_switch(target, "fixed")
    assert released.target == target
    assert isinstance(client.claim(ns, "k", request=1), Acquired)
    with pytest.raises(onceguard.NotFound):
        admin.release_switch(target, "again")


def test_a_run_switch_revoking_leases_makes_the_completion_stale(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()
    held = client.claim(ns, "k", request=1, run=run)
    assert isinstance(held, Acquired)
    switch = admin.engage_switch(SwitchTarget.run(run), "stop this run", revoke_leases=True)
    try:
        assert switch.revoke_leases and switch.revoked >= 1
        with pytest.raises(onceguard.StaleFence):
            client.complete(ns, "k", held.fence, "too late")
        denied = client.claim(ns, "k2", request=1, run=run)
        assert isinstance(denied, Denied) and denied.kind == "switch"
    finally:
        admin.release_switch(SwitchTarget.run(run), "done")


def test_the_guard_raises_stale_fence_when_its_lease_is_revoked(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    run = run_id()

    @once(client, ns, run=run)
    def effect() -> str:
        admin.engage_switch(SwitchTarget.run(run), "revoke mid-call", revoke_leases=True)
        return "done"

    try:
        with pytest.raises(onceguard.StaleFence):
            effect()
    finally:
        admin.release_switch(SwitchTarget.run(run), "done")


def test_switches_are_audited(admin: onceguard.Client, ns: str) -> None:
    target = SwitchTarget.namespace(ns)
    why = f"audit check {uuid.uuid4().hex[:6]}"
    admin.engage_switch(target, why)
    admin.release_switch(target, why + " released")
    page = admin.list_audit(action="switch.engage", limit=50)
    entry = next(e for e in page.entries if e.why == why)
    assert entry.action == "switch.engage" and entry.actor and entry.at <= datetime.now(timezone.utc)
    actions = [e.action for e in admin.iter_audit(page_size=2) if (e.why or "").startswith(why)]
    assert actions[:2] == ["switch.release", "switch.engage"]  # newest first


def test_audit_needs_an_admin(client: onceguard.Client) -> None:
    with pytest.raises(onceguard.Forbidden):
        client.list_audit()
