"""Calibration: probes through the gateway's own worker path, graded, into the ledger, then fitted.

`polyroute router calibrate` (the command is polyroute/cli_calibrate.py) measures workers on the
shipped probe set (router/probes) and teaches the router what it measured:

1. Plan: the probes (seeded, stratified), the workers (named, or every available one), minus the
   (worker, probe) pairs the ledger already holds a calibration grade for (a rerun resumes) and
   those the policy in force excludes (named with the rule, nothing sent).
2. Call: each pair is one chat request of one user message, sent with the gateway's own objects,
   built by `gateway.state.build_state` from the same settings (POLYROUTE_*) a gateway would use:
   the policy engine in force evaluates it again as data class `public` for the calibration tenant
   (a worker it does not admit is skipped and reported, nothing is sent), `WorkerClient.complete`
   calls the worker (litellm's transforms, retries, timeouts), and the cost is the one it computes
   from the catalog's prices, as for any request.
3. Grade (router/grading.py) and write the ledger: a request record (strategy and trace say
   "calibration", with the probe id) and a feedback record with `source: "calibration"` — labelled
   examples that `router train --from-ledger` reads like any other. A 200 without choices, or with
   an empty answer cut by max_tokens, is a failed call (no grade; a rerun asks again); an empty
   answer the worker ended itself is graded (0).
4. Fit: the graded workers' vectors on top of the router in force (router/onboard.py), saved as a
   new version and activated: the hot swap a running gateway watches for. When no grade arrived
   since the version in force was fitted, nothing is saved and that version stays in force.

Why in-process rather than over HTTP to a running gateway: the worker path, policy and cost code
are the same objects either way, but in-process needs no running gateway nor a tenant key, can
record the grade against the request it belongs to, and leaves out exactly what must not touch a
probe: the response cache (it would replay an answer instead of measuring one), retrieval memory
(it would change the question), and tenant budgets and rate limits (the run has its own cap,
`--max-cost-usd`). The ledger is the gateway's (the file, or Redis with REDIS_URL), so a running
gateway and its exports see the records.

The cap: a call starts only if what the run has spent, plus what calls in flight hold, plus this
call's hold fits under the cap. A hold is the gateway's prediction of the call's cost (prompt
characters as policies.cost.token_chars counts them / 4, and max_tokens of output), scaled by what
this worker's answered calls were billed against their predictions (prompt tokens billed per token
predicted, output tokens per max_tokens; never below the prediction), or, until it has answered, by
what every answered call of the run was. Nothing measured that worker yet, so a priced worker's
calls until its first answer run one at a time in the whole run: the cap is passed by at most one
call's excess over its hold (and what calls of measured workers in flight then bill above theirs).
A lane never waits behind such a call: it takes the next pair that may start (another worker's). An
answer whose provider reports no usage is booked at its hold. A run that passes the cap says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import os
import secrets
import socket
import statistics
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from gateway.ledger import INTENT, logged_query
from policies import (
    BilledRate,
    Catalog,
    Kind,
    PolicyEngine,
    PolicyRequest,
    PolicyRequestError,
    Spend,
    Worker,
    estimate_tokens,
    predicted_cost,
)
from router.code_behaviour import kill_running
from router.probes import Probe, ProbeSet

CALIBRATION = "calibration"  # the ledger's strategy and feedback source, and the default tenant
DATA_CLASS = "public"  # probes are public data; the policy still applies to them
# What an answer of each type usually costs in output tokens (the estimate; never more than the
# probe's max_tokens, which the holds of the cap use).
EXPECTED_OUTPUT_TOKENS = {"choice": 8, "number": 250, "match": 12, "code": 200}
LOCAL_READY_MARGIN_S = 300.0  # a local worker's first start assembles its model file
MAX_FAILURES_IN_A_ROW = (
    5  # then a worker's other pairs wait for a rerun: a dead worker costs minutes, not hours
)
READ_CHARS = 200  # what the grader read, as kept in the ledger's trace
# INTENT (gateway/ledger.py) is the record of a paid call sent and not ended yet: written (and, with
# Redis, flushed) before the call is sent, closed by the call's outcome (a request record of the same
# id). A run killed outright (SIGKILL, a crash, the machine) leaves it open, and the next run books it
# (see `lost_calls`).
IN_FLIGHT = 102  # an intent's status: sent, no outcome yet ("Processing")
STOPPED = 499  # a call sent and never answered: the client (this run) went away
USAGE_MISSING = "missing: booked at the hold"  # trace.calibration.usage of an answer without usage


class CalibrationError(Exception):
    """Bad input or a state the run cannot start from; the message says what to do."""


# ---- the ledger's calibration records ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Graded:
    """The latest calibration grade of one (worker, probe) pair in the ledger."""

    score: float
    query: str | None
    completion_tokens: int
    at: float = 0.0  # when the grade was written (its feedback record's `at`)


def graded_pairs(records: Iterable[dict]) -> dict[tuple[str, str], Graded]:
    """(worker, probe id) → its latest calibration grade: a request record whose trace names the
    probe, joined to its feedback of source "calibration". A call that failed, or whose grade was
    never written, is not graded: a rerun asks again."""
    requests: dict[str, dict] = {}
    grades: dict[tuple[str, str], tuple[float, Graded]] = {}
    for record in records:
        if record.get("type") == "request":
            probe = ((record.get("trace") or {}).get(CALIBRATION) or {}).get("probe")
            if probe and record.get("worker") and record.get("status") == 200:
                requests[record["id"]] = record
        elif record.get("type") == "feedback" and record.get("source") == CALIBRATION:
            request = requests.get(record.get("request_id"))
            if request is None:
                continue
            key = (request["worker"], request["trace"][CALIBRATION]["probe"])
            at = float(record.get("at") or 0)
            if key not in grades or at >= grades[key][0]:
                graded = Graded(
                    float(record["score"]),
                    logged_query(request),  # a long probe's head and tail, as training reads it
                    int(request.get("completion_tokens") or 0),
                    at,
                )
                grades[key] = (at, graded)
    return {key: graded for key, (_, graded) in grades.items()}


@dataclass(frozen=True, slots=True)
class LostCall:
    """A paid call an earlier run sent and never recorded the outcome of: its intent record, open."""

    record: dict  # the intent, as the ledger holds it
    hold: Decimal  # what the call was held at: the most it may cost

    @property
    def worker(self) -> str:
        return str(self.record.get("model"))


def lost_calls(records: Iterable[dict], alive: Callable[[dict], bool] | None = None) -> list[LostCall]:
    """The calibration intents no request record of the same id closes: calls an earlier run sent
    and was killed before it could record (SIGKILL, a crash), which the provider may still bill. An
    intent of a run still going (`alive`, by default: its process still runs on this host) is in
    flight, not lost."""
    alive = alive or _run_alive
    intents: dict[str, dict] = {}
    closed: set[str] = set()
    for record in records:
        kind, request_id = record.get("type"), record.get("id")
        if not isinstance(request_id, str):
            continue
        if kind == INTENT and record.get("strategy") == CALIBRATION:
            if isinstance(record.get("tenant"), str) and isinstance(record.get("model"), str):
                intents.setdefault(request_id, record)
        elif kind == "request":
            closed.add(request_id)
    lost = []
    for request_id, intent in intents.items():
        if request_id in closed or alive(intent):
            continue
        micros = _in_flight(intent).get("hold_micros")
        hold = Decimal(micros) / 1_000_000 if isinstance(micros, int) and micros >= 0 else Decimal(0)
        lost.append(LostCall(intent, hold))
    return lost


def _in_flight(intent: dict) -> dict:
    """What an intent says of its call in flight (`Runner._intend`: hold, run, host, pid); {} if nothing."""
    found = ((intent.get("trace") or {}).get(CALIBRATION) or {}).get("in_flight")
    return found if isinstance(found, dict) else {}


def _run_alive(intent: dict) -> bool:
    """Whether the run that wrote `intent` still runs: its process on this host, not ended (a
    zombie has ended). A run on another host cannot be asked: its open intents count as lost."""
    in_flight = _in_flight(intent)
    pid = in_flight.get("pid")
    if in_flight.get("host") != socket.gethostname() or not isinstance(pid, int) or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that id runs
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:  # no /proc (not Linux): the signal said it runs
        return True
    return stat[stat.rindex(b")") + 2 :].split()[0] != b"Z"


# ---- the plan ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Pair:
    probe: Probe
    worker: Worker


@dataclass
class Plan:
    probe_set: ProbeSet
    probes: list[Probe]
    workers: list[Worker]  # to be called
    unavailable: dict[str, str]  # named (or in the catalog) but cannot be called: why
    done: int  # pairs of this plan graded by an earlier run
    pending: list[Pair]  # probe-major: at the cap, every worker has about the same probes
    # worker -> policy rule -> pairs the policy in force excludes: not planned, nothing sent
    excluded: dict[str, Counter[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)  # policy rule -> its reason (the first seen)
    # calls earlier runs sent and were killed before recording (`lost_calls`): this run books them
    lost: list[LostCall] = field(default_factory=list)

    @property
    def lost_usd(self) -> Decimal:
        return sum((call.hold for call in self.lost), Decimal(0))

    @property
    def excluded_pairs(self) -> int:
        return sum(sum(rules.values()) for rules in self.excluded.values())


def parse_worker_names(value: str | None) -> list[str] | None:
    """`--workers a,b` → ["a", "b"]; None for every available worker."""
    if value is None:
        return None
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise CalibrationError("--workers needs at least one worker name (comma-separated)")
    return list(dict.fromkeys(names))


def choose_workers(
    catalog: Catalog, names: list[str] | None, local_enabled: bool
) -> tuple[list[Worker], dict[str, str]]:
    """The workers to calibrate and those that cannot be called (no key, local workers off)."""
    if names is not None:
        unknown = [n for n in names if catalog.get(n) is None]
        if unknown:
            raise CalibrationError(
                f"unknown worker{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                f"the catalog has: {', '.join(catalog.names)}"
            )
        chosen = [catalog.get(n) for n in names]
    else:
        chosen = list(catalog.of_kind(Kind.chat))  # probes are chat prompts: embedding workers sit out
    workers: list[Worker] = []
    unavailable: dict[str, str] = {}
    for worker in chosen:
        assert worker is not None
        reason = worker.availability()
        if reason is None and worker.local is not None and not local_enabled:
            reason = "local workers are disabled (POLYROUTE_LOCAL_WORKERS=false)"
        if reason is None:
            workers.append(worker)
        else:
            unavailable[worker.name] = reason
    return workers, unavailable


def check_policy(engine: PolicyEngine | None, last_error: str | None = None) -> PolicyEngine:
    """The engine, if probes may be evaluated by it; CalibrationError saying why not otherwise."""
    if engine is None:
        raise CalibrationError(f"no valid policy is loaded, so no worker may be called: {last_error}")
    if DATA_CLASS not in engine.policy.data_classes:
        raise CalibrationError(
            f"the policy has no data class {DATA_CLASS!r} (it has {list(engine.policy.data_classes)}); "
            "probes are public data"
        )
    return engine


def planning_policy(settings: Any, catalog: Catalog) -> PolicyEngine:
    """The policy a run with these settings will evaluate its calls by, read without writing
    anything (a dry run sends and writes nothing): the policy file in force, or on a data dir that
    never served the shipped default (which the run's first start copies there). A data dir that
    served and lost its policy file is refused, as the gateway refuses it."""
    from gateway.state import catalog_check, policy_path
    from policies import PolicyError, PolicySource

    try:
        path = policy_path(settings, seed=False)
    except PolicyError as exc:
        raise CalibrationError(str(exc)) from None
    source = PolicySource(path, None, catalog_check(catalog))
    return check_policy(source.engine, source.last_error)


def admission_for(
    engine: PolicyEngine,
    catalog: Catalog,
    chat: Any,
    worker: Worker,
    tenant: str,
    down: dict[str, str] | None = None,
    assume_available: bool = False,
):
    """The policy's verdict on one probe's request to one worker (data class public, no spend)."""
    request = PolicyRequest(
        tenant=tenant,
        model=worker.name,
        texts=chat.texts(),
        data_class=DATA_CLASS,
        prompt_chars=chat.prompt_chars(),
        max_output_tokens=chat.output_budget(),
        spend=Spend(),
    )
    return engine.evaluate(request, catalog, down, assume_available=assume_available)


def make_plan(
    catalog: Catalog,
    probe_set: ProbeSet,
    count: int,
    seed: int,
    names: list[str] | None,
    records: Iterable[dict],
    local_enabled: bool = True,
    engine: PolicyEngine | None = None,
    tenant: str = CALIBRATION,
) -> Plan:
    """The pairs to call. With `engine` (the policy in force), a pair it excludes is not planned:
    it is counted under its rule in `excluded` (the run evaluates every call again, in case the
    policy changes meanwhile). Calls an earlier run left in flight, killed, are in `lost`."""
    workers, unavailable = choose_workers(catalog, names, local_enabled)
    probes = probe_set.select(count, seed)
    records = records if isinstance(records, list) else list(records)
    graded = graded_pairs(records)
    pending = [Pair(p, w) for p in probes for w in workers if (w.name, p.id) not in graded]
    done = sum((w.name, p.id) in graded for p in probes for w in workers)
    plan = Plan(probe_set, probes, workers, unavailable, done, pending, lost=lost_calls(records))
    if engine is None:
        return plan
    kept = []
    for pair in pending:
        try:
            admission = admission_for(
                engine, catalog, chat_for(pair.probe, pair.worker), pair.worker, tenant, assume_available=True
            )
        except PolicyRequestError as exc:
            raise CalibrationError(f"the policy refuses the probes' data class: {exc}") from None
        if admission.admits(pair.worker.name):
            kept.append(pair)
            continue
        exclusion = admission.exclusion_for(pair.worker.name)
        rule = exclusion.rule if exclusion else "?"
        plan.excluded.setdefault(pair.worker.name, Counter())[rule] += 1
        plan.reasons.setdefault(rule, exclusion.reason if exclusion else "not admitted")
    plan.pending = kept
    return plan


def chat_for(probe: Probe, worker: Worker):
    """The request a probe is: one user message, the probe's max_tokens, pinned to the worker."""
    from gateway.schemas import ChatCompletionRequest

    return ChatCompletionRequest(
        model=worker.name,
        messages=[{"role": "user", "content": probe.prompt}],
        max_tokens=probe.max_tokens,
    )


@dataclass(frozen=True, slots=True)
class WorkerEstimate:
    worker: str
    pairs: int
    expected_usd: Decimal  # the holds' prompt prediction in, the type's usual answer length out
    worst_usd: Decimal  # max_tokens out: what the cap holds per call before a worker has answered


def estimate(plan: Plan) -> list[WorkerEstimate]:
    """What the pending pairs should cost, per worker, from the catalog's prices: the prediction
    the cap's holds start from (prompt characters as policies.cost.token_chars counts them, the
    probe's max_tokens out), and an expected cost with the type's usual answer length (never more
    than max_tokens) out."""
    out = []
    for worker in plan.workers:
        pairs = [pair for pair in plan.pending if pair.worker.name == worker.name]
        expected = worst = Decimal(0)
        for pair in pairs:
            chat = chat_for(pair.probe, worker)
            size, budget = chat.prompt_chars(), chat.output_budget()
            prompt_tokens, output_tokens = estimate_tokens(size, budget)
            expected += worker.cost_usd(
                prompt_tokens, min(EXPECTED_OUTPUT_TOKENS[pair.probe.type], output_tokens)
            )
            worst += predicted_cost(worker, size, budget)
        out.append(WorkerEstimate(worker.name, len(pairs), expected, worst))
    return out


# ---- the run ----------------------------------------------------------------------------------------
@dataclass
class WorkerTally:
    graded: int = 0
    score_sum: float = 0.0
    errors: int = 0
    last_error: str | None = None
    skipped: Counter[str] = field(default_factory=Counter)  # policy rule -> pairs
    reasons: dict[str, str] = field(default_factory=dict)  # policy rule -> its reason (the first seen)
    spent: Decimal = Decimal(0)
    failing: int = 0  # failed calls in a row
    gave_up: bool = False  # MAX_FAILURES_IN_A_ROW reached: the worker's other pairs are left for a rerun
    no_usage: int = 0  # answers of a priced worker that reported no usage: each booked at its hold
    booked: Decimal = Decimal(0)  # what those were booked at

    @property
    def mean(self) -> float | None:
        return self.score_sum / self.graded if self.graded else None


@dataclass
class RunResult:
    tallies: dict[str, WorkerTally]
    spent: Decimal
    capped: bool  # stopped because the next call would not fit under the cap
    left: int  # pending pairs not attempted (the cap, or a worker that never started)
    unavailable: dict[str, str]  # workers dropped at the start (a local worker that did not start)
    blocked: tuple[str, Decimal] | None = None  # the call that did not fit under the cap: worker, hold
    cap: Decimal | None = None
    lost: int = 0  # calls earlier runs left in flight, booked by this one (in `spent`, at their holds)
    lost_usd: Decimal = Decimal(0)

    @property
    def errors(self) -> int:
        return sum(t.errors for t in self.tallies.values())

    @property
    def over_cap(self) -> bool:
        """The run spent more than its cap: answers cost more than their holds."""
        return self.cap is not None and self.spent > self.cap


@dataclass
class Rate:
    """What one worker's answered calls were billed against their predictions. Its later calls are
    held at their predictions scaled by it: prompt tokens by the billed/predicted ratio of all its
    answered prompts together (policies.cost.BilledRate, as a workflow's later steps are), output
    tokens by the most it billed per max_tokens allowed. Never below the prediction: a worker that
    bills less does not lower a bound."""

    prompt: BilledRate = field(default_factory=BilledRate)
    output: float = 1.0  # the most output tokens billed per output token allowed (at least 1)

    @property
    def observed(self) -> bool:
        return bool(self.prompt.units) or self.output > 1.0

    def observe(self, predicted: int, billed: int, budget: int | None, completion: int) -> None:
        self.prompt.observe(predicted, billed)
        if budget and completion > 0:
            self.output = max(self.output, completion / budget)

    def scale(self, prompt_tokens: int, output_tokens: int) -> tuple[int, int]:
        prompt_tokens = self.prompt.raised(prompt_tokens, prompt_tokens)
        return prompt_tokens, max(output_tokens, math.ceil(output_tokens * self.output))


Progress = Callable[[Pair, str, Decimal], None]  # (pair, outcome, spent so far)


class Runner:
    """Runs a plan's pending pairs on an AppState, `concurrency` at a time, in order, under the cap.

    Each lane takes the first pending pair (in plan order) that may start now and never waits
    behind a call it cannot join: a local worker answers one call at a time, and a priced worker
    that has not answered yet (nothing measured scales its prediction) may have one call in flight
    in the whole run. A lane waits only when no pending pair may start, until a call ends."""

    def __init__(
        self,
        state: Any,
        plan: Plan,
        cap_usd: Decimal,
        tenant: str = CALIBRATION,
        concurrency: int = 4,
        progress: Progress | None = None,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.state = state
        self.plan = plan
        self.cap = cap_usd
        self.tenant = tenant
        self.concurrency = max(1, concurrency)
        self.progress = progress or (lambda pair, outcome, spent: None)
        self.say = say or (lambda message: None)
        self.tallies = {w.name: WorkerTally() for w in plan.workers}
        self.workers = {w.name: w for w in plan.workers}
        self.spent = Decimal(0)
        self.held = Decimal(0)
        self.rates: dict[str, Rate] = {}  # per worker that has answered: its holds' scale
        self.run_rate = Rate()  # every answered call's: the scale of a worker that has not answered yet
        self.capped = False
        self.blocked: tuple[str, Decimal] | None = None  # the first call that did not fit: worker, hold
        self.dropped: dict[str, str] = {}
        # per worker, its pending pairs with their place in the plan's order
        self.queues: dict[str, deque[tuple[int, Pair]]] = {w.name: deque() for w in plan.workers}
        # A local llama.cpp server answers one request at a time: queued calls would only wait out
        # their timeouts there, so each local worker gets one call in flight.
        self.local_busy: set[str] = set()
        # The one call in flight of a priced worker that has not answered yet (see the module docstring).
        self.unmeasured_call: str | None = None
        self._changed: asyncio.Event | None = None
        self.run_id = uuid.uuid4().hex  # names this run's intents (see `_intend`)
        self._flushing = asyncio.Lock()  # one flush of a Redis ledger at a time: none sends a batch twice

    # -- the cap ---------------------------------------------------------------------------------
    def _priced(self, worker: Worker) -> bool:
        return worker.cost_usd(1_000_000, 1_000_000) > 0

    def _unmeasured(self, worker: Worker) -> bool:
        """A priced worker that has not answered yet: nothing measured what it bills (its holds are
        scaled by the run's rate, which another worker's tokenizer made)."""
        return worker.name not in self.rates and self._priced(worker)

    def _hold(self, worker: Worker, chat) -> tuple[Decimal, int]:
        """(this call's hold, its predicted prompt tokens): the prediction, scaled by the worker's rate."""
        prompt_tokens, output_tokens = estimate_tokens(chat.prompt_chars(), chat.output_budget())
        rate = self.rates.get(worker.name)
        if rate is None or not rate.observed:
            rate = self.run_rate
        return worker.cost_usd(*rate.scale(prompt_tokens, output_tokens)), prompt_tokens

    def _reserve(self, worker: Worker, chat) -> tuple[Decimal, int] | None:
        """Hold this call's cost if it fits under the cap; None (and the run stops) if it does not.
        No await between the check and the update: calls in flight cannot race it."""
        hold, predicted = self._hold(worker, chat)
        if self.spent + self.held + hold > self.cap:
            self.capped = True
            self.blocked = self.blocked or (worker.name, hold)
            return None
        self.held += hold
        return hold, predicted

    # -- which pair next -------------------------------------------------------------------------
    def _may_start(self, worker: Worker) -> bool:
        if self.tallies[worker.name].gave_up:
            return True  # taken at once as abandoned: nothing is sent
        if worker.local is not None and worker.name in self.local_busy:
            return False
        return not (self.unmeasured_call is not None and self._unmeasured(worker))

    def _take(self) -> Pair | None:
        """The first pending pair in plan order that may start now; None when none may."""
        best: tuple[int, str] | None = None
        for name, queue in self.queues.items():
            if queue and (best is None or queue[0][0] < best[0]) and self._may_start(self.workers[name]):
                best = (queue[0][0], name)
        return None if best is None else self.queues[best[1]].popleft()[1]

    def _notify(self) -> None:
        """A call ended (or the run stopped): lanes waiting for a pair that may start look again."""
        if self._changed is not None:
            self._changed.set()
            self._changed = asyncio.Event()

    # -- calls in flight --------------------------------------------------------------------------
    async def _stored(self) -> bool:
        """Whether what was written to the ledger is stored where a killed process cannot lose it.
        The file ledger writes each record through at once; Redis's buffers it, so it is flushed
        now: False when some of it cannot be sent (Redis unreachable)."""
        ledger = self.state.ledger
        while ledger.buffered:
            async with self._flushing:
                if ledger.buffered and not await asyncio.to_thread(ledger.flush):
                    return False
        return True

    async def _book_lost(self) -> None:
        """Book the calls earlier runs left in flight (`Plan.lost`): each as stopped (status 499) at
        its hold, the most it may cost, in the ledger (which closes its intent: no later run books it
        again) and in this run's spend, so the cap counts it. Before any call of this run."""
        from gateway.ledger import RequestRecord
        from gateway.store import to_micros

        fields = set(RequestRecord.__dataclass_fields__) - {"type", "status", "worker", "cost_micros", "at"}
        for call in self.plan.lost:
            intent = call.record
            trace = dict((intent.get("trace") or {}).get(CALIBRATION) or {})
            trace.pop("in_flight", None)
            trace["error"] = (
                f"lost in flight: the run that sent it to {call.worker} ended without its outcome (killed); "
                f"booked by a later run at its hold, the most it may cost, ${call.hold:.6f}"
            )
            kept = {name: intent[name] for name in fields if name in intent}
            if isinstance(kept.get("fallbacks"), list):
                kept["fallbacks"] = tuple(kept["fallbacks"])
            self.state.ledger.record_request(
                RequestRecord(
                    **{**kept, "trace": {CALIBRATION: trace}},
                    worker=None,
                    status=STOPPED,
                    cost_micros=to_micros(call.hold),
                )
            )
            self.spent += call.hold
        await self._flush()

    # -- one pair --------------------------------------------------------------------------------
    def _admission(self, chat, worker: Worker):
        engine = check_policy(self.state.policy.engine, self.state.policy.last_error)
        return admission_for(engine, self.state.catalog, chat, worker, self.tenant, self.state.down_workers())

    async def _one(self, pair: Pair) -> str:
        """Call, grade, record one pair; returns its outcome: graded, error, skipped (by the policy),
        capped (the run stops) or abandoned (its worker failed too often in a row). Everything up to
        the call's hold runs without an await, from the moment the lane took the pair: the worker's
        state it was taken on (given up, busy, measured) is the state it is sent on."""
        probe, worker = pair.probe, pair.worker
        tally = self.tallies[worker.name]
        if tally.gave_up:
            return "abandoned"
        chat = chat_for(probe, worker)
        admission = self._admission(chat, worker)
        if not admission.admits(worker.name):
            exclusion = admission.exclusion_for(worker.name)
            rule = exclusion.rule if exclusion else "?"
            tally.skipped[rule] += 1
            tally.reasons.setdefault(rule, exclusion.reason if exclusion else "not admitted")
            return "skipped"
        unmeasured, local = self._unmeasured(worker), worker.local is not None
        if unmeasured:
            self.unmeasured_call = worker.name
        if local:
            self.local_busy.add(worker.name)
        try:
            return await self._call(pair, chat, admission)
        finally:
            if unmeasured and self.unmeasured_call == worker.name:
                self.unmeasured_call = None
            if local:
                self.local_busy.discard(worker.name)

    def _failed(self, tally: WorkerTally, message: str) -> None:
        tally.errors += 1
        tally.last_error = message
        tally.failing += 1
        tally.gave_up = tally.failing >= MAX_FAILURES_IN_A_ROW

    async def _call(self, pair: Pair, chat, admission) -> str:
        """The call, its grade and its records, under the cap (see :meth:`_one`)."""
        from gateway.ledger import FeedbackRecord, RequestRecord, stored_query
        from gateway.store import to_micros
        from gateway.upstream import WorkerError

        probe, worker = pair.probe, pair.worker
        tally = self.tallies[worker.name]
        reserved = self._reserve(worker, chat)
        if reserved is None:
            return "capped"
        hold, predicted_prompt = reserved
        request_id = "cal_" + uuid.uuid4().hex
        started = time.perf_counter()
        trace: dict[str, Any] = {"probe": probe.id, "task": probe.task, "type": probe.type}
        trace["set"] = self.plan.probe_set.version
        common = {
            "id": request_id,
            "tenant": self.tenant,
            "model": worker.name,
            "strategy": CALIBRATION,
            "policy_version": admission.policy_version,
            "router_version": self.state.router.current.version,
            "data_class": admission.data_class,
            # a long probe keeps its tail as a live request's record does: a last-paragraph model
            # fitted on these records reads the question (router train --from-ledger)
            **stored_query(chat.last_user_text(), admission.data_class).record_fields(),
            "turns": chat.user_turns(),
        }

        def record_failure(status: int, message: str) -> None:  # the call gave no answer to grade
            self.state.ledger.record_request(
                RequestRecord(
                    **common,
                    worker=None,
                    status=status,
                    latency_ms=round((time.perf_counter() - started) * 1000, 2),
                    fallbacks=(worker.name,),
                    trace={CALIBRATION: {**trace, "error": message}},
                )
            )

        try:
            try:
                if hold > 0 and not await self._intend(common, trace, hold):
                    record_failure(503, "not sent: the ledger could not store its in-flight record")
                    raise CalibrationError(
                        "the ledger cannot be written (Redis unreachable?): a paid call is sent only once "
                        "its in-flight record is stored, so that a run killed meanwhile leaves a trace of "
                        "it; run the same command again once the ledger is reachable"
                    )
                async with asyncio.timeout(self.state.settings.request_timeout_s):
                    completion = await self.state.client.complete(worker, self.state.api_base(worker), chat)
            finally:
                self.held -= hold
        except asyncio.CancelledError:  # Ctrl-C or SIGTERM: the call was sent, and its provider may bill it
            record_failure(499, f"stopped while {worker.name} answered: the call may cost up to ${hold:.6f}")
            raise
        except (WorkerError, TimeoutError) as exc:
            status = exc.status if isinstance(exc, WorkerError) else 504
            message = (
                exc.message
                if isinstance(exc, WorkerError)
                else f"no answer within {self.state.settings.request_timeout_s:g} s"
            )
            self._failed(tally, message)
            record_failure(status, message)
            return "error"
        latency = round((time.perf_counter() - started) * 1000, 2)
        cost = completion.cost_usd
        if completion.usage_estimated or (
            completion.prompt_tokens <= 0 and completion.completion_tokens <= 0
        ):
            # The provider reported no usage, so what it bills is unknown (the gateway's own count of
            # the tokens is an estimate, and litellm's price of none is $0): book the most the call
            # could cost, so the cap and the ledger see it. Nothing is learnt for the holds.
            cost = max(cost, hold)
            trace["usage"] = USAGE_MISSING
            if hold > 0:
                tally.no_usage += 1
                tally.booked += hold
            self.rates.setdefault(worker.name, Rate())
        else:
            for rate in (self.rates.setdefault(worker.name, Rate()), self.run_rate):
                rate.observe(
                    predicted_prompt,
                    completion.prompt_tokens,
                    chat.output_budget(),
                    completion.completion_tokens,
                )
        self.spent += cost
        tally.spent += cost
        base = {
            **common,
            "worker": worker.name,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "cost_micros": to_micros(cost),
            "latency_ms": latency,
        }
        text = answer_text(completion.body)
        if not gradable(completion.body, text):  # paid, nothing to grade: failed (no feedback), asked again
            message = missing_answer(completion.body)
            self._failed(tally, message)
            self.state.ledger.record_request(
                RequestRecord(**base, status=502, trace={CALIBRATION: {**trace, "error": message}})
            )
            return "error"
        tally.failing = 0
        try:
            result = await self._grade(probe, text)
        except asyncio.CancelledError:  # stopped while grading: the paid call is booked, not graded
            message = "stopped while its answer was graded: not graded (a rerun asks again)"
            self.state.ledger.record_request(
                RequestRecord(**base, status=200, trace={CALIBRATION: {**trace, "error": message}})
            )
            raise
        except Exception as exc:  # a grader bug must not become a label: the call is booked, not graded
            tally.errors += 1
            tally.last_error = f"grading failed: {type(exc).__name__}: {exc}"
            self.state.ledger.record_request(
                RequestRecord(**base, status=200, trace={CALIBRATION: {**trace, "error": tally.last_error}})
            )
            return "error"
        read = result.extracted[:READ_CHARS] if result.extracted else None
        trace |= {"score": result.score, "read": read, "detail": result.detail[:READ_CHARS]}
        self.state.ledger.record_request(RequestRecord(**base, status=200, trace={CALIBRATION: trace}))
        self.state.ledger.record_feedback(
            FeedbackRecord(request_id, self.tenant, result.score, worker.name, source=CALIBRATION)
        )
        tally.graded += 1
        tally.score_sum += result.score
        return "graded"

    async def _intend(self, common: dict[str, Any], trace: dict[str, Any], hold: Decimal) -> bool:
        """Write the paid call's intent (type INTENT, status IN_FLIGHT, its hold) and make it stored
        before the call is sent: a run killed while the call is in flight (SIGKILL, a crash) leaves
        it open, and the next run books the call (`lost_calls`). Ctrl-C and SIGTERM close it as
        every outcome does, by the call's request record. False when it cannot be stored."""
        from gateway.ledger import RequestRecord
        from gateway.store import to_micros

        in_flight = {
            "hold_micros": to_micros(hold),
            "run": self.run_id,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }
        self.state.ledger.record_request(
            RequestRecord(
                **common,
                worker=None,
                status=IN_FLIGHT,
                fallbacks=(common["model"],),
                trace={CALIBRATION: {**trace, "in_flight": in_flight}},
                type=INTENT,
            )
        )
        return await self._stored()

    async def _grade(self, probe: Probe, text: str):
        """The grade; a code answer's tests run in a thread of their own (they block, up to the
        probe's timeout) that a cancelled run does not wait for (:func:`in_daemon_thread`)."""
        from router.grading import grade

        if probe.type != "code":
            return grade(probe, text)
        return await in_daemon_thread(grade, probe, text)

    # -- the whole run ---------------------------------------------------------------------------
    async def _start_local(self) -> None:
        """Start the plan's local workers (llama.cpp), as the gateway does, and wait until they serve."""
        for worker in self.plan.workers:
            proc = self.state.local.get(worker.name)
            if proc is None:
                continue
            self.say(f"starting local worker {worker.name} …")
            proc.start()
            if not await proc.wait_ready(proc.spec.startup_timeout_s + LOCAL_READY_MARGIN_S):
                self.dropped[worker.name] = f"local worker did not start: {proc.detail}"

    async def _flush(self) -> None:
        if self.state.stores.backend == "redis":
            async with self._flushing:
                await asyncio.to_thread(self.state.ledger.flush)

    async def run(self) -> RunResult:
        check_policy(self.state.policy.engine, self.state.policy.last_error)
        await self._book_lost()
        if self.plan.pending:
            await self._start_local()
        self._changed = asyncio.Event()
        for index, pair in enumerate(self.plan.pending):
            if pair.worker.name not in self.dropped:
                self.queues[pair.worker.name].append((index, pair))

        async def lane() -> None:
            while not self.capped:
                pair = self._take()
                if pair is None:
                    if not any(self.queues.values()):
                        return
                    assert self._changed is not None
                    await self._changed.wait()  # a call in flight holds what every pending pair needs
                    continue
                try:
                    outcome = await self._one(pair)
                except PolicyRequestError as exc:
                    raise CalibrationError(f"the policy refuses the probes' data class: {exc}") from None
                finally:
                    self._notify()
                if outcome == "capped":
                    return
                await self._flush()
                self.progress(pair, outcome, self.spent)

        lanes = [asyncio.ensure_future(lane()) for _ in range(self.concurrency)]
        try:
            await asyncio.gather(*lanes)
        except BaseException:  # one lane's error (or the run's cancellation) ends every lane
            for task in lanes:
                task.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
            raise
        finished = sum(t.graded + t.errors + sum(t.skipped.values()) for t in self.tallies.values())
        return RunResult(
            tallies=self.tallies,
            spent=self.spent,
            capped=self.capped,
            left=len(self.plan.pending) - finished,
            unavailable=dict(self.dropped),
            blocked=self.blocked,
            cap=self.cap,
            lost=len(self.plan.lost),
            lost_usd=self.plan.lost_usd,
        )


def answer_text(body: dict) -> str:
    """The answer's text: the first choice's content (text parts joined), or "" when there is none."""
    choices = body.get("choices") or []
    content = (choices[0].get("message") or {}).get("content") if choices else None
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def gradable(body: dict, text: str) -> bool:
    """Whether an answer (HTTP 200) is one to grade. Not a body without choices (malformed: no answer
    was given), nor an empty answer cut by max_tokens (the budget ran out before any text, as a
    reasoning model's can: the probe's limit, not the worker's answer). An empty answer the worker
    ended itself is its answer, graded (0): a base model that writes nothing to a question is wrong,
    and a rerun would only ask again forever."""
    choices = body.get("choices") or []
    if not choices:
        return False
    return bool(text.strip()) or choices[0].get("finish_reason") != "length"


def missing_answer(body: dict) -> str:
    """Why an answer (HTTP 200) has no text to grade, for the ledger and the summary."""
    choices = body.get("choices") or []
    if not choices:
        return "200 with no choices: no answer to grade"
    finish = choices[0].get("finish_reason")
    why = f" (finish_reason {finish}{': max_tokens ran out first' if finish == 'length' else ''})"
    return "200 without answer text" + (why if finish else "") + ": nothing to grade"


async def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` in a daemon thread of its own. Cancelling the caller (Ctrl-C, SIGTERM) returns at
    once: neither the event loop's shutdown nor the interpreter's exit waits for the thread, as both
    wait for asyncio.to_thread's executor (a code answer's test run may take its whole timeout). On
    cancellation the code sandbox's children of this process are killed (code_behaviour.kill_running),
    so the test run ends now instead of running on to its timeout."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is None:
                done.set_result(value)
            else:
                done.set_exception(error)

    def work() -> None:
        value, error = None, None
        try:
            value = fn(*args)
        except Exception as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it any more
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=work, name="calibration-grader", daemon=True).start()
    try:
        return await done
    except asyncio.CancelledError:
        kill_running()
        raise


async def run_calibration(
    settings: Any,
    catalog: Catalog,
    plan: Plan,
    cap_usd: Decimal,
    tenant: str = CALIBRATION,
    concurrency: int = 4,
    progress: Progress | None = None,
    say: Callable[[str], None] | None = None,
) -> RunResult:
    """Build the gateway's state from `settings`, run the plan on it, and close everything after."""
    state = open_state(settings, catalog)
    try:
        return await Runner(state, plan, cap_usd, tenant, concurrency, progress, say).run()
    finally:
        await close_state(state)


def open_state(settings: Any, catalog: Catalog):
    """The gateway's state for these settings. It serves no HTTP, so nobody authenticates against it:
    it gets an admin key nobody knows, which also keeps `build_state` from creating one on disk
    (a gateway's first start does that, for its operator)."""
    from gateway.state import build_state

    return build_state(settings.model_copy(update={"admin_key": secrets.token_urlsafe(32)}), catalog)


async def close_state(state: Any) -> None:
    """Stop local workers, close upstream connections, and write out the ledger (Redis: flush, or
    spill to disk what cannot be sent). Budgets are not saved: calibration never touched them."""
    for proc in state.local.values():
        await proc.stop()
    await state.client.aclose()
    await asyncio.to_thread(state.stores.ledger.close)
    await state.stores.close()


# ---- fitting ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FitResult:
    status: str  # fitted | unchanged | no_router | no_labels | failed
    message: str
    version: str | None = None


def calibration_labels(
    graded: dict[tuple[str, str], Graded], probe_set: ProbeSet, workers: list[str]
) -> tuple[list[str], list[int], Any, dict[str, float]]:
    """(texts, turns, labels [texts × workers] with NaN where unlabelled, median completion tokens per
    worker) from the ledger's calibration grades of `workers`. A probe's text is its prompt (what
    the router reads: the one user message), or the query the ledger stored when the probe set no
    longer has that probe. An answer whose provider reported no usage (0 tokens) is left out of the
    median."""
    import numpy as np

    column = {w: i for i, w in enumerate(workers)}
    rows: dict[str, int] = {}
    texts: list[str] = []
    cells: list[tuple[int, int, float]] = []
    tokens: dict[str, list[int]] = {w: [] for w in workers}
    for (worker, probe_id), grade in sorted(graded.items()):
        if worker not in column:
            continue
        text = _label_text(grade, probe_id, probe_set)
        if not text:
            continue
        if text not in rows:
            rows[text] = len(texts)
            texts.append(text)
        cells.append((rows[text], column[worker], grade.score))
        if grade.completion_tokens > 0:
            tokens[worker].append(grade.completion_tokens)
    labels = np.full((len(texts), len(workers)), np.nan)
    for row, col, score in cells:
        labels[row, col] = score
    medians = {w: float(statistics.median(t)) for w, t in tokens.items() if t}
    return texts, [1] * len(texts), labels, medians


def _label_text(grade: Graded, probe_id: str, probe_set: ProbeSet) -> str | None:
    probe = probe_set.get(probe_id)
    return probe.prompt if probe is not None else grade.query


def grade_fingerprints(
    graded: dict[tuple[str, str], Graded], probe_set: ProbeSet, workers: list[str]
) -> dict[str, dict[str, Any]]:
    """Per worker, what its vector is fitted on: how many grades, and a digest of them (probe, text,
    score, when graded). The fit writes it in the version's card; equal digests mean no grade
    arrived since (a rerun with nothing new to send), and nothing is fitted again."""
    out: dict[str, dict[str, Any]] = {}
    for worker in workers:
        items = sorted(
            (probe_id, text, grade.score, grade.at)
            for (name, probe_id), grade in graded.items()
            if name == worker and (text := _label_text(grade, probe_id, probe_set))
        )
        digest = hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]
        out[worker] = {"labels": len(items), "digest": digest}
    return out


def fit_workers(
    router_root: Path, records: Iterable[dict], probe_set: ProbeSet, workers: list[str]
) -> FitResult:
    """Fit `workers`' vectors on every calibration grade the ledger holds for them, on top of the
    router in force, and put the result in force (a new version: `router rollback` undoes it). When
    the version in force was fitted on exactly these grades, nothing is fitted nor saved: it stays
    in force (status "unchanged"), so reruns do not pile up identical versions."""
    import numpy as np

    from router import RouterLoadError, feature_builder_for, load_current, save_artifact

    graded = graded_pairs(records)
    texts, turns, labels, medians = calibration_labels(graded, probe_set, workers)
    if not texts:
        return FitResult("no_labels", "no graded probe to fit on")
    from router.onboard import MIN_PROBES, onboard_artifact

    counts = {w: int(np.sum(~np.isnan(labels[:, i]))) for i, w in enumerate(workers)}
    fitted = [w for w in workers if counts[w] >= MIN_PROBES]
    waiting = [f"{w} ({counts[w]})" for w in workers if 0 < counts[w] < MIN_PROBES]
    if not fitted:
        return FitResult(
            "no_labels",
            f"a worker's vector needs at least {MIN_PROBES} graded probes; so far: {', '.join(waiting)}. "
            "The grades are in the ledger: a rerun resumes and fits",
        )
    try:
        artifact = load_current(router_root)
    except RouterLoadError as exc:
        return FitResult("failed", f"the router in force cannot be loaded: {exc}")
    if artifact is None:
        return FitResult(
            "no_router",
            f"no router is in force in {router_root}, so there is no shared query representation to fit "
            "the workers' vectors on; the grades are in the ledger (`polyroute router train "
            "--from-ledger` uses them, and a rerun of this command fits them once a router is in force)",
        )
    fingerprints = grade_fingerprints(graded, probe_set, fitted)
    known = ((artifact.card or {}).get(CALIBRATION) or {}).get("grades") or {}
    if all(known.get(w) == fingerprints[w] for w in fitted) and set(fitted) <= set(artifact.workers):
        return FitResult(
            "unchanged",
            f"nothing new: version {artifact.version} stays in force (no grade since it fitted "
            f"{', '.join(fitted)} on {sum(f['labels'] for f in fingerprints.values())} grades)",
            artifact.version,
        )
    columns = [workers.index(w) for w in fitted]
    # The base model's own workers keep the output length it learnt from its (larger) data; every
    # other worker's figure is its calibration median, updated by each fit.
    base_workers = set(getattr(artifact.model, "base_workers", artifact.workers))
    output_tokens = {w: medians[w] for w in fitted if w in medians and w not in base_workers}
    try:
        features = feature_builder_for(artifact.features)
        new = onboard_artifact(
            artifact, features, texts, turns, labels[:, columns], fitted, output_tokens=output_tokens or None
        )
    except Exception as exc:  # the grades are safe in the ledger: report, and a rerun fits again
        return FitResult("failed", f"fitting the workers' vectors failed: {type(exc).__name__}: {exc}")
    if new.version == artifact.version:
        new.version = ""  # a new version directory, never the one in force
    new.card = {
        **(new.card or {}),
        CALIBRATION: {
            "probe_set": probe_set.version,
            "workers": fitted,
            "probes": len(texts),
            "labels": int(np.sum(~np.isnan(labels[:, columns]))),
            "on_top_of": artifact.version,
            # per worker in force with a calibrated vector: the grades it was fitted on
            "grades": {**known, **fingerprints},
        },
    }
    directory = save_artifact(router_root, new, activate=True)
    return FitResult(
        "fitted",
        f"router {new.version} in force ({', '.join(fitted)} fitted on {len(texts)} probes, "
        f"on top of {artifact.version}); saved in {directory}",
        new.version,
    )
