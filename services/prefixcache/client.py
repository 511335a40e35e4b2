"""A small async client of the public Engine API, shared by the CLI, the benchmark and the tests.

    async with EngineClient("localhost:50051") as engine:
        request = build_request(text="Hello", max_tokens=16, temperature=0.0)
        async for chunk in engine.generate(request):
            print(chunk.text, end="")
        completion = await engine.complete(request)   # the whole stream, gathered

Against a server with tenants configured, give the tenant's API key (`EngineClient(target,
api_key=...)`: sent as `authorization: Bearer …` metadata on every call) or, for mutual TLS, a client
certificate (`tls=ChannelTls(ca, cert, key)`); `tls=ChannelTls(ca)` alone verifies a TLS server.

Errors are `grpc.aio.AioRpcError` with the server's status code and message.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from prefixcache.protos.common.v1 import chat_pb2, logprobs_pb2
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.protos.engine.v1 import engine_pb2_grpc as pb_grpc
from prefixcache.protos.engine.v1 import kv_cache_pb2 as kv_pb
from prefixcache.protos.engine.v1 import kv_cache_pb2_grpc as kv_pb_grpc
from prefixcache.rpc.client import open_channel
from prefixcache.rpc.tls import ChannelTls

DEFAULT_TARGET = "localhost:50051"
FINISH_REASON_NAMES = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
}


def build_request(
    *,
    text: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[tuple[str, str]] | None = None,
    request_id: str = "",
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    cache_salt: str | None = None,
    tenant: str | None = None,
    lora_adapter: str = "",
    logprobs: int = 0,
) -> pb.GenerateRequest:
    """A GenerateRequest from plain values; give exactly one of text, token_ids, messages.

    `messages` are (role, content) pairs, rendered with the model's chat template server-side.
    """
    if sum(x is not None for x in (text, token_ids, messages)) != 1:
        raise ValueError("give exactly one of text, token_ids, messages")
    request = pb.GenerateRequest(request_id=request_id, lora_adapter=lora_adapter)
    if text is not None:
        request.text = text
    elif token_ids is not None:
        request.token_ids.ids.extend(token_ids)
    else:
        request.chat.CopyFrom(
            chat_pb2.ChatConversation(
                messages=[chat_pb2.ChatMessage(role=role, content=content) for role, content in messages],
                add_generation_prompt=True,
            )
        )
    sampling = request.sampling
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    sampling.top_k = top_k
    sampling.stop.extend(stop)
    sampling.stop_token_ids.extend(stop_token_ids)
    sampling.ignore_eos = ignore_eos
    sampling.logprobs = logprobs
    if cache_salt is not None:
        request.cache_salt = cache_salt
    elif tenant is not None:
        request.tenant = tenant
    return request


@dataclass
class Completion:
    """A whole generation stream, gathered."""

    request_id: str = ""
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: pb.Usage = field(default_factory=pb.Usage)
    cache_account: pb.CacheAccount | None = None
    logprobs: list[logprobs_pb2.TokenLogprobs] = field(default_factory=list)  # one per token id, when asked for
    num_chunks: int = 0

    def add(self, chunk: pb.GenerateResponse) -> None:
        self.request_id = chunk.request_id
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.num_chunks += 1
        if chunk.HasField("cache_account"):
            self.cache_account = chunk.cache_account
        if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self.finish_reason = FINISH_REASON_NAMES[chunk.finish_reason]
            self.usage = chunk.usage

    def as_dict(self) -> dict[str, object]:
        account = self.cache_account
        return {
            "request_id": self.request_id,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            **({"logprobs": [
                {"logprob": entry.logprob, "top": [[top.token_id, top.logprob] for top in entry.top]}
                for entry in self.logprobs
            ]} if self.logprobs else {}),
            "usage": {
                "prompt_tokens": self.usage.prompt_tokens,
                "cached_tokens": self.usage.cached_tokens,
                "completion_tokens": self.usage.completion_tokens,
            },
            "cache": None
            if account is None
            else {field.name: getattr(account, field.name) for field in account.DESCRIPTOR.fields},
        }


class EngineClient:
    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, tls: ChannelTls | None = None):
        self.target = target
        self._channel = open_channel(target, tls)
        self._stub = pb_grpc.EngineStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key is not None else None
        self._kv_cache = kv_pb_grpc.KvCacheStub(self._channel)

    def __repr__(self) -> str:  # never the key
        return f"EngineClient({self.target!r})"

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def generate(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> AsyncIterator[pb.GenerateResponse]:
        """The response stream; cancel it (or leave the loop and close it) to abort the request."""
        return self._stub.Generate(request, timeout=timeout_s, metadata=self._metadata)

    async def complete(self, request: pb.GenerateRequest, timeout_s: float | None = None) -> Completion:
        completion = Completion()
        async for chunk in self.generate(request, timeout_s):
            completion.add(chunk)
        return completion

    async def cache_stats(self) -> pb.CacheStats:
        return await self._stub.GetCacheStats(pb.GetCacheStatsRequest(), timeout=30, metadata=self._metadata)

    async def reset_prefix_cache(self) -> bool:
        reply = await self._stub.ResetPrefixCache(pb.ResetPrefixCacheRequest(), timeout=30, metadata=self._metadata)
        return reply.reset

    async def describe(self) -> pb.EngineDescription:
        return await self._stub.Describe(pb.DescribeRequest(), timeout=30, metadata=self._metadata)

    def kv_events(self, from_seq: int | None = None) -> AsyncIterator[kv_pb.KvEventsMessage]:
        """The KV events stream, from batch `from_seq` (None: the next one published) on, until cancelled."""
        request = kv_pb.SubscribeKvEventsRequest() if from_seq is None else kv_pb.SubscribeKvEventsRequest(from_seq=from_seq)
        return self._kv_cache.SubscribeKvEvents(request, metadata=self._metadata)

    async def cached_blocks(self) -> kv_pb.CachedBlocks:
        return await self._kv_cache.GetCachedBlocks(kv_pb.GetCachedBlocksRequest(), timeout=30, metadata=self._metadata)

    async def diagnose(self, window: int = 0) -> kv_pb.CacheDiagnosis:
        """The cache's diagnosis over the newest `window` first lookups (0: every one the scheduler keeps)."""
        return await self._kv_cache.DiagnoseCache(kv_pb.DiagnoseCacheRequest(window=window), timeout=30,
                                                  metadata=self._metadata)
