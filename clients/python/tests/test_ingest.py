"""``once_each``: many items, each done once per key, in batches, across re-runs and workers."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import onceguard


class Embedder:
    """A fake embedding model that counts the texts it embedded."""

    def __init__(self, delay: float = 0.0) -> None:
        self.texts: list[str] = []
        self.delay = delay
        self.lock = threading.Lock()

    def __call__(self, texts: list[str]) -> list[list[float]]:
        time.sleep(self.delay)
        with self.lock:
            self.texts.extend(texts)
        return [[float(len(t)), 0.5] for t in texts]


def test_a_rerun_replays_every_item_and_pays_for_none(client: onceguard.Client, ns: str) -> None:
    corpus = [f"chunk number {i}" for i in range(25)]
    model = Embedder()
    first = onceguard.once_each(client, ns, corpus, key=lambda t: t, work=model, batch_size=10)
    assert first == [[float(len(t)), 0.5] for t in corpus]
    assert sorted(model.texts) == sorted(corpus), "each embedded once"
    again = onceguard.once_each(client, ns, corpus, key=lambda t: t, work=model, batch_size=10)
    assert again == first
    assert len(model.texts) == 25, "the re-run embedded nothing"
    # One new chunk: only it is embedded.
    onceguard.once_each(client, ns, [*corpus, "a new chunk"], key=lambda t: t, work=model)
    assert model.texts[25:] == ["a new chunk"]


def test_the_cost_and_tokens_of_each_item_are_stored_and_replays_say_them(client: onceguard.Client, ns: str) -> None:
    corpus = ["short", "a longer chunk of text"]
    onceguard.once_each(
        client,
        ns,
        corpus,
        key=lambda t: t,
        work=Embedder(),
        cost=lambda text, vector: 1,
        tokens=lambda text, vector: len(text) + int(vector[1] * 2),
    )
    for text in corpus:
        replay = client.claim(ns, text, request=text)
        assert isinstance(replay, onceguard.Replay)
        assert (replay.cost, replay.tokens) == (1, len(text) + 1)


def test_two_workers_at_once_never_do_an_item_twice(client: onceguard.Client, ns: str) -> None:
    corpus = [f"text {i}" for i in range(40)]
    model = Embedder(delay=0.2)
    results: list[list[Any]] = []

    def worker() -> None:
        results.append(onceguard.once_each(client, ns, corpus, key=lambda t: t, work=model, batch_size=8, lease="10s"))

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and results[0] == results[1]
    assert sorted(model.texts) == sorted(corpus), f"embedded {len(model.texts)} texts for 40 chunks"


def test_failed_work_releases_its_batch(client: onceguard.Client, ns: str) -> None:
    corpus = ["a", "b", "c"]

    def broken(texts: list[str]) -> list[Any]:
        raise RuntimeError("the model is down")

    with pytest.raises(RuntimeError):
        onceguard.once_each(client, ns, corpus, key=lambda t: t, work=broken)
    model = Embedder()
    assert onceguard.once_each(client, ns, corpus, key=lambda t: t, work=model) == [[1.0, 0.5]] * 3
    assert model.texts == corpus, "released keys are done by the next run"


def test_a_key_reused_for_another_request_is_refused(client: onceguard.Client, ns: str) -> None:
    onceguard.once_each(client, ns, ["x"], key=lambda t: "same", work=Embedder())
    with pytest.raises(onceguard.KeyConflict):
        onceguard.once_each(client, ns, ["y"], key=lambda t: "same", request=lambda t: t, work=Embedder())


async def test_the_async_helper_replays_on_a_rerun(aclient: onceguard.AsyncClient, ns: str) -> None:
    calls: list[list[str]] = []

    async def work(texts: list[str]) -> list[str]:
        calls.append(texts)
        return [t.upper() for t in texts]

    assert await onceguard.once_each_async(aclient, ns, ["p", "q"], key=lambda t: t, work=work) == ["P", "Q"]
    assert await onceguard.once_each_async(aclient, ns, ["p", "q"], key=lambda t: t, work=work) == ["P", "Q"]
    assert calls == [["p", "q"]]
