"""EngineCore: the asyncio engine around the scheduling policy.

One task runs the step loop: schedule, execute on the worker, apply the output, hand each request's
outputs to its own unbounded queue (so a slow client never holds up the loop). Clients read their
queue through the iterator `add_request` returns; leaving that iterator early aborts the request.

If the worker is lost, every in-flight request that has streamed tokens ends with `EngineUnavailable`,
all blocks and every cached hash are dropped (the KV memory died with the worker), and the worker is
initialized again, with backoff, before new requests are admitted. Requests that have streamed nothing
yet wait for that worker and then run from the start: their clients never see the loss (a worker
restarted while the engine was idle is only noticed by the next request's step).

Pure asyncio: the transport lives in the `StepExecutor` (the gRPC worker client, or
`local_executor.LocalExecutor` over a model runner in this process).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Protocol

from prefixcache.block_identity.hashing import BlockHasher
from prefixcache.rpc.quoting import quoted
from prefixcache.scheduler.kv_cache import CacheStats, KVCacheManager
from prefixcache.scheduler.metrics import SchedulerMetrics
from prefixcache.scheduler.policy import Scheduler, SchedulerConfig
from prefixcache.scheduler.request import FINISH_ABORT, EngineRequest, RequestOutput, Usage
from prefixcache.step.messages import SchedulerStep, StepOutput

__all__ = [
    "EngineCore",
    "EngineRequest",
    "EngineUnavailable",
    "QueueFull",
    "RequestOutput",
    "RequestRejected",
    "SchedulerConfig",
    "StepExecutor",
    "Usage",
    "WorkerInfo",
    "WorkerUnavailable",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerInfo:
    """The worker's description of its model and KV cache."""

    model_id: str  # names the exact weights; part of every block hash
    vocab_size: int
    max_model_len: int
    num_kv_blocks: int  # blocks of the scheduler's block size the worker's KV cache holds
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = ""
    supports_multimodal: bool = False
    tokenizer_id: str = ""  # of the model's tokenizer.json; "" when unknown


class WorkerUnavailable(Exception):
    """Raised by a StepExecutor when the worker is gone (crashed, unreachable)."""


class EngineUnavailable(Exception):
    """The engine cannot serve: the worker is down (or restarting), or the engine is stopping."""


class QueueFull(Exception):
    """The waiting queue is full; the client should retry later."""


class RequestRejected(ValueError):
    """Bad input, detected before the request was queued. `field` names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class StepExecutor(Protocol):
    async def initialize(self, block_size: int) -> WorkerInfo:
        """(Re)initialize the worker's KV cache for this block size and describe the model."""
        ...

    async def execute(self, step: SchedulerStep) -> StepOutput:
        """Run one step. Raises WorkerUnavailable if the worker is gone."""
        ...


_RECOVERY_BACKOFF_S = (0.05, 2.0)  # first and longest wait between re-initialization attempts
# Requests held for a new worker wait at most this long for the first try to answer: a worker that
# accepts the call but hangs would otherwise hold them for the whole initialization timeout.
HELD_REQUESTS_WAIT_S = 10.0
_WORKER_LOST = "the worker was lost; retry the request"
_STOPPED_AFTER_ERROR = "the engine stopped serving after an internal error"


@dataclass(frozen=True)
class _SentStep:
    step: SchedulerStep
    result: asyncio.Future[StepOutput]


async def _cancel(sent: _SentStep | None) -> None:
    """Cancel a step's call and wait for it to end, so that nothing of it reaches a new worker."""
    if sent is None:
        return
    sent.result.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await sent.result


class EngineCore:
    def __init__(
        self, config: SchedulerConfig, executor: StepExecutor, metrics: SchedulerMetrics | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics or SchedulerMetrics()
        self._executor = executor
        self._scheduler: Scheduler | None = None
        self._worker_info: WorkerInfo | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        # Requests that had streamed nothing when the worker was lost: resubmitted once it is back,
        # once only (a request that brings the worker down again, e.g. by running it out of memory,
        # must not do so forever).
        self._held: dict[str, EngineRequest] = {}
        self._held_counted: set[str] = set()  # held requests already in the prefix-cache counters
        self._resubmitted: set[str] = set()
        self.held_requests_wait_s = HELD_REQUESTS_WAIT_S
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # set when no request is in flight
        self._idle.set()
        self._loop_task: asyncio.Task[None] | None = None
        self._crashed = False  # the step loop ended on an unexpected error: see `_step_loop_ended`
        self._crash_announcement: asyncio.Future[None] | None = None
        self._serving = False  # admitting requests: started, worker up, not shutting down
        self._stopping = False
        # Told when a lost worker takes serving away (False) and when a new one brings it back
        # (True), e.g. to flip the Engine's gRPC health so that load balancers look elsewhere.
        self.on_worker_availability: Callable[[bool], Awaitable[None]] | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._install_worker(await self._executor.initialize(self.config.block_size))
        self._loop_task = asyncio.create_task(self._step_loop(), name="engine-step-loop")
        self._loop_task.add_done_callback(self._step_loop_ended)
        self._serving = True

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let in-flight requests finish for up to `grace_s`, abort the rest, stop."""
        self._serving = False
        self._stopping = True
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except TimeoutError:
            for request_id in list(self._streams):
                self.abort(request_id)
        if self._loop_task is not None:
            self._loop_task.cancel()
            # Cancelled now, or crashed earlier (`_step_loop_ended` reported that).
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._loop_task
            self._loop_task = None

    def _step_loop_ended(self, task: asyncio.Task[None]) -> None:
        """The step loop only ends when cancelled. Should a bug end it otherwise, say so loudly, end
        every stream (counted once, as errors: nothing is left to abort) and tell health checks, so
        that clients do not wait on an engine that no longer steps and an orchestrator replaces it."""
        if task.cancelled() or task.exception() is None:
            return
        log.critical("the engine's step loop stopped: %r; it no longer serves", task.exception(),
                     exc_info=task.exception())
        self._serving = False
        self._crashed = True
        self._held = {}
        if self._scheduler is not None:
            self._scheduler.drop_all()
        for request_id in list(self._streams):
            self._fail_stream(request_id, _STOPPED_AFTER_ERROR)
        self._crash_announcement = asyncio.ensure_future(self._announce_crash())

    async def _announce_crash(self) -> None:
        with contextlib.suppress(Exception):  # the announcement may be what failed
            await self._announce_worker_availability(False)

    @property
    def worker_info(self) -> WorkerInfo | None:
        return self._worker_info

    @property
    def is_serving(self) -> bool:
        return self._serving

    @property
    def num_running(self) -> int:
        return self._scheduler.num_running if self._scheduler else 0

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, and those held for a new worker."""
        return (self._scheduler.num_waiting if self._scheduler else 0) + len(self._held)

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, request: EngineRequest, on_abandon: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; iterate the result for its outputs. Raises RequestRejected, QueueFull or
        EngineUnavailable at once, before anything is queued.

        Leaving the iteration early (closed, or cancelled while waiting) aborts the request; every
        output nobody read, the abort's included, goes to `on_abandon`: they may carry the cache
        account of a request cancelled before its first token, and its evictions.

        The caller tells `metrics.request_finished` why a request it reads ended: what its client
        was told can differ from the final output's reason (a stop string it matched turns "length"
        into "stop", a tokenizer that failed mid-stream makes it "error"). The engine counts only
        the streams it fails itself (the worker lost)."""
        self.validate(request)
        assert self._scheduler is not None
        if self._scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFull(f"{self._scheduler.num_waiting} requests are waiting (max_waiting={self.config.max_waiting})")
        self._scheduler.add_request(request)
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._idle.clear()
        self._wakeup.set()
        self.metrics.request_added(len(request.prompt_token_ids))
        return self._stream(request.request_id, queue, on_abandon)

    async def _stream(
        self,
        request_id: str,
        queue: asyncio.Queue[RequestOutput | Exception],
        on_abandon: Callable[[RequestOutput], None] | None,
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                if self._streams.get(request_id) is queue:
                    self.abort(request_id)  # the client went away: free its blocks now
                while on_abandon is not None and not queue.empty():  # delivered, never read (the abort's too)
                    if isinstance(unread := queue.get_nowait(), RequestOutput):
                        on_abandon(unread)

    def abort(self, request_id: str, reason: str = FINISH_ABORT) -> RequestOutput | None:
        """End a request now and free its blocks; its stream gets a last output with `reason`
        ("abort" unless the caller ended it for another reason, a stop string: "stop"), which is
        also returned, for a caller that no longer reads the stream. Unknown or finished ids are
        ignored (None)."""
        held = self._held.pop(request_id, None)
        if held is not None:  # waiting for a worker: it has no state anywhere else
            output = RequestOutput(request_id, [], True, reason, Usage(len(held.prompt_token_ids), 0, 0))
            self._deliver(output)
            return output
        output = self._scheduler.abort(request_id, reason) if self._scheduler is not None else None
        if output is not None:
            self._deliver(output)
            self._wakeup.set()  # tell the worker to drop it
        return output

    def validate(self, request: EngineRequest) -> None:
        """Raise EngineUnavailable, or RequestRejected if the request cannot run on this worker
        (add_request checks too)."""
        if not self._serving or self._scheduler is None:
            raise EngineUnavailable("the engine is stopping" if self._stopping
                                    else _STOPPED_AFTER_ERROR if self._crashed else "the worker is not available")
        if request.request_id in self._streams:
            raise RequestRejected("request_id", f"{quoted(request.request_id)} is already in flight")
        self._check_fits_worker(request)

    def _check_fits_worker(self, request: EngineRequest) -> None:
        assert self._worker_info is not None
        info = self._worker_info
        prompt = request.prompt_token_ids
        if not prompt:
            raise RequestRejected("prompt_token_ids", "the prompt is empty")
        bad = next((t for t in prompt if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise RequestRejected("prompt_token_ids", f"token id {bad} is outside the vocabulary [0, {info.vocab_size})")
        if request.max_tokens <= 0:
            raise RequestRejected("max_tokens", f"must be positive, got {request.max_tokens}")
        if request.sampling.logprobs > info.vocab_size:
            raise RequestRejected("logprobs", f"asks for {request.sampling.logprobs} alternatives; "
                                  f"the vocabulary has {info.vocab_size} tokens")
        max_len = self.max_model_len
        if len(prompt) >= max_len:
            raise RequestRejected(
                "prompt_token_ids", f"the prompt ({len(prompt)} tokens) leaves no room to generate within the "
                f"maximum length {max_len}")
        if len(prompt) + request.max_tokens > max_len:
            raise RequestRejected(
                "max_tokens",
                f"prompt ({len(prompt)} tokens) + max_tokens ({request.max_tokens}) exceeds the maximum length {max_len}",
            )
        # KV slots a request can hold at once: every token but the last one generated, which is
        # sampled and never fed back.
        block_size = self.config.block_size
        prompt_blocks = -(-len(prompt) // block_size)
        if prompt_blocks > info.num_kv_blocks:
            raise RequestRejected(
                "prompt_token_ids",
                f"the prompt ({len(prompt)} tokens) needs {prompt_blocks} KV blocks; "
                f"the worker has {info.num_kv_blocks}",
            )
        blocks_needed = -(-(len(prompt) + request.max_tokens - 1) // block_size)
        if blocks_needed > info.num_kv_blocks:
            raise RequestRejected(
                "max_tokens",
                f"prompt + max_tokens needs {blocks_needed} KV blocks; the worker has {info.num_kv_blocks}",
            )
        if problem := request.sampling.problem():
            raise RequestRejected(*problem)
        if request.extras.mm_items and not info.supports_multimodal:
            raise RequestRejected("multimodal", f"the model {info.model_id!r} takes text only")
        bad_stop = next((t for t in request.stop_token_ids if not 0 <= t < info.vocab_size), None)
        if bad_stop is not None:
            raise RequestRejected("stop_token_ids", f"token id {bad_stop} is outside the vocabulary")

    @property
    def max_model_len(self) -> int:
        limit = self.config.max_model_len
        return min(limit, self._worker_info.max_model_len) if self._worker_info else limit

    # ---- cache ----------------------------------------------------------------------------------

    def cache_stats(self) -> CacheStats:
        """Block counts of the KV cache now; queries, hits and evictions (to make room, not by a
        reset) since the engine started, which outlive the cache manager a worker loss replaces."""
        if self._scheduler is None:
            raise EngineUnavailable("the engine has not started")
        counters = self._scheduler.counters
        return replace(self._scheduler.kv_cache.stats(), queries=counters.queried_tokens,
                       hits=counters.hit_tokens, evictions=counters.evictions)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Refused (False) while any request holds blocks."""
        return self._scheduler is not None and self._scheduler.kv_cache.reset_prefix_cache()

    # ---- the step loop --------------------------------------------------------------------------

    def _install_worker(self, info: WorkerInfo) -> None:
        """Size a fresh KV cache manager (no cached hashes) from the worker's description."""
        hasher = BlockHasher(self.config.block_size, self.config.hash_algo, info.model_id)
        kv_cache = KVCacheManager(info.num_kv_blocks, hasher, enable_caching=self.config.enable_prefix_caching)
        counters = self._scheduler.counters if self._scheduler else None
        self._worker_info = info
        self._scheduler = Scheduler(self.config, kv_cache, info.eos_token_ids, self.max_model_len, counters)
        self.metrics.bind(self._scheduler, held=lambda: len(self._held))

    async def _step_loop(self) -> None:
        """Schedule, execute, apply, deliver. While a step runs, the next one is scheduled and sent
        ahead when the scheduler says it can be (decodes only, nobody waiting): the worker runs steps
        in the order they were sent, so it starts the next as soon as it is free."""
        running: _SentStep | None = None  # the oldest step in flight
        ahead: _SentStep | None = None
        try:
            while True:
                scheduler = self._scheduler
                assert scheduler is not None
                if running is None and not scheduler.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    if running is None:
                        running = self._send(scheduler.schedule())
                    if self.config.schedule_ahead and scheduler.can_schedule_ahead():
                        ahead = self._send(scheduler.schedule())
                    output = await running.result
                    outputs = scheduler.update_from_output(running.step, output)
                except Exception as error:
                    if not isinstance(error, WorkerUnavailable):  # a bug or an answer that does not fit the step
                        log.exception("step failed; treating the worker state as lost")
                    for sent in (running, ahead):
                        await _cancel(sent)
                    running = ahead = None
                    await self._recover(error)
                    continue
                running, ahead = ahead, None
                for request_output in outputs:
                    self._deliver(request_output)
                await asyncio.sleep(0)  # let clients and new requests in, even with an executor that never yields
        finally:
            for sent in (running, ahead):
                if sent is not None:
                    sent.result.cancel()

    def _send(self, step: SchedulerStep) -> _SentStep:
        return _SentStep(step, asyncio.ensure_future(self._executor.execute(step)))

    def _deliver(self, output: RequestOutput) -> None:
        self.metrics.output_delivered(output)
        queue = self._streams.get(output.request_id)
        if queue is None:
            return
        queue.put_nowait(output)
        if output.finished:
            self._end_stream(output.request_id)

    def _end_stream(self, request_id: str) -> None:
        del self._streams[request_id]
        self._resubmitted.discard(request_id)
        if not self._streams:
            self._idle.set()

    async def _recover(self, error: Exception) -> None:
        """The worker is gone: fail the requests that streamed tokens, drop the cache, bring a worker
        back. Requests that streamed nothing run again from the start only if a worker answers at
        the first try, within `held_requests_wait_s` (one restarted while the engine was idle, which
        only the next step finds out); otherwise they end UNAVAILABLE too, rather than wait an
        unknown time for one."""
        self._serving = False
        assert self._scheduler is not None
        self._held_counted = {request.request_id for request in self._scheduler.requests.values() if request.kv.counted}
        self._held = {request_id: engine_request for request_id, engine_request in self._scheduler.drop_all()
                      if request_id in self._streams and engine_request is not None
                      and request_id not in self._resubmitted}
        failed = [request_id for request_id in self._streams if request_id not in self._held]
        log.warning("worker lost (%s); failing %d requests, holding %d that streamed nothing yet, "
                    "re-initializing", error, len(failed), len(self._held))
        await self._announce_worker_availability(False)
        self.metrics.worker_lost()
        for request_id in failed:
            # The error names the worker's address: it stays in the log above, not in a client's status.
            self._fail_stream(request_id, _WORKER_LOST)
        info = await self._initialize_worker()
        self._install_worker(info)
        self._resubmit_held()
        self._serving = not self._stopping
        log.info("worker re-initialized: %d KV blocks, cache empty", info.num_kv_blocks)
        if self._serving:
            await self._announce_worker_availability(True)

    async def _initialize_worker(self) -> WorkerInfo:
        """Initialize the worker's cache, retrying with backoff until it answers; the held requests
        end UNAVAILABLE as soon as the first try fails, or once it has been out for
        `held_requests_wait_s`."""
        delay, longest = _RECOVERY_BACKOFF_S
        while True:
            attempt = asyncio.ensure_future(self._executor.initialize(self.config.block_size))
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
            self._fail_stream(request_id, _WORKER_LOST)

    def _resubmit_held(self) -> None:
        """Queue the held requests on the new worker's scheduler (failing any the new worker cannot
        serve, e.g. a smaller vocabulary)."""
        assert self._scheduler is not None
        held, self._held = self._held, {}
        for request_id, request in held.items():
            try:
                self._check_fits_worker(request)
            except RequestRejected as rejection:
                self._fail_stream(request_id, f"the new worker cannot serve it: {rejection}")
                continue
            self._scheduler.add_request(request, counted=request_id in self._held_counted)
            self._resubmitted.add(request_id)
        self._wakeup.set()

    def _fail_stream(self, request_id: str, message: str) -> None:
        """End a request's stream with EngineUnavailable (it has no final output to count it)."""
        self.metrics.request_failed()
        self._streams[request_id].put_nowait(EngineUnavailable(message))
        self._end_stream(request_id)

    async def _announce_worker_availability(self, available: bool) -> None:
        if self.on_worker_availability is not None:
            await self.on_worker_availability(available)
