"""What the answers obtained so far say about each other: the post-hoc estimator's features.

After each step of a plan the router holds some workers' answers to one query. Whether one of them
is right is judged from evidence that carries across tasks and workers (no task names, no worker
identities), so the same estimator serves a new task or a new worker:

* **agreement**: answers are normalised by their kind (router/answers.py: choice letter, final
  number, canonical span; code by its *behaviour* on shared inputs, router/code_behaviour.py; free
  text has no key yet) into classes of answers that say the same thing. A class backed by
  several workers, or by workers the router trusts, is more often right;
* **priors**: each worker's P(right | query) from the query-only router (the step-0 model), as
  log-odds, for the answer itself, its class and the strongest rival class;
* **form**: length, refusals, hedging, whether the answer has its kind's form at all;
* **checks**: for code, the share of the prompt's own asserts it passes; for worked arithmetic, the
  answer's own calculations re-done (router/compose/acceptance.py).

:class:`Answers` holds one query's answers read once (kind, keys, form, checks);
:func:`posthoc_rows` turns a set of them (the plan's state) into one feature row per answer.
The same code runs live (gateway) and offline (the replay that measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from router.answers import Form, Kind, answer_key, choice_letters, detect_kind, form
from router.compose.acceptance import FEATURE_NAMES as ARITHMETIC
from router.compose.acceptance import answer_features

KINDS = tuple(Kind)
NO_PRIOR = -6.0  # log-odds standing for "no such answer" (P ≈ 0.0025)

POSTHOC_FEATURES = (
    "prior",  # this worker's log-odds of being right on this query (step-0 model)
    "answers",  # how many answers the state holds
    "agreeing",  # other answers in this answer's class
    "agreeing_prior_sum",  # their summed log-odds
    "class_prior_max",  # the most trusted worker in this class (this one included)
    "rival_size",  # the strongest other class: its size,
    "rival_prior_sum",  # summed log-odds,
    "rival_prior_max",  # and most trusted worker
    "dissenting",  # answers in other classes (keyed ones)
    "classes",
    "well_formed",
    "log_chars",
    "refusal",
    "hedges",
    "options",  # choices the query offers (chance agreement is 1/options); 0 for other kinds
    "assert_pass",  # share of the prompt's own tests passed; -1: none to run
    *(f"arithmetic_{name}" for name in ARITHMETIC),
    *(f"kind_{k.value}" for k in KINDS),
)


def logit(p):
    """log(p / (1 − p)) with p clipped to [0.001, 0.999], for a number or an array of them."""
    clipped = np.clip(np.asarray(p, dtype=float), 1e-3, 1 - 1e-3)
    out = np.log(clipped / (1 - clipped))
    return float(out) if out.ndim == 0 else out


@dataclass(frozen=True, slots=True)
class Answers:
    """One query's answers, read once: the kind asked for, each answer's key, form and checks.

    ``keys[j]`` is None when answer j has no key of its kind (a refusal, a choice that names no
    offered letter, code that does not run): it then agrees with nobody.
    """

    kind: Kind
    keys: tuple[str | None, ...]
    forms: tuple[Form, ...]
    assert_pass: tuple[float | None, ...]
    arithmetic: np.ndarray  # [n, len(ARITHMETIC)]
    options: int = 0  # letters a multiple-choice query offers

    def __len__(self) -> int:
        return len(self.keys)


def read_answers(
    query: str,
    texts: Sequence[str],
    *,
    kind: Kind | None = None,
    code_keys: Sequence[str | None] | None = None,
    assert_pass: Sequence[float | None] | None = None,
    text_keys: Sequence[str | None] | None = None,
) -> Answers:
    """Kind, keys, form and checks of ``texts`` (the answers to ``query`` obtained so far).

    ``code_keys``/``assert_pass`` come from running the code (router/code_behaviour.py), which the
    caller does because it needs a subprocess; without them code is compared by its canonical source.
    ``text_keys`` compare free text by meaning (router/text_agreement.py: it needs the embedding
    model, so the caller runs it); without them free text has no key and agrees with nobody.
    """
    kind = kind or detect_kind(query, texts)
    if kind is Kind.CODE and code_keys is not None:
        keys: list[str | None] = list(code_keys)
    elif kind is Kind.TEXT and text_keys is not None:
        keys = list(text_keys)
    else:
        letters = choice_letters(query)
        keys = [answer_key(t, kind, letters) for t in texts]
    return assemble(query, texts, kind, keys, assert_pass)


def assemble(
    query: str,
    texts: Sequence[str],
    kind: Kind,
    keys: Sequence[str | None],
    assert_pass: Sequence[float | None] | None = None,
) -> Answers:
    """:class:`Answers` from keys already made (the offline replay caches them per answer)."""
    n = len(texts)
    if kind is Kind.NUMBER:
        arithmetic = np.array([answer_features(query, t) for t in texts])
    else:
        arithmetic = np.zeros((n, len(ARITHMETIC)))
    return Answers(
        kind,
        tuple(keys),
        tuple(form(t, k) for t, k in zip(texts, keys, strict=True)),
        tuple(assert_pass) if assert_pass is not None else (None,) * n,
        arithmetic.reshape(n, len(ARITHMETIC)),
        len(choice_letters(query)) if kind is Kind.CHOICE else 0,
    )


def classes(keys: Sequence[str | None], members: Sequence[int]) -> dict[object, list[int]]:
    """Answers of ``members`` grouped by key; a keyless answer is a class of its own."""
    out: dict[object, list[int]] = {}
    for j in members:
        out.setdefault(keys[j] if keys[j] is not None else ("alone", j), []).append(j)
    return out


def posthoc_rows(answers: Answers, members: Sequence[int], log_odds: Sequence[float]) -> np.ndarray:
    """One row of :data:`POSTHOC_FEATURES` per answer in ``members`` (the state), in that order.

    ``log_odds[j]`` is answer j's worker's prior log-odds on this query (indexed like ``answers``).
    """
    groups = classes(answers.keys, members)
    weight = {c: sum(log_odds[j] for j in m) for c, m in groups.items()}
    strongest = {c: max(log_odds[j] for j in m) for c, m in groups.items()}
    keyed = sum(1 for j in members if answers.keys[j] is not None)
    kind_onehot = [float(answers.kind is k) for k in KINDS]
    rows = []
    for j in members:
        mine = answers.keys[j] if answers.keys[j] is not None else ("alone", j)
        rivals = [c for c in groups if c != mine]
        rival = max(rivals, key=lambda c: weight[c]) if rivals else None
        f = answers.forms[j]
        passed = answers.assert_pass[j]
        rows.append(
            [
                log_odds[j],
                len(members),
                len(groups[mine]) - 1,
                weight[mine] - log_odds[j],
                strongest[mine],
                len(groups[rival]) if rival is not None else 0,
                weight[rival] if rival is not None else 0.0,
                strongest[rival] if rival is not None else NO_PRIOR,
                keyed - (len(groups[mine]) if answers.keys[j] is not None else 0),
                len(groups),
                float(f.well_formed),
                f.log_chars,
                float(f.refusal),
                min(f.hedges, 5),
                answers.options,
                -1.0 if passed is None else passed,
                *answers.arithmetic[j],
                *kind_onehot,
            ]
        )
    return np.asarray(rows, dtype=float).reshape(len(members), len(POSTHOC_FEATURES))
