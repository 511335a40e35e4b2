"""`prefixcache.llm`: the whole engine in this process, on the embedded model."""
from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from prefixcache.llm import LLM, AsyncLLM, Completion, SamplingOptions
from prefixcache.scheduler.engine import RequestRejected
from prefixcache.tokenizer.text import ChatTurn

pytestmark = pytest.mark.slow

GREEDY = SamplingOptions(max_tokens=16, temperature=0.0)
# The greedy answer to FRANCE_PROMPT (tests/worker/test_model_equivalence.py), ending with <|im_end|>.
FRANCE_ANSWER = [504, 3575, 282, 4649, 314, 7042, 30, 2]


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Iterator[LLM]:
    with LLM(model_dir, kv_cache_memory="64MiB") as llm:
        yield llm


def test_greedy_chat_answer_ends_at_eos_whose_text_is_left_out(llm: LLM, france_prompt: list[int]) -> None:
    chat = llm.tokenizer.encode_chat([ChatTurn("user", "What is the capital of France?")])
    assert chat == france_prompt
    [completion] = llm.generate([chat], GREEDY)
    assert completion.token_ids == FRANCE_ANSWER
    assert (completion.finish_reason, completion.text) == ("stop", "The capital of France is Paris.")
    assert completion.usage.prompt_tokens == len(france_prompt)
    assert completion.usage.completion_tokens == len(FRANCE_ANSWER)


def test_a_shared_prefix_comes_from_the_cache_without_changing_the_output(llm: LLM) -> None:
    prefix = "Notes from the survey of the valley, kept in the order they were written. " * 6
    first, second = f"{prefix}Which year was note 3 written?", f"{prefix}What was surveyed in note 5?"
    block = llm.engine.config.block_size
    shared = len(llm.tokenizer.encode(prefix)) // block * block
    assert shared >= 4 * block
    assert llm.engine.reset_prefix_cache()
    cold, warm = (llm.generate([prompt], GREEDY)[0] for prompt in (first, second))
    assert cold.usage.cached_tokens == 0 and cold.cache_account.miss_reason == "cold"
    assert warm.usage.cached_tokens == shared == warm.cache_account.hit_tokens
    assert llm.engine.reset_prefix_cache()
    [recomputed] = llm.generate([second], GREEDY)
    assert recomputed.usage.cached_tokens == 0
    assert (recomputed.token_ids, recomputed.text) == (warm.token_ids, warm.text)
    assert llm.engine.cache_stats().used_blocks == 0


def test_prompts_run_batched_and_come_back_in_order(llm: LLM) -> None:
    prompts = [f"Count from {n} to {n + 5}:" for n in range(6)]
    one_by_one = [llm.generate([prompt], GREEDY)[0] for prompt in prompts]
    batched = llm.generate(prompts, GREEDY)
    assert [c.token_ids for c in batched] == [c.token_ids for c in one_by_one]
    assert [c.text for c in batched] == [c.text for c in one_by_one]
    assert len({c.request_id for c in batched}) == len(prompts)


def test_sampling_options_reach_the_sampler(llm: LLM) -> None:
    prompt = ["Write a word:"]
    seeded = SamplingOptions(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=2)
    first, again = llm.generate(prompt, seeded)[0], llm.generate(prompt, seeded)[0]
    assert first.token_ids == again.token_ids and first.finish_reason == "length"
    assert len(first.logprobs) == 8 and all(len(entry.top) == 2 for entry in first.logprobs)
    greedy = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
    [full] = llm.generate(prompt, greedy)
    stop_at = next(i for i, token in enumerate(full.token_ids) if i > 0 and token not in full.token_ids[:i])
    [stopped] = llm.generate(prompt, replace(greedy, stop_token_ids=[full.token_ids[stop_at]]))
    assert stopped.token_ids == full.token_ids[: stop_at + 1] and stopped.finish_reason == "stop"
    [before_it] = llm.generate(prompt, replace(greedy, max_tokens=stop_at))
    assert stopped.text == before_it.text  # the stop token's text is left out


def test_bad_input_is_refused_naming_the_field_and_the_engine_goes_on(llm: LLM) -> None:
    vocab = llm.engine.worker_info.vocab_size
    with pytest.raises(RequestRejected, match="prompt_token_ids: token id"):
        llm.generate([[1, vocab]], GREEDY)
    with pytest.raises(RequestRejected, match="max_tokens"):
        llm.generate(["Hello"], SamplingOptions(max_tokens=10**6))
    with pytest.raises(RequestRejected, match="temperature"):
        llm.generate(["Hello"], SamplingOptions(temperature=-1.0))
    with pytest.raises(TypeError, match="a list of prompts"):
        llm.generate("Hello", GREEDY)
    assert llm.generate(["Hello"], GREEDY)[0].finish_reason in ("stop", "length")


def test_more_prompts_than_the_engine_queues_all_complete(model_dir: Path) -> None:
    with LLM(model_dir, kv_cache_memory="16MiB", max_num_seqs=1, max_waiting=1) as llm:
        options = SamplingOptions(max_tokens=2, temperature=0.0, ignore_eos=True)
        completions = llm.generate([f"Say {n}." for n in range(4)], options)
    assert [len(c.token_ids) for c in completions] == [2] * 4


def test_streamed_chunks_add_up_to_the_completion_and_leaving_early_aborts(model_dir: Path) -> None:
    options = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[Completion, list, Completion]:
        async with AsyncLLM(model_dir, kv_cache_memory="16MiB") as llm:
            chunks = [chunk async for chunk in llm.stream("Once upon a time", options)]
            whole = await llm.complete("Once upon a time", options)
            async for _ in llm.stream("Tell me a long story.", SamplingOptions(max_tokens=200, ignore_eos=True)):
                break  # the client leaves after the first chunk
            for _ in range(100):  # the abort runs on the step loop
                if llm.engine.num_running == 0:
                    break
                await asyncio.sleep(0.01)
            assert llm.engine.num_running == 0 and llm.engine.cache_stats().used_blocks == 0
            return whole, chunks, await llm.complete([1, 2, 3], options)

    whole, chunks, after = asyncio.run(main())
    assert len(chunks) > 1 and chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 12
    assert [t for chunk in chunks for t in chunk.token_ids] == whole.token_ids
    assert "".join(chunk.text for chunk in chunks) == whole.text and whole.text
    assert len(after.token_ids) == 12
