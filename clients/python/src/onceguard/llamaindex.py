"""LlamaIndex ingestion: ``OnceEmbedding`` wraps any LlamaIndex embedding model so that each
node's text is embedded once per (model, text digest), across re-runs of an
``IngestionPipeline`` and across workers running it at once; the rest replays.

.. code-block:: python

    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from onceguard.llamaindex import OnceEmbedding

    embed = OnceEmbedding(OpenAIEmbedding(model="text-embedding-3-small"), client, "rag/embeddings")
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(), embed])
    nodes = pipeline.run(documents=documents)
    print(embed.texts_saved, embed.tokens_saved)

It is a ``BaseEmbedding``, hence also a ``TransformComponent``: the last step of a pipeline,
``Settings.embed_model``, or the ``embed_model`` of an index.

Needs the ``llamaindex`` extra (``pip install 'onceguard[llamaindex]'``).
"""

from __future__ import annotations

from typing import Any, Callable

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from ._embeddings import OnceTexts, model_name
from ._wire import Duration
from .client import AsyncClient, Client

__all__ = ["OnceEmbedding"]


class OnceEmbedding(BaseEmbedding):
    """A LlamaIndex embedding model that embeds each text once per (model, SHA-256 of the
    text) with ``embed_model`` and replays it after: an ``IngestionPipeline`` re-run, a
    redeploy or a second worker over the same nodes embeds only the texts no one has embedded,
    and two workers running at once never embed the same text twice (one waits for the
    other's vectors). The text of a node is what LlamaIndex embeds: its content with the
    metadata meant for embedding. Queries pass through: each is usually new.

    Texts are claimed and stored ``batch_size`` at a time (also the wrapper's
    ``embed_batch_size``); ``embed_model`` is given the texts still to embed and batches them
    its own way. ``model`` names the model in the key (default: ``embed_model.model_name``,
    else its class name): another model, or another setting that changes the vectors, needs
    another name. ``tokens`` counts a text's tokens (default: its length in characters / 4);
    :attr:`texts_saved` and :attr:`tokens_saved` add up what replays did not pay for. Give
    ``aclient`` for the async calls (``IngestionPipeline.arun``, ``aget_text_embedding_batch``)
    to run on the event loop; without it they run the sync path in a thread. Choose a ``lease``
    longer than one batch takes to embed.
    """

    embed_model: BaseEmbedding = Field(description="The model that embeds the texts not stored yet.")
    namespace: str = Field(default="rag/embeddings", description="The Onceguard namespace of the keys.")
    _once: OnceTexts = PrivateAttr()

    def __init__(
        self,
        embed_model: BaseEmbedding,
        client: Client,
        namespace: str = "rag/embeddings",
        *,
        model: str | None = None,
        aclient: AsyncClient | None = None,
        batch_size: int = 1_000,
        lease: Duration = "5m",
        tokens: Callable[[str], int] | None = None,
        **kwargs: Any,
    ) -> None:
        name = model_name(embed_model, model)
        super().__init__(  # type: ignore[call-arg]  # mypy sees only BaseEmbedding's own fields
            embed_model=embed_model, namespace=namespace, model_name=name, embed_batch_size=batch_size, **kwargs
        )
        self._once = OnceTexts(
            client, namespace, name, aclient=aclient, batch_size=batch_size, lease=lease, tokens=tokens
        )

    @classmethod
    def class_name(cls) -> str:
        return "OnceEmbedding"

    def __getstate__(self) -> dict[str, Any]:
        # LlamaIndex would drop the client and send a wrapper that cannot embed.
        raise TypeError(
            "OnceEmbedding holds an Onceguard client, which does not cross processes: make one in "
            "each worker process (IngestionPipeline.run(num_workers=...) would send this one)"
        )

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

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return self._once.embed(texts, self.embed_model.get_text_embedding_batch)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return await self._once.aembed(
            texts, self.embed_model.aget_text_embedding_batch, self.embed_model.get_text_embedding_batch
        )

    def _get_text_embedding(self, text: str) -> Embedding:
        return self._get_text_embeddings([text])[0]

    async def _aget_text_embedding(self, text: str) -> Embedding:
        return (await self._aget_text_embeddings([text]))[0]

    def _get_query_embedding(self, query: str) -> Embedding:
        return self.embed_model.get_query_embedding(query)

    async def _aget_query_embedding(self, query: str) -> Embedding:
        return await self.embed_model.aget_query_embedding(query)
