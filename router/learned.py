"""The learned router: per query, predicted quality and cost per admissible worker → one worker.

Workers are black boxes: the model only knows, from past labelled queries, how likely each worker
was to answer well. The pool comes from the policy engine and is never widened here; workers the
model has not seen get a prior. A small, bounded share of traffic may go to under-observed
workers (exploration, off by default) so the model can learn about them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import numpy as np

from policies import Worker, estimate_tokens
from router.artifacts import RouterArtifact
from router.decide import Estimate, choose
from router.features import query_text, text_rule_of
from router.rules import Propensity, RouteDecision, RouteRequest, tool_capable

DEFAULT_COST_WEIGHT = 0.5
# Cold start: a worker with a catalog `profile_like` counts its profile's prediction as this many
# labelled examples, so its own model takes over as feedback accumulates (n / (n + strength)).
PRIOR_STRENGTH = 20
# Where a request's λ came from, in precedence order (resolve_cost_weight), and how a reason names it
# (ASCII: the route reason is a response header).
COST_WEIGHT_SOURCES = {
    "request": "the request (metadata.cost_weight or x-polyroute-cost-weight)",
    "tenant": "the tenant's policy (cost_weight)",
    "setting": "POLYROUTE_COST_WEIGHT",
    "model card": "the model card (operating_cost_weight)",
    "default": "the default",
}


@dataclass(frozen=True, slots=True)
class CostWeight:
    """The λ in force for a request, and which of :data:`COST_WEIGHT_SOURCES` set it."""

    value: float
    source: str

    @property
    def described(self) -> str:
        return f"cost weight {self.value:g} from {COST_WEIGHT_SOURCES[self.source]}"


def operating_cost_weight(card: Mapping[str, Any] | None) -> float | None:
    """The operating λ a model card stores (`router train --strategy cascade`: the λ the harness
    validates, chosen on the training replay), or None: the card has none (older cards, single routing)."""
    value = (card or {}).get("operating_cost_weight")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def resolve_cost_weight(
    request: float | None = None,
    tenant: float | None = None,
    setting: float | None = None,
    card: Mapping[str, Any] | None = None,
) -> CostWeight:
    """The λ of a request — the one rule wherever λ is resolved (fast mode, the plan, a workflow, the
    ledger's route record, /admin/router): the request's own, else its tenant policy's, else
    POLYROUTE_COST_WEIGHT when the operator set it, else the operating λ of the model in force
    (its card's, validated on its training replay), else 0.5."""
    for value, source in ((request, "request"), (tenant, "tenant"), (setting, "setting")):
        if value is not None:
            return CostWeight(float(value), source)
    stored = operating_cost_weight(card)
    if stored is not None:
        return CostWeight(stored, "model card")
    return CostWeight(DEFAULT_COST_WEIGHT, "default")


def cost_weight_of(request: RouteRequest, setting: float | None, router: Any = None) -> CostWeight:
    """:func:`resolve_cost_weight` for ``request`` under ``router`` (its card's operating λ, when it is
    a learned router) and the operator's ``setting`` (None: unset)."""
    artifact = getattr(router, "artifact", None)
    return resolve_cost_weight(
        request.cost_weight, request.tenant_cost_weight, setting, getattr(artifact, "card", None)
    )


class LearnedRouter:
    name = "learned"

    def __init__(
        self,
        artifact: RouterArtifact,
        features: Any,  # a FeatureBuilder: transform(texts, turns) -> [n, d]
        default_cost_weight: float | None = None,
        exploration: float = 0.0,
        min_examples: int = 50,
        seed: int | None = None,
        prior_strength: float = PRIOR_STRENGTH,
        catalog: Mapping[str, Worker] | None = None,
    ) -> None:
        """``catalog``: the catalog's workers by name, so a ``profile_like`` naming a worker the model
        has no column for (every catalog worker, under the shipped prior) starts from that worker's
        own prior rather than being ignored (a catalog reload puts a copy over the new one in force:
        :meth:`with_catalog`, so a router's catalog does not change under a routing call).
        ``default_cost_weight``: the operator's λ (POLYROUTE_COST_WEIGHT); None when unset, so the
        card's operating λ, else 0.5, applies (:func:`resolve_cost_weight`)."""
        if not 0 <= exploration <= 0.5:
            raise ValueError("exploration must be between 0 and 0.5")
        self.artifact = artifact
        self.features = features
        self.default_cost_weight = default_cost_weight
        self.exploration = exploration
        self.min_examples = min_examples
        self.prior_strength = prior_strength
        self._rng = random.Random(seed)
        self.catalog = dict(catalog or {})
        self._column = {name: i for i, name in enumerate(artifact.workers)}
        self._tier_columns: dict[str, list[str]] = {}
        for name, tier in (artifact.card.get("public_tiers") or {}).items():
            if tier and name in self._column:
                self._tier_columns.setdefault(tier, []).append(name)
        # the part of a query the model was trained on (a card without the rule: the whole query)
        self.text_rule = text_rule_of(artifact.features or {})
        self._planner_of: Any = None
        self._planner: Any = None

    @property
    def version(self) -> str:
        return self.artifact.version

    def with_catalog(self, catalog: Mapping[str, Worker]) -> LearnedRouter:
        """This router over another catalog: the same model, features, exploration stream and planner.
        A catalog reload (gateway/router_state.py) puts such a copy in force rather than changing the
        router in force, which requests in flight hold and route with from threads: each keeps the
        catalog it started with."""
        router = copy.copy(self)
        router.catalog = dict(catalog)
        return router

    @property
    def planner(self) -> Any:
        """The artifact's answer-aware planner (router/planner.py), or None when none was trained; told
        which workers the model knows, so that it prices calls on the fast router's scale."""
        cascade = getattr(self.artifact, "cascade", None)
        if cascade is not self._planner_of:  # once per planner (a copy: the artifact's stays as trained)
            self._planner, self._planner_of = self._known_planner(cascade), cascade
        return self._planner

    def _known_planner(self, cascade: Any) -> Any:
        if cascade is None or not dataclasses.is_dataclass(cascade):
            return cascade
        if "known" not in {f.name for f in dataclasses.fields(cascade)}:
            return cascade
        return dataclasses.replace(cascade, known=frozenset(self._column))

    def cost_weight(self, request: RouteRequest | None = None) -> CostWeight:
        """The λ in force for ``request`` (None: a request that sets none) and where it came from."""
        return cost_weight_of(request or RouteRequest(0), self.default_cost_weight, self)

    def warnings(self, code_exec: bool) -> list[str]:
        """What makes this gateway decide otherwise than the model was validated, for the log at load
        and GET /admin/router: a plan trained comparing code answers by behaviour (running them) served
        with code execution off, where they are compared by canonical source."""
        cascade = self.artifact.card.get("cascade") or {}
        questions = cascade.get("code_questions", 0)
        if self.planner is None or code_exec or cascade.get("code_answers") != "behaviour" or not questions:
            return []
        return [
            f"the plan was trained comparing code answers by behaviour (running them; {questions} code "
            "questions) and POLYROUTE_PLAN_CODE_EXEC is off, so live they are compared by canonical "
            "source: code answers agree less often and the plan calls its fallback more than `router "
            'eval` measured (docs/router.md, "Code answers")'
        ]

    def _features(self, text: str, turns: int) -> np.ndarray:
        """The model's features of the query ``text`` (the last user message), read under the card's
        text rule (its last paragraph for a model trained on few-shot RouterBench prompts)."""
        return self.features.transform([query_text(text, self.text_rule)], [turns])

    def predict_quality(self, text: str, turns: int = 1) -> dict[str, float]:
        """P(success) per known worker for the query ``text`` (the last user message)."""
        return self._quality_of(self._features(text, turns))

    def _quality_of(self, x: np.ndarray) -> dict[str, float]:
        row = np.asarray(self.artifact.model.predict(x))[0]
        return {name: float(row[i]) for name, i in self._column.items()}

    def _output_tokens(self, x: np.ndarray) -> dict[str, float]:
        """Completion tokens each worker is expected to write for this query: the artifact's per-query
        model of its recorded answers' lengths, else their median; a worker without recorded answers
        is absent (the default length applies)."""
        medians = self.artifact.output_tokens
        model = getattr(self.artifact, "output_model", None)
        columns = (self.artifact.card.get("output_tokens") or {}).get("columns") or []
        if model is None or not medians or not columns:
            return dict(medians)
        row = dict(zip(columns, (float(t) for t in np.asarray(model.predict(x))[0]), strict=True))
        return {name: row.get(name, tokens) for name, tokens in medians.items()}

    def _quality(
        self, worker: Worker, predicted: dict[str, float], catalog: Mapping[str, Worker] | None = None
    ) -> tuple[float, bool]:
        """(quality estimate, whether the model has seen the worker); ``catalog``: where a
        ``profile_like`` is looked up (default: this router's).

        A worker whose catalog entry names `profile_like` starts from that worker's prediction for
        this very query (so a new code model inherits a code model's strengths, not an average), and
        blends towards its own model as its labelled examples n grow: weight n / (n + prior_strength).
        A profile the model has no column for either lends its own prior (its tier's).
        """
        like = self._profile(worker, predicted, self.catalog if catalog is None else catalog)
        if worker.name not in predicted:
            return (like if like is not None else self._prior(worker, predicted)), False
        if like is None:
            return predicted[worker.name], True
        n = self.artifact.observed.get(worker.name, 0)
        weight = n / (n + self.prior_strength) if n + self.prior_strength > 0 else 1.0
        return weight * predicted[worker.name] + (1.0 - weight) * like, True

    def _profile(
        self, worker: Worker, predicted: dict[str, float], catalog: Mapping[str, Worker]
    ) -> float | None:
        """The estimate ``worker.profile_like`` lends: its prediction, else (a worker of ``catalog`` the
        model has no column for) its own prior; None without a usable profile."""
        name = worker.profile_like
        if not name:
            return None
        if name in predicted:
            return predicted[name]
        target = catalog.get(name)
        return None if target is None else self._prior(target, predicted)

    def _prior(self, worker: Worker, known: dict[str, float]) -> float:
        """An unseen worker without a profile; calibration, exploration and feedback are how it earns
        an estimate of its own:

        * a base model (a local worker with ``instruct: false``): the worst known worker's prediction for
          this query, since none of the public models, all instruction-tuned, is like it; pessimistic,
          so a free base model does not win on price alone;
        * else, when the card names public models of its tier (the shipped prior, ``card["public_tiers"]``),
          their mean prediction for this query: a typical model of its kind. Their minimum was tried
          and dropped: columns fitted on different datasets differ in scale, so the weakest is often
          a dataset's artefact (an open-moe "worst" of 0.13 beside a frontier mean of 0.75);
        * else its tier's mean quality if training saw that tier, else the worst known worker's
          prediction (pessimistic, as for a base model).
        """
        rule = self._prior_rule(worker)
        if rule == "public tier":
            return float(np.mean([known[name] for name in self._tier_columns[worker.tier.value]]))
        if rule == "tier mean":
            return self.artifact.tier_prior[worker.tier.value]
        return min(known.values()) if known else 0.5

    def _prior_rule(self, worker: Worker) -> str:
        """Which of :meth:`_prior`'s rules applies to ``worker``: "base model", "public tier", "tier
        mean" or "worst known" (one decision for the estimate and for what /admin/router says of it)."""
        if worker.local is not None and not worker.local.instruct:
            return "base model"
        if self._tier_columns.get(worker.tier.value):
            return "public tier"
        if worker.tier.value in self.artifact.tier_prior:
            return "tier mean"
        return "worst known"

    def basis(self, worker: Worker, catalog: Mapping[str, Worker] | None = None) -> dict:
        """What this router's estimate for ``worker`` rests on, for the model card and /admin/router:
        ``calibrated`` (its own labels: probes or training data), ``profile_like`` or ``prior`` (its tier).
        ``catalog``: the workers by name ``worker`` was read from (default: this router's)."""
        catalog = self.catalog if catalog is None else catalog
        if worker.name in self._column:
            onboarded = (self.artifact.card.get("onboarding") or {}).get(worker.name)
            return {
                "basis": "calibrated",
                "labels": int(self.artifact.observed.get(worker.name, 0)),
                "from": "calibration probes" if onboarded else "training data",
            }
        like = worker.profile_like
        if like and like in self._column:
            return {"basis": "profile_like", "like": like, "from": f"{like}'s prediction for each query"}
        if like and like in catalog:
            return {
                "basis": "profile_like",
                "like": like,
                "from": f"{like}'s prior: {self._prior_source(catalog[like])}",
            }
        return {"basis": "prior", "tier": worker.tier.value, "from": self._prior_source(worker)}

    def _prior_source(self, worker: Worker) -> str:
        """What :meth:`_prior` rests on for ``worker``, in words."""
        rule = self._prior_rule(worker)
        if rule == "public tier":
            tiers = self._tier_columns[worker.tier.value]
            return f"the mean of {len(tiers)} public {worker.tier.value} models for each query"
        if rule == "tier mean":
            return "the tier's mean quality"
        worst = "the worst known worker's quality for each query"
        return f"{worst} (a base model)" if rule == "base model" else worst

    def estimates(self, request: RouteRequest, pool: list[Worker]) -> list[Estimate]:
        """Per pool worker: predicted quality and cost (the catalog's prices at the prompt's tokens and
        the completion tokens the worker is expected to write, capped by the request's max_tokens)."""
        catalog = self.catalog  # read once: the whole call uses one catalog
        x = self._features(request.text, request.turns)
        quality = self._quality_of(x)
        tokens = self._output_tokens(x)
        prompt_tokens, _ = estimate_tokens(request.prompt_chars, request.max_output_tokens)
        out: list[Estimate] = []
        for worker in pool:
            expected = tokens.get(worker.name)
            if expected is None:  # no recorded answers of this worker: the default completion length
                expected = estimate_tokens(0, None)[1]
            if request.max_output_tokens:
                expected = min(expected, request.max_output_tokens)
            cost = worker.cost_usd(prompt_tokens, int(round(expected)))
            q, known = self._quality(worker, quality, catalog)
            out.append(Estimate(worker.name, q, cost, worker.active_params_b, known))
        return out

    def route(self, request: RouteRequest, pool: tuple[Worker, ...]) -> RouteDecision:
        """One worker (first) and the fallback order, all from ``pool``."""
        if not pool:
            raise ValueError("the admissible pool is empty; the gateway must not call the router")
        candidates, tools_only = tool_capable(request, pool)
        by_name = {w.name: w for w in candidates}
        weight = self.cost_weight(request)
        choice = choose(
            self.estimates(request, candidates),
            weight.value,
            request.min_quality,
            request.prefer_fewer_active_params,
        )
        ranked = [by_name[e.worker] for e in choice.ranked]
        strategy, reason = "fast", choice.reason
        greedy = ranked[0].name
        under = [w for w in ranked if self.artifact.observed.get(w.name, 0) < self.min_examples]
        if self.exploration and self._rng.random() < self.exploration:
            if under:
                pick = self._rng.choice(under)
                ranked = [pick, *(w for w in ranked if w is not pick)]
                strategy = "explore"
                reason = f"exploration: {pick.name} has fewer than {self.min_examples} labelled examples"
        if tools_only:
            reason += ", tool-capable"
        if strategy == "fast" and request.min_quality is None:  # λ decided: which, and whose it is
            reason += f"; {weight.described}"
        top = next(e for e in choice.ranked if e.worker == ranked[0].name)
        explore = tuple(w.name for w in under) if self.exploration else ()
        drawn = Propensity.of_choice(ranked[0].name, greedy, self.exploration, explore)
        return RouteDecision(tuple(ranked), strategy, reason, Decimal(top.cost_usd), drawn)
