"""The Helm chart against what the gateway reads: every env var the chart renders is a setting the
gateway parses (its own `Settings.from_env`, not a copy of it), the settings added since the chart
was written can be set, the readiness probe outlasts /readyz while Redis is down, and shutdown fits
the pod's grace period. Rendered by Helm's own engine, as tests/test_helm.py does.
"""

from __future__ import annotations

import copy

import helm_python as helm
import pytest
import typer

from gateway.settings import ENV_PREFIX, Settings
from gateway.store.health import REDIS_TIMEOUT_S
from polyroute.cli import app as cli_app
from tests.test_helm import (
    CHART_DIR,
    FULL_VALUES,
    FULLNAME,
    NAMESPACE,
    VALUE_SETS,
    env_of,
    gateway,
    one,
    render,
    render_raw,
)

# Env vars the chart renders that are not gateway Settings, each with who reads it.
NOT_SETTINGS = {
    "HOME": "caches (the root filesystem is read-only; /tmp is an emptyDir)",
    "HF_HUB_OFFLINE": "huggingface_hub: no model hub at run time",
    "LITELLM_LOCAL_MODEL_COST_MAP": "litellm: no cost-map download",
    "REDIS_URL": "Settings.from_env reads it for redis_url",
    "QDRANT_URL": "Settings.from_env reads it for qdrant_url",
}
EVERYTHING = {
    **FULL_VALUES,
    "routerStore": {"existingClaim": "router-models"},
    "readyRequiresStore": True,
    "terminationGracePeriodSeconds": 330,
    "gracefulShutdownSeconds": 300,
}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def settings_from(container: dict) -> Settings:
    """The gateway's Settings as `polyroute serve` would build them from this container's env
    (an entry from a Secret gets a stand-in value: only its presence matters here)."""
    env = {name: entry.get("value", "from-a-secret") for name, entry in env_of(container).items()}
    return Settings.from_env(env)


@pytest.mark.parametrize("value_set", [*VALUE_SETS, "everything"])
def test_every_env_var_the_chart_renders_is_read_by_the_gateway(chart, value_set):
    values = EVERYTHING if value_set == "everything" else VALUE_SETS[value_set]
    container = gateway(render(chart, values))
    settings = settings_from(container)  # raises if a rendered value is one the gateway refuses
    for name in env_of(container):
        if name.startswith(ENV_PREFIX):
            field = name.removeprefix(ENV_PREFIX).lower()
            assert field in Settings.model_fields, f"{name} is rendered but the gateway reads no {field}"
        else:
            assert name in NOT_SETTINGS, f"{name}: nobody reads it"
    assert (settings.host, settings.port, str(settings.data_dir)) == ("0.0.0.0", 8400, "/var/lib/polyroute")
    assert settings.local_workers is False


def test_the_rendered_values_are_the_settings_in_force(chart):
    settings = settings_from(gateway(render(chart, EVERYTHING)))
    assert settings.redis_url == f"redis://{FULLNAME}-redis:6379/0"
    assert settings.qdrant_url == f"http://{FULLNAME}-qdrant:6333"
    assert str(settings.router_dir) == "/var/lib/polyroute-router"
    assert str(settings.workers_file) == "/etc/polyroute/workers.yaml"
    assert str(settings.policy_file) == "/etc/polyroute/policy.yaml"
    assert settings.admin_key == "from-a-secret"
    assert settings.ready_requires_store is True
    assert settings.graceful_shutdown_s == 300


# --- readiness while Redis is down (docs/replicas.md "When Redis is down") ------------------------


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_readiness_probe_outlasts_readyz_while_redis_does_not_answer(chart, value_set):
    """/readyz pings Redis (the key store and the shared stores, at once), bounded by REDIS_TIMEOUT_S;
    tests/test_helm_audit_readyz.py shows it waiting that long on a stalled Redis. Twice that leaves
    as much again for a loaded node.
    A probe timeout below that fails the probe on every pod at once: all leave the Service, exactly
    what the degraded-but-ready answer is for. The old chart's 3 s did that."""
    probe = gateway(render(chart, VALUE_SETS[value_set]))["readinessProbe"]
    assert probe["httpGet"] == {"path": "/readyz", "port": "http"}
    assert probe["timeoutSeconds"] > 2 * REDIS_TIMEOUT_S, probe


def test_ready_requires_store_is_a_value(chart):
    default = settings_from(gateway(render(chart)))
    assert default.ready_requires_store is False  # the gateway's rule: reached once, ready while down
    assert env_of(gateway(render(chart)))["POLYROUTE_READY_REQUIRES_STORE"]["value"] == "false"
    strict = gateway(render(chart, {"readyRequiresStore": True}))
    assert env_of(strict)["POLYROUTE_READY_REQUIRES_STORE"]["value"] == "true"
    assert settings_from(strict).ready_requires_store is True
    with pytest.raises(helm.HelmError, match="readyRequiresStore must be true or false, got yes"):
        render_raw(chart, {"readyRequiresStore": "yes"})  # not read as false in silence


# --- shutdown within terminationGracePeriodSeconds ------------------------------------------------


def test_shutdown_fits_the_grace_period_with_a_pre_stop_pause(chart):
    docs = render(chart)
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    container = gateway(docs)
    pause = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep" and pause > 0
    graceful = settings_from(container).graceful_shutdown_s
    assert env_of(container)["POLYROUTE_GRACEFUL_SHUTDOWN_S"]["value"] == "20"
    # the pause, the requests in flight, then a few seconds to flush budgets and the ledger
    assert pause + graceful + 5 <= pod["terminationGracePeriodSeconds"]

    long_streams = {"terminationGracePeriodSeconds": 330, "gracefulShutdownSeconds": 300}
    docs = render(chart, long_streams)
    assert settings_from(gateway(docs)).graceful_shutdown_s == 300
    assert (
        one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 330
    )
    assert "lifecycle" not in gateway(render(chart, {"preStopSleepSeconds": 0}))


@pytest.mark.parametrize(
    "values",
    [
        {"terminationGracePeriodSeconds": 20},  # the gateway's 20 s alone fill it
        {"gracefulShutdownSeconds": 60},
        {"preStopSleepSeconds": 15},
    ],
    ids=["grace-too-short", "shutdown-too-long", "pause-too-long"],
)
def test_shutdown_longer_than_the_grace_period_fails_to_render(chart, values):
    with pytest.raises(helm.HelmError, match="shutdown does not fit the grace period"):
        render_raw(chart, values)


# --- extraEnv adds settings, never repeats the chart's own ---------------------------------------


@pytest.mark.parametrize(
    ("values", "name", "value_hint"),
    [
        ({}, "POLYROUTE_PORT", "containerPort"),
        ({}, "POLYROUTE_GRACEFUL_SHUTDOWN_S", "gracefulShutdownSeconds"),
        ({}, "POLYROUTE_READY_REQUIRES_STORE", "readyRequiresStore"),
        ({"redis": {"enabled": True}}, "REDIS_URL", "redis.url"),
        ({"adminKeySecret": "admin"}, "POLYROUTE_ADMIN_KEY", "adminKeySecret"),
    ],
)
def test_extra_env_repeating_a_chart_setting_fails_naming_the_value(chart, values, name, value_hint):
    extra = {
        **values,
        "extraEnv": [{"name": "POLYROUTE_BODY_TIMEOUT_S", "value": "10"}, {"name": name, "value": "x"}],
    }
    with pytest.raises(
        helm.HelmError, match=rf"extraEnv\[1\]: {name} is set by the chart itself; set the value {value_hint}"
    ):
        render_raw(chart, extra)


def test_extra_env_sets_any_other_setting(chart):
    extra = [
        {"name": "POLYROUTE_BODY_TIMEOUT_S", "value": "10"},
        {"name": "POLYROUTE_KEEP_ALIVE_TIMEOUT_S", "value": "65"},
        {
            "name": "POLYROUTE_QDRANT_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "qdrant", "key": "api-key"}},
        },
        # not set by the chart without adminKeySecret: the operator's own Secret reference is fine
        {"name": "POLYROUTE_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": "mine", "key": "k"}}},
    ]
    container = gateway(render(chart, {"extraEnv": extra}))
    settings = settings_from(container)
    assert (settings.body_timeout_s, settings.keep_alive_timeout_s) == (10, 65)
    assert settings.qdrant_api_key == "from-a-secret" and settings.admin_key == "from-a-secret"
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"terminationGracePeriodSeconds": 330, "gracefulShutdownSeconds": 300, "readyRequiresStore": True},
        {"preStopSleepSeconds": 0, "extraEnv": [{"name": "POLYROUTE_BODY_TIMEOUT_S", "value": "10"}]},
    ],
    ids=["default", "long-shutdown", "no-pause"],
)
def test_helm_lint_passes_strict_with_the_new_values(values):
    report = helm.lint(CHART_DIR, copy.deepcopy(values), strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# --- the retrain CronJob speaks today's `polyroute router train` ----------------------------------


def test_retrain_job_arguments_parse_with_the_real_cli(chart):
    """The CronJob's args through the CLI's own parser (click, as `polyroute` would parse them):
    an option renamed or removed in polyroute/cli.py fails here, not at 03:00 in the cluster."""
    values = {**EVERYTHING, "retrain": {"enabled": True, "activate": True, "extraArgs": ["--seed", "7"]}}
    job = one(render(chart, values), "CronJob", f"{FULLNAME}-retrain")
    [container] = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[:3] == ["router", "train", "--from-ledger"]
    group = typer.main.get_command(cli_app)
    with group.make_context("polyroute", list(args), resilient_parsing=False) as top:
        router = group.get_command(top, "router")
        with router.make_context("router", list(args[1:]), parent=top) as sub:
            train = router.get_command(sub, "train")
            with train.make_context("train", list(args[2:]), parent=sub) as parsed:
                params = parsed.params
    assert params["from_ledger"] is True and params["activate"] is True and params["seed"] == 7
    assert (params["backend"], params["model"]) == ("static", "auto")
    assert (params["weight_calibration"], params["weight_judge"], params["weight_feedback"]) == (
        1.0,
        0.5,
        1.0,
    )
    env = env_of(container)
    # what `router train` reads from the environment (polyroute/cli.py: _redis_url, _router_dir,
    # _workers_file, paths.data_dir): the gateway pods' Redis, router store and catalog
    assert env["REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis:6379/0"
    assert env["POLYROUTE_ROUTER_DIR"]["value"] == "/var/lib/polyroute-router"
    assert env["POLYROUTE_WORKERS_FILE"]["value"] == "/etc/polyroute/workers.yaml"


# --- NOTES: the admin key with Redis ---------------------------------------------------------------


def test_notes_warn_that_a_generated_admin_key_lives_in_one_pod_whenever_redis_is_used(chart):
    """The gateway generates an admin key only when the key store holds none (gateway/state.py
    bootstrap_admin_key; tests/test_helm_audit_admin_key.py): with Redis that is the first pod, and
    its emptyDir is the only copy. The old NOTES said every replica generates its own, and said
    nothing with one replica."""
    from tests.test_helm import notes

    one_replica = {"redis": {"enabled": True}, "providerKeysSecret": "keys", "policy": "version: 1\n"}
    text = notes(chart, one_replica)
    assert "WARNING: no admin key Secret is set" in text
    assert "admin API is locked out" in text and "every replica generates its own" not in text
    assert "admin-key of the first pod that started, and no other" in text
    scaled = notes(chart, {**one_replica, "replicaCount": 3})
    assert "WARNING: no admin key Secret is set" in scaled
    for secured in ({"adminKeySecret": "admin"}, {"createSecret": {"enabled": True, "adminKey": "a"}}):
        assert "no admin key Secret" not in notes(chart, {**one_replica, **secured})
    assert "no admin key Secret" not in notes(
        chart, {"providerKeysSecret": "keys"}
    )  # no Redis: the pod's own
    assert "the pod's /var/lib/polyroute/admin-key" in notes(chart, {"providerKeysSecret": "keys"})


# --- docs/helm.md names only values that exist -----------------------------------------------------


def _has_path(values: dict, dotted: str) -> bool:
    """`a.b.c` is a value, or a key under a free-form map that is empty by default (labels: {})."""
    node = values
    for part in dotted.split("."):
        if node == {}:
            return True
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_value_docs_helm_md_names_exists_in_values_yaml():
    import re

    import yaml

    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    doc = (CHART_DIR.parent.parent / "docs" / "helm.md").read_text()
    named = set()
    for flags in re.findall(r"--set(?:-file)? ([^\s`]+)", doc):
        named |= {item.split("=", 1)[0] for item in flags.split(",")}
    # `retrain.activate: false`, `routerStore.existingClaim=...`, `policy`: a top-level value first
    for token in re.findall(r"`([a-z][A-Za-z0-9]*(?:\.[A-Za-z0-9]+)*)(?:: [^`]*|=[^`]*)?`", doc):
        if token.split(".")[0] in values:
            named.add(token)
    assert {"providerKeysSecret", "redis.url", "readyRequiresStore", "gracefulShutdownSeconds"} <= named
    missing = sorted(name for name in named if not _has_path(values, name))
    assert missing == [], f"docs/helm.md names values the chart does not have: {missing}"


def test_notes_still_warn_of_no_worker_when_extra_env_holds_only_gateway_settings(chart):
    """extraEnv is where the gateway's other settings go (docs/helm.md), so a timeout there is no
    provider key: the install still has no worker it can call, and /readyz stays 503. The old NOTES
    took any extraEnv entry for a key and said nothing."""
    from tests.test_helm import notes

    settings_only = [
        {"name": "POLYROUTE_BODY_TIMEOUT_S", "value": "10"},
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel:4318"},
    ]
    assert "WARNING: no provider keys" in notes(chart, {"extraEnv": settings_only})
    with_key = [
        *settings_only,
        {"name": "MISTRAL_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "m"}}},
    ]
    assert "WARNING: no provider keys" not in notes(chart, {"extraEnv": with_key})


# --- the in-chart Redis: a memory cap below its container limit -------------------------------------

K8S_UNITS = {"Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "K": 1000, "M": 1000**2, "G": 1000**3}


def _redis_bytes(text: str) -> int:
    """redis.conf memory units: 1mb is 1024*1024 bytes, 1m is 1000000 (redis.conf's own header)."""
    import re

    number, unit = re.fullmatch(r"(\d+)([a-z]*)", text.lower()).groups()
    scale = {"kb": 1024, "mb": 1024**2, "gb": 1024**3, "k": 1000, "m": 1000**2, "g": 1000**3, "": 1}[unit]
    return int(number) * scale


def _k8s_bytes(text: str) -> int:
    for suffix, scale in K8S_UNITS.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * scale
    return int(text)


@pytest.mark.parametrize(
    "redis_values",
    [{"enabled": True}, {"enabled": True, "maxmemory": "1gb", "resources": {"limits": {"memory": "2Gi"}}}],
    ids=["default", "sized"],
)
def test_in_chart_redis_refuses_writes_before_the_kernel_kills_it(chart, redis_values):
    """The gateway never trims the ledger stream (gateway/store/ledger_redis.py: XADD without
    MAXLEN), so an in-chart Redis fills up. Without --maxmemory it grows to its container limit and
    is OOM-killed, then again on every reload of its append-only file: keys and budgets are gone
    for every replica. With a cap and noeviction it refuses writes instead, which the gateway treats
    as an outage (docs/replicas.md), and nothing (no key, no budget) is ever evicted."""
    docs = render(chart, {"replicaCount": 2, "redis": redis_values})
    [container] = one(docs, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    cap = _redis_bytes(args[args.index("--maxmemory") + 1])
    limit = _k8s_bytes(container["resources"]["limits"]["memory"])
    assert 0 < cap <= limit // 2, (cap, limit)  # room for the fork of an append-only-file rewrite
    uncapped = render(chart, {"replicaCount": 2, "redis": {"enabled": True, "maxmemory": ""}})
    [container] = one(uncapped, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]["containers"]
    assert "--maxmemory" not in container["args"]


# --- the in-chart Qdrant runs the queries the gateway sends ----------------------------------------


def test_in_chart_qdrant_is_new_enough_for_the_gateways_hybrid_search(chart):
    """The gateway's default hybrid search fuses BM25 and dense scores with a formula query
    (retrieval/engine.py Fusion.kind "formula", models.FormulaQuery), which Qdrant runs from v1.14.0
    on ("Score Boosting, available as of v1.14.0" in Qdrant's docs). The old chart shipped v1.13.4,
    so every collection search on the in-chart Qdrant would fail."""
    from retrieval.engine import Fusion

    assert Fusion().kind == "formula"
    [container] = one(render(chart, FULL_VALUES), "Deployment", f"{FULLNAME}-qdrant")["spec"]["template"][
        "spec"
    ]["containers"]
    tag = container["image"].split(":", 1)[1].removesuffix("-unprivileged")
    assert tuple(int(part) for part in tag.removeprefix("v").split(".")) >= (1, 14, 0), tag
    with pytest.raises(helm.HelmError, match="qdrant.image.tag v1.13.4 is older than v1.14.0"):
        render_raw(chart, {**FULL_VALUES, "qdrant": {"enabled": True, "image": {"tag": "v1.13.4"}}})
    # a tag that is no version (a digest-pinned mirror, "latest") is the operator's call
    render_raw(chart, {**FULL_VALUES, "qdrant": {"enabled": True, "image": {"tag": "latest"}}})
