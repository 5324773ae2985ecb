"""Free-text answers compared by meaning: agreement keys from sentence embeddings.

Choice letters, final numbers, short spans and code have canonical keys (router/answers.py), so the
planner can count how many workers said the same thing. Two free-text answers that say the same in
other words have no such key; without one a free-text answer agrees with nobody. Here each answer is
embedded (all-MiniLM-L6-v2, retrieval/embed.py: L2-normalised, so a dot product is the cosine) and
grouped by *leader clustering* in call order: an answer joins the class of the first earlier leader
it is at least :data:`SIMILARITY` similar to, else leads a class of its own. Keys are ``text:<the
leader's position>``, so an answer's key never changes when a later answer arrives — a plan's
agreement can only grow as it calls more workers, as with the other kinds.

An empty answer or a refusal has no key: it agrees with nobody, as an off-format answer of any kind.

The threshold is not fitted: no data here records several workers' free-text answers with labels
(the RouterBench files are multiple choice and code; RouteLLM records MT-Bench judgements, not the
answers). 0.80 separates the ten hand-written pairs of tests/test_text_agreement.py — paraphrases at
cosine 0.83–0.97, answers on the same topic that say something else at 0.38–0.70 — which is a sanity
check, not a validation; `POLYROUTE_PLAN_TEXT_SIMILARITY` overrides it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from router.answers import REFUSALS

SIMILARITY = 0.80
MAX_CHARS = 4000  # MiniLM reads ~256 word pieces; the opening of a long answer is what it embeds

Embed = Callable[[list[str]], np.ndarray]  # texts -> [n, d] L2-normalised vectors


def keyable(text: str) -> bool:
    """Whether a free-text answer can agree with another at all (not empty, not a refusal)."""
    return bool(text.strip()) and not REFUSALS.search(text)


def text_keys(texts: Sequence[str], vectors: np.ndarray, similarity: float = SIMILARITY) -> list[str | None]:
    """Agreement keys of ``texts`` (in call order) from their embeddings ``vectors`` [n, d]."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.shape[0] != len(texts):
        raise ValueError(f"{len(texts)} answers but {vectors.shape[0]} vectors")
    if not 0.0 < similarity <= 1.0:
        raise ValueError("similarity must be in (0, 1]")
    keys: list[str | None] = []
    leaders: list[int] = []
    for j, text in enumerate(texts):
        if not keyable(text):
            keys.append(None)
            continue
        joined = next((lead for lead in leaders if float(vectors[lead] @ vectors[j]) >= similarity), None)
        if joined is None:
            leaders.append(j)
            joined = j
        keys.append(f"text:{joined}")
    return keys


def embed_and_key(texts: Sequence[str], embed: Embed, similarity: float = SIMILARITY) -> list[str | None]:
    """:func:`text_keys` with the vectors from ``embed`` (only keyable answers are embedded)."""
    wanted = [j for j, t in enumerate(texts) if keyable(t)]
    if not wanted:
        return [None] * len(texts)
    found = np.asarray(embed([texts[j][:MAX_CHARS] for j in wanted]), dtype=np.float32)
    vectors = np.zeros((len(texts), found.shape[1]), dtype=np.float32)
    vectors[wanted] = found
    return text_keys(texts, vectors, similarity)


def remembering(embed: Embed) -> Embed:
    """``embed`` that runs the model on each distinct text once: a plan reads all the answers it holds
    again after every round, and only the new round's answers need embedding. One per request."""
    seen: dict[str, np.ndarray] = {}

    def once(texts: list[str]) -> np.ndarray:
        new = [t for t in dict.fromkeys(texts) if t not in seen]
        if new:
            seen.update(zip(new, np.asarray(embed(new), dtype=np.float32), strict=True))
        return np.stack([seen[t] for t in texts])

    return once
