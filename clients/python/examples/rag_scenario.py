"""The RAG scenario: ingestion that crashes half-way, two workers re-running it at once, and a
re-ingestion after a redeploy, through a real ``onceguard serve`` (SQLite) and LangChain's
``Embeddings`` interface with a fake model that logs every text it embeds (no network).

    python examples/rag_scenario.py          # starts its own server; exits 1 if a check fails

1. A worker process ingests 120 chunks in batches of 20 with ``OnceEmbeddings`` (lease 2 s) and
   dies (``os._exit``) right after it acquired its fourth batch: 60 chunks stored, 20 held.
2. Two workers start at once over the whole corpus: they replay the 60, wait for the 20 held
   keys' leases to pass and recover them, and embed the rest between them.
3. A "redeploy": a new ``OnceEmbeddings`` over the whole corpus embeds nothing.

Checks: every chunk embedded exactly once over the three steps, every worker got every
chunk's vector, and the texts and tokens saved add up.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from langchain_core.embeddings import Embeddings

import onceguard
from onceguard.langchain import OnceEmbeddings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from _shared import serve  # noqa: E402

CORPUS = [f"Handbook, section {i}: how refunds of order class {i % 7} are approved." for i in range(120)]
NAMESPACE = "rag/handbook-embeddings"


def vector(text: str) -> list[float]:
    return [b / 255 for b in hashlib.sha256(text.encode()).digest()[:8]]


class LoggingModel(Embeddings):
    """A fake embedding model that appends every text it embeds to ``log``; with ``die_at``, the
    process dies when it is asked for its ``die_at``-th batch, before embedding it."""

    def __init__(self, log: Path, die_at: int | None = None) -> None:
        self.log, self.die_at, self.batches = log, die_at, 0
        self.lock = threading.Lock()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        with self.lock:
            self.batches += 1
            if self.die_at is not None and self.batches == self.die_at:
                os._exit(137)  # a crash: the batch's keys stay held until their leases pass
            with self.log.open("a", encoding="utf-8") as f:
                f.writelines(t + "\n" for t in texts)
        return [vector(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        return vector(text)


def embeddings(url: str, key: str, model: Embeddings) -> OnceEmbeddings:
    client = onceguard.Client(url, key)
    return OnceEmbeddings(model, client, NAMESPACE, model="fake-8", batch_size=20, lease="2s")


def worker(url: str, key: str, log: Path, die_at: int) -> None:
    embeddings(url, key, LoggingModel(log, die_at)).embed_documents(CORPUS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=4, metavar=("URL", "KEY", "LOG", "DIE_AT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        url, key, log, die_at = args.worker
        worker(url, key, Path(log), int(die_at))
        return 0

    proc, url, key, workdir = serve("sqlite://onceguard-data/onceguard.db")
    log = workdir / "embedded.log"
    failures: list[str] = []
    try:
        print("1. ingest, crash half-way")
        crashed = subprocess.run([sys.executable, __file__, "--worker", url, key, str(log), "4"], check=False)
        embedded = log.read_text(encoding="utf-8").splitlines()
        print(f"   worker exited {crashed.returncode} after embedding {len(embedded)} chunks (20 more held)")
        if crashed.returncode != 137 or len(embedded) != 60:
            failures.append("the first worker did not crash after three batches")

        print("2. re-run with two workers at once")
        workers = [embeddings(url, key, LoggingModel(log)) for _ in range(2)]
        vectors: list[list[list[float]]] = []
        threads = [threading.Thread(target=lambda w=w: vectors.append(w.embed_documents(CORPUS))) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        saved = sum(w.texts_saved for w in workers)
        print(f"   both got {len(vectors[0]) if vectors else 0} vectors; replays saved {saved} embeddings")
        if len(vectors) != 2 or any(v != [vector(t) for t in CORPUS] for v in vectors):
            failures.append("a worker did not get every chunk's vector")

        print("3. re-ingest after a redeploy")
        redeployed = embeddings(url, key, LoggingModel(log))
        if redeployed.embed_documents(CORPUS) != [vector(t) for t in CORPUS]:
            failures.append("the re-ingestion did not replay every vector")
        tokens = sum(max(1, len(t) // 4) for t in CORPUS)
        print(f"   embedded nothing new: {redeployed.texts_saved} texts, {redeployed.tokens_saved} tokens saved")
        if (redeployed.texts_saved, redeployed.tokens_saved) != (len(CORPUS), tokens):
            failures.append("the redeploy did not save every text's tokens")

        counts: dict[str, int] = {}
        for text in log.read_text(encoding="utf-8").splitlines():
            counts[text] = counts.get(text, 0) + 1
        twice = [t for t, n in counts.items() if n > 1]
        never = [t for t in CORPUS if t not in counts]
        print()
        print(f"chunks: {len(CORPUS)}; embedded once: {sum(1 for n in counts.values() if n == 1)}; "
              f"twice or more: {len(twice)}; never: {len(never)}")
        if twice or never:
            failures.append(f"{len(twice)} chunks embedded more than once, {len(never)} never")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)
    for failure in failures:
        print(f"FAILED: {failure}")
    print("rag scenario: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
