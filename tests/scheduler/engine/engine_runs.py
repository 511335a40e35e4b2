"""Running EngineCore over the simulated worker in a test: its configuration, requests, and the
check that nothing leaked."""
from __future__ import annotations

import asyncio

from sim_worker import SimulatedWorker

from prefixcache.scheduler.engine import EngineCore, EngineRequest, SchedulerConfig
from prefixcache.step.messages import SamplingParams

VOCAB = 1000
BLOCK = 4


def config(**overrides) -> SchedulerConfig:
    # Scheduling ahead is the path with more states (tokens pending, two steps in flight when the
    # worker is lost): every test here takes it unless it says otherwise.
    return SchedulerConfig(block_size=BLOCK, **{"max_num_batched_tokens": 64, "schedule_ahead": True, **overrides})


def request(request_id, prompt, max_tokens=6, **kwargs) -> EngineRequest:
    return EngineRequest(request_id, list(prompt), kwargs.pop("sampling", SamplingParams()), max_tokens, **kwargs)


async def collect(stream):
    return [output async for output in stream]


def tokens_of(outputs):
    return [t for o in outputs for t in o.new_token_ids]


def run(coroutine_fn, worker=None, **config_overrides):
    """Start an engine on a simulated worker, run the test body, check nothing leaked, shut down."""
    worker = worker or SimulatedWorker(num_kv_blocks=64, vocab_size=VOCAB)

    async def main():
        engine = EngineCore(config(**config_overrides), worker)
        await engine.start()
        try:
            await coroutine_fn(engine, worker)
            await asyncio.sleep(0)
            stats = engine.cache_stats()
            assert stats.used_blocks == 0, "blocks leaked"
        finally:
            await engine.shutdown(grace_s=1.0)

    asyncio.run(asyncio.wait_for(main(), 30))
