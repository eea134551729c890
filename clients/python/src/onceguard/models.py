"""The typed answers of the API.

A claim answers exactly one of :class:`Acquired`, :class:`Replay`, :class:`InFlight`,
:class:`Mismatch`, :class:`Denied`, :class:`PendingApproval` or, in a namespace in observe mode,
:class:`Proceed` (the union :data:`ClaimAnswer`); match on the class:

.. code-block:: python

    match client.claim("prod/payments-agent", "refund-1234", request=args):
        case Acquired(fence=fence):   ...do the effect, then client.complete(..., fence, result)
        case Replay() as replay:      return replay.result
        case InFlight(retry_after=s): ...retry later
        case Mismatch():              ...the key was used with another request
        case Denied(kind=kind):       ...a switch, budget, quota or an approver refused it
        case PendingApproval(approval=approval): ...a person decides first; claim again later
        case Proceed(would_have_been=what): ...observe mode: do the effect; nothing is held

A fenced call answers the :class:`Record` as it now is; a stale fence raises
:class:`onceguard.StaleFence`, which carries a :class:`Stale`.

A run being rolled back is a :class:`Rollback`; its workers claim its compensations, one
:class:`CompensationTask` at a time, until :class:`CompensationsDone` (the union
:data:`CompensationClaim`).

Durations in answers are seconds (``float``); times are aware ``datetime`` in UTC.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar, Literal, Mapping, Union

from ._wire import Duration, format_duration, parse_optional_time, parse_time
from .errors import ResultNotKept
from .errors import Stale as Stale  # defined beside StaleFence, which carries it; importable here as before

JSON_MEDIA_TYPE = "application/json"


@dataclass(frozen=True)
class ResultDigest:
    """What a namespace that keeps a digest only (``outcome_kept: digest`` in its settings)
    keeps of an outcome, in place of its bytes."""

    #: The size of the outcome's bytes.
    size: int
    #: The SHA-256 of the outcome's bytes, in lowercase hex.
    sha256: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ResultDigest:
        return cls(size=int(d["size"]), sha256=str(d["sha256"]))


def _digest_of(d: Mapping[str, Any]) -> ResultDigest | None:
    digest = d.get("result_digest")
    return ResultDigest.from_json(digest) if digest is not None else None


def _decode_stored(content_type: str, raw: bytes, digest: ResultDigest | None, status: str) -> Any:
    if digest is not None:
        raise ResultNotKept(digest, status=status)
    if content_type.split(";")[0].strip().lower() == JSON_MEDIA_TYPE:
        return json.loads(raw)
    return raw


@dataclass(frozen=True)
class Checkpoint:
    """A recovery point saved by an attempt."""

    name: str
    data: Any
    fence: int
    at: datetime

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Checkpoint:
        return cls(name=d["name"], data=d.get("data"), fence=int(d["fence"]), at=parse_time(d["at"]))


@dataclass(frozen=True)
class Recovery:
    """Why an acquired claim is a recovery: an earlier attempt may have done part of the work."""

    previous_fence: int
    previous_attempt: int
    #: ``lease_expired`` or ``reported_unknown``.
    reason: str
    #: What the previous holder reported, for ``reported_unknown``.
    detail: str | None
    #: The last checkpoint the previous attempts saved, if any.
    last_checkpoint: Checkpoint | None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Recovery:
        cp = d.get("last_checkpoint")
        return cls(
            previous_fence=int(d["previous_fence"]),
            previous_attempt=int(d["previous_attempt"]),
            reason=str(d["reason"]),
            detail=d.get("detail"),
            last_checkpoint=Checkpoint.from_json(cp) if cp else None,
        )


@dataclass(frozen=True)
class Acquired:
    """``201 acquired``: you hold the key. Do the effect, then complete or fail with ``fence``."""

    fence: int
    attempt: int
    lease_expires_at: datetime
    recovery: Recovery | None = None
    outcome: ClassVar[Literal["acquired"]] = "acquired"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Acquired:
        rec = d.get("recovery")
        return cls(
            fence=int(d["fence"]),
            attempt=int(d["attempt"]),
            lease_expires_at=parse_time(d["lease_expires_at"]),
            recovery=Recovery.from_json(rec) if rec else None,
        )


@dataclass(frozen=True)
class StoredOutcome:
    """An outcome as stored: ``raw`` is its bytes exactly as given at completion (``b""`` where
    only its ``digest`` is kept)."""

    #: ``success``, or ``failure`` for a stored permanent failure.
    status: str
    content_type: str
    raw: bytes
    #: Cost units (money) reported at completion.
    cost: int | None = None
    #: Model tokens reported at completion.
    tokens: int | None = None
    #: The size and SHA-256 of the outcome, where its namespace keeps a digest only (then
    #: there are no bytes); ``None`` where the outcome is kept.
    digest: ResultDigest | None = None
    #: Whether a recovering attempt stored it as what the downstream system said happened,
    #: without running the effect (``complete(..., reconciled=True)``).
    reconciled: bool = False

    @property
    def result(self) -> Any:
        """The outcome: the decoded JSON for ``application/json``, else the raw bytes. Raises
        :class:`onceguard.ResultNotKept` where only a ``digest`` is kept."""
        return _decode_stored(self.content_type, self.raw, self.digest, self.status)

    @classmethod
    def from_json(cls, d: Mapping[str, Any], raw: bytes | None) -> StoredOutcome:
        return cls(
            status=str(d["status"]),
            content_type=str(d["content_type"]),
            raw=_raw_of(d, raw),
            cost=d.get("cost"),
            tokens=d.get("tokens"),
            digest=_digest_of(d),
            reconciled=bool(d.get("reconciled", False)),
        )


def _raw_of(d: Mapping[str, Any], raw: bytes | None) -> bytes:
    if "result_digest" in d:
        return b""  # a namespace that keeps a digest only: no bytes, no `result`
    if "result_base64" in d:
        import base64

        return base64.b64decode(d["result_base64"])
    if raw is not None:
        return raw
    return json.dumps(d.get("result"), separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Replay:
    """``200 replay``: the key completed; its stored outcome, byte for byte, or only its
    ``digest`` where its namespace keeps no more."""

    fence: int
    attempt: int
    completed_at: datetime
    #: ``success``, or ``failure`` for a stored permanent failure (``result`` is then the error).
    status: str
    content_type: str
    #: The outcome's bytes exactly as given at completion (``b""`` where only ``digest`` is kept).
    raw: bytes
    #: Cost units (money) reported at completion: what this replay saved.
    cost: int | None = None
    #: Model tokens reported at completion: what this replay saved.
    tokens: int | None = None
    #: The size and SHA-256 of the outcome, where its namespace keeps a digest only (then
    #: there are no bytes); ``None`` where the outcome is kept.
    digest: ResultDigest | None = None
    #: Whether the outcome was stored by a recovering attempt as what the downstream system
    #: said happened, without running the effect again (``complete(..., reconciled=True)``).
    reconciled: bool = False
    outcome: ClassVar[Literal["replay"]] = "replay"

    @property
    def result(self) -> Any:
        """The outcome: the decoded JSON for ``application/json``, else the raw bytes. Raises
        :class:`onceguard.ResultNotKept` where only a ``digest`` is kept: the effect ran once."""
        return _decode_stored(self.content_type, self.raw, self.digest, self.status)

    @property
    def succeeded(self) -> bool:
        return self.status == "success"

    @classmethod
    def from_json(cls, d: Mapping[str, Any], raw: bytes | None) -> Replay:
        return cls(
            fence=int(d["fence"]),
            attempt=int(d["attempt"]),
            completed_at=parse_time(d["completed_at"]),
            status=str(d["status"]),
            content_type=str(d["content_type"]),
            raw=_raw_of(d, raw),
            cost=d.get("cost"),
            tokens=d.get("tokens"),
            digest=_digest_of(d),
            reconciled=bool(d.get("reconciled", False)),
        )


@dataclass(frozen=True)
class InFlight:
    """``409 in-flight``: someone holds a live lease; retry after ``retry_after`` seconds."""

    retry_after: float
    #: The holder's attempt.
    attempt: int | None = None
    detail: str = ""
    outcome: ClassVar[Literal["in_flight"]] = "in_flight"


@dataclass(frozen=True)
class Mismatch:
    """``422 fingerprint-mismatch``: the key was used with a different request; nothing changed."""

    detail: str = ""
    outcome: ClassVar[Literal["mismatch"]] = "mismatch"


DeniedKind = Literal["switch", "budget", "quota", "approval", "recovery"]

_DENIED_KINDS: dict[str, DeniedKind] = {
    "switch-engaged": "switch",
    "budget-exhausted": "budget",
    "quota-exceeded": "quota",
    "approval-denied": "approval",
    "recovery-needs-verify": "recovery",
}


@dataclass(frozen=True)
class Denied:
    """``423 / 429 / 403 / 409 denied``: a kill switch, a run's budget, the tenant's quota, an
    approver (``approval``, in a namespace that requires approval) or the recovery policy
    (``recovery``: the key's last attempt did not finish and may have run; the namespace's
    policy is ``verify`` and the claim did not say it verifies) refused the claim.

    ``reason`` is the server's object, e.g. ``{"reason": "switch_engaged", "target": "…",
    "why": "…"}``, ``{"reason": "budget_exhausted", "limit": "effects"}``,
    ``{"reason": "quota_exceeded", "quota": "rate", …}`` or ``{"reason": "approval_denied",
    "approval": "apr_…", "by": "…", "why": "…"}``.
    """

    kind: DeniedKind
    reason: dict[str, Any] = field(default_factory=dict)
    #: Seconds until a retry may succeed (quotas); ``None`` otherwise.
    retry_after: float | None = None
    detail: str = ""
    #: Whether the same claim may succeed later (a quota refills, a switch is released).
    retryable: bool = False
    outcome: ClassVar[Literal["denied"]] = "denied"

    @staticmethod
    def kind_of(problem_kind: str) -> DeniedKind | None:
        """The denial kind of a problem kind (``switch-engaged`` → ``switch``), else ``None``."""
        return _DENIED_KINDS.get(problem_kind)


@dataclass(frozen=True)
class Decision:
    """An approver's decision on an :class:`Approval`."""

    approved: bool
    #: The id of the admin API key that decided.
    by: str
    why: str
    at: datetime
    #: Of a recovery: marked done (reconciled) rather than failed.
    reconciled: bool = False
    #: Of a recovery marked done: the result its key completed with.
    result: Any = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Decision:
        return cls(
            approved=bool(d["approved"]),
            by=str(d["by"]),
            why=str(d["why"]),
            at=parse_time(d["at"]),
            reconciled=bool(d.get("reconciled", False)),
            result=d.get("result"),
        )


@dataclass(frozen=True)
class Approval:
    """A call waiting for, or given, a person's decision, in a namespace that requires approval
    (``approval_required`` in its settings). It is bound to the key and the request's
    fingerprint: once approved, the next claim of that key with that request acquires (once);
    once denied, every such claim is :class:`Denied` (``approval``)."""

    id: str
    #: ``pending``, ``approved``, ``denied`` or ``reconciled`` (a recovery marked done).
    state: str
    namespace: str
    key: str
    fingerprint: str
    #: The run and cost units of the claim that asked for it.
    run: str | None
    cost: int | None
    #: What the call does, in the caller's words (``summary`` of the claim), shown to the approver.
    summary: str | None
    requested_at: datetime
    #: When it lapses undecided (``approval_expiry`` of the namespace's settings, default 24h).
    expires_at: datetime
    decision: Decision | None = None
    #: Set on an approval of a recovery (recovery policy ``ask``): the attempt that did not
    #: finish, ``{"previous_fence", "previous_attempt", "reason", "unknown_detail",
    #: "last_checkpoint"}``. Approve to re-run it once, deny to store it as failed, or
    #: ``reconcile`` to mark it done.
    recovery: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Approval:
        decision = d.get("decision")
        return cls(
            id=str(d["id"]),
            state=str(d["state"]),
            namespace=str(d["namespace"]),
            key=str(d["key"]),
            fingerprint=str(d["fingerprint"]),
            run=d.get("run"),
            cost=d.get("cost"),
            summary=d.get("summary"),
            requested_at=parse_time(d["requested_at"]),
            expires_at=parse_time(d["expires_at"]),
            decision=Decision.from_json(decision) if decision else None,
            recovery=dict(d["recovery"]) if isinstance(d.get("recovery"), dict) else None,
        )


@dataclass(frozen=True)
class ApprovalPage:
    """A page of approvals; pass ``next`` as ``cursor`` for the next page (``None`` on the last)."""

    approvals: tuple[Approval, ...]
    next: str | None


@dataclass(frozen=True)
class PendingApproval:
    """``202 pending_approval``: the namespace requires a person's approval and it is not given
    yet. Nothing was acquired or charged; claim again (the same key and request) after
    ``retry_after`` seconds, or with ``wait`` to wait for the decision."""

    approval: Approval
    retry_after: float
    outcome: ClassVar[Literal["pending_approval"]] = "pending_approval"

    @classmethod
    def from_json(cls, d: Mapping[str, Any], retry_after: float | None = None) -> PendingApproval:
        ms = d.get("retry_after_ms")
        seconds = ms / 1000 if isinstance(ms, (int, float)) else retry_after
        return cls(approval=Approval.from_json(d["approval"]), retry_after=seconds or 0.0)


@dataclass(frozen=True)
class Proceed:
    """``200 proceed``: the namespace is in observe mode (``mode: observe`` in its settings) and
    enforcing would not have let this call run; it is told to run anyway. Nothing is held (no
    fence, no lease): do the effect, and call neither ``complete`` nor ``fail``. The claim was
    decided and recorded as in enforce mode, so what enforcing would have done shows."""

    #: What enforcing would have answered: ``replay``, ``in_flight``, ``mismatch``, ``denied``
    #: or ``pending_approval``.
    would_have_been: str
    #: For ``denied``, a short text saying why (e.g. "the run's budget is spent (effects)").
    reason: str | None = None
    mode: str = "observe"
    outcome: ClassVar[Literal["proceed"]] = "proceed"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Proceed:
        reason = d.get("reason")
        return cls(
            would_have_been=str(d["would_have_been"]),
            reason=None if reason is None else str(reason),
            mode=str(d.get("mode", "observe")),
        )


#: The one answer of a claim.
ClaimAnswer = Union[Acquired, Replay, InFlight, Mismatch, Denied, PendingApproval, Proceed]


@dataclass(frozen=True)
class Record:
    """A key's record as the API shows it."""

    namespace: str
    key: str
    #: ``in_progress``, ``completed`` or ``released``.
    state: str
    #: In progress with no live lease: the next claim is a recovery.
    stuck: bool
    fingerprint: str
    fence: int
    attempt: int
    run: str | None
    lease_expires_at: datetime | None
    unknown: str | None
    completed_at: datetime | None
    created_at: datetime
    updated_at: datetime
    #: When the record stops existing; ``None`` while in progress (retention runs from
    #: completion or release, never over an unfinished attempt).
    expires_at: datetime | None
    checkpoints: tuple[Checkpoint, ...] = ()
    #: The stored outcome (only from :meth:`Client.get_record`).
    stored: StoredOutcome | None = None
    #: Completed by a recovering attempt with what the downstream system said happened,
    #: without running the effect (``complete(..., reconciled=True)``).
    reconciled: bool = False

    @classmethod
    def from_json(cls, d: Mapping[str, Any], stored_raw: bytes | None = None) -> Record:
        stored = d.get("stored")
        return cls(
            namespace=d["namespace"],
            key=d["key"],
            state=d["state"],
            stuck=bool(d.get("stuck", False)),
            fingerprint=d["fingerprint"],
            fence=int(d["fence"]),
            attempt=int(d["attempt"]),
            run=d.get("run"),
            lease_expires_at=parse_optional_time(d.get("lease_expires_at")),
            unknown=d.get("unknown"),
            completed_at=parse_optional_time(d.get("completed_at")),
            created_at=parse_time(d["created_at"]),
            updated_at=parse_time(d["updated_at"]),
            expires_at=parse_optional_time(d.get("expires_at")),
            checkpoints=tuple(Checkpoint.from_json(c) for c in d.get("checkpoints") or ()),
            stored=StoredOutcome.from_json(stored, stored_raw) if stored else None,
            reconciled=bool(d.get("reconciled", False)),
        )


@dataclass(frozen=True)
class RecordPage:
    """A page of records; pass ``next`` as ``cursor`` for the next page (``None`` on the last)."""

    records: tuple[Record, ...]
    next: str | None


@dataclass(frozen=True)
class ApiKey:
    """An API key; ``token`` only in the answer that created it."""

    id: str
    tenant: str
    role: str
    label: str
    created_at: datetime
    revoked_at: datetime | None
    token: str | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ApiKey:
        return cls(
            id=d["id"],
            tenant=d["tenant"],
            role=d["role"],
            label=d.get("label", ""),
            created_at=parse_time(d["created_at"]),
            revoked_at=parse_optional_time(d.get("revoked_at")),
            token=d.get("token"),
        )


@dataclass(frozen=True)
class Tenant:
    id: str
    created_at: datetime

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Tenant:
        return cls(id=d["id"], created_at=parse_time(d["created_at"]))


# ------------------------------------------------------------------------------------------------
# Runs, switches, audit
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Budget:
    """A run's limits; ``None`` means unlimited."""

    max_effects: int | None = None
    max_cost: int | None = None
    deadline: datetime | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> Budget:
        d = d or {}
        return cls(
            max_effects=d.get("max_effects"),
            max_cost=d.get("max_cost"),
            deadline=parse_optional_time(d.get("deadline")),
        )


@dataclass(frozen=True)
class Usage:
    """What a run has spent: acquired effects (each key once) and cost units."""

    effects: int = 0
    cost: int = 0

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> Usage:
        d = d or {}
        return cls(effects=int(d.get("effects", 0)), cost=int(d.get("cost", 0)))


@dataclass(frozen=True)
class Run:
    """A run with its budget and usage."""

    run: str
    budget: Budget
    usage: Usage
    created_at: datetime | None
    updated_at: datetime | None
    #: Its rollback's progress (without ``tasks``) if it is being rolled back, else ``None``.
    rollback: Rollback | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Run:
        rollback = d.get("rollback")
        return cls(
            run=d["run"],
            budget=Budget.from_json(d.get("budget")),
            usage=Usage.from_json(d.get("usage")),
            created_at=parse_optional_time(d.get("created_at")),
            updated_at=parse_optional_time(d.get("updated_at")),
            rollback=Rollback.from_json(rollback) if rollback else None,
        )


# ------------------------------------------------------------------------------------------------
# Compensations and rollbacks
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compensation:
    """How to undo an effect, registered when it completes: the ``name`` of the compensation (1
    to 128 bytes of printable ASCII) that a worker looks its handler up by, and its ``data``
    (any JSON, at most 16 KiB; a :class:`onceguard.RawJson` text is sent verbatim). It is data,
    never code: Onceguard calls nothing itself."""

    name: str
    data: Any = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Compensation:
        return cls(name=str(d["name"]), data=d.get("data"))


@dataclass(frozen=True)
class EffectRef:
    """The completed effect a compensation undoes: its key, fence and completion time."""

    namespace: str
    key: str
    fence: int
    completed_at: datetime | None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> EffectRef:
        return cls(
            namespace=str(d["namespace"]),
            key=str(d["key"]),
            fence=int(d["fence"]),
            completed_at=parse_optional_time(d.get("completed_at")),
        )


@dataclass(frozen=True)
class RollbackTask:
    """The compensation of one effect of a run being rolled back, run under its own key
    (``namespace``, ``key``)."""

    namespace: str
    key: str
    effect: EffectRef
    compensation: Compensation
    #: ``pending``, ``in_progress``, ``compensated`` or ``failed`` (kept, shown, never retried).
    state: str
    attempt: int

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RollbackTask:
        return cls(
            namespace=str(d["namespace"]),
            key=str(d["key"]),
            effect=EffectRef.from_json(d["effect"]),
            compensation=Compensation.from_json(d["compensation"]),
            state=str(d["state"]),
            attempt=int(d.get("attempt", 0)),
        )


@dataclass(frozen=True)
class Rollback:
    """The progress of a run's rollback. Counts are of the run's completed successful
    ``effects``; ``done`` once no compensation is pending or in progress."""

    run: str
    why: str
    #: The id of the admin API key that started it.
    started_by: str | None
    started_at: datetime | None
    effects: int
    compensated: int
    #: Held by a worker (or held by one whose lease passed: the next worker recovers it).
    in_progress: int
    #: Not started yet, or given back after a retryable failure.
    pending: int
    #: Failed permanently: kept and shown, never handed out again.
    failed: int
    #: Completed effects that registered no compensation.
    not_compensable: int
    #: Keys of the run still in progress: whether their effects happened is unknown.
    effects_in_flight: int
    done: bool
    #: The compensable effects, newest first (empty in :attr:`Run.rollback`).
    tasks: tuple[RollbackTask, ...] = ()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Rollback:
        return cls(
            run=str(d["run"]),
            why=str(d.get("why", "")),
            started_by=d.get("started_by"),
            started_at=parse_optional_time(d.get("started_at")),
            effects=int(d.get("effects", 0)),
            compensated=int(d.get("compensated", 0)),
            in_progress=int(d.get("in_progress", 0)),
            pending=int(d.get("pending", 0)),
            failed=int(d.get("failed", 0)),
            not_compensable=int(d.get("not_compensable", 0)),
            effects_in_flight=int(d.get("effects_in_flight", 0)),
            done=bool(d.get("done", False)),
            tasks=tuple(RollbackTask.from_json(t) for t in d.get("tasks") or ()),
        )


@dataclass(frozen=True)
class CompensationTask:
    """``201 acquired``: a worker holds a compensation of a run being rolled back, exactly as
    an acquired claim of the task's own key (``namespace``, ``key``). Run the compensation, then
    ``complete`` (its result) or ``fail`` (``retryable=False`` keeps it failed, ``True`` hands
    it out again) with ``fence``; ``checkpoint`` and ``extend`` work as for any holder."""

    namespace: str
    key: str
    fence: int
    attempt: int
    lease_expires_at: datetime
    #: Set when an earlier worker held the task and its lease passed (or it reported unknown).
    recovery: Recovery | None
    #: The effect to undo.
    effect: EffectRef
    compensation: Compensation
    outcome: ClassVar[Literal["acquired"]] = "acquired"

    @property
    def acquired(self) -> Acquired:
        """The task as the acquired claim of its key."""
        return Acquired(
            fence=self.fence, attempt=self.attempt, lease_expires_at=self.lease_expires_at, recovery=self.recovery
        )

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CompensationTask:
        held = Acquired.from_json(d)
        return cls(
            namespace=str(d["namespace"]),
            key=str(d["key"]),
            fence=held.fence,
            attempt=held.attempt,
            lease_expires_at=held.lease_expires_at,
            recovery=held.recovery,
            effect=EffectRef.from_json(d["effect"]),
            compensation=Compensation.from_json(d["compensation"]),
        )


@dataclass(frozen=True)
class CompensationsBusy:
    """``200 busy``: no task to take now; other workers hold the ``in_progress`` ones. Claim
    again after ``retry_after`` seconds (one whose holder's lease passes is handed out then)."""

    retry_after: float
    in_progress: int
    outcome: ClassVar[Literal["busy"]] = "busy"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CompensationsBusy:
        return cls(retry_after=float(d.get("retry_after_ms", 0)) / 1000, in_progress=int(d.get("in_progress", 0)))


@dataclass(frozen=True)
class CompensationsDone:
    """``200 done``: nothing is left to run; the run's compensations ``compensated`` and
    ``failed`` (permanently) in all."""

    compensated: int
    failed: int
    outcome: ClassVar[Literal["done"]] = "done"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CompensationsDone:
        return cls(compensated=int(d.get("compensated", 0)), failed=int(d.get("failed", 0)))


#: The one answer of a compensation claim.
CompensationClaim = Union[CompensationTask, CompensationsBusy, CompensationsDone]


@dataclass(frozen=True)
class CompensationReport:
    """What one ``run_compensations`` worker did."""

    #: Compensations it ran and completed.
    compensated: int = 0
    #: Compensations it failed permanently (a handler's error, or no handler known).
    failed: int = 0
    #: Tasks it gave back to run again: a retryable failure, or a lease taken over meanwhile.
    released: int = 0
    #: Whether the rollback had nothing left to run when it stopped (else it stopped after
    #: ``max_tasks``, or after ``idle_timeout`` of other workers holding the rest).
    done: bool = False


@dataclass(frozen=True)
class SwitchTarget:
    """What a kill switch covers: the whole tenant, a namespace prefix, or one run.

    Build one with :meth:`tenant`, :meth:`namespace` or :meth:`run`.
    """

    kind: Literal["tenant", "namespace", "run"]
    prefix: str | None = None
    run_id: str | None = None

    @classmethod
    def tenant(cls) -> SwitchTarget:
        return cls("tenant")

    @classmethod
    def namespace(cls, prefix: str) -> SwitchTarget:
        return cls("namespace", prefix=prefix)

    @classmethod
    def run(cls, run: str) -> SwitchTarget:
        return cls("run", run_id=run)

    def to_json(self) -> dict[str, Any]:
        if self.kind == "namespace":
            return {"kind": "namespace", "prefix": self.prefix}
        if self.kind == "run":
            return {"kind": "run", "run": self.run_id}
        return {"kind": "tenant"}

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | str) -> SwitchTarget:
        if isinstance(d, str):  # tolerate a server that renders targets as text
            kind, _, rest = d.partition(":")
            if kind == "namespace":
                return cls("namespace", prefix=rest)
            if kind == "run":
                return cls("run", run_id=rest)
            return cls("tenant")
        kind = d.get("kind", "tenant")
        if kind == "namespace":
            return cls("namespace", prefix=d.get("prefix"))
        if kind == "run":
            return cls("run", run_id=d.get("run"))
        return cls("tenant")


@dataclass(frozen=True)
class Trip:
    """What a tripwire tripped on: the figures across instances over its window."""

    rule: str
    #: The run whose calls crossed the threshold (a rule counted per run).
    run: str | None
    calls: int
    #: The bad calls among them (or the units spent).
    bad: int
    window_secs: int
    #: When the switch is released by itself; ``None``: by a person.
    release_at: datetime | None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Trip:
        return cls(
            rule=str(d.get("rule", "")),
            run=d.get("run"),
            calls=int(d.get("calls", 0) or 0),
            bad=int(d.get("bad", 0) or 0),
            window_secs=int(d.get("window_secs", 0) or 0),
            release_at=parse_optional_time(d.get("release_at")),
        )


@dataclass(frozen=True)
class Switch:
    """An engaged (or just released) kill switch."""

    target: SwitchTarget
    reason: str
    revoke_leases: bool
    #: How many live leases were revoked when it was engaged.
    revoked: int
    #: The id of the API key that engaged it (``tripwire:<rule>`` for a tripwire's).
    engaged_by: str | None
    engaged_at: datetime | None
    #: The tripwire that engaged it and its figures; ``None`` for a person's.
    tripwire: Trip | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Switch:
        trip = d.get("tripwire")
        return cls(
            target=SwitchTarget.from_json(d.get("target") or {}),
            reason=str(d.get("reason", "")),
            revoke_leases=bool(d.get("revoke_leases", False)),
            revoked=int(d.get("revoked", 0) or 0),
            engaged_by=d.get("engaged_by"),
            engaged_at=parse_optional_time(d.get("engaged_at")),
            tripwire=Trip.from_json(trip) if isinstance(trip, Mapping) else None,
        )


@dataclass(frozen=True)
class Tripwire:
    """A tripwire rule: it engages a kill switch by itself when its symptom crosses the
    threshold over the window (see ``Client.put_tripwire``)."""

    name: str
    #: The namespace prefix it watches; ``None``: the whole tenant.
    prefix: str | None
    #: What it counts and the threshold, as the API spells it, e.g.
    #: ``{"kind": "failure_rate", "above": 0.2}``.
    symptom: Mapping[str, Any]
    window: str
    min_calls: int
    #: ``namespace`` or ``run``.
    per: str
    revoke_leases: bool
    rollback: bool
    auto_release_after: str | None
    set_by: str | None
    set_at: datetime | None
    #: ``switch`` (engage a kill switch) or ``observe`` (turn the prefix to observe mode).
    action: str = "switch"

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Tripwire:
        return cls(
            name=str(d.get("name", "")),
            prefix=d.get("prefix"),
            symptom=dict(d.get("symptom") or {}),
            window=str(d.get("window", "")),
            min_calls=int(d.get("min_calls", 0) or 0),
            per=str(d.get("per", "namespace")),
            action=str(d.get("action", "switch")),
            revoke_leases=bool(d.get("revoke_leases", False)),
            rollback=bool(d.get("rollback", False)),
            auto_release_after=d.get("auto_release_after"),
            set_by=d.get("set_by"),
            set_at=parse_optional_time(d.get("set_at")),
        )


@dataclass(frozen=True)
class ClaimRate:
    """A tenant's claim rate: ``per_second`` on average, bursts of up to ``burst``."""

    per_second: int
    burst: int


@dataclass(frozen=True)
class Settings:
    """Settings of a tenant or of a namespace prefix; ``None`` inherits (from the tenant for a
    prefix, from the server's limits for the tenant). Durations as the API takes them."""

    default_lease: Duration | None = None
    max_lease: Duration | None = None
    default_retention: Duration | None = None
    max_retention: Duration | None = None
    #: Tenant only: at most this many keys in flight at once.
    max_in_flight: int | None = None
    #: Tenant only: the claim rate.
    claim_rate: ClaimRate | None = None
    #: ``full`` (the default) or ``digest``: keep only the size and SHA-256 of each outcome,
    #: never its bytes (replays then carry a :class:`ResultDigest`).
    outcome_kept: Literal["full", "digest"] | None = None
    #: Every first claim of a key waits for a person's decision (:class:`PendingApproval`).
    approval_required: bool | None = None
    #: How long an undecided approval stays open (default 24h).
    approval_expiry: Duration | None = None
    #: ``enforce`` (the default) or ``observe``: claims are decided and recorded as always, but
    #: a call that enforcing would not let run is told to run anyway (:class:`Proceed`).
    mode: Literal["enforce", "observe"] | None = None
    #: What a claim of a key whose last attempt did not finish may do: ``rerun`` (the default),
    #: ``verify`` (only a call given a ``verify`` hook takes it over; others raise
    #: :class:`onceguard.RecoveryNeedsVerify`) or ``ask`` (a person decides: the call is
    #: :class:`PendingApproval`, an approval of the recovery).
    recovery: Literal["rerun", "verify", "ask"] | None = None
    #: A canary: enforce for this percentage of keys (0 to 100), observe the rest, each key
    #: always on the same side; in place of ``mode``.
    enforce_percent: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in ("default_lease", "max_lease", "default_retention", "max_retention", "approval_expiry"):
            value = getattr(self, name)
            if value is not None:
                out[name] = format_duration(value)
        if self.max_in_flight is not None:
            out["max_in_flight"] = self.max_in_flight
        if self.claim_rate is not None:
            out["claim_rate"] = {"per_second": self.claim_rate.per_second, "burst": self.claim_rate.burst}
        if self.outcome_kept is not None:
            out["outcome_kept"] = self.outcome_kept
        if self.approval_required is not None:
            out["approval_required"] = self.approval_required
        if self.mode is not None:
            out["mode"] = self.mode
        if self.recovery is not None:
            out["recovery"] = self.recovery
        if self.enforce_percent is not None:
            out["enforce_percent"] = self.enforce_percent
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any] | None) -> Settings:
        d = d or {}
        rate = d.get("claim_rate")
        return cls(
            default_lease=d.get("default_lease"),
            max_lease=d.get("max_lease"),
            default_retention=d.get("default_retention"),
            max_retention=d.get("max_retention"),
            max_in_flight=d.get("max_in_flight"),
            claim_rate=ClaimRate(int(rate["per_second"]), int(rate["burst"])) if rate else None,
            outcome_kept=d.get("outcome_kept"),
            approval_required=d.get("approval_required"),
            approval_expiry=d.get("approval_expiry"),
            mode=d.get("mode"),
            recovery=d.get("recovery"),
            enforce_percent=d.get("enforce_percent"),
        )


@dataclass(frozen=True)
class SettingsEntry:
    """The settings of the tenant (``namespace_prefix`` ``None``) or of a namespace prefix."""

    namespace_prefix: str | None
    settings: Settings
    #: Who set them: an API key id, ``cli:<user>``, ``embedded`` or ``tripwire:<rule>``.
    updated_by: str | None
    updated_at: datetime | None
    #: Set by a tripwire whose action is ``observe``: why, and the figures it tripped on.
    #: Observe mode then holds for every key under the prefix, over more specific entries,
    #: until a person sets these settings again.
    tripwire: ObserveTrip | None = None

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SettingsEntry:
        trip = d.get("tripwire")
        return cls(
            namespace_prefix=d.get("namespace_prefix"),
            settings=Settings.from_json(d.get("settings")),
            updated_by=d.get("updated_by"),
            updated_at=parse_optional_time(d.get("updated_at")),
            tripwire=ObserveTrip.from_json(trip) if isinstance(trip, Mapping) else None,
        )


@dataclass(frozen=True)
class ObserveTrip:
    """Why a tripwire turned a prefix to observe mode: the sentence and the figures."""

    reason: str
    trip: Trip

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ObserveTrip:
        return cls(reason=str(d.get("reason", "")), trip=Trip.from_json(d))


@dataclass(frozen=True)
class AuditEntry:
    """One admin action: who, when, what, why."""

    id: str
    at: datetime
    actor: str
    action: str
    target: str | None
    why: str | None
    details: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> AuditEntry:
        target = d.get("target")
        return cls(
            id=str(d["id"]),
            at=parse_time(d["at"]),
            actor=str(d.get("actor", "")),
            action=str(d["action"]),
            target=target if target is None or isinstance(target, str) else json.dumps(target),
            why=d.get("why"),
            details=dict(d.get("details") or {}),
        )


@dataclass(frozen=True)
class AuditPage:
    """A page of the audit log, newest first; ``next`` is the cursor of the next page."""

    entries: tuple[AuditEntry, ...]
    next: str | None
