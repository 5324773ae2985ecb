"""How a cascade decides to accept a cheap answer: each verifier returns P(the answer is right).

- `ModelVerifier`: the learned acceptance model (no model call, microseconds).
- `ConsistencyVerifier`: k samples of the same worker agree on the final answer (k − 1 extra calls).
- `JudgeVerifier`: a judge worker scores the answer 0–10 (one short call).
A verifier that cannot decide (its call failed, the judge answered garbage) returns 0: the
cascade escalates — doubt costs money, never quality.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Protocol

from policies import Worker
from router.compose.acceptance import AcceptanceModel, final_answer
from router.compose.base import Answer, CeilingReached, Run, StepFailed, user_turn

JUDGE_PROMPT = (
    "You check answers. Question:\n{question}\n\nProposed answer:\n{answer}\n\n"
    "How likely is the proposed answer to be correct and complete? Reply with one integer from 0 "
    "(certainly wrong) to 10 (certainly right) and nothing else."
)
SCORE = re.compile(r"\b(10|[0-9])\b")


class Verifier(Protocol):
    name: str

    async def score(self, run: Run, worker: Worker, answer: Answer) -> float: ...


class ModelVerifier:
    name = "model"

    def __init__(self, model: AcceptanceModel) -> None:
        self.model = model

    async def score(self, run: Run, worker: Worker, answer: Answer) -> float:
        return float(self.model.predict_proba([run.question], [answer.text])[0])


class ConsistencyVerifier:
    name = "consistency"

    def __init__(self, samples: int = 3, temperature: float = 0.8) -> None:
        if samples < 2:
            raise ValueError("self-consistency needs at least 2 samples")
        self.samples = samples
        self.temperature = temperature

    async def score(self, run: Run, worker: Worker, answer: Answer) -> float:
        finals = [final_answer(answer.text)]
        for _ in range(self.samples - 1):
            try:
                extra = await run.call("sample", worker, run.messages, temperature=self.temperature)
            except (StepFailed, CeilingReached):
                break
            finals.append(final_answer(extra.text))
        agreeing = Counter(finals)[finals[0]] if finals[0] is not None else 0
        return agreeing / self.samples  # missing samples count as disagreement


class JudgeVerifier:
    name = "judge"

    def __init__(self, judge: Worker) -> None:
        self.judge = judge

    async def score(self, run: Run, worker: Worker, answer: Answer) -> float:
        prompt = JUDGE_PROMPT.format(question=run.question, answer=answer.text)
        try:
            verdict = await run.call("judge", self.judge, user_turn(prompt), max_tokens=4, temperature=0)
        except (StepFailed, CeilingReached):
            return 0.0
        found = SCORE.search(verdict.text)
        if found is None:
            run.mark("garbage verdict: escalate")
            return 0.0
        return int(found.group(1)) / 10
