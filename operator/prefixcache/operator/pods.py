"""What the stack's pods share: service containers with their gRPC probes, the pod spec, the model's
volume, scrape annotations, and the Deployment that runs the pods."""
from __future__ import annotations

from typing import Any

from prefixcache.operator.owner import Owner, object_labels, object_metadata, selector_labels
from prefixcache.operator.spec import EMBEDDED, Placement, PrefixCacheSpec, Resources

# Both images bake the embedded model here (`prefixcache model pull` with PREFIXCACHE_HOME=/opt/prefixcache):
# the worker image all of it, the control-plane image the tokenizer's files.
EMBEDDED_MODEL_DIR = "/opt/prefixcache/models/SmolLM2-135M-Instruct"
MODEL_MOUNT = "/models"
RUN_AS_USER = 10001  # the images' unprivileged user


def scrape_annotations(port: int) -> dict[str, str]:
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}


def model_dir(spec: PrefixCacheSpec) -> str:
    if spec.model.source == EMBEDDED:
        return EMBEDDED_MODEL_DIR
    return f"{MODEL_MOUNT}/{spec.model.path}".rstrip("/")


def model_volumes(spec: PrefixCacheSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(pod volumes, container mounts) for the model; the embedded model needs none."""
    if spec.model.source == EMBEDDED:
        return [], []
    volume = {"name": "model",
              "persistentVolumeClaim": {"claimName": spec.model.claim_name, "readOnly": True}}
    return [volume], [{"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}]


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


def service_container(owner: Owner, name: str, image: str, spec: PrefixCacheSpec, args: list[str], port: int | None,
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


def pod_spec(containers: list[dict[str, Any]], volumes: list[dict[str, Any]], grace_seconds: int,
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


def deployment(owner: Owner, name: str, component: str, replicas: int, pod: dict[str, Any],
               annotations: dict[str, str], strategy: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": selector_labels(owner, component)},
        "template": {
            "metadata": {"labels": object_labels(owner, component),
                         "annotations": dict(annotations)},
            "spec": pod,
        },
    }
    if strategy:
        spec["strategy"] = strategy
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": object_metadata(owner, name, component),
            "spec": spec}
