"""An attempt's logic, without I/O, shared by the sync and async guards: the policy (with the
compensation an effect registers), reading a claim's answer into what the attempt does, the
state of an attempt, and the attempt running in this context. The guards (``_async/guard.py``
and the ``_sync`` twin generated from it) do the calls around it; the protocol is told in
:mod:`onceguard.guard`."""

from __future__ import annotations

import contextvars
import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Sequence, Union

from ._undo import check_undo_name, register_undo
from ._wire import Duration, RawJson, dumps, duration_seconds
from .errors import AwaitingApproval, InFlightError, KeyConflict, PermanentFailure, ResultNotKept, StaleFence, denied_error
from .keys import jsonable
from .models import (
    Acquired,
    Checkpoint,
    ClaimAnswer,
    Compensation,
    Denied,
    InFlight,
    Mismatch,
    PendingApproval,
    Proceed,
    Recovery,
    Replay,
)

ExceptionClasses = Union[type[BaseException], Sequence[type[BaseException]]]

#: The longest ``wait`` the server takes on one claim: a longer ``wait_for_approval`` is
#: waited for by claiming again, each claim waiting at most this long.
MAX_CLAIM_WAIT = 30.0


@dataclass(frozen=True)
class Happened:
    """What a ``verify`` hook answers when the effect of an earlier attempt did happen: its
    ``result`` (stored as the key's outcome, ``reconciled``, instead of running the function),
    and what it cost (``cost`` units, model ``tokens``), counted as by a completion."""

    result: Any
    cost: int | None = None
    tokens: int | None = None


#: A ``verify`` hook: called with the key, the recovering attempt's fence and the last
#: checkpoint of the earlier attempts (``None`` if they saved none); answers
#: :class:`Happened` or ``None`` (it did not happen: run the function). A coroutine
#: function for coroutines.
Verify = Callable[[str, int, Union[Checkpoint, None]], Any]


def exception_classes(value: ExceptionClasses) -> tuple[type[BaseException], ...]:
    """The classes of a ``permanent=``, ``unknown=`` or ``retryable=`` argument."""
    return (value,) if isinstance(value, type) else tuple(value)


#: The largest compensation ``data`` the server takes, serialized.
MAX_COMPENSATION_DATA = 16 * 1024


@dataclass(frozen=True)
class Undo:
    """The compensation a guarded effect registers when it completes: its ``name``, and its
    data: ``data(result)`` if given, else the result as stored."""

    name: str
    data: Callable[[Any], Any] | None = None

    @classmethod
    def of(
        cls, undo: Callable[..., Any] | None, name: str | None, data: Callable[[Any], Any] | None
    ) -> Undo | None:
        """The guard's compensation, its undo function registered (see :mod:`onceguard._undo`)."""
        if undo is None and name is None:
            if data is not None:
                raise TypeError("undo_data= needs undo= (or undo_name=)")
            return None
        if data is not None and not callable(data):
            raise TypeError("undo_data is a function of the result, answering the compensation's data")
        if undo is None:
            return cls(check_undo_name(str(name)), data)  # a worker elsewhere knows the name
        return cls(register_undo(undo, name), data)

    def compensation(self, value: Any, text: str) -> Compensation:
        """The compensation of an effect whose result is ``value``, stored as ``text``. Raises
        what ``data`` raises, ``TypeError`` for data that is not JSON, ``ValueError`` for data
        larger than the server takes."""
        data = text if self.data is None else dumps(jsonable(self.data(value)))
        size = len(data.encode("utf-8"))
        if size > MAX_COMPENSATION_DATA:
            raise ValueError(
                f"the data of the compensation {self.name!r} is {size} bytes, more than {MAX_COMPENSATION_DATA}: "
                "give undo_data= a function answering less"
            )
        return Compensation(self.name, RawJson(data))


@dataclass(frozen=True)
class Policy:
    """How a guard claims, runs and stores (shared by ``once``, ``guarded`` and the helpers)."""

    namespace: str
    lease: float = 30.0
    retention: Duration | None = None
    wait: Duration | None = 10.0
    cost: int | None = None
    permanent: tuple[type[BaseException], ...] = ()
    unknown: tuple[type[BaseException], ...] = ()
    encode: Callable[[Any], Any] = jsonable
    decode: Callable[[Any], Any] = field(default=lambda value: value)
    heartbeat: bool = True
    #: Seconds to wait for a person's decision on a call pending approval; ``None``: none.
    wait_for_approval: float | None = None
    verify: Verify | None = None
    #: The compensation a completion registers (``undo=``), if any.
    undo: Undo | None = None

    @classmethod
    def of(
        cls,
        namespace: str,
        *,
        lease: Duration = 30.0,
        retention: Duration | None = None,
        wait: Duration | None = 10.0,
        cost: int | None = None,
        permanent: ExceptionClasses = (),
        unknown: ExceptionClasses = (),
        encode: Callable[[Any], Any] | None = None,
        decode: Callable[[Any], Any] | None = None,
        heartbeat: bool = True,
        wait_for_approval: Duration | None = None,
        verify: Verify | None = None,
        undo: Callable[..., Any] | None = None,
        undo_name: str | None = None,
        undo_data: Callable[[Any], Any] | None = None,
    ) -> Policy:
        if verify is not None and not callable(verify):
            raise TypeError("verify is a function of (key, fence, last checkpoint)")
        return cls(
            namespace=namespace,
            lease=duration_seconds(lease),
            retention=retention,
            wait=wait,
            cost=cost,
            permanent=exception_classes(permanent),
            unknown=exception_classes(unknown),
            encode=encode or jsonable,
            decode=decode or (lambda value: value),
            heartbeat=heartbeat,
            wait_for_approval=None if wait_for_approval is None else duration_seconds(wait_for_approval),
            verify=verify,
            undo=Undo.of(undo, undo_name, undo_data),
        )

    def classify(self, exc: BaseException) -> str:
        """``permanent``, ``unknown`` or ``retryable``."""
        if isinstance(exc, self.permanent):
            return "permanent"
        if isinstance(exc, self.unknown) or not isinstance(exc, Exception):
            return "unknown"
        return "retryable"


def failure_of(exc: BaseException) -> dict[str, str]:
    """The stored JSON of a permanent failure."""
    cls = type(exc)
    return {"type": f"{cls.__module__}.{cls.__qualname__}", "message": str(exc)}


@dataclass
class Replayed:
    """A replayed claim, with its value decoded."""

    replay: Replay
    value: Any


def still_waiting(answer: ClaimAnswer) -> bool:
    """Whether a guard waiting for a person's decision claims again after ``answer``: still
    pending, or in flight (approved, and another caller holds the key: its replay is waited for)."""
    return isinstance(answer, (PendingApproval, InFlight))


def interpret(answer: ClaimAnswer, policy: Policy, key: str) -> Acquired | Replayed | Proceed:
    """An acquired claim, the replayed value, or observe mode's ``proceed`` (run, holding
    nothing); raises for the other answers, and for a replay whose namespace keeps only a
    digest (there is no value, and it must not run again)."""
    ns = policy.namespace
    if isinstance(answer, (Acquired, Proceed)):
        return answer
    if isinstance(answer, Replay):
        if answer.digest is not None:
            raise ResultNotKept(answer.digest, status=answer.status, namespace=ns, key=key)
        if answer.status != "success":
            raise PermanentFailure(answer.result, namespace=ns, key=key, replayed=True)
        return Replayed(answer, policy.decode(answer.result))
    if isinstance(answer, InFlight):
        raise InFlightError(namespace=ns, key=key, retry_after=answer.retry_after, attempt=answer.attempt)
    if isinstance(answer, Mismatch):
        raise KeyConflict(namespace=ns, key=key, detail=answer.detail)
    if isinstance(answer, Denied):
        raise denied_error(answer, namespace=ns, key=key)
    if isinstance(answer, PendingApproval):
        raise AwaitingApproval(answer.approval, namespace=ns, key=key, retry_after=answer.retry_after)
    raise TypeError(f"not a claim answer: {answer!r}")  # pragma: no cover


class AttemptBase:
    """What sync and async attempts share: the claim's facts and the result."""

    def __init__(self, policy: Policy, key: str, found: Acquired | Replayed | Proceed) -> None:
        self.namespace = policy.namespace
        self.key = key
        self._policy = policy
        self._completed = False
        #: complete() was called: the effect happened, so a failure to store it must not release
        #: the key (it is reported unknown instead).
        self._effect_done = False
        self._result: Any = None
        #: Cost units (money) to report when the attempt completes or fails (optional).
        self.cost: int | None = None
        #: Model tokens to report when the attempt completes or fails (optional): every replay
        #: counts them as saved.
        self.tokens: int | None = None
        self.recovery: Recovery | None
        self.lease_expires_at: datetime | None
        #: The outcome was stored by a recovering attempt as what happened downstream (a
        #: ``verify`` hook answered :class:`Happened`), without running the effect.
        self.reconciled = False
        #: Observe mode's answer where enforcing would not have let this call run
        #: (``would_have_been``, ``reason``): the call runs holding nothing (``fence`` and
        #: ``attempt`` are 0), and its result is returned (as a stored one would be), not stored.
        self.observed: Proceed | None = None
        if isinstance(found, Proceed):
            self.replayed = False
            self.observed = found
            self.fence = 0
            self.attempt = 0
            self.recovery = None
            self.lease_expires_at = None
        elif isinstance(found, Replayed):
            self.replayed = True
            self.fence = found.replay.fence
            self.attempt = found.replay.attempt
            self.recovery = None
            self.lease_expires_at = None
            self._result = found.value
            self._completed = True
            self.reconciled = found.replay.reconciled
        else:
            self.replayed = False
            self.fence = found.fence
            self.attempt = found.attempt
            self.recovery = found.recovery
            self.lease_expires_at = found.lease_expires_at
        self._lost: StaleFence | None = None

    @property
    def result(self) -> Any:
        """The replayed (or reconciled) value; or, in a block, the value to complete with when
        it ends (default ``None``); after completion, the value decoded from the stored bytes."""
        return self._result

    @result.setter
    def result(self, value: Any) -> None:
        if self._completed:
            raise RuntimeError("the outcome is stored already")
        self._result = value

    @property
    def completed(self) -> bool:
        """Whether the outcome is stored (always, for a replay)."""
        return self._completed

    @property
    def lease_lost(self) -> bool:
        """Whether the heartbeat found the lease taken over (completing will raise StaleFence)."""
        return self._lost is not None

    def _serialize(self, value: Any) -> str:
        return dumps(self._policy.encode(value))

    def _stored(self, text: str) -> Any:
        self._completed = True
        self._result = self._policy.decode(json.loads(text))
        return self._result

    def _reconciled(self, text: str) -> Any:
        """The outcome ``verify`` found is stored: the attempt is over, as for a replay (a block
        that checks ``replayed`` does not do the effect)."""
        self.replayed = True
        self.reconciled = True
        return self._stored(text)

    def _require_holder(self) -> None:
        if self.replayed:
            raise RuntimeError("this key replayed: there is no attempt to checkpoint or complete")

    def _observed_result(self, value: Any) -> Any:
        """Observe mode: the result is ``value`` as every caller gets a stored one (encoded,
        then decoded), but nothing is stored."""
        return self._stored(self._serialize(value))

    def _compensation(self, value: Any, text: str) -> Compensation | None:
        """The compensation completing with ``value`` (stored as ``text``) registers, if any."""
        undo = self._policy.undo
        return None if undo is None else undo.compensation(value, text)

    def __repr__(self) -> str:
        state = "replayed" if self.replayed else "observed" if self.observed else f"attempt {self.attempt}"
        return f"<{type(self).__name__} {self.namespace}/{self.key} fence={self.fence} {state}>"


#: The attempt of the guarded function (or block) running in this context (see
#: :func:`onceguard.current`).
running: contextvars.ContextVar[AttemptBase | None] = contextvars.ContextVar("onceguard_attempt", default=None)


def interval(lease: float) -> float:
    """Seconds between two heartbeats: a third of the lease."""
    return max(lease / 3, 0.03)


def detail_of(exc: BaseException) -> str:
    """The detail of an unknown outcome that ``exc`` caused."""
    return f"{type(exc).__qualname__}: {exc}"[:1000]
