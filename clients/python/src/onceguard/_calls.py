"""Each API call as data: the request to send and how to read its answer.

The sync :class:`onceguard.Client` and the async :class:`onceguard.AsyncClient` send the same
:class:`Call` values over their own connection pools; building requests and reading answers
happens here, once, with no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Generic, Mapping, Sequence, TypeVar
from urllib.parse import quote


from . import _wire
from ._http import Response
from ._wire import Duration, RawJson
from .errors import OnceguardError, ProblemError, StaleFence, UnexpectedResponse, problem_error
from .models import (
    Acquired,
    ApiKey,
    Approval,
    ApprovalPage,
    AuditEntry,
    AuditPage,
    ClaimAnswer,
    Compensation,
    CompensationClaim,
    CompensationsBusy,
    CompensationsDone,
    CompensationTask,
    Denied,
    InFlight,
    Mismatch,
    PendingApproval,
    Proceed,
    Record,
    RecordPage,
    Replay,
    Rollback,
    Run,
    Settings,
    SettingsEntry,
    Switch,
    SwitchTarget,
    Tripwire,
    Tenant,
)

T = TypeVar("T")

#: Marks an argument that was not given (``None`` is a valid JSON request).
MISSING: Any = type("Missing", (), {"__repr__": lambda self: "MISSING", "__bool__": lambda self: False})()


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and the reader of its answer."""

    method: str
    path: str
    read: Callable[[Response], T]
    params: Mapping[str, str] | None = None
    body: bytes | None = None
    #: Whether sending it twice is harmless, so that a request that may have been sent (a read
    #: timeout, a dropped connection) may be sent again. Claims and fenced calls are, by key and
    #: fence; creating an API key or engaging a switch is not.
    idempotent: bool = True
    #: Seconds the server may legitimately take beyond the usual (a claim's ``wait``).
    extra_time: float = 0.0


# ------------------------------------------------------------------------------------------------
# Reading answers
# ------------------------------------------------------------------------------------------------


def _text(response: Response) -> str:
    return response.content.decode("utf-8", errors="replace")


def problem_of(response: Response) -> dict[str, Any] | None:
    """The problem body of an error answer, or ``None`` if it is not one."""
    media = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media not in ("application/problem+json", "application/json"):
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) and "type" in body else None


def error_of(response: Response) -> OnceguardError:
    """The exception for an answer that is not the call's success."""
    problem = problem_of(response)
    if problem is None:
        return UnexpectedResponse(response.status_code, _text(response))
    return problem_error(problem, response.status_code)


def _expect(response: Response, *ok: int) -> Any:
    if response.status_code in ok:
        return response.json()
    raise error_of(response)


def _retry_after(response: Response, problem: Mapping[str, Any]) -> float | None:
    ms = problem.get("retry_after_ms")
    if isinstance(ms, (int, float)):
        return ms / 1000
    header = response.headers.get("retry-after")
    if header is not None:
        try:
            return float(header)
        except ValueError:
            return None
    return None


def read_claim(response: Response) -> ClaimAnswer:
    """A claim's answer: one of the six, by status for the successes and by problem type."""
    status = response.status_code
    if status == 202:
        return PendingApproval.from_json(response.json(), _retry_after(response, {}))
    if status in (200, 201):
        text = _text(response)
        body = response.json()
        raw = _wire.raw_member(text, "result") if status == 200 and "result" in body else None
        return claim_answer(status, body, raw)
    problem = problem_of(response)
    if problem is None:
        raise UnexpectedResponse(status, _text(response))
    return claim_answer(status, problem, None, _retry_after(response, problem))


#: What enforcement may have answered where observe mode says ``proceed``.
WOULD_HAVE_BEEN = frozenset({"replay", "in_flight", "mismatch", "denied", "pending_approval"})


def claim_answer(status: int, body: Any, raw: bytes | None, retry_after: float | None = None) -> ClaimAnswer:
    """A claim's answer from its status and decoded body (``raw``: a replay's result as sent)."""
    if status == 201:
        return Acquired.from_json(body)
    if status == 200:
        if isinstance(body, dict) and body.get("outcome") == "proceed":
            # Told to run the effect holding nothing: only an observe-mode answer naming a
            # known would-be outcome says so; anything else is refused, never run.
            if body.get("mode") != "observe" or body.get("would_have_been") not in WOULD_HAVE_BEEN:
                raise UnexpectedResponse(status, str(body))
            return Proceed.from_json(body)
        return Replay.from_json(body, raw)
    if status == 202:
        return PendingApproval.from_json(body, retry_after)
    if not isinstance(body, dict) or "type" not in body:
        raise UnexpectedResponse(status, str(body))
    problem: Mapping[str, Any] = body
    if retry_after is None and isinstance(problem.get("retry_after_ms"), (int, float)):
        retry_after = problem["retry_after_ms"] / 1000
    error = problem_error(problem, status)
    assert isinstance(error, ProblemError)
    kind = error.kind
    if kind == "in-flight":
        reason = problem.get("reason")
        attempt = reason.get("attempt") if isinstance(reason, dict) else None
        return InFlight(retry_after=retry_after or 0.0, attempt=attempt, detail=error.detail)
    if kind == "fingerprint-mismatch":
        return Mismatch(detail=error.detail)
    denied = Denied.kind_of(kind)
    if denied is not None:
        reason = problem.get("reason")
        return Denied(
            kind=denied,
            reason=dict(reason) if isinstance(reason, dict) else {"reason": reason},
            retry_after=retry_after,
            detail=error.detail,
            retryable=error.retryable,
        )
    raise error


def read_record(response: Response) -> Record:
    return Record.from_json(_expect(response, 200))


def read_optional_record(response: Response) -> Record | None:
    if response.status_code == 404 and (problem_of(response) or {}).get("type", "").endswith("/not-found"):
        return None
    body = _expect(response, 200)
    raw = _wire.raw_member(_text(response), "stored", "result") if "result" in (body.get("stored") or {}) else None
    return Record.from_json(body, raw)


def read_page(response: Response) -> RecordPage:
    body = _expect(response, 200)
    return RecordPage(records=tuple(Record.from_json(r) for r in body["records"]), next=body.get("next"))


def read_run(response: Response) -> Run:
    return Run.from_json(_expect(response, 200, 201))


def read_optional_run(response: Response) -> Run | None:
    if response.status_code == 404 and (problem_of(response) or {}).get("type", "").endswith("/not-found"):
        return None
    return read_run(response)


def read_rollback(response: Response) -> Rollback:
    return Rollback.from_json(_expect(response, 200, 201))


def read_optional_rollback(response: Response) -> Rollback | None:
    if response.status_code == 404 and (problem_of(response) or {}).get("type", "").endswith("/not-found"):
        return None
    return read_rollback(response)


def read_compensation_claim(response: Response) -> CompensationClaim:
    """A compensation claim's answer: a task (201), ``busy`` or ``done`` (200)."""
    body = _expect(response, 200, 201)
    if response.status_code == 201:
        return CompensationTask.from_json(body)
    outcome = body.get("outcome") if isinstance(body, dict) else None
    if outcome == "busy":
        return CompensationsBusy.from_json(body)
    if outcome == "done":
        return CompensationsDone.from_json(body)
    raise UnexpectedResponse(response.status_code, _text(response))


def read_switch(response: Response) -> Switch:
    return Switch.from_json(_expect(response, 200, 201))


def read_switches(response: Response) -> list[Switch]:
    body = _expect(response, 200)
    items = body["switches"] if isinstance(body, dict) else body
    return [Switch.from_json(s) for s in items]


def read_tripwire(response: Response) -> Tripwire:
    return Tripwire.from_json(_expect(response, 200))


def read_tripwires(response: Response) -> list[Tripwire]:
    body = _expect(response, 200)
    return [Tripwire.from_json(t) for t in (body["tripwires"] if isinstance(body, dict) else body)]


def read_settings_entry(response: Response) -> SettingsEntry:
    return SettingsEntry.from_json(_expect(response, 200, 201))


def read_settings_list(response: Response) -> list[SettingsEntry]:
    body = _expect(response, 200)
    return [SettingsEntry.from_json(e) for e in (body["settings"] if isinstance(body, dict) else body)]


def read_audit(response: Response) -> AuditPage:
    body = _expect(response, 200)
    return AuditPage(entries=tuple(AuditEntry.from_json(e) for e in body["entries"]), next=body.get("next"))


def read_approval(response: Response) -> Approval:
    return Approval.from_json(_expect(response, 200))


def read_optional_approval(response: Response) -> Approval | None:
    if response.status_code == 404 and (problem_of(response) or {}).get("type", "").endswith("/not-found"):
        return None
    return read_approval(response)


def read_approvals(response: Response) -> ApprovalPage:
    body = _expect(response, 200)
    return ApprovalPage(approvals=tuple(Approval.from_json(a) for a in body["approvals"]), next=body.get("next"))


def read_api_key(response: Response) -> ApiKey:
    return ApiKey.from_json(_expect(response, 200, 201))


def read_api_keys(response: Response) -> list[ApiKey]:
    return [ApiKey.from_json(k) for k in _expect(response, 200)]


def read_tenant(response: Response) -> Tenant:
    return Tenant.from_json(_expect(response, 200, 201))


def read_tenants(response: Response) -> list[Tenant]:
    return [Tenant.from_json(t) for t in _expect(response, 200)]


def read_purged(response: Response) -> bool:
    return bool(_expect(response, 200)["purged"])


def read_nothing(response: Response) -> None:
    if response.status_code not in (200, 204):
        raise error_of(response)


def read_ready(response: Response) -> bool:
    return response.status_code == 200


# ------------------------------------------------------------------------------------------------
# Building requests
# ------------------------------------------------------------------------------------------------


def _opt_duration(value: Duration | None) -> str | None:
    return None if value is None else _wire.format_duration(value)


def _query(**params: Any) -> dict[str, str]:
    out = {}
    for name, value in params.items():
        if value is None:
            continue
        out[name] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return out


def _units(value: int | None, what: str = "cost", unit: str = "cost units") -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{what} is a whole number of {unit}, at least 0")
    return value


def _cost(cost: int | None) -> int | None:
    return _units(cost)


def _tokens(tokens: int | None) -> int | None:
    return _units(tokens, "tokens", "model tokens")


def claim(
    namespace: str,
    key: str,
    *,
    request: Any = MISSING,
    fingerprint: str | None = None,
    lease: Duration | None = None,
    retention: Duration | None = None,
    run: str | None = None,
    wait: Duration | None = None,
    cost: int | None = None,
    summary: str | None = None,
    verify_hook: bool = False,
) -> Call[ClaimAnswer]:
    if (request is MISSING) == (fingerprint is None):
        raise ValueError("give exactly one of 'request' (the request's meaning as JSON) and 'fingerprint'")
    fields: dict[str, Any] = {"namespace": namespace, "key": key}
    if request is not MISSING:
        fields["request"] = RawJson("null") if request is None else request
    fields.update(
        fingerprint=fingerprint,
        lease=_opt_duration(lease),
        retention=_opt_duration(retention),
        run=run,
        wait=_opt_duration(wait),
        cost=_cost(cost),
        summary=summary,
        verify_hook=True if verify_hook else None,
    )
    extra = 0.0 if wait is None else _wire.duration_seconds(wait)
    return Call("POST", "/v1/claims", read_claim, body=_wire.body(fields), extra_time=extra)


def _fenced(op: str, namespace: str, key: str, fence: int, **fields: Any) -> Call[Record]:
    body = _wire.body({"namespace": namespace, "key": key, "fence": fence, **fields})
    return Call("POST", f"/v1/claims/{op}", read_record, body=body)


def complete(
    namespace: str,
    key: str,
    fence: int,
    result: Any = None,
    *,
    raw: bytes | None = None,
    content_type: str | None = None,
    cost: int | None = None,
    tokens: int | None = None,
    reconciled: bool = False,
    compensation: Compensation | tuple[str, Any] | None = None,
) -> Call[Record]:
    flag = True if reconciled else None  # absent unless set: the body of a plain completion is as before
    undo = compensation_member(compensation)
    if raw is not None:
        import base64

        return _fenced(
            "complete",
            namespace,
            key,
            fence,
            result_base64=base64.b64encode(raw).decode("ascii"),
            content_type=content_type or "application/octet-stream",
            cost=_cost(cost),
            tokens=_tokens(tokens),
            reconciled=flag,
            compensation=undo,
        )
    if content_type is not None and content_type != "application/json":
        raise ValueError("a 'result' is JSON; send other media types as raw bytes with content_type")
    return _fenced(
        "complete",
        namespace,
        key,
        fence,
        result=RawJson("null") if result is None else result,
        cost=_cost(cost),
        tokens=_tokens(tokens),
        reconciled=flag,
        compensation=undo,
    )


def compensation_member(compensation: Compensation | tuple[str, Any] | None) -> RawJson | None:
    """The ``compensation`` member of a completion: ``{"name": …, "data": …}``, a ``RawJson``
    ``data`` spliced verbatim."""
    if compensation is None:
        return None
    if not isinstance(compensation, Compensation):
        name, data = compensation
        compensation = Compensation(name, data)
    data = compensation.data
    text = data.text if isinstance(data, RawJson) else _wire.dumps(data)
    return RawJson(f'{{"name":{_wire.dumps(compensation.name)},"data":{text}}}')


def fail(
    namespace: str,
    key: str,
    fence: int,
    *,
    retryable: bool,
    error: Any = None,
    cost: int | None = None,
    tokens: int | None = None,
) -> Call[Record]:
    return _fenced(
        "fail", namespace, key, fence, retryable=retryable, error=error, cost=_cost(cost), tokens=_tokens(tokens)
    )


def extend(namespace: str, key: str, fence: int, lease: Duration | None = None) -> Call[Record]:
    return _fenced("extend", namespace, key, fence, lease=_opt_duration(lease))


def checkpoint(namespace: str, key: str, fence: int, name: str, data: Any = None) -> Call[Record]:
    return _fenced("checkpoint", namespace, key, fence, name=name, data=data)


def report_unknown(namespace: str, key: str, fence: int, detail: str) -> Call[Record]:
    return _fenced("report-unknown", namespace, key, fence, detail=detail)


def get_record(namespace: str, key: str) -> Call[Record | None]:
    return Call("GET", "/v1/record", read_optional_record, params=_query(namespace=namespace, key=key))


def list_records(
    *,
    namespace_prefix: str | None = None,
    state: str | None = None,
    stuck: bool | None = None,
    run: str | None = None,
    limit: int | None = None,
    cursor: str | None = None,
) -> Call[RecordPage]:
    params = _query(
        namespace_prefix=namespace_prefix, state=state, stuck=stuck, run=run, limit=limit, cursor=cursor
    )
    return Call("GET", "/v1/records", read_page, params=params)


def purge(namespace: str, key: str, why: str | None = None) -> Call[bool]:
    return Call("DELETE", "/v1/record", read_purged, params=_query(namespace=namespace, key=key, why=why))


def _run_path(run: str) -> str:
    return "/v1/runs/" + quote(run, safe="")


def set_run_budget(
    run: str,
    *,
    max_effects: int | None = None,
    max_cost: int | None = None,
    deadline: datetime | str | None = None,
    why: str | None = None,
    tenant: str | None = None,
) -> Call[Run]:
    fields = {
        "max_effects": max_effects,
        "max_cost": max_cost,
        "deadline": None if deadline is None else _wire.format_time(deadline),
        "why": why,
    }
    return Call("PUT", _run_path(run), read_run, params=_query(tenant=tenant), body=_wire.body(fields))


def get_run(run: str) -> Call[Run | None]:
    return Call("GET", _run_path(run), read_optional_run)


def rollback(run: str, why: str, tenant: str | None = None) -> Call[Rollback]:
    # Starting a started rollback answers the one under way: sending it again is harmless.
    path = _run_path(run) + "/rollback"
    return Call("POST", path, read_rollback, params=_query(tenant=tenant), body=_wire.body({"why": why}))


def rollback_status(run: str) -> Call[Rollback | None]:
    return Call("GET", _run_path(run) + "/rollback", read_optional_rollback)


def claim_compensation(run: str, lease: Duration | None = None) -> Call[CompensationClaim]:
    # As for a claim: a task whose answer was lost stays held until its lease passes, then the
    # next claim recovers it.
    body = _wire.body({"lease": _opt_duration(lease)})
    return Call("POST", _run_path(run) + "/compensations/claim", read_compensation_claim, body=body)


def _target(target: SwitchTarget | Mapping[str, Any]) -> dict[str, Any]:
    return target.to_json() if isinstance(target, SwitchTarget) else dict(target)


def engage_switch(
    target: SwitchTarget | Mapping[str, Any], reason: str, *, revoke_leases: bool = False, tenant: str | None = None
) -> Call[Switch]:
    fields = {"target": _target(target), "reason": reason, "revoke_leases": revoke_leases, "tenant": tenant}
    # Engaging an engaged switch replaces its reason: sending it again is harmless.
    return Call("POST", "/v1/switches", read_switch, body=_wire.body(fields))


def release_switch(
    target: SwitchTarget | Mapping[str, Any], why: str | None = None, *, tenant: str | None = None
) -> Call[Switch]:
    body = _wire.body({"target": _target(target), "why": why, "tenant": tenant})
    # Not sent twice: a release whose answer was lost would answer 404 the second time.
    return Call("POST", "/v1/switches/release", read_switch, body=body, idempotent=False)


def list_switches(tenant: str | None = None) -> Call[list[Switch]]:
    return Call("GET", "/v1/switches", read_switches, params=_query(tenant=tenant))


def put_settings(
    settings: Settings | Mapping[str, Any],
    *,
    namespace_prefix: str | None = None,
    why: str | None = None,
    tenant: str | None = None,
) -> Call[SettingsEntry]:
    fields = {
        "namespace_prefix": namespace_prefix,
        "settings": settings.to_json() if isinstance(settings, Settings) else dict(settings),
        "why": why,
        "tenant": tenant,
    }
    return Call("PUT", "/v1/settings", read_settings_entry, body=_wire.body(fields))


def list_settings(tenant: str | None = None) -> Call[list[SettingsEntry]]:
    return Call("GET", "/v1/settings", read_settings_list, params=_query(tenant=tenant))


def delete_settings(
    *, namespace_prefix: str | None = None, why: str | None = None, tenant: str | None = None
) -> Call[SettingsEntry]:
    params = _query(namespace_prefix=namespace_prefix, why=why, tenant=tenant)
    return Call("DELETE", "/v1/settings", read_settings_entry, params=params)


def put_tripwire(
    name: str,
    symptom: Mapping[str, Any],
    *,
    window: Duration,
    min_calls: int,
    prefix: str | None = None,
    per: str = "namespace",
    action: str | None = None,
    revoke_leases: bool = False,
    rollback: bool = False,
    auto_release_after: Duration | None = None,
    why: str | None = None,
    tenant: str | None = None,
) -> Call[Tripwire]:
    fields = {
        "name": name,
        "prefix": prefix,
        "symptom": dict(symptom),
        "window": _wire.format_duration(window),
        "min_calls": min_calls,
        "per": per,
        "action": action,  # sent only when given: a server of an earlier version knows no action
        "revoke_leases": revoke_leases,
        "rollback": rollback,
        "auto_release_after": _opt_duration(auto_release_after),
        "why": why,
        "tenant": tenant,
    }
    return Call("PUT", "/v1/tripwires", read_tripwire, body=_wire.body(fields))


def list_tripwires(tenant: str | None = None) -> Call[list[Tripwire]]:
    return Call("GET", "/v1/tripwires", read_tripwires, params=_query(tenant=tenant))


def delete_tripwire(name: str, *, why: str | None = None, tenant: str | None = None) -> Call[Tripwire]:
    params = _query(name=name, why=why, tenant=tenant)
    # Not sent twice: a deletion whose answer was lost would answer 404 the second time.
    return Call("DELETE", "/v1/tripwires", read_tripwire, params=params, idempotent=False)


def list_audit(
    *,
    action: str | None = None,
    actor: str | None = None,
    limit: int | None = None,
    cursor: str | None = None,
    tenant: str | None = None,
) -> Call[AuditPage]:
    params = _query(action=action, actor=actor, limit=limit, cursor=cursor, tenant=tenant)
    return Call("GET", "/v1/audit", read_audit, params=params)


def _approval_path(approval_id: str, action: str = "") -> str:
    return "/v1/approvals/" + quote(approval_id, safe="") + (f"/{action}" if action else "")


def list_approvals(*, state: str | None = None, limit: int | None = None, cursor: str | None = None) -> Call[ApprovalPage]:
    return Call("GET", "/v1/approvals", read_approvals, params=_query(state=state, limit=limit, cursor=cursor))


def get_approval(approval_id: str) -> Call[Approval | None]:
    return Call("GET", _approval_path(approval_id), read_optional_approval)


def decide_approval(approval_id: str, *, approve: bool, why: str) -> Call[Approval]:
    body = _wire.body({"why": why})
    # Not sent twice: a decision whose answer was lost would answer approval-closed the second time.
    path = _approval_path(approval_id, "approve" if approve else "deny")
    return Call("POST", path, read_approval, body=body, idempotent=False)


def reconcile_approval(approval_id: str, *, why: str, result: Any = None) -> Call[Approval]:
    body = _wire.body({"why": why, "result": RawJson("null") if result is None else result})
    # Not sent twice, as a decision is not.
    return Call("POST", _approval_path(approval_id, "reconcile"), read_approval, body=body, idempotent=False)


def create_api_key(role: str, label: str = "", tenant: str | None = None) -> Call[ApiKey]:
    body = _wire.body({"role": role, "label": label, "tenant": tenant})
    return Call("POST", "/v1/api-keys", read_api_key, body=body, idempotent=False)


def list_api_keys() -> Call[list[ApiKey]]:
    return Call("GET", "/v1/api-keys", read_api_keys)


def revoke_api_key(key_id: str) -> Call[None]:
    return Call("DELETE", "/v1/api-keys/" + quote(key_id, safe=""), read_nothing)


def create_tenant(tenant_id: str) -> Call[Tenant]:
    return Call("POST", "/v1/tenants", read_tenant, body=_wire.body({"id": tenant_id}), idempotent=False)


def list_tenants() -> Call[list[Tenant]]:
    return Call("GET", "/v1/tenants", read_tenants)


def ready() -> Call[bool]:
    return Call("GET", "/readyz", read_ready)


@dataclass(frozen=True)
class ClaimItem:
    """One claim of :meth:`Client.claim_batch`: the arguments of :meth:`Client.claim` (a batch
    never waits)."""

    namespace: str
    key: str
    request: Any = field(default=MISSING)
    fingerprint: str | None = None
    lease: Duration | None = None
    retention: Duration | None = None
    run: str | None = None
    cost: int | None = None
    summary: str | None = None


@dataclass(frozen=True)
class CompleteItem:
    """One completion of :meth:`Client.complete_batch`: the arguments of :meth:`Client.complete`."""

    namespace: str
    key: str
    fence: int
    result: Any = None
    raw: bytes | None = None
    content_type: str | None = None
    cost: int | None = None
    tokens: int | None = None
    reconciled: bool = False
    compensation: Compensation | tuple[str, Any] | None = None


def _batch_results(response: Response, sent: int) -> tuple[str, list[tuple[int, Any]]]:
    """The text of a batch's answer and each of its ``sent`` items' status and body, or the
    error that refused it. An answer of another shape or with another number of items is
    :class:`UnexpectedResponse`, never read as the answers of other items."""
    text = _text(response)
    if response.status_code != 200:
        raise error_of(response)
    try:
        results = json.loads(text)["results"]
        items = [(int(item["status"]), item["body"]) for item in results]
    except (KeyError, TypeError, ValueError) as e:
        raise UnexpectedResponse(response.status_code, text) from e
    if len(items) != sent:
        raise UnexpectedResponse(response.status_code, text)
    return text, items


def _read_claim_batch(response: Response, sent: int) -> list[ClaimAnswer]:
    """Each claim's answer, read from its status and body; a replay's result is cut out of the
    answer's text, where the server wrote its stored bytes."""
    text, items = _batch_results(response, sent)
    return [claim_answer(status, body, raw) for (status, body), raw in zip(items, _raw_results(text, items))]


_RESULT_MEMBER = '"result":'


def _raw_results(text: str, items: list[tuple[int, Any]]) -> list[bytes | None]:
    """Each replay's stored result as the server wrote it in ``text``; ``None`` for the others,
    among them a replay that has only a ``result_digest`` (its namespace keeps no bytes).

    The server writes each view compactly with its members in a fixed order: in a replay's view
    the stored result is the first member named ``result``, and nothing before it is raw JSON
    (strings escape their quotes). So when no item is an acquisition (whose recovery carries a
    checkpoint's data, raw JSON that could hold that name), the results are found by searching
    the text in order, each checked against the decoded answer; otherwise, or if a check
    fails, each item's members are read one by one."""
    wanted = [status == 200 and isinstance(body, dict) and "result" in body for status, body in items]
    if not any(wanted):
        return [None] * len(items)
    if all(status != 201 for status, _ in items):
        found = _search_results(text, items, wanted)
        if found is not None:
            return found
    spans = _wire.element_spans(text, _wire.member_spans(text)["results"][0])
    raws: list[bytes | None] = []
    for (start, end), want in zip(spans, wanted):
        if not want:
            raws.append(None)
            continue
        item_text = text[start:end]
        body_span = _wire.member_spans(item_text)["body"]
        raws.append(_wire.raw_member(item_text[body_span[0] : body_span[1]], "result"))
    return raws


def _search_results(text: str, items: list[tuple[int, Any]], wanted: list[bool]) -> list[bytes | None] | None:
    raws: list[bytes | None] = []
    at = 0
    for (_, body), want in zip(items, wanted):
        if not want:
            raws.append(None)
            continue
        at = text.find(_RESULT_MEMBER, at)
        if at < 0:
            return None
        start = at + len(_RESULT_MEMBER)
        value, at = _wire.DECODER.raw_decode(text, start)
        if value != body["result"]:
            return None
        raws.append(text[start:at].encode("utf-8"))
    return raws


def _read_complete_batch(response: Response, sent: int) -> list[Record | StaleFence]:
    _, items = _batch_results(response, sent)
    answers: list[Record | StaleFence] = []
    for status, body in items:
        if status == 200:
            answers.append(Record.from_json(body))
            continue
        error = problem_error(body, status) if isinstance(body, dict) else UnexpectedResponse(status, str(body))
        if isinstance(error, StaleFence):
            answers.append(error)
        else:
            raise error
    return answers


def claim_batch(items: Sequence[ClaimItem]) -> Call[list[ClaimAnswer]]:
    parts = [
        claim(
            i.namespace,
            i.key,
            request=i.request,
            fingerprint=i.fingerprint,
            lease=i.lease,
            retention=i.retention,
            run=i.run,
            cost=i.cost,
            summary=i.summary,
        ).body
        or b"{}"
        for i in items
    ]
    body = b'{"claims":[' + b",".join(parts) + b"]}"
    return Call("POST", "/v1/claims/batch", lambda r: _read_claim_batch(r, len(parts)), body=body)


def complete_batch(items: Sequence[CompleteItem]) -> Call[list[Record | StaleFence]]:
    parts = [
        complete(
            i.namespace,
            i.key,
            i.fence,
            i.result,
            raw=i.raw,
            content_type=i.content_type,
            cost=i.cost,
            tokens=i.tokens,
            reconciled=i.reconciled,
            compensation=i.compensation,
        ).body
        or b"{}"
        for i in items
    ]
    body = b'{"completions":[' + b",".join(parts) + b"]}"
    return Call("POST", "/v1/claims/complete/batch", lambda r: _read_complete_batch(r, len(parts)), body=body)
