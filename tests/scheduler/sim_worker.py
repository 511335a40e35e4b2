"""A deterministic pure-Python worker that checks the scheduler's steps instead of running a model.

It keeps what a real worker keeps (each request's token ids and block table, a KV memory indexed by
block id and slot) but stores in each KV slot a digest of the whole prefix ending at that token,
which is what real KV depends on. Before computing a request's tokens it checks that every slot the
request reads holds exactly the digest its own prefix would produce, so a wrong cache hit, a block
handed to two writers or a lost block-table update is caught at once. The "sampled" token is a hash
of the whole sequence, so outputs are the same whatever the batching, caching or preemption.
"""
from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field

from prefixcache.scheduler.engine import WorkerInfo, WorkerUnavailable
from prefixcache.step.messages import SchedulerStep, StepOutput


def next_token(token_ids: list[int], vocab_size: int, avoid: frozenset[int] = frozenset()) -> int:
    """The simulated model: the next token is a hash of the whole sequence (never in `avoid`)."""
    digest = hashlib.blake2b(repr(token_ids).encode(), digest_size=8).digest()
    token = int.from_bytes(digest, "little") % vocab_size
    while token in avoid:
        token = (token + 1) % vocab_size
    return token


def reference_generation(prompt: list[int], max_tokens: int, vocab_size: int, avoid=frozenset()) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens, vocab_size, avoid))
    return tokens[len(prompt):]


def _extend(digest: bytes, token_id: int) -> bytes:
    return hashlib.blake2b(digest + token_id.to_bytes(4, "little"), digest_size=8).digest()


@dataclass
class _WorkerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    prefix_digests: list[bytes] = field(default_factory=list)  # digest of token_ids[:i + 1]

    def digest_at(self, position: int) -> bytes:
        while len(self.prefix_digests) <= position:
            previous = self.prefix_digests[-1] if self.prefix_digests else b""
            self.prefix_digests.append(_extend(previous, self.token_ids[len(self.prefix_digests)]))
        return self.prefix_digests[position]


class SimulatedWorker:
    """A StepExecutor. `fail_next_step()` makes the next execute lose the worker (and its KV memory);
    `down_for` makes that many initialize calls fail after a loss; while `initialize_gate` is set
    to an unset event, initialize calls wait for it."""

    def __init__(
        self,
        num_kv_blocks: int = 64,
        vocab_size: int = 1000,
        max_model_len: int = 4096,
        eos_token_ids: tuple[int, ...] = (),
        model_id: str = "sim-model",
        step_delay_s: float = 0.0,
        tokenizer_id: str = "",
        supports_multimodal: bool = False,
    ) -> None:
        self.info_template = (model_id, vocab_size, max_model_len, num_kv_blocks, eos_token_ids)
        self.tokenizer_id = tokenizer_id
        self.supports_multimodal = supports_multimodal
        self.avoid = frozenset(eos_token_ids)
        self.step_delay_s = step_delay_s
        self.block_size = 0
        self.requests: dict[str, _WorkerRequest] = {}
        self.kv_memory: dict[tuple[int, int], bytes] = {}
        self.steps: list[SchedulerStep] = []
        self.initializations = 0
        self.failures_pending = 0
        self.down_for = 0
        self.up = False
        self.answer_wrongly_next = False  # the next answer names another step (a confused worker)
        self.initialize_gate: asyncio.Event | None = None
        self.in_flight = self.most_in_flight = 0  # execute calls under way at once

    def fail_next_step(self, down_for: int = 0) -> None:
        self.failures_pending += 1
        self.down_for = down_for

    async def initialize(self, block_size: int) -> WorkerInfo:
        await asyncio.sleep(0)
        if self.initialize_gate is not None:
            await self.initialize_gate.wait()
        if self.down_for > 0:
            self.down_for -= 1
            raise WorkerUnavailable("simulated worker still down")
        model_id, vocab_size, max_model_len, num_kv_blocks, eos = self.info_template
        self.block_size = block_size
        self.requests.clear()
        self.kv_memory.clear()
        self.initializations += 1
        self.up = True
        return WorkerInfo(model_id, vocab_size, max_model_len, num_kv_blocks, eos, tokenizer_id=self.tokenizer_id,
                          supports_multimodal=self.supports_multimodal)

    async def execute(self, step: SchedulerStep) -> StepOutput:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.step_delay_s)
            return self._execute(step)
        finally:
            self.in_flight -= 1

    def _execute(self, step: SchedulerStep) -> StepOutput:
        if self.failures_pending or not self.up:
            self.failures_pending = max(0, self.failures_pending - 1)
            self.up = False
            self.requests.clear()
            self.kv_memory.clear()
            raise WorkerUnavailable("simulated worker crashed")
        if step.follows_step_id is not None:  # sent ahead: it must run right after the step it names
            assert self.steps and self.steps[-1].step_id == step.follows_step_id, (
                f"step {step.step_id} follows {step.follows_step_id} but ran after "
                f"{self.steps[-1].step_id if self.steps else 'none'}")
        self.steps.append(step)
        output = self.run(step)
        if self.answer_wrongly_next:
            self.answer_wrongly_next = False
            return StepOutput(step.step_id + 1, output.sampled_token_ids)
        return output

    def run(self, step: SchedulerStep) -> StepOutput:
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            assert new.request_id not in self.requests, f"{new.request_id} sent as new twice"
            self.requests[new.request_id] = _WorkerRequest(list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
        for cached in step.cached_requests:
            request = self.requests[cached.request_id]
            assert cached.num_computed_tokens == request.num_computed_tokens, (
                f"{cached.request_id}: scheduler says {cached.num_computed_tokens} computed, worker has {request.num_computed_tokens}"
            )
            request.block_ids.extend(cached.new_block_ids)
        assert set(step.num_scheduled_tokens) == {r.request_id for r in step.new_requests} | {
            r.request_id for r in step.cached_requests
        }
        vocab_size = self.info_template[1]
        sampled: dict[str, int] = {}
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            request = self.requests[request_id]
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_tokens
            assert 0 < num_tokens and end <= len(request.token_ids), f"{request_id}: {start}+{num_tokens} > {len(request.token_ids)}"
            assert len(request.block_ids) * self.block_size >= end, f"{request_id}: block table too short"
            for position in range(start):  # the prefix this request reads: computed here or a cache hit
                slot = self._slot(request, position)
                assert self.kv_memory.get(slot) == request.digest_at(position), (
                    f"{request_id}: wrong KV at position {position} (block {slot[0]})"
                )
            for position in range(start, end):
                self.kv_memory[self._slot(request, position)] = request.digest_at(position)
            request.num_computed_tokens = end
            if end == len(request.token_ids):
                token = next_token(request.token_ids, vocab_size, self.avoid)
                request.token_ids.append(token)
                sampled[request_id] = token
        return StepOutput(step_id=step.step_id, sampled_token_ids=sampled)

    def _slot(self, request: _WorkerRequest, position: int) -> tuple[int, int]:
        return request.block_ids[position // self.block_size], position % self.block_size
