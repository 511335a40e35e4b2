"""The scheduler → worker step contract, independent of transport.

A request's prompt travels to the worker once (`NewRequestData`); afterwards each step carries only
what changed (`CachedRequestData`: newly allocated blocks and the computed-token count), so a step's
size does not grow with context length. The worker keeps each request's token ids and block table,
and appends the tokens it samples itself. A request is forgotten by the worker when its id appears
in `finished_request_ids` (finished, aborted or preempted); a preempted request that resumes is sent
again as new, with its prompt and the tokens generated so far.

The same message can be broadcast to several tensor-parallel workers: nothing in it is rank-specific.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # most alternatives a request may ask for with each sampled token


@dataclass(frozen=True)
class SamplingParams:
    """How the worker picks the next token. `temperature == 0` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None  # per-request generator: same seed, same tokens
    logprobs: int = 0  # how many top alternatives to return with each sampled token (0: none; <= MAX_LOGPROBS)

    def problem(self) -> tuple[str, str] | None:
        """(field, what is wrong) for the first invalid field, or None. The scheduler checks requests
        with this before admitting them and the worker checks steps with it, so they cannot disagree
        (a step the worker refuses would look like a lost worker). NaN fails every range check."""
        if not 0 <= self.temperature < math.inf:
            return "temperature", f"must be finite and >= 0, got {self.temperature}"
        if not 0 < self.top_p <= 1:
            return "top_p", f"must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return "top_k", f"must be >= 0 (0 disables it), got {self.top_k}"
        if not 0 <= self.logprobs <= MAX_LOGPROBS:
            return "logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"
        if self.seed is not None and not 0 <= self.seed < 2**64:
            return "seed", f"must be in [0, 2**64), got {self.seed}"
        return None


@dataclass
class NewRequestData:
    request_id: str
    token_ids: list[int]  # the prompt, plus generated tokens when resuming after preemption
    block_ids: list[int]  # the whole block table, prefix-cache hits first
    num_computed_tokens: int  # tokens whose KV is already in the cache (the prefix hit)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class CachedRequestData:
    request_id: str
    new_block_ids: list[int]  # appended to the worker's block table for this request
    num_computed_tokens: int  # before this step; lets the worker check it agrees


@dataclass
class SchedulerStep:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # tokens to compute this step, per scheduled request (prefill chunk length, or 1 for decode)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_request_ids: list[str] = field(default_factory=list)
    # The step still in flight when this one was scheduled, which the worker must run first; None
    # when every earlier step had returned.
    follows_step_id: int | None = None

    @property
    def total_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float  # of the sampled token
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first


@dataclass
class StepOutput:
    """Tokens sampled this step. A request mid-way through a chunked prefill samples nothing."""

    step_id: int
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
