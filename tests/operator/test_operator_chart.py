"""The Helm chart, rendered offline by Helm's own Go SDK (helm-python-sdk): lint, schema, strict
Kubernetes validation, and the same objects as the operator renders for the same settings."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from prefixcache.operator.owner import Owner
from prefixcache.operator.render import render
from prefixcache.operator.spec import SpecError, parse_spec

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "prefixcache"
SPEC = {  # a PrefixCacheDeployment spec, and below the same settings as chart values
    "replicas": 2, "blockSize": 64, "hashAlgorithm": "xxhash", "enablePrefixCaching": False, "maxNumSeqs": 32,
    "kvCacheMemory": "3Gi", "image": "registry.example/prefixcache:1.2.3",
    "model": {"source": "PersistentVolumeClaim", "claimName": "models", "path": "hf/smol"},
    "tenantSalts": {"secretName": "tenant-salts", "key": "hmac"},
    "tenants": {"secretName": "chat-tenants", "key": "tenants-v2.json"}, "tls": {"secretName": "chat-engine-tls"},
    "worker": {"image": "registry.example/prefixcache-worker:1.2.3", "gpus": 1, "dtype": "bfloat16", "resources": {"requests": {"memory": "8Gi"}},
               "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
               "startupProbeSeconds": 1200, "runtimeClassName": "nvidia", "priorityClassName": "inference",
               "affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                   {"weight": 1, "preference": {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}}]}}},
    "rollout": {"maxSurge": 1},
    "tokenizer": {"replicas": 2, "resources": {"limits": {"cpu": "1"}}, "nodeSelector": {"pool": "cpu"},
                  "tolerations": [{"operator": "Exists"}]},
    "imagePullSecrets": ["registry-credentials"],
    "otel": {"endpoint": "http://otel:4317"}, "terminationGracePeriodSeconds": 90,
}


def values_for(spec: dict[str, Any]) -> dict[str, Any]:
    """The chart's values for a spec: the same fields, the same units."""
    return copy.deepcopy(spec)


@pytest.fixture(scope="module")
def chart() -> Any:
    return helm.Chart.load(str(CHART))


def rendered(chart: Any, values: dict[str, Any], name: str = "chat", namespace: str = "serving") -> list[dict[str, Any]]:
    """The chart's objects (NOTES.txt is text for the user, not a manifest)."""
    manifests = chart.render(values, name=name, namespace=namespace)
    return [doc for path, text in manifests.items() if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def test_the_notes_name_the_objects_the_chart_makes(chart: Any) -> None:
    """What `helm install` prints must point at the Service and Deployment that exist."""
    notes = chart.render({}, name="chat", namespace="serving")["prefixcache/templates/NOTES.txt"]
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in rendered(chart, {})}
    assert ("Service", "chat") in names and "service/chat 50051:50051" in notes
    assert ("Deployment", "chat-engine") in names and "deployment/chat-engine" in notes
    assert "chat.serving.svc:50051" in notes and "--target localhost:50051" in notes


def test_chart_lints_clean() -> None:
    report = helm.lint(str(CHART), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_default_values_match_the_schema(chart: Any) -> None:
    chart.validate_schema(yaml.safe_load((CHART / "values.yaml").read_text()))


@pytest.mark.parametrize(("values", "field"), [
    ({"blockSize": 24}, "blockSize"),
    ({"hashAlgorithm": "md5"}, "hashAlgorithm"),
    ({"model": {"source": "PersistentVolumeClaim", "claimName": ""}}, "claimName"),
    ({"model": {"source": "PersistentVolumeClaim", "claimName": "m", "path": "../etc"}}, "path"),
    ({"tenantSalts": {"secretName": "s", "acme": "inline-salt"}}, "acme"),
    ({"tenants": {"secretName": "s", "apiKeys": ["inline-key"]}}, "apiKeys"),
    ({"tls": {"secretName": "Not A Name"}}, "secretName"),
    ({"kvCacheMemory": "2GB"}, "kvCacheMemory"),
    ({"kvCacheMemoryBytes": 2147483648}, "kvCacheMemoryBytes"),  # the old name is refused, not ignored
    ({"worker": {"gpus": 2}}, "gpus"),  # a worker runs on one device
    ({"worker": {"gpuResource": "not a resource"}}, "gpuResource"),
    ({"worker": {"nodeSelector": {"not a label": "x"}}}, "nodeSelector"),
    ({"tokenizer": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}}, "tolerations"),
    ({"worker": {"tolerations": [{"operator": "Equal", "value": "v"}]}}, "tolerations"),
    ({"worker": {"tolerations": [{"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}]}}, "tolerations"),
    ({"imagePullSecrets": ["Not_A_Name"]}, "imagePullSecrets"),
    ({"worker": {"tolerations": [{"key": "no spaces/in keys", "operator": "Exists"}]}}, "tolerations"),
])
def test_schema_rejects_bad_values_by_name(chart: Any, values: dict[str, Any], field: str) -> None:
    with pytest.raises(helm.HelmError) as error:
        chart.validate_schema(chart.merge_values(values))
    assert field in str(error.value)


@pytest.mark.parametrize(("worker", "message"), [
    ({"gpus": 0, "resources": {"limits": {"nvidia.com/gpu": "1"}}}, "worker.resources.limits.nvidia.com/gpu: set GPUs"),
    ({"gpus": 1, "resources": {"requests": {"nvidia.com/gpu": "1"}}}, "worker.resources.requests.nvidia.com/gpu: set"),
    ({"gpus": 0, "attentionBackend": "triton"}, "worker.attentionBackend triton needs GPUs"),
    ({"gpuResource": "gpu"}, "worker.gpuResource: \"gpu\" is not a device resource name"),
    ({"gpuResource": "kubernetes.io/gpu"}, "worker.gpuResource: \"kubernetes.io/gpu\" is not a device resource name"),
])
def test_chart_refuses_what_the_operator_refuses(chart: Any, worker: dict[str, Any], message: str) -> None:
    spec = {"worker": worker}
    with pytest.raises(SpecError):
        parse_spec(spec)
    with pytest.raises(helm.HelmError) as error:
        rendered(chart, {"worker": worker})
    assert message in str(error.value)


@pytest.mark.parametrize("release", ["1chat", "chat.v1", "Chat", "x" * 54])
def test_a_release_name_that_cannot_name_a_service_is_refused(chart: Any, release: str) -> None:
    with pytest.raises(helm.HelmError, match="release name"):
        chart.render({}, name=release, namespace="serving")


def test_values_yaml_would_read_as_numbers_booleans_or_null_stay_strings(chart: Any) -> None:
    values = {"image": "true", "imagePullPolicy": "Always", "model": {"source": "PersistentVolumeClaim", "claimName": "123"},
              "worker": {"image": "1.5"}, "operator": {"enabled": True, "image": "null"}}
    objects = rendered(chart, values)
    pods = [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]
    images = {c["name"]: c["image"] for pod in pods for c in pod.get("initContainers", []) + pod["containers"]}
    assert set(images.values()) == {"true", "1.5", "null"}
    claims = [v["persistentVolumeClaim"]["claimName"] for pod in pods for v in pod.get("volumes", [])
              if "persistentVolumeClaim" in v]
    assert claims and set(claims) == {"123"}


def test_names_yaml_would_read_as_booleans_stay_strings(chart: Any) -> None:
    objects = rendered(chart, {"operator": {"enabled": True}}, name="on", namespace="no")
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == "on")
    assert service["metadata"]["labels"]["app.kubernetes.io/instance"] == "on"
    assert {o["metadata"]["namespace"] for o in objects if "namespace" in o["metadata"]} == {"no"}


@pytest.mark.parametrize("values", [pytest.param({}, id="defaults"),
                                    pytest.param({**values_for(SPEC), "operator": {"enabled": True}}, id="full"),
                                    pytest.param({"operator": {"enabled": True, "watchNamespace": "serving"}},
                                                 id="operator-one-namespace")])
@pytest.mark.parametrize("version", ["1.33", "1.37"])
def test_every_rendered_object_validates_strictly(chart: Any, values: dict[str, Any], version: str) -> None:
    objects = rendered(chart, values)
    assert len(objects) >= 5
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def without_management(obj: dict[str, Any]) -> dict[str, Any]:
    """Drop what differs by design: who manages it (Helm labels vs the operator's ownerReference)."""
    obj = copy.deepcopy(obj)
    for metadata in (obj["metadata"], obj.get("spec", {}).get("template", {}).get("metadata", {})):
        metadata.pop("ownerReferences", None)
        for label in ("app.kubernetes.io/managed-by", "helm.sh/chart"):
            metadata.get("labels", {}).pop(label, None)
    return obj


@pytest.mark.parametrize("spec", [
    pytest.param({}, id="defaults"),
    pytest.param(SPEC, id="every-field"),
    # Helm's toJson escapes <, > and & and keeps UTF-8: the config hashes must still agree.
    pytest.param({"otel": {"endpoint": "http://otel:4317/?a=b&c=<d>&e=é"}}, id="json-escapes"),
    # One unit for the KV budget in both: a quantity, decimal or binary, or plain bytes.
    pytest.param({"kvCacheMemory": "1.5Gi"}, id="kv-decimal-quantity"),
    pytest.param({"kvCacheMemory": "3G"}, id="kv-si-quantity"),
    pytest.param({"kvCacheMemory": 3221225472}, id="kv-bytes"),
    pytest.param({"worker": {"gpus": 0, "tolerations": [{"key": "spot", "operator": "Exists"}]}}, id="cpu-worker"),
    pytest.param({"worker": {"tolerations": [{"key": "spot", "operator": "Exists"}]}}, id="gpu-default-toleration"),
])
def test_chart_and_operator_render_the_same_stack(chart: Any, spec: dict[str, Any]) -> None:
    values = values_for({"kvCacheMemory": "2Gi", **spec})
    from_chart = {(o["kind"], o["metadata"]["name"]): without_management(o) for o in rendered(chart, values)}
    from_operator = {(o["kind"], o["metadata"]["name"]): without_management(o)
                     for o in render(Owner("chat", "serving", "uid"), parse_spec(spec))}
    assert from_chart.keys() == from_operator.keys()
    for key, expected in from_operator.items():
        assert from_chart[key] == expected, key


def test_a_kv_budget_that_is_not_whole_bytes_is_refused_by_both(chart: Any) -> None:
    with pytest.raises(helm.HelmError, match="kvCacheMemory"):
        rendered(chart, {"kvCacheMemory": "0.3"})
    with pytest.raises(SpecError, match="kvCacheMemory"):
        parse_spec({"kvCacheMemory": "0.3"})


def test_each_container_runs_the_image_built_for_it(chart: Any) -> None:
    """The worker the worker image (CUDA torch); the tokenizer, the scheduler and the operator the
    control-plane image (no torch). The defaults name the two images the Dockerfiles build."""
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert (defaults["image"], defaults["operator"]["image"]) == ("prefixcache/control-plane:0.1.0",) * 2
    assert defaults["worker"]["image"] == "prefixcache/worker:0.1.0"
    values = {"image": "cp:1", "worker": {"image": "worker:1"}, "operator": {"enabled": True, "image": "cp:1"}}
    pods = [o["spec"]["template"]["spec"] for o in rendered(chart, values) if o["kind"] == "Deployment"]
    images = {c["name"]: c["image"] for pod in pods for c in pod.get("initContainers", []) + pod["containers"]}
    assert images == {"worker": "worker:1", "scheduler": "cp:1", "tokenizer": "cp:1", "operator": "cp:1"}
    spec = parse_spec({"image": "cp:1", "worker": {"image": "worker:1"}})
    operator_pods = [o["spec"]["template"]["spec"] for o in render(Owner("chat", "serving", "uid"), spec)
                     if o["kind"] == "Deployment"]
    assert images == {c["name"]: c["image"] for pod in operator_pods
                      for c in pod.get("initContainers", []) + pod["containers"]} | {"operator": "cp:1"}


def test_gpu_workers_are_told_the_driver_they_need(chart: Any) -> None:
    notes = chart.render({}, name="chat", namespace="serving")["prefixcache/templates/NOTES.txt"]
    assert "NVIDIA driver 580 or newer" in notes and "-c worker" in notes
    cpu_notes = chart.render({"worker": {"gpus": 0}}, name="chat", namespace="serving")
    assert "NVIDIA driver" not in cpu_notes["prefixcache/templates/NOTES.txt"]


def test_operator_is_opt_in_and_reads_no_secrets(chart: Any) -> None:
    assert not [o for o in rendered(chart, {}) if o["metadata"]["name"] == "chat-operator"]
    objects = {o["kind"]: o for o in rendered(chart, {"operator": {"enabled": True}, "stack": {"enabled": False}})}
    assert set(objects) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment"}
    resources = {r for rule in objects["ClusterRole"]["rules"] for r in rule["resources"]}
    assert "secrets" not in resources and "prefixcachedeployments/status" in resources
    # Owner references with blockOwnerDeletion need update on the owner's finalizers where that is enforced.
    finalizer_rules = [rule for rule in objects["ClusterRole"]["rules"]
                       if rule["resources"] == ["prefixcachedeployments/finalizers"]]
    assert [rule["verbs"] for rule in finalizer_rules] == [["update"]]
    # The operator watches its children (to put back what drifted) and writes them.
    for child in ("deployments", "services", "configmaps"):
        verbs = {v for rule in objects["ClusterRole"]["rules"] if child in rule["resources"] for v in rule["verbs"]}
        assert {"get", "list", "watch", "create", "patch"} <= verbs, child
    args = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["run", "--standalone", "-m", "prefixcache.operator.handlers"]


def test_an_operator_watching_one_namespace_gets_rights_only_there(chart: Any) -> None:
    values = {"operator": {"enabled": True, "watchNamespace": "team-a"}, "stack": {"enabled": False}}
    objects = {o["kind"]: o for o in rendered(chart, values, namespace="ops")}
    assert set(objects) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Deployment"}
    cluster_wide = {r for rule in objects["ClusterRole"]["rules"] for r in rule["resources"]}
    assert cluster_wide == {"namespaces", "customresourcedefinitions"}
    role, binding = objects["Role"], objects["RoleBinding"]
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "team-a"
    in_namespace = {r for rule in role["rules"] for r in rule["resources"]}
    assert {"prefixcachedeployments", "prefixcachedeployments/status", "deployments", "services", "configmaps",
            "events"} <= in_namespace and "secrets" not in in_namespace
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-operator", "namespace": "ops"}]
    assert role["metadata"]["name"] == "ops-chat-operator"  # two releases named chat may watch team-a
    args = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=team-a" in args


def test_a_new_chart_version_alone_rolls_no_pod(chart: Any) -> None:
    deployments = [o for o in rendered(chart, {"operator": {"enabled": True}}) if o["kind"] == "Deployment"]
    assert len(deployments) == 3
    for deployment in deployments:
        assert "helm.sh/chart" in deployment["metadata"]["labels"]
        assert "helm.sh/chart" not in deployment["spec"]["template"]["metadata"]["labels"]


def test_the_example_is_opt_in_and_a_valid_spec(chart: Any) -> None:
    assert not [o for o in rendered(chart, {}) if o["kind"] == "PrefixCacheDeployment"]
    values = {"example": {"enabled": True}, "operator": {"enabled": True}, "stack": {"enabled": False}}
    (example,) = [o for o in rendered(chart, values) if o["kind"] == "PrefixCacheDeployment"]
    assert example["metadata"]["namespace"] == "serving"
    spec = parse_spec(example["spec"])  # what the operator (and the CRD's schema) will accept
    assert (spec.replicas, spec.worker.gpus, spec.kv_cache_memory_bytes) == (1, 1, 4 * 2**30)


def test_chart_crd_is_the_operator_crd() -> None:
    chart_copy = CHART / "crds" / "prefixcachedeployments.yaml"
    assert chart_copy.read_bytes() == (REPO / "operator" / "prefixcache" / "operator" / "crd.yaml").read_bytes()


def test_chart_dashboard_is_the_operator_dashboard() -> None:
    chart_copy = CHART / "dashboards" / "prefixcache.json"
    assert chart_copy.read_bytes() == (REPO / "operator" / "prefixcache" / "operator" / "dashboard.json").read_bytes()


def test_two_releases_of_one_name_in_two_namespaces_share_no_cluster_scoped_object(chart: Any) -> None:
    def cluster_scoped(namespace: str) -> set[tuple[str, str]]:
        objects = rendered(chart, {"operator": {"enabled": True}}, namespace=namespace)
        return {(o["kind"], o["metadata"]["name"]) for o in objects if o["kind"].startswith("Cluster")}

    team_a, team_b = cluster_scoped("team-a"), cluster_scoped("team-b")
    assert {kind for kind, _ in team_a} == {"ClusterRole", "ClusterRoleBinding"}
    assert not team_a & team_b
