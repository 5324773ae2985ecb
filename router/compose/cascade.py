"""Cascade: a cheap worker answers; a verifier accepts or escalates to the next, stronger worker.

The chain is the pool ordered by predicted cost, cheapest first, truncated to `depth` workers with
the pool's best-ranked worker always last (escalation must reach the strongest admissible worker,
not just the next-cheapest). A worker predicted to cost more than the strongest never answers
before it: the cheapest answers first, and paying more for a weaker answer is never a level. The
acceptance threshold follows the request's cost weight (`acceptance_threshold`). A member that fails is skipped (the next one answers); when the
ceiling stops the chain, the best answer so far is returned and the trace says so.

When the strongest is also predicted cheapest, the chain is that worker alone: there is nobody to
escalate from. The pool's other workers then stay as fallbacks, cheapest first and `depth - 1` at
most (a cascade never has more than `depth` workers answer): one answers only when the strongest
failed, and its answer is kept as fast mode keeps a fallback's, unverified (nobody is left to
escalate to that is stronger). Without them one failure of the strongest was a 502 where fast mode
would have answered from another admissible worker.
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
    ordered = _cheapest_first(pool, cost)
    if cost is None:
        cheaper = [w for w in ordered if w is not strongest]
        cheaper = cheaper[: ordered.index(strongest)]
    else:
        ceiling = cost(strongest)
        cheaper = [w for w in ordered if w is not strongest and cost(w) <= ceiling]
    return [*cheaper[: max(0, depth - 1)], strongest]


def fallbacks(
    pool: tuple[Worker, ...], depth: int, cost: Callable[[Worker], Decimal] | None = None
) -> list[Worker]:
    """The workers that answer, cheapest first by `cost` (list price without one), when a one-level
    chain's strongest worker (pool[0], also the cheapest) fails: the pool's others, `depth - 1` at
    most, so a cascade still has at most `depth` workers answer."""
    return [w for w in _cheapest_first(pool, cost) if w is not pool[0]][: max(0, depth - 1)]


def _cheapest_first(pool: tuple[Worker, ...], cost: Callable[[Worker], Decimal] | None) -> list[Worker]:
    """The pool cheapest first by `cost` (list price breaking ties), or by list price without one."""
    if cost is None:
        return by_price(pool)
    return sorted(pool, key=lambda w: (cost(w), w.output_price_per_m, w.input_price_per_m, w.name))


class Cascade:
    name = "cascade"

    def __init__(self, verifier: Verifier, depth: int = 2) -> None:
        if depth < 2:
            raise ValueError("a cascade needs a depth of at least 2")
        self.verifier = verifier
        self.depth = depth

    async def run(self, run: Run) -> Outcome:
        threshold = acceptance_threshold(run.cost_weight)

        def predicted(worker: Worker) -> Decimal:
            return run.predict(worker, run.messages)

        workers = chain(run.pool, self.depth, predicted)
        if len(workers) == 1:  # the strongest is the cheapest: nobody to escalate from, only to fall back to
            return await self._alone(run, workers[0], fallbacks(run.pool, self.depth, predicted))
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

    async def _alone(self, run: Run, strongest: Worker, spare: list[Worker]) -> Outcome:
        """The one-level chain: the strongest (also the cheapest) answers, with no verifier (there is
        nobody to escalate to); when it fails, `spare` answer in turn, cheapest first, until one does."""
        for worker in (strongest, *spare):
            try:
                answer = await run.call("answer", worker, run.messages)
            except StepFailed:
                continue  # the next fallback answers instead
            except CeilingReached:
                return Outcome(None, self.name, run.steps, "cost ceiling reached: no answer")
            if worker is strongest:
                run.steps[-1].verdict = "final level"
                return Outcome(answer, self.name, run.steps, "answered at level 1 of 1")
            run.steps[-1].verdict = f"fallback: {strongest.name}, the strongest and cheapest, failed"
            return Outcome(
                answer, self.name, run.steps, f"answered by fallback {worker.name}: {strongest.name} failed"
            )
        return Outcome(None, self.name, run.steps, "every level failed")
