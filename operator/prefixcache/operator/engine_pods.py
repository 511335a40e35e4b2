"""The engine: a Deployment of scheduler+worker pods, and its PodDisruptionBudget.

A scheduler owns the KV cache of exactly one worker (its block table is that worker's memory), so the two
share a pod and talk over loopback; scaling adds whole scheduler+worker pairs, each with its own cache.
The worker is a native sidecar (an init container with restartPolicy Always, Kubernetes >= 1.29): it is
SERVING before the scheduler starts, and it gets SIGTERM only after the scheduler has drained, so in-flight
requests finish on a live worker.
The worker listens on loopback only: its scheduler alone can drive it (a foreign ExecuteStep would
overwrite cached KV, a foreign InitializeCache wipe it). Kubernetes' gRPC probes reach neither loopback
nor TLS, so the worker and the scheduler also serve their health statuses alone on a plaintext port.
With `tenants`, the scheduler reads the tenants file from its mounted Secret (and again when the Secret
changes); with `tls`, it serves the Engine API over TLS from a mounted kubernetes.io/tls Secret.
"""
from __future__ import annotations

from typing import Any

from prefixcache.operator.config_maps import ADMINS_FILE
from prefixcache.operator.owner import Owner, object_metadata, selector_labels
from prefixcache.operator.pods import (
    deployment,
    model_dir,
    model_volumes,
    pod_spec,
    scrape_annotations,
    service_container,
)
from prefixcache.operator.ports import (
    ENGINE_PORT,
    METRICS_PORT,
    SCHEDULER_HEALTH_PORT,
    TOKENIZER_PORT,
    WORKER_HEALTH_PORT,
    WORKER_METRICS_PORT,
    WORKER_PORT,
)
from prefixcache.operator.rollout_hashes import CACHE_IDENTITY_ANNOTATION, cache_identity_hash
from prefixcache.operator.spec import Placement, PrefixCacheSpec, Resources

ENGINE_SERVICE = "prefixcache.engine.v1.Engine"  # the Engine API's gRPC name, as its health service
WORKER_GRACE_SECONDS = 10  # a running step's time to finish once the worker gets SIGTERM
SCHEDULER_STARTUP_SECONDS = 300
# Requests of a worker that sets none: the host memory of the process (torch, the CUDA context, the
# weights on their way to the GPU) and, on CPU, its KV cache; enough for the embedded model: set
# worker.resources.requests for larger ones.
WORKER_BASE_MEMORY_BYTES = 2 * 2**30
WORKER_CPU = {True: "1", False: "2"}  # with a GPU, without
# Secrets are mounted as directories, never by subPath: the kubelet updates those, so keys and
# certificates rotate without a restart.
TENANTS_DIR = "/etc/prefixcache/tenants"
TENANTS_FILE = "tenants.json"
OPERATOR_ADMIN_DIR = "/etc/prefixcache/operator-admin"  # the operator's admin key hash (admin_key.py)
SALT_KEY_DIR = "/etc/prefixcache/salt-key"
SALT_KEY_FILE = "key"
ENGINE_TLS_DIR = "/etc/prefixcache/tls"


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
            "--grace", str(WORKER_GRACE_SECONDS), "--model-dir", model_dir(spec),
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


def disruption_budget(owner: Owner) -> dict[str, Any]:
    """At most one engine pod down by a voluntary disruption (a drain, an upgrade) at a time: the
    other replicas keep their warm caches and serve."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": object_metadata(owner, owner.engine_deployment, "engine"),
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


def engine_deployment(owner: Owner, spec: PrefixCacheSpec, operator_admin: bool) -> dict[str, Any]:
    # Ready while the Engine can serve: the scheduler's Engine health drops while a lost worker is replaced.
    scheduler = service_container(owner, "scheduler", spec.image, spec, _scheduler_args(owner, spec, operator_admin),
                                  ENGINE_PORT,
                                  startup_seconds=SCHEDULER_STARTUP_SECONDS, resources=spec.scheduler_resources,
                                  ready_service=ENGINE_SERVICE,
                                  health_port=SCHEDULER_HEALTH_PORT)
    volumes, mounts = model_volumes(spec)
    # The worker loads weights and may compile kernels before it reports SERVING: allow ten minutes.
    worker = service_container(owner, "worker", spec.worker.image, spec, _worker_args(spec), None,
                               startup_seconds=spec.worker.startup_probe_seconds, resources=_worker_resources(spec),
                               health_port=WORKER_HEALTH_PORT, health_port_name="worker-health")
    worker["volumeMounts"] += mounts
    secret_volumes, secret_mounts = _scheduler_secrets(owner, spec, operator_admin)
    scheduler["volumeMounts"] += secret_mounts
    worker["restartPolicy"] = "Always"  # a native sidecar: up before the scheduler, down after it
    scheduler["ports"].append({"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"})
    worker["ports"].append({"name": "worker-metrics", "containerPort": WORKER_METRICS_PORT, "protocol": "TCP"})
    pod = pod_spec([scheduler], [*volumes, *secret_volumes], spec.termination_grace_period_seconds,
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
    engine = deployment(owner, owner.engine_deployment, "engine", spec.replicas, pod,
                        {CACHE_IDENTITY_ANNOTATION: cache_identity_hash(spec)}, strategy)
    # The worker may take its startup (worker.startupProbeSeconds) before the scheduler starts and takes its: a rollout
    # must not be reported failed (the default deadline is 600 s) while a healthy pod still starts.
    engine["spec"]["progressDeadlineSeconds"] = spec.worker.startup_probe_seconds + SCHEDULER_STARTUP_SECONDS + 300
    engine["spec"]["template"]["metadata"]["annotations"] |= scrape_annotations(METRICS_PORT)
    return engine
