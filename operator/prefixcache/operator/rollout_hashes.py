"""The hashes on the pod templates, which decide what rolls which pods.

The engine pod template carries the cache identity's hash (`cache_identity`), not the tracing
ConfigMap's, so telemetry never restarts a GPU pod (the engine containers read the new environment at
their next start); the tokenizer, which holds no cache, rolls with the ConfigMap (`config_hash`).
Keys and certificates are Secrets mounted as directories, which the kubelet updates in place: they
rotate without a restart (engine_pods).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from prefixcache.operator.pods import model_dir
from prefixcache.operator.schema import GROUP
from prefixcache.operator.spec import PrefixCacheSpec

CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"  # the tokenizer's: its environment (tracing)
CACHE_IDENTITY_ANNOTATION = f"{GROUP}/cache-identity"  # the engine's: what its cached blocks mean (cache_identity)

# What Go's encoding/json escapes inside strings beyond JSON's own rules (HTML-safe output).
_GO_JSON_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",
                                  "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _go_json(value: Any) -> str:
    """The bytes Helm's `toJson` writes (Go's json.Marshal): compact, keys sorted, UTF-8 kept as is,
    and <, >, & and the line and paragraph separators escaped. The chart hashes its config this way,
    so the chart and the operator roll pods for the same changes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).translate(_GO_JSON_ESCAPES)


def config_hash(env: Mapping[str, str]) -> str:
    """The hash of the environment ConfigMap's data, for the tokenizer's pod template."""
    return hashlib.sha256(_go_json(env).encode()).hexdigest()


def cache_identity(spec: PrefixCacheSpec) -> dict[str, Any]:
    """What decides what an engine pod's cached blocks mean and where they live: the weights (model
    directory, claim, worker image), how blocks are cut and hashed, the numerics (dtype, attention
    backend, device) and the KV budget. Its hash is on the engine pod template; a change to it is a
    change of the template, and so rolls the GPU pods, as it must (their caches would be wrong or
    misplaced). The Deployment rolls for other template changes too (images, resources, placement,
    maxNumSeqs, the grace period: each needs a new process); never for tracing, replicas, the
    tokenizer's settings, or a rotated key (see the module docstring)."""
    return {"modelDir": model_dir(spec), "claimName": spec.model.claim_name or "",
            "workerImage": spec.worker.image, "blockSize": spec.block_size, "hashAlgorithm": spec.hash_algorithm,
            "enablePrefixCaching": spec.enable_prefix_caching, "dtype": spec.worker.dtype,
            "attentionBackend": spec.worker.attention_backend, "gpus": spec.worker.gpus,
            "kvCacheMemoryBytes": spec.kv_cache_memory_bytes}


def cache_identity_hash(spec: PrefixCacheSpec) -> str:
    return hashlib.sha256(_go_json(cache_identity(spec)).encode()).hexdigest()
