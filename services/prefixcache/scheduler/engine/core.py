"""EngineCore: the asyncio engine around the scheduling policy.

One task runs the step loop: schedule, execute on the worker, apply the output, hand each request's
outputs to its own unbounded queue (so a slow client never holds up the loop). Clients read their
queue through the iterator `add_request` returns; leaving that iterator early aborts the request.

If the worker is lost, every in-flight request that has streamed tokens ends with `EngineUnavailable`,
the cache manager is replaced by an empty one, and the worker is initialized again, with backoff,
before new requests are admitted; requests that have streamed nothing yet wait for that worker and
run from the start (`recovery.WorkerRecovery`).

Pure asyncio: the transport lives in the `StepExecutor` (the gRPC worker client, or
`local_executor.LocalExecutor` over a model runner in this process).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

from prefixcache.block_identity.hashing import BlockHasher
from prefixcache.rpc.quoting import quoted
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.engine.admission import check_fits_worker, effective_max_model_len
from prefixcache.scheduler.engine.errors import EngineUnavailable, QueueFull, RequestRejected
from prefixcache.scheduler.engine.executor import StepExecutor, WorkerInfo, WorkerUnavailable
from prefixcache.scheduler.engine.recovery import WORKER_LOST, WorkerRecovery
from prefixcache.scheduler.kv_cache import CacheStats, Diagnosis, KVCacheManager, KvEventLog, LookupLog, diagnose
from prefixcache.scheduler.metrics import SchedulerMetrics
from prefixcache.scheduler.policy import SchedulingPolicy
from prefixcache.scheduler.request import FINISH_ABORT, EngineRequest, RequestOutput, Usage
from prefixcache.step.messages import SchedulerStep, StepOutput

log = logging.getLogger(__name__)

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
        self._policy: SchedulingPolicy | None = None
        self._worker_info: WorkerInfo | None = None
        # The stream of cached hashes outlives a worker loss (it reports the loss as a new epoch).
        self.kv_events = KvEventLog()
        self._streams: dict[str, asyncio.Queue[RequestOutput | Exception]] = {}
        self._recovery = WorkerRecovery(lambda: self._executor.initialize(self.config.block_size), self._fail_stream)
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
        self._recovery.drop_held()
        if self._policy is not None:
            self._policy.drop_all()
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
        return self._policy.num_running if self._policy else 0

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, and those held for a new worker."""
        return (self._policy.num_waiting if self._policy else 0) + self._recovery.num_held

    @property
    def held_requests_wait_s(self) -> float:
        """How long requests held through a worker loss wait for the first try to bring a worker back."""
        return self._recovery.held_requests_wait_s

    @held_requests_wait_s.setter
    def held_requests_wait_s(self, seconds: float) -> None:
        self._recovery.held_requests_wait_s = seconds

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self, request: EngineRequest, on_abandon: Callable[[RequestOutput], None] | None = None,
        tenant_max_waiting: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request; iterate the result for its outputs. Raises RequestRejected, QueueFull or
        EngineUnavailable at once, before anything is queued. QueueFull also when `tenant_max_waiting`
        requests of the request's tenant wait already: one tenant cannot fill the queue for all.

        Leaving the iteration early (closed, or cancelled while waiting) aborts the request; every
        output nobody read, the abort's included, goes to `on_abandon`: they may carry the cache
        account of a request cancelled before its first token, and its evictions.

        The caller tells `metrics.request_finished` why a request it reads ended: what its client
        was told can differ from the final output's reason (a stop string it matched turns "length"
        into "stop", a tokenizer that failed mid-stream makes it "error"). The engine counts only
        the streams it fails itself (the worker lost)."""
        self.validate(request)
        assert self._policy is not None
        if self._policy.num_waiting >= self.config.max_waiting:
            raise QueueFull(f"{self._policy.num_waiting} requests are waiting (max_waiting={self.config.max_waiting})")
        if tenant_max_waiting is not None:
            waiting = sum(state.origin.tenant == request.tenant for state in self._policy.waiting if state.origin)
            if waiting >= tenant_max_waiting:
                raise QueueFull(f"your tenant has {waiting} requests waiting, the most it may; retry later")
        self._policy.add_request(request)
        queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self._streams[request.request_id] = queue
        self._idle.clear()
        self._wakeup.set()
        self.metrics.request_added(request)
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
        held = self._recovery.release(request_id)
        if held is not None:  # waiting for a worker: it has no state anywhere else
            output = RequestOutput(request_id, [], True, reason, Usage(len(held.prompt_token_ids), 0, 0))
            self._deliver(output)
            return output
        output = self._policy.abort(request_id, reason) if self._policy is not None else None
        if output is not None:
            self._deliver(output)
            self._wakeup.set()  # tell the worker to drop it
        return output

    def validate(self, request: EngineRequest) -> None:
        """Raise EngineUnavailable, or RequestRejected if the request cannot run on this worker
        (add_request checks too)."""
        if not self._serving or self._policy is None:
            raise EngineUnavailable("the engine is stopping" if self._stopping
                                    else _STOPPED_AFTER_ERROR if self._crashed else "the worker is not available")
        if request.request_id in self._streams:
            raise RequestRejected("request_id", f"{quoted(request.request_id)} is already in flight")
        assert self._worker_info is not None
        check_fits_worker(request, self._worker_info, self.config)

    @property
    def max_model_len(self) -> int:
        return effective_max_model_len(self.config, self._worker_info)

    @property
    def capacity_tokens(self) -> int:
        """Prompt plus output a request can hold at most: within the model's length and the whole KV cache."""
        info = self._worker_info
        if info is None:
            return self.max_model_len
        return min(self.max_model_len, info.num_kv_blocks * self.config.block_size)

    # ---- cache ----------------------------------------------------------------------------------

    def cache_stats(self) -> CacheStats:
        """Block counts of the KV cache now; queries, hits and evictions (to make room, not by a
        reset) since the engine started, which outlive the cache manager a worker loss replaces."""
        if self._policy is None:
            raise EngineUnavailable("the engine has not started")
        counters = self._policy.counters
        return replace(self._policy.kv_cache.stats(), queries=counters.queried_tokens,
                       hits=counters.hit_tokens, evictions=counters.evictions)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash. Refused (False) while any request holds blocks."""
        return self._policy is not None and self._policy.kv_cache.reset_prefix_cache()

    def cached_blocks(self) -> tuple[int, int, list[bytes]]:
        """(epoch, the last KV events batch's sequence number, every cached hash): the state a reader of
        the KV events stream has once it has applied that batch."""
        if self._policy is None:
            raise EngineUnavailable("the engine has not started")
        self._policy.kv_cache.publish_events()
        return self.kv_events.epoch, self.kv_events.last_seq, self._policy.kv_cache.cached_hashes()

    @property
    def lookups(self) -> LookupLog:
        """Every first lookup since start, counted, the newest kept (they outlive a worker loss)."""
        if self._policy is None:
            raise EngineUnavailable("the engine has not started")
        return self._policy.counters.lookups

    def diagnose(self, window: int) -> Diagnosis:
        """The newest `window` first lookups, judged against today's cache (`kv_cache.diagnosis`)."""
        info = self._worker_info
        if info is None:
            raise EngineUnavailable("the engine has not started")
        return diagnose(self.lookups.last(window), info.num_kv_blocks, self.config.block_size, info.kv_bytes_per_token)

    # ---- the step loop --------------------------------------------------------------------------

    def _install_worker(self, info: WorkerInfo) -> None:
        """Size a fresh KV cache manager (no cached hashes) from the worker's description."""
        hasher = BlockHasher(self.config.block_size, self.config.hash_algo, info.model_id)
        kv_cache = KVCacheManager(info.num_kv_blocks, hasher, enable_caching=self.config.enable_prefix_caching,
                                  events=self.kv_events)
        counters = self._policy.counters if self._policy else None
        self._worker_info = info
        self._policy = SchedulingPolicy(self.config, kv_cache, info.eos_token_ids, self.max_model_len, counters)
        self.metrics.bind(self._policy, held=lambda: self._recovery.num_held, model_name=info.model_id)

    async def _step_loop(self) -> None:
        """Schedule, execute, apply, deliver. While a step runs, the next one is scheduled and sent
        ahead when the policy says it can be (decodes only, nobody waiting): the worker runs steps
        in the order they were sent, so it starts the next as soon as it is free."""
        running: _SentStep | None = None  # the oldest step in flight
        ahead: _SentStep | None = None
        try:
            while True:
                policy = self._policy
                assert policy is not None
                if running is None and not policy.has_work():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    if running is None:
                        running = self._send(policy.schedule())
                    if self.config.schedule_ahead and policy.can_schedule_ahead():
                        ahead = self._send(policy.schedule())
                    output = await running.result
                    outputs = policy.update_from_output(running.step, output)
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
        self._recovery.stream_ended(request_id)
        if not self._streams:
            self._idle.set()

    async def _recover(self, error: Exception) -> None:
        """The worker is gone: fail the requests that streamed tokens, drop the cache, bring a worker
        back and run the held requests on it (`WorkerRecovery` says which and when)."""
        self._serving = False
        assert self._policy is not None
        failed = self._recovery.hold(self._policy, self._streams)
        log.warning("worker lost (%s); failing %d requests, holding %d that streamed nothing yet, "
                    "re-initializing", error, len(failed), self._recovery.num_held)
        await self._announce_worker_availability(False)
        self.metrics.worker_lost()
        for request_id in failed:
            # The error names the worker's address: it stays in the log above, not in a client's status.
            self._fail_stream(request_id, WORKER_LOST)
        info = await self._recovery.initialize_worker()
        self._install_worker(info)
        self._recovery.resubmit(self._policy, lambda request: check_fits_worker(request, info, self.config))
        self._wakeup.set()
        self._serving = not self._stopping
        log.info("worker re-initialized: %d KV blocks, cache empty", info.num_kv_blocks)
        if self._serving:
            await self._announce_worker_availability(True)

    def _fail_stream(self, request_id: str, message: str) -> None:
        """End a request's stream with EngineUnavailable (it has no final output to count it)."""
        self.metrics.request_failed(request_id)
        self._streams[request_id].put_nowait(EngineUnavailable(message))
        self._end_stream(request_id)

    async def _announce_worker_availability(self, available: bool) -> None:
        if self.on_worker_availability is not None:
            await self.on_worker_availability(available)
