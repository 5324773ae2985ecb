"""Builder/verifier: a builder drafts, a verifier critiques against the request, the builder revises.

The builder is the best-ranked worker, the verifier the next one (a different model catches
different mistakes; the same one if the pool has one). When the request carries tests for code
(`metadata.tests`: Python source using assert), the draft's code is run against them with a
timeout, and the result is part of the critique. The draft is worker-written code, so it runs in the
code sandbox's child (router/code_behaviour.run_script), never with this process's environment (the
workers' API keys), uid or unlimited resources. The builder revises in the client's conversation
(its system prompt included: the revision is the answer). Bounded rounds; the draft ends when the
verifier approves and the tests pass, or rounds run out (last draft kept).
"""

from __future__ import annotations

import asyncio

from router.answers import FENCE
from router.code_behaviour import run_script
from router.compose.base import CeilingReached, Outcome, Run, StepFailed, user_turn

CRITIQUE_PROMPT = (
    "Check this answer to the request. If it is correct and complete, reply with the single word "
    "APPROVED. Otherwise list the problems briefly.\n\nRequest:\n{question}\n\nAnswer:\n{draft}{tests}"
)
REVISE_PROMPT = (
    "Request:\n{question}\n\nYour previous answer:\n{draft}\n\nA reviewer found these problems:\n"
    "{critique}\n\nWrite the corrected, complete answer."
)
TEST_TIMEOUT_S = 10.0


def extract_code(text: str) -> str:
    """The draft's fenced Python blocks, joined, or the draft itself when it has none. The fences are
    read by the answer readers' `FENCE` (```python3 and CRLF fences included), which stays linear on
    a draft of blank lines; a pattern of its own here took seconds on the event loop for one."""
    blocks = FENCE.findall(text)
    return "\n\n".join(blocks) if blocks else text


async def run_tests(code: str, tests: str, timeout_s: float = TEST_TIMEOUT_S) -> tuple[bool, str]:
    """Runs the draft's code, then the tests, as one script in the code sandbox's child (stdlib only, a
    clean environment, resource limits, nobody when this process is root, its process group killed at
    the end; router/code_behaviour.py): the draft may be hostile, and this process holds the workers'
    keys. Whether they passed, and why not: the last line of the traceback, or that they did not
    finish in `timeout_s`. The child blocks a thread, not the event loop."""
    status, line = await asyncio.to_thread(run_script, code + "\n\n" + tests + "\n", timeout_s)
    if status is None:
        return False, f"the tests {line}"
    if status == 0:
        return True, "all tests passed"
    return False, line[:500] or "tests failed"


class BuilderVerifier:
    name = "builder"

    def __init__(self, rounds: int = 2, tests: str | None = None) -> None:
        if rounds < 1:
            raise ValueError("at least one round")
        self.rounds = rounds
        self.tests = tests

    async def run(self, run: Run) -> Outcome:
        builder = run.pool[0]
        verifier = run.pool[1] if len(run.pool) > 1 else run.pool[0]
        try:
            draft = await run.call("builder", builder, run.messages)
        except (StepFailed, CeilingReached) as exc:
            return Outcome(None, self.name, run.steps, f"the builder could not draft: {exc}")
        for round_ in range(1, self.rounds + 1):
            test_report, passed = "", True
            if self.tests:
                passed, result = await run_tests(extract_code(draft.text), self.tests)
                test_report = f"\n\nTest run: {result}"
                run.mark(f"tests: {result}")
            try:
                critique = await run.call(
                    "verifier",
                    verifier,
                    user_turn(
                        CRITIQUE_PROMPT.format(question=run.question, draft=draft.text, tests=test_report)
                    ),
                )
            except (StepFailed, CeilingReached) as exc:
                return Outcome(
                    draft, self.name, run.steps, f"no review in round {round_} ({exc}): draft kept"
                )
            approved = critique.text.strip().upper().startswith("APPROVED")
            run.mark("approved" if approved else "changes requested")
            if approved and passed:
                return Outcome(draft, self.name, run.steps, f"approved in round {round_}")
            if round_ == self.rounds:
                break
            problems = critique.text if not approved else "The answer fails its tests."
            try:
                draft = await run.call(
                    "builder",
                    builder,
                    run.conversation(
                        REVISE_PROMPT.format(
                            question=run.question, draft=draft.text, critique=problems + test_report
                        )
                    ),
                )
            except (StepFailed, CeilingReached) as exc:
                return Outcome(
                    draft, self.name, run.steps, f"revision {round_} stopped ({exc}): last draft kept"
                )
        return Outcome(
            draft, self.name, run.steps, f"not approved after {self.rounds} rounds: last draft kept"
        )
