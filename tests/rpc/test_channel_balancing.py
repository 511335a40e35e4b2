"""Client channels spread calls over every address their target resolves to (a headless Service's
pods), not over the first connection only: real servers on loopback, one target naming both."""
from __future__ import annotations

import asyncio
from collections import Counter

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from prefixcache.rpc.client import open_channel


class CountingHealth(health_aio.HealthServicer):
    def __init__(self, name: str, calls: Counter[str]):
        super().__init__()
        self._name, self._calls = name, calls

    async def Check(self, request, context):
        self._calls[self._name] += 1
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


def test_calls_are_spread_over_every_resolved_address() -> None:
    async def main() -> Counter[str]:
        calls: Counter[str] = Counter()
        servers, ports = [], []
        for name in ("a", "b"):
            server = aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(CountingHealth(name, calls), server)
            ports.append(server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            servers.append(server)
        try:
            target = "ipv4:" + ",".join(f"127.0.0.1:{port}" for port in ports)  # one name, two addresses
            async with open_channel(target) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for _ in range(20):
                    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5, wait_for_ready=True)
        finally:
            for server in servers:
                await server.stop(0)
        return calls

    calls = asyncio.run(main())
    assert sum(calls.values()) == 20
    assert min(calls["a"], calls["b"]) >= 5, calls  # pick_first would send all twenty to one
