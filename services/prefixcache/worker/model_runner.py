"""Execute scheduler steps: run the model over the paged KV cache and sample.

The runner keeps its own copy of every live request (token ids, block table, computed-token count,
sampling state): the scheduler sends a request once (`NewRequestData`) and afterwards only diffs
(`CachedRequestData`), see `prefixcache.step.messages`. Each step computes
`num_scheduled_tokens[rid]` tokens of each scheduled request, starting at its computed count; a
request whose computed count reaches the end of its known tokens gets a sampled token, appended to
its copy. A partial prefill chunk samples nothing.

A step is checked whole before anything changes, so a bad step raises ValueError and leaves the
runner as it was.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from prefixcache.kernels import (
    AttentionMetadata,
    allocate_kv_cache,
    get_attention_backend,
    kv_cache_bytes_per_block,
    num_blocks_for_budget,
)
from prefixcache.model_store.tokenizer_identity import tokenizer_id
from prefixcache.step.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerStep,
    StepOutput,
)
from prefixcache.worker.cuda_check import CudaSetup, cuda_problem
from prefixcache.worker.kv_memory import free_device_memory
from prefixcache.worker.loader import load_model, parse_dtype, resolve_dtype
from prefixcache.worker.sampler import make_generator, sample, validate_sampling


@dataclass(frozen=True)
class ModelDescription:
    model_id: str  # "<name>@sha256:<16 hex of a digest of the weight files>"
    architecture: str
    dtype: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]
    bytes_per_block_token: int  # KV cache bytes per token slot, all layers, keys and values
    tokenizer_id: str = ""  # of the model directory's tokenizer.json ("" if it has none)


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + every token generated so far
    block_ids: list[int]  # the block table
    num_computed_tokens: int  # tokens whose KV is in the cache
    sampling: SamplingParams
    generator: torch.Generator | None  # None for greedy


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled]: row of each sampling request's last token
    sampled_requests: list[str]


class ModelRunner:
    def __init__(self, model_dir: str | Path, dtype: str = "auto", device: str = "cpu",
                 attention_backend: str | None = None, num_threads: int | None = None) -> None:
        """`dtype` "auto" is bfloat16 on a GPU that has it, float32 elsewhere (`loader.auto_dtype`)."""
        self.device = torch.device(device)
        if self.device.type == "cuda" and (problem := cuda_problem(CudaSetup.probe(), self.device)):
            raise ValueError(problem)
        if self.device.type == "cpu":
            # torch defaults to every physical core of the host; use the cores this process may run on.
            torch.set_num_threads(num_threads or len(os.sched_getaffinity(0)))
        self.dtype_name = resolve_dtype(dtype, self.device)
        self.dtype = parse_dtype(self.dtype_name)
        self.attention_backend = attention_backend
        self.backend = get_attention_backend(attention_backend, self.device, dtype=self.dtype)
        loaded = load_model(model_dir, self.dtype_name, str(self.device))
        self.model = loaded.model
        self.config = loaded.config
        self.model_id = loaded.model_id
        self.tokenizer_id = tokenizer_id(model_dir)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.block_size = 0
        self.requests: dict[str, RequestState] = {}

    def describe(self) -> ModelDescription:
        config = self.config
        return ModelDescription(
            model_id=self.model_id,
            architecture=config.architecture,
            dtype=self.dtype_name,
            vocab_size=config.vocab_size,
            max_model_len=config.max_model_len,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            eos_token_ids=config.eos_token_ids,
            bytes_per_block_token=self._kv_bytes_per_token(),
            tokenizer_id=self.tokenizer_id,
        )

    def _kv_bytes_per_token(self) -> int:
        """Bytes one token's keys and values take in the cache, all layers together."""
        config = self.config
        return kv_cache_bytes_per_block(config.num_layers, 1, config.num_kv_heads, config.head_dim, self.dtype)

    def num_blocks_for_memory(self, memory_bytes: int, block_size: int) -> int:
        config = self.config
        return num_blocks_for_budget(memory_bytes, config.num_layers, block_size, config.num_kv_heads,
                                     config.head_dim, self.dtype)

    def initialize_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Allocate the cache; any request state from an earlier cache is dropped."""
        config = self.config
        # The old cache, and what the backend staged from it, go first: the budget may not hold two.
        self.kv_caches, self.num_blocks, self.block_size = [], 0, 0
        self.backend = get_attention_backend(self.attention_backend, self.device, dtype=self.dtype)
        self.requests.clear()
        self.kv_caches = allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                                           config.head_dim, self.dtype, self.device)
        self.num_blocks, self.block_size = num_blocks, block_size
        # A fresh backend: nothing it kept may outlive the cache it was read from.
        self.backend = get_attention_backend(self.attention_backend, self.device, self._decode_staging_positions(),
                                             self.dtype)

    def _decode_staging_positions(self) -> int:
        """Positions the CPU path may keep staged for decodes (`prefixcache.kernels.cpu.decode_staging`): half
        the cache's, and no more than half the memory still free once the cache is allocated."""
        if self.device.type != "cpu":
            return 0
        try:
            free = free_device_memory(self.device)
        except (OSError, RuntimeError):  # cannot tell: stage nothing
            return 0
        return min(self.num_blocks * self.block_size // 2, free // 2 // self._kv_bytes_per_token())

    def execute(self, step: SchedulerStep) -> StepOutput:
        if not self.kv_caches:
            raise RuntimeError("initialize_kv_cache must be called before execute")
        self._check_step(step)
        for request_id in step.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in step.new_requests:
            self.requests[new.request_id] = RequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.sampling,
                make_generator(new.sampling, self.device))
        for cached in step.cached_requests:
            self.requests[cached.request_id].block_ids.extend(cached.new_block_ids)
        output = StepOutput(step_id=step.step_id)
        if not step.num_scheduled_tokens:
            return output
        batch = self._prepare(step.num_scheduled_tokens)
        with torch.inference_mode():
            hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata, self.backend)
            logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))
        states = [self.requests[request_id] for request_id in batch.sampled_requests]
        sampled = sample(logits, [state.sampling for state in states], [state.generator for state in states],
                         [len(state.token_ids) for state in states])
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            self.requests[request_id].num_computed_tokens += num_tokens
        for request_id, state, token in zip(batch.sampled_requests, states, sampled):
            state.token_ids.append(token.token_id)
            output.sampled_token_ids[request_id] = token.token_id
            if token.logprobs is not None:
                output.logprobs[request_id] = token.logprobs
        return output

    def _prepare(self, scheduled: dict[str, int]) -> _Batch:
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampled_requests: list[str] = []
        for request_id, num_tokens in scheduled.items():
            state = self.requests[request_id]
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(num_tokens)
            seq_lens.append(end)
            tables.append(state.block_ids)
            if end == len(state.token_ids):
                sample_rows.append(len(input_ids) - 1)
                sampled_requests.append(request_id)
        device = self.device
        return _Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            metadata=AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size, device),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64, device=device),
            sampled_requests=sampled_requests,
        )

    def _check_step(self, step: SchedulerStep) -> None:
        """Validate the whole step against the state it will produce, before changing anything."""
        finished = set(step.finished_request_ids)
        prospective: dict[str, tuple[int, int, int]] = {  # request id → (tokens, blocks, computed)
            rid: (len(state.token_ids), len(state.block_ids), state.num_computed_tokens)
            for rid, state in self.requests.items() if rid not in finished
        }
        for new in step.new_requests:
            self._check_new(new, prospective)
            prospective[new.request_id] = (len(new.token_ids), len(new.block_ids), new.num_computed_tokens)
        for cached in step.cached_requests:
            self._check_cached(cached, prospective)
            tokens, blocks, computed = prospective[cached.request_id]
            prospective[cached.request_id] = (tokens, blocks + len(cached.new_block_ids), computed)
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            if request_id not in prospective:
                raise ValueError(f"num_scheduled_tokens names unknown request {request_id!r}")
            tokens, blocks, computed = prospective[request_id]
            if not 1 <= num_tokens <= tokens - computed:
                raise ValueError(f"num_scheduled_tokens[{request_id!r}]={num_tokens} must be between 1 and the "
                                 f"{tokens - computed} tokens not yet computed")
            end = computed + num_tokens
            if end > self.config.max_model_len:
                raise ValueError(f"request {request_id!r} reaches {end} tokens, beyond max_model_len "
                                 f"{self.config.max_model_len}")
            if blocks * self.block_size < end:
                raise ValueError(f"request {request_id!r} has {blocks} blocks of {self.block_size} tokens, "
                                 f"too few for {end} tokens")

    def _check_new(self, new: NewRequestData, prospective: dict[str, tuple[int, int, int]]) -> None:
        if new.request_id in prospective:
            raise ValueError(f"new request {new.request_id!r} is already running")
        if not new.token_ids:
            raise ValueError(f"new request {new.request_id!r} has no token_ids")
        if not 0 <= new.num_computed_tokens < len(new.token_ids):
            raise ValueError(f"new request {new.request_id!r}: num_computed_tokens={new.num_computed_tokens} must be "
                             f"in [0, {len(new.token_ids)})")
        bad_tokens = [token for token in new.token_ids if not 0 <= token < self.config.vocab_size]
        if bad_tokens:
            raise ValueError(f"new request {new.request_id!r}: token_ids outside the vocabulary: {bad_tokens[:5]}")
        self._check_block_ids(new.request_id, new.block_ids)
        validate_sampling(new.sampling)

    def _check_cached(self, cached: CachedRequestData, prospective: dict[str, tuple[int, int, int]]) -> None:
        if cached.request_id not in prospective:
            raise ValueError(f"cached request {cached.request_id!r} is unknown to this worker")
        computed = prospective[cached.request_id][2]
        if cached.num_computed_tokens != computed:
            raise ValueError(f"cached request {cached.request_id!r}: num_computed_tokens={cached.num_computed_tokens} "
                             f"but the worker has computed {computed}")
        self._check_block_ids(cached.request_id, cached.new_block_ids)

    def _check_block_ids(self, request_id: str, block_ids: list[int]) -> None:
        bad = [block for block in block_ids if not 0 <= block < self.num_blocks]
        if bad:
            raise ValueError(f"request {request_id!r}: block ids outside [0, {self.num_blocks}): {bad[:5]}")
