"""The client's calls against a real server: every claim answer, fenced calls, records, errors."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest

import onceguard
from onceguard import Acquired, InFlight, Mismatch, RawJson, Replay


def acquired(answer: onceguard.ClaimAnswer) -> Acquired:
    assert isinstance(answer, Acquired), answer
    return answer


def test_acquired_then_replay_byte_for_byte(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "refund-1", request={"order": 1, "amount": 25}, lease="30s"))
    assert a.fence >= 1 and a.attempt == 1 and a.recovery is None
    assert a.lease_expires_at > datetime.now(timezone.utc)

    stored = '{"z":1, "a" : [1.50, "é"]}'  # spacing and number spelling kept exactly
    record = client.complete(ns, "refund-1", a.fence, RawJson(stored), cost=7, tokens=310)
    assert record.state == "completed" and record.fence == a.fence

    replay = client.claim(ns, "refund-1", request={"amount": 25, "order": 1})  # key order does not matter
    assert isinstance(replay, Replay)
    assert replay.raw == stored.encode()
    assert replay.result == {"z": 1, "a": [1.5, "é"]}
    assert (replay.status, replay.fence, replay.attempt, replay.cost) == ("success", a.fence, 1, 7)
    assert replay.tokens == 310, "a replay says the tokens it saved"
    assert replay.succeeded and replay.completed_at <= datetime.now(timezone.utc)


def test_python_result_is_stored_as_compact_json(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "k", request=None))
    client.complete(ns, "k", a.fence, {"receipt": "re_1", "amounts": [1, 2.5]})
    replay = client.claim(ns, "k", request=None)
    assert isinstance(replay, Replay)
    assert replay.raw == b'{"receipt":"re_1","amounts":[1,2.5]}'


def test_raw_bytes_replay_with_their_media_type(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "bin", request={"file": "x"}))
    client.complete(ns, "bin", a.fence, raw=b"\x00\xffpng", content_type="image/png")
    replay = client.claim(ns, "bin", request={"file": "x"})
    assert isinstance(replay, Replay)
    assert (replay.raw, replay.content_type, replay.result) == (b"\x00\xffpng", "image/png", b"\x00\xffpng")


def test_in_flight_while_a_lease_lives(client: onceguard.Client, ns: str) -> None:
    acquired(client.claim(ns, "k", request=1, lease=5))
    answer = client.claim(ns, "k", request=1)
    assert isinstance(answer, InFlight)
    assert 0 < answer.retry_after <= 5 and answer.attempt == 1


def test_mismatch_changes_nothing(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "k", request={"amount": 25}))
    assert isinstance(client.claim(ns, "k", request={"amount": 2500}), Mismatch)
    client.complete(ns, "k", a.fence, "done")
    assert isinstance(client.claim(ns, "k", request={"amount": 2500}), Mismatch)
    assert isinstance(client.claim(ns, "k", request={"amount": 25}), Replay)


def test_fingerprint_given_instead_of_request(client: onceguard.Client, ns: str) -> None:
    fp = "sha256:" + "ab" * 32
    acquired(client.claim(ns, "k", fingerprint=fp, lease=5))
    assert isinstance(client.claim(ns, "k", fingerprint=fp), InFlight)
    assert isinstance(client.claim(ns, "k", fingerprint="sha256:" + "cd" * 32), Mismatch)
    with pytest.raises(ValueError):
        client.claim(ns, "k")  # neither request nor fingerprint
    with pytest.raises(ValueError):
        client.claim(ns, "k", request=1, fingerprint=fp)


def test_wait_receives_the_replay_when_the_holder_completes(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "k", request=1, lease=10))
    timer = threading.Timer(0.3, lambda: client.complete(ns, "k", a.fence, {"ok": True}))
    timer.start()
    try:
        answer = client.claim(ns, "k", request=1, wait=5)
    finally:
        timer.join()
    assert isinstance(answer, Replay) and answer.result == {"ok": True}


def test_retryable_failure_releases_permanent_failure_replays(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "k", request=1))
    record = client.fail(ns, "k", a.fence, retryable=True, error={"why": "timeout"})
    assert record.state == "released"
    b = acquired(client.claim(ns, "k", request=1))
    assert b.attempt == 2 and b.fence > a.fence and b.recovery is None

    client.fail(ns, "k", b.fence, retryable=False, error={"why": "card declined"})
    replay = client.claim(ns, "k", request=1)
    assert isinstance(replay, Replay)
    assert replay.status == "failure" and not replay.succeeded and replay.result == {"why": "card declined"}


def test_stale_fences_change_nothing(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "k", request=1))
    with pytest.raises(onceguard.StaleFence) as e:
        client.complete(ns, "k", a.fence + 1000, "zombie")
    assert e.value.reason == "superseded" and e.value.status == 409 and not e.value.retryable
    assert e.value.type == "https://onceguard.dev/problems/stale-fence" and e.value.kind == "stale-fence"
    assert e.value.stale.reason == "superseded"
    with pytest.raises(onceguard.StaleFence) as e:
        client.extend(ns, "never-claimed", 1)
    assert e.value.reason == "no_record"

    client.complete(ns, "k", a.fence, "first")
    client.complete(ns, "k", a.fence, "first")  # repeating a completion that took effect is answered alike
    with pytest.raises(onceguard.StaleFence) as e:
        client.complete(ns, "k", a.fence, "second")
    assert e.value.reason == "finished"


def test_checkpoint_and_report_unknown_make_the_next_claim_a_recovery(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "k", request=1))
    client.extend(ns, "k", a.fence, "1m")
    client.checkpoint(ns, "k", a.fence, "reserved", {"hold": "h_1"})
    record = client.checkpoint(ns, "k", a.fence, "charged-card", {"charge": "ch_1"})
    assert [c.name for c in record.checkpoints] == ["reserved", "charged-card"]
    client.report_unknown(ns, "k", a.fence, "upstream timed out after sending")

    b = acquired(client.claim(ns, "k", request=1))
    assert b.attempt == 2 and b.fence > a.fence
    assert b.recovery is not None
    assert b.recovery.reason == "reported_unknown"
    assert b.recovery.detail == "upstream timed out after sending"
    assert (b.recovery.previous_fence, b.recovery.previous_attempt) == (a.fence, 1)
    cp = b.recovery.last_checkpoint
    assert cp is not None and (cp.name, cp.data, cp.fence) == ("charged-card", {"charge": "ch_1"}, a.fence)


def test_a_lease_that_passes_makes_the_next_claim_a_recovery(client: onceguard.Client, ns: str) -> None:
    a = acquired(client.claim(ns, "k", request=1, lease=0.2))
    time.sleep(0.35)
    b = acquired(client.claim(ns, "k", request=1))
    assert b.recovery is not None and b.recovery.reason == "lease_expired" and b.recovery.last_checkpoint is None
    with pytest.raises(onceguard.StaleFence):
        client.complete(ns, "k", a.fence, "zombie")


def test_get_record_with_its_stored_outcome(client: onceguard.Client, ns: str) -> None:
    assert client.get_record(ns, "missing") is None
    a = acquired(client.claim(ns, "k e/y?&", request={"x": 1}, run="run-1"))  # a key that needs URL-encoding
    client.complete(ns, "k e/y?&", a.fence, RawJson('{"b": 2}'))
    record = client.get_record(ns, "k e/y?&")
    assert record is not None
    assert (record.key, record.state, record.run, record.fence) == ("k e/y?&", "completed", "run-1", a.fence)
    assert record.fingerprint.startswith("sha256:")
    assert record.stored is not None and record.stored.raw == b'{"b": 2}' and record.stored.result == {"b": 2}


def test_list_records_pages_through_the_cursor(client: onceguard.Client, ns: str) -> None:
    for i in range(5):
        a = acquired(client.claim(ns, f"k{i}", request=i, lease=30))
        if i % 2 == 0:
            client.complete(ns, f"k{i}", a.fence, i)
    page = client.list_records(namespace_prefix=ns, limit=2)
    assert len(page.records) == 2 and page.next
    keys = [r.key for r in client.iter_records(namespace_prefix=ns, page_size=2)]
    assert keys == ["k0", "k1", "k2", "k3", "k4"]
    in_progress = [r.key for r in client.iter_records(namespace_prefix=ns, state="in_progress")]
    assert in_progress == ["k1", "k3"]


def test_purge_needs_an_admin_and_the_next_claim_runs_again(
    client: onceguard.Client, admin: onceguard.Client, ns: str
) -> None:
    a = acquired(client.claim(ns, "k", request=1))
    client.complete(ns, "k", a.fence, 1)
    with pytest.raises(onceguard.Forbidden) as e:
        client.purge(ns, "k")
    assert e.value.status == 403
    assert admin.purge(ns, "k") is True
    assert admin.purge(ns, "k") is False
    b = acquired(client.claim(ns, "k", request=1))
    assert b.fence > a.fence


def test_problems_are_typed_by_their_type(server: object, client: onceguard.Client, ns: str) -> None:
    with pytest.raises(onceguard.InvalidRequest) as e:
        client.claim("not a namespace!", "k", request=1)
    assert e.value.status == 400 and e.value.kind == "invalid-request" and not e.value.retryable and e.value.detail
    with pytest.raises(onceguard.InvalidRequest):
        client.claim(ns, "k", request=1, lease="1ms")  # below the server's minimum lease
    with pytest.raises(ValueError):
        client.claim(ns, "k", request=1, lease="soon")  # refused before sending
    with onceguard.Client(client.base_url, "og_nobody_secret") as stranger:
        with pytest.raises(onceguard.Unauthenticated) as u:
            stranger.claim(ns, "k", request=1)
    assert u.value.status == 401


def test_api_keys_and_readiness(admin: onceguard.Client, server: object) -> None:
    key = admin.create_api_key("agent", "short-lived")
    assert key.token and key.role == "agent"
    assert key.id in [k.id for k in admin.list_api_keys()]
    admin.revoke_api_key(key.id)
    with onceguard.Client(admin.base_url, key.token) as revoked:
        with pytest.raises(onceguard.Unauthenticated):
            revoked.get_record("a", "b")
    assert admin.ready()


def test_a_batch_answers_each_claim_and_completion_as_alone(client: onceguard.Client, ns: str) -> None:
    from onceguard import ClaimItem, CompleteItem

    done = acquired(client.claim(ns, "done", request={"chunk": 0}))
    client.complete(ns, "done", done.fence, RawJson('{"v": [0.10]}'))
    items = [ClaimItem(ns, f"chunk-{i}", request={"chunk": i}) for i in range(1, 4)]
    answers = client.claim_batch(
        [*items, ClaimItem(ns, "done", request={"chunk": 0}), ClaimItem(ns, "done", request={"other": 1}), items[0]]
    )
    fences = [acquired(a).fence for a in answers[:3]]
    assert isinstance(answers[3], Replay) and answers[3].raw == b'{"v": [0.10]}', answers[3]
    assert isinstance(answers[4], Mismatch)
    assert isinstance(answers[5], InFlight), "the same key again sees the first claim"
    stored = client.complete_batch(
        [CompleteItem(ns, i.key, f, RawJson('{"v": [2.50]}'), cost=3) for i, f in zip(items, fences)]
        + [CompleteItem(ns, "chunk-1", fences[0] + 1000, 1)]
    )
    assert [getattr(r, "state", None) for r in stored[:3]] == ["completed"] * 3
    assert isinstance(stored[3], onceguard.StaleFence)
    replays = client.claim_batch(items)
    assert [r.raw for r in replays if isinstance(r, Replay)] == [b'{"v": [2.50]}'] * 3
    with pytest.raises(onceguard.InvalidRequest, match="item 1"):
        client.claim_batch([ClaimItem(ns, "x", request=1), ClaimItem("bad namespace!", "y", request=1)])
    assert client.claim_batch([]) == []


async def test_an_async_batch_answers_as_the_sync_one(aclient: onceguard.AsyncClient, ns: str) -> None:
    from onceguard import ClaimItem

    first = await aclient.claim_batch([ClaimItem(ns, "a", request=1), ClaimItem(ns, "a", request=1)])
    assert isinstance(first[0], Acquired) and isinstance(first[1], InFlight)


def test_a_batch_answer_with_another_number_of_items_is_refused() -> None:
    from onceguard import ClaimItem, CompleteItem, _calls
    from onceguard._http import Response

    claims = _calls.claim_batch([ClaimItem("ns", "a", request=1), ClaimItem("ns", "b", request=1)])
    one = b'{"results":[{"status":201,"body":{"outcome":"acquired","fence":1,"attempt":1,"lease_expires_at":"2026-12-01T00:00:00Z","recovery":null}}]}'
    with pytest.raises(onceguard.UnexpectedResponse):
        claims.read(Response(200, content=one))
    with pytest.raises(onceguard.UnexpectedResponse):
        claims.read(Response(200, content=b'{"results":[{"body":{}},{"body":{}}]}'))
    completions = _calls.complete_batch([CompleteItem("ns", "a", 1, 1)])
    with pytest.raises(onceguard.UnexpectedResponse):
        completions.read(Response(200, content=b'{"results":[]}'))
