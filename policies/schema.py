"""The policy file: which workers a request may reach, decided by the operator in YAML.

Validated by pydantic on every load; an invalid file is refused whole, with every problem named,
and the last good policy stays in force. Rules are a flat list, each optionally scoped (`when`) to
tenants, model aliases and data classes; a worker is admissible when no rule in scope excludes it.
"""

from __future__ import annotations

import hashlib
import re
from decimal import Decimal
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from policies.admission import BUDGET_RULE_PREFIX, UNAVAILABLE
from policies.catalog import Tier
from policies.detect import BUILTIN_KINDS
from policies.yamlfile import PlacedProblems, parse_yaml_model

Money = Annotated[Decimal, Field(ge=0, max_digits=14, decimal_places=8)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$")]
RESERVED_RULE_PREFIX = BUDGET_RULE_PREFIX  # the engine's budget exclusions: budget:daily, budget:monthly
AUTO_MODEL = "auto"  # the router's choice: not an alias name
WORKFLOW_PREFIX = "compose:"  # `compose:<workflow>` names a workflow (router/compose): not an alias name

# ISO 3166 codes of the EU member states: `EU` in a jurisdiction list means any of them.
EU_MEMBERS = (
    "AT",
    "BE",
    "BG",
    "HR",
    "CY",
    "CZ",
    "DK",
    "EE",
    "FI",
    "FR",
    "DE",
    "GR",
    "HU",
    "IE",
    "IT",
    "LV",
    "LT",
    "LU",
    "MT",
    "NL",
    "PL",
    "PT",
    "RO",
    "SK",
    "SI",
    "ES",
    "SE",
)
DEFAULT_GROUPS = {"EU": EU_MEMBERS, "EEA": (*EU_MEMBERS, "IS", "LI", "NO")}
# Every ISO 3166-1 alpha-2 code (from tzdata's iso3166.tab, public domain), plus `local` (this
# machine): what a jurisdiction list may name besides a group, so a typo such as `Mars` is refused.
ISO_COUNTRIES = frozenset(
    """
    AD AE AF AG AI AL AM AO AQ AR AS AT AU AW AX AZ BA BB BD BE BF BG BH BI BJ BL BM BN BO BQ BR
    BS BT BV BW BY BZ CA CC CD CF CG CH CI CK CL CM CN CO CR CU CV CW CX CY CZ DE DJ DK DM DO DZ
    EC EE EG EH ER ES ET FI FJ FK FM FO FR GA GB GD GE GF GG GH GI GL GM GN GP GQ GR GS GT GU GW
    GY HK HM HN HR HT HU ID IE IL IM IN IO IQ IR IS IT JE JM JO JP KE KG KH KI KM KN KP KR KW KY
    KZ LA LB LC LI LK LR LS LT LU LV LY MA MC MD ME MF MG MH MK ML MM MN MO MP MQ MR MS MT MU MV
    MW MX MY MZ NA NC NE NF NG NI NL NO NP NR NU NZ OM PA PE PF PG PH PK PL PM PN PR PS PT PW PY
    QA RE RO RS RU RW SA SB SC SD SE SG SH SI SJ SK SL SM SN SO SR SS ST SV SX SY SZ TC TD TF TG
    TH TJ TK TL TM TN TO TR TT TV TW TZ UA UG UM US UY UZ VA VC VE VG VI VN VU WF WS YE YT ZA ZM
    ZW
    """.split()
)
SPECIAL_JURISDICTIONS = frozenset({"LOCAL"})


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Scope(Strict):
    """Where a rule applies; an empty list means 'any'."""

    tenants: tuple[str, ...] = ()
    models: tuple[str, ...] = Field((), description="requested model: auto, an alias or a worker name")
    data_classes: tuple[str, ...] = ()


class Rule(Strict):
    """One named constraint. Every constraint set here must hold for a worker to stay admissible."""

    id: Name
    description: str = ""
    when: Scope = Scope()
    allow_jurisdictions: tuple[str, ...] | None = None
    deny_jurisdictions: tuple[str, ...] = ()
    allow_providers: tuple[str, ...] | None = None
    deny_providers: tuple[str, ...] = ()
    allow_licenses: tuple[str, ...] | None = None
    deny_licenses: tuple[str, ...] = ()
    allow_tiers: tuple[Tier, ...] | None = None
    max_active_params_b: float | None = Field(None, gt=0)
    max_request_cost_usd: Money | None = None
    max_output_price_per_m: dict[Tier, Money] | None = Field(
        None, description="per tier: workers whose output price per 1M tokens is above it are excluded"
    )

    @field_validator("id")
    @classmethod
    def _not_reserved(cls, value: str) -> str:
        # the engine names its own exclusions so ("budget:daily", "unavailable"); a rule named alike
        # would read as one of them (the judge, which spends from its own budget, waives those)
        if value.lower().startswith(RESERVED_RULE_PREFIX) or value.lower() == UNAVAILABLE:
            raise ValueError(
                f"rule id {value!r} is reserved: ids starting with {RESERVED_RULE_PREFIX!r} and "
                "'unavailable' name the gateway's own exclusions"
            )
        return value

    @model_validator(mode="after")
    def _constrains_something(self) -> Rule:
        constraints = self.model_dump(exclude={"id", "description", "when"}, exclude_defaults=True)
        if not constraints:
            raise ValueError(f"rule {self.id!r} sets no constraint")
        return self


class Budget(Strict):
    daily_usd: Money | None = None
    monthly_usd: Money | None = None


class RateLimit(Strict):
    """Per-minute limits (GCRA: a burst of the whole minute's allowance, then a steady refill)."""

    rpm: int | None = Field(None, gt=0, description="requests per minute")
    tpm: int | None = Field(None, gt=0, description="tokens per minute (prompt estimate + max output)")


class CacheSettings(Strict):
    """Exact-match response cache; off unless enabled here or asked for by a request's header."""

    enabled: bool = False
    ttl_s: int = Field(300, gt=0, le=30 * 86400)


class JudgeSettings(Strict):
    """Judge-labelled traffic, opt-in per tenant: a judge worker grades a sampled share of this tenant's
    answers after they are sent, and the grades train the router (gateway/judge.py). Only public and
    internal requests are sampled, only when the judge is admissible for the request, and only while
    the judge's own daily spend for this tenant is under `daily_budget_usd` (not the tenant's budget)."""

    worker: Name = Field(description="the catalog worker that grades")
    sample: float = Field(0.05, gt=0, le=1, allow_inf_nan=False, description="share of answers graded")
    daily_budget_usd: Money = Field(description="what grading this tenant's traffic may cost per UTC day")


class Tenant(Strict):
    data_class: str | None = Field(None, description="the class of every request of this tenant, at least")
    budget: Budget = Budget()
    rate_limit: RateLimit = RateLimit()
    cache: CacheSettings = CacheSettings()
    cost_weight: float | None = Field(
        None,
        ge=0,
        le=100,
        allow_inf_nan=False,
        description="this tenant's default λ for the learned router (quality − λ·cost), 0 to 100 as per request",
    )
    judge: JudgeSettings | None = Field(None, description="judge-labelled traffic (off unless set)")


class Detection(Strict):
    """Which detector kinds mark a request as which data class (the strictest found wins)."""

    enabled: bool = True
    kinds: dict[str, str] = Field(
        default_factory=lambda: {
            "email": "pii",
            "phone": "pii",
            "iban": "pii",
            "credit_card": "pii",
            "national_id": "pii",
            "api_secret": "secret",
        }
    )
    custom: dict[str, str] = Field(default_factory=dict, description="kind -> regex, for your own patterns")


class Preferences(Strict):
    prefer_fewer_active_params: float = Field(
        0.0, ge=0, le=1, description="0: ignore; 1: active parameters weigh as much as cost in ranking"
    )


class EmbeddingAlias(Strict):
    """An alias that names one embedding worker: vector spaces differ, so an embeddings alias is a
    fixed worker, not a pool (written in `aliases` as `{worker: ..., description: ...}`)."""

    worker: Name = Field(description="the embedding worker of the catalog this alias sends requests to")
    description: str = ""


class Policy(Strict):
    version: str | int = Field(description="the operator's label; the effective version adds a content hash")
    data_classes: tuple[str, ...] = Field(
        ("public", "internal", "pii", "secret"), min_length=1, description="least strict first"
    )
    default_data_class: str = "public"
    jurisdiction_groups: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="your own groups, added to the built-in EU and EEA"
    )

    def groups(self) -> dict[str, tuple[str, ...]]:
        return {**DEFAULT_GROUPS, **{k.upper(): v for k, v in self.jurisdiction_groups.items()}}

    detection: Detection = Detection()
    tenants: dict[str, Tenant] = Field(default_factory=dict)
    aliases: dict[Name, str] = Field(
        default_factory=dict, description="alias -> description: auto, narrowed by the rules scoped to it"
    )
    embedding_aliases: dict[Name, EmbeddingAlias] = Field(
        default_factory=dict,
        description="alias -> one embedding worker (/v1/embeddings); the entries of `aliases` written as "
        "{worker: ..., description: ...} land here",
    )
    rules: tuple[Rule, ...] = ()
    preferences: Preferences = Preferences()

    @model_validator(mode="before")
    @classmethod
    def _split_aliases(cls, data: object) -> object:
        """`aliases` entries that name a worker ({worker: ...}) are embedding aliases: chat requests
        never see them (a chat alias is auto narrowed by rules, an embeddings alias one fixed worker)."""
        if not isinstance(data, dict) or not isinstance(data.get("aliases"), dict):
            return data
        named = {k: v for k, v in data["aliases"].items() if isinstance(v, dict)}
        if not named:
            return data
        embedding = data.get("embedding_aliases")
        embedding = dict(embedding) if isinstance(embedding, dict) else {}
        twice = sorted(set(named) & set(embedding))
        if twice:
            raise ValueError(f"aliases {twice} are set both in aliases and in embedding_aliases")
        chat = {k: v for k, v in data["aliases"].items() if k not in named}
        return {**data, "aliases": chat, "embedding_aliases": {**embedding, **named}}

    @field_validator("data_classes")
    @classmethod
    def _distinct(cls, classes: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(classes)) != len(classes):
            raise ValueError("data_classes must be distinct")
        return classes

    @model_validator(mode="after")
    def _references_exist(self) -> Policy:
        """Checks that span fields; each problem is reported at its own place (PlacedProblems)."""
        known = set(self.data_classes)
        problems: list[tuple] = []  # (where, message[, places the message names]): PlacedProblems
        if self.default_data_class not in known:
            problems.append((("default_data_class",), f"{self.default_data_class!r} is not in data_classes"))
        for kind, data_class in self.detection.kinds.items():
            if data_class not in known:
                problems.append((("detection", "kinds", kind), f"unknown data class {data_class!r}"))
            if kind not in BUILTIN_KINDS and kind not in self.detection.custom:
                problems.append(
                    (
                        ("detection", "kinds", kind),
                        f"no such detector (built-in: {', '.join(BUILTIN_KINDS)}; "
                        "or define it under detection.custom)",
                    )
                )
        for kind, pattern in self.detection.custom.items():
            if kind not in self.detection.kinds:
                problems.append(
                    (("detection", "custom", kind), "map it to a data class under detection.kinds")
                )
            try:
                re.compile(pattern)
            except re.error as exc:
                problems.append((("detection", "custom", kind), f"invalid regex: {exc}"))
        for name, tenant in self.tenants.items():
            if tenant.data_class is not None and tenant.data_class not in known:
                problems.append(
                    (("tenants", name, "data_class"), f"unknown data class {tenant.data_class!r}")
                )
        first: dict[str, int] = {}
        for i, rule in enumerate(self.rules):
            if rule.id in first:
                problems.append(
                    (
                        ("rules", i, "id"),
                        f"duplicate rule id {rule.id!r} (first at {{first}})",
                        {"first": ("rules", first[rule.id])},
                    )
                )
            first.setdefault(rule.id, i)
            for data_class in rule.when.data_classes:
                if data_class not in known:
                    problems.append(
                        (("rules", i, "when", "data_classes"), f"unknown data class {data_class!r}")
                    )
        for name in sorted(set(self.aliases) & set(self.embedding_aliases)):
            problems.append((("aliases", name), "is both a chat alias and an embedding alias"))
        problems += self._reserved_alias_names()
        problems += self._unknown_jurisdictions()
        if problems:
            raise PlacedProblems(problems)
        return self

    def _reserved_alias_names(self) -> list[tuple[tuple[str | int, ...], str]]:
        """`auto` and `compose:<workflow>` are model names the gateway answers itself: an alias named
        so would never be reached (or, for an embeddings alias, shadow a refusal)."""
        found = []
        for where, names in (("aliases", self.aliases), ("embedding_aliases", self.embedding_aliases)):
            for name in names:
                if name.lower() == AUTO_MODEL or name.lower().startswith(WORKFLOW_PREFIX):
                    found.append(
                        (
                            (where, name),
                            f"alias name {name!r} is reserved: `{AUTO_MODEL}` and names starting with "
                            f"`{WORKFLOW_PREFIX}` are the gateway's own models",
                        )
                    )
        return found

    def _unknown_jurisdictions(self) -> list[tuple[tuple[str | int, ...], str]]:
        """Jurisdiction codes that are neither ISO 3166-1 countries, nor groups, nor `local`."""
        groups = self.groups()
        valid = ISO_COUNTRIES | SPECIAL_JURISDICTIONS | set(groups)
        found: list[tuple[tuple[str | int, ...], str]] = []
        for name, members in self.jurisdiction_groups.items():
            found += [(("jurisdiction_groups", name), c) for c in members if c.upper() not in ISO_COUNTRIES]
        for i, rule in enumerate(self.rules):
            for field in ("allow_jurisdictions", "deny_jurisdictions"):
                found += [
                    (("rules", i, field), c) for c in getattr(rule, field) or () if c.upper() not in valid
                ]
        if not found:
            return []
        hint = f"valid: ISO 3166-1 alpha-2 country codes (e.g. US, DE, FR), `local`, or a group ({', '.join(sorted(groups))})"
        return [(where, f"unknown jurisdiction {code!r}; {hint}") for where, code in found]

    def strictness(self, data_class: str) -> int:
        return self.data_classes.index(data_class)


class PolicyError(ValueError):
    """The policy file could not be read or is invalid; the message names the file and fields."""


def parse_policy(text: str, source: str = "<string>") -> tuple[Policy, str]:
    """Parse and validate; returns the policy and its effective version (label + content hash)."""
    policy = parse_yaml_model(text, source, Policy, "policy", PolicyError)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]
    return policy, f"{policy.version}+{digest}"
