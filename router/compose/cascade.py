"""Cascade: a cheap worker answers; a verifier accepts or escalates to the next, stronger worker.

The chain is the pool ordered by predicted cost, cheapest first, truncated to `depth` workers with
the pool's best-ranked worker always last (escalation must reach the strongest admissible worker,
not just the next-cheapest). A worker predicted to cost more than the strongest never answers
before it: the cheapest answers first, and paying more for a weaker answer is never a level. The
acceptance threshold follows the request's cost weight (`acceptance_threshold`). A member that fails is skipped (the next one answers); when the
ceiling stops the chain, the best answer so far is returned and the trace says so.
"""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal

from policies import Worker
from router.compose.acceptance import acceptance_threshold
from router.compose.base import Answer, CeilingReached, Outcome, Run, StepFailed, by_price
from router.compose.verifiers import Verifier


def chain(
    pool: tuple[Worker, ...], depth: int, cost: Callable[[Worker], Decimal] | None = None
) -> list[Worker]:
    """Cheapest first by `cost` (the step's predicted cost; list price without one), the best-ranked
    (pool[0]) last; `depth` workers at most. Workers predicted to cost more than the strongest are
    left out: none of them may answer before it."""
    strongest = pool[0]
    if cost is None:
        ordered = by_price(pool)
        cheaper = [w for w in ordered if w is not strongest]
        cheaper = cheaper[: ordered.index(strongest)]
    else:
        ceiling = cost(strongest)
        by_cost = sorted(pool, key=lambda w: (cost(w), w.output_price_per_m, w.input_price_per_m, w.name))
        cheaper = [w for w in by_cost if w is not strongest and cost(w) <= ceiling]
    return [*cheaper[: max(0, depth - 1)], strongest]


class Cascade:
    name = "cascade"

    def __init__(self, verifier: Verifier, depth: int = 2) -> None:
        if depth < 2:
            raise ValueError("a cascade needs a depth of at least 2")
        self.verifier = verifier
        self.depth = depth

    async def run(self, run: Run) -> Outcome:
        threshold = acceptance_threshold(run.cost_weight)
        workers = chain(run.pool, self.depth, lambda w: run.predict(w, run.messages))
        best: Answer | None = None
        for level, worker in enumerate(workers):
            last = level == len(workers) - 1
            try:
                answer = await run.call("answer", worker, run.messages)
            except StepFailed:
                continue  # the next worker answers instead
            except CeilingReached:
                return Outcome(best, self.name, run.steps, "cost ceiling reached: best answer so far")
            best = answer
            answer_step = run.steps[-1]
            if last:
                answer_step.verdict = "final level"
                return Outcome(
                    answer, self.name, run.steps, f"answered at level {level + 1} of {len(workers)}"
                )
            score = await self.verifier.score(run, worker, answer)
            accepted = score >= threshold
            answer_step.verdict = (
                f"{'accepted' if accepted else 'escalated'} ({self.verifier.name} {score:.2f} "
                f"{'≥' if accepted else '<'} {threshold:.2f})"
            )
            if accepted:
                return Outcome(
                    answer, self.name, run.steps, f"accepted at level {level + 1} of {len(workers)}"
                )
        return Outcome(
            best, self.name, run.steps, "every level failed" if best is None else "last answer kept"
        )
