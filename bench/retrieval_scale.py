"""Retrieval at 10K / 100K / 300K documents: ingest rate, query latency p50/p99, memory.

Documents are the Jargon File entries (bench/retrieval_jargon.py) repeated with a varying id and a
few random words each, so BM25 postings grow like a real corpus's. Embedding is *not* what is
measured here (its rate is reported once, on a sample, with the real MiniLM): each repeated
document's vector is its base text's `minilm-static` vector plus Gaussian noise (re-normalised),
so the vector stores see as many distinct points as documents. Everything else is the real code:
`Collection.ingest` (sqlite + BM25 + Qdrant) and `Collection.rank` for `bm25`, `dense`,
`bm25_dense` and `rrf`.

Qdrant local mode is brute force in Python/numpy; past `--qdrant-local-max` documents it is not
run (its ingest alone takes too long here) and the table says so. For comparison, an HNSW index
(faiss `IndexHNSWFlat`, M=32, efSearch=64; optional: `pip install faiss-cpu`) is built over the
same vectors at every size, which is what a Qdrant server (HNSW) would give.

    .venv/bin/python bench/retrieval_scale.py [--sizes 10000,100000,300000]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import random
import statistics
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


def run_size(n: int, base, pool, queries, qdrant_local_max: int, tmp: Path) -> dict:
    rng = random.Random(n)
    root = tmp / f"n{n}"
    retriever = Retriever(
        RetrievalConfig(root=root, embedder="minilm-static", chunk_words=400, chunk_overlap=20)
    )
    meta = {"name": "scale", "tenant": "bench", "embedder": "minilm-static", "created": 0}
    (root / "tenants" / "bench" / "scale").mkdir(parents=True, exist_ok=True)
    (root / "tenants" / "bench" / "scale" / "meta.json").write_text(json.dumps(meta))
    collection = BenchCollection(retriever, "bench", "scale", root / "tenants" / "bench" / "scale", meta)
    collection.pool = pool
    use_qdrant = n <= qdrant_local_max
    row: dict = {"documents": n, "qdrant_local_in_ingest": use_qdrant}
    if not use_qdrant:  # BM25 + sqlite only: Qdrant local mode is not asked to hold this many
        collection.dense.upsert = lambda *a, **k: None  # type: ignore[method-assign]
        collection.dense.delete = lambda *a, **k: None  # type: ignore[method-assign]
        collection.dense.ensure = lambda *a, **k: None  # type: ignore[method-assign]
    gc.collect()
    before = rss_mb()
    started = time.perf_counter()
    batch = 1000
    for start in range(0, n, batch):
        docs = []
        for i in range(start, min(n, start + batch)):
            title, text = base[i % len(base)]
            salt = " ".join(rng.choice(WORDS) for _ in range(3))
            docs.append(DocumentInput(f"d{i}", f"{text} ¦ {salt}", title=title))
        collection.ingest(docs)
        if start % 20_000 == 0:
            print(f"  n={n}: {start + len(docs)} ingested ({time.perf_counter() - started:.0f}s)", flush=True)
    collection.bm25.checkpoint()
    ingest_s = time.perf_counter() - started
    row["ingest_docs_per_s"] = round(n / ingest_s, 1)
    row["ingest_s"] = round(ingest_s, 1)
    row["rss_mb_after_ingest"] = round(rss_mb() - before, 1)
    row["bm25_snapshot_mb"] = round((collection.directory / "bm25.npz").stat().st_size / 2**20, 1)
    modes = ("bm25", "dense", "bm25_dense", "rrf") if use_qdrant else ("bm25",)
    for mode in modes:
        latencies = []
        for q in queries:
            t = time.perf_counter()
            collection.rank(q, 10, mode, 100)
            latencies.append((time.perf_counter() - t) * 1000)
        row[f"{mode}_ms"] = {
            "p50": round(percentile(latencies, 50), 2),
            "p99": round(percentile(latencies, 99), 2),
        }
    if not use_qdrant:
        row["qdrant_local"] = f"not run above {qdrant_local_max} documents"
    # the same vectors in an HNSW index, for what an ANN engine gives
    try:
        import faiss

        matrix = collection.pool.encode(
            [f"{base[i % len(base)][0]}. {base[i % len(base)][1]}" for i in range(min(n, len(base)))]
        )
        reps = int(np.ceil(n / len(matrix)))
        noise = (
            np.random.default_rng(0).normal(0, 0.05, (len(matrix) * reps, matrix.shape[1])).astype(np.float32)
        )
        full = np.tile(matrix, (reps, 1))[:n] + noise[:n]
        full /= np.linalg.norm(full, axis=1, keepdims=True)
        t = time.perf_counter()
        index = faiss.IndexHNSWFlat(full.shape[1], 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 64
        index.add(full)
        build = time.perf_counter() - t
        index.hnsw.efSearch = 64
        qv = collection.pool.static.encode(queries)
        latencies = []
        for v in qv:
            t = time.perf_counter()
            index.search(v[None, :], 100)
            latencies.append((time.perf_counter() - t) * 1000)
        exact = []
        for v in qv[:50]:
            t = time.perf_counter()
            np.argpartition(-(full @ v), 100)[:100]
            exact.append((time.perf_counter() - t) * 1000)
        row["hnsw_faiss"] = {
            "build_s": round(build, 1),
            "p50_ms": round(percentile(latencies, 50), 3),
            "p99_ms": round(percentile(latencies, 99), 3),
        }
        row["numpy_bruteforce_ms_p50"] = round(statistics.median(exact), 2)
        del index, full, noise
    except ImportError:
        row["hnsw_faiss"] = "faiss-cpu not installed"
    retriever.close()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,300000")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument(
        "--qdrant-local-max",
        type=int,
        default=10_000,
        help="Qdrant local mode commits every point to sqlite (~100 points/s here): not run above this",
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
    report["minilm_embed_docs_per_s"] = round(args.embed_sample / (time.perf_counter() - t), 1)
    print(f"MiniLM embedding: {report['minilm_embed_docs_per_s']} docs/s (real model, this machine)")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(s) for s in args.sizes.split(",")):
            row = run_size(n, base, pool, queries, args.qdrant_local_max, Path(tmp))
            print(json.dumps(row), flush=True)
            report["rows"].append(row)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
