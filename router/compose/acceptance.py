"""The cascade's learned acceptance model (FrugalGPT style): P(the cheap answer is right | query, answer).

Features are cheap to compute and need no model call: the answer's shape (length, a final-answer
marker, hedging words), how much of the question's numbers the answer uses, and — for worked
arithmetic — whether the answer's own calculations are right (`<<a*b=c>>` annotations and
`a op b = c` statements re-evaluated). A calibrated logistic regression over them is `fit` on
recorded (query, answer, correct) triples and `predict_proba` scores new answers.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Sequence

import numpy as np

from router.answers import NUMBER, final_answer

CALC = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
# An `a op b (op c)* = result` statement is read in two linear steps: the longest operator chain from a
# digit, then `= result` right after it. One regex for both (the chain, then `=`) failed at every
# digit of a long chain without `=` and rescanned the rest of it: quadratic, seconds on 64 KB.
_CHAIN = re.compile(r"\d[\d,.]*(?:\s*([-+*/x×])\s*\d[\d,.]*)*")
_RESULT = re.compile(r"\s*=\s*\$?(-?\d[\d,]*\.?\d*)")
MAX_EXPRESSION_CHARS = 300  # worked arithmetic is short; a longer chain is not re-evaluated
HEDGES = (
    "however",
    "actually",
    "assume",
    "approximately",
    "not possible",
    "cannot",
    "can't",
    "unclear",
    "round",
    "mistake",
    "correction",
    "wait",
    "i apologize",
    "sorry",
)
FEATURE_NAMES = (
    "log_chars",
    "lines",
    "final_marker",
    "calc_count",
    "calc_wrong_share",
    "stmt_count",
    "stmt_wrong_share",
    "hedges",
    "question_number_coverage",
    "final_is_integer",
    "numbers_per_line",
    "length_ratio",
)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def statements(answer: str) -> list[tuple[str, str]]:
    """(expression, claimed result) of each `a op b (op c)* = result` in the answer, e.g. ("16 - 3 - 4",
    "9"); a chain without an operator ("2023 = ...") is not a statement. Linear in the answer."""
    found: list[tuple[str, str]] = []
    at = 0
    while chain := _CHAIN.search(answer, at):
        at = chain.end()
        result = _RESULT.match(answer, at)
        if result and chain.group(1) is not None:
            found.append((chain.group(), result.group(1)))
            at = result.end()
    return found


def _evaluate(expression: str) -> float | None:
    """Plain arithmetic only (+ - * / and parentheses); anything else is not evaluated. Never raises:
    an expression longer than MAX_EXPRESSION_CHARS is not evaluated (a 1,100-term chain is too deep for
    Python's parser and for the recursive walk), and RecursionError/MemoryError count as "not arithmetic"."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        return None
    expression = expression.replace("×", "*").replace("x", "*").replace(",", "").replace("$", "")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise ValueError("not arithmetic")

    try:
        return walk(tree)
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
        return None


def _wrong_share(pairs: list[tuple[str, str]]) -> tuple[int, float]:
    checked = wrong = 0
    for expression, result in pairs:
        value, claimed = _evaluate(expression), _number(result)
        if value is None or claimed is None:
            continue
        checked += 1
        if not math.isclose(value, claimed, rel_tol=1e-3, abs_tol=0.011):
            wrong += 1
    return checked, (wrong / checked if checked else 0.0)


def answer_features(query: str, answer: str) -> np.ndarray:
    lowered = answer.lower()
    lines = [line for line in answer.splitlines() if line.strip()]
    calc_count, calc_wrong = _wrong_share(CALC.findall(answer))
    stmt_count, stmt_wrong = _wrong_share(statements(answer))
    question_numbers = {n.replace(",", "").rstrip(".") for n in NUMBER.findall(query)}
    answer_numbers = {n.replace(",", "").rstrip(".") for n in NUMBER.findall(answer)}
    coverage = len(question_numbers & answer_numbers) / len(question_numbers) if question_numbers else 1.0
    final = final_answer(answer)
    final_value = _number(final) if final else None
    return np.array(
        [
            math.log1p(len(answer)),
            len(lines),
            float("####" in answer or "answer is" in lowered),
            calc_count,
            calc_wrong,
            stmt_count,
            stmt_wrong,
            sum(lowered.count(h) for h in HEDGES),
            coverage,
            float(final_value is not None and float(final_value).is_integer()),
            len(answer_numbers) / max(1, len(lines)),
            len(answer) / max(1, len(query)),
        ],
        dtype=np.float64,
    )


class AcceptanceModel:
    """fit(queries, answers, correct) / predict_proba(queries, answers) -> P(correct)."""

    def __init__(self, C: float = 1.0, seed: int = 0) -> None:
        self.C = C
        self.seed = seed
        self.model = None

    @staticmethod
    def features(queries: Sequence[str], answers: Sequence[str]) -> np.ndarray:
        return np.vstack([answer_features(q, a) for q, a in zip(queries, answers, strict=True)])

    def fit(self, queries: Sequence[str], answers: Sequence[str], correct: Sequence[bool]) -> AcceptanceModel:
        from sklearn.calibration import CalibratedClassifierCV
        from sklearn.linear_model import LogisticRegression
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

        y = np.asarray(correct, dtype=int)
        if len(set(y.tolist())) < 2:
            raise ValueError("the acceptance model needs both right and wrong answers to learn from")
        base = make_pipeline(
            StandardScaler(), LogisticRegression(C=self.C, max_iter=2000, random_state=self.seed)
        )
        folds = max(2, min(5, int(np.bincount(y).min())))
        self.model = CalibratedClassifierCV(base, method="sigmoid", cv=folds)
        self.model.fit(self.features(queries, answers), y)
        return self

    def predict_proba(self, queries: Sequence[str], answers: Sequence[str]) -> np.ndarray:
        if self.model is None:
            raise RuntimeError("fit the acceptance model first")
        return self.model.predict_proba(self.features(queries, answers))[:, 1]


def acceptance_threshold(cost_weight: float) -> float:
    """The cascade accepts the cheap answer when P(correct) ≥ this. It follows the request's λ:
    λ = 0.5 (the default) → 0.5; λ → 0 (quality first) → 0.7, escalating more; λ ≥ 1.5 → 0.1."""
    return float(min(0.9, max(0.1, 0.5 + 0.4 * (0.5 - cost_weight))))
