"""The worker service: hosts one ModelRunner and its paged KV cache behind the Worker gRPC API.

`prefixcache worker --port 50052 [--model-dir DIR] [--device cuda] [--dtype auto] [--kv-cache-memory 1GiB]
[--attention-backend torch]`. The model loads after the port is bound; health says SERVING once it
has. Steps run one at a time on a worker thread so health checks keep answering during a forward.
A CUDA device this process cannot use (a CPU build of torch, no driver, a driver older than torch's
CUDA) stops it before anything starts, with one line saying why (`cuda_check`).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc import aio

from prefixcache.arg_types import listen_port
from prefixcache.protos.worker.v1 import worker_pb2 as pb
from prefixcache.protos.worker.v1 import worker_pb2_grpc as pb_grpc
from prefixcache.rpc.metrics_http import start_service_metrics
from prefixcache.rpc.server import Servicer, add_health_port_argument, configure_logging, probe_address, run_server
from prefixcache.rpc.tls import add_server_tls_arguments, server_tls
from prefixcache.step.codec import output_to_proto, step_from_proto
from prefixcache.worker.compute_thread import ComputeThread
from prefixcache.worker.openmp_wait import configure_openmp_wait
from prefixcache.worker.step_order import StepOrder, StepOutOfOrder

if TYPE_CHECKING:
    from prefixcache.worker.model_runner import ModelRunner

log = logging.getLogger(__name__)
_OUT_OF_MEMORY = re.compile(r"can't allocate memory|out of memory", re.IGNORECASE)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Worker"].full_name

def describe_to_proto(runner: ModelRunner, kv_cache_memory: int) -> pb.ModelDescription:
    description = runner.describe()
    return pb.ModelDescription(
        model_id=description.model_id,
        architecture=description.architecture,
        dtype=description.dtype,
        vocab_size=description.vocab_size,
        max_model_len=description.max_model_len,
        num_layers=description.num_layers,
        num_kv_heads=description.num_kv_heads,
        head_dim=description.head_dim,
        eos_token_ids=description.eos_token_ids,
        bytes_per_block_token=description.bytes_per_block_token,
        kv_cache_tokens=kv_cache_memory // description.bytes_per_block_token,
        tokenizer_id=description.tokenizer_id,
        num_kv_blocks=runner.num_blocks,
        block_size=runner.block_size,
    )


class WorkerServicer(pb_grpc.WorkerServicer):
    """Adapts ModelRunner to gRPC. `runner` is None until the model has loaded."""

    def __init__(self, kv_cache_memory: int | None = None):
        self.runner: ModelRunner | None = None
        self.kv_cache_memory = kv_cache_memory  # bytes; resolved once the model has loaded
        self._block_size: int | None = None
        self._lock = asyncio.Lock()  # one step (or re-initialization) at a time, first come first served
        self._step_order = StepOrder()
        self.compute = ComputeThread("torch")  # every torch call: loading, cache setup, steps

    async def _loaded(self, context: aio.ServicerContext) -> ModelRunner:
        if self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading")
        return self.runner

    async def Describe(self, request: pb.DescribeRequest, context: aio.ServicerContext) -> pb.ModelDescription:
        runner = await self._loaded(context)
        return describe_to_proto(runner, self.kv_cache_memory)

    async def InitializeCache(
        self, request: pb.InitializeCacheRequest, context: aio.ServicerContext
    ) -> pb.InitializeCacheResponse:
        runner = await self._loaded(context)
        if request.block_size <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "block_size: must be positive")
        async with self._lock:
            # RESOURCE_EXHAUSTED, which the scheduler does not take for a lost worker: retrying cannot help.
            try:
                num_blocks = runner.num_blocks_for_memory(self.kv_cache_memory, request.block_size)
            except ValueError as error:  # the budget holds not even one block
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"kv_cache_memory: {error}")
            self._block_size = None  # no cache until the new one is in place: steps are refused meanwhile
            await self._step_order.restart()
            try:
                await self.compute.run(runner.initialize_kv_cache, num_blocks, request.block_size)
            except (MemoryError, RuntimeError) as error:  # torch.OutOfMemoryError is a RuntimeError
                if not isinstance(error, MemoryError) and not _OUT_OF_MEMORY.search(str(error)):
                    raise  # not the allocator's out of memory (CPU or CUDA): a bug, reported as such
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"kv_cache_memory: allocating {num_blocks} blocks failed: {error}")
            self._block_size = request.block_size
        log.info("KV cache initialized: %d blocks of %d tokens", num_blocks, request.block_size)
        description = describe_to_proto(runner, self.kv_cache_memory)
        return pb.InitializeCacheResponse(num_blocks=num_blocks, block_size=request.block_size, model=description)

    async def ExecuteStep(self, request: pb.Step, context: aio.ServicerContext) -> pb.StepResult:
        runner = await self._loaded(context)
        if self._block_size is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "InitializeCache must come before ExecuteStep")
        step = step_from_proto(request)
        if step.follows_step_id is not None and step.follows_step_id >= step.step_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"follows_step_id: {step.follows_step_id} must come before step_id {step.step_id}")
        try:
            generation = await self._step_order.begin(step.step_id, step.follows_step_id)
        except StepOutOfOrder as error:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        async with self._lock:  # entered in the order the steps began
            if not self._step_order.is_current(generation):
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"step {step.step_id}: InitializeCache came after it; its requests are gone")
            try:
                output = await self.compute.run(runner.execute, step)
            except ValueError as error:  # a step that contradicts what the worker holds
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            except Exception as error:  # a bug: the request state may be half-updated, so say so
                log.exception("step %d failed", step.step_id)
                await context.abort(grpc.StatusCode.INTERNAL, f"step {step.step_id} failed: {error!r}")
        return output_to_proto(output)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=listen_port, default=50052, help="port to listen on")
    parser.add_argument("--host", default="[::]", help="address to bind (default: all interfaces)")
    parser.add_argument("--model-dir", type=Path, help="Hugging Face model directory (default: the embedded model)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bfloat16 on a GPU that has it, else float32), float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--kv-cache-memory",
        default="1GiB",
        help="KV cache budget: bytes (512MiB, 2GB) or, with a decimal point, a fraction of the device memory "
        "free after the model has loaded (0.4)",
    )
    parser.add_argument("--attention-backend", default=None, help="attention kernels by name (default: per device)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="on SIGTERM: seconds steps are still served while they keep coming (a scheduler "
                             "draining beside the worker), then a running step's time to finish")
    parser.add_argument("--drain-idle", type=float, default=1.0,
                        help="on SIGTERM: stop once no step has arrived for this long (0: refuse new steps at once)")
    parser.add_argument("--metrics-port", type=listen_port, default=None,
                        help="serve Prometheus metrics on this port (the chart uses 9091)")
    parser.add_argument("--metrics-host", default=None,
                        help="the address /metrics binds (default: --host's; the chart's worker listens on "
                             "loopback for its scheduler alone, and serves metrics, which hold no tenant's data, "
                             "on 0.0.0.0)")
    parser.add_argument("--log-level", default="INFO")
    add_health_port_argument(parser)
    add_server_tls_arguments(parser)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    if not configure_openmp_wait():
        log.warning("torch was imported before the worker set GOMP_SPINCOUNT: OpenMP keeps its default spin")
    from prefixcache.worker.kv_memory import parse_kv_cache_memory

    try:  # a typo should not cost a model load first
        parse_kv_cache_memory(args.kv_cache_memory)
    except ValueError as error:
        log.error("--kv-cache-memory: %s", error)
        return 2
    try:
        tls = server_tls(args)
    except ValueError as error:
        log.error("%s", error)
        return 2
    if args.device.startswith("cuda"):
        from prefixcache.worker.cuda_check import CudaSetup, cuda_problem

        if problem := cuda_problem(CudaSetup.probe(), args.device):
            log.error("%s", problem)
            return 1
    servicer = WorkerServicer()
    try:  # before the model loads: a taken port fails the start at once
        interceptors = start_service_metrics(args.metrics_port, args.metrics_host or args.host,
                                             lambda: servicer.runner.model_id if servicer.runner else "")
    except RuntimeError as error:
        log.error("%s", error)
        return 1

    async def load_model() -> None:
        from prefixcache.worker.kv_memory import kv_cache_budget_bytes
        from prefixcache.worker.model_runner import ModelRunner

        model_dir = args.model_dir
        if model_dir is None:
            from prefixcache.model_store.store import ensure_default_model

            model_dir = await servicer.compute.run(ensure_default_model)
        runner = await servicer.compute.run(
            ModelRunner, model_dir, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend
        )
        try:
            servicer.kv_cache_memory = kv_cache_budget_bytes(args.kv_cache_memory, args.device)
        except ValueError as error:
            raise ValueError(f"--kv-cache-memory: {error}") from None
        servicer.runner = runner  # last: requests wait for the runner, so the budget is set by then
        log.info("model loaded: %s; KV cache budget %d bytes", runner.describe().model_id, servicer.kv_cache_memory)

    registration = Servicer(SERVICE_NAME, lambda server: pb_grpc.add_WorkerServicer_to_server(servicer, server))
    return asyncio.run(
        run_server(
            "prefixcache-worker", f"{args.host}:{args.port}", [registration], grace_s=args.grace,
            drain_idle_s=args.drain_idle, startup=load_model, interceptors=interceptors,
            tls=tls, health_address=probe_address(args),
        )
    )
