"""What a request's span carries besides its outcome: the request's gen_ai and prefix_cache
attributes, and one event per allocation that evicted cached blocks. Hashes and ids only: never
the prompt text, never the cache salt or tenant."""
from __future__ import annotations

from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.engine import WorkerInfo
from prefixcache.scheduler.kv_cache import EvictionBatch

MAX_HASHES_PER_EVICTION_EVENT = 256


def request_attributes(request_id: str, request: pb.GenerateRequest, config: SchedulerConfig,
                       info: WorkerInfo | None) -> dict[str, object]:
    attributes: dict[str, object] = {
        "gen_ai.provider.name": "prefixcache",  # OpenTelemetry's GenAI conventions require one
        "gen_ai.operation.name": "chat" if request.WhichOneof("prompt") == "chat" else "text_completion",
        "gen_ai.request.id": request_id,
        "prefix_cache.block_size": config.block_size,
        "prefix_cache.hash_algo": config.hash_algo,
        "prefix_cache.enabled": config.enable_prefix_caching,
    }
    if info is not None:
        attributes["gen_ai.request.model"] = info.model_id
    sampling = request.sampling
    if sampling.HasField("max_tokens"):
        attributes["gen_ai.request.max_tokens"] = sampling.max_tokens
    if sampling.HasField("temperature"):
        attributes["gen_ai.request.temperature"] = sampling.temperature
    if sampling.HasField("top_p"):
        attributes["gen_ai.request.top_p"] = sampling.top_p
    return attributes


def eviction_attributes(batch: EvictionBatch) -> dict[str, int | list[str]]:
    """One span event per allocation that evicted: how many blocks, which hashes (the first
    `MAX_HASHES_PER_EVICTION_EVENT`, LRU order), and the requests whose tokens had filled those
    blocks (each once). Both lists stay bounded: an allocation that evicts thousands of blocks
    stored by as many requests must not make a span too large to export."""
    listed = slice(MAX_HASHES_PER_EVICTION_EVENT)
    return {
        "prefix_cache.evicted_blocks": len(batch),
        "prefix_cache.block_hashes": [block_hash.hex() for block_hash in batch.block_hashes[listed]],
        "prefix_cache.storing_request_ids": list(dict.fromkeys(batch.storing_request_ids[listed])),
    }
