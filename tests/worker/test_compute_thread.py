"""ComputeThread: every call on one and the same thread (one OpenMP team for torch), with the caller's context."""
from __future__ import annotations

import asyncio
import contextvars
import threading

import pytest

from prefixcache.worker.compute_thread import ComputeThread

REQUEST = contextvars.ContextVar("request", default=None)


def test_every_call_runs_on_one_thread_other_than_the_event_loops() -> None:
    compute = ComputeThread("test")

    async def main() -> set[int]:
        idents = await asyncio.gather(*(compute.run(threading.get_ident) for _ in range(16)))
        return set(idents) | {threading.get_ident()}

    idents = asyncio.run(main())
    assert len(idents) == 2  # the loop's thread and the compute thread, whatever the concurrency


def test_calls_see_the_callers_context_and_raise_its_errors() -> None:
    compute = ComputeThread()

    async def main() -> str | None:
        REQUEST.set("req-1")
        return await compute.run(REQUEST.get)

    assert asyncio.run(main()) == "req-1"
    with pytest.raises(ZeroDivisionError):
        asyncio.run(compute.run(divmod, 1, 0))
