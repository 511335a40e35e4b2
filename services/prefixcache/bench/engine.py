"""The benchmark's view of an Engine: the shared client, plus the facts a run is planned with and the
recording of each request's stream."""
from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from prefixcache.bench.metrics import RequestRecord
from prefixcache.bench.workloads import BenchRequest
from prefixcache.client import FINISH_REASON_NAMES, EngineClient, build_request
from prefixcache.protos.engine.v1 import engine_pb2


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the benchmark needs to know about the engine it drives (the JSON report's `engine`)."""

    model_id: str
    dtype: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    prefix_caching_enabled: bool

    @classmethod
    def of(cls, description: engine_pb2.EngineDescription) -> EngineFacts:
        return cls(
            model_id=description.model_id,
            dtype=description.dtype,
            vocab_size=description.vocab_size,
            max_model_len=description.max_model_len,
            block_size=description.block_size,
            num_kv_blocks=description.num_kv_blocks,
            prefix_caching_enabled=description.prefix_caching_enabled,
        )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_size * self.num_kv_blocks


class EngineEndpoint(EngineClient):
    """The Engine client as the driver's `StreamingEndpoint`, closed by `async with`."""

    def __init__(self, target: str, request_timeout_s: float = 600.0) -> None:
        super().__init__(target)
        self._request_timeout_s = request_timeout_s
        # Workload request ids repeat from run to run; the server keys requests by id, so two benchmark
        # runs against one engine must not send the same ones.
        self._id_prefix = f"bench-{secrets.token_hex(4)}-"

    async def facts(self) -> EngineFacts:
        return EngineFacts.of(await self.describe())

    async def evictions(self) -> int:
        return (await self.cache_stats()).evictions

    async def stream(self, request: BenchRequest, salt: str, clock: Callable[[], float]) -> RequestRecord:
        """Send `request` greedily with `ignore_eos` (so every run generates the same token counts)
        and record when each streamed message arrived; a failed call is recorded, not raised."""
        message = build_request(
            token_ids=request.prompt_token_ids, request_id=self._id_prefix + request.request_id,
            max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True, cache_salt=salt,
        )
        record = RequestRecord(request_id=request.request_id, sent_s=clock())
        try:
            async for response in self.generate(message, self._request_timeout_s):
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
                    record.finish_reason = FINISH_REASON_NAMES[response.finish_reason]
            record.finished_s = clock()
        except grpc.RpcError as error:
            record.error = f"{error.code().name}: {error.details()}"
        return record
