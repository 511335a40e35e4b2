"""Cache-invariant bfloat16: the embedded model in bfloat16 on CPU gives a request the same greedy tokens
run alone, batched with others without the prefix cache, and starting on prefix blocks another request
computed (two hits reading them at once), on the oracle prompts.

float32 holds this through its precision (`test_model_equivalence.py`: the ways differ by about 1e-6 in
the logits). bfloat16 has no such margin: a result that differs in its last bit before the rounding to
bfloat16 differs by 1/256 after it, and thirty layers carry that to the logits. Only the same bits would
hold the tokens everywhere, and the CPU path does not give them yet: rows after cached positions attend
in two calls merged by log-sum-exp, a cold prompt's rows in one causal call, so the logits after a cache
hit differ from a cold prefill's by up to about 0.5. On the oracle prompts the tokens still agree with
the cache on or off; with chunked prefill they do not (the xfail below).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from runner_harness import alone_greedy, cached_prefix_greedy, chunked_greedy, cold_greedy

from prefixcache.worker.model_runner import ModelRunner

NUM_TOKENS = 16
BLOCK_SIZE = 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bfloat16_runner(model_dir: Path) -> ModelRunner:
    return ModelRunner(model_dir, dtype="bfloat16")


@pytest.fixture(scope="module")
def alone_tokens(bfloat16_runner: ModelRunner, oracle_prompts: list[list[int]]) -> list[list[int]]:
    generated = alone_greedy(bfloat16_runner, oracle_prompts, BLOCK_SIZE, NUM_TOKENS)
    assert all(len(set(tokens)) > 1 for tokens in generated)  # a real continuation, not one repeated token
    return generated


def test_bfloat16_tokens_are_those_of_the_request_alone_with_the_cache_on_or_off(bfloat16_runner, oracle_prompts,
                                                                                   alone_tokens):
    assert cold_greedy(bfloat16_runner, oracle_prompts, BLOCK_SIZE, NUM_TOKENS) == alone_tokens
    assert cached_prefix_greedy(bfloat16_runner, oracle_prompts, BLOCK_SIZE, NUM_TOKENS) == alone_tokens


@pytest.mark.xfail(strict=True, reason=(
    "bfloat16 attention depends on how a prompt is split: a chunk after cached positions attends to them "
    "and to its own keys in two calls whose bfloat16 outputs are merged, where the whole prompt takes one "
    "causal call; and torch's CPU flash kernel gives a query another sum when the call's key count does "
    "not end on a multiple of 8. With 7-token chunks the haiku prompt's third token differs."))
def test_bfloat16_chunked_prefill_gives_the_tokens_of_the_request_alone(bfloat16_runner, oracle_prompts,
                                                                        alone_tokens):
    assert chunked_greedy(bfloat16_runner, oracle_prompts, BLOCK_SIZE, NUM_TOKENS) == alone_tokens
