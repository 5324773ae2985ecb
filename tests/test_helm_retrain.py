"""The chart's periodic retrain CronJob and shared router store (issue 14): off by default, valid
against the Kubernetes schemas when on, and refused with a clear message when it could not work."""

from __future__ import annotations

import copy

import helm_python as helm
import kubernetes_validate
import pytest

from tests.test_helm import (
    CHART_DIR,
    FULL_VALUES,
    FULLNAME,
    K8S_VERSIONS,
    NAMESPACE,
    VALUE_SETS,
    env_of,
    find,
    gateway,
    notes,
    one,
    render,
    render_raw,
)

RETRAIN_VALUES = {
    **FULL_VALUES,
    "routerStore": {"existingClaim": "router-models"},
    "retrain": {"enabled": True, "schedule": "30 2 * * *", "weights": {"judge": 0.25}},
}
CRONJOB = f"{FULLNAME}-retrain"


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_off_by_default(chart, value_set):
    docs = render(chart, VALUE_SETS[value_set])
    assert find(docs, "CronJob") == []
    assert "POLYROUTE_ROUTER_DIR" not in env_of(gateway(docs))
    assert "Retrain" not in notes(chart, VALUE_SETS[value_set])


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_the_cronjob_validates_and_trains_from_the_ledger(chart, k8s_version):
    docs = render(chart, RETRAIN_VALUES)
    job = one(docs, "CronJob", CRONJOB)
    kubernetes_validate.validate(job, k8s_version, strict=True)
    kubernetes_validate.validate(one(docs, "Deployment", FULLNAME), k8s_version, strict=True)
    assert job["spec"]["schedule"] == "30 2 * * *" and job["spec"]["concurrencyPolicy"] == "Forbid"
    assert job["metadata"]["labels"]["app.kubernetes.io/component"] == "retrain"
    pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = container["args"]
    assert args[:3] == ["router", "train", "--from-ledger"] and args[-1] == "--no-activate"
    assert args[args.index("--weight-judge") + 1] == "0.25"
    assert args[args.index("--weight-feedback") + 1] == "1"
    env = env_of(container)
    assert (
        env["REDIS_URL"]["value"] == env_of(gateway(docs))["REDIS_URL"]["value"]
    )  # the ledger replicas share
    assert env["POLYROUTE_ROUTER_DIR"]["value"] == "/var/lib/polyroute-router"
    # The gateway mounts the same claim where the job writes, so a new version is seen by every replica.
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["router"]["persistentVolumeClaim"] == {"claimName": "router-models"}
    gateway_pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    gateway_volumes = {v["name"]: v for v in gateway_pod["volumes"]}
    assert gateway_volumes["router"]["persistentVolumeClaim"] == {"claimName": "router-models"}
    assert env_of(gateway(docs))["POLYROUTE_ROUTER_DIR"]["value"] == "/var/lib/polyroute-router"
    # Hardened like every other workload.
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True and ctx["capabilities"] == {"drop": ["ALL"]}
    assert container["resources"]["limits"] and pod["restartPolicy"] == "Never"
    assert "router activate VERSION" in notes(chart, RETRAIN_VALUES)


def test_activate_puts_each_retrain_in_force(chart):
    values = copy.deepcopy(RETRAIN_VALUES)
    values["retrain"]["activate"] = True
    job = one(render(chart, values), "CronJob", CRONJOB)
    assert job["spec"]["jobTemplate"]["spec"]["template"]["spec"]["containers"][0]["args"][-1] == "--activate"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"retrain": {"enabled": True}, "routerStore": {"existingClaim": "m"}},
            "retrain: the retrain job reads",
        ),
        ({"retrain": {"enabled": True}, "redis": {"url": "redis://r:6379/0"}}, "routerStore.existingClaim"),
    ],
    ids=["no-redis", "no-router-store"],
)
def test_a_retrain_that_cannot_work_fails_to_render(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        render_raw(chart, values)


def test_helm_lint_passes_strict_with_retrain():
    report = helm.lint(CHART_DIR, copy.deepcopy(RETRAIN_VALUES), strict=True, namespace=NAMESPACE)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
