"""The exceptions of the client.

Two families:

- **Problems**: the server refused or could not serve a request. The server answers
  ``application/problem+json`` (RFC 9457) with a stable ``type``
  (``https://onceguard.dev/problems/<kind>``); each kind is one class here, chosen by that type
  and never by the message text. Each carries ``type``, ``status``, ``title``, ``detail`` and
  ``retryable`` (whether the same request may succeed later). :class:`TransportError` is the
  client's own: the server could not be reached (after the retries).
- **Guard outcomes** raised by :func:`onceguard.once` and :func:`onceguard.guarded`, which turn
  the claim's answers that are not "run it" or "here is the replay" into exceptions:
  :class:`InFlightError`, :class:`KeyConflict`, :class:`DeniedError` (:class:`ApprovalDenied`
  when an approver refused the call), :class:`AwaitingApproval`, :class:`PermanentFailure`;
  and :class:`StaleFence` when a fenced call (complete, fail, extend, checkpoint,
  report-unknown) was refused because the attempt's fence is no longer the holder's.
- :class:`ResultNotKept`: a replay whose namespace keeps only a digest of the outcome, so
  there is no result to return (raised by ``.result`` and by the guards, which never run the
  function again for it).

A claim's answers themselves (``Acquired``, ``Replay``, ``InFlight``, ``Mismatch``, ``Denied``,
``PendingApproval``) are return values of :meth:`onceguard.Client.claim`, not exceptions: see ``onceguard.models``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Mapping

# The answers some of these exceptions carry, named for the type checker only: models raises
# ResultNotKept, so it imports this module, and this one never imports models.
if TYPE_CHECKING:
    from .models import Approval, Denied, ResultDigest

#: The prefix of every problem type.
PROBLEM_PREFIX = "https://onceguard.dev/problems/"


class OnceguardError(Exception):
    """The base of every exception of this package."""


class TransportError(OnceguardError):
    """The server could not be reached or did not answer, after the client's retries.

    The cause (the HTTP library's error: urllib3's in the sync client, aiohttp's in the async
    one) is chained as ``__cause__``. ``maybe_sent`` says whether the last try may have reached
    the server (a read timeout, a dropped connection), so that whether it took effect is
    unknown; claims and fenced calls are idempotent by key and fence, so sending them again is
    safe.
    """

    def __init__(self, message: str, *, attempts: int, maybe_sent: bool = False) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.maybe_sent = maybe_sent


class UnexpectedResponse(OnceguardError):
    """An answer that is neither the documented success nor a problem (e.g. from a proxy)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"unexpected answer {status}: {body[:200]}")
        self.status = status
        self.body = body


class ProblemError(OnceguardError):
    """A problem answer (RFC 9457). Subclasses name each stable ``type``."""

    #: The kind this class stands for (the last segment of ``type``); ``""`` for the base.
    kind_name: str = ""

    def __init__(self, problem: Mapping[str, Any], status: int) -> None:
        self.problem: dict[str, Any] = dict(problem)
        self.type: str = str(problem.get("type", ""))
        self.status: int = int(problem.get("status", status) or status)
        self.title: str = str(problem.get("title", ""))
        self.detail: str = str(problem.get("detail", ""))
        self.retryable: bool = bool(problem.get("retryable", False))
        super().__init__(f"{self.kind or self.status}: {self.detail or self.title}")

    @property
    def kind(self) -> str:
        """The last segment of ``type``, e.g. ``invalid-request``."""
        return self.type[len(PROBLEM_PREFIX) :] if self.type.startswith(PROBLEM_PREFIX) else self.type


class InvalidRequest(ProblemError):
    """400: malformed JSON, unknown fields, a value outside its rules. Fix the request."""

    kind_name = "invalid-request"


class Unauthenticated(ProblemError):
    """401: no API key, or a malformed, unknown or revoked one."""

    kind_name = "unauthenticated"


class Forbidden(ProblemError):
    """403: the API key's role may not do this call (e.g. an agent key purging)."""

    kind_name = "forbidden"


class NotFound(ProblemError):
    """404: no such record, run, switch, API key or endpoint in your tenant."""

    kind_name = "not-found"


class MethodNotAllowed(ProblemError):
    """405."""

    kind_name = "method-not-allowed"


class Conflict(ProblemError):
    """409 ``conflict``: a resource that must be new exists already (e.g. a tenant)."""

    kind_name = "conflict"


class PayloadTooLarge(ProblemError):
    """413: the body, an outcome or a checkpoint is larger than the server allows."""

    kind_name = "payload-too-large"


class UnsupportedMediaType(ProblemError):
    """415: the body was not sent as JSON."""

    kind_name = "unsupported-media-type"


class StoreUnavailable(ProblemError):
    """503: the store could not answer; nothing was decided. Retried by the client first."""

    kind_name = "store-unavailable"


class InternalServerError(ProblemError):
    """500: a bug in the server."""

    kind_name = "internal"


class UpstreamFailed(ProblemError):
    """502 (proxy mode): the upstream could not be reached or failed after the request was sent."""

    kind_name = "upstream-failed"


class UpstreamTimeout(ProblemError):
    """504 (proxy mode): the upstream did not answer in time."""

    kind_name = "upstream-timeout"


@dataclass(frozen=True)
class Stale:
    """A fenced call changed nothing: ``superseded``, ``no_record`` or ``finished`` (what a
    :class:`StaleFence` carries)."""

    reason: str
    detail: str = ""
    outcome: ClassVar[Literal["stale"]] = "stale"


class StaleFence(ProblemError):
    """409 ``stale-fence``: the fence is not the current holder's; nothing changed.

    Your attempt is over: another claim took the key over (``superseded``, e.g. after your lease
    passed or a kill switch revoked it), there is no live record (``no_record``), or your attempt
    already finished differently (``finished``). A result you tried to store is **not** stored.
    """

    kind_name = "stale-fence"

    def __init__(self, problem: Mapping[str, Any], status: int) -> None:
        super().__init__(problem, status)
        reason = problem.get("reason")
        self.stale = Stale(reason=str(reason) if reason is not None else "", detail=self.detail)

    @property
    def reason(self) -> str:
        """``superseded``, ``no_record`` or ``finished``."""
        return self.stale.reason


class ApprovalClosed(ProblemError):
    """409 ``approval-closed``: the approval was decided already, or expired; this decision
    changed nothing. Read it (:meth:`Client.get_approval`) to see how it stands."""

    kind_name = "approval-closed"


class ClaimProblem(ProblemError):
    """A claim answer (``in-flight``, ``fingerprint-mismatch``, a denial) to a call that is not a
    claim. :meth:`Client.claim` returns these answers as values instead."""


PROBLEM_CLASSES: dict[str, type[ProblemError]] = {
    cls.kind_name: cls
    for cls in (
        InvalidRequest,
        Unauthenticated,
        Forbidden,
        NotFound,
        MethodNotAllowed,
        Conflict,
        PayloadTooLarge,
        UnsupportedMediaType,
        StoreUnavailable,
        InternalServerError,
        UpstreamFailed,
        UpstreamTimeout,
        StaleFence,
        ApprovalClosed,
    )
}


def problem_error(problem: Mapping[str, Any], status: int) -> ProblemError:
    """The exception for a problem body, chosen by its ``type``."""
    kind = str(problem.get("type", ""))
    kind = kind[len(PROBLEM_PREFIX) :] if kind.startswith(PROBLEM_PREFIX) else ""
    return PROBLEM_CLASSES.get(kind, ClaimProblem if "outcome" in problem else ProblemError)(problem, status)


# ------------------------------------------------------------------------------------------------
# Guard outcomes (raised by `once` and `guarded`)
# ------------------------------------------------------------------------------------------------


class GuardError(OnceguardError):
    """A claim made by ``once`` / ``guarded`` did not let the function run, nor replayed it."""

    def __init__(self, message: str, *, namespace: str, key: str) -> None:
        super().__init__(message)
        self.namespace = namespace
        self.key = key


class InFlightError(GuardError):
    """Another caller holds the key with a live lease, still after the bounded wait.

    Retry after ``retry_after`` seconds: you will then get its replay, or the key itself if the
    holder's lease passed.
    """

    def __init__(self, *, namespace: str, key: str, retry_after: float, attempt: int | None) -> None:
        super().__init__(
            f"key {key!r} in {namespace!r} is in flight; retry after {retry_after:.3f}s",
            namespace=namespace,
            key=key,
        )
        self.retry_after = retry_after
        self.attempt = attempt

    @property
    def model_message(self) -> str:
        """The refusal as a tool's answer to a model: one sentence it can act on."""
        return (
            "This call is already running (an earlier call with the same arguments started it), so it was not "
            f"run again; call the tool again with the same arguments in {max(1, round(self.retry_after))}s or "
            "later to get its result."
        )


class KeyConflict(GuardError):
    """The key was used before with a different request (fingerprint mismatch). Nothing changed:
    use another key, or a new version label."""

    def __init__(self, *, namespace: str, key: str, detail: str = "") -> None:
        super().__init__(
            f"key {key!r} in {namespace!r} was used with a different request", namespace=namespace, key=key
        )
        self.detail = detail


class DeniedError(GuardError):
    """A kill switch, a run's budget, the tenant's quota or an approver refused the claim
    (fail closed). An approver's refusal is the subclass :class:`ApprovalDenied`."""

    def __init__(self, denied: Denied, *, namespace: str, key: str) -> None:
        super().__init__(
            f"claim of {key!r} in {namespace!r} denied ({denied.kind}): {denied.detail or denied.reason}",
            namespace=namespace,
            key=key,
        )
        self.denied = denied

    @property
    def kind(self) -> str:
        """``switch``, ``budget``, ``quota``, ``approval`` or ``recovery``."""
        return self.denied.kind

    @property
    def reason(self) -> dict[str, Any]:
        """The server's ``reason`` object, e.g. ``{"reason": "budget_exhausted", "limit": "cost"}``."""
        return self.denied.reason

    @property
    def retry_after(self) -> float | None:
        """Seconds until a retry may succeed (quotas), else ``None``."""
        return self.denied.retry_after


class ApprovalDenied(DeniedError):
    """An approver denied this call (``kind`` ``approval``): every claim of the key with this
    request is refused, now and later. Nothing was done. A new request (other arguments) is a
    new call, which a key bound to this one refuses as a :class:`KeyConflict`."""

    @property
    def approval_id(self) -> str:
        """The id of the denied approval (``apr_…``)."""
        return str(self.reason.get("approval", ""))

    @property
    def by(self) -> str:
        """The id of the admin API key that denied it."""
        return str(self.reason.get("by", ""))

    @property
    def why(self) -> str:
        """The approver's reason."""
        return str(self.reason.get("why", ""))


class RecoveryNeedsVerify(DeniedError):
    """The key's last attempt did not finish and may have done its effect, and the namespace's
    recovery policy is ``verify`` (``kind`` ``recovery``): only a call given a ``verify`` hook
    (which checks downstream whether the effect happened before running it again) may take the
    key over. Nothing was run or changed. Pass ``verify=`` to :func:`onceguard.once` (or the
    framework helper), or ask an operator to resolve the key."""

    def __init__(self, denied: Denied, *, namespace: str, key: str) -> None:
        GuardError.__init__(
            self,
            f"the last attempt at {key!r} in {namespace!r} did not finish and may have run; the namespace's "
            "recovery policy is 'verify', so it is not run again without a verify hook: pass verify= "
            "(a function checking whether the effect happened) or ask an operator to resolve the key",
            namespace=namespace,
            key=key,
        )
        self.denied = denied


def denied_error(denied: Denied, *, namespace: str, key: str) -> DeniedError:
    """The guard's exception for a denial: :class:`ApprovalDenied` for an approver's,
    :class:`RecoveryNeedsVerify` for the recovery policy's."""
    cls: type[DeniedError] = {"approval": ApprovalDenied, "recovery": RecoveryNeedsVerify}.get(denied.kind, DeniedError)
    return cls(denied, namespace=namespace, key=key)


class AwaitingApproval(GuardError):
    """The call's namespace requires a person's approval, and none is given yet (still, after
    the guard's ``wait_for_approval`` if it had one). Nothing was done, acquired or charged:
    call again with the same arguments later (after ``retry_after`` seconds); once approved,
    the call runs once.

    ``approval`` is the server's :class:`onceguard.Approval` (its ``id``, ``summary``,
    ``expires_at``…); :attr:`model_message` is what the framework tool guards tell a model.
    """

    def __init__(self, approval: Approval, *, namespace: str, key: str, retry_after: float) -> None:
        super().__init__(
            f"the call of key {key!r} in {namespace!r} awaits a person's approval ({approval.id}); "
            f"nothing was done: call again with the same arguments later (retry after {retry_after:.3f}s)",
            namespace=namespace,
            key=key,
        )
        self.approval = approval
        self.retry_after = retry_after

    @property
    def model_message(self) -> str:
        """The refusal as a tool's answer to a model."""
        return (
            f"This call awaits a person's approval (approval {self.approval.id}). Nothing was done. "
            "Call the tool again later with the same arguments: it runs once approved."
        )


class PermanentFailure(GuardError):
    """The guarded function failed permanently (an exception class named ``permanent``) and the
    failure is stored: the first caller and every later caller get this same exception.

    ``error`` is the stored JSON: ``{"type": "module.Class", "message": "..."}``.
    """

    def __init__(self, error: Any, *, namespace: str, key: str, replayed: bool) -> None:
        self.error = error
        self.replayed = replayed
        info = error if isinstance(error, dict) else {}
        self.error_type: str = str(info.get("type", ""))
        self.error_message: str = str(info.get("message", error if not isinstance(error, dict) else ""))
        super().__init__(
            f"{self.error_type or 'failure'}: {self.error_message} (stored failure of key {key!r} in {namespace!r})",
            namespace=namespace,
            key=key,
        )


class ResultNotKept(OnceguardError):
    """The effect ran once, and its namespace keeps only a digest of the outcome
    (``outcome_kept: digest`` in its settings): the size and SHA-256 of its bytes, never the
    bytes. There is no result to return, and the function is not run again.

    Raised by ``.result`` of a :class:`onceguard.Replay` or :class:`onceguard.StoredOutcome`
    that has a ``digest``, and by ``once``, ``guarded``, ``once_each`` and the framework guards
    on such a replay (those set ``namespace`` and ``key``). ``status`` is ``success``, or
    ``failure`` for a stored permanent failure.
    """

    def __init__(
        self, digest: ResultDigest, *, status: str = "success", namespace: str | None = None, key: str | None = None
    ) -> None:
        what = "the effect" if key is None else f"the call of key {key!r} in {namespace!r}"
        failed = " and failed" if status == "failure" else ""
        super().__init__(
            f"{what} already ran once{failed}; its result is not kept: its namespace keeps only a digest "
            f"({digest.size} bytes, sha256 {digest.sha256})"
        )
        self.digest = digest
        self.status = status
        self.namespace = namespace
        self.key = key
