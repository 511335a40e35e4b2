"""Killing the worker mid-stream: in-flight requests end UNAVAILABLE; a restarted worker serves again
with an empty cache. Both with one step at a time and with decode steps sent ahead (two steps in
flight when the worker dies)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import pytest
from platform_harness import restart_worker, run, scrape_metrics, start_platform, stop_platform
from platform_prompts import question, shared_prefix

from prefixcache.client import Completion, EngineClient, build_request
from prefixcache.launcher import LocalPlatform

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[["--no-schedule-ahead"], []], ids=["one-step-at-a-time", "scheduling-ahead"])
def platform(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPlatform]:
    platform = start_platform(tmp_path_factory.mktemp("worker-loss-logs"), request.param)
    yield platform
    stop_platform(platform)


@pytest.fixture(scope="module")
def target(platform: LocalPlatform) -> str:
    return platform.engine_address


async def complete_when_back(engine: EngineClient, request, timeout_s: float = 120) -> Completion:
    """Retry while the engine answers UNAVAILABLE (the worker is coming back)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await engine.complete(request, timeout_s=120)
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def test_worker_killed_mid_stream_then_restarted(platform: LocalPlatform, target: str) -> None:
    prefix = shared_prefix(160, "the coast")
    cached_prompt = prefix + question("Which note mentions harbors?")

    async def main() -> None:
        async with EngineClient(target) as engine:
            warm = build_request(token_ids=cached_prompt, max_tokens=2, temperature=0.0)
            await engine.complete(warm, timeout_s=120)
            assert (await engine.complete(warm, timeout_s=120)).usage.cached_tokens == 160
            before = await engine.cache_stats()

            long = build_request(text="Tell me a long story.", max_tokens=400, temperature=0.0, ignore_eos=True)
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for chunk in engine.generate(long, timeout_s=300):
                    if chunk.token_ids and platform.worker.running:
                        platform.worker.kill()
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            # The worker's address stays in the scheduler's log; the client learns what happened.
            assert "worker was lost" in error.value.details()
            assert platform.worker.address not in error.value.details()
            if "--no-schedule-ahead" not in platform.config.scheduler_args:  # the loss found steps sent ahead
                assert scrape_metrics(platform)["prefixcache_steps_scheduled_ahead_total"] > 0

            restart_worker(platform)
            after = await complete_when_back(engine, warm)
            assert after.usage.cached_tokens == 0  # the KV memory died with the worker
            assert after.cache_account.miss_reason == "cold"
            stats = await engine.cache_stats()
            assert stats.used_blocks == 0
            # Counters run since the scheduler started: the worker's restart does not reset them.
            assert stats.query_tokens >= before.query_tokens + len(cached_prompt)
            assert stats.hit_tokens == before.hit_tokens and stats.evictions >= before.evictions

    run(main())


def test_worker_killed_before_the_first_token_and_not_back(platform: LocalPlatform, target: str) -> None:
    """A request still in its prefill when the worker dies ends UNAVAILABLE too, at once, rather than
    waiting for a worker that may never come back."""
    prompt = shared_prefix(100 * 16, f"a doomed prefill {time.monotonic_ns()}")  # a second or more of prefill

    received: list[int] = []

    async def read_all(call) -> None:
        async for chunk in call:
            received.extend(chunk.token_ids)

    async def main() -> None:
        async with EngineClient(target) as engine:
            call = engine.generate(build_request(token_ids=prompt, max_tokens=4, temperature=0.0), timeout_s=120)
            reading = asyncio.ensure_future(read_all(call))
            try:
                while (await engine.cache_stats()).running_requests == 0:
                    assert not reading.done(), "the request ended before the worker was killed"
                    await asyncio.sleep(0.02)
                platform.worker.kill()
                started = time.monotonic()
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await reading
                    pytest.fail(f"the request completed with {received} although its worker was killed")
                assert received == []  # killed in the prefill: the path of a request that streamed nothing
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "worker was lost" in error.value.details()
                assert time.monotonic() - started < 10  # not held for the worker's return
            finally:
                restart_worker(platform)  # the later tests need it, whatever happened here
            after = await complete_when_back(engine, build_request(token_ids=prompt[:64], max_tokens=2))
            assert after.usage.cached_tokens == 0

    run(main())
