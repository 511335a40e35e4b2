"""The tokenizer: a Deployment of stateless tokenizer pods, shared by every engine pod. It holds no
cache, so it rolls with the environment ConfigMap."""
from __future__ import annotations

from typing import Any

from prefixcache.operator.owner import Owner
from prefixcache.operator.pods import (
    deployment,
    model_dir,
    model_volumes,
    pod_spec,
    scrape_annotations,
    service_container,
)
from prefixcache.operator.ports import TOKENIZER_METRICS_PORT, TOKENIZER_PORT
from prefixcache.operator.rollout_hashes import CONFIG_HASH_ANNOTATION
from prefixcache.operator.spec import PrefixCacheSpec

# A tokenizer pod's termination grace, and its streams' share of it: a stopping tokenizer refuses
# new calls at once (the scheduler's next ones go to another replica) while the detokenizing streams
# of generations in flight run on, as long as their generation lasts, up to this.
TOKENIZER_POD_GRACE_SECONDS = 30
TOKENIZER_GRACE_SECONDS = 25


def tokenizer_deployment(owner: Owner, spec: PrefixCacheSpec, config_hash: str) -> dict[str, Any]:
    volumes, mounts = model_volumes(spec)
    container = service_container(owner, "tokenizer", spec.image, spec,
                                  ["tokenizer", "--port", str(TOKENIZER_PORT),
                                   "--grace", str(TOKENIZER_GRACE_SECONDS),
                                   "--model-dir", model_dir(spec),
                                   "--metrics-port", str(TOKENIZER_METRICS_PORT)],
                                  TOKENIZER_PORT, startup_seconds=120, resources=spec.tokenizer.resources)
    container["volumeMounts"] += mounts
    container["ports"].append({"name": "metrics", "containerPort": TOKENIZER_METRICS_PORT, "protocol": "TCP"})
    pod = pod_spec([container], volumes, TOKENIZER_POD_GRACE_SECONDS, spec.tokenizer.placement, spec.image_pull_secrets)
    tokenizer = deployment(owner, owner.tokenizer_deployment, "tokenizer", spec.tokenizer.replicas, pod,
                           {CONFIG_HASH_ANNOTATION: config_hash})
    tokenizer["spec"]["template"]["metadata"]["annotations"] |= scrape_annotations(TOKENIZER_METRICS_PORT)
    return tokenizer
