"""Recovery from a lost worker: the requests held for a new one, and bringing one back.

All blocks and every cached hash go with the worker (the KV memory died with it). Requests that
have streamed nothing yet are held and run again from the start on the next worker, so their
clients never see the loss (a worker restarted while the engine was idle is only noticed by the
next request's step); the others end with `EngineUnavailable`.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection

from prefixcache.scheduler.engine.errors import RequestRejected
from prefixcache.scheduler.engine.executor import WorkerInfo, WorkerUnavailable
from prefixcache.scheduler.policy import SchedulingPolicy
from prefixcache.scheduler.request import EngineRequest

log = logging.getLogger(__name__)

RECOVERY_BACKOFF_S = (0.05, 2.0)  # first and longest wait between re-initialization attempts
# Requests held for a new worker wait at most this long for the first try to answer: a worker that
# accepts the call but hangs would otherwise hold them for the whole initialization timeout.
HELD_REQUESTS_WAIT_S = 10.0
WORKER_LOST = "the worker was lost; retry the request"


class WorkerRecovery:
    """Holds the requests waiting for a new worker, and initializes one, with backoff, until it answers.

    `initialize` (re)initializes the worker; `fail_stream(request_id, message)` ends a request's
    stream with `EngineUnavailable`. A request is held once only: one that brings the worker down
    again (e.g. by running it out of memory) must not do so forever. Held requests run again only if
    a worker answers at the first try, within `held_requests_wait_s`; otherwise they end UNAVAILABLE
    too, rather than wait an unknown time for one.
    """

    def __init__(self, initialize: Callable[[], Awaitable[WorkerInfo]],
                 fail_stream: Callable[[str, str], None]) -> None:
        self._initialize = initialize
        self._fail_stream = fail_stream
        self.held_requests_wait_s = HELD_REQUESTS_WAIT_S
        self._held: dict[str, EngineRequest] = {}
        self._held_counted: set[str] = set()  # held requests already in the prefix-cache counters
        self._resubmitted: set[str] = set()  # run again after a loss, and still streaming

    @property
    def num_held(self) -> int:
        return len(self._held)

    def hold(self, policy: SchedulingPolicy, streaming: Collection[str]) -> list[str]:
        """Take every request off the lost worker's policy and hold those of `streaming` that have
        streamed nothing and were not run again already. Returns the other ids of `streaming`, whose
        streams the caller fails."""
        self._held_counted = {request.request_id for request in policy.requests.values() if request.kv.counted}
        self._held = {request_id: engine_request for request_id, engine_request in policy.drop_all()
                      if request_id in streaming and engine_request is not None
                      and request_id not in self._resubmitted}
        return [request_id for request_id in streaming if request_id not in self._held]

    async def initialize_worker(self) -> WorkerInfo:
        """Initialize the worker's cache, retrying with backoff until it answers; the held requests
        end UNAVAILABLE as soon as the first try fails, or once it has been out for
        `held_requests_wait_s`."""
        delay, longest = RECOVERY_BACKOFF_S
        while True:
            attempt = asyncio.ensure_future(self._initialize())
            try:
                if self._held:
                    await asyncio.wait({attempt}, timeout=self.held_requests_wait_s)
                    if not attempt.done():
                        self._fail_held(f"no answer within {self.held_requests_wait_s:.0f}s")
                return await attempt
            except Exception as retry_error:  # not back yet, or back but failing: keep trying
                self._fail_held("it failed")
                # Unreachable is expected while it restarts; a worker that answers and refuses (its
                # KV budget holds no block) needs someone to change its settings.
                level = logging.INFO if isinstance(retry_error, WorkerUnavailable) else logging.ERROR
                log.log(level, "worker not back yet (%s); retrying in %.2fs", retry_error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, longest)
            finally:
                attempt.cancel()  # a no-op once it finished; stops a try still out when we are cancelled

    def _fail_held(self, why: str) -> None:
        """End the requests held for a new worker, whose first try to come back did not answer."""
        if not self._held:
            return
        log.warning("first try to bring the worker back: %s; failing the %d held requests", why, len(self._held))
        held, self._held = self._held, {}
        for request_id in held:
            self._fail_stream(request_id, WORKER_LOST)

    def resubmit(self, policy: SchedulingPolicy, check_fits: Callable[[EngineRequest], None]) -> None:
        """Queue the held requests on the new worker's policy, failing any that `check_fits` rejects
        (the new worker cannot serve it, e.g. a smaller vocabulary)."""
        held, self._held = self._held, {}
        for request_id, request in held.items():
            try:
                check_fits(request)
            except RequestRejected as rejection:
                self._fail_stream(request_id, f"the new worker cannot serve it: {rejection}")
                continue
            policy.add_request(request, counted=request_id in self._held_counted)
            self._resubmitted.add(request_id)

    def release(self, request_id: str) -> EngineRequest | None:
        """Stop holding a request (its client or a shutdown ended it): what was submitted, or None
        if it is not held."""
        return self._held.pop(request_id, None)

    def stream_ended(self, request_id: str) -> None:
        self._resubmitted.discard(request_id)

    def drop_held(self) -> None:
        """Forget the held requests: the engine stopped serving and fails every stream itself."""
        self._held = {}
