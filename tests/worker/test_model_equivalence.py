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
    greedy_runs,
    load_reference,
    reference_greedy,
    reference_logits,
    runner_logits,
    save_tiny_checkpoint,
)

from prefixcache.kernels.cpu import attention as cpu_attention
from prefixcache.kernels.cpu import attention_plan as cpu_attention_plan
from prefixcache.kernels.cpu.native import DISABLE_ENV, native_cpu_kernels
from prefixcache.worker.model_runner import ModelRunner

LOGITS_TOLERANCE = 1e-3
NUM_GENERATED = 32
KNOWN_FRANCE_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]  # "The capital of France is Paris.<|im_end|>"


def sample_prompts(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in (37, 21, 50)]


@pytest.fixture(scope="module", params=["llama", "llama3", "qwen2", "llama-d64"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    shard = "100KB" if request.param == "qwen2" else None  # the Qwen2 checkpoint is sharded
    model_dir = save_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), max_shard_size=shard)
    assert (model_dir / "model.safetensors.index.json").is_file() == bool(shard)
    return model_dir, load_reference(model_dir)


def test_tiny_checkpoint_logits_match_transformers(tiny_model, device) -> None:
    model_dir, reference = tiny_model
    runner = ModelRunner(model_dir, dtype="float32", device=str(device))
    for prompt in sample_prompts(runner.config.vocab_size):
        expected = reference_logits(reference, prompt).to(device)
        assert (runner_logits(runner, prompt, block_size=4) - expected).abs().max() <= LOGITS_TOLERANCE


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


def test_tiny_checkpoint_greedy_matches_transformers(tiny_model, device) -> None:
    model_dir, reference = tiny_model
    runner = ModelRunner(model_dir, dtype="float32", device=str(device))
    prompts = sample_prompts(runner.config.vocab_size)
    expected = [reference_greedy(reference, prompt, NUM_GENERATED) for prompt in prompts]
    for way, generated in greedy_runs(runner, prompts, block_size=4, num_tokens=NUM_GENERATED).items():
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
        for way, generated in greedy_runs(runner, prompts, block_size=4, num_tokens=NUM_GENERATED).items():
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
    assert greedy_runs(runner, prompts, block_size=4, num_tokens=NUM_GENERATED)["cached prefix"] == expected
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
    for way, generated in greedy_runs(smollm_runner, prompts, block_size=16, num_tokens=NUM_GENERATED).items():
        assert generated == expected, way
