"""The pure renderer: every object validates against the official Kubernetes schemas (strict), and the
objects say exactly what the spec says."""
from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import ValidationError

from prefixcache.operator import kube
from prefixcache.operator.engine_pods import ENGINE_SERVICE
from prefixcache.operator.owner import Owner
from prefixcache.operator.render import render
from prefixcache.operator.rollout_hashes import CACHE_IDENTITY_ANNOTATION, CONFIG_HASH_ANNOTATION
from prefixcache.operator.spec import parse_spec
from prefixcache.protos.engine.v1 import engine_pb2

OWNER = Owner(name="chat", namespace="serving", uid="6a1f0c9e-0000-4000-8000-000000000001")
FULL_SPEC = {
    "replicas": 3, "blockSize": 32, "hashAlgorithm": "xxhash", "enablePrefixCaching": False, "maxNumSeqs": 64,
    "kvCacheMemory": "6Gi", "image": "registry.example/prefixcache:1.2.3", "imagePullPolicy": "Always",
    "model": {"source": "PersistentVolumeClaim", "claimName": "models", "path": "hf/SmolLM2-135M-Instruct/",
              "id": "HuggingFaceTB/SmolLM2-135M-Instruct"},
    "tenantSalts": {"secretName": "tenant-salts", "key": "hmac"},
    "tenants": {"secretName": "chat-tenants", "key": "tenants-v2.json"},
    "tls": {"secretName": "chat-engine-tls"},
    "worker": {"image": "registry.example/prefixcache-worker:1.2.3-cu128", "gpus": 1, "dtype": "bfloat16", "attentionBackend": "triton",
               "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
               "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
    "scheduler": {"resources": {"requests": {"cpu": "500m"}}},
    "tokenizer": {"replicas": 2, "nodeSelector": {"pool": "cpu"},
                  "tolerations": [{"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute",
                                   "tolerationSeconds": 30}]},
    "imagePullSecrets": ["registry-credentials"],
    "otel": {"endpoint": "http://otel-collector.observability:4317"},
    "terminationGracePeriodSeconds": 120,
}


def by_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def containers(deployment: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every container of the pod, native sidecars (restartable init containers) included."""
    pod = deployment["spec"]["template"]["spec"]
    return {c["name"]: c for c in [*pod.get("initContainers", []), *pod["containers"]]}


@pytest.fixture(params=[pytest.param({}, id="defaults"), pytest.param(FULL_SPEC, id="every-field")])
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(OWNER, parse_spec(request.param))


@pytest.mark.parametrize("version", ["1.33", "1.37"])
def test_every_object_validates_strictly(rendered: list[dict[str, Any]], version: str) -> None:
    for obj in rendered:
        kubernetes_validate.validate(obj, version, strict=True)


def test_strict_validation_catches_a_misspelt_field() -> None:
    """The check above can fail: an unknown field in a pod spec is rejected."""
    deployment = by_name(render(OWNER, parse_spec({})))["Deployment", "chat-engine"]
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)


def test_the_stack_and_its_ownership(rendered: list[dict[str, Any]]) -> None:
    assert sorted(by_name(rendered)) == [("ConfigMap", "chat-dashboard"), ("ConfigMap", "chat-env"),
                                         ("Deployment", "chat-engine"),
                                         ("Deployment", "chat-tokenizer"), ("NetworkPolicy", "chat-engine"),
                                         ("NetworkPolicy", "chat-tokenizer"),
                                         ("PodDisruptionBudget", "chat-engine"), ("Service", "chat"),
                                         ("Service", "chat-tokenizer")]
    for obj in rendered:
        assert obj["metadata"]["namespace"] == "serving"
        assert obj["metadata"]["ownerReferences"] == [{
            "apiVersion": "prefixcache.dev/v1alpha1", "kind": "PrefixCacheDeployment", "name": "chat",
            "uid": OWNER.uid, "controller": True, "blockOwnerDeletion": True}]


def test_services_select_their_pods(rendered: list[dict[str, Any]]) -> None:
    objects = by_name(rendered)
    for service, deployment, port in (("chat", "chat-engine", 50051), ("chat-tokenizer", "chat-tokenizer", 50053)):
        spec = objects["Service", service]["spec"]
        pod_labels = objects["Deployment", deployment]["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"].items() <= pod_labels.items()
        assert spec["ports"][0]["port"] == port and spec["ports"][0]["targetPort"] == "grpc"
    engine_pods = objects["Deployment", "chat-engine"]["spec"]["template"]["metadata"]["labels"]
    assert not objects["Service", "chat-tokenizer"]["spec"]["selector"].items() <= engine_pods.items()


def test_spec_becomes_exact_command_lines() -> None:
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC)))
    engine = containers(objects["Deployment", "chat-engine"])
    assert engine["scheduler"]["args"] == [
        "scheduler", "--port", "50051", "--tokenizer", "chat-tokenizer.serving.svc:50053",
        "--worker", "127.0.0.1:50052", "--block-size", "32", "--hash-algo", "xxhash", "--max-num-seqs", "64",
        "--metrics-port", "9090", "--grace", "105", "--health-port", "50055", "--no-prefix-caching",
        "--tenants", "/etc/prefixcache/tenants/tenants.json",
        "--tenant-salt-key-file", "/etc/prefixcache/salt-key/key",
        "--tls-cert", "/etc/prefixcache/tls/tls.crt", "--tls-key", "/etc/prefixcache/tls/tls.key"]
    assert engine["worker"]["args"] == [
        "worker", "--host", "127.0.0.1", "--port", "50052", "--health-port", "50054", "--grace", "10",
        "--model-dir", "/models/hf/SmolLM2-135M-Instruct",
        "--kv-cache-memory", str(6 * 2**30), "--metrics-port", "9091", "--metrics-host", "0.0.0.0",
        "--device", "cuda", "--dtype", "bfloat16",
        "--attention-backend", "triton"]
    tokenizer = containers(objects["Deployment", "chat-tokenizer"])["tokenizer"]
    assert tokenizer["args"] == ["tokenizer", "--port", "50053", "--grace", "25",
                                 "--model-dir", "/models/hf/SmolLM2-135M-Instruct", "--metrics-port", "9092"]
    assert objects["Deployment", "chat-engine"]["spec"]["replicas"] == 3
    assert objects["Deployment", "chat-tokenizer"]["spec"]["replicas"] == 2
    assert engine["worker"]["image"] == "registry.example/prefixcache-worker:1.2.3-cu128"
    assert {engine["scheduler"]["image"], tokenizer["image"]} == {"registry.example/prefixcache:1.2.3"}


def test_defaults_use_the_embedded_model_and_leave_worker_choices_to_the_worker() -> None:
    """No --dtype: the worker's auto picks bfloat16 on the GPU (and float32 on CPU)."""
    objects = by_name(render(OWNER, parse_spec({})))
    engine = containers(objects["Deployment", "chat-engine"])
    assert engine["worker"]["args"] == ["worker", "--host", "127.0.0.1", "--port", "50052", "--health-port", "50054",
                                        "--grace", "10", "--model-dir", "/opt/prefixcache/models/SmolLM2-135M-Instruct",
                                        "--kv-cache-memory", str(2 * 2**30), "--metrics-port", "9091",
                                        "--metrics-host", "0.0.0.0", "--device", "cuda"]
    assert not {"--no-prefix-caching", "--tenants", "--tls-cert"} & set(engine["scheduler"]["args"])
    pod = objects["Deployment", "chat-engine"]["spec"]["template"]["spec"]
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]  # no model volume
    assert "--tenant-salt-key-file" not in engine["scheduler"]["args"]


def test_worker_gets_gpus_and_resources() -> None:
    engine = containers(by_name(render(OWNER, parse_spec(FULL_SPEC)))["Deployment", "chat-engine"])
    assert engine["worker"]["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"},
                                             "limits": {"memory": "32Gi", "nvidia.com/gpu": "1"}}
    assert engine["scheduler"]["resources"] == {"requests": {"cpu": "500m"}}
    cpu_only = containers(by_name(render(OWNER, parse_spec({"worker": {"gpus": 0}, "kvCacheMemory": "4Gi"})))[
        "Deployment", "chat-engine"])
    # Requests where the spec sets none, so the pod is never BestEffort: on CPU the KV cache is host memory.
    assert cpu_only["worker"]["resources"] == {"requests": {"cpu": "2", "memory": str(6 * 2**30)}}
    assert "--device" not in cpu_only["worker"]["args"]
    on_gpu = containers(by_name(render(OWNER, parse_spec({"worker": {"resources": {"requests": {"cpu": "3"}}}})))[
        "Deployment", "chat-engine"])
    assert on_gpu["worker"]["resources"] == {"requests": {"cpu": "3", "memory": str(2 * 2**30)},
                                             "limits": {"nvidia.com/gpu": "1"}}
    # Scheduling ahead is the scheduler's default, on a GPU or not.
    assert not any("schedule-ahead" in arg for arg in [*engine["scheduler"]["args"], *cpu_only["scheduler"]["args"]])


def test_each_component_is_placed_where_its_spec_says() -> None:
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC)))
    engine = objects["Deployment", "chat-engine"]["spec"]["template"]["spec"]
    tokenizer = objects["Deployment", "chat-tokenizer"]["spec"]["template"]["spec"]
    assert engine["nodeSelector"] == FULL_SPEC["worker"]["nodeSelector"]
    assert engine["tolerations"] == FULL_SPEC["worker"]["tolerations"]
    assert tokenizer["nodeSelector"] == {"pool": "cpu"} and tokenizer["tolerations"][0]["tolerationSeconds"] == 30
    assert engine["imagePullSecrets"] == tokenizer["imagePullSecrets"] == [{"name": "registry-credentials"}]
    defaults = by_name(render(OWNER, parse_spec({})))["Deployment", "chat-engine"]["spec"]["template"]["spec"]
    assert not {"nodeSelector", "imagePullSecrets", "runtimeClassName", "priorityClassName", "affinity"} & set(defaults)
    # GPU nodes are usually tainted nvidia.com/gpu:NoSchedule: GPU pods tolerate it by default, CPU pods do not.
    assert defaults["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    cpu = by_name(render(OWNER, parse_spec({"worker": {"gpus": 0}})))["Deployment", "chat-engine"]["spec"]["template"]
    assert "tolerations" not in cpu["spec"]


def test_engine_replicas_spread_across_nodes_and_one_goes_down_at_a_time() -> None:
    objects = by_name(render(OWNER, parse_spec({"replicas": 3})))
    pod = objects["Deployment", "chat-engine"]["spec"]["template"]
    (spread,) = pod["spec"]["topologySpreadConstraints"]
    assert (spread["topologyKey"], spread["whenUnsatisfiable"]) == ("kubernetes.io/hostname", "ScheduleAnyway")
    assert spread["labelSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    budget = objects["PodDisruptionBudget", "chat-engine"]["spec"]
    assert budget == {"maxUnavailable": 1, "selector": {"matchLabels": spread["labelSelector"]["matchLabels"]}}
    assert objects["Deployment", "chat-engine"]["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0,
                                                                                         "maxUnavailable": 1}
    surge = by_name(render(OWNER, parse_spec({"rollout": {"maxSurge": 1}})))["Deployment", "chat-engine"]["spec"]
    assert surge["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_gpu_pod_settings_are_spec_fields() -> None:
    worker = {"runtimeClassName": "nvidia", "priorityClassName": "inference-high", "startupProbeSeconds": 1800,
              "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                  {"matchExpressions": [{"key": "gpu.product", "operator": "In", "values": ["H100"]}]}]}}}}
    deployment = by_name(render(OWNER, parse_spec({"worker": worker})))["Deployment", "chat-engine"]
    pod = deployment["spec"]["template"]["spec"]
    assert (pod["runtimeClassName"], pod["priorityClassName"], pod["affinity"]) == (
        "nvidia", "inference-high", worker["affinity"])
    assert pod["initContainers"][0]["startupProbe"]["failureThreshold"] * 5 == 1800
    assert deployment["spec"]["progressDeadlineSeconds"] == 1800 + 600  # a slow start is not a failed rollout
    kubernetes_validate.validate(deployment, "1.33", strict=True)


def test_model_claim_is_mounted_read_only_where_needed() -> None:
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC)))
    for deployment, container in (("chat-engine", "worker"), ("chat-tokenizer", "tokenizer")):
        pod = objects["Deployment", deployment]["spec"]["template"]["spec"]
        assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
        mounts = {m["name"]: m for m in containers(objects["Deployment", deployment])[container]["volumeMounts"]}
        assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    scheduler = containers(objects["Deployment", "chat-engine"])["scheduler"]
    assert "model" not in {m["name"] for m in scheduler["volumeMounts"]}


def test_port_names_are_unique_within_each_pod(rendered: list[dict[str, Any]]) -> None:
    """Kubernetes asks a container port's name to be unique within its pod (a Service or a probe
    that names a port must find one)."""
    for deployment in (o for o in rendered if o["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        names = [p["name"] for c in [*pod.get("initContainers", []), *pod["containers"]] for p in c["ports"]]
        assert len(names) == len(set(names)), (deployment["metadata"]["name"], names)


def test_every_container_is_probed_over_grpc_health(rendered: list[dict[str, Any]]) -> None:
    """On its plaintext health port where it has one (the worker listens on loopback, the Engine API
    may serve TLS: the kubelet's gRPC probes reach neither), else on its service port."""
    for deployment in (o for o in rendered if o["kind"] == "Deployment"):
        for container in containers(deployment).values():
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            port = next((number for name, number in ports.items() if name.endswith("health")), ports.get("grpc"))
            for probe in ("startupProbe", "livenessProbe"):
                assert container[probe]["grpc"] == {"port": port}, (container["name"], probe)
            # The scheduler is ready while its Engine can serve (not while it waits for a worker).
            ready = {"port": port, "service": ENGINE_SERVICE} if container["name"] == "scheduler" else {"port": port}
            assert container["readinessProbe"]["grpc"] == ready, container["name"]
    engine = by_name(rendered)["Deployment", "chat-engine"]
    startup = containers(engine)["worker"]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # room to load the model
    # The sidecar starts the scheduler only once the worker is up: a healthy pod may take both
    # startups in a row, and the rollout must not be declared failed before that.
    startups = sum(c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"]
                   for c in containers(engine).values())
    assert engine["spec"]["progressDeadlineSeconds"] > startups


def test_worker_is_a_native_sidecar_so_it_outlives_the_draining_scheduler() -> None:
    pod = by_name(render(OWNER, parse_spec({})))["Deployment", "chat-engine"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["scheduler"]
    assert [(c["name"], c["restartPolicy"]) for c in pod["initContainers"]] == [("worker", "Always")]


def test_grace_period_and_gpu_safe_rollout() -> None:
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC)))
    engine = objects["Deployment", "chat-engine"]["spec"]
    assert engine["template"]["spec"]["terminationGracePeriodSeconds"] == 120
    scheduler = containers(objects["Deployment", "chat-engine"])["scheduler"]["args"]
    worker = containers(objects["Deployment", "chat-engine"])["worker"]["args"]
    drain, stop = int(scheduler[scheduler.index("--grace") + 1]), int(worker[worker.index("--grace") + 1])
    assert drain + stop < 120  # both finish inside the pod's grace period, scheduler first
    assert engine["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_tracing_is_configured_through_the_config_map() -> None:
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC)))
    data = objects["ConfigMap", "chat-env"]["data"]
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert data["OTEL_TRACES_EXPORTER"] == "otlp"
    for deployment in ("chat-engine", "chat-tokenizer"):
        for container in containers(objects["Deployment", deployment]).values():
            assert container["envFrom"] == [{"configMapRef": {"name": "chat-env"}}]
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["OTEL_SERVICE_NAME"] == f"prefixcache-{container['name']}"
    untraced = by_name(render(OWNER, parse_spec({})))["ConfigMap", "chat-env"]["data"]
    assert untraced["OTEL_TRACES_EXPORTER"] == "none" and "OTEL_EXPORTER_OTLP_ENDPOINT" not in untraced


def templates(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The engine's and the tokenizer's pod templates: a change to one rolls that Deployment's pods."""
    return {o["metadata"]["name"].removeprefix("chat-"): o["spec"]["template"]
            for o in render(OWNER, parse_spec(raw)) if o["kind"] == "Deployment"}


# (change to the defaults, the GPU (engine) pods roll, the tokenizer pods roll, the cache identity changes)
ROLLS = [
    ({"replicas": 5}, False, False, False),
    ({"tokenizer": {"replicas": 3}}, False, False, False),
    ({"otel": {"endpoint": "http://otel:4317"}}, False, True, False),
    ({"model": {"id": "a display name"}}, False, False, False),
    ({"cacheHealth": {"intervalSeconds": 5, "thrashing": {"evictedMissShare": 0.2}}}, False, False, False),
    ({"tokenizer": {"resources": {"requests": {"cpu": "2"}}}}, False, True, False),
    ({"blockSize": 32}, True, False, True),
    ({"hashAlgorithm": "xxhash"}, True, False, True),
    ({"enablePrefixCaching": False}, True, False, True),
    ({"kvCacheMemory": "4Gi"}, True, False, True),
    ({"worker": {"dtype": "bfloat16"}}, True, False, True),
    ({"worker": {"attentionBackend": "torch"}}, True, False, True),
    ({"worker": {"gpus": 0}}, True, False, True),
    ({"worker": {"image": "worker:2"}}, True, False, True),
    ({"model": {"source": "PersistentVolumeClaim", "claimName": "models"}}, True, True, True),
    ({"maxNumSeqs": 64}, True, False, False),
    ({"worker": {"resources": {"requests": {"memory": "20Gi"}}}}, True, False, False),
    ({"terminationGracePeriodSeconds": 90}, True, False, False),
    ({"tenantSalts": {"secretName": "salts"}}, True, False, False),  # a new mount; the key's rotation rolls nothing
    ({"tenants": {"secretName": "tenants"}}, True, False, False),
    ({"image": "control-plane:2"}, True, True, False),
]


@pytest.mark.parametrize(("change", "engine_rolls", "tokenizer_rolls", "identity_changes"), ROLLS,
                         ids=[json.dumps(r[0]) for r in ROLLS])
def test_which_spec_changes_roll_which_pods(change: dict[str, Any], engine_rolls: bool, tokenizer_rolls: bool,
                                            identity_changes: bool) -> None:
    """GPU pods roll for what needs a new process, and never for tracing, replicas or the tokenizer; a
    warm cache is emptied only when that cannot be helped."""
    before, after = templates({}), templates(change)
    assert (before["engine"] != after["engine"], before["tokenizer"] != after["tokenizer"]) == \
        (engine_rolls, tokenizer_rolls)
    identity = [t["engine"]["metadata"]["annotations"][CACHE_IDENTITY_ANNOTATION] for t in (before, after)]
    assert (identity[0] != identity[1]) == identity_changes
    assert CONFIG_HASH_ANNOTATION not in after["engine"]["metadata"]["annotations"]


def test_tenant_salt_key_reaches_only_the_scheduler_and_only_as_a_mounted_secret() -> None:
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC)))
    deployment = objects["Deployment", "chat-engine"]
    engine = containers(deployment)
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["salt-key"] == {"name": "salt-key", "secret": {"secretName": "tenant-salts",
                                                                  "items": [{"key": "hmac", "path": "key"}]}}
    assert {"name": "salt-key", "mountPath": "/etc/prefixcache/salt-key", "readOnly": True} \
        in engine["scheduler"]["volumeMounts"]
    assert "salt-key" not in {m["name"] for m in engine["worker"]["volumeMounts"]}
    assert "tenant-salts" not in yaml.safe_dump(objects["ConfigMap", "chat-env"])
    assert "secretKeyRef" not in json.dumps(list(objects.values()))


def test_the_operator_is_an_admin_of_a_stack_with_tenants_by_a_hash_only() -> None:
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC), operator_admin_hash="sha256:" + "ab" * 32))
    admins = json.loads(objects["ConfigMap", "chat-operator-admin"]["data"]["admins.json"])
    assert admins == {"admins": [{"name": "prefixcache-operator", "api_keys": ["sha256:" + "ab" * 32]}]}
    scheduler = containers(objects["Deployment", "chat-engine"])["scheduler"]
    assert scheduler["args"][scheduler["args"].index("--admins") + 1] == "/etc/prefixcache/operator-admin/admins.json"
    # No tenants: every caller may read the whole cache, so no admin is needed.
    plain = by_name(render(OWNER, parse_spec({}), operator_admin_hash="sha256:" + "ab" * 32))
    assert ("ConfigMap", "chat-operator-admin") not in plain
    assert "--admins" not in containers(plain["Deployment", "chat-engine"])["scheduler"]["args"]


def test_the_worker_is_reachable_from_its_scheduler_only() -> None:
    """Attack 2 of issue 29: a worker on the pod's IP obeyed anyone's ExecuteStep and InitializeCache."""
    objects = by_name(render(OWNER, parse_spec({})))
    worker = containers(objects["Deployment", "chat-engine"])["worker"]
    args = worker["args"]
    assert args[args.index("--host") + 1] == "127.0.0.1"
    # the Worker API itself is not a container port; its metrics are, on every interface
    assert [p["name"] for p in worker["ports"]] == ["worker-health", "worker-metrics"]
    assert args[args.index("--metrics-host") + 1] == "0.0.0.0"
    engine_policy = objects["NetworkPolicy", "chat-engine"]["spec"]
    assert engine_policy["podSelector"]["matchLabels"] == objects["Service", "chat"]["spec"]["selector"]
    allowed = {port["port"] for rule in engine_policy["ingress"] for port in rule["ports"]}
    assert 50052 not in allowed and {50051, 9090, 9091} <= allowed


def test_the_tokenizer_takes_calls_from_the_stacks_engine_pods_only() -> None:
    objects = by_name(render(OWNER, parse_spec({})))
    policy = objects["NetworkPolicy", "chat-tokenizer"]["spec"]
    assert policy["podSelector"]["matchLabels"] == objects["Service", "chat-tokenizer"]["spec"]["selector"]
    calls, scrapes = policy["ingress"]
    assert calls["from"] == [{"podSelector": {"matchLabels": objects["Service", "chat"]["spec"]["selector"]}}]
    assert calls["ports"] == [{"protocol": "TCP", "port": 50053}]
    assert scrapes == {"ports": [{"protocol": "TCP", "port": 9092}]}  # from anyone: no tenant's data


def test_the_tenants_file_and_the_certificate_are_mounted_secrets_that_can_rotate() -> None:
    """Mounted as directories, not by subPath and not as environment: the kubelet updates them in place,
    and the scheduler reads the new tenants file and certificate without a restart."""
    objects = by_name(render(OWNER, parse_spec(FULL_SPEC)))
    pod = objects["Deployment", "chat-engine"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["tenants"]["secret"] == {"secretName": "chat-tenants",
                                            "items": [{"key": "tenants-v2.json", "path": "tenants.json"}]}
    assert volumes["engine-tls"]["secret"] == {"secretName": "chat-engine-tls"}
    engine = containers(objects["Deployment", "chat-engine"])
    mounts = {m["name"]: m for m in engine["scheduler"]["volumeMounts"]}
    assert mounts["tenants"] == {"name": "tenants", "mountPath": "/etc/prefixcache/tenants", "readOnly": True}
    assert mounts["engine-tls"] == {"name": "engine-tls", "mountPath": "/etc/prefixcache/tls", "readOnly": True}
    assert not any("subPath" in m for c in engine.values() for m in c["volumeMounts"])
    assert {"tenants", "engine-tls"}.isdisjoint(m["name"] for m in engine["worker"]["volumeMounts"])


def test_pods_run_unprivileged_without_api_access(rendered: list[dict[str, Any]]) -> None:
    for deployment in (o for o in rendered if o["kind"] == "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_rendering_is_deterministic() -> None:
    spec = parse_spec(FULL_SPEC)
    assert json.dumps(render(OWNER, spec), sort_keys=True) == json.dumps(render(OWNER, spec), sort_keys=True)


def test_every_service_exposes_metrics_for_scraping() -> None:
    objects = by_name(render(OWNER, parse_spec({})))
    engine, tokenizer_pods = objects["Deployment", "chat-engine"], objects["Deployment", "chat-tokenizer"]
    for container, name, port in ((containers(engine)["scheduler"], "metrics", 9090),
                                  (containers(engine)["worker"], "worker-metrics", 9091),
                                  (containers(tokenizer_pods)["tokenizer"], "metrics", 9092)):
        assert {"name": name, "containerPort": port, "protocol": "TCP"} in container["ports"]
        assert container["args"][container["args"].index("--metrics-port") + 1] == str(port)
    for deployment, port in ((engine, "9090"), (tokenizer_pods, "9092")):
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", port)


def test_the_grafana_dashboard_is_a_configmap_for_the_sidecar() -> None:
    dashboard = by_name(render(OWNER, parse_spec({})))["ConfigMap", "chat-dashboard"]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    panels = json.loads(dashboard["data"]["prefixcache.json"])["panels"]
    queries = " ".join(target["expr"] for panel in panels for target in panel["targets"])
    for metric in ("prefixcache_prefix_cache_hits_total", "prefixcache_prefix_cache_missed_tokens_total",
                   "prefixcache_prefix_cache_evictions_total", "prefixcache_kv_cache_usage_perc",
                   "prefixcache_time_to_first_token_seconds_bucket"):
        assert metric in queries
    assert "prefix_cache_hit" in queries  # TTFT with and without a hit


def test_the_readiness_service_is_the_engines_grpc_name() -> None:
    assert ENGINE_SERVICE == engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


def test_the_model_display_name_is_not_configuration_so_changing_it_restarts_nothing() -> None:
    renamed = render(OWNER, parse_spec({"model": {"id": "another-name"}}))
    assert renamed == render(OWNER, parse_spec({}))


def test_what_the_api_server_writes_back_is_not_drift() -> None:
    """Children are re-applied only where they differ from the rendering; the API server's own
    canonical forms and defaults must not count, or every event would patch again."""
    spec = parse_spec({**FULL_SPEC, "worker": {**FULL_SPEC["worker"], "resources": {"requests": {"cpu": "0.5",
                                                                                                  "memory": "1024Mi"}},
                                               "tolerations": [{"key": "gpu", "operator": "Exists", "value": ""}]}})
    engine = by_name(render(OWNER, spec))["Deployment", "chat-engine"]
    stored = copy.deepcopy(engine)  # as the API server stores it: canonical quantities, defaults, status
    pod = stored["spec"]["template"]["spec"]
    worker = pod["initContainers"][0]
    worker["resources"]["requests"].update(cpu="500m", memory="1Gi")
    worker["terminationMessagePath"] = "/dev/termination-log"
    pod["dnsPolicy"] = "ClusterFirst"
    stored["status"] = {"replicas": 3}
    assert not pod["tolerations"][0].get("value")  # an empty value is not rendered, as it is not stored
    assert not kube._drifted(stored, engine)
    worker["resources"]["requests"]["cpu"] = "1"
    assert kube._drifted(stored, engine)
    stored["spec"]["replicas"] = 5
    assert kube._drifted(stored, engine)
