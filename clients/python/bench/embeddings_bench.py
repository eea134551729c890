"""Re-ingesting an unchanged corpus: ``OnceEmbeddings`` against LangChain's
``CacheBackedEmbeddings`` over a local file store, and against one ``@once`` call per chunk,
measured in one run (the same fake model, the same chunks).

    python bench/embeddings_bench.py --serve          # starts onceguard serve (SQLite)
    python bench/embeddings_bench.py -n 10000 --store sqlite://onceguard-data/og.db

Each way first ingests the corpus once (not timed: it stores every vector), then ingests it
again, timed: every vector is stored, so the second pass is pure look-up and replay. Needs the
``bench`` extra (``langchain-classic`` for ``CacheBackedEmbeddings``).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from langchain_classic.embeddings import CacheBackedEmbeddings
from langchain_classic.storage import LocalFileStore
from langchain_core.embeddings import Embeddings

import onceguard
from onceguard.langchain import OnceEmbeddings

from _shared import find_binary, serve


class FakeModel(Embeddings):
    """16 floats from the text's digest; counts the texts it embedded."""

    def __init__(self) -> None:
        self.embedded = 0

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        self.embedded += len(texts)
        return [[b / 255 for b in hashlib.sha256(t.encode()).digest()[:16]] for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


def timed(label: str, run: object) -> float:
    start = time.perf_counter()
    run()  # type: ignore[operator]
    took = time.perf_counter() - start
    print(f"  {label:44} {took:8.2f} s")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--chunks", type=int, default=10_000)
    parser.add_argument("--store", default="sqlite://onceguard-data/onceguard.db")
    parser.add_argument("--serve", action="store_true", help="start onceguard serve (the default)")
    args = parser.parse_args()
    corpus = [f"chunk {i} of {uuid.uuid4().hex}: refunds, approvals and their limits" for i in range(args.chunks)]
    binary = find_binary(("release", "debug"))
    proc, url, key, workdir = serve(args.store, binary=binary)
    files = Path(tempfile.mkdtemp(prefix="onceguard-embed-cache-"))
    try:
        client = onceguard.Client(url, key)
        ns = f"bench/embed-{uuid.uuid4().hex[:8]}"
        print(f"re-ingesting {args.chunks} unchanged chunks; server {binary.name} on {args.store}")

        once_model = FakeModel()
        once = OnceEmbeddings(once_model, client, ns, model="fake-16")
        once.embed_documents(corpus)
        ours = timed("OnceEmbeddings (1,000 a batch)", lambda: once.embed_documents(corpus))

        cache_model = FakeModel()
        cached = CacheBackedEmbeddings.from_bytes_store(cache_model, LocalFileStore(str(files)), namespace="fake-16")
        cached.embed_documents(corpus)
        theirs = timed("CacheBackedEmbeddings over LocalFileStore", lambda: cached.embed_documents(corpus))

        per_call_model = FakeModel()
        embed_one = onceguard.once(client, ns, name="embed-one")(lambda text: per_call_model.embed_documents([text])[0])
        for text in corpus:
            embed_one(text)
        one_by_one = timed("one @once call per chunk", lambda: [embed_one(t) for t in corpus])

        assert once_model.embedded == cache_model.embedded == per_call_model.embedded == args.chunks
        print(f"  OnceEmbeddings ÷ CacheBackedEmbeddings (speed): {theirs / ours:.2f}x")
        print(f"  OnceEmbeddings ÷ one @once per chunk (speed):   {one_by_one / ours:.1f}x")
        print(f"  embeddings on the second pass: 0 for each way ({once.texts_saved} texts saved by OnceEmbeddings)")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(files, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
