"""Test helpers for the model runner: a hand-written scheduler, tiny checkpoints, a transformers oracle.

`HandScheduler` plays the scheduler's side of the step contract with real block ids: it allocates
blocks from a shuffled pool as requests grow, sends each request once and then only diffs, chunks
prefills when asked, and can start a request on blocks another request computed (a prefix-cache hit).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers

from prefixcache.kernels import AttentionMetadata
from prefixcache.step.messages import (
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    SchedulerStep,
    StepOutput,
)
from prefixcache.worker.model_runner import ModelRunner


@dataclass
class HandRequest:
    request_id: str
    token_ids: list[int]
    max_tokens: int
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generated: list[int] = field(default_factory=list)
    sent: bool = False
    new_block_ids: list[int] = field(default_factory=list)  # allocated since the last step

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.max_tokens


class HandScheduler:
    def __init__(self, runner: ModelRunner, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = block_size
        runner.initialize_kv_cache(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous block tables
        self.running: dict[str, HandRequest] = {}
        self.finished: list[str] = []
        self.step_id = 0

    def add(self, request_id: str, token_ids: list[int], max_tokens: int, *, cached_blocks: list[int] = (),
            sampling: SamplingParams | None = None) -> HandRequest:
        """`cached_blocks`: full blocks holding the KV of the first tokens, computed by an earlier request."""
        request = HandRequest(request_id, list(token_ids), max_tokens, block_ids=list(cached_blocks),
                              num_computed_tokens=len(cached_blocks) * self.block_size,
                              sampling=sampling or SamplingParams())
        self.running[request_id] = request
        return request

    def step(self, chunk_size: int | None = None) -> StepOutput:
        new, cached, scheduled = [], [], {}
        for request in self.running.values():
            known = len(request.token_ids) + len(request.generated)
            count = known - request.num_computed_tokens
            if chunk_size is not None:
                count = min(count, chunk_size)
            self._allocate(request, request.num_computed_tokens + count)
            scheduled[request.request_id] = count
            if request.sent:
                cached.append(CachedRequestData(request.request_id, request.new_block_ids, request.num_computed_tokens))
            else:
                new.append(NewRequestData(request.request_id, list(request.token_ids), list(request.block_ids),
                                          request.num_computed_tokens, request.sampling))
                request.sent = True
            request.new_block_ids = []
        step = SchedulerStep(self.step_id, new, cached, scheduled, self.finished)
        self.step_id += 1
        self.finished = []
        output = self.runner.execute(step)
        for request_id, count in scheduled.items():
            request = self.running[request_id]
            request.num_computed_tokens += count
            if request_id in output.sampled_token_ids:
                request.generated.append(output.sampled_token_ids[request_id])
        for request in [r for r in self.running.values() if r.done]:
            del self.running[request.request_id]
            self.finished.append(request.request_id)
        return output

    def run(self, chunk_size: int | None = None) -> None:
        while self.running:
            self.step(chunk_size)

    def _allocate(self, request: HandRequest, num_tokens: int) -> None:
        while len(request.block_ids) * self.block_size < num_tokens:
            block = self.free_blocks.pop()
            request.block_ids.append(block)
            request.new_block_ids.append(block)


def runner_logits(runner: ModelRunner, token_ids: list[int], block_size: int = 8) -> torch.Tensor:
    """Logits of every position, from one prefill over a shuffled block table, on the runner's device."""
    num_blocks = -(-len(token_ids) // block_size)
    runner.initialize_kv_cache(num_blocks + 3, block_size)
    table = torch.randperm(num_blocks + 3, generator=torch.Generator().manual_seed(7))[:num_blocks].tolist()
    metadata = AttentionMetadata.build([len(token_ids)], [len(token_ids)], [table], block_size, runner.device)
    ids = torch.tensor(token_ids, device=runner.device)
    with torch.inference_mode():
        hidden = runner.model(ids, torch.arange(len(token_ids), device=runner.device), runner.kv_caches, metadata,
                              runner.backend)
        return runner.model.compute_logits(hidden)


def cold_greedy(runner: ModelRunner, prompts: list[list[int]], block_size: int, num_tokens: int) -> list[list[int]]:
    """Greedy continuations of the prompts, prefilled whole and batched together."""
    scheduler = HandScheduler(runner, num_blocks=64, block_size=block_size)
    requests = [scheduler.add(f"cold-{i}", prompt, num_tokens) for i, prompt in enumerate(prompts)]
    scheduler.run()
    return [request.generated for request in requests]


def alone_greedy(runner: ModelRunner, prompts: list[list[int]], block_size: int, num_tokens: int) -> list[list[int]]:
    """Greedy continuations of the prompts, each run on its own: no other request in any of its steps."""
    generated = []
    for i, prompt in enumerate(prompts):
        scheduler = HandScheduler(runner, num_blocks=64, block_size=block_size, seed=3)
        request = scheduler.add(f"alone-{i}", prompt, num_tokens)
        scheduler.run()
        generated.append(request.generated)
    return generated


def cached_prefix_greedy(runner: ModelRunner, prompts: list[list[int]], block_size: int,
                         num_tokens: int) -> list[list[int]]:
    """Greedy continuations of the prompts, each starting on cached blocks of its prefix.

    Earlier requests compute each prompt's block-aligned prefix and finish; the next requests start on
    those very blocks with num_computed_tokens set, so only the suffix is prefilled. Each prefix is
    reused by two concurrent requests, which read the shared blocks while writing their own."""
    scheduler = HandScheduler(runner, num_blocks=96, block_size=block_size, seed=1)
    prefixes = []
    for i, prompt in enumerate(prompts):
        prefix_blocks = (len(prompt) - 1) // block_size
        prefixes.append(scheduler.add(f"prefix-{i}", prompt[: prefix_blocks * block_size], 1))
    scheduler.run()
    hits = []
    for i, (prompt, prefix) in enumerate(zip(prompts, prefixes)):
        assert len(prefix.block_ids) * block_size == len(prefix.token_ids)
        hits.append([scheduler.add(f"hit-{i}-{copy}", prompt, num_tokens, cached_blocks=prefix.block_ids)
                     for copy in range(2)])
    scheduler.run()
    for pair in hits:
        assert pair[0].generated == pair[1].generated
    return [pair[0].generated for pair in hits]


def chunked_greedy(runner: ModelRunner, prompts: list[list[int]], block_size: int, num_tokens: int) -> list[list[int]]:
    """Greedy continuations with chunked prefill; the prompts start one step apart so chunks share
    batches with decodes."""
    scheduler = HandScheduler(runner, num_blocks=64, block_size=block_size, seed=2)
    requests = []
    for i, prompt in enumerate(prompts):
        requests.append(scheduler.add(f"chunked-{i}", prompt, num_tokens))
        scheduler.step(chunk_size=7)
    scheduler.run(chunk_size=7)
    return [request.generated for request in requests]


def greedy_runs(runner: ModelRunner, prompts: list[list[int]], block_size: int,
                num_tokens: int) -> dict[str, list[list[int]]]:
    """Greedy continuations of every prompt under the three ways a prompt can reach the model."""
    return {way: run(runner, prompts, block_size, num_tokens) for way, run in
            (("cold", cold_greedy), ("cached prefix", cached_prefix_greedy), ("chunked prefill", chunked_greedy))}


def save_tiny_checkpoint(kind: str, out_dir: Path, *, max_shard_size: str | None = None) -> Path:
    """A randomly initialised checkpoint: "llama" (tied), "llama3" (its rope scaling), "llama-linear"
    (linear rope scaling), "llama-d64" (head_dim 64, which the native CPU attention serves), "mistral",
    or "qwen2" (QKV bias)."""
    common = dict(vocab_size=320, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, eos_token_id=2, bos_token_id=1,
                  # Ten times transformers' default: at 0.02 a greedy continuation repeats one token,
                  # which a wrong cached prefix would not change.
                  initializer_range=0.2)
    if kind == "llama-d64":
        common.update(hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed({"llama": 1, "llama3": 2, "qwen2": 3, "mistral": 4, "llama-linear": 5, "llama-d64": 6}[kind])
    if kind == "qwen2":
        config = transformers.Qwen2Config(**common, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        model = transformers.Qwen2ForCausalLM(config)
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, tie_word_embeddings=False, sliding_window=None,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
        model = transformers.MistralForCausalLM(config)
    else:
        rope = {"rope_type": "default", "rope_theta": 10_000.0}
        if kind == "llama3":
            rope = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        elif kind == "llama-linear":
            rope = {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}
        config = transformers.LlamaConfig(**common, tie_word_embeddings=kind == "llama", rope_parameters=rope)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # random norms and biases, so a mix-up cannot hide behind all-ones or zeros
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                parameter.normal_(0.0, 0.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    return out_dir


def load_reference(model_dir: Path) -> transformers.PreTrainedModel:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def reference_logits(model: transformers.PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[T, vocab] float32 logits of every position."""
    return model(torch.tensor([token_ids])).logits[0].float()


@torch.no_grad()
def reference_greedy(model: transformers.PreTrainedModel, token_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache, never stopping at EOS."""
    cache = transformers.DynamicCache()
    inputs = torch.tensor([token_ids])
    generated: list[int] = []
    for _ in range(num_tokens):
        logits = model(inputs, cache=cache, use_cache=True).logits[0, -1]
        generated.append(int(logits.argmax()))
        inputs = torch.tensor([[generated[-1]]])
    return generated
