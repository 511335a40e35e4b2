"""The "outputs unchanged" guarantee: our runner computes what transformers computes, cache hit or not.

Float32 logits are compared with transformers on the same weights (max abs diff <= 1e-3), and greedy
continuations of 32 tokens must be token-for-token identical: cold, with the prompt's prefix taken
from blocks an earlier request computed, and with chunked prefill mixed into decode batches.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from runner_harness import (
    HandScheduler,
    load_reference,
    reference_greedy,
    reference_logits,
    save_tiny_checkpoint,
)

from prefixcache.kernels import AttentionMetadata
from prefixcache.kernels.cpu import attention as cpu_attention
from prefixcache.kernels.cpu import attention_plan as cpu_attention_plan
from prefixcache.kernels.cpu.native import DISABLE_ENV, native_cpu_kernels
from prefixcache.worker.model_runner import ModelRunner

LOGITS_TOLERANCE = 1e-3
NUM_GENERATED = 32
KNOWN_FRANCE_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris.<|im_end|>"


def runner_logits(runner: ModelRunner, token_ids: list[int], block_size: int = 8) -> torch.Tensor:
    """Logits of every position, from one prefill over a shuffled block table."""
    num_blocks = -(-len(token_ids) // block_size)
    runner.initialize_kv_cache(num_blocks + 3, block_size)
    table = torch.randperm(num_blocks + 3, generator=torch.Generator().manual_seed(7))[:num_blocks].tolist()
    metadata = AttentionMetadata.build([len(token_ids)], [len(token_ids)], [table], block_size, runner.device)
    ids = torch.tensor(token_ids)
    with torch.inference_mode():
        hidden = runner.model(ids, torch.arange(len(token_ids)), runner.kv_caches, metadata, runner.backend)
        return runner.model.compute_logits(hidden)


def sample_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in (37, 21, 50)]


def greedy_runs(runner: ModelRunner, prompts: list[list[int]], block_size: int) -> dict[str, list[list[int]]]:
    """Greedy continuations of every prompt under the three ways a prompt can reach the model."""
    runs: dict[str, list[list[int]]] = {}

    scheduler = HandScheduler(runner, num_blocks=64, block_size=block_size)
    requests = [scheduler.add(f"cold-{i}", prompt, NUM_GENERATED) for i, prompt in enumerate(prompts)]
    scheduler.run()
    runs["cold"] = [request.generated for request in requests]

    # Earlier requests compute each prompt's block-aligned prefix and finish; the next requests start
    # on those very blocks with num_computed_tokens set, so only the suffix is prefilled. Each prefix
    # is reused by two concurrent requests, which read the shared blocks while writing their own.
    scheduler = HandScheduler(runner, num_blocks=96, block_size=block_size, seed=1)
    prefixes = []
    for i, prompt in enumerate(prompts):
        prefix_blocks = (len(prompt) - 1) // block_size
        prefixes.append(scheduler.add(f"prefix-{i}", prompt[: prefix_blocks * block_size], 1))
    scheduler.run()
    hits = []
    for i, (prompt, prefix) in enumerate(zip(prompts, prefixes)):
        assert len(prefix.block_ids) * block_size == len(prefix.token_ids)
        hits.append([scheduler.add(f"hit-{i}-{copy}", prompt, NUM_GENERATED, cached_blocks=prefix.block_ids)
                     for copy in range(2)])
    scheduler.run()
    for pair in hits:
        assert pair[0].generated == pair[1].generated
    runs["cached prefix"] = [pair[0].generated for pair in hits]

    # Chunked prefill; the prompts start one step apart so chunks share batches with decodes.
    scheduler = HandScheduler(runner, num_blocks=64, block_size=block_size, seed=2)
    requests = []
    for i, prompt in enumerate(prompts):
        requests.append(scheduler.add(f"chunked-{i}", prompt, NUM_GENERATED))
        scheduler.step(chunk_size=7)
    scheduler.run(chunk_size=7)
    runs["chunked prefill"] = [request.generated for request in requests]
    return runs


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "llama-d64"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    shard = "100KB" if request.param == "qwen2" else None  # the Qwen2 checkpoint is sharded
    model_dir = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), max_shard_size=shard)
    assert (model_dir / "model.safetensors.index.json").is_file() == bool(shard)
    return model_dir, load_reference(model_dir)


def test_tiny_checkpoint_logits_match_transformers(tiny_model) -> None:
    model_dir, reference = tiny_model
    runner = ModelRunner(model_dir)
    for prompt in sample_prompts(runner.config.vocab_size):
        difference = (runner_logits(runner, prompt, block_size=4) - reference_logits(reference, prompt)).abs().max()
        assert difference <= LOGITS_TOLERANCE


@pytest.mark.parametrize("kind", ["mistral", "llama-linear"])
def test_more_tiny_architectures_logits_match_transformers(kind: str, tmp_path: Path) -> None:
    model_dir = save_tiny_checkpoint(kind, tmp_path)
    reference, runner = load_reference(model_dir), ModelRunner(model_dir)
    for prompt in sample_prompts(runner.config.vocab_size):
        difference = (runner_logits(runner, prompt, block_size=4) - reference_logits(reference, prompt)).abs().max()
        assert difference <= LOGITS_TOLERANCE


def test_a_head_the_checkpoint_carries_wins_over_a_config_that_ties_it(tmp_path: Path) -> None:
    """As in transformers: `tie_word_embeddings: true`, yet `lm_head.weight` in the checkpoint."""
    model_dir = save_tiny_checkpoint("mistral", tmp_path)  # untied: its own lm_head.weight
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    reference, runner = load_reference(model_dir), ModelRunner(model_dir)
    assert not torch.equal(reference.lm_head.weight, reference.model.embed_tokens.weight)
    for prompt in sample_prompts(runner.config.vocab_size):
        difference = (runner_logits(runner, prompt, block_size=4) - reference_logits(reference, prompt)).abs().max()
        assert difference <= LOGITS_TOLERANCE


def test_tiny_checkpoint_greedy_matches_transformers(tiny_model) -> None:
    model_dir, reference = tiny_model
    runner = ModelRunner(model_dir)
    prompts = sample_prompts(runner.config.vocab_size)
    expected = [reference_greedy(reference, prompt, NUM_GENERATED) for prompt in prompts]
    for way, generated in greedy_runs(runner, prompts, block_size=4).items():
        assert generated == expected, way


def test_torch_kernels_alone_keep_the_guarantee(tiny_model, monkeypatch) -> None:
    """Where the native CPU kernels cannot run (no AVX-512, no compiler), torch's serve every step:
    the same logits and tokens as transformers, cold, cached and chunked."""
    monkeypatch.setenv(DISABLE_ENV, "0")
    native_cpu_kernels.cache_clear()
    try:
        model_dir, reference = tiny_model
        runner = ModelRunner(model_dir)
        assert all(getattr(module, "native", None) is None for module in runner.model.modules())
        prompts = sample_prompts(runner.config.vocab_size)
        for prompt in prompts:
            difference = (runner_logits(runner, prompt, block_size=4) - reference_logits(reference, prompt))
            assert difference.abs().max() <= LOGITS_TOLERANCE
        expected = [reference_greedy(reference, prompt, NUM_GENERATED) for prompt in prompts]
        for way, generated in greedy_runs(runner, prompts, block_size=4).items():
            assert generated == expected, way
    finally:
        native_cpu_kernels.cache_clear()  # the next caller builds (loads) them again


def test_tiny_checkpoint_greedy_matches_transformers_through_cascade_attention(tiny_model, monkeypatch) -> None:
    """Decodes reading the same cached blocks attend to them once, as a cascade merged by log-sum-exp.
    It normally needs 256 saved positions (8,192 beside the native decode kernel); forced here for the
    short prompts, it must change nothing."""
    model_dir, reference = tiny_model
    cascades = []
    attend_cascade = cpu_attention._attend_cascade
    monkeypatch.setattr(cpu_attention_plan, "MIN_CASCADE_SAVED_POSITIONS", 1)
    monkeypatch.setattr(cpu_attention_plan, "MIN_NATIVE_CASCADE_SAVED_POSITIONS", 1)
    monkeypatch.setattr(cpu_attention, "_attend_cascade",
                        lambda *args: cascades.append(args[3]) or attend_cascade(*args))
    runner = ModelRunner(model_dir, attention_backend="torch")
    prompts = sample_prompts(runner.config.vocab_size)
    expected = [reference_greedy(reference, prompt, NUM_GENERATED) for prompt in prompts]
    assert greedy_runs(runner, prompts, block_size=4)["cached prefix"] == expected
    assert cascades and all(cascade.tails.blocks.shape[0] >= 2 for cascade in cascades)


def test_embedded_model_logits_match_transformers(smollm_runner, smollm_reference, france_prompt) -> None:
    prompt = france_prompt + [504, 3575, 282, 4649, 314]
    difference = (runner_logits(smollm_runner, prompt, block_size=16) - reference_logits(smollm_reference, prompt))
    assert difference.abs().max() <= LOGITS_TOLERANCE


def test_embedded_model_knows_the_capital_of_france(smollm_runner, france_prompt) -> None:
    scheduler = HandScheduler(smollm_runner, num_blocks=8, block_size=16)
    request = scheduler.add("france", france_prompt, len(KNOWN_FRANCE_ANSWER))
    scheduler.run()
    assert request.generated == KNOWN_FRANCE_ANSWER


def test_embedded_model_greedy_matches_transformers(smollm_runner, smollm_reference, chat_prompt) -> None:
    prompts = [
        chat_prompt("What is the capital of France?"),
        chat_prompt("Write a haiku about the sea in 2024."),
        chat_prompt("List three prime numbers and explain why each one is prime."),
    ]
    expected = [reference_greedy(smollm_reference, prompt, NUM_GENERATED) for prompt in prompts]
    for way, generated in greedy_runs(smollm_runner, prompts, block_size=16).items():
        assert generated == expected, way
