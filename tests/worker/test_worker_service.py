"""The worker service over real loopback gRPC, hosting the embedded model's ModelRunner."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc import aio

from prefixcache.model_store.tokenizer_identity import tokenizer_id
from prefixcache.protos.worker.v1 import worker_pb2 as pb
from prefixcache.protos.worker.v1 import worker_pb2_grpc as pb_grpc
from prefixcache.step.codec import output_from_proto, step_to_proto
from prefixcache.step.messages import CachedRequestData, NewRequestData, SchedulerStep
from prefixcache.worker.server import WorkerServicer

pytestmark = pytest.mark.slow

CAPITAL_PROMPT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip
CAPITAL_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris."
BLOCK = 16


@pytest.fixture(scope="module")
def runner(model_dir: Path):
    from prefixcache.worker.model_runner import ModelRunner

    return ModelRunner(model_dir, dtype="float32")


def serve(runner, body, kv_memory: int = 32 * 2**20) -> None:
    async def main() -> None:
        servicer = WorkerServicer(kv_memory)
        servicer.runner = runner
        server = aio.server()
        pb_grpc.add_WorkerServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                await body(pb_grpc.WorkerStub(channel))
        finally:
            await server.stop(0)

    asyncio.run(main())


def test_greedy_generation_through_steps(runner, model_dir: Path) -> None:
    async def body(stub: pb_grpc.WorkerStub) -> None:
        description = await stub.Describe(pb.DescribeRequest())
        assert description.vocab_size == 49152 and list(description.eos_token_ids) == [2]
        assert (description.num_kv_blocks, description.block_size) == (0, 0)  # no cache yet
        assert description.tokenizer_id == tokenizer_id(model_dir)  # what the tokenizer service serves
        init = await stub.InitializeCache(pb.InitializeCacheRequest(block_size=BLOCK))
        expected_blocks = 32 * 2**20 // (description.bytes_per_block_token * BLOCK)
        assert init.num_blocks == expected_blocks and init.model.model_id == description.model_id
        assert description.kv_cache_tokens // BLOCK == expected_blocks  # known before InitializeCache
        described = await stub.Describe(pb.DescribeRequest())
        assert (described.num_kv_blocks, described.block_size) == (expected_blocks, BLOCK)
        assert (init.model.num_kv_blocks, init.model.block_size) == (expected_blocks, BLOCK)

        # The prompt in two prefill chunks (the first samples nothing), then decodes, growing the
        # block table by one block when the sequence crosses a block boundary.
        blocks = [5, 9, 2]
        step = SchedulerStep(1, new_requests=[NewRequestData("r", CAPITAL_PROMPT, blocks, 0)], num_scheduled_tokens={"r": 20})
        reply = output_from_proto(await stub.ExecuteStep(step_to_proto(step)))
        assert reply.step_id == 1 and reply.sampled_token_ids == {}
        computed, generated, step_id = 20, [], 2
        scheduled = len(CAPITAL_PROMPT) - 20
        while len(generated) < len(CAPITAL_ANSWER):
            new_blocks = [7] if computed + scheduled > len(blocks) * BLOCK else []
            blocks += new_blocks
            step = SchedulerStep(
                step_id,
                cached_requests=[CachedRequestData("r", new_blocks, computed)],
                num_scheduled_tokens={"r": scheduled},
            )
            reply = output_from_proto(await stub.ExecuteStep(step_to_proto(step)))
            generated.append(reply.sampled_token_ids["r"])
            computed += scheduled
            scheduled, step_id = 1, step_id + 1
        assert generated == CAPITAL_ANSWER

    serve(runner, body)


def test_a_step_sent_ahead_runs_after_the_step_it_follows_even_when_it_arrives_first(runner) -> None:
    prompt = CAPITAL_PROMPT

    async def body(stub: pb_grpc.WorkerStub) -> None:
        await stub.InitializeCache(pb.InitializeCacheRequest(block_size=BLOCK))
        prefill = SchedulerStep(0, new_requests=[NewRequestData("r", prompt, [5, 9, 2], 0)],
                                num_scheduled_tokens={"r": len(prompt)})
        # Decodes the token the prefill samples, which its sender has not seen yet.
        decode = SchedulerStep(1, cached_requests=[CachedRequestData("r", [], len(prompt))],
                               num_scheduled_tokens={"r": 1}, follows_step_id=0)
        decode_call = asyncio.ensure_future(stub.ExecuteStep(step_to_proto(decode)))
        await asyncio.sleep(0.2)
        assert not decode_call.done()  # waits for the prefill
        first = output_from_proto(await stub.ExecuteStep(step_to_proto(prefill)))
        second = output_from_proto(await decode_call)
        assert [first.sampled_token_ids["r"], second.sampled_token_ids["r"]] == CAPITAL_ANSWER[:2]

        with pytest.raises(grpc.RpcError) as error:  # a step cannot follow itself or a later one
            await stub.ExecuteStep(step_to_proto(SchedulerStep(5, follows_step_id=5)))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("follows_step_id:")

        # A step that follows one from before InitializeCache is refused: its requests are gone.
        stale = asyncio.ensure_future(stub.ExecuteStep(step_to_proto(SchedulerStep(3, follows_step_id=2))))
        await asyncio.sleep(0.1)
        await stub.InitializeCache(pb.InitializeCacheRequest(block_size=BLOCK))
        with pytest.raises(grpc.RpcError) as error:
            await stale
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "re-initialized" in error.value.details()

    serve(runner, body)


def test_step_before_initialization_is_refused(runner) -> None:
    async def body(stub: pb_grpc.WorkerStub) -> None:
        with pytest.raises(grpc.RpcError) as error:
            await stub.ExecuteStep(pb.Step(step_id=1))
        assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as error:
            await stub.InitializeCache(pb.InitializeCacheRequest(block_size=0))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.value.details().startswith("block_size:")

    serve(runner, body)


def test_a_budget_too_small_for_one_block_is_refused(runner) -> None:
    async def body(stub: pb_grpc.WorkerStub) -> None:
        with pytest.raises(grpc.RpcError) as error:
            await stub.InitializeCache(pb.InitializeCacheRequest(block_size=BLOCK))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.value.details().startswith("kv_cache_memory:")

    serve(runner, body, kv_memory=1024)
