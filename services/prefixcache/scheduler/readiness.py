"""The Engine's readiness: SERVING only while the replica can serve a request, which needs both its
worker (initialized for our blocks) and a tokenizer that answers. A load balancer or a Kubernetes
readiness probe then sends traffic elsewhere while either is down, instead of to a replica that
would fail every request. The process's own status ("") stays SERVING: liveness is not readiness.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

log = logging.getLogger(__name__)
TOKENIZER_CHECK_INTERVAL_S = 1.0


class Readiness:
    def __init__(self, health: health_aio.HealthServicer, service: str,
                 tokenizer_serving: Callable[[], Awaitable[bool]]) -> None:
        self._health = health
        self._service = service
        self._tokenizer_serving = tokenizer_serving
        self._worker_ok = True  # until told otherwise: the engine starts only with a worker
        self._tokenizer_ok = True
        self._watch: asyncio.Task[None] | None = None

    async def worker_available(self, available: bool) -> None:
        self._worker_ok = available
        await self._publish()

    def watch_tokenizer(self, interval_s: float = TOKENIZER_CHECK_INTERVAL_S) -> None:
        self._watch = asyncio.create_task(self._watch_tokenizer(interval_s), name="tokenizer-readiness")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    async def _watch_tokenizer(self, interval_s: float) -> None:
        while True:
            serving = await self._tokenizer_serving()
            if serving != self._tokenizer_ok:
                log.warning("the tokenizer service %s", "is serving again" if serving else "is not serving")
                self._tokenizer_ok = serving
                await self._publish()
            await asyncio.sleep(interval_s)

    async def _publish(self) -> None:
        ready = self._worker_ok and self._tokenizer_ok
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set(self._service, status)
