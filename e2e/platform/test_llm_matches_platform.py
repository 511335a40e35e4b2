"""The in-process engine (`prefixcache.llm.LLM`) answers as the served platform does: the same greedy
request gets the same token ids, text, finish reason and token counts from both."""
from __future__ import annotations

import pytest
from platform_harness import run

from prefixcache.client import EngineClient, build_request
from prefixcache.llm import LLM, SamplingOptions
from prefixcache.tokenizer.text import ChatTurn

pytestmark = pytest.mark.slow


def test_the_in_process_engine_answers_as_the_platform_does(target: str) -> None:
    with LLM(kv_cache_memory="64MiB") as llm:
        chat = llm.tokenizer.encode_chat([ChatTurn("user", "What is the capital of France?")])
        prompts = ["The capital of France is", chat]  # the first ends at max_tokens, the chat at EOS
        ours = llm.generate(prompts, SamplingOptions(max_tokens=24, temperature=0.0))

    async def served() -> list:
        async with EngineClient(target) as engine:
            requests = [build_request(text=prompts[0], max_tokens=24, temperature=0.0),
                        build_request(token_ids=chat, max_tokens=24, temperature=0.0)]
            return [await engine.complete(request, timeout_s=120) for request in requests]

    theirs = run(served())
    assert [c.finish_reason for c in ours] == ["length", "stop"]
    for mine, served_completion in zip(ours, theirs):
        assert mine.token_ids == served_completion.token_ids
        assert mine.text == served_completion.text and mine.finish_reason == served_completion.finish_reason
        assert (mine.usage.prompt_tokens, mine.usage.completion_tokens) == (
            served_completion.usage.prompt_tokens, served_completion.usage.completion_tokens)
