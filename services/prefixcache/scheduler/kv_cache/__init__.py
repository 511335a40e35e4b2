"""The scheduler's KV cache: block pool, free queue and the prefix-caching manager.

Pure Python with no torch, triton or grpc imports (enforced by import-linter), so the scheduler
image stays small and this logic is testable anywhere.
"""
from prefixcache.scheduler.kv_cache.block_pool import BlockPool, EvictionBatch, EvictionEvent
from prefixcache.scheduler.kv_cache.free_queue import FreeBlockQueue
from prefixcache.scheduler.kv_cache.manager import (
    CacheAccount,
    CacheStats,
    KVCacheManager,
    KVRequest,
    MissReason,
)

__all__ = ["BlockPool", "CacheAccount", "CacheStats", "EvictionBatch", "EvictionEvent", "FreeBlockQueue",
           "KVCacheManager", "KVRequest", "MissReason"]
