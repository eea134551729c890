"""Guard LangChain tools, for agents built with LangChain or LangGraph (``ToolNode``, the
prebuilt agents): each tool call's effect happens once per run, tool and arguments, however
often the model re-emits the call or the graph re-runs the node.

.. code-block:: python

    from onceguard.langchain import guard_tool

    refund = guard_tool(refund_tool, client, "prod/payments-agent",
                        run_id=lambda config: config["configurable"]["thread_id"])
    agent = create_react_agent(model, [refund])

``OnceEmbeddings`` wraps any LangChain ``Embeddings`` for ingestion: each text is embedded once
per (model, text digest), across re-runs and across workers running at once; the rest replays.

Needs the ``langchain`` extra (``pip install 'onceguard[langchain]'``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Mapping, Optional, Union

from langchain_core.callbacks import Callbacks
from langchain_core.embeddings import Embeddings
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, StructuredTool, ToolException

from ._attempts import ExceptionClasses, Policy
from ._embeddings import OnceTexts, model_name
from ._tools import KeyFn, Summary, ToolCall, arguments_of, run_guarded_async, run_guarded_sync, tool_key
from ._wire import Duration
from .client import AsyncClient, Client
from .errors import AwaitingApproval, InFlightError

__all__ = ["guard_tool", "OnceEmbeddings", "ToolAwaitingApproval", "ToolCall", "ToolInFlight"]

RunId = Union[str, Callable[[RunnableConfig], Optional[str]], None]


class ToolAwaitingApproval(AwaitingApproval, ToolException):
    """:class:`onceguard.AwaitingApproval` raised by a guarded tool, as a ``ToolException``
    too, whose message is the one for the model: the tool's ``handle_tool_error`` (e.g.
    ``True``) turns it into the tool's answer, as LangChain does for a tool's refusals; without
    it, it propagates like the other guard outcomes (catch ``AwaitingApproval``)."""

    def __init__(self, awaiting: AwaitingApproval) -> None:
        super().__init__(
            awaiting.approval, namespace=awaiting.namespace, key=awaiting.key, retry_after=awaiting.retry_after
        )
        self.args = (self.model_message,)


class ToolInFlight(InFlightError, ToolException):
    """:class:`onceguard.InFlightError` raised by a guarded tool (the call is already running,
    still after the guard's wait), as a ``ToolException`` too, whose message is the one for the
    model: the tool's ``handle_tool_error`` turns it into the tool's answer, telling the model
    the call is already running and when to call again."""

    def __init__(self, in_flight: InFlightError) -> None:
        super().__init__(
            namespace=in_flight.namespace, key=in_flight.key, retry_after=in_flight.retry_after, attempt=in_flight.attempt
        )
        self.args = (self.model_message,)


def _model_argument_names(tool: BaseTool) -> set[str] | None:
    """The arguments the model gives (not those injected at run time, such as the tool call id
    or the graph state), which alone make the key."""
    try:
        schema: Any = tool.tool_call_schema
    except Exception:  # pragma: no cover - a tool without a schema
        return None
    if isinstance(schema, Mapping):
        return set(schema.get("properties", {}))
    fields = getattr(schema, "model_fields", None)
    return set(fields) if fields is not None else None


def guard_tool(
    tool: BaseTool,
    client: Client | AsyncClient,
    namespace: str,
    *,
    run_id: RunId = None,
    key_fn: KeyFn | None = None,
    async_client: AsyncClient | None = None,
    lease: Duration = 30.0,
    retention: Duration | None = None,
    wait: Duration | None = 10.0,
    cost: int | None = None,
    permanent: ExceptionClasses = (),
    unknown: ExceptionClasses = (),
    summary: Summary = None,
) -> BaseTool:
    """A tool like ``tool`` (same name, description and arguments) whose every call is guarded.

    - The key is ``key_fn(ToolCall)`` if given, else ``<tool>:<sha256 of the canonical
      {"run", "tool", "arguments"}>``: a repeated call (same run, tool, arguments) replays the
      first one's stored result instead of running the tool again. The arguments are also the
      claim's request; a custom key reused with other arguments raises ``KeyConflict``.
    - ``run_id``: a string, or a function of the ``RunnableConfig`` (e.g. the LangGraph
      ``thread_id``); it is in the key and charged with the run's budget.
    - ``client`` is used for ``invoke``; ``ainvoke`` uses the async client (``client`` if it is
      one, or ``async_client``), else the sync client in a worker thread.
    - Failures follow ``once``: ``permanent`` classes are stored and replayed as
      ``PermanentFailure``, ``unknown`` classes reported unknown, others release the key. The
      tool's own ``handle_tool_error`` applies outside the guard, so an error turned into a
      message for the model is never stored as the tool's result.
    - The result is stored as JSON: the tool should return JSON-able values (strings, dicts…).
    - Where the namespace requires approval, ``summary`` (a string, or a function of the
      :class:`ToolCall`) tells the approver what the call does; a call pending approval does
      not run and raises :class:`ToolAwaitingApproval`, which the tool's ``handle_tool_error``
      turns into a message telling the model the call awaits a person's approval (its id),
      that nothing was done, and to call again later with the same arguments.
    - A call already running (another caller holds its key, still after ``wait``; a ``wait``
      longer than the lease, e.g. ``"45s"``, outlasts a holder that crashed) raises :class:`ToolInFlight`, which the
      tool's ``handle_tool_error`` turns into one sentence for the model: the call is already
      running, and when to call again.
    """
    sync_client = client if isinstance(client, Client) else None
    aclient = client if isinstance(client, AsyncClient) else async_client
    inner = tool.model_copy(update={"handle_tool_error": False, "handle_validation_error": False})
    model_args = _model_argument_names(tool)
    content_and_artifact = getattr(tool, "response_format", "content") == "content_and_artifact"
    policy = Policy.of(
        namespace,
        lease=lease,
        retention=retention,
        wait=wait,
        cost=cost,
        permanent=permanent,
        unknown=unknown,
        decode=(lambda v: tuple(v) if isinstance(v, list) and len(v) == 2 else v) if content_and_artifact else None,
    )

    def tool_call(config: RunnableConfig | None, kwargs: dict[str, Any]) -> tuple[ToolCall, str]:
        run = run_id(config or {}) if callable(run_id) else run_id
        given = {k: v for k, v in kwargs.items() if model_args is None or k in model_args}
        call = ToolCall(tool=tool.name, arguments=arguments_of(given), run=run)
        return call, tool_key(call, key_fn)

    def child_config(config: RunnableConfig | None, callbacks: Callbacks) -> RunnableConfig:
        out: RunnableConfig = dict(config or {})  # type: ignore[assignment]
        out["callbacks"] = callbacks
        return out

    def run_sync(config: RunnableConfig, callbacks: Callbacks = None, **kwargs: Any) -> Any:
        if sync_client is None:
            raise RuntimeError(f"tool {tool.name!r} is guarded with an AsyncClient: call it with ainvoke")
        call, key = tool_call(config, kwargs)
        try:
            return run_guarded_sync(
                sync_client, policy, key, call, lambda: inner.invoke(kwargs, child_config(config, callbacks)), summary
            )
        except AwaitingApproval as e:
            raise ToolAwaitingApproval(e) from None
        except InFlightError as e:
            raise ToolInFlight(e) from None

    async def run_async(config: RunnableConfig, callbacks: Callbacks = None, **kwargs: Any) -> Any:
        if aclient is None:
            return await asyncio.to_thread(run_sync, config, callbacks, **kwargs)
        call, key = tool_call(config, kwargs)

        async def invoke() -> Any:
            return await inner.ainvoke(kwargs, child_config(config, callbacks))

        try:
            return await run_guarded_async(aclient, policy, key, call, invoke, summary)
        except AwaitingApproval as e:
            raise ToolAwaitingApproval(e) from None
        except InFlightError as e:
            raise ToolInFlight(e) from None

    return StructuredTool(
        name=tool.name,
        description=tool.description,
        args_schema=tool.args_schema or tool.get_input_schema(),
        func=run_sync,
        coroutine=run_async,
        return_direct=tool.return_direct,
        response_format=tool.response_format,
        handle_tool_error=tool.handle_tool_error,
        handle_validation_error=tool.handle_validation_error,
        tags=tool.tags,
        metadata=tool.metadata,
        verbose=tool.verbose,
    )


class OnceEmbeddings(Embeddings):
    """LangChain ``Embeddings`` that embeds each document text once per (model, SHA-256 of the
    text) and replays it after: a re-run, a redeploy or a backfill over the same corpus embeds
    only the texts it has not seen, in batches, and two ingestion workers running at once never
    embed the same text twice (one waits for the other's vectors). Queries pass through: each
    is usually new.

    ``model`` names the embedding model in the key (default: the wrapped object's ``model`` or
    ``model_name``, else its class name): another model is another key. ``tokens`` counts a
    text's tokens (default: its length in characters / 4); :attr:`texts_saved` and
    :attr:`tokens_saved` add up what replays did not pay for. Give ``aclient`` for
    ``aembed_documents`` to run on the event loop (else it runs the sync path in a thread).
    """

    def __init__(
        self,
        embeddings: Embeddings,
        client: Client,
        namespace: str = "rag/embeddings",
        *,
        model: str | None = None,
        aclient: AsyncClient | None = None,
        batch_size: int = 1_000,
        lease: Duration = "5m",
        tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.embeddings = embeddings
        self._once = OnceTexts(
            client,
            namespace,
            model_name(embeddings, model),
            aclient=aclient,
            batch_size=batch_size,
            lease=lease,
            tokens=tokens,
        )

    @property
    def model(self) -> str:
        """The model's name in the keys."""
        return self._once.model

    @property
    def texts_saved(self) -> int:
        """Texts replayed instead of embedded, since this object was made."""
        return self._once.texts_saved

    @property
    def tokens_saved(self) -> int:
        """The tokens of :attr:`texts_saved`."""
        return self._once.tokens_saved

    def key(self, text: str) -> str:
        """The key of ``text``: the model and the text's digest (what the vector depends on)."""
        return self._once.key(text)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._once.embed(texts, self.embeddings.embed_documents)

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        return await self._once.aembed(texts, self.embeddings.aembed_documents, self.embeddings.embed_documents)

    def embed_query(self, text: str) -> list[float]:
        return self.embeddings.embed_query(text)

    async def aembed_query(self, text: str) -> list[float]:
        return await self.embeddings.aembed_query(text)
