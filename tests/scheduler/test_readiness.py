"""The Engine's readiness follows its dependencies: NOT_SERVING while the tokenizer does not answer
(a real tokenizer server on loopback, stopped and started again on its port) or the worker is lost,
SERVING once both are back."""
from __future__ import annotations

import asyncio

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from prefixcache.scheduler.readiness import Readiness
from prefixcache.scheduler.tokenizer_client import TokenizerClient
from prefixcache.tokenizer.server import servicer
from prefixcache.tokenizer.text import TextTokenizer

ENGINE = "prefixcache.engine.v1.Engine"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def start_tokenizer(tokenizer: TextTokenizer, port: int = 0) -> tuple[aio.Server, int]:
    server = aio.server()
    servicer(tokenizer).add_to_server(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


async def status(health: health_aio.HealthServicer) -> int:
    return (await health.Check(health_pb2.HealthCheckRequest(service=ENGINE), None)).status


async def becomes(health: health_aio.HealthServicer, wanted: int) -> None:
    while await status(health) != wanted:
        await asyncio.sleep(0.02)


def test_the_engine_is_not_ready_while_the_tokenizer_or_the_worker_is_down(tokenizer: TextTokenizer) -> None:
    async def main() -> None:
        server, port = await start_tokenizer(tokenizer)
        client = TokenizerClient(f"127.0.0.1:{port}")
        health = health_aio.HealthServicer()
        await health.set(ENGINE, SERVING)
        readiness = Readiness(health, ENGINE, client.is_serving)
        readiness.watch_tokenizer(interval_s=0.05)
        try:
            await asyncio.sleep(0.2)
            assert await status(health) == SERVING
            await server.stop(0)
            await asyncio.wait_for(becomes(health, NOT_SERVING), 10)
            server, _ = await start_tokenizer(tokenizer, port)
            await asyncio.wait_for(becomes(health, SERVING), 10)
            await readiness.worker_available(False)
            assert await status(health) == NOT_SERVING
            await asyncio.sleep(0.2)  # the tokenizer's checks do not bring it back without a worker
            assert await status(health) == NOT_SERVING
            await readiness.worker_available(True)
            assert await status(health) == SERVING
        finally:
            await readiness.stop()
            await client.close()
            await server.stop(0)

    asyncio.run(asyncio.wait_for(main(), 60))
