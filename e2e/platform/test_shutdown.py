"""SIGTERM on the scheduler: in-flight streams finish, new requests are refused, the process exits 0."""
from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from platform_harness import run

from prefixcache.client import Completion, EngineClient, build_request
from prefixcache.launcher import LocalPlatform
from prefixcache.rpc.client import is_serving, open_channel

pytestmark = pytest.mark.slow


async def wait_not_serving(address: str, timeout_s: float = 30.0) -> None:
    """Until the health service stops reporting SERVING (the scheduler has begun its drain)."""
    async with open_channel(address) as channel:
        async with asyncio.timeout(timeout_s):
            while await is_serving(channel):
                await asyncio.sleep(0.02)


def test_sigterm_lets_in_flight_requests_finish(platform: LocalPlatform, target: str) -> None:
    async def main() -> tuple[Completion, grpc.StatusCode]:
        async with EngineClient(target) as engine:
            request = build_request(text="Once upon a time", max_tokens=24, temperature=0.0, ignore_eos=True)
            completion = Completion()
            refused = grpc.StatusCode.OK
            async for chunk in engine.generate(request, timeout_s=120):
                completion.add(chunk)
                if completion.num_chunks == 1:
                    platform.scheduler.process.send_signal(signal.SIGTERM)
                    await wait_not_serving(target)
                    with pytest.raises(grpc.aio.AioRpcError) as error:
                        await engine.complete(build_request(text="Too late", max_tokens=2), timeout_s=30)
                    refused = error.value.code()
            return completion, refused

    try:
        completion, refused = run(main())
        assert completion.finish_reason == "length" and len(completion.token_ids) == 24
        assert refused == grpc.StatusCode.UNAVAILABLE
        assert platform.scheduler.wait(timeout_s=90) == 0
    finally:
        # Bring the scheduler back for the tests that follow (it re-initializes the worker's cache),
        # whatever happened above.
        platform.scheduler.kill()
        platform.scheduler.start()
        run(platform.wait_serving(platform.scheduler, timeout_s=120))
