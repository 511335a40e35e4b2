"""Server interceptors every service runs at its gRPC boundary, before any servicer code.

- `MalformedRequestInterceptor`: bytes that do not parse as the method's request message (a string
  field holding invalid UTF-8, a truncated message) get INVALID_ARGUMENT. Left to grpcio, they end
  as UNKNOWN with a logged traceback.
- `CallActivity`: counts the calls in flight, so that a service can keep serving after SIGTERM for
  as long as its caller keeps calling (see `run_server`'s `drain_idle_s`).
"""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc import aio

# Health checks and reflection are not work: probes must not keep a draining service alive.
_NOT_WORK = ("/grpc.health.", "/grpc.reflection.")


def rebuild_handler(handler: grpc.RpcMethodHandler, behavior: Callable,
                    request_deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """`handler` with another behavior (and, optionally, request deserializer), same kind of call."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=request_deserializer or handler.request_deserializer,
                response_serializer=handler.response_serializer)


def status_code_of(context: aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with: the one the handler set or aborted with; else OK, or
    DEADLINE_EXCEEDED or CANCELLED for a call that ran out of time or that the client left, or
    UNKNOWN for a crash."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if error is None:
        return grpc.StatusCode.OK
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 \
            else grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable:
    return handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream


def wrap_behavior(behavior: Callable, around: Callable[[Any, aio.ServicerContext], Any]) -> Callable:
    """A behavior that runs `around(request, context)` (an async context manager) around `behavior`,
    as an async generator if `behavior` is one (a streaming handler yielding its responses).
    A synchronous behavior (grpcio runs those in a thread) is left as it is."""
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        return behavior
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            async with around(request, context) as request:
                # Closed here, before `around` exits, also when gRPC drops the stream at a yield.
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
        return stream

    async def call(request: Any, context: aio.ServicerContext) -> Any:
        async with around(request, context) as request:
            return await behavior(request, context)
    return call


@dataclass(frozen=True)
class _Malformed:
    """Stands in for a request message that did not parse."""

    message: str
    error: str


class _CheckedRequest:
    """The async context manager `wrap_behavior` takes: aborts on a malformed unary request, and
    hands a streaming handler an iterator that aborts at the first malformed message."""

    def __init__(self, request: Any, context: aio.ServicerContext) -> None:
        self._request, self._context = request, context

    async def __aenter__(self) -> Any:
        if isinstance(self._request, _Malformed):
            await _abort(self._context, self._request)
        if hasattr(self._request, "__aiter__"):
            return _checked_stream(self._request, self._context)
        return self._request

    async def __aexit__(self, *exc_info: object) -> None:
        return None


async def _checked_stream(requests: AsyncIterator[Any], context: aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            await _abort(context, request)
        yield request


async def _abort(context: aio.ServicerContext, malformed: _Malformed) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request: not a valid {malformed.message} message ({malformed.error})")


def _tolerant(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    owner = getattr(deserialize, "__self__", None)  # `FromString` is bound to the message class
    message = owner.DESCRIPTOR.full_name if hasattr(owner, "DESCRIPTOR") else "request"

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as error:
            return _Malformed(message, str(error))
    return parse


class MalformedRequestInterceptor(aio.ServerInterceptor):
    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return rebuild_handler(handler, wrap_behavior(behavior_of(handler), _CheckedRequest),
                               _tolerant(handler.request_deserializer))


class CallActivity(aio.ServerInterceptor):
    """Counts calls in flight (health checks and reflection aside) and when the last one ended."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.last_active = time.monotonic()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_NOT_WORK):
            return handler
        return rebuild_handler(handler, wrap_behavior(behavior_of(handler), self._counted))

    def _counted(self, request: Any, context: aio.ServicerContext) -> _Counted:
        return _Counted(self, request)

    async def wait_idle(self, idle_s: float, deadline: float) -> bool:
        """Until no call has been in flight for `idle_s` seconds (True), or `deadline` passes
        (`time.monotonic()` seconds): then False if calls were still coming."""
        start = time.monotonic()
        while True:
            now = time.monotonic()
            if self.in_flight == 0 and now - self.last_active >= idle_s:
                return True
            if now >= deadline:
                return self.in_flight == 0 and self.last_active <= start
            await asyncio.sleep(min(0.05, deadline - now))


class _Counted:
    def __init__(self, activity: CallActivity, request: Any) -> None:
        self._activity, self._request = activity, request

    async def __aenter__(self) -> Any:
        self._activity.in_flight += 1
        return self._request

    async def __aexit__(self, *exc_info: object) -> None:
        self._activity.in_flight -= 1
        self._activity.last_active = time.monotonic()
