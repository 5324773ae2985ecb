"""What every workflow shares: one run's context, its cost guard, and its trace.

A workflow never calls a worker directly: it asks its `Run`, which (1) only accepts workers of the
admissible pool, (2) predicts the step's cost and refuses it if the run's spend plus that
prediction would pass the request's ceiling — so a workflow stops early rather than overspends —
(3) bounds the step with a timeout, and (4) records the step (role, worker, tokens, cost,
latency, verdict or error) in the trace that goes to the ledger and, on request, to the client.
The worker call itself is injected (`ask`), so this package knows nothing of HTTP or litellm.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any, Protocol

from policies import Worker, predicted_cost


@dataclass(frozen=True, slots=True)
class Answer:
    """One worker's answer to one step."""

    worker: str
    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: Decimal = Decimal(0)
    body: dict[str, Any] | None = None  # the OpenAI-shaped response, when the step produced one


Ask = Callable[[Worker, list[dict[str, Any]], dict[str, Any]], Awaitable[Answer]]


@dataclass(slots=True)
class Step:
    role: str
    worker: str
    cost_usd: Decimal = Decimal(0)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    verdict: str | None = None
    error: str | None = None

    def public(self) -> dict[str, Any]:
        data = asdict(self)
        data["cost_usd"] = f"{self.cost_usd:f}"
        return {k: v for k, v in data.items() if v is not None}


class StepFailed(Exception):
    """A member failed (error, timeout, garbage); the workflow decides whether it can go on."""


class CeilingReached(Exception):
    """The next step's predicted cost would pass the request's ceiling: the workflow must stop."""


@dataclass(slots=True)
class Outcome:
    answer: Answer | None
    workflow: str
    steps: list[Step]
    note: str = ""  # why it ended as it did (accepted at depth 1, ceiling reached, degraded...)
    detail: dict[str, Any] = field(default_factory=dict)  # workflow-specific summary (a plan's rounds)

    @property
    def cost_usd(self) -> Decimal:
        return sum((s.cost_usd for s in self.steps), Decimal(0))

    def trace(self) -> dict[str, Any]:
        trace = {
            "workflow": self.workflow,
            "note": self.note,
            "final_worker": self.answer.worker if self.answer else None,
            "cost_usd": f"{self.cost_usd:f}",
            "steps": [s.public() for s in self.steps],
        }
        if self.detail:
            trace["detail"] = self.detail
        return trace


def chars(messages: Sequence[dict[str, Any]]) -> int:
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return total


@dataclass
class Run:
    """One workflow execution: the question, the pool (best-ranked first), the guard, the trace."""

    messages: list[dict[str, Any]]
    pool: tuple[Worker, ...]
    ask: Ask
    ceiling_usd: Decimal
    cost_weight: float = 0.5
    max_tokens: int | None = None
    params: dict[str, Any] = field(default_factory=dict)  # the client's sampling parameters
    step_timeout_s: float = 60.0
    seed: int = 0
    steps: list[Step] = field(default_factory=list)
    spent_usd: Decimal = Decimal(0)
    _reserved: Decimal = Decimal(0)  # predicted cost of steps in flight (parallel members)

    def __post_init__(self) -> None:
        self._names = {w.name for w in self.pool}

    @property
    def question(self) -> str:
        for message in reversed(self.messages):
            if message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content
                if isinstance(content, list):
                    return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        return ""

    def fits(self, worker: Worker, messages: Sequence[dict[str, Any]]) -> bool:
        return self.spent_usd + self._reserved + self.predict(worker, messages) <= self.ceiling_usd

    def predict(self, worker: Worker, messages: Sequence[dict[str, Any]]) -> Decimal:
        return predicted_cost(worker, chars(messages), self.max_tokens)

    async def call(self, role: str, worker: Worker, messages: list[dict[str, Any]], **params: Any) -> Answer:
        if worker.name not in self._names:  # a bug in a workflow must not leave the pool
            raise ValueError(f"{worker.name} is not in the admissible pool")
        predicted = self.predict(worker, messages)
        if self.spent_usd + self._reserved + predicted > self.ceiling_usd:
            self.steps.append(Step(role, worker.name, verdict="skipped: cost ceiling"))
            raise CeilingReached(
                f"{role} on {worker.name} (predicted ${predicted:.6f}) would pass the ceiling "
                f"${self.ceiling_usd:f} (spent ${self.spent_usd:.6f})"
            )
        self._reserved += predicted
        started = time.perf_counter()
        step = Step(role, worker.name)
        try:
            merged = {**self.params, **params}
            if self.max_tokens is not None:
                merged.setdefault("max_tokens", self.max_tokens)
            answer = await asyncio.wait_for(self.ask(worker, messages, merged), self.step_timeout_s)
        except TimeoutError:
            step.error = f"timed out after {self.step_timeout_s:g} s"
            raise StepFailed(step.error) from None
        except Exception as exc:  # a worker error: the workflow decides (drop the member, stop)
            step.error = str(exc)[:300] or type(exc).__name__
            raise StepFailed(step.error) from exc
        finally:
            self._reserved -= predicted
            step.latency_ms = round((time.perf_counter() - started) * 1000, 2)
            self.steps.append(step)
        step.cost_usd = answer.cost_usd
        step.prompt_tokens, step.completion_tokens = answer.prompt_tokens, answer.completion_tokens
        self.spent_usd += answer.cost_usd
        if not answer.text.strip():
            step.error = "empty answer"
            raise StepFailed(f"{worker.name} returned an empty answer")
        return answer

    def mark(self, verdict: str) -> None:
        """Attach a verdict to the last step (accepted, escalated, chosen...)."""
        if self.steps:
            self.steps[-1].verdict = verdict


class Workflow(Protocol):
    name: str

    async def run(self, run: Run) -> Outcome: ...


def by_price(pool: Sequence[Worker]) -> list[Worker]:
    """Cheapest first (output price dominates an answer's cost), then input price, then name."""
    return sorted(pool, key=lambda w: (w.output_price_per_m, w.input_price_per_m, w.name))


def user_turn(text: str, system: str | None = None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if system:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": text})
    return messages
