"""The answer-aware plan: after each round the planner reads the answers so far and calls more, or stops.

The planner (router/planner.py) compares stopping now — returning the answer its post-hoc estimator
rates best, from the answers' agreement, the workers' priors, form and checks (router/evidence.py) —
with calling another worker (or, with a latency weight, two at once). Every call goes through
`Run.call`, so the plan stays inside the admissible pool and under the request's cost ceiling:
workers whose predicted cost no longer fits are masked out before the planner chooses (those that
never fit are named in the note and in `detail["over_ceiling"]`), a worker that fails (error,
timeout, empty answer) is dropped for the rest of the plan and never retried, and so is one the
policy in force no longer admits (a reload while the plan ran: `Run.admissible`), which is not
called at all; a ceiling stop returns the best answer so far and says so. A run stopped from
outside (`Run.stop`: the client hung up) or cut by the deadline starts no further round. Besides
the workers' calls, a round costs a few regexes and two small tree-model predictions (well under a
millisecond), run inline.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

from router.answers import Kind, detect_kind
from router.compose.base import (
    Answer,
    CeilingReached,
    DeadlineReached,
    Excluded,
    Outcome,
    Run,
    Step,
    StepFailed,
)
from router.evidence import Answers, read_answers
from router.features import TEXT_WHOLE, query_text, text_rule_of
from router.planner import Decision, Plans, State

log = logging.getLogger("polyroute.compose")

CodeKeys = Callable[[str, Sequence[str]], Awaitable[tuple[Sequence[str | None], Sequence[float | None]]]]
TextKeys = Callable[[Sequence[str]], Awaitable[Sequence[str | None]]]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class Planned:
    """Workflow "plan": `planner` decides round by round over `run.pool`.

    ``log_odds`` (each worker's prior log-odds of answering this query right) and ``costs`` (its
    predicted USD) are aligned with ``run.pool``; ``latency_weight`` (μ) is what one more round trip
    costs in quality units (μ > 0 lets the planner call two workers in the same round);
    ``code_keys`` (async ``(query, texts) -> (keys, assert_pass)``) compares code answers by
    behaviour, None by canonical source; ``text_keys`` (async ``texts -> keys``,
    router/text_agreement.py) compares free-text answers by meaning, None: they agree with nobody;
    ``question_rule`` is the part of the last user message the plan was trained to read
    (router.features.query_text: RouterBench's plans read a few-shot prompt's last paragraph, so the
    option letters and the asserts they see are the question's, not an example's)."""

    name = "plan"

    def __init__(
        self,
        planner: Plans,
        log_odds: Sequence[float],
        costs: Sequence[float],
        latency_weight: float = 0.0,
        code_keys: CodeKeys | None = None,
        parallel: int = 2,
        text_keys: TextKeys | None = None,
        question_rule: str = TEXT_WHOLE,
    ) -> None:
        if len(log_odds) != len(costs):
            raise ValueError(f"{len(log_odds)} priors but {len(costs)} costs")
        if not math.isfinite(latency_weight) or latency_weight < 0:
            raise ValueError("latency_weight must be a finite number >= 0")
        self.planner = planner
        self.log_odds = [float(x) for x in log_odds]
        self.costs = [float(c) for c in costs]
        self.latency_weight = float(latency_weight)
        self.code_keys = code_keys
        self.text_keys = text_keys
        self.parallel = parallel
        # the model card's check: an unknown rule fails here, not in a request's first round
        self.question_rule = text_rule_of({"text_rule": question_rule})

    async def read(self, question: str, texts: Sequence[str]) -> Answers:
        """The answers so far as the planner sees them (code run in a subprocess when asked to)."""
        kind = detect_kind(question, texts)
        if kind is Kind.CODE and self.code_keys is not None:
            try:
                keys, passes = await self.code_keys(question, list(texts))
                return read_answers(question, texts, kind=kind, code_keys=keys, assert_pass=passes)
            except Exception:  # running the code is evidence, not a requirement
                log.warning("comparing code answers by behaviour failed; by source instead", exc_info=True)
        if kind is Kind.TEXT and self.text_keys is not None:
            try:
                return read_answers(question, texts, kind=kind, text_keys=await self.text_keys(list(texts)))
            except Exception:  # so is comparing by meaning: without it free text agrees with nobody
                log.warning(
                    "comparing free-text answers by meaning failed; they agree with nobody", exc_info=True
                )
        return read_answers(question, texts, kind=kind)

    def decide(self, state: State, run: Run, allowed: Sequence[bool]) -> Decision:
        return self.planner.decide(
            state,
            self.log_odds,
            self.costs,
            run.cost_weight,
            latency_weight=self.latency_weight,
            parallel=self.parallel,
            allowed=allowed,
            names=[w.name for w in run.pool],
        )

    async def run(self, run: Run) -> Outcome:
        pool = run.pool
        if len(pool) != len(self.log_odds):
            raise ValueError(f"{len(pool)} workers in the pool but {len(self.log_odds)} priors")
        question = query_text(run.question, self.question_rule)
        called: list[int] = []  # pool indices that answered, in order (State.called)
        answers: list[Answer] = []
        answer_steps: list[Step] = []
        dropped: set[int] = set()  # failed, or refused by the ceiling: never called again
        rounds: list[list[str]] = []
        ceiling_hit = deadline_hit = False
        # workers whose first step alone would pass the ceiling are never asked: said in the trace,
        # not left out silently (a client's max_tokens prices the strongest worker out first)
        over = {w.name: run.predict(w, run.messages) for w in pool if not run.fits(w, run.messages)}
        state = State.of(question)
        decision: Decision | None = None
        for round_no in range(1, self.planner.max_calls + 1):  # each round calls at least one worker
            for k, worker in enumerate(pool):  # a policy reload since the start may have left some out
                if k not in dropped and k not in called and not await run.admits(worker):
                    dropped.add(k)
            allowed = [
                k not in dropped and k not in called and run.fits(worker, run.messages)
                for k, worker in enumerate(pool)
            ]
            decision = self.decide(state, run, allowed)
            if not decision.call:
                break
            before = len(run.steps)
            asked = [pool[k] for k in decision.call]
            # workers asked together share the room left, so the first to start cannot hold it all
            shares = run.split(asked, run.messages) if len(asked) > 1 else [None]
            results = await asyncio.gather(
                *(
                    run.call("answer", w, run.messages, allowance=a)
                    for w, a in zip(asked, shares, strict=True)
                ),
                return_exceptions=True,
            )
            # Run.call records a step when its call ends, so a round's steps arrive in whatever order
            # its workers finished; list them in the plan's order, as the header does, so the trace
            # reads the same on a busy machine as on an idle one
            place = {pool[k].name: i for i, k in enumerate(decision.call)}
            run.steps[before:] = sorted(
                run.steps[before:], key=lambda step: place.get(step.worker, len(place))
            )
            verdict = f"round {round_no}: {decision.reason}"
            went: list[str] = []
            for k, result in zip(decision.call, results, strict=True):
                if isinstance(result, Answer):
                    step = _step_of(run.steps[before:], pool[k].name)
                    step.verdict = verdict
                    called.append(k)
                    answers.append(result)
                    answer_steps.append(step)
                    went.append(pool[k].name)
                elif isinstance(result, Excluded):
                    dropped.add(k)  # run.call recorded it as skipped, with the policy's reason: not asked
                elif isinstance(result, StepFailed):
                    dropped.add(k)
                    _step_of(
                        run.steps[before:], pool[k].name
                    ).verdict = f"{verdict}; failed, dropped from the plan"
                    went.append(pool[k].name)
                elif isinstance(result, DeadlineReached):
                    dropped.add(k)  # run.call recorded it as "skipped: request deadline"
                    deadline_hit = True
                elif isinstance(result, CeilingReached):
                    dropped.add(k)  # run.call recorded it as "skipped: cost ceiling"
                    ceiling_hit = True
                else:  # a bug (a worker outside the pool...), or cancellation: not the plan's to absorb
                    raise result
            if went:
                rounds.append(went)
            if len(answers) > len(state.called):
                read = await self.read(question, [a.text for a in answers])
                state = State.of(question, called, read)
            deadline_hit = deadline_hit or run.expired() or run.stopped is not None
            if deadline_hit:  # no time (or nobody) for another round: the best answer held is the answer
                decision = self.decide(state, run, [False] * len(pool))
                break
            decision = None
        if decision is None:  # as many rounds as the planner may make calls: stop with the best answer
            decision = self.decide(state, run, [False] * len(pool))
            decision = replace(decision, reason=f"{_plural(self.planner.max_calls, 'round')} made")
            wanted = None
        elif deadline_hit:
            wanted = None
        else:
            wanted = self._ceiling_blocked(state, run, called, dropped)
        if wanted is not None:
            ceiling_hit = True
            run.steps.append(Step("answer", wanted, verdict="skipped: cost ceiling"))
        calls = sum(len(r) for r in rounds)
        detail: dict[str, Any] = {"rounds": rounds, "calls": calls}
        priced = ", ".join(f"{name} (predicted ${cost:.6f})" for name, cost in over.items())
        left_out = f"; left out, over the cost ceiling ${run.ceiling_usd:f}: {priced}" if over else ""
        if over:
            detail["over_ceiling"] = {name: f"{cost:f}" for name, cost in over.items()}
        done = f"{_plural(len(rounds), 'round')}, {_plural(calls, 'call')}"
        if not answers or decision.answer is None:
            if ceiling_hit and not calls:
                why = f"cost ceiling ${run.ceiling_usd:f}: no worker fits" + (f" ({priced})" if over else "")
            else:
                why = f"no worker answered after {done}" + ("; cost ceiling reached" if ceiling_hit else "")
                if deadline_hit:
                    why += (
                        f"; {run.stopped}" if run.stopped is not None else "; the request's deadline passed"
                    )
                why += left_out
            return Outcome(None, self.name, run.steps, why, detail)
        chosen = decision.answer
        step = answer_steps[chosen]
        # the planner rates the answers it chooses between; a plan table returns its plan's answer unrated
        rated = f" (P={float(decision.scores[chosen]):.2f})" if len(decision.scores) > chosen else ""
        step.verdict = f"chosen{rated}; {step.verdict}"
        detail["chosen"] = answers[chosen].worker
        if run.stopped is not None:
            note = f"{run.stopped} after {done}: best answer so far"
        elif deadline_hit:
            note = f"the request's deadline passed after {done}: best answer so far"
        elif ceiling_hit:
            wanted_text = f" (the plan wanted {wanted})" if wanted else ""
            note = f"cost ceiling reached after {done}: best answer so far{wanted_text}"
        else:
            note = f"stopped after {done}: {decision.reason.removeprefix('stop: ')}"
        return Outcome(answers[chosen], self.name, run.steps, note + left_out, detail)

    def _ceiling_blocked(self, state: State, run: Run, called: list[int], dropped: set[int]) -> str | None:
        """The worker the plan would have called next were it not for the cost ceiling, if any."""
        pool = run.pool
        over = [
            k not in dropped and k not in called and not run.fits(w, run.messages) for k, w in enumerate(pool)
        ]
        if not any(over):
            return None
        unbounded = self.decide(state, run, [k not in dropped and k not in called for k in range(len(pool))])
        blocked = [k for k in unbounded.call if over[k]]
        return pool[blocked[0]].name if blocked else None


def _step_of(steps: Sequence[Step], worker: str) -> Step:
    """The step `Run.call` recorded for `worker` among this round's steps (one per worker)."""
    for step in reversed(steps):
        if step.worker == worker and step.role == "answer":
            return step
    raise RuntimeError(f"no step recorded for {worker}")  # Run.call always records one


def plan_header(detail: dict[str, Any]) -> str:
    """`rounds=2; calls=3; steps=cheap+mid,pricey`: a "+" joins workers called in the same round."""
    rounds = detail.get("rounds") or []
    steps = ",".join("+".join(r) for r in rounds)
    return f"rounds={len(rounds)}; calls={detail.get('calls', 0)}; steps={steps}"


def check_planner(planner: Plans) -> None:
    """Run `planner` on a made-up query, before and after one answer: a planner whose models do not
    match this code (other features) fails here, when its router file loads, not on a client's request."""
    query = "Which is right?\nA) one\nB) two"
    for state in (State.of(query), State.of(query, (0,), read_answers(query, ["A"]))):
        planner.decide(state, [0.0, 1.0], [1.0, 2.0], 0.5, latency_weight=0.1)
