"""Tune the second stage of `bm25_dense` (and RRF's k) on the TUNE half of a BEIR train split.

    python bench/retrieval_tune.py --dataset ../shared/data/beir/scifact --cache-dir /tmp/pr-evalcache

Uses the collection `polyroute retrieval eval --cache-dir` ingested (or ingests it). For every tune
query it asks the real engine once per part: BM25's top-K chunks with their BM25 scores, and the
cosines of exactly those chunks (a dense query restricted to their ids). Each fusion candidate is
then scored on those numbers (the formula is the one Qdrant evaluates: `alpha · bm25 / (bm25 + c)
+ cosine`, DBSF, RRF), chunk hits grouped by document (best chunk). The best setting is then run
as the real single Qdrant query on the tune half to check that the engine agrees with the
simulation. Only the tune half is read; `polyroute retrieval eval --subset validation` reports
the other half. Writes bench/results/retrieval_tune_<name>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from retrieval.engine import Fusion, QuerySpec, bm25_query  # noqa: E402
from retrieval.evaluate import doc_ranking, ingest_corpus, load_beir, ndcg_at, recall_at  # noqa: E402
from retrieval.store import RetrievalConfig, Retriever  # noqa: E402
from retrieval.text import normalize, tokenize  # noqa: E402


def docs_of(keys: list[str], scores: np.ndarray) -> list[str]:
    out, seen = [], set()
    for i in np.argsort(-scores, kind="stable"):
        doc = keys[i].rsplit("#", 1)[0]
        if doc not in seen:
            seen.add(doc)
            out.append(doc)
    return out


def dbsf(x: np.ndarray) -> np.ndarray:
    """Qdrant's distribution-based normalisation: (x − (μ − 3σ)) / 6σ over the list."""
    if len(x) < 2:
        return np.full_like(x, 0.5)
    mu, sd = x.mean(), x.std()
    if sd == 0:
        return np.full_like(x, 0.5)
    return (x - (mu - 3 * sd)) / (6 * sd)


def rrf(x: np.ndarray, k: int) -> np.ndarray:
    ranks = np.empty(len(x))
    ranks[np.argsort(-x, kind="stable")] = np.arange(len(x))
    return 1.0 / (k + ranks + 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--embedder", default="minilm")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    data = load_beir(args.dataset, "train", "tune")
    stat = (args.dataset / "corpus.jsonl").stat()
    root = args.cache_dir / f"{data.name}-{args.embedder}-{stat.st_size}-{int(stat.st_mtime)}-v2"
    retriever = Retriever(RetrievalConfig(root=root, embedder=args.embedder))
    collection = retriever.get("eval", "beir", create=True)
    if "ingest_s" not in collection.meta:
        collection, _ = ingest_corpus(retriever, data)
    queries = list(data.queries.items())
    print(f"{len(queries)} tune queries, {collection.engine.count('chunk')} chunks", flush=True)

    depth = 300
    cached = []
    for qid, text in queries:
        tokens = tokenize(text)
        vector = collection.embedder.encode_query(normalize(text))
        sparse = bm25_query(tokens) if tokens else None
        lexical = (
            collection.engine.query(QuerySpec("bm25", depth, depth, sparse, None, Fusion(), ["doc", "idx"]))
            if sparse
            else []
        )
        ids = [p.id for p in lexical]
        cos = (
            {
                p.id: p.score
                for p in collection.engine.query(
                    QuerySpec("dense", len(ids), len(ids), None, vector, Fusion(), ["doc"], ids=ids)
                )
            }
            if ids
            else {}
        )
        semantic = collection.engine.query(
            QuerySpec("dense", depth, depth, None, vector, Fusion(), ["doc", "idx"])
        )
        cached.append(
            (
                qid,
                [f"{p.payload['doc']}#{p.payload['idx']}" for p in lexical],
                np.array([p.score for p in lexical]),
                np.array([cos.get(i, 0.0) for i in ids]),
                [f"{p.payload['doc']}#{p.payload['idx']}" for p in semantic],
                np.array([p.score for p in semantic]),
            )
        )

    def metrics(score_fn, k: int) -> dict[str, float]:
        nd, rc = [], []
        for qid, keys, bm, cs, _, _ in cached:
            keys_k, bm_k, cs_k = keys[:k], bm[:k], cs[:k]
            ranked = docs_of(keys_k, score_fn(bm_k, cs_k)) if keys_k else []
            nd.append(ndcg_at(ranked, data.qrels[qid], 10))
            rc.append(recall_at(ranked, data.qrels[qid], 100))
        return {"ndcg_at_10": round(statistics.fmean(nd), 4), "recall_at_100": round(statistics.fmean(rc), 4)}

    rows = []
    rows.append({"kind": "bm25", **metrics(lambda b, c: b, 100)})
    for k in (50, 100, 200, 300):
        rows.append({"kind": "dense_rescore", "candidates": k, **metrics(lambda b, c: c, k)})
        rows.append({"kind": "dbsf", "candidates": k, **metrics(lambda b, c: dbsf(b) + dbsf(c), k)})
        for rk in (2, 10, 30, 60):
            rows.append(
                {
                    "kind": "rrf",
                    "candidates": k,
                    "rrf_k": rk,
                    **metrics(lambda b, c, rk=rk: rrf(b, rk) + rrf(c, rk), k),
                }
            )
        for c0 in (2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0, 400.0):
            for alpha in (0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0):
                fn = lambda b, c, a=alpha, c0=c0: a * b / (b + c0) + c  # noqa: E731
                rows.append({"kind": "formula", "candidates": k, "alpha": alpha, "c": c0, **metrics(fn, k)})
    # RRF of dense top-K ∪ BM25 top-K (the `rrf` mode), by its k
    for rk in (2, 5, 10, 20, 30, 60, 100):
        nd = []
        for qid, keys, _, _, skeys, _ in cached:
            fused: dict[str, float] = {}
            for ranking in (keys[:100], skeys[:100]):
                for r, key in enumerate(ranking):
                    fused[key] = fused.get(key, 0.0) + 1.0 / (rk + r + 1)
            order = sorted(fused, key=lambda x: -fused[x])
            nd.append(ndcg_at(docs_of(order, -np.arange(len(order), dtype=float)), data.qrels[qid], 10))
        rows.append({"kind": "rrf_mode", "rrf_k": rk, "ndcg_at_10": round(statistics.fmean(nd), 4)})

    best = max((r for r in rows if r["kind"] in ("formula", "dbsf", "rrf")), key=lambda r: r["ndcg_at_10"])
    best_rrf = max((r for r in rows if r["kind"] == "rrf_mode"), key=lambda r: r["ndcg_at_10"])
    print("best on the tune half:", best, "; rrf mode:", best_rrf, flush=True)

    # the chosen setting as the real one-query engine path, on the tune half
    fusion = Fusion(best["kind"], best.get("alpha", 1.0), best.get("c", 10.0), best.get("rrf_k", 60))
    retriever.config.fusion = fusion
    nd, lat = [], []
    for qid, text in queries:
        collection.embedder.encode_query(normalize(text))
        started = time.perf_counter()
        ranked = doc_ranking(collection, text, "bm25_dense", 100, best["candidates"])
        lat.append((time.perf_counter() - started) * 1000)
        nd.append(ndcg_at(ranked, data.qrels[qid], 10))
    engine_ndcg = statistics.fmean(nd)
    print(
        f"engine, one query: nDCG@10 {engine_ndcg:.4f} (simulated {best['ndcg_at_10']:.4f}), "
        f"p50 {statistics.median(lat):.2f} ms without the query embedding",
        flush=True,
    )
    top = sorted(rows, key=lambda r: -r["ndcg_at_10"])[:15]
    report = {
        "dataset": str(args.dataset),
        "split": "train",
        "subset": "tune",
        "queries": len(queries),
        "best": best,
        "best_rrf_mode": best_rrf,
        "engine_check": {
            "ndcg_at_10": round(engine_ndcg, 4),
            "p50_ms_without_query_embedding": round(statistics.median(lat), 2),
        },
        "top": top,
        "baselines": [r for r in rows if r["kind"] in ("bm25", "dense_rescore", "rrf_mode")],
        "grid_size": len(rows),
    }
    out = args.out or ROOT / "bench" / "results" / f"retrieval_tune_{data.name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    retriever.close()


if __name__ == "__main__":
    main()
