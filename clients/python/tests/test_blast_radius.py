"""Runs and budgets, kill switches, settings and quotas, and the audit log: the client's calls
and the guard's ``DeniedError`` / ``StaleFence`` against a real server."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import onceguard
from onceguard import Acquired, ClaimRate, Denied, Replay, Settings, SwitchTarget, once


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
        assert isinstance(client.claim(ns + "/below", "k", request=1), Denied)  # the namespace and below
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
    client.checkpoint(ns, "k", held.fence, "charged", {"charge": "ch_1"})
    switch = admin.engage_switch(SwitchTarget.run(run), "stop this run", revoke_leases=True)
    try:
        assert switch.revoke_leases and switch.revoked >= 1
        with pytest.raises(onceguard.StaleFence) as e:
            client.complete(ns, "k", held.fence, "too late")
        assert e.value.reason == "superseded"
        denied = client.claim(ns, "k2", request=1, run=run)
        assert isinstance(denied, Denied) and denied.kind == "switch"
    finally:
        admin.release_switch(SwitchTarget.run(run), "done")
    recovered = client.claim(ns, "k", request=1, run=run)  # the revoked attempt is recovered
    assert isinstance(recovered, Acquired) and recovered.recovery is not None
    assert recovered.recovery.reason == "reported_unknown"
    assert recovered.recovery.last_checkpoint is not None and recovered.recovery.last_checkpoint.name == "charged"


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


def test_a_switch_refuses_replays_too(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    done = client.claim(ns, "k", request=1)
    assert isinstance(done, Acquired)
    client.complete(ns, "k", done.fence, "stored")
    admin.engage_switch(SwitchTarget.namespace(ns), "freeze")
    try:
        assert isinstance(client.claim(ns, "k", request=1), Denied)
        record = client.get_record(ns, "k")  # the outcome stays readable
        assert record is not None and record.stored is not None and record.stored.result == "stored"
    finally:
        admin.release_switch(SwitchTarget.namespace(ns))


def test_purges_are_audited_with_their_reason(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    a = client.claim(ns, "k", request=1)
    assert isinstance(a, Acquired)
    why = f"purge check {uuid.uuid4().hex[:6]}"
    assert admin.purge(ns, "k", why=why)
    assert any(e.why == why for e in admin.list_audit(action="record.purge", limit=100).entries)


@pytest.fixture(scope="module")
def other_tenant(admin: onceguard.Client, server: Any) -> Iterator[tuple[onceguard.Client, onceguard.Client]]:
    """A tenant of its own (admin and agent clients), so that its quotas bind no other test."""
    tenant = f"quota-{uuid.uuid4().hex[:8]}"
    admin.create_tenant(tenant)
    admin_key = admin.create_api_key("admin", "quota tests", tenant=tenant)
    agent_key = admin.create_api_key("agent", "quota tests", tenant=tenant)
    assert admin_key.token and agent_key.token
    with onceguard.Client(server.url, admin_key.token) as a, onceguard.Client(server.url, agent_key.token) as c:
        yield a, c


def test_in_flight_quota(other_tenant: tuple[onceguard.Client, onceguard.Client], ns: str) -> None:
    admin, client = other_tenant
    entry = admin.put_settings(Settings(max_in_flight=1), why="one at a time")
    assert entry.namespace_prefix is None and entry.settings.max_in_flight == 1
    try:
        assert isinstance(client.claim(ns, "a", request=1), Acquired)
        denied = client.claim(ns, "b", request=1)
        assert isinstance(denied, Denied) and denied.kind == "quota" and denied.reason["quota"] == "in_flight"
        assert denied.retryable and denied.retry_after is not None and denied.retry_after > 0
    finally:
        admin.delete_settings(why="done")
    assert isinstance(client.claim(ns, "b", request=1), Acquired)


def test_claim_rate_quota(other_tenant: tuple[onceguard.Client, onceguard.Client], ns: str) -> None:
    admin, client = other_tenant
    admin.put_settings(Settings(claim_rate=ClaimRate(per_second=1, burst=1)))
    try:
        client.claim(ns, "a", request=1)
        denied = client.claim(ns, "b", request=1)
        assert isinstance(denied, Denied) and denied.kind == "quota" and denied.reason["quota"] == "rate"
        assert denied.retry_after is not None and 0 < denied.retry_after <= 1
    finally:
        admin.delete_settings()


def test_namespace_settings_give_the_default_lease(
    other_tenant: tuple[onceguard.Client, onceguard.Client], ns: str
) -> None:
    admin, client = other_tenant
    admin.put_settings(Settings(default_lease="2s"), namespace_prefix=ns, why="short leases here")
    try:
        entries = admin.list_settings()
        assert any(e.namespace_prefix == ns and e.settings.default_lease == "2s" for e in entries)
        a = client.claim(ns, "k", request=1)
        assert isinstance(a, Acquired)
        left = (a.lease_expires_at - datetime.now(timezone.utc)).total_seconds()
        assert 0 < left <= 2.5
    finally:
        admin.delete_settings(namespace_prefix=ns)
    with pytest.raises(onceguard.NotFound):
        admin.delete_settings(namespace_prefix=ns)


def test_a_tripwire_switches_off_a_run_whose_effects_keep_failing(
    admin: onceguard.Client, client: onceguard.Client, ns: str
) -> None:
    import time

    name = f"py-{uuid.uuid4().hex[:10]}"
    rule = admin.put_tripwire(
        name,
        {"kind": "failure_rate", "above": 0.5},
        window="5m",
        min_calls=4,
        prefix=ns,
        per="run",
        why="stop runs that keep failing",
    )
    assert (rule.name, rule.prefix, rule.per, rule.window, rule.min_calls) == (name, ns, "run", "5m", 4)
    assert rule.symptom == {"kind": "failure_rate", "above": 0.5}
    assert name in [r.name for r in admin.list_tripwires()]
    run = run_id()
    target = SwitchTarget.run(run)
    try:
        ran = 0
        deadline = time.monotonic() + 30
        denied = None
        while time.monotonic() < deadline:
            answer = client.claim(ns, f"charge-{ran}", request=ran, run=run)
            if isinstance(answer, Denied):
                denied = answer
                break
            assert isinstance(answer, Acquired)
            client.fail(ns, f"charge-{ran}", answer.fence, retryable=False, error={"declined": True})
            ran += 1
            if ran >= 4:
                time.sleep(1.3)  # the server adds its counts every second
        assert denied is not None and denied.kind == "switch", "the run was never switched off"
        assert 4 <= ran <= 6, ran
        switch = next(s for s in client.list_switches() if s.target == target)
        assert switch.engaged_by == f"tripwire:{name}" and switch.tripwire is not None
        assert switch.tripwire.rule == name and switch.tripwire.run == run and switch.tripwire.calls >= 4
        # Another run of the namespace still runs.
        assert isinstance(client.claim(ns, "other", request=0, run=run_id()), Acquired)
    finally:
        admin.delete_tripwire(name, why="test done")
        try:
            admin.release_switch(target, "test done")
        except onceguard.NotFound:
            pass
    with pytest.raises(onceguard.NotFound):
        admin.delete_tripwire(name)


def test_a_tripwire_turns_a_canary_back_to_observe(admin: onceguard.Client, client: onceguard.Client, ns: str) -> None:
    import time

    admin.put_settings(Settings(enforce_percent=100), namespace_prefix=ns)
    name = f"py-{uuid.uuid4().hex[:10]}"
    rule = admin.put_tripwire(
        name,
        {"kind": "failure_rate", "above": 0.5},
        window="5m",
        min_calls=4,
        prefix=ns,
        action="observe",
        why="back to observe when enforcing breaks the agent",
    )
    assert (rule.action, rule.per) == ("observe", "namespace")
    try:
        done = client.claim(ns, "done", request=0)
        assert isinstance(done, Acquired)
        client.complete(ns, "done", done.fence, result={"sent": True})
        assert isinstance(client.claim(ns, "done", request=0), Replay), "enforced under the canary"
        deadline = time.monotonic() + 30
        ran = 0
        while time.monotonic() < deadline:
            entry = next(e for e in admin.list_settings() if e.namespace_prefix == ns)
            if entry.tripwire is not None:
                break
            answer = client.claim(ns, f"failing-{ran}", request=ran)
            assert isinstance(answer, Acquired)
            client.fail(ns, f"failing-{ran}", answer.fence, retryable=False, error={"declined": True})
            ran += 1
            if ran >= 4:
                time.sleep(1.3)  # the server adds its counts every second
        assert entry.tripwire is not None, "the canary was never turned back"
        assert entry.settings.mode == "observe" and entry.settings.enforce_percent is None
        assert entry.updated_by == f"tripwire:{name}" and entry.tripwire.trip.rule == name
        assert entry.tripwire.reason.startswith(f"tripwire {name}: failure rate"), entry.tripwire.reason
        assert 4 <= ran <= 6, ran
        time.sleep(1.1)  # every instance reads settings within a second
        again = client.claim(ns, "done", request=0)
        assert isinstance(again, onceguard.Proceed) and again.would_have_been == "replay", again
    finally:
        admin.delete_tripwire(name, why="test done")
        admin.delete_settings(namespace_prefix=ns)
