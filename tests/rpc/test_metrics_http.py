"""Every service's metrics: the gRPC calls counted by method and status code and timed (health checks
left out), served over HTTP on a port bound up front, labelled with the model."""
from __future__ import annotations

import asyncio
import socket
import urllib.request

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixcache.launcher import free_port
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2 as pb
from prefixcache.protos.tokenizer.v1 import tokenizer_pb2_grpc as pb_grpc
from prefixcache.rpc.metrics_http import RpcMetrics, start_service_metrics
from prefixcache.tokenizer.server import servicer as tokenizer_servicer
from prefixcache.tokenizer.text import TextTokenizer


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_calls_are_counted_by_method_and_code_and_timed(model_dir) -> None:
    registry = CollectorRegistry()
    metrics = RpcMetrics(registry, lambda: "tiny-model")

    async def main() -> None:
        server = aio.server(interceptors=[metrics])
        tokenizer_servicer(TextTokenizer(model_dir)).add_to_server(server)
        health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.TokenizerStub(channel)
                for _ in range(3):
                    await stub.Tokenize(pb.TokenizeRequest(text="Hello"))
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Tokenize(pb.TokenizeRequest())  # neither text nor chat
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        finally:
            await server.stop(0)

    asyncio.run(main())
    found = samples(generate_latest(registry).decode())
    method = "prefixcache.tokenizer.v1.Tokenizer/Tokenize"
    handled = {key: value for key, value in found.items() if key[0] == "prefixcache_rpc_server_handled_total"}
    assert handled == {
        ("prefixcache_rpc_server_handled_total", (("code", "OK"), ("method", method), ("model_name", "tiny-model"))): 3,
        ("prefixcache_rpc_server_handled_total", (("code", "INVALID_ARGUMENT"), ("method", method),
                                                  ("model_name", "tiny-model"))): 1,
    }  # the health check is not counted
    assert found["prefixcache_rpc_server_handling_seconds_count", (("method", method), ("model_name", "tiny-model"))] == 4


def test_metrics_are_served_over_http_and_a_taken_port_is_named() -> None:
    port = free_port()
    [interceptor] = start_service_metrics(port, "127.0.0.1", lambda: "m")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    assert "process_resident_memory_bytes" in text and "prefixcache_rpc_server_handled_total" in text
    assert start_service_metrics(None, "127.0.0.1", lambda: "m") == []  # no port: nothing served, nothing counted
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match=rf"cannot serve metrics on 127.0.0.1:{taken.getsockname()[1]} "
                                               r"\(--metrics-port\)"):
            start_service_metrics(taken.getsockname()[1], "127.0.0.1", lambda: "m")
