"""Retrieval evaluation on a BEIR-format folder: corpus.jsonl, queries.jsonl, qrels/<split>.tsv.

The split is `test` when qrels/test.tsv exists, else `train`. `subset` keeps a deterministic half
of the queries (`tune` / `validation`, by a hash of the query id), so parameters tuned on one half
of the train qrels are reported on the other.

Every method runs through the real collection code (ingest → one Qdrant collection → `Collection.rank`),
chunk hits grouped by document (best chunk counts). Metrics as trec_eval computes them: nDCG@10
with linear gains, Recall@100 over the judged-relevant documents. Query latency is wall time of
one `rank` call (query embedding included, not cached).

Progressive disclosure: for each query, tokens of the injected memory (layer 0 for the index,
layer 1 for the top few) against stuffing the top-5 full documents, and whether a gold document
is reachable — listed in the index, so at most two `memory_expand` calls (passage, then full)
bring it in.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import orjson

from retrieval.memory import recall
from retrieval.store import MODES, DocumentInput, RetrievalConfig, Retriever

METHOD_LABELS = {
    "bm25": "BM25 alone",
    "dense": "dense alone (MiniLM)",
    "bm25_dense": "BM25 top-100 → BM25 + dense (one query)",
    "rrf": "RRF(dense top-100 ∪ BM25 top-100)",
}
EVAL_ORDER = ("bm25", "dense", "bm25_dense", "rrf")


@dataclass
class BeirData:
    name: str
    corpus: dict[str, tuple[str, str]]  # id -> (title, text)
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]
    split: str = "test"
    subset: str = "all"


SUBSETS = ("all", "tune", "validation")


def default_split(path: Path) -> str:
    return "test" if (Path(path) / "qrels" / "test.tsv").exists() else "train"


def in_subset(query_id: str, subset: str) -> bool:
    """A fixed half of the queries: `tune` or `validation` (sha256 of the id, even or odd)."""
    if subset == "all":
        return True
    odd = hashlib.sha256(query_id.encode()).digest()[0] & 1
    return bool(odd) == (subset == "validation")


def load_beir(path: Path, split: str | None = None, subset: str = "all") -> BeirData:
    path = Path(path)
    split = split or default_split(path)
    if subset not in SUBSETS:
        raise ValueError(f"unknown subset {subset!r}; expected one of {', '.join(SUBSETS)}")
    missing = [p for p in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv") if not (path / p).exists()]
    if missing:
        raise FileNotFoundError(f"{path} is not a BEIR folder: missing {', '.join(missing)}")
    corpus: dict[str, tuple[str, str]] = {}
    with open(path / "corpus.jsonl", "rb") as fh:
        for line in fh:
            if line.strip():
                row = orjson.loads(line)
                corpus[str(row["_id"])] = (row.get("title") or "", row.get("text") or "")
    queries: dict[str, str] = {}
    with open(path / "queries.jsonl", "rb") as fh:
        for line in fh:
            if line.strip():
                row = orjson.loads(line)
                queries[str(row["_id"])] = row["text"]
    qrels: dict[str, dict[str, int]] = {}
    with open(path / "qrels" / f"{split}.tsv", encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or (i == 0 and not parts[2].strip().lstrip("-").isdigit()):
                continue  # the header
            qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    queries = {q: t for q, t in queries.items() if q in qrels and in_subset(q, subset)}
    return BeirData(path.name, corpus, queries, qrels, split, subset)


def ndcg_at(ranked: list[str], relevant: dict[str, int], k: int = 10) -> float:
    dcg = sum(relevant.get(d, 0) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    ideal = sorted((g for g in relevant.values() if g > 0), reverse=True)[:k]
    idcg = sum(g / math.log2(i + 2) for i, g in enumerate(ideal))
    return dcg / idcg if idcg else 0.0


def recall_at(ranked: list[str], relevant: dict[str, int], k: int = 100) -> float:
    gold = {d for d, g in relevant.items() if g > 0}
    return len(gold & set(ranked[:k])) / len(gold) if gold else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def token_counter() -> Callable[[str], int]:
    """cl100k_base (litellm's bundled default encoding, no download); ~4 chars/token if missing."""
    try:
        from litellm.litellm_core_utils.default_encoding import encoding

        return lambda text: len(encoding.encode(text, disallowed_special=()))
    except Exception:  # pragma: no cover - litellm is a dependency; this is only a fallback
        return lambda text: max(1, len(text) // 4)


def ingest_corpus(
    retriever: Retriever,
    data: BeirData,
    progress: Callable[[int, int], None] | None = None,
    timings: dict[str, float] | None = None,
):
    """Ingest in batches, then optimise the shard (HNSW); `timings` gets `embed` and `index` seconds."""
    collection = retriever.get("eval", "beir", create=True)
    items = list(data.corpus.items())
    timings = {} if timings is None else timings
    started = time.perf_counter()
    batch = 256
    for start in range(0, len(items), batch):
        docs = [
            DocumentInput(doc_id, text or title, title=title or None)
            for doc_id, (title, text) in items[start : start + batch]
            if (text or title).strip()
        ]
        collection.ingest(docs, timings)
        if progress:
            progress(min(start + batch, len(items)), len(items))
    optimized = time.perf_counter()
    collection.optimize()
    timings["index"] = timings.get("index", 0.0) + time.perf_counter() - optimized
    return collection, time.perf_counter() - started


def doc_ranking(collection, query: str, method: str, depth: int = 100, candidates: int = 100) -> list[str]:
    ranked: list[str] = []
    seen: set[str] = set()
    for key, *_ in collection.rank(query, k=depth, mode=method, candidates=candidates):
        doc = key.rsplit("#", 1)[0]
        if doc not in seen:
            seen.add(doc)
            ranked.append(doc)
    return ranked


def evaluate(
    dataset: Path,
    embedder: str = "minilm",
    methods: tuple[str, ...] = EVAL_ORDER,
    candidates: int = 100,
    max_queries: int | None = None,
    work_dir: Path | None = None,
    index_size: int = 3,
    snippets: int = 0,
    disclosure_mode: str = "bm25_dense",
    title_words: int = 8,
    summary_words: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
    cache_dir: Path | None = None,
    split: str | None = None,
    subset: str = "all",
    disclosure_queries: int | None = None,
) -> dict:
    data = load_beir(dataset, split, subset)
    for method in methods:
        if method not in MODES:
            raise ValueError(f"unknown method {method!r}")
    with contextlib.ExitStack() as stack:
        if cache_dir is not None:  # reuse an ingested copy of this exact corpus (ingest is the slow part)
            stat = (Path(dataset) / "corpus.jsonl").stat()
            root = Path(cache_dir) / f"{data.name}-{embedder}-{stat.st_size}-{int(stat.st_mtime)}-v2"
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=work_dir)))
        retriever = Retriever(RetrievalConfig(root=root, embedder=embedder, candidates=candidates))
        stack.callback(retriever.close)  # before the temporary dir goes (the stack unwinds in reverse)
        report = _run(
            retriever,
            data,
            methods,
            candidates,
            max_queries,
            index_size,
            snippets,
            disclosure_mode,
            progress,
            disclosure_queries,
            title_words,
            summary_words,
        )
    report["dataset"] = str(dataset)
    report["embedder"] = embedder
    return report


def _run(
    retriever,
    data,
    methods,
    candidates,
    max_queries,
    index_size,
    snippets,
    disclosure_mode,
    progress,
    disclosure_queries=None,
    title_words=8,
    summary_words=0,
):
    tick = (
        (lambda stage: lambda done, total: progress(stage, done, total)) if progress else (lambda stage: None)
    )
    collection = retriever.get("eval", "beir", create=True)
    wanted = sum(1 for title, text in data.corpus.values() if (text or title).strip())
    if collection.stats()["documents"] == wanted and "ingest_s" in collection.meta:
        ingest_s = float(collection.meta["ingest_s"])  # a cached ingest: report the time it took then
        timings = collection.meta.get("ingest_timings", {})
    else:
        timings = {}
        collection, ingest_s = ingest_corpus(retriever, data, tick("ingest"), timings)
        collection.meta["ingest_s"] = ingest_s
        collection.meta["ingest_timings"] = timings
        retriever._save_meta(collection)
    queries = list(data.queries.items())[: max_queries or None]
    collection.embedder.encode(["warm-up"])
    report: dict = {
        "name": data.name,
        "corpus_docs": len(data.corpus),
        "chunks": collection.engine.count("chunk"),
        "split": data.split,
        "subset": data.subset,
        "queries": len(queries),
        "engine": retriever.engine_name,
        "ingest_s": round(ingest_s, 2),
        "ingest_embed_s": round(timings.get("embed", 0.0), 2),
        "ingest_index_s": round(timings.get("index", 0.0), 2),
        "ingest_docs_per_s": round(len(data.corpus) / ingest_s, 1) if ingest_s else None,
        "candidates": candidates,
        "bm25": collection.meta.get("bm25"),
        "fusion": retriever.config.fusion.as_dict(),
        "ndcg_at_10": {},
        "recall_at_100": {},
        "latency_ms": {},
    }
    for method in methods:
        ndcgs, recalls, latencies = [], [], []
        report_tick = tick(method)
        for i, (qid, text) in enumerate(queries):
            collection.embedder._queries.clear()  # time the query embedding too
            started = time.perf_counter()
            ranked = doc_ranking(collection, text, method, 100, candidates)
            latencies.append((time.perf_counter() - started) * 1000)
            ndcgs.append(ndcg_at(ranked, data.qrels[qid], 10))
            recalls.append(recall_at(ranked, data.qrels[qid], 100))
            if report_tick and (i % 25 == 0 or i == len(queries) - 1):
                report_tick(i + 1, len(queries))
        report["ndcg_at_10"][method] = round(statistics.fmean(ndcgs), 4) if ndcgs else 0.0
        report["recall_at_100"][method] = round(statistics.fmean(recalls), 4) if recalls else 0.0
        report["latency_ms"][method] = {
            "p50": round(percentile(latencies, 50), 2),
            "p99": round(percentile(latencies, 99), 2),
        }
    report["disclosure"] = (
        disclosure(
            retriever,
            collection,
            data,
            queries[:disclosure_queries],
            index_size,
            snippets,
            disclosure_mode,
            tick("disclosure"),
            title_words,
            summary_words,
        )
        if disclosure_queries != 0
        else []
    )
    return report


# (index entries, passages, title words, summary words): the gateway's default layer 0 (3 entries,
# 8 title words, no passage) and the fuller settings it replaced, for comparison.
DISCLOSURE_CONFIGS = ((3, 0, 8, 0), (3, 0, 0, 12), (5, 0, 0, 12), (5, 1, 0, 12), (10, 2, 0, 12))


def disclosure(
    retriever,
    collection,
    data,
    queries,
    index_size,
    snippets,
    mode,
    report_tick=None,
    title_words: int = 8,
    summary_words: int = 0,
) -> list[dict]:
    """Tokens injected with layers 0+1 vs the top-5 full documents; how far away the gold document is.

    Run for the requested (index entries, passages, title words, summary words) and the settings in
    DISCLOSURE_CONFIGS. The tokens are those of the system message in the tool-calling form (the
    text-directive form's header is 7 tokens longer). `gold_in_index`: listed in the injected index
    (one expansion reads it in full). `gold_reachable`: within two expansions — in the index, or on
    the next index page ('more', then the document).
    """
    count = token_counter()
    requested = (index_size, snippets, title_words, summary_words)
    configs = [requested] + [c for c in DISCLOSURE_CONFIGS if c != requested]
    stats = {c: {"injected": [], "in_index": 0, "reachable": 0} for c in configs}
    stuffed, top5_has_gold = [], 0
    for i, (qid, text) in enumerate(queries):
        gold = {d for d, g in data.qrels[qid].items() if g > 0}
        for size, passages, title, summary in configs:
            context = recall(
                retriever,
                "eval",
                [("beir", False)],
                text,
                size,
                passages,
                mode,
                pages=2,
                title_words=title,
                summary_words=summary,
            )
            entry = stats[(size, passages, title, summary)]
            entry["injected"].append(count(context.render()))
            entry["in_index"] += bool(gold & {e.document_id for e in context.visible})
            entry["reachable"] += bool(gold & {e.document_id for e in context.entries})
        top5 = doc_ranking(collection, text, mode, 20)[:5]
        full = []
        for doc_id in top5:
            record = collection.document(doc_id)
            if record is not None:
                full.append(f"{record.title}\n{record.text}")
        stuffed.append(count("\n\n".join(full)))
        top5_has_gold += bool(gold & set(top5))
        if report_tick and (i % 25 == 0 or i == len(queries) - 1):
            report_tick(i + 1, len(queries))
    n = max(1, len(queries))
    mean_stuffed = statistics.fmean(stuffed) if stuffed else 0.0
    rows = []
    for (size, passages, title, summary), entry in stats.items():
        mean_injected = statistics.fmean(entry["injected"]) if entry["injected"] else 0.0
        rows.append(
            {
                "mode": mode,
                "index_size": size,
                "snippets": passages,
                "title_words": title,
                "summary_words": summary,
                "tokens_injected_mean": round(mean_injected, 1),
                "tokens_top5_full_mean": round(mean_stuffed, 1),
                "token_saving": round(1 - mean_injected / mean_stuffed, 4) if mean_stuffed else 0.0,
                "gold_in_index": round(entry["in_index"] / n, 4),
                "gold_reachable": round(entry["reachable"] / n, 4),
                "gold_in_top5_full": round(top5_has_gold / n, 4),
            }
        )
    return rows
