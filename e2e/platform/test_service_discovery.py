"""Every service of the running platform answers gRPC health checks and lists its API by reflection."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prefixcache.launcher import LocalPlatform

pytestmark = pytest.mark.slow

APIS = {
    "tokenizer": "prefixcache.tokenizer.v1.Tokenizer",
    "worker": "prefixcache.worker.v1.Worker",
    "scheduler": "prefixcache.engine.v1.Engine",
}


@pytest.mark.parametrize("name", list(APIS))
def test_health_and_reflection_on_every_service(platform: LocalPlatform, name: str) -> None:
    service = next(s for s in platform.services if s.name == name)
    with grpc.insecure_channel(service.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for checked in ("", APIS[name]):  # the whole server, then its API by name
            reply = health.Check(health_pb2.HealthCheckRequest(service=checked), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = ProtoReflectionDescriptorDatabase(channel)
        listed = set(reflection.get_services())
        # The full descriptors too, so a client can call the API without our .proto files.
        descriptor = reflection.FindFileContainingSymbol(APIS[name])
    assert {APIS[name], "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= listed
    assert descriptor.name.startswith("prefixcache/")
