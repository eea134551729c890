"""Namespaces that keep a digest only (``outcome_kept: digest``): a replay carries the size and
SHA-256 of the stored bytes instead of them, and no guard runs the function again for it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import pytest

import onceguard
from onceguard import (
    Acquired,
    ClaimItem,
    Replay,
    ResultDigest,
    ResultNotKept,
    Settings,
    guarded,
    once,
)
from onceguard.keys import derive_key


class CardDeclined(Exception):
    pass


def digest_of(value: Any) -> ResultDigest:
    """The digest of a JSON value as the client sends it: compact, UTF-8, non-ASCII as is."""
    raw = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return ResultDigest(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())


@pytest.fixture
def pii(admin: onceguard.Client, ns: str) -> Iterator[str]:
    """A namespace under a prefix whose settings keep a digest only (``ns`` itself keeps all)."""
    prefix = f"{ns}/pii"
    entry = admin.put_settings(Settings(outcome_kept="digest"), namespace_prefix=prefix, why="personal data")
    assert entry.settings.outcome_kept == "digest"
    yield prefix
    admin.delete_settings(namespace_prefix=prefix)


RECEIPT = {"customer": "Zoë Faure", "amount": 25, "card": "•••• 4242"}


def test_once_runs_once_then_raises_result_not_kept_with_the_digest(
    admin: onceguard.Client, client: onceguard.Client, pii: str
) -> None:
    assert any(e.namespace_prefix == pii and e.settings.outcome_kept == "digest" for e in admin.list_settings())
    runs = []

    @once(client, pii, name="send_receipt")
    def send_receipt(order: int) -> dict[str, Any]:
        runs.append(order)
        return RECEIPT

    assert send_receipt(7) == RECEIPT  # the caller that ran it gets its whole result
    with pytest.raises(ResultNotKept) as e:
        send_receipt(7)
    assert runs == [7]
    key = derive_key("send_receipt", "v1", {"order": 7})
    assert e.value.digest == digest_of(RECEIPT)
    assert (e.value.status, e.value.namespace, e.value.key) == ("success", pii, key)
    assert "already ran once" in str(e.value) and "not kept" in str(e.value)
    with pytest.raises(ResultNotKept):
        send_receipt(7)
    assert runs == [7]

    replay = client.claim(pii, key, request={"order": 7})
    assert isinstance(replay, Replay) and replay.succeeded
    assert (replay.digest, replay.raw, replay.content_type) == (digest_of(RECEIPT), b"", "application/json")
    with pytest.raises(ResultNotKept, match="keeps only a digest") as read:
        replay.result
    assert read.value.digest == replay.digest and read.value.key is None
    record = client.get_record(pii, key)
    assert record is not None and record.stored is not None
    assert (record.stored.digest, record.stored.raw) == (digest_of(RECEIPT), b"")
    with pytest.raises(ResultNotKept):
        record.stored.result


async def test_async_once_runs_once_then_raises_result_not_kept(aclient: onceguard.AsyncClient, pii: str) -> None:
    runs = []

    @once(aclient, pii, key="receipt-8")
    async def send_receipt(order: int) -> dict[str, Any]:
        runs.append(order)
        return {**RECEIPT, "order": order}

    assert (await send_receipt(8))["order"] == 8
    with pytest.raises(ResultNotKept) as e:
        await send_receipt(8)
    assert runs == [8]
    assert e.value.digest == digest_of({**RECEIPT, "order": 8}) and e.value.key == "receipt-8"


def test_guarded_does_not_enter_the_block_again(client: onceguard.Client, pii: str) -> None:
    entered = []
    with guarded(client, pii, "note-1", request={"note": 1}) as attempt:
        assert not attempt.replayed
        entered.append(1)
        attempt.result = "private note"
    with pytest.raises(ResultNotKept) as e:
        with guarded(client, pii, "note-1", request={"note": 1}):
            entered.append(2)
    assert entered == [1] and e.value.digest == digest_of("private note")


def test_a_stored_permanent_failure_is_not_kept_either(client: onceguard.Client, pii: str) -> None:
    runs = []

    @once(client, pii, key="charge", permanent=(CardDeclined,))
    def charge() -> None:
        runs.append(1)
        raise CardDeclined("card of Zoë declined")

    with pytest.raises(onceguard.PermanentFailure) as first:
        charge()
    with pytest.raises(ResultNotKept) as e:
        charge()
    assert runs == [1] and e.value.status == "failure"
    assert e.value.digest == digest_of({"type": first.value.error_type, "message": first.value.error_message})


@pytest.mark.parametrize("with_acquisition", [False, True])
def test_a_batch_reads_a_digest_item_between_kept_replays(
    client: onceguard.Client, ns: str, pii: str, with_acquisition: bool
) -> None:
    kept = f"{ns}/kept"
    for namespace, key in ((kept, "a"), (pii, "b"), (kept, "c")):
        held = client.claim(namespace, key, request=key)
        assert isinstance(held, Acquired)
        client.complete(namespace, key, held.fence, onceguard.RawJson('{"result": "%s" }' % key))
    items = [ClaimItem(kept, "a", request="a"), ClaimItem(pii, "b", request="b"), ClaimItem(kept, "c", request="c")]
    if with_acquisition:
        items.append(ClaimItem(kept, "new", request="new"))
    answers = client.claim_batch(items)
    a, b, c = answers[:3]
    assert isinstance(a, Replay) and isinstance(b, Replay) and isinstance(c, Replay)
    assert (a.raw, a.digest, c.raw, c.digest) == (b'{"result": "a" }', None, b'{"result": "c" }', None)
    raw_b = b'{"result": "b" }'
    assert b.digest == ResultDigest(len(raw_b), hashlib.sha256(raw_b).hexdigest()) and b.raw == b""
    assert isinstance(answers[-1], Acquired) == with_acquisition


def test_once_each_never_does_an_item_again(client: onceguard.Client, pii: str) -> None:
    done: list[str] = []

    def work(texts: list[str]) -> list[Any]:
        done.extend(texts)
        return [{"text": t, "length": len(t)} for t in texts]

    texts = ["Zoë's address", "a phone number"]
    first = onceguard.once_each(client, pii, texts, key=lambda t: f"t{len(t)}", work=work)
    assert first == [{"text": t, "length": len(t)} for t in texts]
    with pytest.raises(ResultNotKept) as e:
        onceguard.once_each(client, pii, texts, key=lambda t: f"t{len(t)}", work=work)
    assert done == texts
    assert e.value.key == f"t{len(texts[0])}" and e.value.digest == digest_of(first[0])

    batch = client.claim_batch([ClaimItem(pii, f"t{len(t)}", request=f"t{len(t)}") for t in texts])
    assert [getattr(r, "digest", None) for r in batch] == [digest_of(v) for v in first]


async def test_async_once_each_never_does_an_item_again(aclient: onceguard.AsyncClient, pii: str) -> None:
    done: list[str] = []

    async def work(texts: list[str]) -> list[Any]:
        done.extend(texts)
        return [len(t) for t in texts]

    await onceguard.once_each_async(aclient, pii, ["x", "yy"], key=lambda t: t, work=work)
    with pytest.raises(ResultNotKept) as e:
        await onceguard.once_each_async(aclient, pii, ["yy", "zzz"], key=lambda t: t, work=work)
    assert done == ["x", "yy"] and e.value.key == "yy" and e.value.digest == digest_of(2)


async def test_an_agents_tool_tells_the_model_it_ran_once(aclient: onceguard.AsyncClient, pii: str) -> None:
    """As for a call in flight or denied, the tool's failure policy answers the model."""
    from agents import Agent, RunConfig, Runner, function_tool

    from onceguard.openai_agents import guard_function_tool

    from .test_openai_agents import ScriptedModel, _outputs, message, tool_call

    sent = []

    @function_tool(failure_error_function=lambda ctx, error: f"error: {error}")
    def send_invoice(customer: str) -> str:
        """Send an invoice."""
        sent.append(customer)
        return f"invoice sent to {customer}"

    tool = guard_function_tool(send_invoice, aclient, pii, run_id="run-digest")
    args = {"customer": "Zoë"}
    model = ScriptedModel([[tool_call("send_invoice", args, "c1")], [tool_call("send_invoice", args, "c2")], [message("done")]])
    await Runner.run(Agent(name="billing", tools=[tool], model=model), "bill", run_config=RunConfig(tracing_disabled=True))
    outputs = [o for inputs in model.inputs for o in _outputs(inputs)]
    assert sent == ["Zoë"]
    assert outputs[0] == "invoice sent to Zoë"
    assert "already ran once" in outputs[-1] and "not kept" in outputs[-1]

