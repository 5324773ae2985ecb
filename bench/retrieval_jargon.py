"""Build a BEIR-format retrieval set from the Jargon File (public domain), for when no BEIR data is here.

Source: Debian's `jargon-text` package (`apt-get install jargon-text`), The Jargon File 4.4.7,
whose copyright file says "This document (the Jargon File) is in the public domain".

Queries follow the Inverse Cloze Task (Lee et al., 2019): for a sample of entries with at least
three sentences, one sentence (≥ 8 words, not the first) is taken out of the entry and becomes the
query; the entry it came from (without that sentence) is the one relevant document. Known-item
search, judged by construction — easier for BM25 than human-written queries when the sentence
repeats the entry's own words, and it says nothing about graded relevance. The output goes to a
cache folder outside the repository:

    .venv/bin/python bench/retrieval_jargon.py --out ~/.cache/polyroute/beir/jargon-ict
    .venv/bin/polyroute retrieval eval --dataset ~/.cache/polyroute/beir/jargon-ict
"""

from __future__ import annotations

import argparse
import gzip
import random
import re
from pathlib import Path

import orjson

SOURCE = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
_HEAD = re.compile(r"^   :(?P<word>[^:]+):(?P<rest>.*)$")
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[\"'“‘(\[A-Z0-9])")


def entries(source: Path = SOURCE) -> list[tuple[str, str]]:
    lines = gzip.open(source, "rt", encoding="utf-8").read().splitlines()
    out: list[tuple[str, str]] = []
    word, body = None, []
    for line in lines:
        if line.startswith("Appendix A. Hacker Folklore"):
            break
        match = _HEAD.match(line)
        if match:
            if word is not None:
                out.append((word, " ".join(body)))
            word, body = match["word"].strip(), []
            continue
        if word is not None and line.strip():
            body.append(line.strip())
    if word is not None:
        out.append((word, " ".join(body)))
    cleaned = []
    for word, text in out:
        text = re.sub(r"[{}]", "", text)
        text = " ".join(text.split()[:600])
        if len(text.split()) >= 5:
            cleaned.append((word, text))
    return cleaned


def build(out: Path, queries: int = 500, seed: int = 13) -> None:
    rng = random.Random(seed)
    docs = entries()
    candidates = []
    for i, (_, text) in enumerate(docs):
        sentences = _SENTENCE.split(text)
        usable = [j for j, s in enumerate(sentences) if j > 0 and len(s.split()) >= 8]
        if len(sentences) >= 3 and usable:
            candidates.append((i, sentences, usable))
    picked = rng.sample(candidates, min(queries, len(candidates)))
    texts = {i: text for i, (_, text) in enumerate(docs)}
    query_rows, qrels = [], []
    for n, (i, sentences, usable) in enumerate(sorted(picked)):
        j = rng.choice(usable)
        query_rows.append({"_id": f"q{n}", "text": sentences[j]})
        qrels.append((f"q{n}", f"d{i}"))
        texts[i] = " ".join(s for k, s in enumerate(sentences) if k != j)
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "wb") as fh:
        for i, (word, _) in enumerate(docs):
            fh.write(orjson.dumps({"_id": f"d{i}", "title": word, "text": texts[i]}) + b"\n")
    with open(out / "queries.jsonl", "wb") as fh:
        for row in query_rows:
            fh.write(orjson.dumps(row) + b"\n")
    with open(out / "qrels" / "test.tsv", "w", encoding="utf-8") as fh:
        fh.write("query-id\tcorpus-id\tscore\n")
        for qid, did in qrels:
            fh.write(f"{qid}\t{did}\t1\n")
    print(f"{len(docs)} documents, {len(query_rows)} queries -> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache/polyroute/beir/jargon-ict")
    parser.add_argument("--queries", type=int, default=500)
    args = parser.parse_args()
    if not SOURCE.exists():
        raise SystemExit(f"{SOURCE} is missing: apt-get install jargon-text")
    build(args.out, args.queries)


if __name__ == "__main__":
    main()
