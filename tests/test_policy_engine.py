"""The policy engine, table-driven over a catalog of nine workers across jurisdictions, licenses,
providers, tiers and sizes; plus a property test against an independent oracle."""

from __future__ import annotations

from decimal import Decimal

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from policies import (
    PolicyEngine,
    PolicyError,
    PolicyRequest,
    PolicyRequestError,
    Spend,
    parse_catalog,
    parse_policy,
    predicted_cost,
)
from policies.schema import EU_MEMBERS

# name, jurisdiction, license, provider, tier, active B, $in, $out
WORKERS = [
    ("eu-small", "FR", "Apache-2.0", "mistral", "specialist", 7, 0.10, 0.30),
    ("eu-moe", "DE", "Apache-2.0", "aleph", "open-moe", 39, 2.00, 6.00),
    ("cn-moe", "CN", "MIT", "deepseek", "open-moe", 37, 0.28, 0.42),
    ("us-frontier", "US", "proprietary", "openai", "frontier", None, 2.00, 8.00),
    ("us-pricey", "US", "proprietary", "anthropic", "frontier", None, 15.00, 75.00),
    ("us-moe", "US", "Apache-2.0", "together", "open-moe", 22, 0.20, 0.60),
    ("local-tiny", "local", "gemma", "local", "local", 0.27, 0.0, 0.0),
    ("nowhere", None, "llama3", "shadyhost", "specialist", 70, 0.90, 0.90),
    ("eu-restricted", "FR", "MNPL-0.1", "mistral", "specialist", 22, 0.30, 0.90),
]
ALL = {w[0] for w in WORKERS}


def catalog_text() -> str:
    entries = []
    for name, where, lic, provider, tier, active, pin, pout in WORKERS:
        entry = {
            "name": name,
            "model": f"openai/{name}",
            "api_base": "http://127.0.0.1:9/v1",
            "input_price_per_m": pin,
            "output_price_per_m": pout,
            "tier": tier,
            "license": lic,
            "provider": provider,
            "context_window": 8192,
        }
        if where:
            entry["jurisdiction"] = where
        if active is not None:
            entry["active_params_b"] = active
        entries.append(entry)
    return yaml.safe_dump({"version": 1, "workers": entries})


CATALOG = parse_catalog(catalog_text())


def engine_for(rules: list[dict], **policy: object) -> PolicyEngine:
    text = yaml.safe_dump({"version": "t1", "rules": rules, **policy})
    return PolicyEngine(*parse_policy(text))


def pool(engine: PolicyEngine, **request: object) -> set[str]:
    request.setdefault("tenant", "default")
    return {w.name for w in engine.evaluate(PolicyRequest(**request), CATALOG, env={}).pool}


# ---- each rule alone ---------------------------------------------------------------------------
SINGLE_RULES = [
    ({"allow_jurisdictions": ["EU"]}, {"eu-small", "eu-moe", "eu-restricted"}),
    ({"allow_jurisdictions": ["EU", "local"]}, {"eu-small", "eu-moe", "eu-restricted", "local-tiny"}),
    ({"allow_jurisdictions": ["US"]}, {"us-frontier", "us-pricey", "us-moe"}),
    ({"deny_jurisdictions": ["CN"]}, ALL - {"cn-moe", "nowhere"}),  # unknown is denied when restricted
    ({"allow_providers": ["mistral", "local"]}, {"eu-small", "eu-restricted", "local-tiny"}),
    ({"deny_providers": ["openai", "anthropic"]}, ALL - {"us-frontier", "us-pricey"}),
    ({"allow_licenses": ["apache-2.0", "MIT"]}, {"eu-small", "eu-moe", "cn-moe", "us-moe"}),
    ({"deny_licenses": ["MNPL-0.1", "llama3"]}, ALL - {"eu-restricted", "nowhere"}),
    ({"allow_tiers": ["local", "specialist"]}, {"eu-small", "local-tiny", "nowhere", "eu-restricted"}),
    ({"max_active_params_b": 13}, {"eu-small", "local-tiny"}),  # unknown size is excluded by a cap
    ({"max_active_params_b": 37}, {"eu-small", "cn-moe", "us-moe", "local-tiny", "eu-restricted"}),
    ({"max_output_price_per_m": {"frontier": 10}}, ALL - {"us-pricey"}),
    ({"max_output_price_per_m": {"open-moe": 1}}, ALL - {"eu-moe"}),
]


@pytest.mark.parametrize(("rule", "expected"), SINGLE_RULES, ids=[str(r[0]) for r in SINGLE_RULES])
def test_each_rule_alone(rule, expected):
    engine = engine_for([{"id": "r", **rule}])
    assert pool(engine, texts=("hello",), prompt_chars=5) == expected


def test_request_cost_ceiling_uses_the_predicted_cost():
    engine = engine_for([{"id": "ceiling", "max_request_cost_usd": "0.01"}])
    # 40,000 chars ≈ 10,000 prompt tokens + 1,000 output tokens
    request = {"prompt_chars": 40_000, "max_output_tokens": 1000}
    expected = {
        w.name for w in CATALOG.workers if predicted_cost(w, 40_000, 1000) <= Decimal("0.01")
    }  # computed here, not by the engine
    assert pool(engine, **request) == expected
    assert "us-pricey" not in expected and "eu-small" in expected and "local-tiny" in expected


def test_exclusions_name_the_rule_and_the_reason():
    engine = engine_for(
        [{"id": "no-cn", "deny_jurisdictions": ["CN"]}, {"id": "small", "max_active_params_b": 30}]
    )
    admission = engine.evaluate(PolicyRequest(tenant="t"), CATALOG, env={})
    by_worker = {e.worker: e for e in admission.excluded}
    assert by_worker["cn-moe"].rule == "no-cn" and "CN is denied" in by_worker["cn-moe"].reason
    assert by_worker["eu-moe"].rule == "small" and "39B" in by_worker["eu-moe"].reason
    assert by_worker["nowhere"].rule == "no-cn" and "unknown" in by_worker["nowhere"].reason
    assert by_worker["us-frontier"].rule == "small" and "unknown" in by_worker["us-frontier"].reason
    assert admission.rules_applied == ("no-cn", "small")


# ---- combinations and scopes -------------------------------------------------------------------
def test_rules_combine_as_an_intersection():
    engine = engine_for(
        [
            {"id": "eu", "allow_jurisdictions": ["EU", "US"]},
            {"id": "open", "deny_licenses": ["proprietary", "MNPL-0.1"]},
            {"id": "small", "max_active_params_b": 30},
        ]
    )
    assert pool(engine) == {"eu-small", "us-moe"}


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        ({"tenant": "acme", "model": "batch"}, {"eu-small", "local-tiny"}),
        ({"tenant": "acme", "model": "auto"}, ALL),
        ({"tenant": "globex", "model": "batch"}, ALL),
    ],
)
def test_rules_scoped_to_tenant_and_alias(request_, expected):
    engine = engine_for(
        [{"id": "acme-batch", "when": {"tenants": ["acme"], "models": ["batch"]}, "max_active_params_b": 13}],
        aliases={"batch": "bulk"},
    )
    assert pool(engine, **request_) == expected


# ---- data classes ------------------------------------------------------------------------------
SOVEREIGN = [
    {
        "id": "pii-eu",
        "when": {"data_classes": ["pii"]},
        "allow_jurisdictions": ["EU", "local"],
        "deny_jurisdictions": ["CN"],
    },
    {"id": "secret-local", "when": {"data_classes": ["secret"]}, "allow_jurisdictions": ["local"]},
]
EU_OR_LOCAL = {"eu-small", "eu-moe", "eu-restricted", "local-tiny"}


@pytest.mark.parametrize(
    ("request_", "data_class", "expected"),
    [
        ({"texts": ("What is the capital of France?",)}, "public", ALL),
        ({"texts": ("Mail the report to jane.doe@example.com",)}, "pii", EU_OR_LOCAL),
        ({"texts": ("My IBAN is DE89 3704 0044 0532 0130 00",)}, "pii", EU_OR_LOCAL),
        ({"texts": ("card 4111 1111 1111 1111 exp 12/27",)}, "pii", EU_OR_LOCAL),
        ({"texts": ("use key sk-proj-abcdefghijklmnopqrstuvwx123456",)}, "secret", {"local-tiny"}),
        ({"texts": ("hello",), "data_class": "pii"}, "pii", EU_OR_LOCAL),
        (
            {"texts": ("call +33 6 12 34 56 78",), "data_class": "public"},
            "pii",
            EU_OR_LOCAL,
        ),  # strictest wins
        ({"tenant": "hospital", "texts": ("hello",)}, "pii", EU_OR_LOCAL),
        ({"tenant": "hospital", "texts": ("token AKIAIOSFODNN7EXAMPLE",)}, "secret", {"local-tiny"}),
        ({"texts": ("Invoice 2024-11-15, total $1,299.99, order #123456789",)}, "public", ALL),
    ],
)
def test_data_class_strictest_wins(request_, data_class, expected):
    engine = engine_for(SOVEREIGN, tenants={"hospital": {"data_class": "pii"}})
    request_ = {"tenant": "default", **request_}
    admission = engine.evaluate(PolicyRequest(**request_), CATALOG, env={})
    assert admission.data_class == data_class
    assert {w.name for w in admission.pool} == expected
    assert admission.data_class_reasons


def test_detection_can_be_turned_off_and_extended():
    off = engine_for(SOVEREIGN, detection={"enabled": False})
    assert off.classify(PolicyRequest("t", texts=("jane@example.com",))).data_class == "public"
    custom = engine_for(
        SOVEREIGN, detection={"kinds": {"employee_id": "pii"}, "custom": {"employee_id": r"\bEMP-\d{6}\b"}}
    )
    assert custom.classify(PolicyRequest("t", texts=("ask EMP-123456",))).data_class == "pii"
    assert custom.classify(PolicyRequest("t", texts=("jane@example.com",))).data_class == "public"


def test_unknown_data_class_tag_is_a_request_error():
    with pytest.raises(PolicyRequestError, match="unknown data class 'top-secret'"):
        engine_for(SOVEREIGN).evaluate(PolicyRequest("t", data_class="top-secret"), CATALOG, env={})


def test_eu_group_expands_to_member_states():
    engine = engine_for([{"id": "eu", "allow_jurisdictions": ["EU"]}])
    compiled = engine.rules[0]
    assert {"FR", "DE", "IE", "EU"} <= compiled.allow_jurisdictions
    assert len(compiled.allow_jurisdictions) == len(EU_MEMBERS) + 1
    assert "GB" not in compiled.allow_jurisdictions and "CH" not in compiled.allow_jurisdictions


# ---- budgets -----------------------------------------------------------------------------------
def test_budget_excludes_what_would_overspend_but_keeps_free_workers():
    engine = engine_for([], tenants={"acme": {"budget": {"daily_usd": "1.00", "monthly_usd": "10"}}})
    fresh = pool(engine, tenant="acme", prompt_chars=4000, max_output_tokens=500)
    assert fresh == ALL
    spent = engine.evaluate(
        PolicyRequest(
            "acme", prompt_chars=4000, max_output_tokens=500, spend=Spend(Decimal("0.999"), Decimal("5"))
        ),
        CATALOG,
        env={},
    )
    names = {w.name for w in spent.pool}
    assert "local-tiny" in names and "us-pricey" not in names
    assert {e.rule for e in spent.excluded} == {"budget:daily"}
    monthly = pool(engine, tenant="acme", prompt_chars=4000, spend=Spend(Decimal(0), Decimal("10")))
    assert monthly == {"local-tiny"}
    assert pool(engine, tenant="other", spend=Spend(Decimal(99), Decimal(99))) == ALL  # no budget set


# ---- the policy file ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("version: 1\nrules: [", "invalid YAML"),
        ("- 1", "mapping"),
        ("rules: []", "version"),
        ("version: 1\nrules: [{id: r}]", "sets no constraint"),
        (
            "version: 1\nrules: [{id: r, max_active_params_b: 1}, {id: r, max_active_params_b: 2}]",
            "duplicate rule id",
        ),
        (
            "version: 1\nrules: [{id: r, when: {data_classes: [nope]}, max_active_params_b: 1}]",
            "unknown data class",
        ),
        ("version: 1\ndefault_data_class: nope", "default_data_class"),
        ("version: 1\ntenants: {a: {data_class: nope}}", "tenants.a.data_class"),
        ("version: 1\nrules: [{id: r, max_active_params_b: -3}]", "greater than 0"),
        ("version: 1\nrules: [{id: r, colour: red, max_active_params_b: 3}]", "colour"),
        ("version: 1\nrules: [{id: r, allow_tiers: [galactic]}]", "allow_tiers"),
        ("version: 1\ndetection: {kinds: {email: nope}}", "detection.kinds.email"),
        ("version: 1\ndetection: {kinds: {passport: pii}}", "no such detector"),
        ("version: 1\ndetection: {custom: {emp: 'EMP-1'}}", "map it to a data class"),
        ("version: 1\ndetection: {kinds: {emp: pii}, custom: {emp: 'EMP-('}}", "invalid regex"),
        ("version: 1\ntenants: {a: {cost_weight: .inf}}", "tenants.a.cost_weight"),
        ("version: 1\ntenants: {a: {cost_weight: .nan}}", "tenants.a.cost_weight"),
        ("version: 1\ntenants: {a: {cost_weight: 1e6}}", "tenants.a.cost_weight"),
        ("version: 1\nrules: [{id: r, allow_jurisdictions: [EU, Mars]}]", "unknown jurisdiction 'Mars'"),
        ("version: 1\nrules: [{id: r, deny_jurisdictions: [UK]}]", "a group (EEA, EU)"),
        (
            "version: 1\njurisdiction_groups: {nordics: ['NO', XX]}",
            "jurisdiction_groups.nordics: unknown jurisdiction 'XX'",
        ),
    ],
)
def test_invalid_policies_are_refused_with_the_reason(text, fragment):
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "policy.yaml")
    assert "policy.yaml" in str(info.value) and fragment in str(info.value)


EVERY_KIND_OF_MISTAKE = """
version: 1
data_classes: [public, internal, pii, secret]
default_data_class: publik
detection: {kinds: {email: pii, phone: piii}}
tenants:
  default: {budget: {daily_usd: -3}}
  ok: {data_class: internl}
rules:
  - {id: a, when: {data_classes: [pii]}, allow_jurisdictions: [Mars]}
  - {id: b, when: {data_classes: [pii]}}
  - {id: c, max_active_params_b: lots}
  - {id: a, deny_jurisdictions: [CN]}
  - {id: d, when: {data_classes: [secrett]}, deny_jurisdictions: [CN]}
"""


def test_every_problem_is_reported_at_once():
    """Field errors stop pydantic before the cross-reference checks; the operator still sees all of them."""
    with pytest.raises(PolicyError) as info:
        parse_policy(EVERY_KIND_OF_MISTAKE, "policy.yaml")
    message = str(info.value)
    for fragment in (
        "tenants.default.budget.daily_usd: Input should be greater than or equal to 0",
        "rules.1: Value error, rule 'b' sets no constraint",
        "rules.2.max_active_params_b: Input should be a valid number",
        "default_data_class: 'publik' is not in data_classes",
        "detection.kinds.phone: unknown data class 'piii'",
        "tenants.ok.data_class: unknown data class 'internl'",
        "rules.3.id: duplicate rule id 'a' (first at rules.0)",
        "rules.0.allow_jurisdictions: unknown jurisdiction 'Mars'",
        "rules.4.when.data_classes: unknown data class 'secrett'",
    ):
        assert fragment in message
    # rule c is reported for its bad number only: setting it aside must not invent a second problem
    assert "rule 'c' sets no constraint" not in message
    # rules b and c were set aside to find the rest: rules a and d keep their own indexes in the report
    assert "rules.1.id" not in message and "rules.2.when" not in message


def test_a_catalog_reports_every_bad_worker_at_once():
    from policies import CatalogError, parse_catalog

    text = """
workers:
  - {name: one, model: openai/x, tier: frontier, jurisdiction: US, price_in_per_m: -1, price_out_per_m: 1}
  - {name: two, model: openai/y, tier: galactic, jurisdiction: US, price_in_per_m: 1, price_out_per_m: 1}
"""
    with pytest.raises(CatalogError) as info:
        parse_catalog(text, "workers.yaml")
    assert "workers.0.price_in_per_m" in str(info.value) and "workers.1.tier" in str(info.value)


def test_jurisdictions_accept_countries_groups_and_local_in_any_case():
    engine = PolicyEngine(
        *parse_policy(
            "version: 1\njurisdiction_groups: {nordics: ['no', IS]}\nrules: [{id: r, allow_jurisdictions: [nordics, eu, Local, us]}]"
        )
    )
    assert engine.policy.rules[0].allow_jurisdictions == ("nordics", "eu", "Local", "us")


def test_version_carries_label_and_content_hash():
    _, v1 = parse_policy("version: 7\n")
    _, v2 = parse_policy("version: 7\n# a comment changes the content\n")
    assert v1.startswith("7+") and v2.startswith("7+") and v1 != v2


def test_the_default_policy_file_is_valid_and_sovereign():
    from policies import DEFAULT_POLICY_PATH, compile_policy

    engine = compile_policy(DEFAULT_POLICY_PATH.read_text(), "default")
    assert pool(engine, texts=("email me at a.b@example.org",)) <= EU_OR_LOCAL
    assert pool(engine, texts=("ghp_" + "a" * 36,)) == {"local-tiny"}


# ---- property: no admitted worker breaks any rule in scope -------------------------------------
JURIS = ["FR", "DE", "CN", "US", "local", "EU", "GB"]
LICENSES = ["Apache-2.0", "MIT", "proprietary", "gemma", "llama3", "MNPL-0.1"]
PROVIDERS = sorted({w[3] for w in WORKERS})
TIERS = ["open-moe", "specialist", "frontier", "local"]

rules_strategy = st.lists(
    st.fixed_dictionaries(
        {},
        optional={
            "allow_jurisdictions": st.lists(st.sampled_from(JURIS), max_size=3),
            "deny_jurisdictions": st.lists(st.sampled_from(JURIS), max_size=2),
            "allow_licenses": st.lists(st.sampled_from(LICENSES), max_size=3),
            "deny_licenses": st.lists(st.sampled_from(LICENSES), max_size=2),
            "allow_providers": st.lists(st.sampled_from(PROVIDERS), max_size=4),
            "deny_providers": st.lists(st.sampled_from(PROVIDERS), max_size=2),
            "allow_tiers": st.lists(st.sampled_from(TIERS), max_size=3),
            "max_active_params_b": st.sampled_from([1, 10, 30, 40, 100]),
            "max_request_cost_usd": st.sampled_from(["0.0001", "0.001", "0.01", "1"]),
            "when": st.fixed_dictionaries(
                {},
                optional={
                    "tenants": st.lists(st.sampled_from(["a", "b"]), max_size=1),
                    "data_classes": st.lists(st.sampled_from(["public", "pii"]), max_size=1),
                },
            ),
        },
    ).filter(lambda r: any(k != "when" and not (k.startswith("deny_") and not v) for k, v in r.items())),
    max_size=6,
)


def oracle_ok(rule: dict, worker: tuple, cost: Decimal) -> bool:
    """An independent reading of the policy semantics, written from the README, not the engine."""
    name, where, lic, provider, tier, active, _, _ = worker

    def expand(codes):
        out = set()
        for c in codes:
            out |= set(EU_MEMBERS) | {"EU"} if c == "EU" else {c.upper()}
        return out

    if "allow_jurisdictions" in rule or rule.get("deny_jurisdictions"):
        if where is None:
            return False
        if where.upper() in expand(rule.get("deny_jurisdictions", [])):
            return False
        if "allow_jurisdictions" in rule and where.upper() not in expand(rule["allow_jurisdictions"]):
            return False
    if "allow_licenses" in rule and lic.lower() not in {x.lower() for x in rule["allow_licenses"]}:
        return False
    if lic.lower() in {x.lower() for x in rule.get("deny_licenses", [])}:
        return False
    if "allow_providers" in rule and provider not in rule["allow_providers"]:
        return False
    if provider in rule.get("deny_providers", []):
        return False
    if "allow_tiers" in rule and tier not in rule["allow_tiers"]:
        return False
    if "max_active_params_b" in rule and (active is None or active > rule["max_active_params_b"]):
        return False
    return not ("max_request_cost_usd" in rule and cost > Decimal(rule["max_request_cost_usd"]))


@settings(max_examples=300, deadline=None)
@given(
    rules=rules_strategy,
    tenant=st.sampled_from(["a", "b", "c"]),
    text=st.sampled_from(["hello", "mail x@example.com", "plain 2024-01-01"]),
    chars=st.integers(0, 200_000),
)
def test_no_decision_admits_a_worker_that_a_rule_in_scope_excludes(rules, tenant, text, chars):
    rules = [{"id": f"r{i}", **r} for i, r in enumerate(rules)]
    engine = engine_for(rules)
    request = PolicyRequest(tenant, texts=(text,), prompt_chars=chars)
    admission = engine.evaluate(request, CATALOG, env={})
    data_class = admission.data_class
    in_scope = [
        r
        for r in rules
        if (not r.get("when", {}).get("tenants") or tenant in r["when"]["tenants"])
        and (not r.get("when", {}).get("data_classes") or data_class in r["when"]["data_classes"])
    ]
    expected = set()
    for worker in WORKERS:
        cost = predicted_cost(CATALOG.get(worker[0]), chars, None)
        if all(oracle_ok(r, worker, cost) for r in in_scope):
            expected.add(worker[0])
    assert {w.name for w in admission.pool} == expected
    assert {w.name for w in admission.pool} | {e.worker for e in admission.excluded} == ALL


def test_custom_jurisdiction_groups_add_to_the_builtin_ones():
    engine = engine_for(
        [{"id": "nordics-or-eu", "allow_jurisdictions": ["nordics", "EU"]}],
        jurisdiction_groups={"nordics": ["NO", "IS"]},
    )
    compiled = engine.rules[0]
    assert {"NO", "IS", "FR", "DE"} <= compiled.allow_jurisdictions
    empty = engine_for([{"id": "eu", "allow_jurisdictions": ["EU"]}], jurisdiction_groups={})
    assert "FR" in empty.rules[0].allow_jurisdictions  # an empty mapping never drops EU
