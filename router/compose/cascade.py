"""Cascade: a cheap worker answers; a verifier accepts or escalates to the next, stronger worker.

The chain is the pool ordered by price, cheapest first, truncated to `depth` workers with the
pool's best-ranked worker always last (escalation must reach the strongest admissible worker,
not just the next-cheapest). The acceptance threshold follows the request's cost weight
(`acceptance_threshold`). A member that fails is skipped (the next one answers); when the
ceiling stops the chain, the best answer so far is returned and the trace says so.
"""

from __future__ import annotations

from policies import Worker
from router.compose.acceptance import acceptance_threshold
from router.compose.base import Answer, CeilingReached, Outcome, Run, StepFailed, by_price
from router.compose.verifiers import Verifier


def chain(pool: tuple[Worker, ...], depth: int) -> list[Worker]:
    """Cheapest first, the best-ranked (pool[0]) last; `depth` workers at most."""
    strongest = pool[0]
    cheaper = [w for w in by_price(pool) if w is not strongest]
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
        workers = chain(run.pool, self.depth)
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
