"""Call another agent through ``onceguard a2a`` (the A2A gateway, docs/A2A.md) with one stable
key per send: each step of a run is sent once, however often the orchestrator is re-run,
resumed or retries.

.. code-block:: python

    import httpx
    from a2a.client import ClientConfig, create_client
    from a2a.types.a2a_pb2 import Message, Part, Role, SendMessageRequest
    from onceguard.a2a import OnceA2AClient

    http = httpx.AsyncClient(headers={"x-onceguard-key": token})
    client = await create_client(gateway_url, client_config=ClientConfig(httpx_client=http))
    billing = OnceA2AClient(client, run_id="order-1234")
    refund = Message(role=Role.ROLE_USER, parts=[Part(text="refund order 1234")])
    async for event in billing.send_message(SendMessageRequest(message=refund), step="refund"):
        ...

The gateway keys a send by its ``Idempotency-Key`` header, scoped to the caller's API key, and
charges it to the run its ``X-Onceguard-Run-Id`` header names. :class:`OnceA2AClient` sends
both with every message, the key derived from the run and the step (:func:`step_key`), and
fills an empty ``messageId`` with the same key, so the message reads the same on every retry.

Needs the ``a2a`` extra (``pip install 'onceguard[a2a]'``: ``a2a-sdk`` 1.x).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import TracebackType

from a2a.client import Client, ClientCallContext
from a2a.types.a2a_pb2 import SendMessageRequest, StreamResponse

from .keys import check_label, derive_key

__all__ = ["IDEMPOTENCY_KEY_HEADER", "RUN_HEADER", "OnceA2AClient", "step_key"]

#: The header the gateway takes a send's key from (else the message's ``messageId``).
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
#: The header naming the run a send is charged to (its budget, and a switch on it).
RUN_HEADER = "X-Onceguard-Run-Id"

_OURS = frozenset({IDEMPOTENCY_KEY_HEADER.lower(), RUN_HEADER.lower()})


def step_key(run_id: str, step: str, *, version: str = "v1") -> str:
    """The key of ``step`` of the run ``run_id``: ``a2a:<version>:<sha256 hex>`` of the
    canonical ``{"run": run_id, "step": step}`` (:func:`onceguard.derive_key` with the name
    ``a2a``), 71 characters for the default version, whatever the run and the step are; the
    TypeScript client's ``a2aKey(run, step)`` is the same key. ``run_id`` is a run the gateway
    takes (1 to 128 bytes of printable ASCII without spaces) and ``step`` a non-empty string,
    else ``ValueError``.

    The same run and step give the same key in every process, so a re-run, a resumed
    orchestrator or a retry of the step is answered with the first send's task instead of
    starting another. Bump ``version`` when a step's message changes meaning: a key sent again
    with another message is refused (``fingerprint-mismatch``, JSON-RPC error 42201).
    """
    if not isinstance(step, str) or not step:
        raise ValueError(f"a step is a non-empty string, not {step!r}")
    return derive_key("a2a", version, {"run": _check_run(run_id), "step": step})


def _check_run(run_id: str) -> str:
    """``run_id`` if the gateway takes it as a run: 1 to 128 bytes of printable ASCII without
    spaces (the gateway refuses any other with JSON-RPC error -32602)."""
    if not isinstance(run_id, str) or not run_id or len(run_id) > 128 or not all("!" <= c <= "~" for c in run_id):
        raise ValueError(f"a run id is 1 to 128 bytes of printable ASCII without spaces, not {run_id!r}")
    return run_id


class OnceA2AClient:
    """An ``a2a-sdk`` :class:`~a2a.client.Client` (from ``ClientFactory``, connected to the
    gateway) whose sends are keyed by the steps of one run.

    Only :meth:`send_message` is wrapped; the other calls (``get_task``, ``cancel_task``,
    ``subscribe``…) go to :attr:`client`, which the gateway answers for the caller's own tasks.
    Closing the wrapper (``async with``, :meth:`close`) closes the client.
    """

    def __init__(self, client: Client, run_id: str, *, version: str = "v1") -> None:
        self._client = client
        self._run_id = _check_run(run_id)
        self._version = check_label("version", version, 32)

    @property
    def client(self) -> Client:
        """The wrapped client."""
        return self._client

    @property
    def run_id(self) -> str:
        """The run every send is charged to."""
        return self._run_id

    def key(self, step: str) -> str:
        """The key of ``step`` in this run (:func:`step_key`)."""
        return step_key(self._run_id, step, version=self._version)

    async def send_message(
        self, request: SendMessageRequest, *, step: str, context: ClientCallContext | None = None
    ) -> AsyncIterator[StreamResponse]:
        """``client.send_message(request)`` as the step ``step`` of the run: its events, as the
        client yields them (one ``task`` or ``message`` when the client does not stream).

        The call carries the step's key as ``Idempotency-Key`` and the run as
        ``X-Onceguard-Run-Id``, added to ``context``'s ``service_parameters`` (which the SDK's
        HTTP transports send as headers of this request only; ``context`` itself is not
        changed, and a header of the same name in it is replaced). A message without a
        ``messageId`` is sent with the key as its id, on a copy: ``request`` is not changed. The
        key decides at the gateway, so a step's message keeps its key whatever id it carries.
        """
        key = self.key(step)
        if not request.message.message_id:
            filled = SendMessageRequest()
            filled.CopyFrom(request)
            filled.message.message_id = key
            request = filled
        parameters = {k: v for k, v in ((context and context.service_parameters) or {}).items() if k.lower() not in _OURS}
        parameters[IDEMPOTENCY_KEY_HEADER] = key
        parameters[RUN_HEADER] = self._run_id
        if context is None:
            call = ClientCallContext(service_parameters=parameters)
        else:
            call = context.model_copy(update={"service_parameters": parameters})
        async for event in self._client.send_message(request, context=call):
            yield event

    async def close(self) -> None:
        """Closes the wrapped client."""
        await self._client.close()

    async def __aenter__(self) -> OnceA2AClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
