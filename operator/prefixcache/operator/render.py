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

One module renders each part: `engine_pods` (the scheduler+worker pods and their disruption budget),
`tokenizer_pods`, `network` (Services and NetworkPolicies), `config_maps`; on top of `pods` (what every
pod shares), `owner` (names, labels, metadata), `ports`, and `rollout_hashes` (what rolls which pods).
The tokenizer is stateless and shared. No function of these modules talks to a cluster; every object
carries an ownerReference to the PrefixCacheDeployment so deleting it garbage-collects the stack.
"""
from __future__ import annotations

from typing import Any

from prefixcache.operator.config_maps import dashboard, env_config_map, operator_admins
from prefixcache.operator.engine_pods import disruption_budget, engine_deployment
from prefixcache.operator.network import network_policies, service
from prefixcache.operator.owner import Owner
from prefixcache.operator.ports import ENGINE_PORT, TOKENIZER_PORT
from prefixcache.operator.rollout_hashes import config_hash
from prefixcache.operator.spec import PrefixCacheSpec
from prefixcache.operator.tokenizer_pods import tokenizer_deployment


def render(owner: Owner, spec: PrefixCacheSpec, operator_admin_hash: str | None = None) -> list[dict[str, Any]]:
    """All objects of the stack, in apply order (config before the pods that read it).
    `operator_admin_hash`: the operator's admin key hash, made an admin of a stack with tenants
    (None, as the chart renders it: no admin but the tenants file's)."""
    env_config = env_config_map(owner, spec)
    admins = [operator_admins(owner, operator_admin_hash)] if spec.tenants and operator_admin_hash else []
    return [
        env_config,
        *admins,
        service(owner, "tokenizer", owner.tokenizer_service, TOKENIZER_PORT),
        tokenizer_deployment(owner, spec, config_hash(env_config["data"])),
        service(owner, "engine", owner.engine_service, ENGINE_PORT),
        engine_deployment(owner, spec, bool(admins)),
        disruption_budget(owner),
        *network_policies(owner),
        dashboard(owner),
    ]
