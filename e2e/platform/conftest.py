"""One local platform for the whole e2e session: tokenizer, worker and scheduler as real processes on
free loopback ports, with the embedded model. Every test checks afterwards that no block leaked."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
from platform_harness import run, start_platform, stop_platform, wait_idle

from prefixcache.services.cli.launcher import LocalPlatform


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPlatform]:
    platform = start_platform(tmp_path_factory.mktemp("platform-logs"))
    yield platform
    stop_platform(platform)


@pytest.fixture(scope="session")
def target(platform: LocalPlatform) -> str:
    return platform.engine_address


@pytest.fixture(autouse=True)
def no_block_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    # Looked up before the test: fixtures may not be requested during teardown.
    platform = request.getfixturevalue("platform") if "platform" in request.fixturenames else None
    yield
    if platform is None:
        return
    stats = run(wait_idle(platform.engine_address))
    assert (stats.running_requests, stats.waiting_requests) == (0, 0)
    assert stats.used_blocks == 0, f"{stats.used_blocks} blocks still held after the test"
    assert stats.free_blocks == stats.num_blocks
