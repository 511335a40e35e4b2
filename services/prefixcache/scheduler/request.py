"""What goes into the engine (`EngineRequest`), what comes out (`RequestOutput`), and the scheduling
policy's per-request state in between (`RequestState`).

Pure data: no asyncio, no transport. The gRPC servicer converts its messages to and from these.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from prefixcache.block_identity.hashing import BlockExtras
from prefixcache.scheduler.kv_cache import CacheAccount, EvictionBatch, KVRequest
from prefixcache.step.messages import SamplingParams, TokenLogprobs

FINISH_STOP = "stop"  # EOS, a stop token, or a stop string (matched by the servicer, which then ends the request)
FINISH_LENGTH = "length"  # max_tokens or the model's maximum length reached
FINISH_ABORT = "abort"  # client cancel, deadline, shutdown


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    extras: BlockExtras = field(default_factory=BlockExtras)  # LoRA, multimodal items, cache salt
    tenant: str = ""  # the tenant's one-way label, for its share of the waiting queue ("" without tenants)
    # Its span's context when traced (opaque here): what it evicts and stores is linked to it.
    trace_context: object | None = None
    arrival_ns: int | None = None  # when the call arrived (time.time_ns); None: when it is queued


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache at the request's first admission
    completion_tokens: int


@dataclass
class StepWork:
    """One step's computation of a request's prompt (or, after a preemption, of its recompute)."""

    step_id: int
    num_tokens: int
    scheduled_ns: int  # wall clock (time.time_ns), as every time here
    done_ns: int | None = None  # when the step's result came back


@dataclass
class RequestTimeline:
    """When a request's phases happened: for its span's children and the latency histograms."""

    arrival_ns: int
    queued_ns: int
    lookup_ns: int | None = None  # the admitting cache lookup began
    admitted_ns: int | None = None  # first admission (the lookup ended)
    prefill: list[StepWork] = field(default_factory=list)
    first_token_ns: int | None = None
    decode_steps: int = 0  # steps that fed back one sampled token
    first_decode: StepWork | None = None
    last_decode_step_id: int | None = None
    finished_ns: int | None = None

    @classmethod
    def begun(cls, arrival_ns: int | None = None) -> RequestTimeline:
        """Queued now; arrived at `arrival_ns` (the call's arrival), or now."""
        now = time.time_ns()
        return cls(arrival_ns or now, now)

    def admitted(self, lookup_ns: int) -> None:
        if self.admitted_ns is None:
            self.lookup_ns, self.admitted_ns = lookup_ns, time.time_ns()

    def scheduled(self, step_id: int, num_tokens: int, prefill: bool) -> None:
        if prefill:
            self.prefill.append(StepWork(step_id, num_tokens, time.time_ns()))
            return
        if self.first_decode is None:
            self.first_decode = StepWork(step_id, num_tokens, time.time_ns())
        self.decode_steps += 1
        self.last_decode_step_id = step_id

    def step_done(self, step_id: int, now_ns: int) -> None:
        if self.prefill and self.prefill[-1].step_id == step_id:
            self.prefill[-1].done_ns = now_ns


@dataclass(frozen=True)
class RequestOutput:
    """One per step in which the request produced tokens, plus a final one if it is aborted."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # FINISH_STOP | FINISH_LENGTH | FINISH_ABORT, on the last output
    usage: Usage | None = None  # on the last output
    cache_account: CacheAccount | None = None  # the first admission's lookup, on the first and last output
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token when the sampling asked for logprobs
    # Cached blocks this request's allocations evicted since its previous output (for its span).
    evictions: tuple[EvictionBatch, ...] = ()
    num_preemptions: int = 0  # times the request was preempted (recomputed) so far
    timeline: RequestTimeline | None = None  # on the last output


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not yet admitted, or preempted and waiting to be recomputed
    RUNNING = "running"  # holds KV blocks; scheduled every step until it finishes
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState:
    """The scheduling policy's state for one request. Its token ids (prompt + generated) and computed-token
    count live in `kv`, the object the KV cache manager reads."""

    request_id: str
    prompt_len: int
    sampling: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    kv: KVRequest
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # The lookup at the first admission; a re-admission after preemption does not change what the
    # client is told was cached.
    cache_account: CacheAccount | None = None
    num_preemptions: int = 0
    known_to_worker: bool = False  # the worker holds its state (sent as new, not yet dropped)
    sent_first_output: bool = False
    pending_evictions: list[EvictionBatch] = field(default_factory=list)
    origin: EngineRequest | None = None  # what was submitted, to submit again after a worker loss
    timeline: RequestTimeline = field(default_factory=RequestTimeline.begun)

    @classmethod
    def from_engine_request(cls, request: EngineRequest) -> RequestState:
        return cls(
            origin=request,
            request_id=request.request_id,
            prompt_len=len(request.prompt_token_ids),
            sampling=request.sampling,
            max_tokens=request.max_tokens,
            stop_token_ids=frozenset(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
            kv=KVRequest(request.request_id, list(request.prompt_token_ids), request.extras,
                         trace_context=request.trace_context),
            timeline=RequestTimeline.begun(request.arrival_ns),
        )

    @property
    def num_tokens(self) -> int:
        return len(self.kv.token_ids)

    @property
    def num_computed_tokens(self) -> int:
        return self.kv.num_computed_tokens

    @property
    def usage(self) -> Usage:
        cached_tokens = self.cache_account.hit_tokens if self.cache_account is not None else 0
        return Usage(self.prompt_len, cached_tokens, len(self.output_token_ids))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.kv.token_ids.append(token_id)

    def take_evictions(self) -> tuple[EvictionBatch, ...]:
        batches, self.pending_evictions = tuple(self.pending_evictions), []
        return batches
