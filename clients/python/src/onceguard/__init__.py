"""Onceguard's Python client: make every side effect of an agent or a pipeline happen once.

- :class:`Client` / :class:`AsyncClient`: every call of the HTTP API, with typed answers.
- :func:`once`: a decorator that makes a function run once per key (derived from its
  arguments, or given); :func:`guarded`: the same for a block; :func:`current`: the running
  attempt (fence, attempt number, recovery, checkpoints); a ``verify`` hook answering
  :class:`Happened` reconciles a recovery with what happened downstream instead of running
  again.
- Approvals: in a namespace that requires a person's approval, a claim answers
  :class:`PendingApproval` (the guards raise :class:`AwaitingApproval`) until an admin calls
  ``approve`` or ``deny`` (:class:`ApprovalDenied`).
- ``onceguard.langchain.guard_tool`` and ``onceguard.openai_agents.guard_function_tool``: guard
  the tools of LangChain / LangGraph and of the OpenAI Agents SDK;
  ``onceguard.a2a.OnceA2AClient``: an ``a2a-sdk`` client whose sends through the A2A gateway are
  keyed by the steps of a run.
- Observe mode: in a namespace whose settings say ``mode: observe``, a claim that enforcing
  would refuse answers :class:`Proceed` (``would_have_been``, ``reason``) and the guards run
  the function anyway, holding and storing nothing.
- Rollbacks: ``undo=`` on :func:`once` and :func:`guarded` registers each effect's
  :class:`Compensation` when it completes (and the undo function in this process,
  :func:`undo_handlers`); ``client.rollback(run, why)`` starts undoing a run, and
  :func:`run_compensations` (``run_compensations(client, run)``) is the worker that runs its
  compensations, newest first.
- :func:`once_each`: many items, each done once per key, in batches; on it,
  ``onceguard.langchain.OnceEmbeddings`` and ``onceguard.llamaindex.OnceEmbedding`` embed each
  chunk of an ingestion once per (model, text digest).
"""

from ._calls import ClaimItem, CompleteItem
from ._undo import register_undo, undo_handlers, undo_name
from ._wire import RawJson
from .client import NO_RETRY, AsyncClient, Client, Retry, Timeout
from .errors import (
    ApprovalClosed,
    ApprovalDenied,
    RecoveryNeedsVerify,
    AwaitingApproval,
    ClaimProblem,
    Conflict,
    DeniedError,
    Forbidden,
    GuardError,
    InFlightError,
    InternalServerError,
    InvalidRequest,
    KeyConflict,
    MethodNotAllowed,
    NotFound,
    OnceguardError,
    PayloadTooLarge,
    PermanentFailure,
    ProblemError,
    ResultNotKept,
    Stale,
    StaleFence,
    StoreUnavailable,
    TransportError,
    Unauthenticated,
    UnexpectedResponse,
    UnsupportedMediaType,
    UpstreamFailed,
    UpstreamTimeout,
)
from ._async.ingest import once_each as once_each_async
from ._sync.ingest import once_each
from .guard import AsyncAttempt, AsyncGuarded, Attempt, Guarded, Happened, current, guarded, once
from .keys import canonical_json, derive_key
from .models import (
    Acquired,
    ApiKey,
    Approval,
    ApprovalPage,
    AuditEntry,
    AuditPage,
    Budget,
    Checkpoint,
    ClaimAnswer,
    ClaimRate,
    Compensation,
    CompensationClaim,
    CompensationReport,
    CompensationsBusy,
    CompensationsDone,
    CompensationTask,
    Decision,
    Denied,
    EffectRef,
    InFlight,
    Mismatch,
    PendingApproval,
    Proceed,
    Record,
    RecordPage,
    Recovery,
    Replay,
    ResultDigest,
    Rollback,
    RollbackTask,
    Run,
    Settings,
    SettingsEntry,
    StoredOutcome,
    Switch,
    SwitchTarget,
    ObserveTrip,
    Trip,
    Tripwire,
    Tenant,
    Usage,
)
from .rollback import run_compensations

__version__ = "0.1.0"

__all__ = [
    "once_each",
    "once_each_async",
    "ClaimItem",
    "CompleteItem",
    "Acquired",
    "ApiKey",
    "Approval",
    "ApprovalClosed",
    "ApprovalDenied",
    "RecoveryNeedsVerify",
    "ApprovalPage",
    "AsyncAttempt",
    "AsyncClient",
    "AsyncGuarded",
    "Attempt",
    "AuditEntry",
    "AuditPage",
    "AwaitingApproval",
    "Budget",
    "Checkpoint",
    "ClaimAnswer",
    "ClaimProblem",
    "ClaimRate",
    "Client",
    "Compensation",
    "CompensationClaim",
    "CompensationReport",
    "CompensationTask",
    "CompensationsBusy",
    "CompensationsDone",
    "Conflict",
    "Decision",
    "Denied",
    "DeniedError",
    "EffectRef",
    "Forbidden",
    "GuardError",
    "Guarded",
    "Happened",
    "InFlight",
    "InFlightError",
    "InternalServerError",
    "InvalidRequest",
    "KeyConflict",
    "MethodNotAllowed",
    "Mismatch",
    "NO_RETRY",
    "NotFound",
    "OnceguardError",
    "PayloadTooLarge",
    "PendingApproval",
    "PermanentFailure",
    "ProblemError",
    "Proceed",
    "RawJson",
    "Record",
    "RecordPage",
    "Recovery",
    "Replay",
    "ResultDigest",
    "ResultNotKept",
    "Retry",
    "Rollback",
    "RollbackTask",
    "Run",
    "Settings",
    "SettingsEntry",
    "Stale",
    "StaleFence",
    "StoreUnavailable",
    "StoredOutcome",
    "Switch",
    "SwitchTarget",
    "ObserveTrip",
    "Trip",
    "Tripwire",
    "Tenant",
    "Timeout",
    "TransportError",
    "Unauthenticated",
    "UnexpectedResponse",
    "UnsupportedMediaType",
    "UpstreamFailed",
    "UpstreamTimeout",
    "Usage",
    "canonical_json",
    "current",
    "derive_key",
    "guarded",
    "once",
    "register_undo",
    "run_compensations",
    "undo_handlers",
    "undo_name",
]
