"""Composition on the request path: whether to compose, running the workflow, answering.

`model="compose:<workflow>"` forces a workflow; under `model="auto"` a learned router with a trained
planner runs the answer-aware plan (router/compose/planned.py: after each round, call another worker
or stop), and one without may choose a cascade when its predicted utility beats the best single
worker (router/compose/choose.py).
A workflow draws only from the admissible pool, in the router's order; a request with tools, or a
pool of one worker, is answered in fast mode and says
so (`x-polyroute-compose`), as is, under auto, one whose workflow could not start within its
ceiling. The whole workflow reserves its cost ceiling on the tenant's budget up front and settles
the actual total; each step is checked against that ceiling before it runs. Nothing is sent before
the workflow ends, so the client's connection is watched meanwhile: once it has gone no step
starts, and the ledger says 499. The final answer is returned as a chat.completion or streamed as
SSE chunks; the trace (every step's worker, cost, verdict) goes to the ledger and, with
`x-polyroute-trace: 1`, to the client. However the workflow ends — no answer (502), a fault (500),
the request cancelled at shutdown (503) — what its answered steps cost is settled on the budget and
written to the ledger. A workflow `auto` chose (not one the client asked for) that produces no
answer hands the request to fast mode over the admissible workers it did not try, as fast mode
falls back, its steps billed all the same.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import memory, ratelimits, tracing
from gateway.errors import APIError, error_response
from gateway.schemas import ChatCompletionRequest
from gateway.upstream import Attempt, CallScope, WorkerError, attempts_header, calling, with_attempts
from policies import Worker, predicted_cost
from router import RouteRequest
from router.compose import (
    PREFIX,
    WORKFLOWS,
    Answer,
    BuilderVerifier,
    Cascade,
    ConsistencyVerifier,
    Debate,
    Ensemble,
    JudgeVerifier,
    ModelVerifier,
    Outcome,
    Run,
    predict_cascade,
    requested_workflow,
    should_cascade,
)
from router.compose.base import Admissible, CutBy, chars, error_text
from router.compose.planned import Planned, plan_header
from router.decide import Estimate
from router.evidence import logit
from router.learned import COST_WEIGHT_SOURCES, CostWeight, cost_weight_of

log = logging.getLogger("polyroute.compose")

__all__ = [
    "COMPOSE_HEADER",
    "PLAN_HEADER",
    "PREFIX",
    "TRACE_HEADER",
    "WORKFLOWS",
    "Composition",
    "checked_workflow",
    "degraded_trace",
    "plan",
    "requested_workflow",
    "respond",
]

COMPOSE_HEADER = "x-polyroute-compose"
PLAN_HEADER = "x-polyroute-plan"
TRAIN_PLANNER = "polyroute router train --strategy cascade"
MAX_LATENCY_WEIGHT = 10.0
TRACE_HEADER = "x-polyroute-trace"
SAMPLING = (
    "temperature",
    "top_p",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "seed",
)
# Sent to every step with the sampling: the client's end-user id, which providers read for abuse
# monitoring (every step asks on that user's behalf; a worker whose mapping drops it says so, IGNORED)
STEP_PARAMS = (*SAMPLING, "user")
# The client's output format: sent to the steps whose answer may be returned, not to a judge's (base.JUDGING_ROLES)
ANSWER_FORMAT = ("response_format", "logprobs", "top_logprobs", "logit_bias")
STREAM_CHUNK_CHARS = 48
STREAM_CHUNK_TOKENS = 8  # with logprobs: the tokens (and their logprobs) of one streamed chunk
CLIENT_GONE = "the client disconnected"
# The status a step's call cut short is booked with, whichever cut it (its outcome says which: the
# step's timeout, `step_timeout`, or the request's deadline, `deadline`): a gateway timeout, as fast
# mode books a call its deadline cut (gateway/completions.py STREAM_STATUS["deadline"]).
CUT_STATUS = 504


@dataclass
class Composition:
    workflow: str | None = None  # None: fast mode
    pool: tuple[Worker, ...] = ()
    reason: str = ""
    note: str = ""  # why composition was degraded or chosen, for the header
    cost_weight: float = 0.5
    # the plan: the router's planner, per pool worker its prior log-odds and predicted USD, and μ
    planner: Any = None
    log_odds: tuple[float, ...] = ()
    costs: tuple[float, ...] = ()
    latency_weight: float = 0.0
    question_rule: str = "whole"  # the part of the question the plan reads (the router's text rule)
    requested: str | None = None  # the workflow asked for (or chosen) when it was degraded to fast mode
    auto: bool = False  # chosen by `auto` (the router), not asked for by the client's compose:<workflow>
    # a workflow that ran and produced no answer before fast mode answered: its steps (trace form)
    steps: tuple[dict[str, Any], ...] = ()
    # workers fast mode must not call in place of a compose:<workflow>: predicted over the client's ceiling
    skip: frozenset[str] = frozenset()
    # the workflow's worker calls given up (gateway/upstream.py Attempt), when it ran before fast mode
    attempts: tuple[Attempt, ...] = ()

    @property
    def degraded(self) -> bool:
        return self.workflow is None and self.note.startswith("degraded")


def _by_strength(
    pool: tuple[Worker, ...], estimates: list[Estimate] | None, chat: ChatCompletionRequest
) -> tuple[Worker, ...]:
    """Strongest first: by predicted quality when the router predicts it, else (and between equal
    predictions) by the request's predicted cost, a proxy. The cascade answers from the other end."""
    quality = {e.worker: e.quality for e in estimates or ()}
    prompt_chars, output = chat.prompt_chars(), chat.output_budget()

    def key(w: Worker):
        cost = predicted_cost(w, prompt_chars, output)
        return (-quality.get(w.name, 0.0), -cost, -w.output_price_per_m, -w.input_price_per_m, w.name)

    return tuple(sorted(pool, key=key))


async def _estimates(router, route: RouteRequest, pool: tuple[Worker, ...]) -> list[Estimate] | None:
    """The learned router's per-worker predictions (it embeds the query: off the event loop)."""
    if router.name != "learned":
        return None
    return await asyncio.to_thread(router.estimates, route, list(pool))


def _latency_weight(settings, chat: ChatCompletionRequest) -> float:
    """μ of a plan: metadata.latency_weight (0..10), else the gateway's default."""
    raw = (chat.metadata or {}).get("latency_weight")
    if raw is None:
        return settings.plan_latency_weight
    try:
        value = float(str(raw))
    except ValueError:
        value = math.nan
    if isinstance(raw, bool) or not math.isfinite(value) or not 0 <= value <= MAX_LATENCY_WEIGHT:
        raise APIError(
            400,
            f"metadata.latency_weight must be a number from 0 to {MAX_LATENCY_WEIGHT:g}",
            param="metadata.latency_weight",
            code="invalid_value",
        )
    return value


async def _planned(
    router,
    route: RouteRequest,
    chat: ChatCompletionRequest,
    pool: tuple[Worker, ...],
    settings,
    weight: CostWeight,
    reason: str,
    note: str,
) -> Composition:
    """The plan over `pool` (the router's order): priors and predicted costs from the same estimates
    fast mode ranks by, computed off the event loop; ``weight``: the λ in force and its source."""
    latency_weight = _latency_weight(settings, chat)
    estimates = await _estimates(router, route, pool)
    by_name = {e.worker: e for e in estimates}
    ordered = [by_name[w.name] for w in pool]
    return Composition(
        "plan",
        pool,
        f"{reason} over {len(pool)} workers (cost weight {weight.value:g} from "
        f"{COST_WEIGHT_SOURCES[weight.source]}, latency weight {latency_weight:g}){_priors_used(ordered)}",
        note,
        weight.value,
        router.planner,
        tuple(logit(e.quality) for e in ordered),
        tuple(float(e.cost_usd) for e in ordered),
        latency_weight,
        question_rule=getattr(router, "text_rule", "whole"),
    )


def _priors_used(estimates: list[Estimate] | None) -> str:
    """For a workflow's route reason: the workers the model has no data for, whose predictions are
    priors (their tier's, a profile's), as fast mode's reason says of the worker it chose."""
    unknown = [e.worker for e in estimates or () if not e.known]
    return f"; no data for {', '.join(unknown)} yet, prior used" if unknown else ""


def _first_step_costs(
    chat: ChatCompletionRequest, recalled, workers: tuple[Worker, ...]
) -> tuple[dict[str, Decimal], str]:
    """Each worker's predicted cost for the request's first call (the messages it would carry,
    recalled memory included, at the client's max_tokens), and " at max_tokens N" for a message."""
    messages = memory.workflow_messages(recalled, chat.messages_payload())
    prompt_chars, output = chars(messages), chat.output_budget()
    at = f" at max_tokens {output}" if output else ""
    return {w.name: predicted_cost(w, prompt_chars, output) for w in workers}, at


def _in_fast_mode(
    state,
    chat: ChatCompletionRequest,
    admission,
    recalled,
    workers: tuple[Worker, ...],
    why: str,
    workflow: str,
) -> Composition:
    """A client's compose:<workflow> answered in fast mode because the workflow cannot run (tools, one
    admissible worker), saying ``why``. A ceiling the client set itself (metadata.max_cost_usd below
    the gateway's) stays its bound, as the workflow would have kept it: fast mode does not call the
    workers predicted over it, and when every worker is, nobody is called (502 workflow_failed, as
    when no worker fits a workflow's first step)."""
    note = f"degraded: {why}"
    if not _client_bound(state, chat, admission):
        return Composition(note=note, requested=workflow)
    ceiling = _asked_ceiling(chat)
    costs, at = _first_step_costs(chat, recalled, workers)
    over = frozenset(name for name, cost in costs.items() if cost > ceiling)
    if len(over) == len(workers):
        cheapest = min(costs, key=lambda name: costs[name])
        raise APIError(
            502,
            f"the {workflow} workflow cannot run ({why.split(';')[0]}) and fast mode would pass your cost "
            f"ceiling ${ceiling} (metadata.max_cost_usd): the cheapest admissible worker, {cheapest}, is "
            f"predicted ${costs[cheapest]:.6f}{at}; nobody was called",
            type="server_error",
            code="workflow_failed",
        )
    if over:
        note += f"; not called, predicted over your cost ceiling ${ceiling}: {', '.join(sorted(over))}"
    return Composition(note=note, requested=workflow, skip=over)


def _cannot_start(
    state, chat: ChatCompletionRequest, admission, recalled, pool: tuple[Worker, ...], workflow: str
) -> Composition | None:
    """Under auto (the router's choice, not the client's): fast mode, degraded and saying why, when
    the workflow could not start because no pool worker's step fits its ceiling — steps are priced at
    the client's max_tokens, and Anthropic clients send tens of thousands. Fast mode answers such a
    request, and auto must not fail where fast mode answers. A ceiling the client set itself
    (metadata.max_cost_usd below the gateway's) is the client's bound: kept, and the workflow calls
    nobody and says so rather than spend past it. None: the workflow can start (or the client's bound
    decides)."""
    ceiling = _gateway_ceiling(state, admission)
    if _client_bound(state, chat, admission):
        return None
    costs, at = _first_step_costs(chat, recalled, pool)
    cheapest = min(costs, key=lambda name: costs[name])
    if costs[cheapest] <= ceiling:
        return None
    return Composition(
        note=f"degraded: no worker fits the {workflow} workflow's cost ceiling ${ceiling:f} (the cheapest, "
        f"{cheapest}, is predicted ${costs[cheapest]:.6f}{at}); fast mode",
        requested=workflow,
    )


def checked_workflow(model: str, error_type: str = "invalid_request_error") -> str | None:
    """:func:`requested_workflow`, an unknown workflow refused as a 404 ``model_not_found`` (the one
    check /v1/chat/completions, /v1/messages and its count_tokens make); ``error_type`` is the
    API's own name for the error."""
    try:
        return requested_workflow(model)
    except ValueError as exc:
        raise APIError(404, str(exc), type=error_type, code="model_not_found", param="model") from None


async def plan(
    state,
    request: Request,
    chat: ChatCompletionRequest,
    route: RouteRequest,
    decision,
    router,
    admission=None,
    recalled=None,
) -> Composition:
    """Fast mode, a workflow, or a workflow degraded to fast mode (and why). ``admission`` (the
    policy's ceiling) and ``recalled`` (memory the steps would carry) price a workflow `auto` would
    choose, so that it is chosen only when it can start."""
    forced = checked_workflow(chat.model)
    settings = state.settings
    resolved = cost_weight_of(route, settings.cost_weight, router)  # the λ fast mode ranked by
    weight = resolved.value
    planner = getattr(router, "planner", None) if router.name == "learned" else None
    if forced is None:
        if chat.model != "auto" or router.name != "learned" or chat.tools:
            return Composition()
        if planner is not None and settings.compose_plan:
            # exploration sends this one to an under-observed worker; a quality target (min_quality)
            # asks for the cheapest worker predicted to reach it, which the plan does not weigh
            if decision.strategy != "fast" or route.min_quality is not None:
                return Composition()
            if len(decision.workers) < 2:
                return Composition(
                    note=f"degraded: only one admissible worker ({decision.workers[0].name}); fast mode",
                    requested="plan",
                )
            if degraded := _cannot_start(state, chat, admission, recalled, decision.workers, "plan"):
                return degraded
            planned = await _planned(
                router, route, chat, decision.workers, settings, resolved, "answer-aware plan", "chosen"
            )
            return replace(planned, auto=True)
        if not settings.compose_auto or decision.strategy != "fast" or len(decision.workers) < 2:
            return Composition()
        estimates = await _estimates(router, route, decision.workers)
        prediction = predict_cascade(estimates, weight, settings.compose_verifier_accuracy)
        if not should_cascade(prediction):
            return Composition()
        if degraded := _cannot_start(state, chat, admission, recalled, decision.workers, "cascade"):
            return degraded
        levels = {prediction.cheap, prediction.strong}
        return Composition(
            "cascade",
            _by_strength(decision.workers, estimates, chat),
            prediction.reason + _priors_used([e for e in estimates if e.worker in levels]),
            "chosen",
            weight,
            auto=True,
        )
    if forced == "plan" and planner is None:
        raise APIError(
            400,
            f"{PREFIX}plan needs a trained planner and the router in force has none "
            f"({'version ' + router.version if router.name == 'learned' else 'rule-based router'}): "
            f"train one with `{TRAIN_PLANNER}`",
            code="invalid_value",
            param="model",
        )
    if chat.tools:
        why = f"{forced} does not take tools; answered in fast mode"
        return _in_fast_mode(state, chat, admission, recalled, decision.workers, why, forced)
    if len(decision.workers) < 2:
        why = f"only one admissible worker ({decision.workers[0].name}); fast mode"
        return _in_fast_mode(state, chat, admission, recalled, decision.workers, why, forced)
    pool = decision.workers
    if forced == "plan":
        return await _planned(
            router, route, chat, pool, settings, resolved, f"{PREFIX}plan requested", "requested"
        )
    if forced == "cascade":
        pool = _by_strength(pool, await _estimates(router, route, pool), chat)
    return Composition(forced, pool, f"{PREFIX}{forced} requested", "requested", weight)


def degraded_trace(
    composition: Composition,
    worker: str | None,
    prompt_tokens: int,
    completion_tokens: int,
    cost_usd: Decimal,
    failures=(),
) -> dict[str, Any]:
    """The trace of a workflow answered in fast mode: shaped like a workflow's (`steps` included),
    saying that it degraded and why, with the steps of the workflow when it ran and produced no
    answer, then the workers fast mode tried (failed, then the one that answered; ``worker`` None:
    none did). Its cost is the workflow's steps' and the answer's."""
    ran = sum((Decimal(step.get("cost_usd") or 0) for step in composition.steps), Decimal(0))
    tried = [
        {"role": "answer", "worker": f.worker, "cost_usd": "0", "error": error_text(f, f.message)}
        for f in failures
    ]
    answered = [
        {
            "role": "answer",
            "worker": worker,
            "cost_usd": f"{cost_usd:f}",
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "verdict": "fast mode (degraded)",
        }
    ]
    trace = {
        "workflow": composition.requested,
        "mode": "fast",
        "degraded": True,
        "note": composition.note,
        "final_worker": worker,
        "cost_usd": f"{ran + cost_usd:f}",
        "steps": [*composition.steps, *tried, *(answered if worker is not None else ())],
    }
    return with_attempts(trace, composition.attempts) or trace


def _ceiling(state, chat: ChatCompletionRequest, admission) -> Decimal:
    """What the whole workflow may spend: the gateway's setting, lowered by the client's
    metadata.max_cost_usd and by the policy's max_request_cost_usd (a rule caps a request, and a
    workflow is one request however many workers it asks)."""
    ceiling = _gateway_ceiling(state, admission)
    asked = _asked_ceiling(chat)
    return ceiling if asked is None else min(asked, ceiling)


def _client_bound(state, chat: ChatCompletionRequest, admission) -> bool:
    """Whether the client set the workflow's ceiling itself (metadata.max_cost_usd below the
    gateway's): its bound, which `auto` keeps rather than answer in fast mode past it."""
    asked = _asked_ceiling(chat)
    return asked is not None and asked < _gateway_ceiling(state, admission)


def _gateway_ceiling(state, admission) -> Decimal:
    """The ceiling the client did not choose: the gateway's setting, lowered by the policy's."""
    ceiling = Decimal(repr(state.settings.compose_max_cost_usd))
    if admission is not None and admission.max_request_cost_usd is not None:
        ceiling = min(ceiling, admission.max_request_cost_usd)
    return ceiling


def _asked_ceiling(chat: ChatCompletionRequest) -> Decimal | None:
    """The client's metadata.max_cost_usd (None: not set); a 400 when it is no positive amount."""
    raw = (chat.metadata or {}).get("max_cost_usd")
    if raw is None:
        return None
    try:
        asked = Decimal(str(raw))
    except InvalidOperation:
        asked = Decimal(-1)
    if not asked.is_finite() or asked <= 0:
        raise APIError(
            400,
            "metadata.max_cost_usd must be a positive number of USD",
            param="metadata.max_cost_usd",
            code="invalid_value",
        )
    return asked


@functools.lru_cache(maxsize=512)
def known_output_limit(model: str) -> int | None:
    """The most output tokens litellm's model map gives ``model`` (the packaged map: no network),
    None when it does not list it. A workflow step the client set no max_tokens for is bounded by it
    when the catalog gives the worker no max_output_tokens (router/compose/base.py)."""
    import litellm

    try:
        value = litellm.get_model_info(model).get("max_output_tokens")
    except Exception:  # not in the map (a local or custom model): the limit is unknown
        return None
    return value if isinstance(value, int) and value > 0 else None


@functools.lru_cache(maxsize=4)
def _acceptance_model(path: str, mtime_ns: int):
    """Loaded once per file version (a retrained model has a new mtime), not once per request."""
    import joblib

    return joblib.load(path)


def _verifier(
    state, pool: tuple[Worker, ...], chat: ChatCompletionRequest, router_version: str | None = None
):
    """The cascade's verifier; `model` is the acceptance model of ``router_version`` (the request's
    router: default the one in force), kept in its version directory (router/artifacts.py)."""
    kind = (chat.metadata or {}).get("verifier") or state.settings.compose_verifier
    found = state.router.acceptance(router_version) if kind in ("auto", "model") else None
    if found is not None:
        try:
            mtime_ns = found.path.stat().st_mtime_ns
        except FileNotFoundError:  # removed since it was found (a version deleted): as if never there
            found = None
        else:
            return ModelVerifier(_acceptance_model(str(found.path), mtime_ns))
    if kind == "model":
        version = router_version or state.router.current.version
        raise APIError(
            400,
            f"no acceptance model for router version {version} under {state.router.root}: run "
            "`polyroute router eval --strategy cascade --save-acceptance`",
            param="metadata.verifier",
            code="invalid_value",
        )
    if kind == "consistency":
        return ConsistencyVerifier(samples=3)
    if kind in ("auto", "judge"):
        return JudgeVerifier(pool[0])
    raise APIError(
        400,
        "metadata.verifier must be auto, model, consistency or judge",
        param="metadata.verifier",
        code="invalid_value",
    )


def _code_keys(settings):
    """Behaviour keys for code answers (router/code_behaviour.py), when the gateway may run code."""
    if not settings.plan_code_exec:
        return None
    from router.code_behaviour import behaviour_keys_async

    return behaviour_keys_async


def _text_keys(settings):
    """Meaning keys for free-text answers (router/text_agreement.py), embedded off the event loop
    with the retrieval embedder (one model per process); built per request, so each of the request's
    answers is embedded once however many rounds read it."""
    if not settings.plan_text_agreement:
        return None
    from retrieval.embed import shared_embedder
    from router.text_agreement import embed_and_key, remembering

    embed = remembering(shared_embedder(settings.retrieval_embedder).encode)

    async def keys(texts):
        return await asyncio.to_thread(embed_and_key, texts, embed, settings.plan_text_similarity)

    return keys


def workflow_for(
    state, composition: Composition, chat: ChatCompletionRequest, router_version: str | None = None
):
    """The workflow to run; ``router_version``: the request's router, whose acceptance model a
    cascade's `model` verifier uses (default: the router in force)."""
    settings, metadata = state.settings, chat.metadata or {}
    if composition.workflow == "plan":
        return Planned(
            composition.planner,
            composition.log_odds,
            composition.costs,
            composition.latency_weight,
            code_keys=_code_keys(settings),
            text_keys=_text_keys(settings),
            question_rule=composition.question_rule,
        )
    if composition.workflow == "cascade":
        verifier = _verifier(state, composition.pool, chat, router_version)
        return Cascade(verifier, depth=settings.compose_depth)
    if composition.workflow == "ensemble":
        return Ensemble(members=settings.compose_members, concurrency=settings.compose_members)
    if composition.workflow == "builder":
        tests = metadata.get("tests")
        if tests is not None and not isinstance(tests, str):
            raise APIError(
                400,
                "metadata.tests must be Python source (a string)",
                param="metadata.tests",
                code="invalid_value",
            )
        return BuilderVerifier(rounds=settings.compose_rounds, tests=tests)
    return Debate(debaters=min(3, max(2, settings.compose_members - 1)), rounds=1)


def _excluded_note(run: Run) -> str:
    """What the header and the trace say of the workers a policy reload left out of the run."""
    if not run.excluded:
        return ""
    return "; left out by a policy reload during the workflow: " + ", ".join(sorted(run.excluded))


def _asker(state, given_up: list[Attempt], unsupported: list[WorkerError], ignored: set[str]):
    """One workflow step's call. Its bounds (the step timeout, the request's deadline) are Run's.
    The calls of its worker given up on the way (retried, or the step's failure) go to ``given_up``,
    for the request's trace and header (gateway/upstream.py Attempt); those a cut loses go there
    through the step's scope (`_step_scope`). A step whose worker's provider has none of a parameter
    (WorkerError.unsupported: the worker was not called) fails as any failed member, and goes to
    ``unsupported`` too: a workflow no step of which could answer for that alone says so (`_no_answer`).
    The parameters an answering step's worker went without, though litellm raised no error (its
    request built without them is the same: wire.ignored_params), go to ``ignored``, so the answer
    names them (IGNORED_HEADER, and the trace's `ignored_params`) as fast mode's does."""

    async def ask(worker: Worker, messages: list[dict[str, Any]], params: dict[str, Any]) -> Answer:
        step = ChatCompletionRequest.model_validate({"model": worker.name, "messages": messages, **params})
        try:
            result = await state.client.complete(worker, state.api_base(worker), step)
        except WorkerError as err:
            given_up.extend(err.attempts)
            if err.unsupported:
                unsupported.append(err)
            raise
        given_up.extend(result.attempts)
        ignored.update(state.client.ignored_params(worker, state.api_base(worker), step))
        choices = result.body.get("choices") or [{}]
        text = (choices[0].get("message") or {}).get("content") or ""
        return Answer(
            worker.name, text, result.prompt_tokens, result.completion_tokens, result.cost_usd, result.body
        )

    return ask


def _step_scope(given_up: list[Attempt]):
    """The scope each workflow step's call runs in (router.compose.base.StepScope): its worker calls
    under a CallScope of the step's own (gateway/upstream.py), so that

    - a retry of the step's worker asks the run's policy re-check first (``readmit``: `Run.readmit`),
      and a worker a reload excluded between two of its calls is not called again (the run leaves it
      out, as at a step's start);
    - the calls a cancellation cut short (the one in flight, and that worker's calls retried before
      it), which carry no WorkerError, go to ``given_up`` after the calls given up before: labelled
      with what cut them when the step's timeout or the request's deadline did (`Run.call` says
      which), as `cancelled` (503) when the request itself was cancelled (the gateway shutting down).

    Steps that run together each open their own, in their own task: one step's cut calls are never
    booked to another."""

    @contextmanager
    def scope(worker: Worker, readmit: Admissible) -> Iterator[CutBy]:
        calls = CallScope(readmit=readmit)

        def cut_by(what: str) -> None:
            given_up.extend(calls.cut_by(what, CUT_STATUS))

        with calling(calls):
            try:
                yield cut_by
            except asyncio.CancelledError:
                given_up.extend(calls.cut)
                raise

    return scope


async def respond(state, request: Request, ex, composition: Composition) -> Response | None:
    """Run the workflow inside the reserved ceiling and answer (JSON or SSE) with its trace.

    None: the workflow `auto` chose produced no answer, and fast mode is to answer over the admissible
    workers it did not try (gateway/completions.py): ``ex`` is ready for it — the steps' cost settled
    on the budget and kept for the ledger record (`Exchange.settled`), the workers tried skipped, the
    degraded note and the workflow's steps in ``ex.degraded``."""
    from gateway.completions import BudgetRefusal, refused

    chat = ex.chat
    try:
        ceiling = _ceiling(state, chat, ex.admission)
        workflow = workflow_for(state, composition, chat, ex.router_version)
    except APIError as err:  # refused before any step: counted, logged and traced as every refusal
        await ratelimits.give_back(state.stores.limiter, ex.tenant, ex.limits)  # it used no tokens
        return refused(state, err, ex.headers, ex.wire, started=ex.started, stream=ex.chat.stream)
    strategy = f"{PREFIX}{composition.workflow}"
    headers = {**ex.headers, "x-polyroute-strategy": strategy, "x-polyroute-route-reason": composition.reason}
    try:
        ceiling = await _hold(state, ex, composition.pool, ceiling)
    except BudgetRefusal as refusal:
        err = APIError(
            refusal.status,
            f"the workflow's ceiling ${ceiling:f} does not fit the budget: {refusal.message}",
            type="insufficient_quota",
            code=refusal.code,
        )
        err.headers = headers
        await ex.finish(state, None, err.status, [refusal], strategy=strategy)
        _count_failure(state, ex, strategy, err.code or err.type, str(err.status))
        return error_response(err)
    params = {k: v for k in STEP_PARAMS if (v := getattr(chat, k)) is not None}
    deadline = asyncio.get_running_loop().time() + ex.remaining(state)
    given_up: list[Attempt] = []  # the steps' worker calls given up (retried, failed, or cut short)
    unsupported: list[WorkerError] = []  # the steps refused for a parameter their worker lacks
    ignored: set[str] = set()  # the parameters an answering step's worker went without
    run = Run(
        messages=memory.workflow_messages(ex.memory, chat.messages_payload()),
        pool=composition.pool,
        ask=_asker(state, given_up, unsupported, ignored),
        deadline=deadline,
        output_limits={w.name: n for w in composition.pool if (n := known_output_limit(w.model)) is not None},
        ceiling_usd=ceiling,
        cost_weight=composition.cost_weight,
        max_tokens=chat.output_budget(),
        params=params,
        answer_params={k: v for k in ANSWER_FORMAT if (v := getattr(chat, k)) is not None},
        step_timeout_s=state.settings.compose_step_timeout_s,
        seed=zlib.crc32(ex.request_id.encode()),
        admissible=ex.admissible,  # the request's one check (gateway/readmit.py), fast mode's too
        step_scope=_step_scope(given_up),  # before each retry too; the calls a cut loses, booked
    )
    books = state.pending_books()  # from here until the books are written, the shutdown waits for them
    try:
        # nothing is sent before the workflow ends, so a client that hangs up is noticed here or never
        watcher = asyncio.create_task(_stop_when_gone(request, run))
        try:
            with tracing.step("compose", **{"polyroute.workflow": composition.workflow}):
                outcome = await workflow.run(run)
        except BaseException as exc:
            watcher.cancel()
            # what the answered steps cost is owed however the run ended: booked in a task of its
            # own, which a second cancellation (the shutdown's) does not stop
            await books.write(_ended_by(state, ex, composition, run, strategy, exc, given_up))
            raise
        watcher.cancel()
        await asyncio.wait([watcher])  # its read of the connection ends before the response's begins
        return await _answer(
            state, request, ex, composition, run, outcome, strategy, headers, given_up, unsupported, ignored
        )
    finally:
        books.done()


async def _answer(
    state,
    request: Request,
    ex,
    composition: Composition,
    run: Run,
    outcome,
    strategy: str,
    headers: dict,
    given_up: list[Attempt],
    unsupported: Sequence[WorkerError],
    ignored: set[str],
) -> Response | None:
    """The workflow's outcome as the response, once it ended (see :func:`respond`); ``given_up``:
    the steps' worker calls given up, in the trace (`attempts`) and the x-polyroute-attempts header;
    ``unsupported``: the steps refused for a parameter their worker lacks (`_no_answer`); ``ignored``:
    the parameters answering steps' workers went without, named once in IGNORED_HEADER (in chat
    completions' names: another API's wire renames them) and the trace's `ignored_params`."""
    from gateway.completions import IGNORED_HEADER, LEFT_OUT_HEADER, format_cost

    chat = ex.chat
    if outcome.answer is None and composition.auto and run.stopped is None:
        # fast mode may answer over the workers the workflow did not try: none a policy reload left out
        for worker in ex.decision.workers:
            await run.admits(worker)
    if run.excluded:  # said in the note (header, trace, error) and, with each reason, in the trace
        outcome.note = (outcome.note or composition.note) + _excluded_note(run)
        outcome.detail["excluded_by_policy"] = dict(run.excluded)
    trace = with_attempts(outcome.trace(), given_up)
    prompt_tokens = sum(s.prompt_tokens for s in outcome.steps)
    completion_tokens = sum(s.completion_tokens for s in outcome.steps)
    final = outcome.answer
    headers |= {
        "x-polyroute-cost-usd": format_cost(outcome.cost_usd),
        COMPOSE_HEADER: outcome.note or composition.note,
        **attempts_header(given_up),
    }
    if run.excluded:  # as fast mode names the workers a reload left out (the reasons: in the trace)
        headers[LEFT_OUT_HEADER] = ",".join(sorted(run.excluded))
    if ignored:
        headers[IGNORED_HEADER] = ",".join(sorted(ignored))
        trace = {**(trace or {}), "ignored_params": sorted(ignored)}
    if composition.workflow == "plan":
        headers[PLAN_HEADER] = plan_header(outcome.detail)
    if run.stopped is not None:
        return await _client_gone(
            state, ex, outcome, strategy, headers, trace, prompt_tokens, completion_tokens
        )
    if final is None:
        if await _to_fast_mode(
            state, ex, composition, run, outcome, prompt_tokens, completion_tokens, given_up
        ):
            return None
        err = _no_answer(composition, outcome, unsupported)
        await ex.finish(
            state, None, err.status, [], prompt_tokens, completion_tokens, outcome.cost_usd, strategy, trace
        )
        _count_failure(state, ex, strategy, err.code or err.type, str(err.status))
        err.headers = headers
        if request.headers.get(TRACE_HEADER) == "1":
            err.message += f" (trace: {orjson.dumps(trace).decode()})"
        return error_response(err)
    headers["x-polyroute-worker"] = final.worker
    memory.remember(state, ex.memory, final.text)
    if ex.memory is not None:
        headers["x-polyroute-memory"] = ex.memory.header()
    await ex.finish(
        state, final.worker, 200, [], prompt_tokens, completion_tokens, outcome.cost_usd, strategy, trace
    )
    state.metrics.requests.labels(final.worker, strategy, "200").inc()
    state.metrics.observe_latency(ex.started, chat.stream)
    extra = {"workflow": composition.workflow, "cost_usd": format_cost(outcome.cost_usd)}
    if request.headers.get(TRACE_HEADER) == "1":
        extra["trace"] = trace
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if chat.stream:
        include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
        body = _sse(final, usage if include_usage else None, extra, ex.request_id)
        return StreamingResponse(
            body, media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"}
        )
    return Response(
        orjson.dumps(_completion(final, usage, extra, ex.request_id)),
        media_type="application/json",
        headers=headers,
    )


def _no_answer(composition: Composition, outcome, unsupported: Sequence[WorkerError]) -> APIError:
    """Why a workflow the client named produced no answer. When every step that was made was refused
    for a parameter its worker's provider has none of (no worker was called), the client can fix it
    as a pinned worker's can (gateway/completions.py `final_error`): a 400 `unsupported_parameter`
    naming it; otherwise the 502 `workflow_failed` with the workflow's note."""
    made = [s for s in outcome.steps if not (s.verdict or "").startswith("skipped")]
    if unsupported and len(made) == len(unsupported) and all(s.error for s in made):
        names = list(dict.fromkeys(name for err in unsupported for name in err.unsupported))
        workers = ", ".join(dict.fromkeys(err.worker for err in unsupported))
        return APIError(
            400,
            f"the {composition.workflow} workflow produced no answer: {workers} cannot take "
            f"{', '.join(names)}: leave {'it' if len(names) == 1 else 'them'} out, or ask another "
            f"workflow or worker ({outcome.note})",
            code="unsupported_parameter",
            param=names[0],
        )
    return APIError(
        502,
        f"the {composition.workflow} workflow produced no answer: {outcome.note}",
        type="server_error",
        code="workflow_failed",
    )


def _count_failure(state, ex, strategy: str, error: str, status: str) -> None:
    """A composed request that ended without an answer, in the request, error and latency metrics,
    as fast mode counts its failures."""
    state.metrics.errors.labels(error).inc()
    state.metrics.requests.labels("-", strategy, status).inc()
    state.metrics.observe_latency(ex.started, ex.chat.stream)


async def _to_fast_mode(
    state,
    ex,
    composition: Composition,
    run: Run,
    outcome,
    prompt_tokens: int,
    completion_tokens: int,
    given_up: list[Attempt],
) -> bool:
    """Whether fast mode answers instead of the 502 of a workflow without an answer: yes when `auto`
    chose the workflow (a client's compose:<workflow> asked for that workflow, and gets its outcome),
    time is left, the client set no ceiling of its own (metadata.max_cost_usd below the gateway's is
    kept, as when the workflow cannot start) and the workflow left an admissible worker untried.
    Fast mode then tries those in the router's order: auto does not fail where fast mode answers.
    The steps' cost is settled on the budget now and added to the request's ledger record."""
    if not composition.auto or run.expired() or _client_bound(state, ex.chat, ex.admission):
        return False
    tried = frozenset(step.worker for step in outcome.steps if not (step.verdict or "").startswith("skipped"))
    tried |= frozenset(run.excluded)
    if all(worker.name in tried for worker in ex.decision.workers):
        return False
    ex.spent(prompt_tokens, completion_tokens, outcome.cost_usd)
    await ex.release(state)  # the hold of the ceiling goes; what the steps cost stays on the budget
    note = f"degraded: the {composition.workflow} workflow produced no answer ({outcome.note}); fast mode"
    ex.degraded = Composition(
        note=note,
        requested=composition.workflow,
        steps=tuple(s.public() for s in outcome.steps),
        attempts=tuple(given_up),
    )
    ex.skip = tried
    ex.excluded.update(run.excluded)  # fast mode's header and trace name who a reload left out, and why
    # the router chose the workflow, not fast mode's first worker: no route record for offline
    # evaluation (it replays single-worker choices; a composed request is none)
    ex.route = None
    ex.headers[COMPOSE_HEADER] = note
    log.info("request %s: %s", ex.request_id, note)
    return True


async def _ended_by(
    state,
    ex,
    composition: Composition,
    run: Run,
    strategy: str,
    exc: BaseException,
    given_up: list[Attempt],
) -> None:
    """The workflow ended by an exception: a fault (500), the request cancelled — the gateway shutting
    down — (503), or, the client gone, 499. The steps that answered were paid: their cost settles the
    budget's hold and the ledger records it with the trace (and the worker calls given up), as for a
    workflow that ended."""
    if run.stopped is not None:
        name, status, label = "client_disconnected", 499, "client_disconnected"
    elif isinstance(exc, asyncio.CancelledError):
        name, status, label = "cancelled", 503, "503"
    else:
        name, status, label = "workflow_error", 500, "500"
    why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    outcome = Outcome(None, composition.workflow or "", list(run.steps), error_text(exc, f"ended by {why}"))
    trace = with_attempts({**outcome.trace(), "ended": name}, given_up)
    await ex.finish(
        state,
        None,
        status,
        [],
        sum(s.prompt_tokens for s in outcome.steps),
        sum(s.completion_tokens for s in outcome.steps),
        outcome.cost_usd,
        strategy,
        trace,
    )
    _count_failure(state, ex, strategy, name, label)
    log.warning(
        "request %s: %s ended by %s; its steps' $%s is billed", ex.request_id, strategy, why, outcome.cost_usd
    )


async def hung_up(request: Request) -> bool:
    """Wait for the client to hang up: True then, False if its connection cannot be watched (the
    request then runs to its end, as before). The body has been read, so the server's next message
    is http.disconnect, sent when the connection closes. Watched while a workflow runs (below) and
    while fast mode calls workers (gateway/completions.py), where nothing is sent yet."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:
        log.debug("cannot watch the client's connection", exc_info=True)
        return False
    return True


async def _stop_when_gone(request: Request, run: Run) -> None:
    """Stop ``run`` (no further step starts) when the client hangs up."""
    if await hung_up(request):
        run.stop(CLIENT_GONE)


async def _client_gone(
    state,
    ex,
    outcome,
    strategy: str,
    headers: dict[str, str],
    trace: dict,
    prompt_tokens: int,
    completion_tokens: int,
) -> Response:
    """The client hung up during the workflow: no step started after that (those in flight finished),
    nobody gets the answer, and the ledger says 499 — as for a stream the client leaves — with
    every step's cost billed and the budget's hold settled to it. ``trace`` and the token counts are
    the ones :func:`respond` read off the outcome."""
    from gateway.completions import STREAM_STATUS

    outcome_name = "client_disconnected"
    trace = {**trace, "ended": outcome_name}
    if ex.chat.stream:
        trace["stream"] = outcome_name  # as a fast-mode stream's record says it (and its span reads)
    worker = outcome.answer.worker if outcome.answer is not None else None
    status = STREAM_STATUS[outcome_name]
    await ex.finish(
        state, worker, status, [], prompt_tokens, completion_tokens, outcome.cost_usd, strategy, trace
    )
    state.metrics.errors.labels(outcome_name).inc()
    state.metrics.requests.labels(worker or "-", strategy, str(status)).inc()
    state.metrics.observe_latency(ex.started, ex.chat.stream)
    log.info("request %s: the client hung up during %s; %s", ex.request_id, strategy, outcome.note)
    err = APIError(status, f"the client closed the request: {outcome.note}", code=outcome_name)
    err.headers = headers
    return error_response(err)  # nobody reads it: the connection is gone


def _completion(final: Answer, usage: dict, extra: dict, request_id: str) -> dict[str, Any]:
    base = final.body or {}
    return {
        "id": base.get("id") or "chatcmpl-" + request_id,
        "object": "chat.completion",
        "created": base.get("created") or int(time.time()),
        "model": final.worker,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": final.text},
                "logprobs": _choice(final).get("logprobs"),
                "finish_reason": _finish_reason(final),
            }
        ],
        "usage": usage,
        "polyroute": extra,
    }


async def _hold(state, ex, pool: tuple[Worker, ...], ceiling: Decimal) -> Decimal:
    """Reserve the workflow's ceiling on the tenant's budget, and return the ceiling the run keeps.

    When less than the ceiling is left of the budget, the ceiling shrinks to what is left, as long as
    the cheapest worker's step still fits: a tenant with $0.05 left is still answered instead of
    refused because the default ceiling is $0.10. Each step is checked against the smaller ceiling
    before it starts, so the budget is passed only where the ceiling is: when a step's prompt bills
    more tokens than predicted, which the prediction leaves possible above all for the steps started
    before any step reported usage (router/compose/base.py; outputs are bounded by max_tokens).
    Raises BudgetRefusal when not even the cheapest step fits."""
    from gateway.completions import BudgetRefusal
    from gateway.store import to_micros
    from gateway.store.budgets import MICRO

    try:
        await ex.hold(state, pool[0], micros=to_micros(ceiling))
        return ceiling
    except BudgetRefusal as refusal:
        left = refusal.left_micros
        chat = ex.chat
        cheapest = min(predicted_cost(w, chat.prompt_chars(), chat.output_budget()) for w in pool)
        if not left or to_micros(cheapest) > left:
            raise
    await ex.hold(state, pool[0], micros=left)
    return Decimal(left) / MICRO


def _finish_reason(final: Answer) -> str:
    """Why the chosen answer ended, as its worker said ("length": cut at max_tokens), in JSON and SSE alike."""
    return _choice(final).get("finish_reason") or "stop"


def _choice(final: Answer) -> dict[str, Any]:
    return ((final.body or {}).get("choices") or [{}])[0]


def _pieces(text: str, logprobs: Any) -> list[tuple[str, dict | None]]:
    """The answer's text in stream chunks, each with its share of the answer's logprobs (the client
    asked for them): as OpenAI streams them, a chunk's `logprobs.content` holds its own tokens. When
    the tokens do not spell the text (a provider's other shape), the first chunk carries them all."""
    entries = logprobs.get("content") if isinstance(logprobs, dict) else None
    tokens = isinstance(entries, list) and all(
        isinstance(e, dict) and isinstance(e.get("token"), str) for e in entries
    )
    if entries and tokens and "".join(e["token"] for e in entries) == text:
        groups = [entries[i : i + STREAM_CHUNK_TOKENS] for i in range(0, len(entries), STREAM_CHUNK_TOKENS)]
        return [("".join(e["token"] for e in group), {"content": group}) for group in groups]
    pieces = [text[i : i + STREAM_CHUNK_CHARS] for i in range(0, len(text), STREAM_CHUNK_CHARS)]
    return [(piece, logprobs if i == 0 and logprobs else None) for i, piece in enumerate(pieces)]


async def _sse(final: Answer, usage: dict | None, extra: dict, request_id: str):
    """The final answer as OpenAI chunks; with include_usage, a usage chunk carrying the workflow's total."""
    common = {
        "id": (final.body or {}).get("id") or "chatcmpl-" + request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": final.worker,
    }

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        payload = {
            **common,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for piece, logprobs in _pieces(final.text, _choice(final).get("logprobs")):
        yield chunk({"content": piece}, logprobs=logprobs)
    yield chunk({}, _finish_reason(final))
    if usage is not None:
        yield (
            b"data: " + orjson.dumps({**common, "choices": [], "usage": usage, "polyroute": extra}) + b"\n\n"
        )
    yield b"data: [DONE]\n\n"
