"""Prometheus metrics for every service: `/metrics` over HTTP, and the gRPC calls each one served.

`serve_metrics(port, host, registry)` serves a registry at `:port/metrics` (on the gRPC `--host` when
that is a specific address, on every IPv4 interface when it is `[::]` or `0.0.0.0`, as Prometheus
scrapes a pod's IP). A service calls it before anything slow, so a taken port fails its start at once.

`RpcMetrics` is a server interceptor that counts each call by method and status code and times it:
`prefixcache_rpc_server_handled_total{model_name,method,code}` and
`prefixcache_rpc_server_handling_seconds{model_name,method}` (a streaming call is timed to its last
message). Health checks and reflection are left out, as probes, not work.

`start_service_metrics` does both for a service, with the process's own figures (CPU, memory).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
from grpc import aio
from prometheus_client import GC_COLLECTOR, PROCESS_COLLECTOR, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.rpc.histogram import Histogram
from prefixcache.rpc.interceptors import behavior_of, rebuild_handler, status_code_of, wrap_behavior

PREFIX = "prefixcache"
_UNMEASURED = ("/grpc.health.", "/grpc.reflection.")
# A tokenize call or a cached step takes milliseconds; a long prompt's step on a CPU, seconds.
CALL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def metrics_address(host: str) -> str:
    """Where /metrics listens, for a service whose gRPC port binds `host`."""
    host = host.strip("[]")
    return "0.0.0.0" if host in ("", "::", "0.0.0.0") else host


def serve_metrics(port: int, host: str, registry: CollectorRegistry) -> None:
    """Serve `registry` at `:port/metrics` from a daemon thread; RuntimeError naming `--metrics-port`
    if the port cannot be bound."""
    address = metrics_address(host)
    try:
        start_http_server(port, addr=address, registry=registry)
    except OSError as error:
        raise RuntimeError(f"cannot serve metrics on {address}:{port} (--metrics-port): "
                           f"{error.strerror or error}") from None


def start_service_metrics(port: int | None, host: str, model_name: Callable[[], str],
                          registry: CollectorRegistry | None = None) -> list[aio.ServerInterceptor]:
    """A service's metrics: the calls it handles and the process's own (CPU, memory, garbage collection),
    in `registry` (a new one if None), served at `:port/metrics`. Returns the interceptor to give
    `run_server`. Without a port nothing is served, and the calls go uncounted (no interceptor)."""
    if port is None:
        return []
    registry = registry or CollectorRegistry()
    for collector in (PROCESS_COLLECTOR, GC_COLLECTOR):
        registry.register(collector)
    interceptor = RpcMetrics(registry, model_name)
    serve_metrics(port, host, registry)
    return [interceptor]


class RpcMetrics(aio.ServerInterceptor, Collector):
    """Counts and times the calls a server handles; registers itself in `registry`.

    `model_name()` labels every sample: the served model's id once it is known ("" until then)."""

    def __init__(self, registry: CollectorRegistry, model_name: Callable[[], str] = lambda: "") -> None:
        self._model_name = model_name
        self._handled: dict[tuple[str, str], int] = {}  # (method, code) -> calls
        self._seconds = Histogram(CALL_BUCKETS)
        registry.register(self)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_UNMEASURED):
            return handler
        method = method.lstrip("/")

        @contextlib.asynccontextmanager
        async def measured(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                yield request
            except BaseException as raised:
                error = raised
                raise
            finally:
                self._seconds.observe(time.perf_counter() - start, (method,))
                key = (method, status_code_of(context, error).name)
                self._handled[key] = self._handled.get(key, 0) + 1

        return rebuild_handler(handler, wrap_behavior(behavior_of(handler), measured))

    def collect(self) -> Iterator[Metric]:
        model = self._model_name()
        handled = CounterMetricFamily(f"{PREFIX}_rpc_server_handled", "gRPC calls handled, by method and status code.",
                                      labels=["model_name", "method", "code"])
        for (method, code), count in sorted(self._handled.items()):
            handled.add_metric([model, method, code], count)
        yield handled
        yield self._seconds.family(f"{PREFIX}_rpc_server_handling_seconds", "Time to handle a gRPC call (a "
                                   "streaming one, to its last message), by method.", ["model_name", "method"],
                                   lambda labels: [model, *labels])
