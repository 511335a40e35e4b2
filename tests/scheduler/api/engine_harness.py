"""The Engine API on loopback for tests: a real tokenizer server and an Engine server over the
simulated worker, the Engine's with the services' message limits and malformed-request handling."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from grpc import aio
from sim_worker import SimulatedWorker

from prefixcache.protos.engine.v1 import engine_pb2_grpc as pb_grpc
from prefixcache.protos.engine.v1 import kv_cache_pb2_grpc
from prefixcache.rpc.interceptors import MalformedRequestInterceptor
from prefixcache.rpc.server import SERVER_OPTIONS
from prefixcache.scheduler.api.kv_cache_servicer import KvCacheServicer
from prefixcache.scheduler.api.servicer import EngineServicer
from prefixcache.scheduler.engine import EngineCore, SchedulerConfig, StepExecutor
from prefixcache.scheduler.tenancy import TenantRegistry
from prefixcache.scheduler.tokenizer_client import TokenizerClient
from prefixcache.tokenizer.server import servicer as tokenizer_servicer
from prefixcache.tokenizer.text import TextTokenizer

PROMPT = list(range(300, 311))
SPECIAL_IDS = tuple(range(17))  # SmolLM2's special tokens: never generated, so all text shows


@contextlib.asynccontextmanager
async def engine_api(tokenizer: TextTokenizer, num_kv_blocks: int = 256, max_model_len: int = 4096,
                     worker_tokenizer_id: str = "", tokenizer_target: str | None = None,
                     worker_vocab_size: int | None = None,
                     executor: StepExecutor | None = None, registry: TenantRegistry | None = None,
                     config: SchedulerConfig | None = None) -> AsyncIterator[tuple[str, EngineCore]]:
    """(Engine API address, its EngineCore): a tokenizer server and an Engine server (with the KvCache
    service) on loopback.
    `tokenizer_target` points the engine at another tokenizer address instead; `executor` runs the
    steps instead of a simulated worker made from the other arguments; `registry` turns tenancy on;
    `config` replaces the engine's small-block configuration."""
    tokenizer_server = aio.server()
    engine_server = aio.server(interceptors=[MalformedRequestInterceptor()], options=SERVER_OPTIONS)
    tokenizer_servicer(tokenizer).add_to_server(tokenizer_server)
    tokenizer_port = tokenizer_server.add_insecure_port("127.0.0.1:0")
    await tokenizer_server.start()
    worker = executor or SimulatedWorker(
        num_kv_blocks=num_kv_blocks, vocab_size=worker_vocab_size or tokenizer.vocab_size, eos_token_ids=SPECIAL_IDS,
        max_model_len=max_model_len, tokenizer_id=worker_tokenizer_id)
    engine = EngineCore(config or SchedulerConfig(block_size=4, max_num_batched_tokens=64, max_model_len=max_model_len),
                        worker)
    await engine.start()
    tokenizer_client = TokenizerClient(tokenizer_target or f"127.0.0.1:{tokenizer_port}")
    pb_grpc.add_EngineServicer_to_server(EngineServicer(engine, tokenizer_client, registry=registry), engine_server)
    kv_cache = KvCacheServicer(engine, registry)
    kv_cache_pb2_grpc.add_KvCacheServicer_to_server(kv_cache, engine_server)
    engine_port = engine_server.add_insecure_port("127.0.0.1:0")
    await engine_server.start()
    try:
        yield f"127.0.0.1:{engine_port}", engine
        assert engine.cache_stats().used_blocks == 0, "blocks leaked"
    finally:
        kv_cache.close()
        await engine_server.stop(0)
        await engine.shutdown(grace_s=1.0)
        await tokenizer_client.close()
        await tokenizer_server.stop(0)
