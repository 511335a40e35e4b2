"""The scheduler's StepExecutor over gRPC: drives a remote worker one step at a time.

Any failure that means the worker's state is gone (unreachable, restarted without our KV cache,
timed out) becomes `WorkerUnavailable`, upon which EngineCore drops its cache and re-initializes.
"""
from __future__ import annotations

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from prefixcache.protos.worker.v1 import worker_pb2 as pb
from prefixcache.protos.worker.v1 import worker_pb2_grpc as pb_grpc
from prefixcache.rpc.client import open_channel, status_of
from prefixcache.rpc.tls import ChannelTls
from prefixcache.rpc.tracing import SpanRegistry, quiet_span, tracing_enabled
from prefixcache.scheduler.engine import WorkerInfo, WorkerUnavailable
from prefixcache.step.codec import output_from_proto, step_to_proto
from prefixcache.step.messages import SchedulerStep, StepOutput

_tracer = trace.get_tracer(__name__)

# Codes after which the worker cannot be trusted to hold the requests and KV blocks we gave it.
LOST_WORKER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # process gone or unreachable
        grpc.StatusCode.FAILED_PRECONDITION,  # a restarted worker that was never initialized
        grpc.StatusCode.DEADLINE_EXCEEDED,  # hung
        grpc.StatusCode.INTERNAL,  # a step failed half-way: its request state cannot be trusted
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)


class GrpcStepExecutor:
    """`StepExecutor` for a worker at `target` (HOST:PORT)."""

    def __init__(
        self,
        target: str,
        step_timeout_s: float = 300.0,
        init_timeout_s: float = 120.0,
        request_spans: SpanRegistry | None = None,
        tls: ChannelTls | None = None,
    ):
        self.target = target
        self._request_spans = request_spans or SpanRegistry()
        self._channel = open_channel(target, tls)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._step_timeout_s = step_timeout_s
        self._init_timeout_s = init_timeout_s

    async def initialize(self, block_size: int) -> WorkerInfo:
        try:
            reply = await self._stub.InitializeCache(
                pb.InitializeCacheRequest(block_size=block_size), timeout=self._init_timeout_s
            )
        except grpc.RpcError as error:
            raise self._translate(error) from error
        return WorkerInfo(
            model_id=reply.model.model_id,
            vocab_size=reply.model.vocab_size,
            max_model_len=reply.model.max_model_len,
            num_kv_blocks=reply.num_blocks,
            eos_token_ids=tuple(reply.model.eos_token_ids),
            dtype=reply.model.dtype,
            tokenizer_id=reply.model.tokenizer_id,
            kv_bytes_per_token=reply.model.bytes_per_block_token,
        )

    async def execute(self, step: SchedulerStep) -> StepOutput:
        if not tracing_enabled():
            return await self._execute(step)
        # One step serves many requests: its span links to each of theirs, and the worker's span
        # for the call becomes its child.
        attributes = {
            "prefix_cache.step.id": step.step_id,
            "prefix_cache.step.num_requests": len(step.num_scheduled_tokens),
            "prefix_cache.step.num_tokens": step.total_scheduled_tokens,
        }
        links = self._request_spans.links(step.num_scheduled_tokens)
        with quiet_span(_tracer, "execute_step", kind=SpanKind.CLIENT, links=links, attributes=attributes) as span:
            self._request_spans.add_step(step.step_id, span)  # the requests' prefill and decode spans link here
            return await self._execute(step)

    async def _execute(self, step: SchedulerStep) -> StepOutput:
        try:
            reply = await self._stub.ExecuteStep(step_to_proto(step), timeout=self._step_timeout_s)
        except grpc.RpcError as error:
            raise self._translate(error) from error
        return output_from_proto(reply)

    def _translate(self, error: grpc.RpcError) -> Exception:
        code, details = status_of(error)
        message = f"worker {self.target}: {code.name}: {details}"
        if code in LOST_WORKER_CODES:
            return WorkerUnavailable(message)
        return RuntimeError(message)

    async def close(self) -> None:
        await self._channel.close()
