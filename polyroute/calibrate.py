"""Calibration: probes through the gateway's own worker path, graded, into the ledger, then fitted.

`polyroute router calibrate` (the command is polyroute/cli_calibrate.py) measures workers on the
shipped probe set (router/probes) and teaches the router what it measured:

1. Plan: the probes (seeded, stratified), the workers (named, or every available one), minus the
   (worker, probe) pairs the ledger already holds a calibration grade for: a rerun resumes.
2. Call: each pair is one chat request of one user message, sent with the gateway's own objects,
   built by `gateway.state.build_state` from the same settings (POLYROUTE_*) a gateway would use:
   the policy engine in force evaluates it as data class `public` for the calibration tenant (a
   worker it does not admit is skipped and reported, nothing is sent), `WorkerClient.complete`
   calls the worker (litellm's transforms, retries, timeouts), and the cost is the one it computes
   from the catalog's prices, as for any request.
3. Grade (router/grading.py) and write the ledger: a request record (strategy and trace say
   "calibration", with the probe id) and a feedback record with `source: "calibration"` — labelled
   examples that `router train --from-ledger` reads like any other.
4. Fit: the graded workers' vectors on top of the router in force (router/onboard.py), saved as a
   new version and activated: the hot swap a running gateway watches for.

Why in-process rather than over HTTP to a running gateway: the worker path, policy and cost code
are the same objects either way, but in-process needs no running gateway nor a tenant key, can
record the grade against the request it belongs to, and leaves out exactly what must not touch a
probe: the response cache (it would replay an answer instead of measuring one), retrieval memory
(it would change the question), and tenant budgets and rate limits (the run has its own cap,
`--max-cost-usd`). The ledger is the gateway's (the file, or Redis with REDIS_URL), so a running
gateway and its exports see the records.

The cap: a call starts only if what the run has spent, plus what calls in flight hold, plus this
call's hold fits under the cap. A hold is the gateway's prediction of the call's cost (prompt
characters / 4, and max_tokens of output), or the most a call to that worker has cost in this run
if that is more; so the cap is passed only when a worker's first answer costs more than predicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

from policies import (
    Catalog,
    Kind,
    PolicyRequest,
    PolicyRequestError,
    Spend,
    Worker,
    estimate_tokens,
    predicted_cost,
)
from router.probes import Probe, ProbeSet

CALIBRATION = "calibration"  # the ledger's strategy and feedback source, and the default tenant
DATA_CLASS = "public"  # probes are public data; the policy still applies to them
# What an answer of each type usually costs in output tokens (for the estimate; the cap uses max_tokens).
EXPECTED_OUTPUT_TOKENS = {"choice": 8, "number": 250, "match": 12, "code": 200}
LOCAL_READY_MARGIN_S = 300.0
MAX_FAILURES_IN_A_ROW = (
    5  # then a worker's other pairs wait for a rerun: a dead worker costs minutes, not hours
)
READ_CHARS = 200  # what the grader read, as kept in the ledger's trace  # a local worker's first start assembles its model file


class CalibrationError(Exception):
    """Bad input or a state the run cannot start from; the message says what to do."""


# ---- the ledger's calibration records ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Graded:
    """The latest calibration grade of one (worker, probe) pair in the ledger."""

    score: float
    query: str | None
    completion_tokens: int


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
                    float(record["score"]), request.get("query"), int(request.get("completion_tokens") or 0)
                )
                grades[key] = (at, graded)
    return {key: graded for key, (_, graded) in grades.items()}


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


def make_plan(
    catalog: Catalog,
    probe_set: ProbeSet,
    count: int,
    seed: int,
    names: list[str] | None,
    records: Iterable[dict],
    local_enabled: bool = True,
) -> Plan:
    workers, unavailable = choose_workers(catalog, names, local_enabled)
    probes = probe_set.select(count, seed)
    graded = graded_pairs(records)
    pending = [Pair(p, w) for p in probes for w in workers if (w.name, p.id) not in graded]
    done = sum((w.name, p.id) in graded for p in probes for w in workers)
    return Plan(probe_set, probes, workers, unavailable, done, pending)


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
    expected_usd: Decimal  # prompt chars / 4 in, the type's usual answer length out
    worst_usd: Decimal  # max_tokens out: what the cap holds per call


def estimate(plan: Plan) -> list[WorkerEstimate]:
    """What the pending pairs should cost, per worker, from the catalog's prices."""
    out = []
    for worker in plan.workers:
        pairs = [pair for pair in plan.pending if pair.worker.name == worker.name]
        expected = worst = Decimal(0)
        for pair in pairs:
            prompt_tokens, _ = estimate_tokens(len(pair.probe.prompt), pair.probe.max_tokens)
            expected += worker.cost_usd(prompt_tokens, EXPECTED_OUTPUT_TOKENS[pair.probe.type])
            worst += predicted_cost(worker, len(pair.probe.prompt), pair.probe.max_tokens)
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

    @property
    def errors(self) -> int:
        return sum(t.errors for t in self.tallies.values())


Progress = Callable[[Pair, str, Decimal], None]  # (pair, outcome, spent so far)


class Runner:
    """Runs a plan's pending pairs on an AppState, `concurrency` at a time, in order, under the cap."""

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
        self.spent = Decimal(0)
        self.held = Decimal(0)
        self.largest: dict[str, Decimal] = {}
        self.capped = False
        self.blocked: tuple[str, Decimal] | None = None  # the first call that did not fit: worker, hold
        self.dropped: dict[str, str] = {}
        # A local llama.cpp server answers one request at a time: queued calls would only wait out
        # their timeouts there, so each local worker gets one call in flight.
        self.slots = {w.name: asyncio.Semaphore(1) for w in plan.workers if w.local is not None}
        # Until a worker has answered once, its hold is only the prediction (chars/4, the probe's
        # max_tokens), which a non-English prompt or reasoning tokens can pass: one such call in flight
        # per worker, so the cap is passed by at most one call's excess, not by `concurrency` of them.
        self.unmeasured = {w.name: asyncio.Lock() for w in plan.workers}

    # -- the cap ---------------------------------------------------------------------------------
    def _reserve(self, worker: Worker, chat) -> Decimal | None:
        """Hold this call's cost if it fits under the cap; None (and the run stops) if it does not.
        No await between the check and the update: calls in flight cannot race it."""
        hold = max(
            predicted_cost(worker, chat.prompt_chars(), chat.output_budget()),
            self.largest.get(worker.name, Decimal(0)),
        )
        if self.spent + self.held + hold > self.cap:
            self.capped = True
            self.blocked = self.blocked or (worker.name, hold)
            return None
        self.held += hold
        return hold

    # -- one pair --------------------------------------------------------------------------------
    def _admission(self, chat, worker: Worker):
        engine = self.state.policy.engine
        request = PolicyRequest(
            tenant=self.tenant,
            model=worker.name,
            texts=chat.texts(),
            data_class=DATA_CLASS,
            prompt_chars=chat.prompt_chars(),
            max_output_tokens=chat.output_budget(),
            spend=Spend(),
        )
        return engine.evaluate(request, self.state.catalog, self.state.down_workers())

    async def _one(self, pair: Pair) -> str:
        """Call, grade, record one pair; returns its outcome: graded, error, skipped (by the policy),
        capped (the run stops) or abandoned (its worker failed too often in a row)."""
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
        gate = self.unmeasured[worker.name]
        if worker.name in self.largest:
            gate = None
        else:
            await gate.acquire()
            if worker.name in self.largest:  # measured while this call waited
                gate.release()
                gate = None
        try:
            return await self._call(pair, chat, admission)
        finally:
            if gate is not None:
                gate.release()

    async def _call(self, pair: Pair, chat, admission) -> str:
        """The call, its grade and its records, under the cap (see :meth:`_one`)."""
        from gateway.ledger import FeedbackRecord, RequestRecord, storable_query
        from gateway.store import to_micros
        from gateway.upstream import WorkerError
        from router.grading import grade

        probe, worker = pair.probe, pair.worker
        tally = self.tallies[worker.name]
        hold = self._reserve(worker, chat)
        if hold is None:
            return "capped"
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
            "query": storable_query(chat.last_user_text(), admission.data_class),
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
                async with self.slots.get(worker.name) or contextlib.nullcontext():
                    async with asyncio.timeout(self.state.settings.request_timeout_s):
                        completion = await self.state.client.complete(
                            worker, self.state.api_base(worker), chat
                        )
            finally:
                self.held -= hold
        except asyncio.CancelledError:  # Ctrl-C: the call was sent, and its provider may bill it
            record_failure(499, f"stopped while {worker.name} answered: the call may cost up to ${hold:.6f}")
            raise
        except (WorkerError, TimeoutError) as exc:
            status = exc.status if isinstance(exc, WorkerError) else 504
            message = (
                exc.message
                if isinstance(exc, WorkerError)
                else f"no answer within {self.state.settings.request_timeout_s:g} s"
            )
            tally.errors += 1
            tally.last_error = message
            tally.failing += 1
            tally.gave_up = tally.failing >= MAX_FAILURES_IN_A_ROW
            record_failure(status, message)
            return "error"
        latency = round((time.perf_counter() - started) * 1000, 2)
        tally.failing = 0
        cost = completion.cost_usd
        self.spent += cost
        tally.spent += cost
        self.largest[worker.name] = max(self.largest.get(worker.name, Decimal(0)), cost)
        base = {
            **common,
            "worker": worker.name,
            "prompt_tokens": completion.prompt_tokens,
            "completion_tokens": completion.completion_tokens,
            "cost_micros": to_micros(cost),
            "latency_ms": latency,
        }
        text = answer_text(completion.body)
        try:
            result = (
                await asyncio.to_thread(grade, probe, text) if probe.type == "code" else grade(probe, text)
            )
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
            await asyncio.to_thread(self.state.ledger.flush)

    async def run(self) -> RunResult:
        engine = self.state.policy.engine
        if engine is None:
            raise CalibrationError(
                f"no valid policy is loaded, so no worker may be called: {self.state.policy.last_error}"
            )
        if DATA_CLASS not in engine.policy.data_classes:
            raise CalibrationError(
                f"the policy has no data class {DATA_CLASS!r} (it has {list(engine.policy.data_classes)}); "
                "probes are public data"
            )
        await self._start_local()
        pending = iter([pair for pair in self.plan.pending if pair.worker.name not in self.dropped])

        async def lane() -> None:
            for pair in pending:  # one iterator shared by the lanes: each takes the next pair in order
                if self.capped:
                    return
                try:
                    outcome = await self._one(pair)
                except PolicyRequestError as exc:
                    raise CalibrationError(f"the policy refuses the probes' data class: {exc}") from None
                if outcome == "capped":
                    return
                await self._flush()
                self.progress(pair, outcome, self.spent)

        await asyncio.gather(*(lane() for _ in range(self.concurrency)))
        finished = sum(t.graded + t.errors + sum(t.skipped.values()) for t in self.tallies.values())
        return RunResult(
            tallies=self.tallies,
            spent=self.spent,
            capped=self.capped,
            left=len(self.plan.pending) - finished,
            unavailable=dict(self.dropped),
            blocked=self.blocked,
        )


def answer_text(body: dict) -> str:
    """The answer's text: the first choice's content (text parts joined), or "" when there is none."""
    choices = body.get("choices") or []
    content = (choices[0].get("message") or {}).get("content") if choices else None
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content or ""


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
    status: str  # fitted | no_router | no_labels | failed
    message: str
    version: str | None = None


def calibration_labels(
    graded: dict[tuple[str, str], Graded], probe_set: ProbeSet, workers: list[str]
) -> tuple[list[str], list[int], Any, dict[str, float]]:
    """(texts, turns, labels [texts × workers] with NaN where unlabelled, median completion tokens per
    worker) from the ledger's calibration grades of `workers`. A probe's text is its prompt (what
    the router reads: the one user message), or the query the ledger stored when the probe set no
    longer has that probe."""
    import numpy as np

    column = {w: i for i, w in enumerate(workers)}
    rows: dict[str, int] = {}
    texts: list[str] = []
    cells: list[tuple[int, int, float]] = []
    tokens: dict[str, list[int]] = {w: [] for w in workers}
    for (worker, probe_id), grade in sorted(graded.items()):
        if worker not in column:
            continue
        probe = probe_set.get(probe_id)
        text = probe.prompt if probe is not None else grade.query
        if not text:
            continue
        if text not in rows:
            rows[text] = len(texts)
            texts.append(text)
        cells.append((rows[text], column[worker], grade.score))
        tokens[worker].append(grade.completion_tokens)
    labels = np.full((len(texts), len(workers)), np.nan)
    for row, col, score in cells:
        labels[row, col] = score
    medians = {w: float(statistics.median(t)) for w, t in tokens.items() if t}
    return texts, [1] * len(texts), labels, medians


def fit_workers(
    router_root: Path, records: Iterable[dict], probe_set: ProbeSet, workers: list[str]
) -> FitResult:
    """Fit `workers`' vectors on every calibration grade the ledger holds for them, on top of the
    router in force, and put the result in force (a new version: `router rollback` undoes it)."""
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
    columns = [workers.index(w) for w in fitted]
    output_tokens = {w: medians[w] for w in fitted if w in medians and w not in artifact.output_tokens}
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
        },
    }
    directory = save_artifact(router_root, new, activate=True)
    return FitResult(
        "fitted",
        f"router {new.version} in force ({', '.join(fitted)} fitted on {len(texts)} probes, "
        f"on top of {artifact.version}); saved in {directory}",
        new.version,
    )
