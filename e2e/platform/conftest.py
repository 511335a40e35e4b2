"""One local platform for the whole e2e session: tokenizer, worker and scheduler as real processes on
free loopback ports, with the embedded model. Every test checks afterwards that no block leaked."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixcache.services.cli.launcher import LocalPlatform, PlatformConfig, free_port
from prefixcache.services.common.engine_client import EngineClient

# Small enough to share the machine, large enough for 16 streams and two 1,000-token prompts.
KV_CACHE_MEMORY = "160MiB"
# 16 running and 16 waiting at most: room for 16 concurrent arrivals, few enough for the queue-full test.
SCHEDULER_ARGS = ["--max-num-seqs", "16", "--max-waiting", "16", "--grace", "10"]
# grpc.aio binds its poller to the first event loop it sees: every test runs on this one.
_loop = asyncio.new_event_loop()


def run(coroutine):
    return _loop.run_until_complete(coroutine)


def start_platform(log_dir: Path, extra_scheduler_args: list[str] = ()) -> LocalPlatform:
    from prefixcache.services.common.model_store import ensure_default_model

    platform = LocalPlatform(
        PlatformConfig(
            model_dir=ensure_default_model(),
            log_dir=log_dir,
            engine_port=free_port(),
            engine_host="127.0.0.1",
            kv_cache_memory=KV_CACHE_MEMORY,
            scheduler_args=[*SCHEDULER_ARGS, *extra_scheduler_args],
        )
    )
    platform.start()
    try:
        run(platform.wait_ready(timeout_s=240))
    except BaseException:
        platform.stop(grace_s=5)
        raise
    return platform


def stop_platform(platform: LocalPlatform) -> None:
    statuses = platform.stop(grace_s=20)
    # SIGTERM is a clean shutdown for every service: exit status 0.
    assert statuses == {"scheduler": 0, "worker": 0, "tokenizer": 0}, (
        f"{statuses}\n" + "\n".join(f"--- {s.name}\n{s.log_tail()}" for s in platform.services)
    )


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPlatform]:
    platform = start_platform(tmp_path_factory.mktemp("platform-logs"))
    yield platform
    stop_platform(platform)


@pytest.fixture(scope="session")
def target(platform: LocalPlatform) -> str:
    return platform.engine_address


async def wait_idle(target: str, timeout_s: float = 30.0):
    """Poll the cache stats until no request runs or waits and no block is held; return them."""
    deadline = time.monotonic() + timeout_s
    async with EngineClient(target) as engine:
        while True:
            stats = await engine.cache_stats()
            idle = stats.running_requests == 0 and stats.waiting_requests == 0 and stats.used_blocks == 0
            if idle or time.monotonic() > deadline:
                return stats
            await asyncio.sleep(0.1)


@pytest.fixture(autouse=True)
def no_block_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "platform" not in request.fixturenames:
        return
    target = request.getfixturevalue("target")
    stats = run(wait_idle(target))
    assert (stats.running_requests, stats.waiting_requests) == (0, 0)
    assert stats.used_blocks == 0, f"{stats.used_blocks} blocks still held after the test"
    assert stats.free_blocks == stats.num_blocks
