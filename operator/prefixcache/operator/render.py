"""Pure rendering: one PrefixCacheDeployment -> the Kubernetes objects that run it.

    Service <name>            :50051 Engine API  ─┐
    Deployment <name>-engine  (replicas)          │ one pod per replica:
        scheduler :50051 ── 127.0.0.1:50052 ──► worker (GPU, KV cache; a native sidecar)
             │
    Service <name>-tokenizer  :50053 ◄── Deployment <name>-tokenizer
    ConfigMap <name>-env      environment shared by every container (tracing)
    ConfigMap <name>-operator-admin  with tenants: the operator's admin key hash (admin_key.py)
    NetworkPolicy <name>-engine, <name>-tokenizer   who may connect to which pod, on which port
    PodDisruptionBudget <name>-engine  one engine pod down at a time (pods also spread over nodes)
    ConfigMap <name>-dashboard  the Grafana dashboard, for Grafana's sidecar (label grafana_dashboard: "1")

Every service serves Prometheus metrics (scheduler :9090, worker :9091, tokenizer :9092); each pod's
scrape annotations name its first service's port, and every metrics port is a named container port
(`metrics`, `worker-metrics`) for a PodMonitor or a scrape job that follows container ports.

A scheduler owns the KV cache of exactly one worker (its block table is that worker's memory), so the two
share a pod and talk over loopback; scaling adds whole scheduler+worker pairs, each with its own cache.
The worker is a native sidecar (an init container with restartPolicy Always, Kubernetes >= 1.29): it is
SERVING before the scheduler starts, and it gets SIGTERM only after the scheduler has drained, so in-flight
requests finish on a live worker.
The worker listens on loopback only: its scheduler alone can drive it (a foreign ExecuteStep would
overwrite cached KV, a foreign InitializeCache wipe it). Kubernetes' gRPC probes reach neither loopback
nor TLS, so the worker and the scheduler also serve their health statuses alone on a plaintext port.
The NetworkPolicies let the engine pods be reached on the Engine API, metrics and health ports only,
and the tokenizer by the engine pods only. With `tenants`, the scheduler reads the tenants file from
its mounted Secret (and again when the Secret changes); with `tls`, it serves the Engine API over TLS
from a mounted kubernetes.io/tls Secret.
Rollouts: the engine pod template carries the cache identity's hash (`cache_identity`), not the
tracing ConfigMap's, so telemetry never restarts a GPU pod (the engine containers read the new
environment at their next start); the tokenizer, which holds no cache, rolls with the ConfigMap.
The tokenizer is stateless and shared. No function here talks to a cluster; every object carries an
ownerReference to the PrefixCacheDeployment so deleting it garbage-collects the stack.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixcache.operator.admin_key import ADMIN_NAME
from prefixcache.operator.schema import GROUP, KIND, VERSION
from prefixcache.operator.spec import EMBEDDED, Placement, PrefixCacheSpec, Resources

ENGINE_PORT = 50051
ENGINE_SERVICE = "prefixcache.engine.v1.Engine"  # the Engine API's gRPC name, as its health service
TOKENIZER_PORT = 50053  # the services' own default ports
WORKER_PORT = 50052
WORKER_HEALTH_PORT = 50054  # plaintext health only, for the probes: the worker itself listens on loopback
SCHEDULER_HEALTH_PORT = 50055  # plaintext health only, for the probes: the Engine API may serve TLS
METRICS_PORT = 9090  # the scheduler's Prometheus endpoint (prefix-cache counters)
WORKER_METRICS_PORT = 9091
TOKENIZER_METRICS_PORT = 9092
DASHBOARD_PATH = Path(__file__).with_name("dashboard.json")  # the chart ships the same file (dashboards/)
DASHBOARD_KEY = "prefixcache.json"
WORKER_GRACE_SECONDS = 10  # a running step's time to finish once the worker gets SIGTERM
# A tokenizer pod's termination grace, and its streams' share of it: a stopping tokenizer refuses
# new calls at once (the scheduler's next ones go to another replica) while the detokenizing streams
# of generations in flight run on, as long as their generation lasts, up to this.
TOKENIZER_POD_GRACE_SECONDS = 30
TOKENIZER_GRACE_SECONDS = 25
# Both images bake the embedded model here (`prefixcache model pull` with PREFIXCACHE_HOME=/opt/prefixcache):
# the worker image all of it, the control-plane image the tokenizer's files.
EMBEDDED_MODEL_DIR = "/opt/prefixcache/models/SmolLM2-135M-Instruct"
MODEL_MOUNT = "/models"
# Secrets are mounted as directories, never by subPath: the kubelet updates those, so keys and
# certificates rotate without a restart.
TENANTS_DIR = "/etc/prefixcache/tenants"
TENANTS_FILE = "tenants.json"
OPERATOR_ADMIN_DIR = "/etc/prefixcache/operator-admin"  # the operator's admin key hash (admin_key.py)
ADMINS_FILE = "admins.json"
SALT_KEY_DIR = "/etc/prefixcache/salt-key"
SALT_KEY_FILE = "key"
ENGINE_TLS_DIR = "/etc/prefixcache/tls"
RUN_AS_USER = 10001  # the images' unprivileged user
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"  # the tokenizer's: its environment (tracing)
CACHE_IDENTITY_ANNOTATION = f"{GROUP}/cache-identity"  # the engine's: what its cached blocks mean (cache_identity)
MANAGED_BY = "prefixcache-operator"


@dataclass(frozen=True, slots=True)
class Owner:
    """The PrefixCacheDeployment the objects belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> Owner:
        metadata = body["metadata"]
        return cls(name=metadata["name"], namespace=metadata["namespace"], uid=metadata["uid"])

    @property
    def reference(self) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name, "uid": self.uid,
                "controller": True, "blockOwnerDeletion": True}

    @property
    def engine_service(self) -> str:
        return self.name

    @property
    def tokenizer_service(self) -> str:
        return f"{self.name}-tokenizer"

    @property
    def engine_deployment(self) -> str:
        return f"{self.name}-engine"

    @property
    def tokenizer_deployment(self) -> str:
        return f"{self.name}-tokenizer"

    @property
    def config_map(self) -> str:
        return f"{self.name}-env"

    @property
    def operator_admin(self) -> str:
        return f"{self.name}-operator-admin"

    @property
    def dashboard(self) -> str:
        return f"{self.name}-dashboard"

    @property
    def engine_endpoint(self) -> str:
        return f"{self.engine_service}.{self.namespace}.svc:{ENGINE_PORT}"


# What Go's encoding/json escapes inside strings beyond JSON's own rules (HTML-safe output).
_GO_JSON_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                                  "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _go_json(value: Any) -> str:
    """The bytes Helm's `toJson` writes (Go's json.Marshal): compact, keys sorted, UTF-8 kept as is,
    and <, >, & and the line and paragraph separators escaped. The chart hashes its config this way,
    so the chart and the operator roll pods for the same changes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).translate(_GO_JSON_ESCAPES)


SCHEDULER_STARTUP_SECONDS = 300
# Requests of a worker that sets none: the host memory of the process (torch, the CUDA context, the
# weights on their way to the GPU) and, on CPU, its KV cache; enough for the embedded model: set
# worker.resources.requests for larger ones.
WORKER_BASE_MEMORY_BYTES = 2 * 2**30
WORKER_CPU = {True: "1", False: "2"}  # with a GPU, without


def render(owner: Owner, spec: PrefixCacheSpec, operator_admin_hash: str | None = None) -> list[dict[str, Any]]:
    """All objects of the stack, in apply order (config before the pods that read it).
    `operator_admin_hash`: the operator's admin key hash, made an admin of a stack with tenants
    (None, as the chart renders it: no admin but the tenants file's)."""
    env_config = _config_map(owner, spec)
    config_hash = hashlib.sha256(_go_json(env_config["data"]).encode()).hexdigest()
    admins = [_operator_admins(owner, operator_admin_hash)] if spec.tenants and operator_admin_hash else []
    return [
        env_config,
        *admins,
        _service(owner, "tokenizer", owner.tokenizer_service, TOKENIZER_PORT),
        _tokenizer_deployment(owner, spec, config_hash),
        _service(owner, "engine", owner.engine_service, ENGINE_PORT),
        _engine_deployment(owner, spec, bool(admins)),
        _disruption_budget(owner),
        *_network_policies(owner),
        _dashboard(owner),
    ]


def selector_labels(owner: Owner, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "prefixcache", "app.kubernetes.io/instance": owner.name,
            "app.kubernetes.io/component": component}


def _labels(owner: Owner, component: str) -> dict[str, str]:
    return {**selector_labels(owner, component), "app.kubernetes.io/part-of": "prefixcache",
            "app.kubernetes.io/managed-by": MANAGED_BY}


def _metadata(owner: Owner, name: str, component: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": _labels(owner, component),
            "ownerReferences": [owner.reference]}


def _config_map(owner: Owner, spec: PrefixCacheSpec) -> dict[str, Any]:
    """Environment every container shares. Never a secret: the tenant salt key is a secretKeyRef."""
    if spec.otel_endpoint:
        data = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": spec.otel_endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    else:
        data = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(owner, owner.config_map, "config"),
            "data": data}


def _operator_admins(owner: Owner, key_hash: str) -> dict[str, Any]:
    """The admins file that makes the operator an admin of this stack's Engine API: a key's hash only."""
    admins = {"admins": [{"name": ADMIN_NAME, "api_keys": [key_hash]}]}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(owner, owner.operator_admin, "config"),
            "data": {ADMINS_FILE: json.dumps(admins)}}


def _dashboard(owner: Owner) -> dict[str, Any]:
    """The Grafana dashboard (hit rate, missed tokens by reason, evictions, KV usage, TTFT with and
    without a hit), labelled for Grafana's sidecar to load."""
    metadata = _metadata(owner, owner.dashboard, "dashboard")
    metadata["labels"]["grafana_dashboard"] = "1"
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
            "data": {DASHBOARD_KEY: DASHBOARD_PATH.read_text()}}


def _scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def _service(owner: Owner, component: str, name: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner, name, component),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner, component),
                 "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP",
                            "appProtocol": "grpc"}]},
    }


def _model_dir(spec: PrefixCacheSpec) -> str:
    if spec.model.source == EMBEDDED:
        return EMBEDDED_MODEL_DIR
    return f"{MODEL_MOUNT}/{spec.model.path}".rstrip("/")


def _model_volumes(spec: PrefixCacheSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts) for the model; the embedded model needs none."""
    if spec.model.source == EMBEDDED:
        return [], []
    volume = {"name": "model",
              "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}}
    return [volume], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]


def _network_policies(owner: Owner) -> list[dict[str, Any]]:
    """Engine pods take the Engine API, metrics and the probes' health ports from anyone (the Engine
    API authenticates its callers), never the worker's port; tokenizer pods take calls from this
    stack's engine pods only, and metrics scrapes from anyone. (Kubernetes always lets a node's kubelet probe its pods.)"""
    def policy(component: str, *ingress: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": _metadata(owner, f"{owner.name}-{component}", component),
                "spec": {"podSelector": {"matchLabels": selector_labels(owner, component)},
                         "policyTypes": ["Ingress"], "ingress": list(ingress)}}

    def tcp(*ports: int) -> list[dict[str, Any]]:
        return [{"protocol": "TCP", "port": port} for port in ports]

    return [
        policy("engine", {"ports": tcp(ENGINE_PORT, METRICS_PORT, WORKER_METRICS_PORT, SCHEDULER_HEALTH_PORT,
                                       WORKER_HEALTH_PORT)}),
        policy("tokenizer", {"from": [{"podSelector": {"matchLabels": selector_labels(owner, "engine")}}],
                             "ports": tcp(TOKENIZER_PORT)},
               {"ports": tcp(TOKENIZER_METRICS_PORT)}),
    ]


def _grpc_probes(port: int, startup_seconds: int, ready_service: str | None) -> dict[str, Any]:
    """gRPC health checking (grpc.health.v1) on the container's own port: startup covers model loading,
    readiness gates traffic (on `ready_service`'s status if given, else the process's), liveness
    restarts a hung process."""
    period = 5
    readiness = {"port": port, "service": ready_service} if ready_service else {"port": port}
    return {
        "startupProbe": {"grpc": {"port": port}, "periodSeconds": period,
                         "failureThreshold": startup_seconds // period},
        "readinessProbe": {"grpc": readiness, "periodSeconds": period, "failureThreshold": 2},
        "livenessProbe": {"grpc": {"port": port}, "periodSeconds": 10, "failureThreshold": 3,
                          "timeoutSeconds": 5},
    }


def _container(owner: Owner, name: str, image: str, spec: PrefixCacheSpec, args: list[str], port: int | None,
               startup_seconds: int, resources: Resources, ready_service: str | None = None,
               health_port: int | None = None, health_port_name: str = "health") -> dict[str, Any]:
    """One service container; `port` None for a service on loopback only, `health_port` its
    plaintext health port, which the probes then check (port names are unique within a pod)."""
    ports = [{"name": "grpc", "containerPort": port, "protocol": "TCP"}] if port is not None else []
    if health_port is not None:
        ports.append({"name": health_port_name, "containerPort": health_port, "protocol": "TCP"})
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": args,
        "ports": ports,
        "envFrom": [{"configMapRef": {"name": owner.config_map}}],
        "env": [
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "OTEL_SERVICE_NAME", "value": f"prefixcache-{name}"},
            {"name": "OTEL_RESOURCE_ATTRIBUTES",
             "value": "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)"},
        ],
        **_grpc_probes(health_port or port, startup_seconds, ready_service),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    if resources.requests or resources.limits:
        container["resources"] = {k: v for k, v in
                                  (("requests", resources.requests), ("limits", resources.limits)) if v}
    return container


def _pod_spec(containers: list[dict[str, Any]], volumes: list[dict[str, Any]], grace_seconds: int,
              placement: Placement, image_pull_secrets: tuple[str, ...]) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "containers": containers,
        "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
        "terminationGracePeriodSeconds": grace_seconds,
        "automountServiceAccountToken": False,  # the services never call the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER,
                            "fsGroup": RUN_AS_USER, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        pod["tolerations"] = [dict(t) for t in placement.tolerations]
    if image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in image_pull_secrets]
    return pod


def cache_identity(spec: PrefixCacheSpec) -> dict[str, Any]:
    """What decides what an engine pod's cached blocks mean and where they live: the weights (model
    directory, claim, worker image), how blocks are cut and hashed, the numerics (dtype, attention
    backend, device) and the KV budget. Its hash is on the engine pod template; a change to it is a
    change of the template, and so rolls the GPU pods, as it must (their caches would be wrong or
    misplaced). The Deployment rolls for other template changes too (images, resources, placement,
    maxNumSeqs, the grace period: each needs a new process); never for tracing, replicas, the
    tokenizer's settings, or a rotated key (see the module docstring)."""
    return {"modelDir": _model_dir(spec), "claimName": spec.model.claim_name or "",
            "workerImage": spec.worker.image, "blockSize": spec.block_size, "hashAlgorithm": spec.hash_algorithm,
            "enablePrefixCaching": spec.enable_prefix_caching, "dtype": spec.worker.dtype,
            "attentionBackend": spec.worker.attention_backend, "gpus": spec.worker.gpus,
            "kvCacheMemoryBytes": spec.kv_cache_memory_bytes}


def cache_identity_hash(spec: PrefixCacheSpec) -> str:
    return hashlib.sha256(_go_json(cache_identity(spec)).encode()).hexdigest()


def _deployment(owner: Owner, name: str, component: str, replicas: int, pod_spec: dict[str, Any],
                annotations: dict[str, str], strategy: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": selector_labels(owner, component)},
        "template": {
            "metadata": {"labels": _labels(owner, component),
                         "annotations": dict(annotations)},
            "spec": pod_spec,
        },
    }
    if strategy:
        spec["strategy"] = strategy
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _metadata(owner, name, component),
            "spec": spec}


def _tokenizer_deployment(owner: Owner, spec: PrefixCacheSpec, config_hash: str) -> dict[str, Any]:
    volumes, mounts = _model_volumes(spec)
    container = _container(owner, "tokenizer", spec.image, spec, ["tokenizer", "--port", str(TOKENIZER_PORT),
                                                "--grace", str(TOKENIZER_GRACE_SECONDS),
                                                "--model-dir", _model_dir(spec),
                                                "--metrics-port", str(TOKENIZER_METRICS_PORT)],
                           TOKENIZER_PORT, startup_seconds=120, resources=spec.tokenizer.resources)
    container["volumeMounts"] += mounts
    container["ports"].append({"name": "metrics", "containerPort": TOKENIZER_METRICS_PORT, "protocol": "TCP"})
    pod = _pod_spec([container], volumes, TOKENIZER_POD_GRACE_SECONDS, spec.tokenizer.placement, spec.image_pull_secrets)
    deployment = _deployment(owner, owner.tokenizer_deployment, "tokenizer", spec.tokenizer.replicas, pod,
                             {CONFIG_HASH_ANNOTATION: config_hash})
    deployment["spec"]["template"]["metadata"]["annotations"] |= _scrape_annotations(TOKENIZER_METRICS_PORT)
    return deployment


def _scheduler_args(owner: Owner, spec: PrefixCacheSpec, operator_admin: bool) -> list[str]:
    args = ["scheduler", "--port", str(ENGINE_PORT),
            "--tokenizer", f"{owner.tokenizer_service}.{owner.namespace}.svc:{TOKENIZER_PORT}",
            "--worker", f"127.0.0.1:{WORKER_PORT}",
            "--block-size", str(spec.block_size), "--hash-algo", spec.hash_algorithm,
            "--max-num-seqs", str(spec.max_num_seqs), "--metrics-port", str(METRICS_PORT),
            "--grace", str(scheduler_grace_seconds(spec)), "--health-port", str(SCHEDULER_HEALTH_PORT)]
    if not spec.enable_prefix_caching:
        args.append("--no-prefix-caching")
    if spec.tenants is not None:
        args += ["--tenants", f"{TENANTS_DIR}/{TENANTS_FILE}"]
    if operator_admin:
        args += ["--admins", f"{OPERATOR_ADMIN_DIR}/{ADMINS_FILE}"]
    if spec.tenant_salts is not None:
        args += ["--tenant-salt-key-file", f"{SALT_KEY_DIR}/{SALT_KEY_FILE}"]
    if spec.tls is not None:
        args += ["--tls-cert", f"{ENGINE_TLS_DIR}/tls.crt", "--tls-key", f"{ENGINE_TLS_DIR}/tls.key"]
    return args


def scheduler_grace_seconds(spec: PrefixCacheSpec) -> int:
    """The scheduler's share of the pod's termination grace: the rest lets the worker stop cleanly."""
    return spec.termination_grace_period_seconds - WORKER_GRACE_SECONDS - 5


def _worker_args(spec: PrefixCacheSpec) -> list[str]:
    args = ["worker", "--host", "127.0.0.1", "--port", str(WORKER_PORT), "--health-port", str(WORKER_HEALTH_PORT),
            "--grace", str(WORKER_GRACE_SECONDS), "--model-dir", _model_dir(spec),
            "--kv-cache-memory", str(spec.kv_cache_memory_bytes),
            "--metrics-port", str(WORKER_METRICS_PORT), "--metrics-host", "0.0.0.0"]
    if spec.worker.gpus > 0:
        args += ["--device", "cuda"]
    if spec.worker.dtype != "auto":
        args += ["--dtype", spec.worker.dtype]
    if spec.worker.attention_backend != "auto":
        args += ["--attention-backend", spec.worker.attention_backend]
    return args


def _worker_resources(spec: PrefixCacheSpec) -> Resources:
    """The spec's resources, with CPU and memory requests derived where it sets none (a pod without
    requests is BestEffort, the first evicted under pressure) and the GPUs as limits."""
    resources = spec.worker.resources
    on_gpu = spec.worker.gpus > 0
    memory = WORKER_BASE_MEMORY_BYTES + (0 if on_gpu else spec.kv_cache_memory_bytes)
    requests = {"cpu": WORKER_CPU[on_gpu], "memory": str(memory), **resources.requests}
    if not on_gpu:
        return Resources(requests=requests, limits=resources.limits)
    return Resources(requests=requests, limits={**resources.limits, spec.worker.gpu_resource: str(spec.worker.gpus)})


def _worker_placement(spec: PrefixCacheSpec) -> Placement:
    """The spec's placement, and a toleration of the GPU resource's usual taint (`nvidia.com/gpu`
    NoSchedule, as the GPU operators and managed node pools set) unless the spec tolerates that key."""
    placement = spec.worker.placement
    key = spec.worker.gpu_resource
    if spec.worker.gpus == 0 or any(t.get("key") == key for t in placement.tolerations):
        return placement
    return Placement(node_selector=placement.node_selector,
                     tolerations=(*placement.tolerations, {"key": key, "operator": "Exists", "effect": "NoSchedule"}))


def _disruption_budget(owner: Owner) -> dict[str, Any]:
    """At most one engine pod down by a voluntary disruption (a drain, an upgrade) at a time: the
    other replicas keep their warm caches and serve."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, owner.engine_deployment, "engine"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(owner, "engine")}}}


def _scheduler_secrets(owner: Owner, spec: PrefixCacheSpec,
                       operator_admin: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, scheduler mounts) for the tenants file, the operator's admins file, the salt key
    and the Engine API's certificate: each a directory the kubelet updates in place."""
    volumes, mounts = [], []
    if spec.tenants is not None:
        volumes.append({"name": "tenants", "secret": {"secretName": spec.tenants.secret_name, "items": [
            {"key": spec.tenants.key, "path": TENANTS_FILE}]}})
        mounts.append({"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True})
    if operator_admin:
        volumes.append({"name": "operator-admin", "configMap": {"name": owner.operator_admin}})
        mounts.append({"name": "operator-admin", "mountPath": OPERATOR_ADMIN_DIR, "readOnly": True})
    if spec.tenant_salts is not None:
        volumes.append({"name": "salt-key", "secret": {"secretName": spec.tenant_salts.secret_name, "items": [
            {"key": spec.tenant_salts.key, "path": SALT_KEY_FILE}]}})
        mounts.append({"name": "salt-key", "mountPath": SALT_KEY_DIR, "readOnly": True})
    if spec.tls is not None:
        volumes.append({"name": "engine-tls", "secret": {"secretName": spec.tls.secret_name}})
        mounts.append({"name": "engine-tls", "mountPath": ENGINE_TLS_DIR, "readOnly": True})
    return volumes, mounts


def _engine_deployment(owner: Owner, spec: PrefixCacheSpec, operator_admin: bool) -> dict[str, Any]:
    # Ready while the Engine can serve: the scheduler's Engine health drops while a lost worker is replaced.
    scheduler = _container(owner, "scheduler", spec.image, spec, _scheduler_args(owner, spec, operator_admin),
                           ENGINE_PORT,
                           startup_seconds=SCHEDULER_STARTUP_SECONDS, resources=spec.scheduler_resources,
                           ready_service=ENGINE_SERVICE,
                           health_port=SCHEDULER_HEALTH_PORT)
    volumes, mounts = _model_volumes(spec)
    # The worker loads weights and may compile kernels before it reports SERVING: allow ten minutes.
    worker = _container(owner, "worker", spec.worker.image, spec, _worker_args(spec), None,
                        startup_seconds=spec.worker.startup_probe_seconds, resources=_worker_resources(spec),
                        health_port=WORKER_HEALTH_PORT, health_port_name="worker-health")
    worker["volumeMounts"] += mounts
    secret_volumes, secret_mounts = _scheduler_secrets(owner, spec, operator_admin)
    scheduler["volumeMounts"] += secret_mounts
    worker["restartPolicy"] = "Always"  # a native sidecar: up before the scheduler, down after it
    scheduler["ports"].append({"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"})
    worker["ports"].append({"name": "worker-metrics", "containerPort": WORKER_METRICS_PORT, "protocol": "TCP"})
    pod = _pod_spec([scheduler], [*volumes, *secret_volumes], spec.termination_grace_period_seconds,
                    _worker_placement(spec), spec.image_pull_secrets)
    pod["initContainers"] = [worker]
    # Replicas on different nodes where there are nodes enough: one drain or node failure takes one
    # warm cache, not all of them (ScheduleAnyway: never a reason to leave a pod pending).
    pod["topologySpreadConstraints"] = [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": selector_labels(owner, "engine")}, "matchLabelKeys": ["pod-template-hash"]}]
    for key, value in (("runtimeClassName", spec.worker.runtime_class_name),
                       ("priorityClassName", spec.worker.priority_class_name), ("affinity", spec.worker.affinity)):
        if value:
            pod[key] = value
    # GPUs are scarce: by default replace pods one at a time instead of surging onto GPUs that may not
    # exist (LeaderWorkerSet and Dynamo's Grove path default to the same); rollout.maxSurge 1 starts
    # the new pod first, for a single replica that cannot go down.
    surge = spec.max_surge
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": surge, "maxUnavailable": 1 - surge}}
    deployment = _deployment(owner, owner.engine_deployment, "engine", spec.replicas, pod,
                             {CACHE_IDENTITY_ANNOTATION: cache_identity_hash(spec)}, strategy)
    # The worker may take its startup (worker.startupProbeSeconds) before the scheduler starts and takes its: a rollout
    # must not be reported failed (the default deadline is 600 s) while a healthy pod still starts.
    deployment["spec"]["progressDeadlineSeconds"] = spec.worker.startup_probe_seconds + SCHEDULER_STARTUP_SECONDS + 300
    deployment["spec"]["template"]["metadata"]["annotations"] |= _scrape_annotations(METRICS_PORT)
    return deployment
