"""The scheduler's KV cache: block pool, free queue, the prefix-caching manager, and what explains
it: the eviction history, the KV events stream, LRU stack distances and the log of lookups.

Pure Python with no torch, triton or grpc imports (enforced by import-linter), so the scheduler
image stays small and this logic is testable anywhere.
"""
from prefixcache.scheduler.kv_cache.block_pool import BlockPool
from prefixcache.scheduler.kv_cache.diagnosis import Diagnosis, diagnose
from prefixcache.scheduler.kv_cache.eviction_history import EvictionBatch, EvictionEvent, EvictionRecord, RequestRef
from prefixcache.scheduler.kv_cache.free_queue import FreeBlockQueue
from prefixcache.scheduler.kv_cache.kv_events import BlocksRemoved, BlocksStored, CacheCleared, KvEventBatch, KvEventLog
from prefixcache.scheduler.kv_cache.lookup_log import WHAT_IF_FACTORS, LookupLog, LookupRecord
from prefixcache.scheduler.kv_cache.manager import (
    CacheAccount,
    CacheStats,
    KVCacheManager,
    KVRequest,
    MissReason,
)

__all__ = ["WHAT_IF_FACTORS", "BlockPool", "BlocksRemoved", "BlocksStored", "CacheAccount", "CacheCleared",
           "CacheStats", "Diagnosis", "EvictionBatch", "EvictionEvent", "EvictionRecord", "FreeBlockQueue",
           "KVCacheManager", "KVRequest", "KvEventBatch", "KvEventLog", "LookupLog", "LookupRecord", "MissReason",
           "RequestRef", "diagnose"]
