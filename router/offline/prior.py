"""The shipped prior: one router model trained on all the public routing data we have, shipped in the package.

A new install has no labels for its own workers. This model gives it a query representation learned
from 24 public models on ~22k questions (RouteLLM's MMLU, GSM8K and MT-Bench; RouterBench's ARC,
Winogrande and MBPP training files; LLMRouter's 14-task training file), so:

* ``polyroute router calibrate`` can fit a catalog worker's vector on a few dozen probes
  (router/onboard.py) instead of needing thousands of labels;
* until then a catalog worker runs on its tier's prior *for this query*: the mean predicted quality of
  the public models of its tier (:data:`PUBLIC_TIERS`), so a frontier worker is still expected to do
  better on a hard proof than on a greeting.

The model is the factorisation + per-worker logistic regression ensemble without kNN (which would ship
every training embedding), so the file stays small. The calibration probes are left out of the
training data: their predictions must be out-of-sample for onboarding to fit honest vectors.

`python -m router.offline.prior` rebuilds ``router/prior/`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any

import numpy as np

from router.artifacts import RouterArtifact

PRIOR_DIR = Path(__file__).resolve().parents[1] / "prior"
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
PRIOR_MEMBERS: tuple[tuple[str, dict[str, Any]], ...] = (("logreg", {"C": 0.1}), ("mf", {}))
# The catalog tier each public model stands for, for the per-query tier prior of uncalibrated workers.
PUBLIC_TIERS: dict[str, str] = {
    "gpt-4-1106-preview": "frontier",
    "claude-v2": "frontier",
    "claude-v1": "frontier",
    "gpt-3.5-turbo-1106": "frontier",
    "claude-instant-v1": "frontier",
    "mistralai/mixtral-8x7b-chat": "open-moe",
    "zero-one-ai/Yi-34B-Chat": "open-moe",
    "meta/llama-2-70b-chat": "open-moe",
    "llama-3.1-nemotron-51b-instruct": "open-moe",
    "llama-3.3-nemotron-super-49b-v1": "open-moe",
    "llama3-chatqa-1.5-70b": "open-moe",
    "meta/code-llama-instruct-34b-chat": "specialist",
    "codegemma-7b": "specialist",
    "WizardLM/WizardLM-13B-V1.2": "local",
    "mistralai/mistral-7b-chat": "local",
    "mistral-7b-instruct-v0.3": "local",
    "qwen2.5-7b-instruct": "local",
    "llama-3.1-8b-instruct": "local",
    "gemma-2-9b-it": "local",
    "llama3-chatqa-1.5-8b": "local",
}
# RouteLLM's Mixtral is RouterBench's Mixtral: one column.
RENAMES = {"mixtral-8x7b": "mistralai/mixtral-8x7b-chat"}
RESPONSE_TOKENS_DEFAULT = 256.0


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def probe_texts() -> list[str]:
    """The shipped probes' prompts, normalised, to leave their questions out of the prior's training."""
    from router.probes import load_probes

    return [_normal(p.prompt) for p in load_probes().ordered()]


def _is_probe(text: str, probes: list[str]) -> bool:
    snippet = _normal(text)[:80]
    return len(snippet) >= 20 and any(snippet in p for p in probes)


def public_datasets(shared: Path = SHARED_DATA) -> list[Any]:
    """RouteLLM, RouterBench's and LLMRouter's training files as RoutingDatasets."""
    from router.offline.formats import load_format
    from router.offline.routellm import load_routellm

    rb = shared / "routerbench"
    lr = shared / "llmrouter"
    return [
        load_routellm(shared / "routellm"),
        load_format("routerbench", sorted(rb.glob("*_train.csv"))),
        load_format(
            "llmrouter",
            [lr / "dcrouter_train.json", lr / "default_query_train.jsonl"],
            lr / "default_llm.json",
        ),
    ]


def combine(
    datasets: list[Any], exclude: list[str]
) -> tuple[list[str], list[int], np.ndarray, list[str], dict]:
    """(texts, turns, labels [n, workers] with NaN where a dataset lacks a worker, workers, counts)."""
    workers: list[str] = []
    for ds in datasets:
        for w in ds.workers:
            name = RENAMES.get(w, w)
            if name not in workers:
                workers.append(name)
    texts: list[str] = []
    turns: list[int] = []
    blocks: list[np.ndarray] = []
    counts: dict[str, dict[str, int]] = {}
    for ds in datasets:
        keep = [i for i, t in enumerate(ds.texts) if not _is_probe(t, exclude)]
        block = np.full((len(keep), len(workers)), np.nan)
        for j, w in enumerate(ds.workers):
            block[:, workers.index(RENAMES.get(w, w))] = ds.labels[keep, j]
        texts += [ds.texts[i] for i in keep]
        turns += [int(ds.turns[i]) for i in keep]
        blocks.append(block)
        counts[ds.name] = {"rows": len(keep), "left_out_as_probes": len(ds.texts) - len(keep)}
    return texts, turns, np.vstack(blocks), workers, counts


def output_tokens(datasets: list[Any]) -> dict[str, float]:
    """Median completion tokens per public model where the data records answers (chars / 4):
    :meth:`RoutingDataset.output_tokens`, under the prior's column names."""
    out: dict[str, float] = {}
    for ds in datasets:
        for w, tokens in ds.output_tokens().items():
            out[RENAMES.get(w, w)] = tokens
    return out


def train_prior(
    shared: Path = SHARED_DATA, backend: str = "static", seed: int = 0, progress: bool = True
) -> RouterArtifact:
    """The shipped prior's artifact (not saved)."""
    from router.features import combined_text_rule
    from router.quality import EnsembleQuality
    from router.training import feature_builder

    started = time.time()
    datasets = public_datasets(shared)
    texts, turns, labels, workers, counts = combine(datasets, probe_texts())
    keep = [j for j in range(len(workers)) if np.any(~np.isnan(labels[:, j]))]
    workers = [workers[j] for j in keep]
    labels = labels[:, keep]
    # the sources' texts follow different rules (RouterBench's last paragraph, the others' whole query):
    # combined, the live router reads the whole query
    builder = feature_builder(backend, text_rule=combined_text_rule([ds.text_rule for ds in datasets]))
    X = builder.transform(texts, turns, progress=progress)
    model = EnsembleQuality(PRIOR_MEMBERS, random_state=seed).fit(X, labels)
    observed = {w: int(np.sum(~np.isnan(labels[:, i]))) for i, w in enumerate(workers)}
    tier_prior = {}
    for tier in sorted(set(PUBLIC_TIERS.values())):
        cols = [i for i, w in enumerate(workers) if PUBLIC_TIERS.get(w) == tier]
        if cols:
            tier_prior[tier] = float(np.nanmean(labels[:, cols]))
    card = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kind": "shipped prior",
        "data": {
            "routellm": "lm-sys/RouteLLM evals (Apache-2.0): MMLU, GSM8K, MT-Bench",
            "routerbench": "withmartian/routerbench training files (MIT): ARC-Challenge, Winogrande, MBPP",
            "llmrouter": "ulab-uiuc/LLMRouter training file (MIT): 14 tasks",
            "rows": counts,
        },
        "rows": len(texts),
        "model": "ensemble",
        "selection": {"chosen": "ensemble", "members": [list(m) for m in PRIOR_MEMBERS]},
        "public_tiers": {w: PUBLIC_TIERS.get(w) for w in workers},
        "train_seconds": round(time.time() - started, 1),
        "random_state": seed,
    }
    return RouterArtifact(
        workers=workers,
        features=builder.describe(),
        model=model,
        output_tokens=output_tokens(datasets),
        observed=observed,
        tier_prior=tier_prior,
        card=card,
        version="prior-" + time.strftime("%Y%m%d"),
    )


def main(argv: list[str] | None = None) -> None:
    """Rebuild the shipped prior in router/prior/ from ../shared/data."""
    import shutil

    from router.artifacts import save_artifact

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--data", type=Path, default=SHARED_DATA)
    parser.add_argument("--out", type=Path, default=PRIOR_DIR)
    args = parser.parse_args(argv)
    artifact = train_prior(args.data)
    staging = args.out.with_name(args.out.name + ".new")
    shutil.rmtree(staging, ignore_errors=True)
    directory = save_artifact(staging, artifact, activate=False)
    shutil.rmtree(args.out, ignore_errors=True)
    directory.rename(args.out)
    shutil.rmtree(staging, ignore_errors=True)
    print(f"wrote {args.out} ({sum(f.stat().st_size for f in args.out.iterdir()) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
