"""The public Engine gRPC API over EngineCore.

Every call first proves who it comes from when tenants are configured (`access.identify`). Per
Generate call: check what only the API knows (prompt kind and size, stop strings, isolation keys, and
the LoRA adapters and multimodal items no served request can use), tokenize text or chat through
the tokenizer service, admit the request to EngineCore within its tenant's limits, then stream each
output's token ids with their text (`stream.ResponseStream`). Client cancellation and deadlines abort
the request in the engine, which frees its blocks at once. Resetting the cache takes an admin; a
tenant's cache statistics are its own counters only.

Each request gets one span carrying the gen_ai and prefix_cache attributes and, with tenants, the
tenant's one-way label; never the prompt text, the cache salt, the tenant's name or a credential.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc import aio
from opentelemetry import trace

from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.protos.engine.v1 import engine_pb2_grpc as pb_grpc
from prefixcache.rpc.client import status_of
from prefixcache.rpc.quoting import quoted
from prefixcache.rpc.tracing import SpanRegistry, iterate_in_context, quiet_span
from prefixcache.scheduler.api.access import (
    OpenCalls,
    TenantBusy,
    TenantCounters,
    engine_request_id,
    identify,
    require_admin,
)
from prefixcache.scheduler.api.codec import (
    DEFAULT_MAX_PROMPT_BYTES,
    MAX_REQUEST_ID_BYTES,
    InvalidRequest,
    PermissionDenied,
    Unimplemented,
    check_prompt_bytes,
    check_served,
    check_stop_strings,
    engine_request,
    public_field,
)
from prefixcache.scheduler.api.isolation import isolation_attributes, request_salt
from prefixcache.scheduler.api.spans import request_attributes, request_span_name, traced_context
from prefixcache.scheduler.api.stream import ResponseStream
from prefixcache.scheduler.engine import EngineCore, EngineUnavailable, QueueFull, RequestOutput, RequestRejected
from prefixcache.scheduler.engine.admission import check_prompt_length
from prefixcache.scheduler.metrics import FINISH_ERROR
from prefixcache.scheduler.request import FINISH_ABORT
from prefixcache.scheduler.tenancy import Identity, TenantRegistry, TenantSalts
from prefixcache.scheduler.tenancy.identity import Role
from prefixcache.scheduler.tokenizer_client import TokenizerClient, TokenizerMismatch

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Engine"].full_name
log = logging.getLogger(__name__)
_tracer = trace.get_tracer(__name__)


class EngineServicer(pb_grpc.EngineServicer):
    def __init__(
        self,
        engine: EngineCore,
        tokenizer: TokenizerClient,
        tenants: TenantSalts | None = None,
        request_spans: SpanRegistry | None = None,
        registry: TenantRegistry | None = None,
        max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES,
    ):
        """`registry`: the configured tenants, whose credentials every call must then carry; without
        it, the local single-user default (`tenants` derives the salts of the `tenant` field)."""
        self._request_spans = request_spans or SpanRegistry()
        self._engine = engine
        self._calls = OpenCalls()
        self._tokenizer = tokenizer
        self._tenants = tenants or TenantSalts()
        self._registry = registry
        self._max_prompt_bytes = max_prompt_bytes
        self._counters: dict[str, TenantCounters] = {}  # by tenant label

    # ---- Generate -------------------------------------------------------------------------------

    async def wait_generate_calls_done(self, timeout_s: float) -> bool:
        """Until every Generate call has sent its last response (True) or `timeout_s` passed.

        The engine is idle once it has queued each request's final output, but the call still
        needs the tokenizer to turn that output into text: close the clients only after this.
        """
        try:
            await asyncio.wait_for(self._calls.none_open.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def Generate(
        self, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        identity = await identify(self._registry, context)
        request_id = request.request_id or uuid.uuid4().hex
        if (size := len(request_id.encode())) > MAX_REQUEST_ID_BYTES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id: {size} bytes, more than the {MAX_REQUEST_ID_BYTES} allowed")
        engine_id = engine_request_id(identity, request_id)
        max_in_flight, max_waiting = self._limits(identity)
        try:
            self._calls.enter(engine_id, request_id, identity, max_in_flight)
        except InvalidRequest as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except TenantBusy as error:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
        try:
            # Closed explicitly, innermost first, even when gRPC drops the stream at a yield: left to
            # the garbage collector, an outer layer closes before an inner one, and the request's span
            # would end before its outcome is written on it.
            call = _Call(request_id, engine_id, identity, max_waiting)
            async with contextlib.aclosing(self._generate(call, request, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self._calls.leave(engine_id, identity)

    def _limits(self, identity: Identity) -> tuple[int | None, int | None]:
        """A tenant's most Generate calls in flight and requests waiting; None: no limit of its own."""
        if identity.role is not Role.TENANT:
            return None, None
        return identity.limits.resolved(self._engine.config)

    async def _generate(
        self, call: _Call, request: pb.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        # The span is current only while each response is computed (see `iterate_in_context`).
        attributes = request_attributes(call.engine_id, request, self._engine.config, self._engine.worker_info)
        with quiet_span(_tracer, request_span_name(attributes), current=False, attributes=attributes) as span:
            responses = iterate_in_context(self._responses(call, request, context, span),
                                           trace.set_span_in_context(span))
            async with contextlib.aclosing(responses):  # closes `_responses`, which annotates the span
                async for response in responses:
                    yield response

    async def _responses(
        self, call: _Call, request: pb.GenerateRequest, context: aio.ServicerContext, span: trace.Span
    ) -> AsyncIterator[pb.GenerateResponse]:
        request_id = call.engine_id
        arrival_ns = time.time_ns()
        try:
            check_served(request)
            check_stop_strings(list(request.sampling.stop))
            salt = request_salt(request, self._tenants, call.identity)
            span.set_attributes(isolation_attributes(request, self._tenants, call.identity))
            check_prompt_bytes(request, self._max_prompt_bytes)
            tokenizer_id = self._expected_tokenizer_id()  # the same for the prompt and the reply
            prompt_ids = await self._prompt_ids(request, tokenizer_id)
            submitted = engine_request(request_id, request, prompt_ids, capacity_tokens=self._engine.capacity_tokens,
                                       cache_salt=salt, tenant=call.identity.label,
                                       trace_context=traced_context(span), arrival_ns=arrival_ns)
            detokenizer = self._tokenizer.detokenizer(prompt_ids, tokenizer_id)
            if request.WhichOneof("prompt") == "token_ids":  # the tokenizer is checked before the prefill
                self._engine.validate(submitted)  # the ids, before the tokenizer sees them
                await detokenizer.open()
            abandoned: list[RequestOutput] = []  # outputs never read, if the engine saw the call leave first
            try:
                outputs = self._engine.add_request(submitted, on_abandon=abandoned.append,
                                                   tenant_max_waiting=call.max_waiting)
            except Exception:
                await detokenizer.close()
                raise
        except PermissionDenied as error:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(error))
        except Unimplemented as error:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, str(error))
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

        stream = ResponseStream(call.request_id, request_id, self._engine, detokenizer, list(request.sampling.stop),
                                arrival_ns, self._request_spans)
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
            if stream.account is not None:
                counters = self._counters.setdefault(call.identity.label, TenantCounters())
                counters.query_tokens += stream.account.queried_tokens
                counters.hit_tokens += stream.account.hit_tokens

    async def _prompt_ids(self, request: pb.GenerateRequest, tokenizer_id: str) -> list[int]:
        kind = request.WhichOneof("prompt")
        if kind == "token_ids":
            check_prompt_length(len(request.token_ids.ids), self._engine.max_model_len)  # before copying them
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

    # ---- cache and description ------------------------------------------------------------------

    async def GetCacheStats(self, request: pb.GetCacheStatsRequest, context: aio.ServicerContext) -> pb.CacheStats:
        """The whole cache's statistics; for a tenant, only what its own requests looked up and hit
        (the pool's occupancy and the others' traffic are not its to see)."""
        identity = await identify(self._registry, context)
        config = self._engine.config
        if identity.role is Role.TENANT:
            own = self._counters.get(identity.label, TenantCounters())
            return pb.CacheStats(block_size=config.block_size, hash_algo=config.hash_algo,
                                 prefix_caching_enabled=config.enable_prefix_caching,
                                 query_tokens=own.query_tokens, hit_tokens=own.hit_tokens)
        try:
            stats = self._engine.cache_stats()
            lookups = self._engine.lookups
        except EngineUnavailable as error:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
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
            missed_tokens_by_reason=lookups.missed_tokens,
            lookups=lookups.lookups,
            evicted_lookups=lookups.evicted_lookups,
            idle_cached_blocks=stats.idle_cached_blocks,
            model_name=self._engine.worker_info.model_id,
        )

    async def ResetPrefixCache(
        self, request: pb.ResetPrefixCacheRequest, context: aio.ServicerContext
    ) -> pb.ResetPrefixCacheResponse:
        """Every tenant's cached prefixes go: an admin's call (or anyone's without tenants)."""
        await require_admin(self._registry, context, "resetting the prefix cache")
        return pb.ResetPrefixCacheResponse(reset=self._engine.reset_prefix_cache())

    async def Describe(self, request: pb.DescribeRequest, context: aio.ServicerContext) -> pb.EngineDescription:
        """The model and the engine's limits. `lora_adapters` stays empty and `multimodal` false:
        no served request can use either (`codec.check_served`)."""
        await identify(self._registry, context)
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
        )


@dataclass(frozen=True)
class _Call:
    """One Generate call: the client's request id, the engine's (scoped by tenant), who sent it and
    how many of its tenant's requests may wait."""

    request_id: str
    engine_id: str
    identity: Identity
    max_waiting: int | None


def _tokenizer_failed(request_id: str, code: grpc.StatusCode, details: str) -> str:
    """The client's message for a failed tokenizer call. gRPC's details can name the tokenizer's
    address, which stays in the scheduler's log."""
    log.warning("request %s: tokenizer call failed: %s: %s", quoted(request_id), code.name, details)
    return f"the tokenizer service failed ({code.name}); retry the request"
