"""One dedicated thread for a process's model computation.

torch's CPU kernels run on OpenMP, which keeps a separate team of worker threads for each thread
that starts parallel work. `asyncio.to_thread` hands each call to whichever pool thread is free,
so loading on one thread and stepping on others leaves several teams competing for the same
cores, and a decode step takes far longer than when every torch call comes from one thread.
Routing all of them through one `ComputeThread` keeps one team.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class ComputeThread:
    def __init__(self, name: str = "compute") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `function` on the thread and await its result, with the caller's context (trace
        spans started inside are children of the caller's), as `asyncio.to_thread` does."""
        call = functools.partial(contextvars.copy_context().run, function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)
