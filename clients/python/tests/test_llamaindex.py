"""``OnceEmbedding`` in LlamaIndex's ``IngestionPipeline`` (and an index), with a deterministic
fake embedding model that counts the texts, calls and tokens it embedded (no network)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import pickle
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import pytest
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import BaseNode, MetadataMode, TextNode

import onceguard
from onceguard.llamaindex import OnceEmbedding

ROOT = Path(__file__).resolve().parents[1]


def vector(text: str, size: int = 8) -> list[float]:
    return [b / 255 for b in hashlib.sha256(text.encode()).digest()[:size]]


def words(text: str) -> int:
    """The fake model's tokens: one per word."""
    return len(text.split())


class CountingModel(BaseEmbedding):
    """A fake model: a text's vector from its digest; it counts every text, call and token it
    embedded. ``fail_on_call=n`` makes its n-th call raise; ``exit_on_call=n`` makes its n-th call
    end the process (a crash: the call's keys stay held); ``gate`` is waited for before any
    text is embedded."""

    model_name: str = "fake-8"
    fail_on_call: int | None = None
    exit_on_call: int | None = None
    _embedded: list[str] = PrivateAttr(default_factory=list)
    _queries: list[str] = PrivateAttr(default_factory=list)
    _calls: int = PrivateAttr(default=0)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _gate: Any = PrivateAttr(default=None)

    def gated(self, gate: threading.Event | asyncio.Event) -> CountingModel:
        self._gate = gate
        return self

    @property
    def embedded(self) -> list[str]:
        return list(self._embedded)

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def tokens(self) -> int:
        return sum(words(t) for t in self._embedded)

    @property
    def queries(self) -> list[str]:
        return list(self._queries)

    def _embed(self, texts: list[str]) -> list[list[float]]:
        with self._lock:
            self._calls += 1
            if self._calls == self.exit_on_call:
                os._exit(137)
            if self._calls == self.fail_on_call:
                raise RuntimeError("the model is down")
            self._embedded.extend(texts)
        return [vector(t) for t in texts]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        if isinstance(self._gate, threading.Event) and not self._gate.wait(10):
            raise AssertionError("the other worker never met a key this one held")
        return self._embed(texts)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        if isinstance(self._gate, asyncio.Event):
            await asyncio.wait_for(self._gate.wait(), 10)
        return self._embed(texts)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]

    def _get_query_embedding(self, query: str) -> list[float]:
        self._queries.append(query)
        return vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._get_query_embedding(query)


class WatchedClient(onceguard.Client):
    """A client that notes when one of its claims found a key held by another worker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.contended = threading.Event()

    def claim_batch(self, items: Sequence[onceguard.ClaimItem]) -> list[onceguard.ClaimAnswer]:
        answers = super().claim_batch(items)
        if any(isinstance(a, onceguard.InFlight) for a in answers):
            self.contended.set()
        return answers


class WatchedAsyncClient(onceguard.AsyncClient):
    """:class:`WatchedClient` for asyncio."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.contended = asyncio.Event()

    async def claim_batch(self, items: Sequence[onceguard.ClaimItem]) -> list[onceguard.ClaimAnswer]:
        answers = await super().claim_batch(items)
        if any(isinstance(a, onceguard.InFlight) for a in answers):
            self.contended.set()
        return answers


def handbook(n: int) -> list[Document]:
    """``n`` short documents, one node each, with metadata that is part of the embedded text."""
    return [
        Document(text=f"Section {i}: refunds of order class {i % 7} need approval.", metadata={"page": i}, doc_id=f"hb-{i}")
        for i in range(n)
    ]


def pipeline(embed: OnceEmbedding) -> IngestionPipeline:
    """A fresh pipeline (its own, empty, ``IngestionCache``), as a new process would have."""
    return IngestionPipeline(transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0), embed])


def text_of(node: BaseNode) -> str:
    return node.get_content(metadata_mode=MetadataMode.EMBED)


def assert_embedded_in_order(nodes: Sequence[BaseNode], n: int) -> None:
    assert [node.ref_doc_id for node in nodes] == [f"hb-{i}" for i in range(n)]
    assert [node.embedding for node in nodes] == [vector(text_of(node)) for node in nodes]
    assert all("page: " in text_of(node) for node in nodes), "the metadata is part of the text and the key"


def test_a_rerun_of_the_pipeline_embeds_each_node_once(client: onceguard.Client, ns: str) -> None:
    model = CountingModel()
    first = OnceEmbedding(model, client, ns, batch_size=10, tokens=words)
    nodes = pipeline(first).run(documents=handbook(30))
    assert_embedded_in_order(nodes, 30)
    texts = [text_of(node) for node in nodes]
    assert model.embedded == texts and model.calls == 3, "30 texts in 3 batches, each once"
    assert first.texts_saved == 0 and first.tokens_saved == 0
    paid = model.tokens

    # A re-run after a redeploy: a new pipeline and wrapper, one new document.
    again = OnceEmbedding(model, client, ns, batch_size=10, tokens=words)
    nodes_again = pipeline(again).run(documents=handbook(31))
    assert_embedded_in_order(nodes_again, 31)
    assert [node.embedding for node in nodes_again[:30]] == [node.embedding for node in nodes]
    assert model.embedded[30:] == [text_of(nodes_again[30])], "only the new node was embedded"
    assert again.texts_saved == 30 and again.tokens_saved == paid

    # Another model name is another key.
    OnceEmbedding(model, client, ns, model="fake-8-v2").get_text_embedding_batch(texts[:2])
    assert model.embedded[31:] == texts[:2]


def test_a_run_that_fails_half_way_leaves_only_the_rest_to_the_next(client: onceguard.Client, ns: str) -> None:
    broken = CountingModel(fail_on_call=2)
    with pytest.raises(RuntimeError, match="the model is down"):
        pipeline(OnceEmbedding(broken, client, ns, batch_size=10)).run(documents=handbook(30))
    assert len(broken.embedded) == 10, "the first batch was embedded (and stored) before the failure"

    model = CountingModel()
    again = OnceEmbedding(model, client, ns, batch_size=10)
    nodes = pipeline(again).run(documents=handbook(30))
    assert_embedded_in_order(nodes, 30)
    texts = [text_of(node) for node in nodes]
    assert model.embedded == texts[10:], "the failed batch was released, the stored one replayed"
    assert again.texts_saved == 10 and again.tokens_saved == sum(max(1, len(t) // 4) for t in texts[:10])


def ingest_and_die(url: str, api_key: str, namespace: str) -> None:
    """The crashing worker of the next test, run in its own process: its model ends the
    process when asked for its second batch, whose keys stay held until their leases pass."""
    with onceguard.Client(url, api_key) as client:
        model = CountingModel(exit_on_call=2)
        pipeline(OnceEmbedding(model, client, namespace, batch_size=10, lease="2s")).run(documents=handbook(30))
    raise SystemExit("the worker was meant to die on its second batch")


def test_after_a_worker_died_half_way_a_rerun_embeds_only_the_rest(
    server: Any, agent_key: str, client: onceguard.Client, ns: str
) -> None:
    code = f"from tests.test_llamaindex import ingest_and_die; ingest_and_die({server.url!r}, {agent_key!r}, {ns!r})"
    died = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert died.returncode == 137, died.stderr

    model = CountingModel()
    again = OnceEmbedding(model, client, ns, batch_size=10, lease="2s")
    nodes = pipeline(again).run(documents=handbook(30))  # waits for the held keys' leases, then recovers them
    assert_embedded_in_order(nodes, 30)
    texts = [text_of(node) for node in nodes]
    assert model.embedded == texts[10:], "the dead worker's stored batch replayed; its held one was embedded once"
    assert again.texts_saved == 10


def test_two_workers_at_once_embed_each_text_exactly_once(server: Any, agent_key: str, ns: str) -> None:
    with WatchedClient(server.url, agent_key) as client:
        # No text is embedded until one worker's claim has met a key the other holds.
        model = CountingModel().gated(client.contended)
        embeds = [OnceEmbedding(model, client, ns, batch_size=10, tokens=words) for _ in range(2)]
        out: dict[int, Sequence[BaseNode]] = {}
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                out[i] = pipeline(embeds[i]).run(documents=handbook(40))
            except BaseException as e:  # reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert client.contended.is_set()
    for nodes in out.values():
        assert_embedded_in_order(nodes, 40)
    assert sorted(model.embedded) == sorted(text_of(node) for node in out[0]), f"{len(model.embedded)} for 40"
    assert sum(e.texts_saved for e in embeds) == 40, "what one embedded the other replayed"
    assert sum(e.tokens_saved for e in embeds) == model.tokens


async def test_two_async_pipelines_at_once_embed_each_text_exactly_once(
    client: onceguard.Client, server: Any, agent_key: str, ns: str
) -> None:
    async with WatchedAsyncClient(server.url, agent_key) as aclient:
        model = CountingModel().gated(aclient.contended)
        embeds = [OnceEmbedding(model, client, ns, aclient=aclient, batch_size=10) for _ in range(2)]
        runs = await asyncio.gather(*(pipeline(e).arun(documents=handbook(40)) for e in embeds))
        assert aclient.contended.is_set()
    for nodes in runs:
        assert_embedded_in_order(nodes, 40)
    assert sorted(model.embedded) == sorted(text_of(node) for node in runs[0]), f"{len(model.embedded)} for 40"
    assert sum(e.texts_saved for e in embeds) == 40


def test_as_an_index_embed_model_it_stores_texts_and_passes_queries_through(
    client: onceguard.Client, ns: str
) -> None:
    texts = [f"policy {i}: a refund over {10 * i} euros needs a second approver" for i in range(5)]
    model = CountingModel()
    VectorStoreIndex([TextNode(text=t) for t in texts], embed_model=OnceEmbedding(model, client, ns))
    embed = OnceEmbedding(model, client, ns)
    index = VectorStoreIndex([TextNode(text=t) for t in texts], embed_model=embed)
    assert model.embedded == texts and embed.texts_saved == 5, "the second index replayed every text"
    retriever = index.as_retriever(similarity_top_k=1)
    for _ in range(2):
        [hit] = retriever.retrieve(texts[3])
        assert hit.node.get_content() == texts[3]
    assert model.queries == [texts[3]] * 2, "queries are embedded by the model each time, never stored"
    assert embed.get_text_embedding(texts[0]) == vector(texts[0]) and model.embedded == texts


def test_it_refuses_to_be_sent_to_another_process(client: onceguard.Client, ns: str) -> None:
    # IngestionPipeline.run(num_workers=2) pickles its transformations for its worker processes.
    with pytest.raises(TypeError, match="make one in each worker process"):
        pickle.dumps(OnceEmbedding(CountingModel(), client, ns))
