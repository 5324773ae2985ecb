"""Debate: two or three workers answer, then rebut each other for bounded rounds; a judge decides.

Each debater sees the question, its own last answer and the others' last answers, anonymous
("Debater B"), in the client's conversation (its system prompt included: a rebuttal may be the
answer), never the judge's view; the judge sees the question and the final answers in a
shuffled order and names the best one. A debater that fails drops out; with one left it wins.
"""

from __future__ import annotations

import asyncio
import random
import re

from policies import Worker
from router.compose.base import Answer, CeilingReached, Outcome, Run, StepFailed, user_turn

REBUT_PROMPT = (
    "Question:\n{question}\n\nYour answer:\n{own}\n\nOther answers:\n{others}\n\n"
    "Point out any errors in the other answers and in yours, then give your final answer."
)
JUDGE_PROMPT = (
    "Question:\n{question}\n\n{answers}\n\nWhich answer is correct and best? Reply with its letter only."
)
LETTERS = "ABC"


class Debate:
    name = "debate"

    def __init__(self, debaters: int = 2, rounds: int = 1, judge: str | None = None) -> None:
        if not 2 <= debaters <= 3:
            raise ValueError("a debate has 2 or 3 debaters")
        self.debaters = debaters
        self.rounds = rounds
        self.judge = judge

    async def _round(self, run: Run, answers: dict[str, tuple[Worker, Answer]], first: bool) -> None:
        # the debaters speak together: each gets its share of the room (predicted on the question)
        shares = dict(zip(answers, run.split([w for w, _ in answers.values()], run.messages), strict=True))

        async def speak(key: str, worker: Worker, own: Answer | None):
            if first:
                messages = run.messages
            else:
                others = "\n\n".join(f"Debater {k}:\n{a.text}" for k, (_, a) in answers.items() if k != key)
                messages = run.conversation(
                    REBUT_PROMPT.format(question=run.question, own=own.text, others=others)
                )
            try:
                role = "debater" if first else "rebuttal"
                return key, worker, await run.call(role, worker, messages, allowance=shares[key])
            except (StepFailed, CeilingReached):
                return key, worker, None

        results = await asyncio.gather(*(speak(k, w, a) for k, (w, a) in answers.items()))
        for key, worker, answer in results:
            if answer is not None:
                answers[key] = (worker, answer)
            elif first:
                answers.pop(key, None)  # never answered: out of the debate

    async def run(self, run: Run) -> Outcome:
        seats = list(run.pool[: self.debaters])
        answers: dict[str, tuple[Worker, Answer]] = {LETTERS[i]: (w, None) for i, w in enumerate(seats)}  # type: ignore[misc]
        await self._round(run, answers, first=True)
        if not answers:
            return Outcome(None, self.name, run.steps, "every debater failed")
        for _ in range(self.rounds):
            if len(answers) < 2:
                break
            await self._round(run, answers, first=False)
        if len(answers) == 1:
            (only,) = answers.values()
            return Outcome(only[1], self.name, run.steps, "one debater left: its answer")
        order = list(answers)
        random.Random(run.seed).shuffle(order)
        shown = {LETTERS[i]: key for i, key in enumerate(order)}
        listing = "\n\n".join(f"Answer {label}:\n{answers[key][1].text}" for label, key in shown.items())
        judges = [w for w in run.pool if w.name == self.judge] or [run.pool[0]]
        try:
            verdict = await run.call(
                "judge",
                judges[0],
                user_turn(JUDGE_PROMPT.format(question=run.question, answers=listing)),
                max_tokens=4,
                temperature=0,
            )
        except (StepFailed, CeilingReached) as exc:
            first_seat = answers[order[0]] if order[0] in answers else next(iter(answers.values()))
            return Outcome(
                answers.get("A", first_seat)[1],
                self.name,
                run.steps,
                f"no judgement ({exc}): first debater's answer",
            )
        found = re.search(r"\b([ABC])\b", verdict.text.upper())
        if found is None or found.group(1) not in shown:
            run.mark("garbage verdict")
            winner = answers["A"] if "A" in answers else next(iter(answers.values()))
            return Outcome(
                winner[1],
                self.name,
                run.steps,
                "the judge's verdict was unreadable: best-ranked debater's answer",
            )
        key = shown[found.group(1)]
        run.mark(f"chose {answers[key][0].name}")
        return Outcome(answers[key][1], self.name, run.steps, f"the judge chose {answers[key][0].name}")
