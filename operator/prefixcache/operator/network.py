"""Who reaches which pod: the Services in front of the engine and tokenizer pods, and the
NetworkPolicies that let the engine pods be reached on the Engine API, metrics and health ports only,
and the tokenizer by the engine pods only."""
from __future__ import annotations

from typing import Any

from prefixcache.operator.owner import Owner, object_metadata, selector_labels
from prefixcache.operator.ports import (
    ENGINE_PORT,
    METRICS_PORT,
    SCHEDULER_HEALTH_PORT,
    TOKENIZER_METRICS_PORT,
    TOKENIZER_PORT,
    WORKER_HEALTH_PORT,
    WORKER_METRICS_PORT,
)


def service(owner: Owner, component: str, name: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": object_metadata(owner, name, component),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner, component),
                 "ports": [{"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP",
                            "appProtocol": "grpc"}]},
    }


def network_policies(owner: Owner) -> list[dict[str, Any]]:
    """Engine pods take the Engine API, metrics and the probes' health ports from anyone (the Engine
    API authenticates its callers), never the worker's port; tokenizer pods take calls from this
    stack's engine pods only, and metrics scrapes from anyone. (Kubernetes always lets a node's kubelet
    probe its pods.)"""
    def policy(component: str, *ingress: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": object_metadata(owner, f"{owner.name}-{component}", component),
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
