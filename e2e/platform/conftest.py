"""One local platform for the whole e2e session: tokenizer, worker and scheduler as real processes on
free loopback ports, with the embedded model. After every test, each platform still running (this one
and any a test module started) is checked for leaked blocks."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from platform_harness import run, running_platforms, start_platform, stop_platform, wait_idle

from prefixcache.launcher import LocalPlatform


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPlatform]:
    platform = start_platform(tmp_path_factory.mktemp("platform-logs"))
    yield platform
    stop_platform(platform)


@pytest.fixture(scope="session")
def target(platform: LocalPlatform) -> str:
    return platform.engine_address


@pytest.fixture(autouse=True)
def no_block_leaks() -> Iterator[None]:
    yield
    for platform in running_platforms:
        stats = run(wait_idle(platform.engine_address))
        assert (stats.running_requests, stats.waiting_requests) == (0, 0), platform.engine_address
        assert stats.used_blocks == 0, f"{stats.used_blocks} blocks still held after the test ({platform.engine_address})"
        assert stats.free_blocks == stats.num_blocks
