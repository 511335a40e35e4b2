"""The benchmark's view of an Engine endpoint: the only bench module that touches protobuf."""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc import aio

from prefixcache.bench.metrics import RequestRecord
from prefixcache.bench.workloads import BenchRequest
from prefixcache.protos.engine.v1 import engine_pb2, engine_pb2_grpc
from prefixcache.rpc.client import open_channel


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the benchmark needs to know about the engine it drives."""

    model_id: str
    dtype: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    prefix_caching_enabled: bool

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_kv_blocks


class EngineEndpoint:
    """A channel to one Engine service, closed by `async with`."""

    def __init__(self, target: str, request_timeout_s: float = 600.0) -> None:
        self.target = target
        self._request_timeout_s = request_timeout_s
        self._channel: aio.Channel = open_channel(target)
        self._stub = engine_pb2_grpc.EngineStub(self._channel)
        # Workload request ids repeat from run to run; the server keys requests by id, so two benchmark
        # runs against one engine must not send the same ones.
        self._id_prefix = f"bench-{secrets.token_hex(4)}-"

    async def __aenter__(self) -> EngineEndpoint:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._channel.close()

    async def describe(self) -> EngineFacts:
        d = await self._stub.Describe(engine_pb2.DescribeRequest(), timeout=30)
        return EngineFacts(
            model_id=d.model_id,
            dtype=d.dtype,
            vocab_size=d.vocab_size,
            max_model_len=d.max_model_len,
            block_size=d.block_size,
            num_kv_blocks=d.num_kv_blocks,
            prefix_caching_enabled=d.prefix_caching_enabled,
        )

    async def evictions(self) -> int:
        stats = await self._stub.GetCacheStats(engine_pb2.GetCacheStatsRequest(), timeout=30)
        return stats.evictions

    async def reset_prefix_cache(self) -> bool:
        reply = await self._stub.ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(), timeout=30)
        return reply.reset

    async def stream(self, request: BenchRequest, salt: str, clock: Callable[[], float]) -> RequestRecord:
        """Send `request` greedily with `ignore_eos` (so every run generates the same token counts)
        and record when each streamed message arrived; a failed call is recorded, not raised."""
        message = engine_pb2.GenerateRequest(
            request_id=self._id_prefix + request.request_id,
            token_ids=engine_pb2.TokenIds(ids=request.prompt_token_ids),
            sampling=engine_pb2.SamplingOptions(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True),
            cache_salt=salt,
        )
        record = RequestRecord(request_id=request.request_id, sent_s=clock())
        try:
            async for response in self._stub.Generate(message, timeout=self._request_timeout_s):
                now = clock()
                if response.token_ids:
                    record.chunks.append((now, len(response.token_ids)))
                if response.cache_account.miss_reason:
                    record.miss_reason = response.cache_account.miss_reason
                if response.HasField("usage"):
                    record.prompt_tokens = response.usage.prompt_tokens
                    record.cached_tokens = response.usage.cached_tokens
                    record.completion_tokens = response.usage.completion_tokens
                if response.finish_reason:
                    record.finish_reason = engine_pb2.FinishReason.Name(response.finish_reason)
            record.finished_s = clock()
        except grpc.RpcError as error:
            record.error = f"{error.code().name}: {error.details()}"
        return record
