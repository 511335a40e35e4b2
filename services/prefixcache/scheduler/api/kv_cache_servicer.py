"""The KvCache gRPC service: the KV events stream, the cached-blocks snapshot, the cache's diagnosis.

Served beside the Engine API on the scheduler's port. Everything it sends is block hashes, counts and
times: never token ids, text or salts. It covers every tenant's blocks, so with tenants configured each
call takes an admin credential.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc import aio

from prefixcache.protos.engine.v1 import kv_cache_pb2 as pb
from prefixcache.protos.engine.v1 import kv_cache_pb2_grpc as pb_grpc
from prefixcache.scheduler.api.access import require_admin
from prefixcache.scheduler.engine import EngineCore, EngineUnavailable
from prefixcache.scheduler.kv_cache import BlocksRemoved, BlocksStored, Diagnosis, KvEventBatch
from prefixcache.scheduler.tenancy import TenantRegistry

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KvCache"].full_name


class KvCacheServicer(pb_grpc.KvCacheServicer):
    def __init__(self, engine: EngineCore, registry: TenantRegistry | None = None) -> None:
        self._engine = engine
        self._registry = registry
        self._closed = asyncio.Event()

    def close(self) -> None:
        """End every KV events stream (the server is stopping); new ones end at once."""
        self._closed.set()

    async def SubscribeKvEvents(self, request: pb.SubscribeKvEventsRequest,
                                context: aio.ServicerContext) -> AsyncIterator[pb.KvEventsMessage]:
        await require_admin(self._registry, context, "the KV events stream")
        events = self._engine.kv_events
        if request.HasField("from_seq") and request.from_seq > events.next_seq:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"from_seq: {request.from_seq} is beyond the next batch, {events.next_seq} "
                                "(a sequence number of another scheduler process?)")
        cursor = max(request.from_seq, 1) if request.HasField("from_seq") else events.next_seq
        published = asyncio.Event()
        events.add_listener(published.set)
        closing = asyncio.ensure_future(self._closed.wait())
        try:
            while not self._closed.is_set():
                if cursor < events.oldest_seq:  # asked for, or not read before, the buffer dropped them
                    self._engine.metrics.kv_events_missed(events.oldest_seq - cursor)
                    yield pb.KvEventsMessage(gap=pb.KvEventsGap(first_missed_seq=cursor, resume_seq=events.oldest_seq))
                    cursor = events.oldest_seq
                batch = events.get(cursor)
                if batch is None:
                    published.clear()
                    waiting = asyncio.ensure_future(published.wait())
                    await asyncio.wait((waiting, closing), return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                    continue
                yield pb.KvEventsMessage(batch=batch_to_proto(batch))
                cursor += 1
        finally:
            closing.cancel()
            events.remove_listener(published.set)

    async def GetCachedBlocks(self, request: pb.GetCachedBlocksRequest, context: aio.ServicerContext) -> pb.CachedBlocks:
        await require_admin(self._registry, context, "the cached blocks")
        try:
            epoch, seq, hashes = self._engine.cached_blocks()
        except EngineUnavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        return pb.CachedBlocks(epoch=epoch, seq=seq, block_size=self._engine.config.block_size, block_hashes=hashes)

    async def DiagnoseCache(self, request: pb.DiagnoseCacheRequest, context: aio.ServicerContext) -> pb.CacheDiagnosis:
        await require_admin(self._registry, context, "the cache's diagnosis")
        if request.window < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"window: must be >= 0 (0: every lookup kept), got {request.window}")
        try:
            max_window = self._engine.lookups.window
            diagnosis = self._engine.diagnose(request.window or max_window)
        except EngineUnavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        info = self._engine.worker_info
        return diagnosis_to_proto(diagnosis, max_window, info.num_kv_blocks, self._engine.config.block_size,
                                  info.kv_bytes_per_token)


def batch_to_proto(batch: KvEventBatch) -> pb.KvEventBatch:
    message = pb.KvEventBatch(seq=batch.seq, epoch=batch.epoch, published_at_unix_nano=batch.at_ns)
    for event in batch.events:
        if isinstance(event, BlocksStored):
            message.events.add(stored=pb.BlocksStored(
                block_hashes=event.block_hashes, parent_block_hash=event.parent_hash or b"",
                block_size=event.block_size, token_count=event.token_count, lora=event.lora,
                multimodal=event.multimodal))
        elif isinstance(event, BlocksRemoved):
            message.events.add(removed=pb.BlocksRemoved(block_hashes=event.block_hashes))
        else:
            message.events.add(cleared=pb.CacheCleared())
    return message


def diagnosis_to_proto(diagnosis: Diagnosis, max_window: int, num_blocks: int, block_size: int,
                       kv_bytes_per_token: int) -> pb.CacheDiagnosis:
    message = pb.CacheDiagnosis(
        lookups=diagnosis.lookups, max_window=max_window, queried_tokens=diagnosis.queried_tokens,
        hit_tokens=diagnosis.hit_tokens, hit_rate=diagnosis.hit_rate, miss_tokens=diagnosis.miss_tokens,
        evicted_lookups=diagnosis.evicted_lookups, evicted_miss_share=diagnosis.evicted_miss_share,
        top_evicted_prefixes=[pb.PrefixCount(first_block_hash=block_hash, count=count)
                              for block_hash, count in diagnosis.top_evicted_prefixes],
        what_if=[pb.WhatIf(memory_factor=factor, hit_rate=rate) for factor, rate in diagnosis.what_if],
        verdict=diagnosis.verdict, num_blocks=num_blocks, block_size=block_size, kv_bytes_per_token=kv_bytes_per_token,
    )
    if diagnosis.median_evicted_age_s is not None:
        message.median_evicted_age_s = diagnosis.median_evicted_age_s
    if diagnosis.recommended_factor is not None:
        message.recommended_memory_factor = diagnosis.recommended_factor
    return message
