"""The scheduling policy: continuous batching with prefix caching, in the style of vLLM v1.

There are no prefill and decode phases. Every step, each running request gets its next tokens (the
rest of its prompt, a chunk of it, or the one token it sampled last) under a token budget and a cap on
the number of running requests; then waiting requests are admitted, each looking up the prefix cache
first so that only its uncached tokens are computed.

A prompt longer than what is left of the budget is chunked only into a step that computes no other
prompt (decodes aside); otherwise it waits for the next step, where it comes first. vLLM v1 fills
every step to the budget instead, which makes each prompt that completes in a step wait for a
chunk of the next one: prompts arriving together get their first token later, for the same total
time (the README's figures compare the two). A request never waits for work queued behind it, so
nothing starves: the head of the queue goes first as soon as the prompts ahead of it are done.

When the KV cache has no room for a running request's next tokens, the most recently admitted running
request is preempted by recompute: its blocks are freed (the full ones stay cached) and it goes back
to the front of the waiting queue, where its re-admission may hit those same blocks again.

While a step runs, the next one can be scheduled ahead when that delays no one: nothing waits for
admission and every running request decodes. Each request then counts the token the step in flight
will sample for it as pending: the next step feeds it back (the worker appends what it samples), the
block it fills is hashed once the token is known, and a request whose pending token ends it by
length is not scheduled again. One that the token in flight ends otherwise (EOS, a stop token) has
computed one token for nothing, and the worker drops it a step later.

The policy is synchronous and knows nothing of transport: `schedule()` builds a diff-based
`SchedulerStep`, `update_from_output()` applies the worker's `StepOutput` and returns the outputs for
the clients. `EngineCore` drives it.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.kv_cache import KVCacheManager, LookupLog
from prefixcache.scheduler.request import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineRequest,
    RequestOutput,
    RequestState,
    RequestStatus,
)
from prefixcache.step.messages import (
    CachedRequestData,
    NewRequestData,
    SchedulerStep,
    StepOutput,
    TokenLogprobs,
)


@dataclass
class PolicyCounters:
    """Cumulative counts for metrics; they outlive a policy (handed to the next after a worker loss)."""

    admissions: int = 0  # admissions from the waiting queue, re-admissions after preemption included
    # Prompt tokens looked up in the prefix cache at first admissions (a recompute after preemption
    # would count a prompt twice, and its generated tokens as prompt), and found there; none with
    # caching off.
    queried_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0  # cached blocks whose hash was dropped to make room
    preemptions: int = 0
    steps: int = 0
    steps_ahead: int = 0  # of those, scheduled while the step before was in flight
    lookups: LookupLog = field(default_factory=LookupLog)  # first lookups: counted, and the newest kept


class SchedulingPolicy:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int | None = None,
        counters: PolicyCounters | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.counters = counters or PolicyCounters()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len or config.max_model_len
        self.requests: dict[str, RequestState] = {}  # unfinished requests, waiting or running
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # in admission order: the last one is preempted first
        self._dropped_ids: list[str] = []  # the worker must forget these at the next step
        # Requests of each step in flight, by step id, each with whether the step samples for it.
        self._in_flight: dict[int, dict[str, tuple[RequestState, bool]]] = {}
        self._next_step_id = 0

    # ---- queues ---------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest, counted: bool = False) -> RequestState:
        """Queue a request. `counted`: its prompt is already in the prefix-cache counters (a request
        submitted again after a worker loss, once admitted before it)."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in flight")
        state = RequestState.from_engine_request(request)
        state.kv.counted = counted
        self.requests[state.request_id] = state
        self.waiting.append(state)
        return state

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        """Whether `schedule()` would produce a step worth sending."""
        return bool(self.requests or self._dropped_ids)

    def can_schedule_ahead(self) -> bool:
        """Whether the next step can be scheduled now, while the last one is in flight, at no one's
        expense: nothing waits for admission (a request admitted a step later than it could have been
        would pay for it in time to first token), every running request decodes the token that step
        samples for it, and not every one of them ends by length with that token."""
        return (not self.waiting and bool(self.running)
                and all(self._pending_samples(request) == 1 and request.num_computed_tokens == request.num_tokens
                        for request in self.running)
                and not all(map(self._ends_by_length, self.running)))

    def _pending_samples(self, request: RequestState) -> int:
        """Tokens the steps in flight will sample for `request`: the next step feeds them back before
        the policy knows them (the worker appends what it samples itself)."""
        return sum(entry[1] for scheduled in self._in_flight.values()
                   if (entry := scheduled.get(request.request_id)) is not None and entry[0] is request)

    def _ends_by_length(self, request: RequestState) -> bool:
        """Whether the tokens pending for `request` end it by length (max_tokens or the model's)."""
        pending = self._pending_samples(request)
        return (len(request.output_token_ids) + pending >= request.max_tokens
                or request.num_tokens + pending >= self.max_model_len)

    # ---- one step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerStep:
        step = SchedulerStep(step_id=self._next_step_id, finished_request_ids=self._dropped_ids,
                             follows_step_id=max(self._in_flight, default=None))
        self._next_step_id += 1
        self._dropped_ids = []
        self._in_flight[step.step_id] = {}
        budget, preempted = self._schedule_running(step, self.config.max_num_batched_tokens)
        if not preempted:  # admitting while preempting would only evict what running requests need
            self._admit_waiting(step, budget)
        self._collect_evictions()
        self.kv_cache.publish_events()  # this step's changes to the cache: one batch of the KV events stream
        self.counters.steps += 1
        self.counters.steps_ahead += step.follows_step_id is not None
        return step

    def _schedule_running(self, step: SchedulerStep, budget: int) -> tuple[int, bool]:
        """Give each running request, oldest first, its next tokens; preempt the newest for room.
        Returns the budget left and whether anyone was preempted."""
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._ends_by_length(request):  # the step in flight samples its last token
                index += 1
                continue
            num_new = min(request.num_tokens + self._pending_samples(request) - request.num_computed_tokens, budget)
            new_block_ids = self.kv_cache.allocate_slots(request.kv, num_new)
            while new_block_ids is None:
                victim = self.running.pop()
                self._preempt(victim, step)
                preempted = True
                if victim is request:
                    return budget, preempted  # it was the newest: nobody after it is left
                new_block_ids = self.kv_cache.allocate_slots(request.kv, num_new)
            step.cached_requests.append(
                CachedRequestData(request.request_id, list(new_block_ids), request.num_computed_tokens)
            )
            budget -= self._mark_scheduled(request, num_new, step)
            index += 1
        return budget, preempted

    def _admit_waiting(self, step: SchedulerStep, budget: int) -> None:
        """Admit waiting requests in order, each taking its cached prefix, while room remains."""
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._pending_samples(request):  # preempted while a step was sampling for it
                return
            lookup_ns = time.time_ns()
            hit_block_ids, account = self.kv_cache.get_computed_blocks(request.kv)
            counted = request.kv.counted  # set by the allocation below, the first time
            num_hit_tokens = len(hit_block_ids) * self.kv_cache.block_size
            num_uncached = request.num_tokens - num_hit_tokens
            if num_uncached > budget and _computes_a_prompt(step):
                return  # a chunk now would only delay the prompts this step finishes
            num_new = min(num_uncached, budget)
            if self.kv_cache.allocate_slots(request.kv, num_new, hit_block_ids) is None:
                return
            self.waiting.popleft()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.kv.num_computed_tokens = num_hit_tokens
            if request.cache_account is None:
                request.cache_account = account
            request.timeline.admitted(lookup_ns)
            if not counted and account.miss_reason != "disabled":
                self.counters.queried_tokens += account.queried_tokens
                self.counters.hit_tokens += num_hit_tokens
                self.counters.lookups.record(self.kv_cache.lookup_record(request.kv, account))
            self.counters.admissions += 1
            step.new_requests.append(
                NewRequestData(
                    request_id=request.request_id,
                    token_ids=list(request.kv.token_ids),
                    block_ids=self.kv_cache.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    sampling=request.sampling,
                )
            )
            request.known_to_worker = True
            budget -= self._mark_scheduled(request, num_new, step)

    def _collect_evictions(self) -> None:
        """Count this step's evictions and hand each to the request whose allocation caused it."""
        for batch in self.kv_cache.drain_events():
            if batch.evicting_request_id is None:
                continue  # dropped by a cache reset, not by an allocation
            self.counters.evictions += len(batch)
            evictor = self.requests.get(batch.evicting_request_id)
            if evictor is not None:
                evictor.pending_evictions.append(batch)

    def _mark_scheduled(self, request: RequestState, num_new: int, step: SchedulerStep) -> int:
        step.num_scheduled_tokens[request.request_id] = num_new
        pending = self._pending_samples(request)
        # A decode feeds back one sampled token; anything else computes prompt (or recomputes after a preemption).
        request.timeline.scheduled(step.step_id, num_new, prefill=num_new > 1 or not (request.output_token_ids or pending))
        request.kv.num_computed_tokens += num_new
        samples = request.num_computed_tokens == request.num_tokens + pending
        self._in_flight[step.step_id][request.request_id] = (request, samples)
        return num_new

    def _preempt(self, request: RequestState, step: SchedulerStep) -> None:
        self.kv_cache.free(request.request_id)
        request.kv.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.counters.preemptions += 1
        self.waiting.appendleft(request)
        if request.known_to_worker:
            step.finished_request_ids.append(request.request_id)
            request.known_to_worker = False

    # ---- the worker's answer --------------------------------------------------------------------

    def update_from_output(self, step: SchedulerStep, output: StepOutput) -> list[RequestOutput]:
        """Append each sampled token, check stop conditions, finish what is done.

        Requests aborted while the step ran are skipped. Raises ValueError if the worker's answer
        does not match the step (a token missing or unexpected): the worker and the policy no
        longer agree, and the caller must treat the worker as lost.
        """
        if output.step_id != step.step_id:
            raise ValueError(f"output of step {output.step_id} applied to step {step.step_id}")
        scheduled = self._in_flight.get(step.step_id)
        if scheduled is None:
            raise ValueError(f"step {step.step_id} is not in flight")
        outputs: list[RequestOutput] = []
        for request_id in output.sampled_token_ids:
            if request_id not in step.num_scheduled_tokens:
                raise ValueError(f"worker sampled for {request_id!r}, which step {step.step_id} did not schedule")
        # The whole answer is checked before any of it is taken: one that does not fit leaves every
        # request as it was (no token appended to some), and the engine treats the worker as lost.
        sampled: list[tuple[RequestState, int]] = []
        for request_id, (request, samples) in scheduled.items():
            if self.requests.get(request_id) is not request:
                continue  # ended (and maybe re-added under the same id) while the step ran
            token_id = output.sampled_token_ids.get(request_id)
            if samples != (token_id is not None):
                raise ValueError(
                    f"worker {'did not sample' if samples else 'sampled'} for {request_id!r} in step {step.step_id}"
                )
            if token_id is not None:  # None: mid-way through a chunked prefill
                sampled.append((request, token_id))
        del self._in_flight[step.step_id]
        now = time.time_ns()
        for request, _ in scheduled.values():
            request.timeline.step_done(step.step_id, now)
        for request, token_id in sampled:
            if request.timeline.first_token_ns is None:
                request.timeline.first_token_ns = now
            request.append_output_token(token_id)
            finish_reason = self._stop_reason(request, token_id)
            logprobs = output.logprobs.get(request.request_id)
            outputs.append(self._output(request, [token_id], finish_reason, (logprobs,) if logprobs else ()))
            if finish_reason is not None:
                self._finish(request)
        return outputs

    def _stop_reason(self, request: RequestState, token_id: int) -> str | None:
        if token_id in request.stop_token_ids or (not request.ignore_eos and token_id in self.eos_token_ids):
            return FINISH_STOP
        if len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return FINISH_LENGTH
        return None

    def _output(
        self,
        request: RequestState,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: tuple[TokenLogprobs, ...] = (),
    ) -> RequestOutput:
        finished = finish_reason is not None
        first = not request.sent_first_output
        request.sent_first_output = True
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            finished=finished,
            finish_reason=finish_reason,
            usage=request.usage if finished else None,
            cache_account=request.cache_account if (first or finished) else None,
            logprobs=logprobs,
            evictions=request.take_evictions(),
            num_preemptions=request.num_preemptions,
            timeline=request.timeline if finished else None,
        )

    def _finish(self, request: RequestState) -> None:
        request.timeline.finished_ns = time.time_ns()
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv_cache.free(request.request_id)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        if request.known_to_worker:
            self._dropped_ids.append(request.request_id)
            request.known_to_worker = False

    # ---- ending requests from outside -----------------------------------------------------------

    def abort(self, request_id: str, reason: str = FINISH_ABORT) -> RequestOutput | None:
        """End a request now and free its blocks; its last output carries `reason` (FINISH_STOP when
        the servicer matched a stop string). Unknown or finished ids are ignored (returns None)."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        output = self._output(request, [], reason)
        self._finish(request)
        return output

    def drop_all(self) -> list[tuple[str, EngineRequest | None]]:
        """Forget every request, free every block and every cached hash: the worker is gone, and its
        KV with it. Returns each request that was in flight: its id, and what was submitted if it has
        produced no output yet (so it can be submitted again as it was), else None."""
        dropped = [(request.request_id, None if request.sent_first_output else request.origin)
                   for request in self.requests.values()]
        for request in self.running:
            self.kv_cache.free(request.request_id)
            request.status = RequestStatus.FINISHED
        self.kv_cache.reset_prefix_cache()  # nothing holds a block now, so this cannot refuse
        for request in self.waiting:
            request.status = RequestStatus.FINISHED
        self.requests.clear()
        self.running.clear()
        self.waiting.clear()
        self._dropped_ids = []
        self._in_flight = {}
        return dropped


def _computes_a_prompt(step: SchedulerStep) -> bool:
    """Whether `step` already computes prompt tokens (a decode computes exactly one token)."""
    return any(num_tokens > 1 for num_tokens in step.num_scheduled_tokens.values())
