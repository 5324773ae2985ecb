"""Recorded answers, read per plan state exactly as the gateway reads live ones.

A replay asks "what would the planner know after calling these workers?" thousands of times per
query. :class:`AnswerBook` answers it from the recorded responses (RouterBench's
``<model>|model_response``, GSM8K's two answers) with the same functions the gateway runs
(router/answers.py, router/evidence.py), caching what does not depend on the state: the kind is
detected from the query and the answers of the state only, and each answer's key is computed once
per kind. Code is compared by behaviour (router/code_behaviour.py): each query's answers are run
once on every input harvested from the query and from any answer, remembering where each input came
from, so a state's keys use only the inputs the gateway would have had (the query's and its own
answers') — no answer the plan has not paid for leaks in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from router.answers import Kind, answer_key, choice_letters, detect_kind
from router.evidence import Answers, assemble
from router.planner import State
from router.text_agreement import MAX_CHARS, Embed, text_keys


@dataclass
class AnswerBook:
    """``texts[i][j]``: worker j's recorded answer to query i (``queries[i]``)."""

    queries: Sequence[str]
    texts: Sequence[Sequence[str]]
    behaviour: dict[int, object] = field(default_factory=dict)  # query → code runs (see code_runs)
    # free text compared by meaning (router/text_agreement.py) when given; else it agrees with nobody
    embed: Embed | None = None
    _vectors: dict[tuple[int, int], np.ndarray] = field(default_factory=dict, repr=False)
    _keys: dict[tuple[int, int, Kind], str | None] = field(default_factory=dict, repr=False)
    _kinds: dict[tuple[int, tuple[int, ...]], Kind] = field(default_factory=dict, repr=False)
    _letters: dict[int, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if len(self.queries) != len(self.texts):
            raise ValueError(f"{len(self.queries)} queries but {len(self.texts)} rows of answers")

    def __len__(self) -> int:
        return len(self.queries)

    def kind(self, i: int, members: Sequence[int] = ()) -> Kind:
        key = (i, tuple(sorted(members)))
        if key not in self._kinds:
            self._kinds[key] = detect_kind(self.queries[i], [self.texts[i][j] for j in members])
        return self._kinds[key]

    def key(self, i: int, j: int, kind: Kind) -> str | None:
        cached = (i, j, kind)
        if cached not in self._keys:
            if i not in self._letters:
                self._letters[i] = choice_letters(self.queries[i])
            self._keys[cached] = answer_key(self.texts[i][j], kind, self._letters[i])
        return self._keys[cached]

    def state(self, i: int, called: Sequence[int]) -> State:
        """The plan's state for query ``i`` after calling ``called`` (in order)."""
        return State.of(self.queries[i], called, self.read(i, called) if called else None)

    def _text_vectors(self, i: int, members: Sequence[int]) -> np.ndarray:
        """The embeddings of query i's answers by ``members``, each embedded once (all of the query's
        answers in one batch on first use)."""
        if (i, members[0]) not in self._vectors:
            assert self.embed is not None
            every = list(range(len(self.texts[i])))
            found = self.embed([self.texts[i][j][:MAX_CHARS] for j in every])
            self._vectors.update({(i, j): found[j] for j in every})
        return np.stack([self._vectors[(i, j)] for j in members])

    def read(self, i: int, members: Sequence[int]) -> Answers:
        """The answers of workers ``members`` (in that order) to query ``i``, as the planner sees them."""
        kind = self.kind(i, members)
        texts = [self.texts[i][j] for j in members]
        runs = self.behaviour.get(i)
        if kind is Kind.CODE and runs is not None:
            keys, passes = runs.keys(members)  # type: ignore[attr-defined]
            return assemble(self.queries[i], texts, kind, keys, passes)
        if kind is Kind.TEXT and self.embed is not None:
            return assemble(self.queries[i], texts, kind, text_keys(texts, self._text_vectors(i, members)))
        return assemble(self.queries[i], texts, kind, [self.key(i, j, kind) for j in members])
