"""Which workers a request may reach, and why each other worker may not.

The gateway calls `admit` once per request; fallback and retries draw only from the pool it
returns (DESIGN.md: a policy decision is never undone downstream). This first version excludes
only what cannot be called at all: a worker without its key, a local worker that is not running.
The operator's policy rules (sovereignty, cost, parameters, licenses) add exclusions here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal

from policies.catalog import Catalog, Kind, Worker

EMBEDDED_POLICY_VERSION = "embedded-0"
# The exclusions the gateway names itself (not an operator's rule ids, which may not take them:
# policies/schema.py): a worker that cannot be called, and a tenant's budget (policies/engine.py).
UNAVAILABLE = "unavailable"
BUDGET_RULE_PREFIX = "budget:"
BUDGET_DAILY = BUDGET_RULE_PREFIX + "daily"
BUDGET_MONTHLY = BUDGET_RULE_PREFIX + "monthly"
BUDGET_RULES = frozenset({BUDGET_DAILY, BUDGET_MONTHLY})


@dataclass(frozen=True, slots=True)
class Exclusion:
    worker: str
    rule: str  # machine-readable: "unavailable", later the policy rule's id
    reason: str  # for people: shown in errors and in explain output


@dataclass(frozen=True, slots=True)
class Admission:
    pool: tuple[Worker, ...]
    excluded: tuple[Exclusion, ...]
    policy_version: str = EMBEDDED_POLICY_VERSION
    data_class: str = "public"
    data_class_reasons: tuple[str, ...] = ()
    rules_applied: tuple[str, ...] = ()
    prefer_fewer_active_params: float = 0.0
    # the tightest max_request_cost_usd of the rules applied: a workflow's whole request stays under it
    max_request_cost_usd: Decimal | None = None

    def exclusion_for(self, name: str) -> Exclusion | None:
        return next((e for e in self.excluded if e.worker == name), None)

    def admits(self, name: str) -> bool:
        return any(w.name == name for w in self.pool)

    @property
    def denied_by_policy(self) -> tuple[Exclusion, ...]:
        """Exclusions made by a rule (as opposed to a worker that cannot be called at all)."""
        return tuple(e for e in self.excluded if e.rule != UNAVAILABLE)

    def explain(self) -> dict:
        return {
            "policy_version": self.policy_version,
            "data_class": self.data_class,
            "data_class_reasons": list(self.data_class_reasons),
            "rules_applied": list(self.rules_applied),
            "pool": [w.name for w in self.pool],
            "excluded": [{"worker": e.worker, "rule": e.rule, "reason": e.reason} for e in self.excluded],
        }


def unavailable_reason(worker: Worker, down: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """Why a worker cannot be called at all right now (no key, local server not up), or None."""
    return worker.availability(env) or down.get(worker.name)


def admit(
    catalog: Catalog,
    down: Mapping[str, str] | None = None,
    env: Mapping[str, str] = os.environ,
    kind: Kind = Kind.chat,
) -> Admission:
    """Split the catalog's workers of `kind` (chat unless asked) into the admissible pool and the
    excluded workers with their reasons.

    `down` maps worker names to why they cannot serve right now (a local server still starting).
    """
    down = down or {}
    pool: list[Worker] = []
    excluded: list[Exclusion] = []
    for worker in catalog.of_kind(kind):
        reason = unavailable_reason(worker, down, env)
        if reason:
            excluded.append(Exclusion(worker.name, UNAVAILABLE, reason))
        else:
            pool.append(worker)
    return Admission(tuple(pool), tuple(excluded))
