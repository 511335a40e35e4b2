"""While one tenant floods the Engine API, another tenant's time to first token stays within twice its
unloaded value: the flooding tenant holds at most its share of the running slots and of the queue.

Over real gRPC with the real tokenizer service, on a simulated worker whose steps take time in
proportion to the tokens they compute, one at a time, as on a device: the bound is about scheduling,
relative to the same engine unloaded, and holds whatever the speed of the machine running the test.
The same flood without tenants' limits is shown to break it, so the bound is one a regression
would fail.
"""
from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from engine_harness import SPECIAL_IDS, engine_api
from sim_worker import SimulatedWorker
from tenants_file import new_key, tenants_document, write_tenants

from prefixcache.client import EngineClient, build_request
from prefixcache.scheduler.engine import SchedulerConfig
from prefixcache.scheduler.tenancy import TenantRegistry
from prefixcache.step.messages import SchedulerStep, StepOutput
from prefixcache.tokenizer.text import TextTokenizer

CONFIG = SchedulerConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=1024)
LIGHT_PROMPT_TOKENS = 384
FLOOD_CALLERS = 16  # as many as the engine has running slots
KEYS = {"light": new_key(), "flood": new_key()}
pytestmark = pytest.mark.slow  # tens of seconds of timed traffic


class TimedWorker(SimulatedWorker):
    """A step takes `base_s` plus `per_token_s` for each token it computes, and steps run one at a time."""

    def __init__(self, base_s: float = 0.02, per_token_s: float = 0.0005, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.base_s, self.per_token_s = base_s, per_token_s
        self._device = asyncio.Lock()

    async def execute(self, step: SchedulerStep) -> StepOutput:
        async with self._device:
            await asyncio.sleep(self.base_s + self.per_token_s * step.total_scheduled_tokens)
            return self._execute(step)


@contextlib.asynccontextmanager
async def engine(tokenizer: TextTokenizer, tenants: Path | None) -> AsyncIterator[str]:
    worker = TimedWorker(num_kv_blocks=1024, vocab_size=tokenizer.vocab_size, eos_token_ids=SPECIAL_IDS,
                         max_model_len=CONFIG.max_model_len)
    registry = TenantRegistry(tenants) if tenants is not None else None
    async with engine_api(tokenizer, executor=worker, registry=registry, config=CONFIG) as (target, core):
        yield target
        while core.num_running or core.num_waiting:  # the flood's cancelled calls leave the engine
            await asyncio.sleep(0.01)


async def time_to_first_token(client: EngineClient, rng: random.Random) -> float:
    prompt = [rng.randrange(100, 40_000) for _ in range(LIGHT_PROMPT_TOKENS)]  # never cached
    started = time.perf_counter()
    async for response in client.generate(build_request(token_ids=prompt, max_tokens=2, temperature=0.0)):
        if response.token_ids:
            first = time.perf_counter() - started
    return first


async def p99_ttft(client: EngineClient, samples: int, rng: random.Random) -> float:
    times = sorted([await time_to_first_token(client, rng) for _ in range(samples)])
    return times[math.ceil(0.99 * len(times)) - 1]


async def flood(client: EngineClient, stop: asyncio.Event, rng: random.Random) -> None:
    """Long generations back to back; refused ones are retried after a moment."""
    while not stop.is_set():
        request = build_request(token_ids=[rng.randrange(100, 40_000) for _ in range(4)], max_tokens=100,
                                ignore_eos=True, temperature=0.0)
        call = client.generate(request)
        try:
            async for _ in call:
                if stop.is_set():
                    break
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            await asyncio.sleep(0.05)
        call.cancel()


async def ttft_unloaded_and_flooded(target: str, keys: dict[str, str | None], samples: int) -> tuple[float, float]:
    rng = random.Random(29)
    async with EngineClient(target, api_key=keys["light"]) as light, \
            EngineClient(target, api_key=keys["flood"]) as flooder:
        await p99_ttft(light, 3, rng)  # warm up the channels and the tokenizer
        unloaded = await p99_ttft(light, samples, rng)
        stop = asyncio.Event()
        flooding = [asyncio.ensure_future(flood(flooder, stop, random.Random(i))) for i in range(FLOOD_CALLERS)]
        await asyncio.sleep(0.5)  # every slot the flood may take is taken
        flooded = await p99_ttft(light, samples, rng)
        stop.set()
        await asyncio.gather(*flooding)
    return unloaded, flooded


def test_a_flooding_tenant_leaves_another_tenants_p99_ttft_within_twice_unloaded(tokenizer: TextTokenizer,
                                                                                tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path / "tenants.json", tenants_document(KEYS))

    async def main() -> tuple[float, float]:
        async with engine(tokenizer, tenants) as target:
            return await ttft_unloaded_and_flooded(target, KEYS, samples=20)

    unloaded, flooded = asyncio.run(asyncio.wait_for(main(), 120))
    assert flooded <= 2 * unloaded, f"p99 TTFT {flooded * 1000:.0f} ms under the flood, {unloaded * 1000:.0f} ms without"


def test_without_tenants_limits_the_same_flood_breaks_the_bound(tokenizer: TextTokenizer) -> None:
    """The control: one client flooding a single-user engine takes every running slot, and a request
    waits for one of its long generations to end."""
    async def main() -> tuple[float, float]:
        async with engine(tokenizer, None) as target:
            return await ttft_unloaded_and_flooded(target, {"light": None, "flood": None}, samples=2)

    unloaded, flooded = asyncio.run(asyncio.wait_for(main(), 120))
    assert flooded > 2 * unloaded, f"p99 TTFT {flooded * 1000:.0f} ms under the flood, {unloaded * 1000:.0f} ms without"
