"""Retrieval at 10K / 100K / 300K chunks on both engines: indexing rate, search latency, memory.

Chunks are the Jargon File entries (bench/retrieval_jargon.py) repeated with a varying id and a
few random words each, so BM25's vocabulary and postings grow like a real corpus's. Embedding is
*not* what is measured per size (its rate is measured once, on a sample, with the real MiniLM):
each repeated chunk's vector is its base text's `minilm-static` vector plus Gaussian noise
(re-normalised), so Qdrant sees as many distinct vectors as chunks. Everything else is the real
code: `Collection.ingest` (tokenising, BM25 vectors, Qdrant writes), `Collection.optimize` (HNSW
build, counted in indexing), and `Collection.rank` for `bm25`, `dense`, `bm25_dense` and `rrf`,
timed with the query vector already computed (query embedding is reported apart).

Engines: `edge` (the embedded Qdrant Edge shard) and `memory` (qdrant-client's in-process mode,
which stands in for a Qdrant server's API since no server can run here; it is brute force, so it
is run up to `--memory-max` chunks).

    .venv/bin/python bench/retrieval_scale.py [--sizes 10000,100000,300000] [--engines edge,memory]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from retrieval.embed import Embedder, shared_embedder  # noqa: E402
from retrieval.evaluate import percentile  # noqa: E402
from retrieval.store import Collection, DocumentInput, RetrievalConfig, Retriever  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "retrieval_scale.json"
WORDS = "alpha beta gamma delta kernel packet router cache vector index shard replica quorum lease".split()


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class PoolEmbedder(Embedder):
    """Vectors for repeated documents: the base text's static vector + noise (seeded by the text)."""

    def __init__(self) -> None:
        super().__init__("minilm-static")
        self.static = shared_embedder("minilm-static")
        self.cache: dict[str, np.ndarray] = {}

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            key = text.split(" ¦", 1)[0]
            vector = self.cache.get(key)
            if vector is None:
                vector = self.cache[key] = self.static.encode([key])[0]
            seed = int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "little")
            noisy = vector + np.random.default_rng(seed).normal(0, 0.05, self.dim).astype(np.float32)
            out[i] = noisy / np.linalg.norm(noisy)
        return out


class BenchCollection(Collection):
    pool: PoolEmbedder

    @property
    def embedder(self):  # type: ignore[override]
        return self.pool


def base_corpus() -> list[tuple[str, str]]:
    from retrieval_jargon import SOURCE, entries

    if SOURCE.exists():
        return entries()
    rng = random.Random(1)  # no Jargon File: synthetic word salad
    return [(f"doc{i}", " ".join(rng.choice(WORDS) for _ in range(120))) for i in range(2000)]


def run_size(n: int, engine: str, base, pool, queries, tmp: Path) -> dict:
    rng = random.Random(n)
    retriever = Retriever(
        RetrievalConfig(
            root=tmp / f"{engine}-{n}",
            qdrant_url=":memory:" if engine == "memory" else None,
            embedder="minilm-static",
            chunk_words=400,
            chunk_overlap=20,
            optimize_every=0,  # one optimise at the end, timed as indexing
        )
    )
    collection = retriever.get("bench", "scale", create=True)
    collection.__class__ = BenchCollection
    collection.pool = pool
    row: dict = {"engine": engine, "chunks_target": n}
    gc.collect()
    before = rss_mb()
    timings: dict[str, float] = {}
    started = time.perf_counter()
    batch = 2000
    for start in range(0, n, batch):
        docs = []
        for i in range(start, min(n, start + batch)):
            title, text = base[i % len(base)]
            salt = " ".join(rng.choice(WORDS) for _ in range(3))
            docs.append(DocumentInput(f"d{i}", f"{text} ¦ {salt}", title=title))
        collection.ingest(docs, timings)
        if start % 50_000 == 0:
            print(
                f"  {engine} n={n}: {start + len(docs)} ingested ({time.perf_counter() - started:.0f}s)",
                flush=True,
            )
    t = time.perf_counter()
    collection.optimize()
    timings["index"] = timings.get("index", 0.0) + time.perf_counter() - t
    chunks = collection.engine.count("chunk")
    row["chunks"] = chunks
    row["index_s"] = round(timings["index"], 1)
    row["index_chunks_per_s"] = round(chunks / timings["index"], 1)
    row["fake_embed_s"] = round(timings.get("embed", 0.0), 1)
    row["rss_mb_after_ingest"] = round(rss_mb() - before, 1)
    for q in queries:  # query vectors in the embedder's cache: latencies exclude embedding
        collection.embedder.encode_query(q)
    for mode in ("bm25", "dense", "bm25_dense", "rrf"):
        latencies = []
        for q in queries:
            t = time.perf_counter()
            collection.rank(q, 10, mode, 100)
            latencies.append((time.perf_counter() - t) * 1000)
        row[f"{mode}_ms"] = {
            "p50": round(percentile(latencies, 50), 2),
            "p99": round(percentile(latencies, 99), 2),
        }
    row["rss_mb_after_search"] = round(rss_mb() - before, 1)
    retriever.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,300000")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--engines", default="edge,memory")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--memory-max",
        type=int,
        default=10_000,
        help="qdrant-client in-memory mode (brute force): not run above this",
    )
    parser.add_argument(
        "--embed-sample", type=int, default=200, help="docs embedded with real MiniLM for the rate"
    )
    args = parser.parse_args()
    base = base_corpus()
    pool = PoolEmbedder()
    texts = [f"{t}. {x}" for t, x in base]
    rng = random.Random(7)
    queries = [" ".join(rng.choice(x.split()) for _ in range(6)) for _, x in rng.sample(base, args.queries)]
    report: dict = {"base_documents": len(base), "queries": len(queries), "rows": []}
    minilm = Embedder("minilm")
    minilm.encode(["warm"])
    t = time.perf_counter()
    minilm.encode(texts[: args.embed_sample])
    report["minilm_embed_chunks_per_s"] = round(args.embed_sample / (time.perf_counter() - t), 1)
    t = time.perf_counter()
    for q in queries[:50]:
        minilm.encode([q])
    report["minilm_query_embed_ms_mean"] = round((time.perf_counter() - t) * 1000 / 50, 2)
    print(
        f"MiniLM: {report['minilm_embed_chunks_per_s']} chunks/s, a query {report['minilm_query_embed_ms_mean']} ms"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            for engine in args.engines.split(","):
                if engine == "memory" and n > args.memory_max:
                    report["rows"].append(
                        {
                            "engine": engine,
                            "chunks_target": n,
                            "skipped": f"above --memory-max {args.memory_max}",
                        }
                    )
                    continue
                row = run_size(n, engine, base, pool, queries, Path(tmp))
                print(json.dumps(row), flush=True)
                report["rows"].append(row)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
