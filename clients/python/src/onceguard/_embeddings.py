"""What the embedding wrappers of the framework helpers share (``OnceEmbeddings`` in
``onceguard.langchain``, ``OnceEmbedding`` in ``onceguard.llamaindex``): each text is embedded
once per (model, SHA-256 of the text) through :func:`onceguard.once_each`, and what replays
did not pay for is counted. A wrapper only adapts its framework's interface to :class:`OnceTexts`.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import Counter
from typing import Any, Awaitable, Callable, Sequence

from ._async.ingest import once_each as once_each_async
from ._sync.ingest import once_each
from ._wire import Duration
from .client import AsyncClient, Client

#: A model's batch call: the texts to embed, answering one vector per text, in order.
EmbedMany = Callable[[list[str]], Sequence[Sequence[float]]]
AsyncEmbedMany = Callable[[list[str]], Awaitable[Sequence[Sequence[float]]]]


def model_name(embeddings: object, given: str | None) -> str:
    """The model's name in the keys: ``given``, else the wrapped object's ``model`` or
    ``model_name`` (but not LlamaIndex's placeholder ``"unknown"``), else its class name."""
    if given:
        return given
    for attribute in ("model", "model_name"):
        name = getattr(embeddings, attribute, None)
        if name and name != "unknown":
            return str(name)
    return type(embeddings).__name__


class OnceTexts:
    """Embeds texts once per (``model``, SHA-256 of the text) in ``namespace``: the stored
    vectors replay, the others are embedded ``batch_size`` at a time by the model's batch call
    and stored, and two workers at once never embed one text twice (one waits for the other's
    vectors). :attr:`texts_saved` and :attr:`tokens_saved` (``tokens``, default characters / 4)
    add up the replays; they are safe to update from many threads."""

    def __init__(
        self,
        client: Client,
        namespace: str,
        model: str,
        *,
        aclient: AsyncClient | None = None,
        batch_size: int = 1_000,
        lease: Duration = "5m",
        tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.client = client
        self.aclient = aclient
        self.namespace = namespace
        self.model = model
        self.batch_size = batch_size
        self.lease = lease
        self.tokens = tokens or (lambda text: max(1, len(text) // 4))
        self.texts_saved = 0
        self.tokens_saved = 0
        self._lock = threading.Lock()

    def key(self, text: str) -> str:
        """The key of ``text``: the model and the text's digest (what the vector depends on)."""
        return f"{self.model}:{hashlib.sha256(text.encode('utf-8')).hexdigest()}"

    def embed(self, texts: Sequence[str], embed_many: EmbedMany) -> list[Any]:
        """Every text's vector, in order, with ``embed_many`` called only for the texts that
        no one embedded yet."""
        embedded: list[str] = []

        def work(todo: list[str]) -> Sequence[Sequence[float]]:
            embedded.extend(todo)
            return embed_many(todo)

        vectors = once_each(
            self.client,
            self.namespace,
            texts,
            key=self.key,
            work=work,
            tokens=self._tokens_of,
            batch_size=self.batch_size,
            lease=self.lease,
        )
        self._count_saved(texts, embedded)
        return vectors

    async def aembed(self, texts: Sequence[str], aembed_many: AsyncEmbedMany, embed_many: EmbedMany) -> list[Any]:
        """:meth:`embed` on the event loop with the async client and ``aembed_many``; without
        an async client, :meth:`embed` with ``embed_many`` in a worker thread."""
        if self.aclient is None:
            return await asyncio.to_thread(self.embed, texts, embed_many)
        embedded: list[str] = []

        async def work(todo: list[str]) -> Sequence[Sequence[float]]:
            embedded.extend(todo)
            return await aembed_many(todo)

        vectors = await once_each_async(
            self.aclient,
            self.namespace,
            texts,
            key=self.key,
            work=work,
            tokens=self._tokens_of,
            batch_size=self.batch_size,
            lease=self.lease,
        )
        self._count_saved(texts, embedded)
        return vectors

    def _tokens_of(self, text: str, _vector: Any) -> int:
        """The tokens a text cost to embed, stored with its vector: the server counts them as
        saved by every replay (the dashboard's tokens saved per namespace)."""
        return self.tokens(text)

    def _count_saved(self, texts: Sequence[str], embedded: list[str]) -> None:
        left = Counter(embedded)
        replayed = []
        for text in texts:
            if left[text] > 0:
                left[text] -= 1
            else:
                replayed.append(text)
        with self._lock:
            self.texts_saved += len(replayed)
            self.tokens_saved += sum(self.tokens(t) for t in replayed)
