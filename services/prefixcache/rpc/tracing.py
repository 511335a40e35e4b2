"""OpenTelemetry for every service: configured by the standard OTEL_* variables, W3C context over gRPC.

`configure_tracing(service)` installs an SDK tracer provider only when an exporter is configured:
`OTEL_TRACES_EXPORTER` (`otlp`, `console`, `none`; comma-separated) or, without it, an OTLP endpoint
(`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`). Otherwise the API's no-op
tracer stays in place: spans cost a function call and nothing is exported. The SDK itself reads the
rest (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`, `OTEL_TRACES_SAMPLER`, exporter endpoints).

Context travels in gRPC metadata (`traceparent`, `tracestate`, through the globally configured
propagator, W3C trace context by default). The server interceptor makes the caller's context current
for the handler, and opens a server span when tracing is on; the client interceptor injects the
current context into every outgoing call. A service with tracing off still forwards the context it
received, so a trace is not cut by one unconfigured hop.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc
from grpc import aio
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from prefixcache.rpc.interceptors import behavior_of, rebuild_handler, status_code_of

T = TypeVar("T")
log = logging.getLogger(__name__)

_enabled = False
SHUTDOWN_FLUSH_S = 3.0
UNTRACED_SERVICES = ("grpc.health.v1.Health/", "grpc.reflection.")


def configure_tracing(service_name: str) -> bool:
    """Install the exporter the environment asks for; return whether spans are exported."""
    global _enabled
    exporters = _configured_exporters()
    if not exporters:
        return False
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=service_resource(service_name))
    for exporter in exporters:
        provider.add_span_processor(_naming_bad_settings(_BATCH_PROCESSOR_SETTINGS, BatchSpanProcessor, exporter))
    trace.set_tracer_provider(provider)
    _enabled = True
    log.info("tracing on for %s", service_name)
    return True


def shutdown_tracing(timeout_s: float = SHUTDOWN_FLUSH_S) -> None:
    """Flush pending spans (at process exit), for at most `timeout_s`: an unreachable collector
    (the exporter retries with backoff) must not hold up a stopping service."""
    provider = trace.get_tracer_provider()
    if not (_enabled and hasattr(provider, "shutdown")):
        return
    flushing = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
    flushing.start()
    flushing.join(timeout_s)
    if flushing.is_alive():
        log.warning("spans not exported within %.0f s of stopping were dropped", timeout_s)


def service_resource(service_name: str) -> Any:
    """The SDK's resource from the environment; `service_name` only where neither OTEL_SERVICE_NAME
    nor a `service.name` in OTEL_RESOURCE_ATTRIBUTES names the service."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    return resource


def tracing_enabled() -> bool:
    return _enabled


def _configured_exporters() -> list[Any]:
    """The span exporters the environment asks for (none when nothing is configured)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = os.environ.get("OTEL_TRACES_EXPORTER", "").strip()
    if not names:  # the OpenTelemetry spec: an empty value means unset
        endpoint_set = any(
            os.environ.get(var) for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        names = "otlp" if endpoint_set else "none"
    exporters = []
    for name in (n.strip().lower() for n in names.split(",")):
        if name in ("", "none"):
            continue
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
                protocol = os.environ.get(variable)
                if protocol:
                    break
            if protocol not in (None, "", "grpc"):
                raise ValueError(f"{variable}: {protocol!r} is not supported; the services export OTLP over gRPC "
                                 "(protocol grpc, usually port 4317)")

            exporters.append(_naming_bad_settings(_OTLP_EXPORTER_SETTINGS, OTLPSpanExporter))
        elif name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} (otlp, console, none)")
    return exporters


# Numeric settings whose bad values the SDK's constructors raise on, without naming the variable.
_OTLP_EXPORTER_SETTINGS = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
_BATCH_PROCESSOR_SETTINGS = ("OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_EXPORT_TIMEOUT", "OTEL_BSP_MAX_QUEUE_SIZE",
                             "OTEL_BSP_MAX_EXPORT_BATCH_SIZE")


def _naming_bad_settings(variables: tuple[str, ...], build: Callable[..., T], *args: Any) -> T:
    """`build(*args)`, its ValueError re-raised naming whichever of `variables` are set, with their values."""
    try:
        return build(*args)
    except ValueError as error:
        named = ", ".join(f"{name}: {os.environ[name]!r}" for name in variables if name in os.environ)
        if not named:
            raise
        raise ValueError(f"{named} is not valid ({error})") from None


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


# --- server side -------------------------------------------------------------------------------


def _extract(metadata: tuple[tuple[str, str | bytes], ...] | None) -> otel_context.Context:
    carrier = {key: value for key, value in (metadata or ()) if isinstance(value, str)}
    return propagate.extract(carrier)


class ServerTracingInterceptor(aio.ServerInterceptor):
    """Runs each handler in the caller's trace context, inside a server span when tracing is on."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        parent = _extract(handler_call_details.invocation_metadata)
        method = handler_call_details.method.lstrip("/")
        if method.startswith(UNTRACED_SERVICES):
            return handler  # probes every few seconds: noise in every trace store
        wrap = _wrap_streaming if handler.response_streaming else _wrap_unary
        return rebuild_handler(handler, wrap(behavior_of(handler), parent, method))


@contextlib.contextmanager
def _server_span(method: str, call: aio.ServicerContext, **options: Any) -> Iterator[trace.Span]:
    """A call's server span, ending with the call's gRPC status on it."""
    with quiet_span(tracer(__name__), method, kind=trace.SpanKind.SERVER, marks_errors=False,
                    attributes={"rpc.system": "grpc", "rpc.method": method}, **options) as span:
        error = None
        try:
            yield span
        except BaseException as raised:
            error = raised
            raise
        finally:
            _set_status_code(span, call, error)


# The codes that make a server span an error (OpenTelemetry's gRPC conventions): the server's
# faults. A refused argument, a missing entity or a client that left are the caller's business.
_SERVER_ERROR_CODES = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                                 grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                                 grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


def _set_status_code(span: trace.Span, context: aio.ServicerContext, error: BaseException | None) -> None:
    """The call's gRPC status on its span (OpenTelemetry's `rpc.grpc.status_code`, see
    `status_code_of`). The span is an error for the server's faults only (`_SERVER_ERROR_CODES`),
    described by the code's name, never by a message."""
    code = status_code_of(context, error)
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code in _SERVER_ERROR_CODES:
        span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))


@contextlib.contextmanager
def quiet_span(span_tracer: trace.Tracer, name: str, *, current: bool = True, marks_errors: bool = True,
               **options: Any) -> Iterator[trace.Span]:
    """A span like `start_as_current_span`'s, but a failure marks it ERROR naming only the exception's
    type: messages and stack traces can quote what a request contained (a chat template's complaint,
    a bad value), and spans leave the process. With `current=False` the span is not made current
    (for a body that yields: see `iterate_in_context`); with `marks_errors=False` the caller sets
    the status itself."""
    options.update(record_exception=False, set_status_on_exception=False)
    starting = span_tracer.start_as_current_span(name, **options) if current else _ended(span_tracer.start_span(name, **options))
    with starting as span:
        try:
            yield span
        except Exception as error:
            if marks_errors:
                span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
            raise


@contextlib.contextmanager
def _ended(span: trace.Span) -> Iterator[trace.Span]:
    try:
        yield span
    finally:
        span.end()


async def iterate_in_context(items: AsyncIterator[Any], context: otel_context.Context) -> AsyncIterator[Any]:
    """Yield `items` with `context` current while each one is computed, never across a yield.

    An async generator that holds a context token across `yield` cannot restore it when it is closed
    from another task (gRPC drops a stream whose client went away; the event loop closes it later),
    and OpenTelemetry logs that failure with a traceback. Attached per item, nothing is held."""
    iterator = items.__aiter__()
    try:
        while True:
            token = otel_context.attach(context)
            try:
                item = await iterator.__anext__()
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            yield item
    finally:
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


def _wrap_unary(behavior: Callable, parent: otel_context.Context, method: str) -> Callable:
    async def handle(request: Any, context: aio.ServicerContext) -> Any:
        token = otel_context.attach(parent)
        try:
            if not _enabled:
                return await behavior(request, context)
            with _server_span(method, call=context):
                return await behavior(request, context)
        finally:
            otel_context.detach(token)

    return handle


def _wrap_streaming(behavior: Callable, parent: otel_context.Context, method: str) -> Callable:
    if not inspect.isasyncgenfunction(behavior):  # a handler that writes with `context.write`
        return _wrap_unary(behavior, parent, method)

    async def handle(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
        if not _enabled:
            async for response in iterate_in_context(behavior(request, context), parent):
                yield response
            return
        with _server_span(method, call=context, current=False, context=parent) as span:
            async for response in iterate_in_context(behavior(request, context), trace.set_span_in_context(span, parent)):
                yield response

    return handle


# --- client side -------------------------------------------------------------------------------


def _with_trace_context(details: aio.ClientCallDetails) -> aio.ClientCallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return details
    metadata = aio.Metadata(*(tuple(details.metadata or ())))
    for key, value in carrier.items():
        metadata[key] = value
    return aio.ClientCallDetails(
        details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
    )


class _UnaryUnary(aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[override]
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStream(aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[override]
        return await continuation(_with_trace_context(client_call_details), request)


class _StreamUnary(aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[override]
        return await continuation(_with_trace_context(client_call_details), request_iterator)


class _StreamStream(aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[override]
        return await continuation(_with_trace_context(client_call_details), request_iterator)


def client_interceptors() -> list[aio.ClientInterceptor]:
    """Interceptors that put the current trace context on every outgoing call of a channel."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]


class SpanRegistry:
    """Span contexts of in-flight requests by id, so work done for a batch (one engine step serves
    many requests) can link back to each request's span; and of the newest `max_steps` steps by
    step id, so each request's spans can link to the steps that computed it."""

    def __init__(self, max_steps: int = 4096) -> None:
        self._contexts: dict[str, trace.SpanContext] = {}
        self._steps: OrderedDict[int, trace.SpanContext] = OrderedDict()
        self._max_steps = max_steps

    def add(self, request_id: str, span: trace.Span) -> None:
        if _enabled:
            self._contexts[request_id] = span.get_span_context()

    def remove(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)

    def links(self, request_ids: Iterable[str]) -> list[trace.Link]:
        return [trace.Link(self._contexts[r], {"prefix_cache.link": "computed_request"})
                for r in request_ids if r in self._contexts]

    def add_step(self, step_id: int, span: trace.Span) -> None:
        self._steps[step_id] = span.get_span_context()
        if len(self._steps) > self._max_steps:
            self._steps.popitem(last=False)

    def step(self, step_id: int | None) -> trace.SpanContext | None:
        return self._steps.get(step_id) if step_id is not None else None
