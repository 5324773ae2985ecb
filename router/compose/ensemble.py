"""Ensemble + fuse (Mixture-of-Agents style): k workers answer in parallel, a fuser writes the answer.

Members are the pool's k best-ranked workers, run with bounded concurrency and a per-step timeout;
a member that fails or times out is dropped. The fuser (the best-ranked worker unless named) sees
the client's conversation (its system prompt included: the fused text is the answer) with the
question and the candidates in place of the last turn — anonymous and in a shuffled order, because
LLM judges favour the first slot — never which worker wrote what. One surviving candidate is returned as is;
if the fuser does not fit under the ceiling or fails, the best-ranked member's answer is returned.
"""

from __future__ import annotations

import asyncio
import random

from policies import Worker
from router.compose.base import Answer, CeilingReached, Outcome, Run, StepFailed

FUSE_PROMPT = (
    "Several assistants answered the question below. Their answers may contain errors. Write the "
    "single best answer to the question: use what is right in them, fix what is wrong, and do not "
    "mention the assistants.\n\nQuestion:\n{question}\n\n{candidates}"
)


class Ensemble:
    name = "ensemble"

    def __init__(self, members: int = 3, concurrency: int = 3, fuser: str | None = None) -> None:
        if members < 2:
            raise ValueError("an ensemble needs at least 2 members")
        self.members = members
        self.concurrency = concurrency
        self.fuser = fuser

    def _fuser(self, run: Run) -> Worker:
        named = [w for w in run.pool if w.name == self.fuser]
        return named[0] if named else run.pool[0]

    async def run(self, run: Run) -> Outcome:
        members = list(run.pool[: self.members])
        gate = asyncio.Semaphore(self.concurrency)
        shares = run.split(members, run.messages)  # members run together: each gets its share of the room

        async def member(worker: Worker, share) -> Answer | None:
            async with gate:
                try:
                    return await run.call("member", worker, run.messages, allowance=share)
                except (StepFailed, CeilingReached):
                    return None

        asked = await asyncio.gather(*(member(w, a) for w, a in zip(members, shares, strict=True)))
        answers = [a for a in asked if a is not None]
        if not answers:
            return Outcome(None, self.name, run.steps, "every member failed")
        if len(answers) == 1:
            return Outcome(answers[0], self.name, run.steps, "one member answered: returned without fusing")
        shuffled = answers[:]
        random.Random(run.seed).shuffle(shuffled)
        candidates = "\n\n".join(f"Answer {i + 1}:\n{a.text}" for i, a in enumerate(shuffled))
        prompt = FUSE_PROMPT.format(question=run.question, candidates=candidates)
        try:
            fused = await run.call("fuser", self._fuser(run), run.conversation(prompt))
        except (StepFailed, CeilingReached) as exc:
            kind = "cost ceiling" if isinstance(exc, CeilingReached) else "fuser failed"
            return Outcome(answers[0], self.name, run.steps, f"{kind}: best-ranked member's answer")
        run.mark(f"fused {len(answers)} candidates")
        return Outcome(fused, self.name, run.steps, f"fused {len(answers)} of {len(members)} members")
