"""The public Engine gRPC API over EngineCore.

Per Generate call: validate what only the API knows (prompt kind, LoRA, multimodal items, stop
strings), tokenize text or chat through the tokenizer service, admit the request to EngineCore,
then stream each output's token ids with their text (detokenized incrementally by the tokenizer
service), watching for stop strings. Client cancellation and deadlines abort the request in the
engine, which frees its blocks at once.

Each request gets one span carrying the gen_ai and prefix_cache attributes; never the prompt text,
never the cache salt or tenant.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

import grpc
from grpc import aio
from opentelemetry import trace

from prefixcache.block_identity.hashing import BlockExtras, MultiModalItem
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.protos.engine.v1 import engine_pb2_grpc as pb_grpc
from prefixcache.rpc.client import status_of
from prefixcache.rpc.quoting import quoted
from prefixcache.rpc.tracing import SpanRegistry, iterate_in_context, quiet_span
from prefixcache.scheduler.engine_core import (
    EngineCore,
    EngineRequest,
    EngineUnavailable,
    QueueFull,
    RequestOutput,
    RequestRejected,
)
from prefixcache.scheduler.kv_cache import CacheAccount, EvictionBatch
from prefixcache.scheduler.metrics import FINISH_ERROR
from prefixcache.scheduler.request import FINISH_ABORT, FINISH_STOP
from prefixcache.scheduler.stop_strings import StopStringMatcher
from prefixcache.scheduler.tenancy import TenantSalts
from prefixcache.scheduler.tokenizer_client import StreamingDetokenizer, TokenizerClient, TokenizerMismatch
from prefixcache.step.codec import logprobs_to_proto
from prefixcache.step.messages import SamplingParams

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
# EngineCore's field names → the public API's.
PUBLIC_FIELDS = {
    "max_tokens": "sampling.max_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "stop_token_ids": "sampling.stop_token_ids",
    "logprobs": "sampling.logprobs",
    "multimodal": "multimodal_items",
}
log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)


# Isolation keys are hashed into every request's first block and held per request: cap them well
# above any sensible key (a 256-bit salt is 64 hex characters) so that one request cannot make the
# server hash and hold megabytes.
MAX_CACHE_SALT_BYTES = 1024
MAX_TENANT_BYTES = 256
# A request id is echoed in every response and recorded in spans and eviction events.
MAX_REQUEST_ID_BYTES = 256
# Stop strings are matched on the event loop that serves every request, at a cost per token that
# grows with their number: a bound keeps one request from slowing all the others.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024


class InvalidRequest(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class EngineOptions:
    """What the servicer reports and checks beyond EngineCore's own configuration."""

    lora_adapters: tuple[str, ...] = ()  # the base model only, for now
    multimodal: bool = False


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(
        self,
        engine: EngineCore,
        tokenizer: TokenizerClient,
        tenants: TenantSalts | None = None,
        options: EngineOptions = EngineOptions(),
        request_spans: SpanRegistry | None = None,
    ):
        self._request_spans = request_spans or SpanRegistry()
        self._engine = engine
        # Ids of open Generate calls. An id stays taken until its call ends, not only until the
        # engine finishes the request: the call still aborts by id when it stops or is cancelled.
        self._open_request_ids: set[str] = set()
        self._no_generate_calls = asyncio.Event()
        self._no_generate_calls.set()
        self._tokenizer = tokenizer
        self._tenants = tenants or TenantSalts()
        self._options = options

    # ---- Generate -------------------------------------------------------------------------------

    async def wait_generate_calls_done(self, timeout_s: float) -> bool:
        """Until every Generate call has sent its last response (True) or `timeout_s` passed.

        The engine is idle once it has queued each request's final output, but the call still
        needs the tokenizer to turn that output into text: close the clients only after this.
        """
        try:
            await asyncio.wait_for(self._no_generate_calls.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def Generate(self, request: pb.GenerateRequest, context: aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        request_id = request.request_id or uuid.uuid4().hex
        if (size := len(request_id.encode())) > MAX_REQUEST_ID_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: {size} bytes, more than the {MAX_REQUEST_ID_BYTES} allowed")
        if request_id in self._open_request_ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request_id: {quoted(request_id)} is already in flight")
        self._open_request_ids.add(request_id)
        self._no_generate_calls.clear()
        try:
            # Closed explicitly, innermost first, even when gRPC drops the stream at a yield: left to
            # the garbage collector, an outer layer closes before an inner one, and the request's span
            # would end before its outcome is written on it.
            async with contextlib.aclosing(self._generate(request_id, request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._open_request_ids.discard(request_id)
            if not self._open_request_ids:
                self._no_generate_calls.set()

    async def _generate(
        self, request_id: str, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        # The span is current only while each response is computed (see `iterate_in_context`).
        with quiet_span(_tracer, "generate", current=False, attributes=self._request_attributes(request_id, request)) as span:
            responses = iterate_in_context(self._responses(request_id, request, context, span),
                                           trace.set_span_in_context(span))
            async with contextlib.aclosing(responses):  # closes `_responses`, which annotates the span
                async for response in responses:
                    yield response

    async def _responses(
        self, request_id: str, request: pb.GenerateRequest, context: aio.ServicerContext, span: trace.Span
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            self._check_options(request)
            tokenizer_id = self._expected_tokenizer_id()  # the same for the prompt and the reply
            prompt_ids = await self._prompt_ids(request, tokenizer_id)
            engine_request = self._engine_request(request_id, request, prompt_ids)
            detokenizer = self._tokenizer.detokenizer(prompt_ids, tokenizer_id)
            if request.WhichOneof("prompt") == "token_ids":  # the tokenizer is checked before the prefill
                self._engine.validate(engine_request)  # the ids, before the tokenizer sees them
                await detokenizer.open()
            abandoned: list[RequestOutput] = []  # outputs never read, if the engine saw the call leave first
            try:
                outputs = self._engine.add_request(engine_request, on_abandon=abandoned.append)
            except Exception:
                await detokenizer.close()
                raise
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except RequestRejected as error:
            field = public_field(error.field, request)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {error.message}")
        except QueueFull as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        except (EngineUnavailable, TokenizerMismatch) as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except grpc.RpcError as error:  # from the tokenizer service
            code, details = status_of(error)
            if code == grpc.StatusCode.INVALID_ARGUMENT and request.WhichOneof("prompt") == "chat":
                await context.abort(code, details)  # bad chat messages: the message names the field
            await context.abort(grpc.StatusCode.UNAVAILABLE, _tokenizer_failed(request_id, code, details))
        span.set_attribute("gen_ai.usage.input_tokens", len(prompt_ids))

        stream = _Stream(request_id, self._engine, detokenizer, list(request.sampling.stop))
        self._request_spans.add(request_id, span)
        failed = False  # the call ends UNAVAILABLE for a fault of ours the engine did not see
        lost = False  # the engine lost the worker: it ended the request and counted it
        try:
            async for response in stream.responses(outputs):
                yield response
        except EngineUnavailable as error:
            lost = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except TokenizerMismatch as error:
            failed = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        except grpc.RpcError as error:
            failed = True
            await context.abort(grpc.StatusCode.UNAVAILABLE, _tokenizer_failed(request_id, *status_of(error)))
        finally:
            if not stream.finished:  # cancelled by the client, deadline, or an error above
                self._engine.abort(request_id, FINISH_ERROR if failed else FINISH_ABORT)  # if still running
                # Closing the engine's stream now, not when it is collected, hands its unread outputs
                # to `abandoned`: the final one holds the reason to count.
                await outputs.aclose()
                for output in abandoned:
                    stream.absorb(output)
                stream.end_unread(FINISH_ERROR if failed or lost else None, count=not lost)
            self._request_spans.remove(request_id)
            await stream.close()
            stream.annotate(span)

    def _check_options(self, request: pb.GenerateRequest) -> None:
        """What EngineCore cannot check: fields the public API adds."""
        if request.lora_adapter and request.lora_adapter not in self._options.lora_adapters:
            available = ", ".join(self._options.lora_adapters) or "none"
            raise InvalidRequest("lora_adapter", f"unknown adapter {quoted(request.lora_adapter)} (available: {available})")
        if request.multimodal_items and not self._options.multimodal:
            raise InvalidRequest("multimodal_items", "the model is text-only")
        if len(request.sampling.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("sampling.stop", f"{len(request.sampling.stop)} stop strings, more than the "
                                                  f"{MAX_STOP_STRINGS} allowed")
        for index, stop in enumerate(request.sampling.stop):
            if not stop:
                raise InvalidRequest(f"sampling.stop[{index}]", "must not be empty")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequest(f"sampling.stop[{index}]", f"{len(stop)} characters, more than the "
                                                               f"{MAX_STOP_STRING_CHARS} allowed")
        # Neither value is quoted back: a salt is a secret, and a tenant name is as good as one.
        for name, limit in (("cache_salt", MAX_CACHE_SALT_BYTES), ("tenant", MAX_TENANT_BYTES)):
            if not request.HasField(name):
                continue
            size = len(getattr(request, name).encode())
            if size == 0:
                raise InvalidRequest(name, "must not be empty when set")
            if size > limit:
                raise InvalidRequest(name, f"{size} bytes, more than the {limit} allowed")

    async def _prompt_ids(self, request: pb.GenerateRequest, tokenizer_id: str) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            return list(request.token_ids.ids)
        if kind == "text":
            if not request.text:
                raise InvalidRequest("text", "the prompt is empty")
            return await self._tokenizer.tokenize_text(request.text, tokenizer_id)
        if kind == "chat":
            return await self._tokenizer.tokenize_chat(request.chat, tokenizer_id)
        raise InvalidRequest("prompt", "set one of text, token_ids or chat")

    def _expected_tokenizer_id(self) -> str:
        info = self._engine.worker_info
        return info.tokenizer_id if info is not None else ""

    def _engine_request(self, request_id: str, request: pb.GenerateRequest, prompt_ids: list[int]) -> EngineRequest:
        options = request.sampling
        sampling = SamplingParams(
            temperature=options.temperature if options.HasField("temperature") else 1.0,
            top_p=options.top_p if options.HasField("top_p") else 1.0,
            top_k=options.top_k,
            seed=options.seed if options.HasField("seed") else None,
            logprobs=options.logprobs,
        )
        if options.HasField("max_tokens"):
            max_tokens = options.max_tokens
        else:  # as many as fit in both the model's length and the KV cache
            max_tokens = max(1, self._capacity_tokens() - len(prompt_ids))
        salt = None
        if request.HasField("cache_salt"):
            salt = request.cache_salt
        elif request.HasField("tenant"):
            salt = self._tenants.salt_for(request.tenant)
        return EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            stop_token_ids=tuple(options.stop_token_ids),
            ignore_eos=options.ignore_eos,
            extras=BlockExtras(lora_name=request.lora_adapter or None,
                               mm_items=_multimodal_items(request.multimodal_items, len(prompt_ids)), cache_salt=salt),
        )

    def _capacity_tokens(self) -> int:
        info = self._engine.worker_info
        if info is None:
            return self._engine.max_model_len
        return min(self._engine.max_model_len, info.num_kv_blocks * self._engine.config.block_size)

    def _request_attributes(self, request_id: str, request: pb.GenerateRequest) -> dict[str, object]:
        config = self._engine.config
        info = self._engine.worker_info
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

    # ---- cache and description ------------------------------------------------------------------

    async def GetCacheStats(self, request: pb.GetCacheStatsRequest, context: aio.ServicerContext) -> pb.CacheStats:
        try:
            stats = self._engine.cache_stats()
        except EngineUnavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
        config = self._engine.config
        return pb.CacheStats(
            block_size=config.block_size,
            hash_algo=config.hash_algo,
            prefix_caching_enabled=config.enable_prefix_caching,
            num_blocks=stats.num_blocks,
            free_blocks=stats.free_blocks,
            used_blocks=stats.used_blocks,
            cached_blocks=stats.cached_blocks,
            query_tokens=stats.queries,
            hit_tokens=stats.hits,
            evictions=stats.evictions,
            running_requests=self._engine.num_running,
            waiting_requests=self._engine.num_waiting,
        )

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        return pb.ResetPrefixCacheResponse(reset=self._engine.reset_prefix_cache())

    async def Describe(self, request: pb.DescribeRequest, context: aio.ServicerContext) -> pb.EngineDescription:
        info = self._engine.worker_info
        if info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is not available")
        config = self._engine.config
        return pb.EngineDescription(
            model_id=info.model_id,
            dtype=info.dtype,
            vocab_size=info.vocab_size,
            max_model_len=self._engine.max_model_len,
            block_size=config.block_size,
            hash_algo=config.hash_algo,
            prefix_caching_enabled=config.enable_prefix_caching,
            num_kv_blocks=info.num_kv_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            lora_adapters=self._options.lora_adapters,
            multimodal=self._options.multimodal,
        )


class _Stream:
    """Turns one request's engine outputs into responses: text, stop strings, the final summary."""

    def __init__(self, request_id: str, engine: EngineCore, detokenizer: StreamingDetokenizer, stops: list[str]):
        self._request_id = request_id
        self._engine = engine
        self._detokenizer = detokenizer
        self._stops = StopStringMatcher(stops)
        # The stream, not the engine, tells the metrics why the request ended: as the client was
        # told, which a stop string or a failed tokenizer can make differ from the engine's reason.
        self._engine_finish_reason: str | None = None  # of the final output, once absorbed
        self._unread_reason: str | None = None  # why a stream that ended without its final response ended
        self.finished = False
        self.last: RequestOutput | None = None
        self.account: CacheAccount | None = None
        self.evictions: list[EvictionBatch] = []
        self.delivered_tokens = 0  # token ids sent to the client

    async def responses(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[pb.GenerateResponse]:
        """Responses for the engine's outputs. Once a stop string matched, the tokens the engine
        generated meanwhile (it runs ahead of detokenizing) are dropped: the client gets the ids up
        to the one completing the match, and the usage counts those."""
        async for output in outputs:
            self.last = output
            self.absorb(output)
            if self._stops.stopped:
                if output.finished:
                    yield self._final(output, "", with_tokens=False)
                    return
                continue
            # The token that stopped the request (EOS or a stop token id) stays in the ids but adds no
            # text, as in vLLM: a stop token's text is a delimiter, not part of the answer.
            stopped_by_token = output.finished and output.finish_reason == FINISH_STOP
            text_ids = output.new_token_ids[:-1] if stopped_by_token else output.new_token_ids
            new_text = await self._detokenizer.push(text_ids, last=output.finished)
            text = self._stops.push(new_text, final=output.finished)
            self.delivered_tokens += len(output.new_token_ids)
            if self._stops.stopped:
                # Its final output, with the usage, follows, finished for reason "stop".
                self._engine.abort(self._request_id, FINISH_STOP)
            if output.finished:
                yield self._final(output, text)
                return
            if output.new_token_ids or text or output.cache_account is not None:
                yield self._response(output, text, None)

    def _final(self, output: RequestOutput, text: str, with_tokens: bool = True) -> pb.GenerateResponse:
        """The last response. A matched stop string makes the reason "stop", also where the engine
        had finished the request first (it runs ahead of detokenizing)."""
        self.finished = True
        reason = FINISH_STOP if self._stops.stopped else output.finish_reason
        self._engine.metrics.request_finished(reason)
        return self._response(output, text, reason, with_tokens)

    def end_unread(self, told: str | None, count: bool = True) -> None:
        """For a stream that ended without its final response: its reason is `told`, what the call
        ended with, if it failed; otherwise (cancelled, deadline) the reason of the engine's final
        output, absorbed since, if there was one. Counted unless the engine counted it already."""
        self._unread_reason = told or (FINISH_STOP if self._stops.stopped else self._engine_finish_reason)
        if count and self._unread_reason is not None:
            self._engine.metrics.request_finished(self._unread_reason)

    def _response(self, output: RequestOutput, text: str, reason: str | None,
                  with_tokens: bool = True) -> pb.GenerateResponse:
        response = pb.GenerateResponse(request_id=self._request_id, text=text)
        if with_tokens:
            response.token_ids.extend(output.new_token_ids)
            response.logprobs.extend(logprobs_to_proto(logprobs) for logprobs in output.logprobs)
        if output.cache_account is not None:
            response.cache_account.CopyFrom(account_to_proto(output.cache_account))
        if reason is not None:
            response.finish_reason = FINISH_REASONS[reason]
        if output.usage is not None:
            response.usage.CopyFrom(
                pb.Usage(
                    prompt_tokens=output.usage.prompt_tokens,
                    cached_tokens=output.usage.cached_tokens,
                    completion_tokens=self.delivered_tokens,
                )
            )
        return response

    async def close(self) -> None:
        await self._detokenizer.close()

    def annotate(self, span: trace.Span) -> None:
        """Usage, cache account and evictions on the request's span (hashes only, never text).

        A stream that ended before its final response reports the tokens it delivered and the
        reason it was counted under ("error" for a failed call, "abort" for a client that left)."""
        span.set_attribute("gen_ai.usage.output_tokens", self.delivered_tokens)
        if self.account is not None:
            span.set_attribute("gen_ai.usage.cache_read.input_tokens", self.account.hit_tokens)
        if self._stops.stopped:
            reason = "stop"
        elif self.finished and self.last is not None and self.last.finish_reason is not None:
            reason = self.last.finish_reason
        else:
            reason = self._unread_reason or FINISH_ABORT
        span.set_attribute("gen_ai.response.finish_reasons", [reason])
        if self.account is not None:
            span.set_attribute("prefix_cache.blocks_queried", self.account.queried_blocks)
            span.set_attribute("prefix_cache.blocks_matched", self.account.hit_blocks)
            span.set_attribute("prefix_cache.miss_reason", self.account.miss_reason)
        for batch in self.evictions if span.is_recording() else ():
            span.add_event("prefix_cache.eviction", eviction_attributes(batch), timestamp=batch.evicted_at_ns)

    def absorb(self, output: RequestOutput | None) -> None:
        """Take an output's cache account and evictions for the span: each output streamed, and
        those the stream never read (the call ended first: cancelled before its first token, say)."""
        if output is None:
            return
        if output.finish_reason is not None:
            self._engine_finish_reason = output.finish_reason
        self.evictions.extend(output.evictions)
        if output.cache_account is not None:
            self.account = output.cache_account


MAX_HASHES_PER_EVICTION_EVENT = 256


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


def _tokenizer_failed(request_id: str, code: grpc.StatusCode, details: str) -> str:
    """The client's message for a failed tokenizer call. gRPC's details can name the tokenizer's
    address, which stays in the scheduler's log."""
    log.warning("request %s: tokenizer call failed: %s: %s", quoted(request_id), code.name, details)
    return f"the tokenizer service failed ({code.name}); retry the request"


def public_field(engine_field: str, request: pb.GenerateRequest) -> str:
    """The GenerateRequest field an EngineCore rejection is about."""
    if engine_field == "prompt_token_ids":  # the prompt, in whichever form the client sent it
        return request.WhichOneof("prompt") or "prompt"
    return PUBLIC_FIELDS.get(engine_field, engine_field)


def account_to_proto(account: CacheAccount) -> pb.CacheAccount:
    return pb.CacheAccount(
        queried_tokens=account.queried_tokens,
        hit_tokens=account.hit_tokens,
        capped_tokens=account.capped_tokens,
        partial_tail_tokens=account.partial_tail_tokens,
        miss_reason=account.miss_reason,
        queried_blocks=account.queried_blocks,
        hit_blocks=account.hit_blocks,
    )


def _multimodal_items(items: Iterable[pb.MultiModalItem], prompt_len: int) -> tuple[MultiModalItem, ...]:
    """The request's multimodal items for the block hashes: each content hash enters the identity
    of every block its placeholder tokens overlap, so the same placeholders with another image
    never share KV."""
    converted: list[MultiModalItem] = []
    previous_end = 0
    for index, item in enumerate(items):
        name = f"multimodal_items[{index}]"
        if not item.content_hash:
            raise InvalidRequest(f"{name}.content_hash", "must not be empty")
        if item.length == 0:
            raise InvalidRequest(f"{name}.length", "must be at least 1")
        if item.offset + item.length > prompt_len:
            raise InvalidRequest(name, f"tokens {item.offset}..{item.offset + item.length - 1} lie past the "
                                       f"prompt's {prompt_len} tokens")
        if item.offset < previous_end:
            raise InvalidRequest(f"{name}.offset", f"{item.offset} is inside or before the previous item, which "
                                                   f"ends at {previous_end}: items must be sorted and must not overlap")
        previous_end = item.offset + item.length
        converted.append(MultiModalItem(item.content_hash, item.offset, item.length))
    return tuple(converted)
