"""``OnceEmbeddings`` over LangChain's ``Embeddings`` interface (a deterministic fake model that
counts what it embedded; no network)."""

from __future__ import annotations

import hashlib
import threading
import time

from langchain_core.embeddings import Embeddings

import onceguard
from onceguard.langchain import OnceEmbeddings


def vector(text: str, size: int) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [b / 255 for b in digest[:size]]


class CountingModel(Embeddings):
    """A fake model: a text's vector from its digest; it counts every text it embedded."""

    def __init__(self, size: int, delay: float = 0.0) -> None:
        self.size, self.delay = size, delay
        self.embedded: list[str] = []
        self.lock = threading.Lock()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        time.sleep(self.delay)
        with self.lock:
            self.embedded.extend(texts)
        return [vector(t, self.size) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return vector(text, self.size)


def test_a_reingestion_embeds_only_new_texts_and_counts_what_it_saved(client: onceguard.Client, ns: str) -> None:
    model = CountingModel(8)
    once = OnceEmbeddings(model, client, ns, model="fake-8")
    corpus = [f"chunk {i} of the handbook" for i in range(30)]
    first = once.embed_documents(corpus)
    assert first == [vector(t, 8) for t in corpus]
    assert sorted(model.embedded) == sorted(corpus) and once.texts_saved == 0
    again = once.embed_documents([*corpus, "a new page"])
    assert again[:30] == first
    assert model.embedded[30:] == ["a new page"], "only the new text was embedded"
    assert once.texts_saved == 30 and once.tokens_saved == sum(max(1, len(t) // 4) for t in corpus)
    # The server was told each text's tokens: its replays count them as saved.
    replay = client.claim(ns, once.key(corpus[0]), request=once.key(corpus[0]))
    assert isinstance(replay, onceguard.Replay) and replay.tokens == max(1, len(corpus[0]) // 4)
    # Another model is another key: embedded again.
    OnceEmbeddings(model, client, ns, model="fake-8-v2").embed_documents(corpus[:2])
    assert model.embedded[31:] == corpus[:2]


def test_two_ingestion_workers_never_embed_a_chunk_twice(client: onceguard.Client, ns: str) -> None:
    model = CountingModel(4, delay=0.2)
    corpus = [f"doc {i}" for i in range(40)]
    out: list[list[list[float]]] = []

    def worker() -> None:
        out.append(OnceEmbeddings(model, client, ns, batch_size=10).embed_documents(corpus))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 2 and out[0] == out[1]
    assert sorted(model.embedded) == sorted(corpus), f"{len(model.embedded)} embeddings for 40 chunks"


async def test_the_async_path_replays_too(client: onceguard.Client, aclient: onceguard.AsyncClient, ns: str) -> None:
    model = CountingModel(4)
    once = OnceEmbeddings(model, client, ns, aclient=aclient)
    first = await once.aembed_documents(["a", "b"])
    assert await once.aembed_documents(["a", "b"]) == first
    assert model.embedded == ["a", "b"] and once.texts_saved == 2
