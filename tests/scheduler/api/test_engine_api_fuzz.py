"""Hypothesis over every public RPC of the Engine API, with tenants configured, over real gRPC (the
real tokenizer service, the simulated worker): every field of a request drawn across its whole range,
any credentials, and raw bytes that may not even parse. Every call ends, within its deadline, with a
status that names the caller's mistake (or OK); never UNKNOWN, INTERNAL or UNAVAILABLE. Afterwards
the engine holds no request and no block."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from engine_harness import engine_api
from grpc import aio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tenants_file import new_key, tenants_document, write_tenants

from prefixcache.protos.common.v1 import chat_pb2
from prefixcache.protos.engine.v1 import engine_pb2 as pb
from prefixcache.scheduler.engine import EngineCore
from prefixcache.scheduler.tenancy import TenantRegistry
from prefixcache.tokenizer.text import TextTokenizer

KEYS = {"acme": new_key(), "globex": new_key()}
ADMIN_KEY = new_key()
# A mistake of the caller's (or no mistake); anything else would be a fault of the server.
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED,
              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
METHODS = {"Generate": True, "GetCacheStats": False, "ResetPrefixCache": False, "Describe": False}  # streaming?
CALL_DEADLINE_S = 20.0
MAX_MODEL_LEN = 64  # short generations: each example stays quick


@dataclass
class Served:
    loop: asyncio.AbstractEventLoop
    channel: aio.Channel
    engine: EngineCore


@pytest.fixture(scope="module")
def served(tokenizer: TextTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = write_tenants(Path(tmp_path_factory.mktemp("tenants")) / "tenants.json",
                         tenants_document(KEYS, admins={"ops": ADMIN_KEY}))
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    api = engine_api(tokenizer, max_model_len=MAX_MODEL_LEN, registry=TenantRegistry(path, check_interval_s=0))
    target, engine = loop.run_until_complete(stack.enter_async_context(api))

    async def open_channel() -> aio.Channel:
        return aio.insecure_channel(target)

    channel = loop.run_until_complete(open_channel())
    try:
        yield Served(loop, channel, engine)
        loop.run_until_complete(_until_idle(engine))
    finally:
        loop.run_until_complete(channel.close())
        loop.run_until_complete(stack.aclose())  # asserts that no block leaked
        loop.close()


async def _until_idle(engine: EngineCore) -> None:
    for _ in range(500):
        if not (engine.num_running or engine.num_waiting):
            return
        await asyncio.sleep(0.01)


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.none() | strategy


def mostly(usual: object, strategy: st.SearchStrategy) -> st.SearchStrategy:
    """`usual` three times in four, else anything `strategy` draws: most requests stay valid enough to
    run, so the fields' edges are reached on requests that get far."""
    return st.sampled_from([usual] * 3 + [None]).flatmap(lambda v: st.just(v) if v is not None else strategy)


int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
texts = st.text(max_size=40) | st.sampled_from(["Hello there", "<|im_start|>user", "日本語 🙂", " "])
token_ids = st.lists(mostly(300, st.integers(0, 49_200) | uint32), max_size=40) | st.lists(uint32, max_size=80)
chats = st.lists(st.tuples(st.sampled_from(["user", "assistant", "system", "", "tool"]), texts), max_size=4)


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=draw(st.sampled_from(["", "", "same"]) | st.text(max_size=300)))
    prompt = draw(st.sampled_from(["text", "token_ids", "token_ids", "chat", "none"]))
    if prompt == "text":
        request.text = draw(texts)
    elif prompt == "token_ids":
        request.token_ids.ids.extend(draw(token_ids))
    elif prompt == "chat":
        request.chat.messages.extend(chat_pb2.ChatMessage(role=role, content=content) for role, content in draw(chats))
        request.chat.add_generation_prompt = draw(st.booleans())
    sampling = request.sampling
    for name, values in (("max_tokens", st.integers(1, 12) | st.integers(-3, 0) | int32),
                         ("temperature", st.floats(0, 2) | floats), ("top_p", st.floats(0.01, 1) | floats),
                         ("seed", st.integers(0, 2**64 - 1))):
        if (value := draw(optional(values))) is not None:
            setattr(sampling, name, value)
    sampling.top_k = draw(st.integers(0, 50) | st.integers(-2, -1) | int32)
    sampling.logprobs = draw(st.integers(0, 5) | st.integers(0, 25) | uint32)
    sampling.ignore_eos = draw(st.booleans())
    sampling.stop.extend(draw(mostly((), st.lists(st.text(max_size=8), max_size=3))))
    sampling.stop_token_ids.extend(draw(mostly((), st.lists(uint32, max_size=3))))
    isolation = draw(mostly("none", st.sampled_from(["cache_salt", "tenant"])))
    if isolation != "none":
        setattr(request, isolation, draw(st.text(max_size=20)))
    request.lora_adapter = draw(mostly("", st.text(max_size=8)))
    for offset, length in draw(mostly((), st.lists(st.tuples(uint32, uint32), max_size=2))):
        request.multimodal_items.add(content_hash=draw(st.text(max_size=4)), offset=offset, length=length)
    return request


credentials = mostly(f"Bearer {KEYS['acme']}", st.sampled_from(
    [f"Bearer {KEYS['globex']}", None, f"Bearer {ADMIN_KEY}", "Bearer not-a-key", "Basic abc", "Bearer"]))


async def call(channel: aio.Channel, method: str, payload: bytes, authorization: str | None) -> grpc.StatusCode:
    """Send `payload` as the method's request bytes; the call's final status."""
    path = f"/prefixcache.engine.v1.Engine/{method}"
    metadata = (("authorization", authorization),) if authorization is not None else None
    try:
        if METHODS[method]:
            async for _ in channel.unary_stream(path)(payload, timeout=CALL_DEADLINE_S, metadata=metadata):
                pass
        else:
            await channel.unary_unary(path)(payload, timeout=CALL_DEADLINE_S, metadata=metadata)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(request=generate_requests(), authorization=credentials)
def test_any_generate_request_ends_with_a_callers_status(served: Served, request: pb.GenerateRequest,
                                                         authorization: str | None) -> None:
    status = served.loop.run_until_complete(call(served.channel, "Generate", request.SerializeToString(),
                                                 authorization))
    assert status in ACCEPTABLE


@FUZZ
@given(method=st.sampled_from(sorted(METHODS)), payload=st.binary(max_size=64), authorization=credentials)
def test_any_bytes_to_any_rpc_end_with_a_callers_status(served: Served, method: str, payload: bytes,
                                                        authorization: str | None) -> None:
    status = served.loop.run_until_complete(call(served.channel, method, payload, authorization))
    assert status in ACCEPTABLE
