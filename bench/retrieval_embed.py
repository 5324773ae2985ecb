"""MiniLM embedding throughput: batch sizes, torch threads, bf16, int8 — interleaved, so load hits all alike.

    .venv/bin/python bench/retrieval_embed.py --dataset ../shared/data/beir/scifact [--sample 256 --rounds 3]

Embeds the same sample of corpus chunks (title + text, as ingest does) with each variant, in
`rounds` interleaved passes (variant A, B, C, A, B, C, …), and reports the best and median rate per
variant, plus each variant's mean cosine to the fp32 vectors. Quality in retrieval terms (nDCG) is
measured with `polyroute retrieval eval` (bf16: POLYROUTE_EMBED_PRECISION=fp32|bf16; int8:
`--embedder minilm-int8`): see docs/retrieval-engine.md.
Writes bench/results/retrieval_embed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from retrieval.embed import Embedder, native_bf16  # noqa: E402
from retrieval.text import chunk_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--sample", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "retrieval_embed.json")
    args = parser.parse_args()
    import torch

    texts: list[str] = []
    with open(args.dataset / "corpus.jsonl", "rb") as fh:
        for line in fh:
            row = orjson.loads(line)
            for chunk in chunk_text(row.get("text") or "", 200, 40):
                texts.append(f"{row.get('title') or ''}. {chunk.text}")
            if len(texts) >= args.sample:
                break
    texts = texts[: args.sample]
    variants = {  # name: (backend, batch, torch threads, precision)
        "fp32 batch 16": ("minilm", 16, None, "fp32"),
        "fp32 batch 32": ("minilm", 32, None, "fp32"),
        "fp32 batch 64": ("minilm", 64, None, "fp32"),
        "fp32 batch 128": ("minilm", 128, None, "fp32"),
        "fp32 batch 32, 1 thread": ("minilm", 32, 1, "fp32"),
        "bf16 autocast batch 32 (default here)": ("minilm", 32, None, "bf16"),
        "bf16 autocast batch 64": ("minilm", 64, None, "bf16"),
        "int8 batch 32": ("minilm-int8", 32, None, "fp32"),
        "int8 batch 64": ("minilm-int8", 64, None, "fp32"),
    }
    embedders = {}
    for name, (backend, batch, _, precision) in variants.items():
        embedders[name] = Embedder(backend, batch_size=batch, precision=precision)
        embedders[name].encode(texts[:4])  # load + warm
    default_threads = torch.get_num_threads()
    rates: dict[str, list[float]] = {name: [] for name in variants}
    vectors: dict[str, np.ndarray] = {}
    for _ in range(args.rounds):
        for name, (_, _, threads, _) in variants.items():
            torch.set_num_threads(threads or default_threads)
            started = time.perf_counter()
            vectors[name] = embedders[name].encode(texts)
            rates[name].append(len(texts) / (time.perf_counter() - started))
    torch.set_num_threads(default_threads)
    reference = vectors["fp32 batch 32"]
    rows = []
    for name, values in rates.items():
        rows.append(
            {
                "variant": name,
                "chunks_per_s_best": round(max(values), 1),
                "chunks_per_s_median": round(statistics.median(values), 1),
                "cosine_to_fp32_mean": round(float((vectors[name] * reference).sum(1).mean()), 4),
            }
        )
        print(rows[-1], flush=True)
    report = {
        "sample_chunks": len(texts),
        "rounds": args.rounds,
        "torch_threads": default_threads,
        "native_bf16": native_bf16(),
        "cpus": __import__("os").cpu_count(),
        "load_average_at_end": list(__import__("os").getloadavg()),
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
