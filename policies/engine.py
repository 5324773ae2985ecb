"""The policy engine: (request, tenant, catalog) → the admissible pool, and why each other worker is not.

An engine is built once per policy version (rules compiled, jurisdiction groups expanded,
detectors chosen) and is immutable afterwards: a request takes one engine and uses it for its
whole decision, so a reload can never mix two versions inside one request.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal

from policies.admission import (
    BUDGET_DAILY,
    BUDGET_MONTHLY,
    UNAVAILABLE,
    Admission,
    Exclusion,
    unavailable_reason,
)
from policies.catalog import Catalog, Kind, Worker
from policies.cost import predicted_cost
from policies.detect import Detector, RegexDetector, builtin_detectors, decoded_views, scan
from policies.schema import AUTO_MODEL, WORKFLOW_PREFIX, Policy, Rule, Tenant


class PolicyRequestError(ValueError):
    """The request itself is at fault (e.g. an unknown data-class tag): a 400, not a policy failure."""


@dataclass(frozen=True, slots=True)
class Spend:
    """What the tenant has spent so far in the current day and month (UTC), in USD."""

    daily_usd: Decimal = Decimal(0)
    monthly_usd: Decimal = Decimal(0)


def _names(model: str, models) -> bool:
    """Whether a rule scoped to ``models`` covers a request for ``model``. A workflow request
    (`compose:<name>`) draws from auto's pool: rules scoped to `auto` cover it, and so do rules
    scoped to that workflow by name."""
    return model in models or (model.startswith(WORKFLOW_PREFIX) and AUTO_MODEL in models)


@dataclass(frozen=True, slots=True)
class PolicyRequest:
    tenant: str
    model: str = "auto"
    texts: tuple[str, ...] = ()
    data_class: str | None = None  # the request's own tag (metadata.data_class or a header)
    prompt_chars: int = 0
    max_output_tokens: int | None = None
    spend: Spend = field(default_factory=Spend)


@dataclass(frozen=True, slots=True)
class Classification:
    data_class: str
    reasons: tuple[str, ...]  # e.g. "tenant default: internal", "detected email → pii"


Check = Callable[[Worker, Decimal], "str | None"]


def _expand(codes: tuple[str, ...] | None, groups: Mapping[str, tuple[str, ...]]) -> frozenset[str] | None:
    if codes is None:
        return None
    out: set[str] = set()
    for code in codes:
        out.add(code.upper())
        out.update(c.upper() for c in groups.get(code.upper(), ()))
    return frozenset(out)


def _lower(values: tuple[str, ...]) -> frozenset[str]:
    return frozenset(v.lower() for v in values)


def _checks(rule: Rule, groups: Mapping[str, tuple[str, ...]]) -> tuple[Check, ...]:
    """One small check per constraint the rule sets, so a rule costs only what it asks for.

    This is the one place a rule's meaning lives; each check returns why a worker breaks it, or None.
    """
    checks: list[Check] = []
    allow_j, deny_j = _expand(rule.allow_jurisdictions, groups), _expand(rule.deny_jurisdictions, groups)
    if allow_j is not None or deny_j:
        shown = sorted(rule.allow_jurisdictions or ())

        def jurisdiction(w: Worker, _: Decimal) -> str | None:
            where = (w.jurisdiction or "").upper()
            if not where:
                return "jurisdiction unknown, and this rule restricts jurisdiction"
            if deny_j and where in deny_j:
                return f"jurisdiction {w.jurisdiction} is denied"
            if allow_j is not None and where not in allow_j:
                return f"jurisdiction {w.jurisdiction} is not among {shown}"
            return None

        checks.append(jurisdiction)

    def member(attr: str, label: str, allow: tuple[str, ...] | None, deny: tuple[str, ...]) -> None:
        allowed, denied, shown = (
            (_lower(allow) if allow is not None else None),
            _lower(deny),
            sorted(allow or ()),
        )
        if allowed is None and not denied:
            return

        def check(w: Worker, _: Decimal) -> str | None:
            value = getattr(w, attr)
            if value.lower() in denied:
                return f"{label} {value} is denied"
            if allowed is not None and value.lower() not in allowed:
                return f"{label} {value} is not among {shown}"
            return None

        checks.append(check)

    member("provider", "provider", rule.allow_providers, rule.deny_providers)
    member("license", "license", rule.allow_licenses, rule.deny_licenses)
    if rule.allow_tiers is not None:
        tiers, shown_tiers = frozenset(rule.allow_tiers), [t.value for t in rule.allow_tiers]
        checks.append(
            lambda w, _: None if w.tier in tiers else f"tier {w.tier.value} is not among {shown_tiers}"
        )
    if (cap := rule.max_active_params_b) is not None:

        def active(w: Worker, _: Decimal) -> str | None:
            if w.active_params_b is None:
                return f"active parameters unknown, and this rule caps them at {cap:g}B"
            if w.active_params_b > cap:
                return f"{w.active_params_b:g}B active parameters > cap {cap:g}B"
            return None

        checks.append(active)
    if (prices := rule.max_output_price_per_m) is not None:

        def output_price(w: Worker, _: Decimal) -> str | None:
            limit = prices.get(w.tier)
            if limit is not None and w.output_price_per_m > limit:
                return (
                    f"output price ${w.output_price_per_m}/1M > ${limit}/1M allowed for tier {w.tier.value}"
                )
            return None

        checks.append(output_price)
    return tuple(checks)


@dataclass(frozen=True)
class CompiledRule:
    rule: Rule
    checks: tuple[Check, ...]  # everything but the cost ceiling: depends on the worker alone
    allow_jurisdictions: frozenset[str] | None

    @classmethod
    def compile(cls, rule: Rule, groups: Mapping[str, tuple[str, ...]]) -> CompiledRule:
        return cls(rule, _checks(rule, groups), _expand(rule.allow_jurisdictions, groups))

    def static_violation(self, worker: Worker) -> str | None:
        for check in self.checks:
            reason = check(worker, Decimal(0))
            if reason is not None:
                return reason
        return None

    def cost_violation(self, cost: Decimal) -> str | None:
        ceiling = self.rule.max_request_cost_usd
        if ceiling is not None and cost > ceiling:
            return f"predicted cost ${cost:.6f} > ceiling ${ceiling}"
        return None

    def applies(self, tenant: str, model: str, data_class: str) -> bool:
        when = self.rule.when
        return (
            (not when.tenants or tenant in when.tenants)
            and (not when.models or _names(model, when.models))
            and (not when.data_classes or data_class in when.data_classes)
        )

    def violation(self, worker: Worker, cost: Decimal) -> str | None:
        """Why this worker breaks the rule, or None if it complies."""
        return self.static_violation(worker) or self.cost_violation(cost)


def budget_violation(tenant: Tenant | None, spend: Spend, cost: Decimal) -> tuple[str, str] | None:
    if tenant is None or cost == 0:
        return None
    budget = tenant.budget
    if budget.daily_usd is not None and spend.daily_usd + cost > budget.daily_usd:
        left = max(Decimal(0), budget.daily_usd - spend.daily_usd)
        return BUDGET_DAILY, f"predicted cost ${cost:.6f} > ${left:.6f} left of the daily budget"
    if budget.monthly_usd is not None and spend.monthly_usd + cost > budget.monthly_usd:
        left = max(Decimal(0), budget.monthly_usd - spend.monthly_usd)
        return BUDGET_MONTHLY, f"predicted cost ${cost:.6f} > ${left:.6f} left of the monthly budget"
    return None


class PolicyEngine:
    def __init__(self, policy: Policy, version: str) -> None:
        self.policy = policy
        self.version = version
        self.rules = tuple(CompiledRule.compile(r, policy.groups()) for r in policy.rules)
        detection = policy.detection
        detectors: list[Detector] = []
        if detection.enabled:
            detectors = builtin_detectors([k for k in detection.kinds if k not in detection.custom])
            detectors += [RegexDetector(kind, pattern) for kind, pattern in detection.custom.items()]
        self.detectors = tuple(detectors)
        self._kind_class = {**detection.kinds}
        self._strictest = policy.data_classes[-1]
        self._static: tuple[Catalog, list[dict[str, str | None]]] | None = None

    def _static_table(self, catalog: Catalog) -> list[dict[str, str | None]]:
        """Per rule, per worker: the rule's verdict on everything but cost (cached per catalog)."""
        cached = self._static
        if cached is not None and cached[0] is catalog:
            return cached[1]
        table = [{w.name: rule.static_violation(w) for w in catalog.workers} for rule in self.rules]
        self._static = (catalog, table)
        return table

    # ---- classification -------------------------------------------------------------------
    def classify(self, request: PolicyRequest) -> Classification:
        policy = self.policy
        tenant = policy.tenants.get(request.tenant)
        found: list[tuple[str, str]] = [(policy.default_data_class, f"default: {policy.default_data_class}")]
        if tenant and tenant.data_class:
            found.append((tenant.data_class, f"tenant {request.tenant}: {tenant.data_class}"))
        if request.data_class is not None:
            if request.data_class not in policy.data_classes:
                raise PolicyRequestError(
                    f"unknown data class {request.data_class!r}; this policy knows {list(policy.data_classes)}"
                )
            found.append((request.data_class, f"tagged: {request.data_class}"))
        current = max((c for c, _ in found), key=policy.strictness)
        if self.detectors and current != self._strictest:
            # One text, one pass per detector: a request's payload is many small strings (keys,
            # roles, tool schemas), and scanning each alone would cost a call per string and
            # detector. A newline between them keeps a shape from spanning two fields. Escaped
            # text (JSON unicode escapes in tool-call arguments, %40 in a URL) is scanned decoded too.
            texts = [*request.texts, *(view for text in request.texts for view in decoded_views(text))]
            for finding in scan(("\n".join(texts),), self.detectors):
                data_class = self._kind_class.get(finding.kind)
                if data_class is not None:
                    found.append((data_class, f"detected {finding.kind}: {data_class}"))
        strictest = max((c for c, _ in found), key=policy.strictness)
        reasons = tuple(reason for c, reason in found if c == strictest)
        return Classification(strictest, reasons)

    # ---- admission ------------------------------------------------------------------------
    def applicable(self, request: PolicyRequest, data_class: str) -> tuple[CompiledRule, ...]:
        return tuple(r for r in self.rules if r.applies(request.tenant, request.model, data_class))

    def evaluate(
        self,
        request: PolicyRequest,
        catalog: Catalog,
        down: Mapping[str, str] | None = None,
        env: Mapping[str, str] = os.environ,
        assume_available: bool = False,
        kind: Kind = Kind.chat,
    ) -> Admission:
        """The pool among the catalog's workers of `kind`: chat unless asked, so an embedding worker
        never enters a chat pool (nor a chat worker an embeddings one).

        `assume_available` (a dry run, before keys are bought): every worker is taken as callable,
        so each one is judged by the rules alone."""
        classification = self.classify(request)
        table = self._static_table(catalog)
        tenant_, model, data_class = request.tenant, request.model, classification.data_class
        verdicts = [(r, table[i]) for i, r in enumerate(self.rules) if r.applies(tenant_, model, data_class)]
        rules = [r for r, _ in verdicts]
        has_budget = tenant_ in self.policy.tenants and (
            self.policy.tenants[tenant_].budget.daily_usd is not None
            or self.policy.tenants[tenant_].budget.monthly_usd is not None
        )
        needs_cost = has_budget or any(r.rule.max_request_cost_usd is not None for r in rules)
        tenant = self.policy.tenants.get(request.tenant)
        down = down or {}
        pool: list[Worker] = []
        excluded: list[Exclusion] = []
        for worker in catalog.of_kind(kind):
            unavailable = None if assume_available else unavailable_reason(worker, down, env)
            if unavailable:
                excluded.append(Exclusion(worker.name, UNAVAILABLE, unavailable))
                continue
            # Money is Decimal and costs ~2 µs per worker: only computed where a ceiling or budget asks.
            cost = (
                predicted_cost(worker, request.prompt_chars, request.max_output_tokens)
                if needs_cost
                else None
            )
            exclusion = None
            for rule, static in verdicts:
                reason = static[worker.name] or (cost is not None and rule.cost_violation(cost)) or None
                if reason is not None:
                    exclusion = Exclusion(worker.name, rule.rule.id, reason)
                    break
            if (
                exclusion is None
                and cost is not None
                and (over := budget_violation(tenant, request.spend, cost))
            ):
                exclusion = Exclusion(worker.name, *over)
            if exclusion is None:
                pool.append(worker)
            else:
                excluded.append(exclusion)
        return Admission(
            pool=tuple(pool),
            excluded=tuple(excluded),
            policy_version=self.version,
            data_class=classification.data_class,
            data_class_reasons=classification.reasons,
            rules_applied=tuple(r.rule.id for r in rules),
            prefer_fewer_active_params=self.policy.preferences.prefer_fewer_active_params,
            max_request_cost_usd=min(
                (r.rule.max_request_cost_usd for r in rules if r.rule.max_request_cost_usd is not None),
                default=None,
            ),
        )
