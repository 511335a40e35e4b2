"""Bootstrap shared by every service: one asyncio gRPC server with health, reflection, tracing, SIGTERM.

A service hands over its servicers plus optional `startup` and `shutdown` hooks. Health reports
NOT_SERVING until `startup` has finished (the scheduler waits for its worker there), then SERVING.
SIGTERM or SIGINT flips health to NOT_SERVING, waits for the callers to go quiet if the service
drains (`drain_idle_s`), runs `shutdown(grace_s)` (the scheduler stops admitting and finishes or
aborts in-flight requests there), stops the server with the same grace (new calls are refused at
once; calls still running after the grace are cancelled) and returns 0.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from prefixcache.rpc.interceptors import CallActivity, MalformedRequestInterceptor
from prefixcache.rpc.tls import ServerTls
from prefixcache.rpc.tracing import ServerTracingInterceptor, configure_tracing, shutdown_tracing

log = logging.getLogger(__name__)

# Prompts of a few thousand tokens and step messages of a large batch stay far below this.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
# gRPC sets SO_REUSEPORT by default, so a second server on a taken port starts "fine" and the kernel
# splits connections between the two (two engines with two caches behind one address): refuse instead.
SERVER_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0))
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


@dataclass(frozen=True)
class Servicer:
    """One gRPC service: its full proto name and the generated `add_*Servicer_to_server` call."""

    name: str  # e.g. "prefixcache.engine.v1.Engine"
    add_to_server: Callable[[aio.Server], None]


def add_health_port_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--health-port", type=int, metavar="PORT",
                        help="also serve the health statuses alone, in plaintext, on this port of every interface "
                             "(for Kubernetes' gRPC probes where --host is loopback or the service serves TLS)")


def probe_address(args: argparse.Namespace) -> str | None:
    return f"[::]:{args.health_port}" if args.health_port is not None else None


def configure_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


async def run_server(
    service_name: str,
    address: str,
    servicers: list[Servicer],
    *,
    grace_s: float = 10.0,
    drain_idle_s: float = 0.0,
    startup: Callable[[], Awaitable[None]] | None = None,
    shutdown: Callable[[float], Awaitable[None]] | None = None,
    ready: Callable[[int], None] | None = None,
    health: health_aio.HealthServicer | None = None,
    tls: ServerTls | None = None,
    health_address: str | None = None,
    interceptors: Sequence[aio.ServerInterceptor] = (),
) -> int:
    """Serve until SIGTERM/SIGINT; return the process exit code.

    With `drain_idle_s`, a stop signal does not close the door at once: calls are still served
    until none has been in flight for that long (or `grace_s` has passed). A worker's only caller is
    its scheduler, which may be draining its own requests at the same moment (a process group or a
    cgroup signalled as a whole) and needs a step served until its last request is done.

    `ready(port)` is called once the port is bound (port 0 picks a free one). Pass `health` to set
    a service's status yourself while serving; this sets every service's on start and stop. With
    `tls`, the port serves TLS only (`rpc.tls`). `health_address` serves the same health statuses, and
    nothing else, in plaintext: for Kubernetes' gRPC probes, which speak neither TLS nor loopback,
    where the service itself listens on loopback only or serves TLS. `interceptors` run after the
    shared ones (the calls' metrics, say).
    """
    try:
        configure_tracing(service_name)
    except Exception as error:  # an OTEL_* value we or the SDK cannot honour (ours name the variable)
        log.error("%s cannot start: OpenTelemetry settings (OTEL_*): %s", service_name, error)
        return 1
    try:
        return await _serve(service_name, address, servicers, grace_s, drain_idle_s, startup, shutdown, ready, health,
                            tls, health_address, interceptors)
    finally:
        shutdown_tracing()  # spans of a failed start are worth having too


async def _serve(
    service_name: str,
    address: str,
    servicers: list[Servicer],
    grace_s: float,
    drain_idle_s: float,
    startup: Callable[[], Awaitable[None]] | None,
    shutdown: Callable[[float], Awaitable[None]] | None,
    ready: Callable[[int], None] | None,
    health: health_aio.HealthServicer | None,
    tls: ServerTls | None,
    health_address: str | None,
    extra_interceptors: Sequence[aio.ServerInterceptor],
) -> int:
    activity = CallActivity() if drain_idle_s > 0 else None
    interceptors = [MalformedRequestInterceptor(), *([activity] if activity else []), ServerTracingInterceptor(),
                    *extra_interceptors]
    server = aio.server(interceptors=interceptors, options=SERVER_OPTIONS)
    health = health or health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for servicer in servicers:
        servicer.add_to_server(server)
    names = [s.name for s in servicers]
    _enable_reflection([*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name], server)
    try:
        credentials = tls.credentials() if tls is not None else None
    except ValueError as error:
        log.error("%s cannot start: %s", service_name, error)
        return 1
    probes = aio.server(options=SERVER_OPTIONS) if health_address is not None else None
    if probes is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health, probes)
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as error:
        log.error("cannot listen on %s: %s", address, error)
        return 1
    if probes is not None:
        try:
            probes.add_insecure_port(health_address)
        except RuntimeError as error:
            log.error("cannot listen on %s (health checks): %s", health_address, error)
            return 1
    await _set_health(health, names, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    if probes is not None:
        await probes.start()
    if ready is not None:
        ready(port)
    log.info("%s listening on port %d", service_name, port)

    stop = asyncio.Event()
    stop_signals = shutdown_signals()
    set_on_signals(stop, stop_signals)

    starting = asyncio.ensure_future(startup()) if startup is not None else None
    if starting is not None:
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not starting.done():
            starting.cancel()
        elif starting.exception() is not None:
            log.error("%s failed to start: %s", service_name, starting.exception())
            await _stop_servers((server, probes), 0)
            return 1
    if not stop.is_set():
        await _set_health(health, names, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s serving", service_name)
        await stop.wait()

    log.info("%s shutting down (grace %.1f s)", service_name, grace_s)
    # The shutdown is bounded by the grace; a second signal (a supervisor's SIGTERM on top of the
    # terminal's Ctrl-C) must not kill it halfway, nor the exit after the loop has closed.
    for signum in stop_signals:
        signal.signal(signum, signal.SIG_IGN)
    await health.enter_graceful_shutdown()
    if activity is not None and not await activity.wait_idle(drain_idle_s, time.monotonic() + grace_s):
        log.warning("%s: calls still arriving after the grace period; stopping anyway", service_name)
    if shutdown is not None:
        await shutdown(grace_s)
    await _stop_servers((server, probes), grace_s)
    return 0


async def _stop_servers(servers: tuple[aio.Server | None, ...], grace_s: float) -> None:
    for server in servers:
        if server is not None:
            await server.stop(grace_s)


def _enable_reflection(service_names: list[str], server: aio.Server) -> None:
    """Server reflection under both names clients ask for: grpcio-reflection serves only v1alpha, and
    v1 (what current grpcurl and grpcui try first) has the very same messages under another package."""
    servicer = reflection.aio.ReflectionServicer([*service_names, reflection.SERVICE_NAME, REFLECTION_V1])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": v1}),))


def set_on_signals(event: asyncio.Event, signums: tuple[signal.Signals, ...]) -> None:
    """Set `event` (of the running loop) when one of `signums` arrives.

    Not `loop.add_signal_handler`: removing one restores the default action for a moment (a signal
    then kills the process), and closing the loop removes them all, before the process has finished
    stopping. These stay until replaced (with SIG_IGN once shutting down); after the loop has closed
    they do nothing."""
    loop = asyncio.get_running_loop()

    def handle(signum: int, frame: object) -> None:
        if not loop.is_closed():
            loop.call_soon_threadsafe(event.set)

    for signum in signums:
        signal.signal(signum, handle)


def shutdown_signals() -> tuple[signal.Signals, ...]:
    """SIGTERM, and SIGINT unless this process was started with it ignored: a supervisor (such as
    `prefixcache serve`) that orders its services' shutdown keeps the terminal's Ctrl-C from them."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return (signal.SIGTERM,)
    return (signal.SIGTERM, signal.SIGINT)


async def _set_health(health: health_aio.HealthServicer, names: list[str], status: int) -> None:
    for name in ("", *names):
        await health.set(name, status)
