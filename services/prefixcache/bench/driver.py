"""Drive a workload through an engine: arrivals, conversation order and a concurrency bound."""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixcache.bench.metrics import RequestRecord
from prefixcache.bench.workloads import BenchRequest


class TenantSalts:
    """One fresh 256-bit secret per tenant, made per run and never printed.

    Fresh salts also make each run start cold on a long-lived server, so a second run of the same
    seed is not flattered by the first one's cache.
    """

    def __init__(self, tenants: int) -> None:
        self._salts = [secrets.token_urlsafe(32) for _ in range(tenants)]

    def __getitem__(self, tenant: int) -> str:
        return self._salts[tenant]

    def __repr__(self) -> str:
        return f"TenantSalts({len(self._salts)} tenants)"


class StreamingEndpoint(Protocol):
    """What the driver needs from a server: `EngineEndpoint`, or a baseline's adapter in benchmarks/."""

    async def stream(self, request: BenchRequest, salt: str, clock: Callable[[], float]) -> RequestRecord:
        """Send one request and record its stream; failures go into the record, not raised."""

    async def evictions(self) -> int:
        """The server's cumulative count of evicted cached blocks (0 where it keeps none)."""


@dataclass(frozen=True, slots=True)
class DriveResult:
    records: list[RequestRecord]
    evictions: int  # from GetCacheStats before and after the run


async def drive(
    endpoint: StreamingEndpoint,
    requests: Sequence[BenchRequest],
    concurrency: int,
    salts: TenantSalts,
    on_done: Callable[[RequestRecord], None] = lambda record: None,
) -> DriveResult:
    """Send every request no earlier than its arrival offset and after the request it follows,
    with at most `concurrency` in flight. Times in the records are seconds since the run began."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    known = {r.request_id for r in requests}
    for request in requests:
        if request.after is not None and request.after not in known:
            raise ValueError(f"request {request.request_id} follows unknown request {request.after}")
    slots = asyncio.Semaphore(concurrency)
    finished = {r.request_id: asyncio.Event() for r in requests}
    evictions_before = await endpoint.evictions()
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    async def one(request: BenchRequest) -> RequestRecord:
        await asyncio.sleep(max(0.0, request.arrival_s - clock()))
        if request.after is not None:
            await finished[request.after].wait()
        async with slots:  # taken only once the request may go, so waiting turns hold no slot
            record = await endpoint.stream(request, salts[request.tenant], clock)
        finished[request.request_id].set()
        on_done(record)
        return record

    records = await asyncio.gather(*(one(r) for r in requests))
    return DriveResult(list(records), await endpoint.evictions() - evictions_before)
