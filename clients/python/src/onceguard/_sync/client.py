# Generated from src/onceguard/_async/client.py by `python scripts/unasync.py` (in clients/python).
# Do not edit it: change the async source and run the script again.
""":class:`Client`: every call of the HTTP API, sent through one keep-alive connection pool
with the retries of :class:`onceguard.Retry` (which calls may be sent again: see
:mod:`onceguard.client`)."""

from __future__ import annotations

import logging
from datetime import datetime
from types import TracebackType
from typing import Any, Iterator, Mapping, Sequence, TypeVar

from .. import _calls
from .._calls import MISSING, Call, ClaimItem, CompleteItem
from .._http import (
    JSON_BODY,
    NO_RETRY,
    ClientBase,
    MaybeSent,
    NotSent,
    Retry,
    Timeout,
    headers_of,
    may_retry,
    retry_after_header,
    with_extra,
)
from .._wire import Duration
from ..errors import StaleFence, TransportError
from ..models import (
    ApiKey,
    Approval,
    ApprovalPage,
    AuditEntry,
    AuditPage,
    ClaimAnswer,
    Compensation,
    CompensationClaim,
    Record,
    RecordPage,
    Rollback,
    Run,
    Settings,
    SettingsEntry,
    Switch,
    SwitchTarget,
    Tenant,
    Tripwire,
)
from . import _backend

__all__ = ["Client"]

T = TypeVar("T")
log = logging.getLogger("onceguard")


class Client(ClientBase):
    """The sync client. Use it as a context manager, or call :meth:`close`.

    ``base_url`` defaults to ``$ONCEGUARD_URL`` (else ``http://127.0.0.1:8080``), ``api_key`` to
    ``$ONCEGUARD_API_KEY``. ``timeout`` is seconds per read of an answer (a claim that waits
    gets its ``wait`` on top; connecting takes at most 5 s of it) or a :class:`Timeout`.
    ``max_connections`` bounds the keep-alive connections to the server; ``verify`` is whether
    to check an ``https`` server's certificate, or the file of the CA that signed it.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float | Timeout = 10.0,
        retry: Retry = Retry(),
        headers: Mapping[str, str] | None = None,
        max_connections: int = 100,
        verify: bool | str = True,
    ) -> None:
        super().__init__(base_url, api_key, timeout, retry)
        self._transport = _backend.Transport(
            self.base_url, headers_of(self.api_key, headers), max_connections=max_connections, verify=verify
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection pool."""
        self._transport.close()

    def send(self, call: Call[T], *, retry: Retry | None = None) -> T:
        """Send one call, retrying as the client's :class:`Retry` (or ``retry``) allows."""
        policy = retry or self.retry
        timeout = with_extra(self.timeout, call.extra_time)
        headers = JSON_BODY if call.body is not None else None
        tries = 0
        while True:
            tries += 1
            try:
                response = self._transport.send(
                    call.method, call.path, call.params, call.body, headers, timeout, idempotent=call.idempotent
                )
            except (NotSent, MaybeSent) as e:
                if tries < policy.attempts and may_retry(e, call.idempotent):
                    delay = policy.delay(tries)
                    log.debug("onceguard: %s %s failed (%r); retry %d in %.2fs", call.method, call.path, e, tries, delay)
                    _backend.sleep(delay)
                    continue
                raise TransportError(
                    f"{call.method} {self.base_url}{call.path} failed after {tries} tries: {e!r}",
                    attempts=tries,
                    maybe_sent=isinstance(e, MaybeSent),
                ) from e.__cause__
            if response.status_code == 503 and tries < policy.attempts:
                delay = policy.delay(tries, retry_after_header(response))
                log.debug("onceguard: %s %s answered 503; retry %d in %.2fs", call.method, call.path, tries, delay)
                _backend.sleep(delay)
                continue
            return call.read(response)

    # -- claims ----------------------------------------------------------------------------------

    def claim(
        self,
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
    ) -> ClaimAnswer:
        """Claim a key: one atomic step answering :class:`Acquired`, :class:`Replay`,
        :class:`InFlight`, :class:`Mismatch`, :class:`Denied` or :class:`PendingApproval`; in a
        namespace in observe mode, :class:`Proceed` where enforcing would not have let the call
        run (do the effect; nothing is held, so neither complete nor fail it).

        Give ``request`` (what the request means, any JSON: its fingerprint is the SHA-256 of its
        RFC 8785 canonical form) or ``fingerprint`` (``algorithm:hex``). ``lease`` (default 30s),
        ``retention`` (default 24h) and ``wait`` (if in flight, wait up to this long for its
        replay; if pending approval, for the decision; at most 30s) are durations. ``run``
        groups the key for budgets; ``cost`` declares the cost units charged to the run once per
        key. ``summary`` (at most 1,024 bytes, no control characters but newlines) says what the
        call does, for the approver of a namespace that requires approval. ``verify_hook=True``
        says you check, on a recovery, whether the unfinished attempt's effect happened before
        running it again: where the namespace's recovery policy is ``verify``, only such a claim
        takes over a key whose last attempt did not finish (others are :class:`Denied`, kind
        ``recovery``).
        """
        return self.send(
            _calls.claim(
                namespace,
                key,
                request=request,
                fingerprint=fingerprint,
                lease=lease,
                retention=retention,
                run=run,
                wait=wait,
                cost=cost,
                summary=summary,
                verify_hook=verify_hook,
            )
        )

    def complete(
        self,
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
    ) -> Record:
        """Store a successful outcome: ``result`` (JSON; a :class:`RawJson` is sent verbatim) or
        ``raw`` bytes with their ``content_type``. Every later claim replays it byte for byte.
        ``cost`` (cost units, charged to the run) and ``tokens`` (model tokens) say what the
        effect cost; every replay counts them as saved.

        ``compensation``: how to undo the effect, a :class:`Compensation` or a ``(name, data)``
        pair (a name of 1 to 128 bytes of printable ASCII, any JSON data of at most 16 KiB),
        stored with the outcome: when the run is rolled back, a worker runs it
        (:func:`onceguard.run_compensations`).

        ``reconciled=True``: a recovering attempt (attempt 2 or later) stores what the
        downstream system says happened, without running the effect; the record and every
        replay say ``reconciled``. On attempt 1 it raises :class:`onceguard.InvalidRequest`.

        Raises :class:`onceguard.StaleFence` if ``fence`` is not the holder's (nothing stored).
        Repeating a completion that took effect, identically, answers as the first time.
        """
        return self.send(
            _calls.complete(
                namespace,
                key,
                fence,
                result,
                raw=raw,
                content_type=content_type,
                cost=cost,
                tokens=tokens,
                reconciled=reconciled,
                compensation=compensation,
            )
        )

    def claim_batch(self, items: Sequence[ClaimItem]) -> list[ClaimAnswer]:
        """Claim many keys in one request (at most the server's ``limits.max_batch``, 1,000 by
        default): each answered exactly as :meth:`claim` answers it alone, in order. A key given
        twice is :class:`InFlight` the second time. An invalid item refuses the whole batch
        (:class:`onceguard.InvalidRequest`) before anything is decided."""
        return self.send(_calls.claim_batch(items))

    def complete_batch(self, items: Sequence[CompleteItem]) -> list[Record | StaleFence]:
        """Store many outcomes in one request, each as :meth:`complete` alone, in order: the
        record, or for a completion with a stale fence (nothing stored) the
        :class:`onceguard.StaleFence` that :meth:`complete` would have raised."""
        return self.send(_calls.complete_batch(items))

    def fail(
        self,
        namespace: str,
        key: str,
        fence: int,
        *,
        retryable: bool,
        error: Any = None,
        cost: int | None = None,
        tokens: int | None = None,
    ) -> Record:
        """Report a failure: ``retryable=True`` releases the key (the next claim runs again);
        ``False`` stores ``error`` (JSON) as a failure that replays. Raises ``StaleFence``."""
        call = _calls.fail(namespace, key, fence, retryable=retryable, error=error, cost=cost, tokens=tokens)
        return self.send(call)

    def extend(self, namespace: str, key: str, fence: int, lease: Duration | None = None) -> Record:
        """Push the lease out to now + ``lease``. Raises ``StaleFence``."""
        return self.send(_calls.extend(namespace, key, fence, lease))

    def checkpoint(self, namespace: str, key: str, fence: int, name: str, data: Any = None) -> Record:
        """Save a named recovery point with small JSON ``data``; a recovering attempt receives the
        last one in ``Acquired.recovery.last_checkpoint``. Raises ``StaleFence``."""
        return self.send(_calls.checkpoint(namespace, key, fence, name, data))

    def report_unknown(self, namespace: str, key: str, fence: int, detail: str) -> Record:
        """You do not know whether the effect happened: your lease ends now and the next claim is
        a recovery carrying ``detail``. Raises ``StaleFence``."""
        return self.send(_calls.report_unknown(namespace, key, fence, detail))

    # -- records ---------------------------------------------------------------------------------

    def get_record(self, namespace: str, key: str) -> Record | None:
        """One live record with its stored outcome, or ``None``."""
        return self.send(_calls.get_record(namespace, key))

    def list_records(
        self,
        *,
        namespace_prefix: str | None = None,
        state: str | None = None,
        stuck: bool | None = None,
        run: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> RecordPage:
        """One page of records by namespace and key; see :meth:`iter_records` for all of them."""
        return self.send(
            _calls.list_records(
                namespace_prefix=namespace_prefix, state=state, stuck=stuck, run=run, limit=limit, cursor=cursor
            )
        )

    def iter_records(
        self,
        *,
        namespace_prefix: str | None = None,
        state: str | None = None,
        stuck: bool | None = None,
        run: str | None = None,
        page_size: int = 100,
    ) -> Iterator[Record]:
        """Every matching record, fetching pages through the cursor as it goes."""
        cursor: str | None = None
        while True:
            page = self.list_records(
                namespace_prefix=namespace_prefix, state=state, stuck=stuck, run=run, limit=page_size, cursor=cursor
            )
            for record in page.records:
                yield record
            if not page.next:
                return
            cursor = page.next

    def purge(self, namespace: str, key: str, *, why: str | None = None) -> bool:
        """Delete a record whatever its state (admin; audited with ``why``); ``True`` if one
        existed. The next claim of the key runs again, with a greater fence."""
        return self.send(_calls.purge(namespace, key, why))

    # -- runs, switches, settings, audit ---------------------------------------------------------

    def set_run_budget(
        self,
        run: str,
        *,
        max_effects: int | None = None,
        max_cost: int | None = None,
        deadline: datetime | str | None = None,
        why: str | None = None,
        tenant: str | None = None,
    ) -> Run:
        """Set a run's budget (admin): at most ``max_effects`` acquired keys, ``max_cost`` cost
        units, until ``deadline`` (absent limits do not limit; the run keeps what it spent).
        Spent, claims of the run answer :class:`Denied` (``budget``)."""
        return self.send(
            _calls.set_run_budget(
                run, max_effects=max_effects, max_cost=max_cost, deadline=deadline, why=why, tenant=tenant
            )
        )

    def get_run(self, run: str) -> Run | None:
        """A run's budget, usage and rollback, or ``None`` if it was never used nor budgeted."""
        return self.send(_calls.get_run(run))

    # -- rollbacks -------------------------------------------------------------------------------

    def rollback(self, run: str, why: str, *, tenant: str | None = None) -> Rollback:
        """Start rolling a run back (admin; ``why`` is kept): a kill switch is engaged on the
        run (its new claims are denied), and each of its completed effects that registered a
        compensation becomes a task for the workers (:func:`onceguard.run_compensations`),
        newest effect first. A run already being rolled back answers its rollback as it stands."""
        return self.send(_calls.rollback(run, why, tenant))

    def rollback_status(self, run: str) -> Rollback | None:
        """A run's rollback with its tasks, newest effect first, or ``None`` if the run is not
        being rolled back."""
        return self.send(_calls.rollback_status(run))

    def claim_compensation(self, run: str, lease: Duration | None = None) -> CompensationClaim:
        """Take the next compensation of a run being rolled back: a :class:`CompensationTask`
        to run and then complete or fail with its ``fence`` (like an acquired claim of its
        key), :class:`CompensationsBusy` (other workers hold the rest; ask again after
        ``retry_after``) or :class:`CompensationsDone`. ``lease`` as for :meth:`claim`. Raises
        :class:`onceguard.NotFound` if the run is not being rolled back."""
        return self.send(_calls.claim_compensation(run, lease))

    def engage_switch(
        self,
        target: SwitchTarget | Mapping[str, Any],
        reason: str,
        *,
        revoke_leases: bool = False,
        tenant: str | None = None,
    ) -> Switch:
        """Engage a kill switch (admin): claims under ``target`` are denied (replays included);
        with ``revoke_leases`` the live leases it covers are revoked, so that their holders'
        later calls answer stale. Engaging an engaged switch replaces its reason."""
        return self.send(_calls.engage_switch(target, reason, revoke_leases=revoke_leases, tenant=tenant))

    def release_switch(
        self, target: SwitchTarget | Mapping[str, Any], why: str | None = None, *, tenant: str | None = None
    ) -> Switch:
        """Release an engaged switch (admin); raises :class:`onceguard.NotFound` if none is."""
        return self.send(_calls.release_switch(target, why, tenant=tenant))

    def list_switches(self, *, tenant: str | None = None) -> list[Switch]:
        """The engaged switches."""
        return self.send(_calls.list_switches(tenant))

    def put_settings(
        self,
        settings: Settings | Mapping[str, Any],
        *,
        namespace_prefix: str | None = None,
        why: str | None = None,
        tenant: str | None = None,
    ) -> SettingsEntry:
        """Set (replace) the settings of the tenant, or of ``namespace_prefix`` (admin), e.g.
        ``Settings(mode="observe")``."""
        return self.send(_calls.put_settings(settings, namespace_prefix=namespace_prefix, why=why, tenant=tenant))

    def list_settings(self, *, tenant: str | None = None) -> list[SettingsEntry]:
        """The tenant's settings (its own entry first), admin."""
        return self.send(_calls.list_settings(tenant))

    def delete_settings(
        self, *, namespace_prefix: str | None = None, why: str | None = None, tenant: str | None = None
    ) -> SettingsEntry:
        """Delete settings (admin): what they set is inherited again. ``NotFound`` if none."""
        return self.send(_calls.delete_settings(namespace_prefix=namespace_prefix, why=why, tenant=tenant))

    def put_tripwire(
        self,
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
    ) -> Tripwire:
        """Set (replace) a tripwire rule (admin): it engages a kill switch by itself when
        ``symptom`` crosses its threshold over ``window`` on at least ``min_calls`` calls, e.g.
        ``put_tripwire("runaway", {"kind": "failure_rate", "above": 0.2}, window="5m",
        min_calls=20, prefix="agents", per="run")``. Symptoms: ``failure_rate`` (``above``),
        ``latency`` (``quantile``, ``above_ms``), ``spend`` (``unit`` cost or tokens,
        ``per_minute``), ``mismatches`` (``per_minute``). With ``action="observe"`` (and
        ``per="namespace"``) it turns its prefix to observe mode instead, over any canary in it,
        until a person sets the prefix's settings again."""
        call = _calls.put_tripwire(
            name,
            symptom,
            window=window,
            min_calls=min_calls,
            prefix=prefix,
            per=per,
            action=action,
            revoke_leases=revoke_leases,
            rollback=rollback,
            auto_release_after=auto_release_after,
            why=why,
            tenant=tenant,
        )
        return self.send(call)

    def list_tripwires(self, *, tenant: str | None = None) -> list[Tripwire]:
        """The tenant's tripwire rules, by name (admin)."""
        return self.send(_calls.list_tripwires(tenant))

    def delete_tripwire(self, name: str, *, why: str | None = None, tenant: str | None = None) -> Tripwire:
        """Delete a tripwire rule (admin); a switch it engaged stays until released. ``NotFound``
        if there is none."""
        return self.send(_calls.delete_tripwire(name, why=why, tenant=tenant))

    def list_audit(
        self,
        *,
        action: str | None = None,
        actor: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        tenant: str | None = None,
    ) -> AuditPage:
        """One page of the audit log (admin), newest first."""
        return self.send(_calls.list_audit(action=action, actor=actor, limit=limit, cursor=cursor, tenant=tenant))

    def iter_audit(
        self, *, action: str | None = None, actor: str | None = None, page_size: int = 100, tenant: str | None = None
    ) -> Iterator[AuditEntry]:
        """Every matching audit entry, newest first, through the cursor."""
        cursor: str | None = None
        while True:
            page = self.list_audit(action=action, actor=actor, limit=page_size, cursor=cursor, tenant=tenant)
            for entry in page.entries:
                yield entry
            if not page.next:
                return
            cursor = page.next

    # -- approvals -------------------------------------------------------------------------------

    def list_approvals(
        self, *, state: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> ApprovalPage:
        """One page of the tenant's approvals (``state``: ``pending``, ``approved`` or
        ``denied``); see :meth:`iter_approvals` for all of them."""
        return self.send(_calls.list_approvals(state=state, limit=limit, cursor=cursor))

    def iter_approvals(self, *, state: str | None = None, page_size: int = 100) -> Iterator[Approval]:
        """Every matching approval, fetching pages through the cursor as it goes."""
        cursor: str | None = None
        while True:
            page = self.list_approvals(state=state, limit=page_size, cursor=cursor)
            for approval in page.approvals:
                yield approval
            if not page.next:
                return
            cursor = page.next

    def get_approval(self, approval_id: str) -> Approval | None:
        """One approval, or ``None`` if there is none with this id."""
        return self.send(_calls.get_approval(approval_id))

    def approve(self, approval_id: str, *, why: str) -> Approval:
        """Approve a pending call (admin; ``why``, 1 to 1,024 bytes, is kept with the decision
        and in the audit log): the next claim of its key with its request acquires, once.
        Raises :class:`onceguard.ApprovalClosed` if it was decided already or expired, and
        :class:`onceguard.NotFound` for an unknown id. Not sent twice after a lost answer."""
        return self.send(_calls.decide_approval(approval_id, approve=True, why=why))

    def deny(self, approval_id: str, *, why: str) -> Approval:
        """Deny a pending call (admin): every claim of its key with its request is refused
        (:class:`onceguard.Denied`, ``approval``). Raises as :meth:`approve`."""
        return self.send(_calls.decide_approval(approval_id, approve=False, why=why))

    def reconcile(self, approval_id: str, *, why: str, result: Any = None) -> Approval:
        """Mark a pending approval of a recovery done (admin; recovery policy ``ask``): the
        unfinished attempt's effect happened; its key completes with ``result`` (JSON), marked
        reconciled, which every later call replays, and nothing runs again. Raises as
        :meth:`approve`, and :class:`onceguard.InvalidRequest` for an approval of a call."""
        return self.send(_calls.reconcile_approval(approval_id, why=why, result=result))

    # -- tenants and API keys --------------------------------------------------------------------

    def create_api_key(self, role: str, label: str = "", *, tenant: str | None = None) -> ApiKey:
        """Create an API key (admin); its ``token`` is in this answer only."""
        return self.send(_calls.create_api_key(role, label, tenant))

    def list_api_keys(self) -> list[ApiKey]:
        return self.send(_calls.list_api_keys())

    def revoke_api_key(self, key_id: str) -> None:
        self.send(_calls.revoke_api_key(key_id))

    def create_tenant(self, tenant_id: str) -> Tenant:
        return self.send(_calls.create_tenant(tenant_id))

    def list_tenants(self) -> list[Tenant]:
        return self.send(_calls.list_tenants())

    def ready(self) -> bool:
        """Whether the server answers and its store is reachable (``/readyz``); no retries."""
        try:
            return self.send(_calls.ready(), retry=NO_RETRY)
        except TransportError:
            return False
