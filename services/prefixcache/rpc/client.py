"""Client channels shared by the services and the CLI: tracing, message limits, fast reconnects, TLS,
and calls spread over every address a name resolves to.

gRPC's default policy, pick_first, sends every call over one connection to the first address. A
Kubernetes headless Service (the tokenizer's) resolves to every ready pod, so channels balance
round robin, call by call: each tokenizer replica takes its share of one scheduler's calls. For a
single address the two policies behave alike."""
from __future__ import annotations

import asyncio
import json
import time

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prefixcache.rpc.server import CHANNEL_OPTIONS
from prefixcache.rpc.tls import ChannelTls
from prefixcache.rpc.tracing import client_interceptors

# gRPC's default reconnect backoff grows to two minutes; a restarted peer on loopback should be
# found again within a second.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

ROUND_ROBIN = ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]}))


def open_channel(target: str, tls: ChannelTls | None = None) -> aio.Channel:
    """A channel to `target` (HOST:PORT) that propagates the trace context: TLS with `tls`, plaintext without."""
    options = [*CHANNEL_OPTIONS, *RECONNECT_OPTIONS, ROUND_ROBIN]
    if tls is not None:
        return aio.secure_channel(target, tls.credentials(), options=options, interceptors=client_interceptors())
    return aio.insecure_channel(target, options=options, interceptors=client_interceptors())


async def is_serving(channel: aio.Channel, service: str = "", timeout_s: float = 1.0) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


async def wait_until_serving(target: str, timeout_s: float, service: str = "", tls: ChannelTls | None = None) -> None:
    """Poll the health service of `target` until it reports SERVING; TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    async with open_channel(target, tls) as channel:
        while not await is_serving(channel, service):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{target} not serving after {timeout_s:.0f} s")
            await asyncio.sleep(0.1)


def status_of(error: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    """The status code and message of a failed call (sync and asyncio errors alike)."""
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    return (code() if callable(code) else grpc.StatusCode.UNKNOWN, details() if callable(details) else str(error))
