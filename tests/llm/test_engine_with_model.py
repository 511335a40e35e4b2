"""EngineCore over the real in-process model runner (a tiny random Llama checkpoint): continuous
batching with chunked prefill, prefix-cache hits and preemption must not change greedy output."""
from __future__ import annotations

import asyncio

import pytest

from prefixcache.llm.local_executor import LocalExecutor
from prefixcache.scheduler.engine import EngineCore, EngineRequest, SchedulerConfig
from prefixcache.step.messages import SamplingParams

torch = pytest.importorskip("torch", reason="the model runner needs torch (worker extra)")
transformers = pytest.importorskip("transformers", reason="builds the tiny checkpoint")

SHARED = [(7 * i + 3) % 250 + 3 for i in range(40)]  # 10 blocks of 4
PROMPTS = {f"r{i}": SHARED + [(11 * i + j) % 250 + 3 for j in range(3 + i)] for i in range(6)}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from prefixcache.worker.model_runner import ModelRunner

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, bos_token_id=1,
        tie_word_embeddings=False,
    )
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    return ModelRunner(model_dir, dtype="float32", num_threads=1)


def generate_all(runner, num_kv_blocks: int, concurrent: bool, **config):
    async def main():
        engine = EngineCore(SchedulerConfig(block_size=4, **config), LocalExecutor(runner, num_kv_blocks=num_kv_blocks))
        await engine.start()

        async def one(request_id, prompt):
            request = EngineRequest(request_id, prompt, SamplingParams(), MAX_TOKENS, ignore_eos=True)
            return [output async for output in engine.add_request(request)]

        if concurrent:
            results = await asyncio.gather(*(one(rid, p) for rid, p in PROMPTS.items()))
        else:
            results = [await one(rid, p) for rid, p in PROMPTS.items()]
        assert engine.cache_stats().used_blocks == 0
        preemptions = engine._policy.counters.preemptions
        await engine.shutdown(grace_s=1)
        return {outputs[0].request_id: outputs for outputs in results}, preemptions

    return asyncio.run(asyncio.wait_for(main(), 120))


@pytest.fixture(scope="module")
def reference(runner):
    """One request at a time, caching off: nothing shared, nothing preempted."""
    outputs, _ = generate_all(runner, 64, concurrent=False, enable_prefix_caching=False, max_num_seqs=1)
    return outputs


# A budget of 16 chunks every prompt; with 512, all six are admitted in one step and the later ones
# hit the shared blocks the first one computes in that same step.
@pytest.mark.parametrize("token_budget", [16, 512])
def test_batching_caching_and_preemption_keep_greedy_output_unchanged(runner, reference, token_budget):
    batched, preemptions = generate_all(runner, 30, concurrent=True, max_num_batched_tokens=token_budget)

    def tokens(outputs):
        return [t for o in outputs for t in o.new_token_ids]

    for request_id in PROMPTS:
        assert len(tokens(reference[request_id])) == MAX_TOKENS
        assert tokens(batched[request_id]) == tokens(reference[request_id]), request_id
        assert reference[request_id][-1].usage.cached_tokens == 0
    assert preemptions > 0  # 30 blocks cannot hold six 15-block requests, even sharing 10
    assert max(batched[r][-1].usage.cached_tokens for r in PROMPTS) == 40
