"""Namespaces that require a person's approval (``approval_required`` in their settings): a first
claim answers ``PendingApproval`` and acquires nothing until an admin approves; a denial refuses
every claim of the call; the guards raise ``AwaitingApproval`` (or wait for the decision with
``wait_for_approval``), and the framework tool guards tell the model."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest

import onceguard
from onceguard import (
    Acquired,
    ApprovalDenied,
    AwaitingApproval,
    ClaimItem,
    Denied,
    InFlight,
    Mismatch,
    PendingApproval,
    Replay,
    Settings,
    guarded,
    once,
)


@pytest.fixture
def gated(admin: onceguard.Client, ns: str) -> Iterator[str]:
    """A namespace prefix whose every call waits for a person's approval (``ns`` itself does not)."""
    prefix = f"{ns}/gated"
    entry = admin.put_settings(
        Settings(approval_required=True, approval_expiry="4h"), namespace_prefix=prefix, why="a person decides"
    )
    assert entry.settings.approval_required is True and entry.settings.approval_expiry == "4h"
    yield prefix
    admin.delete_settings(namespace_prefix=prefix)


@pytest.fixture
async def aadmin(server: Any) -> AsyncIterator[onceguard.AsyncClient]:
    async with onceguard.AsyncClient(server.url, server.admin_key) as c:
        yield c


def pending(answer: onceguard.ClaimAnswer) -> PendingApproval:
    assert isinstance(answer, PendingApproval), answer
    return answer


def on_send(c: onceguard.Client | onceguard.AsyncClient, note: Callable[[str, bytes | None], None]) -> None:
    """Calls ``note(path, body)`` as ``c`` sends each request from now on, before it is sent."""
    inner = c._transport.send

    if isinstance(c, onceguard.AsyncClient):

        async def asend(method: str, path: str, *rest: Any, **named: Any) -> Any:
            note(path, rest[1])
            return await inner(method, path, *rest, **named)

        c._transport.send = asend  # type: ignore[method-assign]
    else:

        def send(method: str, path: str, *rest: Any, **named: Any) -> Any:
            note(path, rest[1])
            return inner(method, path, *rest, **named)

        c._transport.send = send  # type: ignore[method-assign]


def claim_bodies(c: onceguard.Client | onceguard.AsyncClient) -> list[dict[str, Any]]:
    """The bodies of the claims ``c`` sends from now on, as they are sent."""
    sent: list[dict[str, Any]] = []
    on_send(c, lambda path, body: sent.append(json.loads(body or b"")) if path == "/v1/claims" else None)
    return sent


def test_pending_until_approved_then_the_next_claim_acquires(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    ns = f"{gated}/payments"
    first = pending(client.claim(ns, "refund-1", request={"order": 1}, run="run-appr-1", cost=3, summary="Refund 25 EUR\nto order 1"))
    a = first.approval
    assert a.id.startswith("apr_") and a.state == "pending" and a.decision is None
    assert (a.namespace, a.key, a.run, a.cost, a.summary) == (ns, "refund-1", "run-appr-1", 3, "Refund 25 EUR\nto order 1")
    assert a.fingerprint.startswith("sha256:")
    assert a.expires_at - a.requested_at == timedelta(hours=4)
    assert first.retry_after > 0

    again = pending(client.claim(ns, "refund-1", request={"order": 1}, run="run-appr-1", cost=3))
    assert again.approval == a, "the same call while pending: the same approval"
    # The approver sees the run and the cost: another run, or more cost, is another call.
    assert isinstance(client.claim(ns, "refund-1", request={"order": 1}, run="run-other", cost=3), Mismatch)
    assert isinstance(client.claim(ns, "refund-1", request={"order": 1}, run="run-appr-1", cost=300), Mismatch)
    assert client.get_record(ns, "refund-1") is None, "nothing acquired"
    assert client.get_run("run-appr-1") is None, "nothing charged"
    assert client.get_approval(a.id) == a
    assert client.get_approval("apr_0000000000000000deadbeef") is None
    assert a.id in [p.id for p in client.iter_approvals(state="pending")]

    decided = admin.approve(a.id, why="the customer asked")
    assert decided.state == "approved" and decided.decision is not None
    assert decided.decision.approved and decided.decision.why == "the customer asked" and decided.decision.by
    assert a.id in [p.id for p in admin.iter_approvals(state="approved")]
    assert a.id not in [p.id for p in admin.iter_approvals(state="pending")]

    acquired = client.claim(ns, "refund-1", request={"order": 1}, run="run-appr-1", cost=3)
    assert isinstance(acquired, Acquired) and acquired.attempt == 1
    client.complete(ns, "refund-1", acquired.fence, {"refund": "re_1"})
    replay = client.claim(ns, "refund-1", request={"order": 1})
    assert isinstance(replay, Replay) and replay.result == {"refund": "re_1"}


def test_eight_concurrent_claims_after_the_approval_acquire_once(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    approval = pending(client.claim(gated, "k", request={"x": 1})).approval
    admin.approve(approval.id, why="ok")
    barrier = threading.Barrier(8)
    answers: list[onceguard.ClaimAnswer] = []
    lock = threading.Lock()

    def claim() -> None:
        barrier.wait()
        answer = client.claim(gated, "k", request={"x": 1}, lease=30)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(answers) == 8
    assert sum(isinstance(a, Acquired) for a in answers) == 1
    assert sum(isinstance(a, InFlight) for a in answers) == 7


def test_a_denied_call_is_refused_on_every_claim(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    runs: list[int] = []

    @once(client, gated, key="drop-table", summary=lambda table: f"DROP TABLE {table}")
    def drop(table: str) -> str:
        runs.append(1)
        return "dropped"

    with pytest.raises(AwaitingApproval) as waiting:
        drop("users")
    approval = waiting.value.approval
    assert approval.summary == "DROP TABLE users" and approval.key == "drop-table"
    decided = admin.deny(approval.id, why="never in production")
    assert decided.state == "denied" and decided.decision is not None and not decided.decision.approved

    for _ in range(3):
        answer = client.claim(gated, "drop-table", request={"table": "users"})
        assert isinstance(answer, Denied) and answer.kind == "approval" and not answer.retryable
        assert answer.reason == {
            "reason": "approval_denied",
            "approval": approval.id,
            "by": decided.decision.by,
            "why": "never in production",
        }
    for _ in range(2):
        with pytest.raises(ApprovalDenied) as e:
            drop("users")
        assert isinstance(e.value, onceguard.DeniedError) and e.value.kind == "approval"
        assert (e.value.approval_id, e.value.by, e.value.why) == (approval.id, decided.decision.by, "never in production")
    with pytest.raises(ApprovalDenied):
        with guarded(client, gated, "drop-table", request={"table": "users"}):
            raise AssertionError("must not run")
    assert runs == []


def test_an_agent_key_cannot_decide_and_a_decision_is_final(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    approval = pending(client.claim(gated, "k", request=1)).approval
    with pytest.raises(onceguard.Forbidden) as forbidden:
        client.approve(approval.id, why="I approve myself")
    assert forbidden.value.status == 403
    with pytest.raises(onceguard.Forbidden):
        client.deny(approval.id, why="no")
    assert pending(client.claim(gated, "k", request=1)).approval.state == "pending"

    admin.approve(approval.id, why="ok")
    for decide in (admin.approve, admin.deny):
        with pytest.raises(onceguard.ApprovalClosed) as closed:
            decide(approval.id, why="again")
        assert closed.value.status == 409 and closed.value.kind == "approval-closed" and not closed.value.retryable
    approved = admin.get_approval(approval.id)
    assert approved is not None and approved.state == "approved" and approved.decision is not None
    assert approved.decision.why == "ok"
    with pytest.raises(onceguard.NotFound):
        admin.approve("apr_0000000000000000deadbeef", why="ok")
    with pytest.raises(onceguard.InvalidRequest):
        admin.approve(approval.id, why="")


def test_after_the_approval_another_request_is_a_mismatch(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    approval = pending(client.claim(gated, "refund-7", request={"order": 7, "amount": 25})).approval
    admin.approve(approval.id, why="25 is fine")
    assert isinstance(client.claim(gated, "refund-7", request={"order": 7, "amount": 2500}), Mismatch)

    @once(client, gated, key=lambda order, amount: f"refund-{order}")
    def refund(order: int, amount: int) -> int:
        return amount

    with pytest.raises(onceguard.KeyConflict):
        refund(7, 2500)
    assert refund(7, 25) == 25, "the approved request runs"


def test_once_raises_awaiting_approval_at_once_and_does_not_run(
    server: Any, agent_key: str, gated: str
) -> None:
    runs: list[int] = []
    with onceguard.Client(server.url, agent_key) as c:
        sent = claim_bodies(c)

        @once(c, gated, version="v1", wait=10)
        def send(to: str) -> str:
            runs.append(1)
            return f"sent to {to}"

        for _ in range(2):
            with pytest.raises(AwaitingApproval) as e:
                send("ops@example.com")
            assert isinstance(e.value, onceguard.GuardError) and e.value.namespace == gated
            assert e.value.approval.state == "pending" and e.value.retry_after > 0
            assert e.value.approval.id in str(e.value) and "nothing was done" in str(e.value)
        with pytest.raises(AwaitingApproval):
            with guarded(c, gated, "block", request={"b": 1}):
                raise AssertionError("must not run")
    assert runs == []
    assert sent and all("wait" not in body for body in sent), "no wait spent on the decision without wait_for_approval"


def test_wait_for_approval_runs_once_after_an_approval_given_while_it_waits(
    admin: onceguard.Client, server: Any, agent_key: str, gated: str
) -> None:
    runs: list[str] = []
    with onceguard.Client(server.url, agent_key) as c:
        sent = claim_bodies(c)
        waiting = threading.Event()
        on_send(c, lambda path, body: waiting.set() if b'"wait"' in (body or b"") else None)

        @once(c, gated, key="deploy-42", wait_for_approval="5m", summary="deploy build 42")
        def deploy(build: int) -> str:
            runs.append("deploy")
            return f"deployed {build}"

        def approver() -> None:
            assert waiting.wait(30)
            (approval,) = [a for a in admin.iter_approvals(state="pending") if a.namespace == gated]
            assert approval.summary == "deploy build 42"
            admin.approve(approval.id, why="release window")

        thread = threading.Thread(target=approver)
        thread.start()
        try:
            assert deploy(42) == "deployed 42"
        finally:
            thread.join()
        assert deploy(42) == "deployed 42"
    assert runs == ["deploy"]
    waits = [body["wait"] for body in sent if "wait" in body]
    assert waits and all(onceguard._wire.duration_seconds(w) <= 30 for w in waits), waits


def test_wait_for_approval_ends_undecided_or_denied(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    @once(client, gated, key="k", wait_for_approval=timedelta(milliseconds=300))
    def effect() -> None:
        raise AssertionError("must not run")

    with pytest.raises(AwaitingApproval) as e:
        effect()
    admin.deny(e.value.approval.id, why="no")
    with pytest.raises(ApprovalDenied):
        effect()


def test_a_batch_claims_with_summaries_and_once_each_does_the_approved_items(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    items = ["a", "b", "c"]
    done: list[str] = []

    def work(batch: list[str]) -> list[str]:
        done.extend(batch)
        return [x.upper() for x in batch]

    def each() -> list[Any]:
        return onceguard.once_each(client, gated, items, key=lambda x: f"item-{x}", work=work, summary=lambda x: f"publish {x}")

    with pytest.raises(AwaitingApproval) as first:
        each()
    assert done == [] and first.value.key == "item-a"
    answers = client.claim_batch([ClaimItem(gated, f"item-{x}", request=f"item-{x}") for x in items])
    approvals = {pending(a).approval.key: pending(a).approval for a in answers}
    assert {k: a.summary for k, a in approvals.items()} == {f"item-{x}": f"publish {x}" for x in items}

    admin.approve(approvals["item-a"].id, why="ok")
    admin.approve(approvals["item-c"].id, why="ok")
    with pytest.raises(AwaitingApproval) as second:
        each()
    assert sorted(done) == ["a", "c"] and second.value.key == "item-b", "the approved items are done, then it says which waits"
    admin.approve(approvals["item-b"].id, why="ok")
    assert each() == ["A", "B", "C"]
    assert sorted(done) == ["a", "b", "c"]


def test_list_approvals_pages_through_the_cursor(client: onceguard.Client, gated: str) -> None:
    ids = [pending(client.claim(gated, f"k{i}", request=i)).approval.id for i in range(3)]
    page = client.list_approvals(state="pending", limit=1)
    assert len(page.approvals) == 1 and page.next
    mine = [a.id for a in client.iter_approvals(state="pending", page_size=1) if a.namespace == gated]
    assert sorted(mine) == sorted(ids), "every page, each approval once"
    with pytest.raises(onceguard.InvalidRequest):
        client.list_approvals(state="maybe")


async def test_async_once_waits_for_an_approval_from_another_task(
    aadmin: onceguard.AsyncClient, aclient: onceguard.AsyncClient, gated: str
) -> None:
    runs: list[int] = []
    sent = claim_bodies(aclient)
    waiting = asyncio.Event()

    on_send(aclient, lambda path, body: waiting.set() if b'"wait"' in (body or b"") else None)

    @once(aclient, gated, key="async-deploy", wait_for_approval="2m")
    async def deploy(build: int) -> str:
        runs.append(build)
        return f"deployed {build}"

    async def approver() -> None:
        await waiting.wait()
        (approval,) = [a async for a in aadmin.iter_approvals(state="pending") if a.namespace == gated]
        await aadmin.approve(approval.id, why="go")

    result, _ = await asyncio.gather(deploy(7), approver())
    assert result == "deployed 7" and await deploy(7) == "deployed 7"
    assert runs == [7]
    assert any("wait" in body for body in sent)


async def test_async_guards_raise_awaiting_approval_and_approval_denied(
    aadmin: onceguard.AsyncClient, aclient: onceguard.AsyncClient, gated: str
) -> None:
    answer = pending(await aclient.claim(gated, "k", request={"v": 1}, summary="async call"))
    assert answer.approval.summary == "async call"

    @once(aclient, gated, key="k")
    async def effect(v: int) -> None:
        raise AssertionError("must not run")

    with pytest.raises(AwaitingApproval) as e:
        await effect(1)
    assert e.value.approval.id == answer.approval.id
    await aadmin.deny(answer.approval.id, why="no")
    with pytest.raises(ApprovalDenied) as denied:
        async with guarded(aclient, gated, "k", request={"v": 1}):
            raise AssertionError("must not run")
    assert denied.value.approval_id == answer.approval.id and denied.value.why == "no"
    assert (await aclient.get_approval(answer.approval.id)).state == "denied"  # type: ignore[union-attr]


# ------------------------------------------------------------------------------------------------
# Framework tool guards: the model is told, the tool does not run
# ------------------------------------------------------------------------------------------------


def test_a_langchain_tool_tells_the_model_it_awaits_approval(
    admin: onceguard.Client, client: onceguard.Client, gated: str
) -> None:
    from langchain_core.tools import tool

    from onceguard.langchain import ToolAwaitingApproval, guard_tool

    refunds: list[int] = []

    @tool
    def refund(order: int) -> str:
        """Refund an order."""
        refunds.append(order)
        return f"refunded {order}"

    refund.handle_tool_error = True  # the model sees a tool's refusals as its answer
    guarded_tool = guard_tool(refund, client, gated, run_id="r", summary=lambda call: f"refund order {call.arguments['order']}")
    told = guarded_tool.invoke({"order": 9})
    (approval,) = [a for a in client.iter_approvals(state="pending") if a.namespace == gated]
    assert approval.summary == "refund order 9"
    assert told == f"This call awaits a person's approval (approval {approval.id}). Nothing was done. " \
        "Call the tool again later with the same arguments: it runs once approved."
    assert refunds == []

    quiet = guard_tool(refund.model_copy(update={"handle_tool_error": False}), client, gated, run_id="r")
    with pytest.raises(AwaitingApproval) as raised:  # without handle_tool_error it propagates, as other refusals
        quiet.invoke({"order": 9})
    assert isinstance(raised.value, ToolAwaitingApproval) and raised.value.approval.id == approval.id

    admin.approve(approval.id, why="ok")
    assert guarded_tool.invoke({"order": 9}) == "refunded 9"
    assert guarded_tool.invoke({"order": 9}) == "refunded 9"
    assert refunds == [9]


@pytest.mark.parametrize("client_kind", ["async", "sync"])
async def test_an_agents_tool_tells_the_model_it_awaits_approval(
    client_kind: str, client: onceguard.Client, aclient: onceguard.AsyncClient, gated: str
) -> None:
    from agents import Agent, RunConfig, Runner, function_tool

    from onceguard.openai_agents import guard_function_tool

    from .test_openai_agents import ScriptedModel, _outputs, message, tool_call

    sent: list[str] = []

    @function_tool  # the SDK's default failure policy: a fixed message for the model
    def send_invoice(customer: str) -> str:
        """Send an invoice."""
        sent.append(customer)
        return f"invoice sent to {customer}"

    tool = guard_function_tool(
        send_invoice, aclient if client_kind == "async" else client, gated, run_id="run-1", summary="invoice acme"
    )
    model = ScriptedModel([[tool_call("send_invoice", {"customer": "acme"}, "c1")], [message("waiting")]])
    await Runner.run(Agent(name="billing", tools=[tool], model=model), "bill", run_config=RunConfig(tracing_disabled=True))
    (approval,) = [a async for a in aclient.iter_approvals(state="pending") if a.namespace == gated]
    assert approval.summary == "invoice acme"
    outputs = [o for inputs in model.inputs for o in _outputs(inputs)]
    assert outputs == [
        f"This call awaits a person's approval (approval {approval.id}). Nothing was done. "
        "Call the tool again later with the same arguments: it runs once approved."
    ]
    assert sent == []


async def test_an_agents_tool_without_a_failure_policy_raises_awaiting_approval(
    aclient: onceguard.AsyncClient, gated: str
) -> None:
    from agents import Agent, RunConfig, Runner, function_tool
    from agents.exceptions import UserError

    from onceguard.openai_agents import guard_function_tool

    from .test_openai_agents import ScriptedModel, message, tool_call

    @function_tool(failure_error_function=None)
    def send_invoice(customer: str) -> str:
        """Send an invoice."""
        raise AssertionError("must not run")

    tool = guard_function_tool(send_invoice, aclient, gated, run_id="run-2")
    model = ScriptedModel([[tool_call("send_invoice", {"customer": "acme"}, "c1")], [message("done")]])
    with pytest.raises(UserError) as e:  # the SDK's wrapping of what a tool raises
        await Runner.run(Agent(name="billing", tools=[tool], model=model), "bill", run_config=RunConfig(tracing_disabled=True))
    assert isinstance(e.value.__cause__, AwaitingApproval)
