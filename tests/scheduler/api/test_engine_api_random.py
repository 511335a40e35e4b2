"""Random requests over real gRPC, valid and not, many at once, some cancelled by their clients (the
real tokenizer service, the simulated worker): every call ends well, with INVALID_ARGUMENT naming a
field, UNIMPLEMENTED naming a field no served request can use, or CANCELLED where its client
cancelled it; nothing else. Afterwards the engine still serves,
holds no request and no block, and its counters agree with the usage the clients were sent."""
from __future__ import annotations

import asyncio
import math
import random

import grpc
import pytest
from engine_harness import PROMPT, engine_api
from grpc import aio

from prefixcache.client import EngineClient, build_request
from prefixcache.model_store.store import ensure_default_model
from prefixcache.protos.common.v1 import chat_pb2
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.protos.engine.v1 import engine_pb2_grpc as pb_grpc
from prefixcache.scheduler.engine import StepExecutor
from prefixcache.tokenizer.text import TextTokenizer

# What an INVALID_ARGUMENT message may start with: the request's fields, as the API names them.
FIELDS = ("prompt", "text", "token_ids", "chat", "request_id", "sampling.max_tokens",
          "sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.logprobs", "sampling.stop",
          "sampling.stop_token_ids", "cache_salt", "tenant")
UNIMPLEMENTED_FIELDS = ("lora_adapter", "multimodal_items")
TEXTS = ("", "Hello there", "  ", "日本語のテキスト", "emoji 🙂 and \u200b zero width", "a\n\n3 digits 12345",
         "<|im_start|>user", "x" * 3000)


def random_request(rng: random.Random, vocab: int) -> pb.GenerateRequest:
    """A valid request of random shape; about half of them then get one to three faults."""
    request = pb.GenerateRequest(request_id=rng.choice(["", "", "", "shared-id", f"id-{rng.random()}"]))
    kind = rng.choice(["text", "token_ids", "token_ids", "chat"])
    if kind == "text":
        request.text = rng.choice(TEXTS[1:])
    elif kind == "token_ids":
        length = rng.choice([1, 5, 40, 300])
        shared = PROMPT * (length // len(PROMPT) + 1) if rng.random() < 0.5 else []  # some prefixes hit
        request.token_ids.ids.extend((shared + [rng.randrange(vocab) for _ in range(length)])[:length])
    else:
        for _ in range(rng.choice([1, 3])):
            request.chat.messages.append(chat_pb2.ChatMessage(role=rng.choice(["user", "assistant", "system"]),
                                                              content=rng.choice(TEXTS[1:])))
        request.chat.add_generation_prompt = rng.random() < 0.8
    sampling = request.sampling
    if (max_tokens := rng.choice([None, 1, 4, 12])) is not None:
        sampling.max_tokens = max_tokens
    if (temperature := rng.choice([None, 0.0, 0.8])) is not None:
        sampling.temperature = temperature
    if (top_p := rng.choice([None, 1.0, 0.5])) is not None:
        sampling.top_p = top_p
    sampling.top_k = rng.choice([0, 0, 5])
    sampling.logprobs = rng.choice([0, 0, 2, 20])
    if rng.random() < 0.3:
        sampling.seed = rng.randrange(2**64)
    sampling.stop.extend(rng.sample(["the", "\n", ".", "zz" * 40, "é"], rng.choice([0, 0, 1, 2])))
    sampling.stop_token_ids.extend(rng.choice([[], [], [7]]))
    sampling.ignore_eos = rng.random() < 0.5
    isolation = rng.choice(["none", "none", "salt", "tenant"])
    if isolation != "none":
        setattr(request, "cache_salt" if isolation == "salt" else "tenant", rng.choice(["tenant-a", "tenant-b"]))
    for fault in rng.sample(FAULTS, rng.choice([0, 0, 0, 1, 1, 2, 3])):
        fault(request, rng, vocab)
    return request


def _bad_prompt(request: pb.GenerateRequest, rng: random.Random, vocab: int) -> None:
    kind = rng.choice(["empty text", "no prompt", "empty ids", "id beyond vocab", "too long", "empty chat", "bad role"])
    if kind == "empty text":
        request.text = ""
    elif kind == "no prompt":
        request.ClearField(request.WhichOneof("prompt") or "text")
    elif kind == "empty ids":
        request.token_ids.ids[:] = []
        request.token_ids.SetInParent()
    elif kind == "id beyond vocab":
        request.token_ids.ids[:] = [1, 2, vocab + rng.randrange(1000), 3]
    elif kind == "too long":
        request.token_ids.ids[:] = [rng.randrange(vocab) for _ in range(5000)]
    elif kind == "empty chat":
        request.chat.SetInParent()
        del request.chat.messages[:]
    else:
        request.chat.messages.append(chat_pb2.ChatMessage(role=rng.choice(["", "wizard"]), content="hi"))


def _bad_sampling(request: pb.GenerateRequest, rng: random.Random, vocab: int) -> None:
    sampling = request.sampling
    field, value = rng.choice([("max_tokens", -3), ("max_tokens", 0), ("max_tokens", 5000), ("temperature", -1.0),
                               ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0),
                               ("top_p", 1.5), ("top_p", math.nan), ("top_k", -1), ("logprobs", 21)])
    setattr(sampling, field, value)


def _bad_stop(request: pb.GenerateRequest, rng: random.Random, vocab: int) -> None:
    if rng.random() < 0.5:
        request.sampling.stop.append("")
    else:
        request.sampling.stop_token_ids.append(vocab + 5)


def _bad_isolation(request: pb.GenerateRequest, rng: random.Random, vocab: int) -> None:
    setattr(request, rng.choice(["cache_salt", "tenant"]), rng.choice(["", "k" * 2000]))


def _unserved_extras(request: pb.GenerateRequest, rng: random.Random, vocab: int) -> None:
    if rng.random() < 0.5:
        request.lora_adapter = "some-adapter"
    else:
        request.multimodal_items.append(pb.MultiModalItem(content_hash="img", offset=0, length=2))


FAULTS = (_bad_prompt, _bad_sampling, _bad_stop, _bad_isolation, _unserved_extras)


async def call(stub: pb_grpc.EngineStub, request: pb.GenerateRequest,
               cancel_after: int | None) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    """Run one Generate; with `cancel_after`, the client cancels once it has that many messages
    (0: at once, whatever the server has done with the call by then)."""
    stream = stub.Generate(request)
    if cancel_after == 0:
        stream.cancel()
        return grpc.StatusCode.CANCELLED, "", []
    responses: list[pb.GenerateResponse] = []
    try:
        async for response in stream:
            responses.append(response)
            if cancel_after is not None and len(responses) >= cancel_after:
                stream.cancel()
                break
    except aio.AioRpcError as error:
        return error.code(), error.details() or "", responses
    if cancel_after is not None and len(responses) >= cancel_after and not responses[-1].finish_reason:
        return grpc.StatusCode.CANCELLED, "", responses
    return grpc.StatusCode.OK, "", responses


@pytest.mark.parametrize("seed", range(3))
def test_random_requests_end_well_or_name_a_field_and_leave_the_engine_serving(tokenizer: TextTokenizer,
                                                                               seed: int) -> None:
    asyncio.run(asyncio.wait_for(random_rounds(tokenizer, random.Random(seed), rounds=12), 120))


def test_random_requests_on_the_embedded_model(tokenizer: TextTokenizer) -> None:
    """The same on the real model, whose sampler sees every sampling option the faults left valid."""
    from prefixcache.llm.local_executor import LocalExecutor
    from prefixcache.worker.model_runner import ModelRunner

    runner = ModelRunner(ensure_default_model(), dtype="float32")
    executor = LocalExecutor(runner, num_kv_blocks=512)
    rounds = random_rounds(tokenizer, random.Random(100), rounds=3, executor=executor, default_max_tokens=6)
    asyncio.run(asyncio.wait_for(rounds, 600))


async def random_rounds(tokenizer: TextTokenizer, rng: random.Random, rounds: int,
                        executor: StepExecutor | None = None, default_max_tokens: int | None = None) -> None:
    """Rounds of random calls at once; `default_max_tokens` caps the requests that set none (on a
    real model, those run to the end of the KV cache)."""
    async with engine_api(tokenizer, executor=executor) as (target, engine):
        async with aio.insecure_channel(target) as channel:
            stub = pb_grpc.EngineStub(channel)
            outcomes = []
            for _ in range(rounds):  # rounds of calls running at once
                batch = [random_request(rng, tokenizer.vocab_size) for _ in range(rng.randint(1, 10))]
                for request in batch:
                    if default_max_tokens is not None and not request.sampling.HasField("max_tokens"):
                        request.sampling.max_tokens = default_max_tokens
                cancels = [rng.choice([None, None, None, 0, 2]) for _ in batch]
                results = await asyncio.gather(*(call(stub, r, c) for r, c in zip(batch, cancels)))
                outcomes.extend(zip(batch, cancels, results))
        check(outcomes)
        # A cancelled call's clean-up on the server may still be under way: give it a moment.
        for _ in range(500):
            if engine.num_running == engine.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.num_running == engine.num_waiting == 0
        completed = [responses[-1] for _, _, (code, _, responses) in outcomes if code == grpc.StatusCode.OK]
        assert engine.cache_stats().hits >= sum(final.usage.cached_tokens for final in completed)
        async with EngineClient(target) as client:  # still serving
            done = await client.complete(build_request(token_ids=PROMPT, max_tokens=3))
        assert done.finish_reason == "length" and len(done.token_ids) == 3


def check(outcomes: list) -> None:
    codes = {grpc.StatusCode.OK: 0, grpc.StatusCode.INVALID_ARGUMENT: 0, grpc.StatusCode.CANCELLED: 0}
    for request, cancel_after, (code, details, responses) in outcomes:
        if code == grpc.StatusCode.UNIMPLEMENTED:
            assert details.startswith(UNIMPLEMENTED_FIELDS), details
            continue
        assert code in codes, (code, details, request)
        codes[code] += 1
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert details.startswith(FIELDS), details
            assert "kkkkkkkk" not in details  # a salt or tenant is never quoted back
        elif code == grpc.StatusCode.CANCELLED:
            assert cancel_after is not None
        else:
            final = responses[-1]
            assert final.finish_reason != pb.FINISH_REASON_UNSPECIFIED
            generated = sum(len(response.token_ids) for response in responses)
            assert final.usage.completion_tokens >= generated
            if request.sampling.HasField("max_tokens"):
                assert final.usage.completion_tokens <= request.sampling.max_tokens
    # the rounds did exercise all three outcomes
    assert all(count > 0 for count in codes.values()), codes
