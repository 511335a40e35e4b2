"""The scheduler's StepExecutor over gRPC: drives a remote worker one step at a time.

Any failure that means the worker's state is gone (unreachable, restarted without our KV cache,
timed out) becomes `WorkerUnavailable`, upon which EngineCore drops its cache and re-initializes.
"""
from __future__ import annotations

import grpc

from prefixcache.protos.worker.v1 import worker_pb2 as pb
from prefixcache.protos.worker.v1 import worker_pb2_grpc as pb_grpc
from prefixcache.services.common.grpc_client import open_channel, status_of
from prefixcache.services.common.step import SchedulerStep, StepOutput
from prefixcache.services.common.step_codec import output_from_proto, step_to_proto
from prefixcache.services.scheduler.engine_core import WorkerInfo, WorkerUnavailable

# Codes after which the worker cannot be trusted to hold the requests and KV blocks we gave it.
LOST_WORKER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,  # process gone or unreachable
        grpc.StatusCode.FAILED_PRECONDITION,  # a restarted worker that was never initialized
        grpc.StatusCode.DEADLINE_EXCEEDED,  # hung
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.UNKNOWN,
    }
)


class GrpcStepExecutor:
    """`StepExecutor` for a worker at `target` (HOST:PORT)."""

    def __init__(self, target: str, step_timeout_s: float = 300.0, init_timeout_s: float = 120.0):
        self.target = target
        self._channel = open_channel(target)
        self._stub = pb_grpc.WorkerStub(self._channel)
        self._step_timeout_s = step_timeout_s
        self._init_timeout_s = init_timeout_s
        self.description: pb.ModelDescription | None = None

    async def initialize(self, block_size: int) -> WorkerInfo:
        try:
            reply = await self._stub.InitializeCache(
                pb.InitializeCacheRequest(block_size=block_size), timeout=self._init_timeout_s
            )
        except grpc.RpcError as error:
            raise self._translate(error) from error
        self.description = reply.model
        return WorkerInfo(
            model_id=reply.model.model_id,
            vocab_size=reply.model.vocab_size,
            max_model_len=reply.model.max_model_len,
            num_kv_blocks=reply.num_blocks,
            eos_token_ids=tuple(reply.model.eos_token_ids),
            dtype=reply.model.dtype,
        )

    async def execute(self, step: SchedulerStep) -> StepOutput:
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
