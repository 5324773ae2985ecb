"""Replaying answer-aware plans on recorded answers, charging every worker a plan calls.

No worker is called: each plan step looks its workers' answers up in the :class:`AnswerBook` and
pays their recorded cost (RouterBench's per-query USD, or the token estimate for GSM8K). The planner
decides with *predicted* costs (router/costs.py), as live; it is scored with the recorded ones.
Beside the planner, the fixed agreement rule the issue set as the bar to beat: ask two cheap
workers, accept when their normalised answers agree, else ask a fallback worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from router.offline.book import AnswerBook
from router.planner import Plans


@dataclass
class Replay:
    """Per (λ, query): the score of the answer returned, the recorded cost paid, the workers called
    and the rounds (sequential steps) it took."""

    lambdas: list[float]
    score: np.ndarray  # [L, n]
    cost: np.ndarray
    calls: np.ndarray
    rounds: np.ndarray
    first: np.ndarray  # [L, n] the first worker called

    def accuracy(self) -> np.ndarray:
        return np.nanmean(self.score, axis=1)

    def mean_cost(self) -> np.ndarray:
        return self.cost.mean(axis=1)

    def stop_shares(self, at: int) -> dict[str, float]:
        """Share of queries whose plan stopped after 1, 2, ... rounds, at λ index ``at``."""
        values, counts = np.unique(self.rounds[at], return_counts=True)
        return {
            str(int(v)): round(float(c) / self.rounds.shape[1], 4)
            for v, c in zip(values, counts, strict=True)
        }


def play(
    planner: Plans,
    book: AnswerBook,
    i: int,
    log_odds: np.ndarray,
    predicted_cost: np.ndarray,
    cost_weight: float,
    *,
    latency_weight: float = 0.0,
    memo: dict | None = None,
) -> tuple[list[int], int, int]:
    """One query's plan: (workers called in order, position of the answer returned, rounds)."""
    memo = {} if memo is None else memo
    called: list[int] = []
    rounds = 0
    while True:
        key = tuple(called)
        state = book.state(i, called)
        decision = planner.decide(
            state,
            log_odds,
            predicted_cost,
            cost_weight,
            latency_weight=latency_weight,
            memo=memo.setdefault(key, {}),
        )
        if not decision.call:
            return called, int(decision.answer if decision.answer is not None else 0), rounds
        called.extend(decision.call)
        rounds += 1


def replay(
    planner_for: Callable[[int], Plans],
    book: AnswerBook,
    rows: Sequence[int],
    log_odds: np.ndarray,
    predicted_cost: np.ndarray,
    recorded_cost: np.ndarray,
    labels: np.ndarray,
    lambdas: Sequence[float],
    *,
    latency_weight: float = 0.0,
    progress: Callable[[int], None] | None = None,
) -> Replay:
    """The plans of every query in ``rows`` at every λ; ``log_odds``/costs/labels are indexed by row."""
    rows = list(rows)
    shape = (len(lambdas), len(rows))
    score, cost = np.full(shape, np.nan), np.zeros(shape)
    calls, rounds, first = np.zeros(shape, dtype=int), np.zeros(shape, dtype=int), np.zeros(shape, dtype=int)
    for col, i in enumerate(rows):
        planner = planner_for(i)
        memo: dict = {}
        for at, lam in enumerate(lambdas):
            called, answer, steps = play(
                planner,
                book,
                i,
                log_odds[i],
                predicted_cost[i],
                float(lam),
                latency_weight=latency_weight,
                memo=memo,
            )
            score[at, col] = labels[i, called[answer]]
            cost[at, col] = float(recorded_cost[i, called].sum())
            calls[at, col], rounds[at, col] = len(called), steps
            first[at, col] = called[0]
        if progress is not None:
            progress(1)
    return Replay(list(lambdas), score, cost, calls, rounds, first)


def agreement_rule(
    book: AnswerBook,
    rows: Sequence[int],
    voters: tuple[int, int],
    fallback: int,
    recorded_cost: np.ndarray,
    labels: np.ndarray,
) -> dict:
    """Ask both ``voters``; return the first's answer when their keys agree, else ask ``fallback``."""
    scores, costs, escalated = [], [], 0
    for i in rows:
        answers = book.read(i, list(voters))
        spent = float(recorded_cost[i, list(voters)].sum())
        if answers.keys[0] is not None and answers.keys[0] == answers.keys[1]:
            scores.append(labels[i, voters[0]])
        else:
            escalated += 1
            spent += float(recorded_cost[i, fallback])
            scores.append(labels[i, fallback])
        costs.append(spent)
    return {
        "accuracy": float(np.nanmean(scores)),
        "cost_usd": float(np.mean(costs)),
        "escalated_share": escalated / max(1, len(rows)),
    }
