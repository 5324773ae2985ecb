"""What every workflow shares: one run's context, its cost guard, and its trace.

A workflow never calls a worker directly: it asks its `Run`, which (1) only accepts workers of the
admissible pool, (2) predicts the step's cost and refuses it if the run's spend plus that
prediction would pass the request's ceiling — so a workflow stops early rather than overspends —
(3) bounds the step with a timeout, and (4) records the step (role, worker, tokens, cost,
latency, verdict or error) in the trace that goes to the ledger and, on request, to the client.
The worker call itself is injected (`ask`), so this package knows nothing of HTTP or litellm; so is
the scope each step's call runs in (`step_scope`), which `Run` tells what cut a call short (the step's
timeout, the request's deadline) and how to re-check the policy before a retry.

A step's output is bounded (max_tokens), its prompt tokens are predicted: before any step has
answered, from characters (policies.cost.token_chars: ASCII four a token, any other character a
token); once steps have reported usage, from the tokens per character this run's prompts were
actually billed (the worker's own, else the run's), never below the character estimate. So a run
whose text tokenizes denser than predicted (Chinese, Japanese...) stops before its next step would
pass the ceiling. A step can still pass it by what its prompt was mispredicted: above all one
started before any usage came back, or one whose prompt tokenizes denser than the run's earlier ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any, Protocol

from policies import Worker
from policies.cost import DEFAULT_EXPECTED_OUTPUT_TOKENS, BilledRate, estimate_tokens, token_chars

# Output tokens assumed at most for a worker whose output limit is unknown (no max_output_tokens in the
# catalog, a model litellm's map does not list), when the ceiling would allow more than this: no
# max_tokens is sent then (a larger one may be refused by the provider), so such a worker is not
# bounded strictly.
UNKNOWN_OUTPUT_LIMIT = 4096


# Steps whose output the workflow reads as a verdict (a judge's pick, a reviewer's critique), not as an
# answer the client may get: the client's output format (JSON mode, logprobs) would only garble them.
JUDGING_ROLES = frozenset({"judge", "verifier"})


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
# Whether the policy in force now still admits a worker for this request: None, or why not
Admissible = Callable[[Worker], Awaitable[str | None]]

# What cut a step's call short (`Run.call`, told to its `StepScope`): the step's own timeout, or the
# request's deadline.
STEP_TIMEOUT = "step_timeout"
DEADLINE = "deadline"
# Told what cut the step's call short (STEP_TIMEOUT or DEADLINE): a cancelled call carries no error,
# so whoever keeps the books of its worker calls learns of the cut only so.
CutBy = Callable[[str], None]
# Opened by `Run.call` around each step's call, in the task that makes the step, so steps that run
# together (an ensemble's members, a plan's round) each have their own; given the worker and the
# run's re-check as a retry of that worker asks it (`Run.readmit`), it yields the step's `CutBy`. The
# gateway's makes the step's worker calls under a CallScope of the step's own (gateway/compose.py).
StepScope = Callable[[Worker, Admissible], AbstractContextManager[CutBy]]


# A step's error, and the note of what ended a workflow, at most (`error_text`): they go to the trace,
# the ledger and, through a workflow's note, to a header.
ERROR_CHARS = 300
ELLIPSIS = "…"


def error_text(exc: BaseException, text: str | None = None, limit: int = ERROR_CHARS) -> str:
    """``text`` (by default the exception's own, else its type's name) in at most ``limit`` characters.

    The end of it that the gateway appended to a provider's message is kept whole: the exception's
    ``appended`` (gateway/upstream.py `WorkerError.append`, e.g. "(not retried: ...)"), which this
    package reads without knowing the gateway's types. The part before it, the provider's, is what
    is shortened, with an ellipsis: a provider that quotes a long body would otherwise push out what
    says why the call ended so."""
    text = (str(exc) or type(exc).__name__) if text is None else text
    if len(text) <= limit:
        return text
    appended = getattr(exc, "appended", "")
    room = limit - len(ELLIPSIS)
    if not isinstance(appended, str) or not appended or not text.endswith(appended) or len(appended) >= room:
        return text[:room] + ELLIPSIS
    return text[: room - len(appended)] + ELLIPSIS + appended


def _unbooked(what: str) -> None:
    """A run without a `StepScope` keeps no books of cut calls."""


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


async def still_admitted(admissible: Admissible | None, excluded: dict[str, str], worker: Worker) -> bool:
    """Whether ``admissible`` (the policy in force, asked again) still admits ``worker``; one it no
    longer admits is added to ``excluded`` with why, and stays out for the rest of the request. The
    one rule for a workflow's steps (`Run.admits`) and fast mode's attempts (the gateway's Exchange)."""
    if worker.name in excluded:
        return False
    why = None if admissible is None else await admissible(worker)
    if why is not None:
        excluded[worker.name] = why
    return why is None


async def why_excluded(admissible: Admissible | None, excluded: dict[str, str], worker: Worker) -> str | None:
    """`still_admitted` as a retry of the same worker asks it: None, or why the policy in force no
    longer admits ``worker`` (kept in ``excluded`` too)."""
    return None if await still_admitted(admissible, excluded, worker) else excluded[worker.name]


class Excluded(StepFailed):
    """The policy in force no longer admits the worker: it was reloaded after the request was admitted
    and leaves the worker out for this request (`Run.admissible`). The step is not made, the worker is
    never asked again in this run, and the workflow goes on without it as without a failed member: a
    policy decision is never undone downstream, including the decision of a policy that took effect
    while the workflow ran."""


class CeilingReached(Exception):
    """The next step's predicted cost would pass the request's ceiling: the workflow must stop."""


class DeadlineReached(CeilingReached):
    """The request's deadline has passed: no step may start, and the workflow stops as it does at
    the ceiling (a subclass, so every workflow that stops at the ceiling stops here too)."""


class Stopped(DeadlineReached):
    """The run was stopped from outside (`Run.stop`: the client hung up): no step may start, and the
    workflow stops as it does at the deadline. Steps already in flight finish, so what they cost is
    known and billed, not guessed."""


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


# A step's billed prompt includes the chat template's tokens (a few per message), so the rate of a
# short prompt ("Hi": 2 characters, 9 tokens) says nothing of text: only prompts of at least this
# many characters (about 100 tokens' worth, the template a few percent of it) teach the rate.
MIN_OBSERVED_CHARS = 400


def chars(messages: Sequence[dict[str, Any]]) -> int:
    """The messages' text as cost predictions count it (policies.cost.token_chars: a non-ASCII
    character counts as a token's worth of characters)."""

    def texts():
        for message in messages:
            content = message.get("content")
            if isinstance(content, str):
                yield content
            elif isinstance(content, list):
                for part in content:
                    if isinstance(part, dict) and isinstance(text := part.get("text", ""), str):
                        yield text

    return token_chars(texts())


# (the field a step's output bound is sent in, the one it must not be sent beside); swapped when the
# client sent max_completion_tokens
BOUND_FIELDS = ("max_tokens", "max_completion_tokens")


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
    # the client's output format (response_format, logprobs...): sent to every step but JUDGING_ROLES'
    answer_params: dict[str, Any] = field(default_factory=dict)
    step_timeout_s: float = 60.0
    seed: int = 0
    deadline: float | None = None  # the request's, in event-loop time: no step starts after it
    # per worker name, the most output tokens it writes where the catalog does not say (the gateway
    # fills it from litellm's model map): the bound of a step the client set no max_tokens for
    output_limits: dict[str, int] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    spent_usd: Decimal = Decimal(0)
    stopped: str | None = None  # why no step may start any more (`stop`), None while the run goes on
    # asked before each step (the gateway: has a policy reload since the request's admission left the
    # worker out?); None: the pool admitted at the start holds for the whole run
    admissible: Admissible | None = None
    # workers the policy in force left out after the run started, and why: never asked again
    excluded: dict[str, str] = field(default_factory=dict)
    # opened around each step's call (None: none): the gateway's keeps the step's worker calls' books
    step_scope: StepScope | None = None
    _reserved: Decimal = Decimal(0)  # predicted cost of steps in flight (parallel members)
    # prompt tokens billed and chars() sent, per worker and ("" key) for the whole run: the rate that
    # predicts later steps' prompts once steps have reported usage
    _billed: dict[str, BilledRate] = field(default_factory=dict)

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

    def conversation(self, instruction: str) -> list[dict[str, Any]]:
        """The client's conversation with its last user turn replaced by a workflow's own
        ``instruction`` (which quotes the question): the system and developer messages, recalled
        memory and earlier turns stay, so a step whose text the client may get (a fused answer, a
        rebuttal, a revision) follows the client's system prompt and knows the conversation. The
        replaced turn's other parts (images) follow the instruction; messages after it stay too."""
        messages = self.messages
        at = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
        if at is None:
            return [*messages, {"role": "user", "content": instruction}]
        content = messages[at].get("content")
        others = (
            [p for p in content if isinstance(p, dict) and p.get("type") != "text"]
            if isinstance(content, list)
            else []
        )
        turn = {
            **messages[at],
            "content": [{"type": "text", "text": instruction}, *others] if others else instruction,
        }
        return [*messages[:at], turn, *messages[at + 1 :]]

    def stop(self, reason: str) -> None:
        """No step may start from now on (steps in flight finish): the workflow stops as at the
        deadline, with the best answer it holds. The gateway calls it when the client hangs up."""
        if self.stopped is None:
            self.stopped = reason

    def fits(self, worker: Worker, messages: Sequence[dict[str, Any]]) -> bool:
        return self.spent_usd + self._reserved + self.predict(worker, messages) <= self.ceiling_usd

    def predict(self, worker: Worker, messages: Sequence[dict[str, Any]]) -> Decimal:
        output = self.max_tokens or DEFAULT_EXPECTED_OUTPUT_TOKENS
        return worker.cost_usd(self.prompt_tokens(worker, messages), output)

    def prompt_tokens(self, worker: Worker, messages: Sequence[dict[str, Any]]) -> int:
        """The prompt tokens ``messages`` are predicted to bill on ``worker``: the character estimate
        (policies.cost), raised to what this run's answered steps were billed per character — the
        worker's own steps when it has answered, else every step's. Never below the estimate: a rate
        that came out lower (a worker that reports few tokens) does not lower a bound."""
        size = chars(messages)
        estimate, _ = estimate_tokens(size, None)
        rate = self._billed.get(worker.name) or self._billed.get("") or BilledRate()
        return rate.raised(size, estimate)

    def _observe(self, worker: Worker, messages: Sequence[dict[str, Any]], prompt_tokens: int) -> None:
        """An answered step's billed prompt tokens, for :meth:`prompt_tokens`."""
        size = chars(messages)
        if prompt_tokens <= 0 or size < MIN_OBSERVED_CHARS:
            return
        for key in (worker.name, ""):
            self._billed.setdefault(key, BilledRate()).observe(size, prompt_tokens)

    def room(self) -> Decimal:
        """What is left of the ceiling for steps not yet started."""
        return self.ceiling_usd - self.spent_usd - self._reserved

    def split(self, workers: Sequence[Worker], messages: Sequence[dict[str, Any]]) -> list[Decimal]:
        """The room shared among steps about to run together, in proportion to their predicted costs:
        pass each its share as ``allowance``, so the first to start does not hold the others' room.
        When their predictions do not all fit, the first ones that do share it and the rest get 0 (the
        ceiling refuses them, as it would have refused them one after the other)."""
        predicted = [self.predict(w, messages) for w in workers]
        room = left = self.room()
        fits = []  # in order, the steps whose predictions fit what the earlier ones leave
        for p in predicted:
            fits.append(p <= left)
            left -= p if fits[-1] else 0
        total = sum((p for p, ok in zip(predicted, fits, strict=True) if ok), Decimal(0))
        if total <= 0:  # free steps, or none fits: an even split (a step that does not fit is refused)
            return [room / len(workers) if ok else Decimal(0) for ok in fits] if workers else []
        return [room * p / total if ok else Decimal(0) for p, ok in zip(predicted, fits, strict=True)]

    def _output_bound(
        self, worker: Worker, messages: Sequence[dict[str, Any]], allowance: Decimal
    ) -> tuple[int | None, Decimal]:
        """For a step the client set no output budget for: the max_tokens to send so that the step
        cannot cost more than ``allowance`` (None: none needed), and the most the step can then cost,
        which is what it holds of the ceiling while it runs. Without this a worker writing 2,000
        tokens where 256 were predicted passes the ceiling, and the budget with it."""
        prompt_cost = worker.cost_usd(self.prompt_tokens(worker, messages), 0)
        per_token = worker.cost_usd(0, 1)
        if per_token <= 0:  # output is free: nothing to bound
            return None, prompt_cost
        affordable = int((allowance - prompt_cost) / per_token)
        limit = worker.max_output_tokens or self.output_limits.get(worker.name)
        if limit is not None and affordable >= limit:
            return None, prompt_cost + per_token * limit
        if limit is None and affordable >= UNKNOWN_OUTPUT_LIMIT:
            return None, prompt_cost + per_token * UNKNOWN_OUTPUT_LIMIT
        return affordable, prompt_cost + per_token * affordable

    def expired(self) -> bool:
        """Whether the request's deadline has passed (no step may start)."""
        return self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline

    def _timed_out(self, cut: str) -> str:
        if cut == DEADLINE:
            return "cut by the request's deadline"
        return f"timed out after {self.step_timeout_s:g} s"

    def _scope(self, worker: Worker) -> AbstractContextManager[CutBy]:
        if self.step_scope is None:
            return nullcontext(_unbooked)
        return self.step_scope(worker, self.readmit)

    async def call(
        self,
        role: str,
        worker: Worker,
        messages: list[dict[str, Any]],
        *,
        allowance: Decimal | None = None,
        **params: Any,
    ) -> Answer:
        """Ask ``worker``, within ``allowance`` of the ceiling (default: all the room left; steps that
        run together pass their :meth:`split`)."""
        if worker.name not in self._names:  # a bug in a workflow must not leave the pool
            raise ValueError(f"{worker.name} is not in the admissible pool")
        now = asyncio.get_running_loop().time()
        if self.expired():
            self.steps.append(Step(role, worker.name, verdict="skipped: request deadline"))
            raise DeadlineReached(f"{role} on {worker.name}: the request's deadline has passed")
        if self.stopped is not None:
            self.steps.append(Step(role, worker.name, verdict=f"skipped: {self.stopped}"))
            raise Stopped(f"{role} on {worker.name}: {self.stopped}")
        await self._still_admitted(role, worker)
        predicted = self.predict(worker, messages)
        room = self.room()
        allowed = room if allowance is None else min(allowance, room)
        if predicted > allowed:
            self.steps.append(Step(role, worker.name, verdict="skipped: cost ceiling"))
            raise CeilingReached(
                f"{role} on {worker.name} (predicted ${predicted:.6f}) would pass the ceiling "
                f"${self.ceiling_usd:f} (spent ${self.spent_usd:.6f})"
            )
        shaped = {} if role in JUDGING_ROLES else self.answer_params
        merged = {**self.params, **shaped, **params}
        # One output bound per step, in the field the client used: OpenAI refuses max_tokens beside
        # max_completion_tokens (which current SDKs send). A step's own bound (a judge's 4) wins.
        field, other = BOUND_FIELDS
        if self.params.get("max_completion_tokens") is not None:
            field, other = other, field
        own = params.get("max_tokens", params.get("max_completion_tokens"))
        bound = own if own is not None else merged.get(field, merged.get(other, self.max_tokens))
        merged.pop(other, None)
        held = predicted  # with an output budget set, the prediction is the step's worst case
        if bound is None:
            bound, held = self._output_bound(worker, messages, allowed)
        if bound is not None:
            merged[field] = bound
        self._reserved += held
        started = time.perf_counter()
        step = Step(role, worker.name)
        timeout = self.step_timeout_s
        if self.deadline is not None:
            timeout = min(timeout, max(0.0, self.deadline - now))
        with self._scope(worker) as cut_by:
            try:
                answer = await asyncio.wait_for(self.ask(worker, messages, merged), timeout)
            except TimeoutError:
                cut = DEADLINE if self.expired() else STEP_TIMEOUT
                cut_by(cut)  # the call it cancelled, and that worker's calls retried before, go on the books
                step.error = self._timed_out(cut)
                raise StepFailed(step.error) from None
            except Exception as exc:  # a worker error: the workflow decides (drop the member, stop)
                step.error = error_text(exc)  # the provider's message shortened, not our notes
                raise StepFailed(step.error) from exc
            finally:
                self._reserved -= held
                step.latency_ms = round((time.perf_counter() - started) * 1000, 2)
                self.steps.append(step)
        step.cost_usd = answer.cost_usd
        step.prompt_tokens, step.completion_tokens = answer.prompt_tokens, answer.completion_tokens
        self.spent_usd += answer.cost_usd
        self._observe(worker, messages, answer.prompt_tokens)
        if not answer.text.strip():
            step.error = "empty answer"
            raise StepFailed(f"{worker.name} returned an empty answer")
        return answer

    async def admits(self, worker: Worker) -> bool:
        """Whether the policy in force still admits ``worker`` for this run (see ``admissible``); one
        it no longer admits is kept in ``excluded``, with why, and stays excluded for the run."""
        return await still_admitted(self.admissible, self.excluded, worker)

    async def readmit(self, worker: Worker) -> str | None:
        """`admits` as a retry of the same worker within a step asks it (the `StepScope`'s): None, or
        why the policy in force no longer admits it. A worker a reload excluded between two of its
        calls is not called again, and is left out of the rest of the run as at a step's start."""
        return await why_excluded(self.admissible, self.excluded, worker)

    async def _still_admitted(self, role: str, worker: Worker) -> None:
        """Raise :class:`Excluded` (the step recorded as skipped, and why) when the policy in force
        no longer admits ``worker``: a worker the operator excluded while the workflow ran is not
        called by a later step."""
        if await self.admits(worker):
            return
        why = self.excluded[worker.name]
        self.steps.append(Step(role, worker.name, verdict=f"skipped: {why}"))
        raise Excluded(f"{role} on {worker.name}: {why}")

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
