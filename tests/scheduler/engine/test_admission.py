"""Requests that cannot run on the worker are refused before they are queued, naming the field, and
the engine goes on serving."""
from __future__ import annotations

import pytest
from engine_runs import VOCAB, collect, request, run, tokens_of
from sim_worker import SimulatedWorker, reference_generation

from prefixcache.block_identity.hashing import BlockExtras, MultiModalItem
from prefixcache.scheduler.engine import RequestRejected
from prefixcache.step.messages import SamplingParams


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: request("x", []), "prompt_token_ids"),
        (lambda: request("x", [1, VOCAB]), "prompt_token_ids"),
        (lambda: request("x", [-1]), "prompt_token_ids"),
        (lambda: request("x", [1], max_tokens=0), "max_tokens"),
        (lambda: request("x", range(100), max_tokens=4000), "max_tokens"),  # beyond max_model_len
        (lambda: request("x", range(100), max_tokens=200), "max_tokens"),  # beyond the KV cache
        (lambda: request("x", range(1100), max_tokens=1), "prompt_token_ids"),  # the prompt alone is beyond it
        (lambda: request("x", [1], sampling=SamplingParams(temperature=-1)), "temperature"),
        (lambda: request("x", [1], sampling=SamplingParams(temperature=float("nan"))), "temperature"),
        (lambda: request("x", [1], sampling=SamplingParams(temperature=float("inf"))), "temperature"),
        (lambda: request("x", range(4096)), "prompt_token_ids"),  # no room left to generate
        (lambda: request("x", [1], sampling=SamplingParams(top_p=0)), "top_p"),
        (lambda: request("x", [1], sampling=SamplingParams(top_p=1.5)), "top_p"),
        (lambda: request("x", [1], sampling=SamplingParams(top_k=-1)), "top_k"),
        (lambda: request("x", [1], stop_token_ids=(VOCAB,)), "stop_token_ids"),
        (lambda: request("x", [1, 2], extras=BlockExtras(mm_items=(MultiModalItem("img", 0, 1),))), "multimodal"),
    ],
)
def test_bad_input_is_rejected_naming_the_field_and_the_engine_still_serves(make, field):
    async def body(engine, worker):
        with pytest.raises(RequestRejected) as error:
            engine.add_request(make())
        assert error.value.field == field
        assert len(await collect(engine.add_request(request("ok", [1, 2, 3])))) == 6

    run(body, SimulatedWorker(num_kv_blocks=64, vocab_size=VOCAB, max_model_len=4096), max_model_len=2048)


def test_more_logprobs_than_the_vocabulary_has_are_refused():
    async def body(engine, worker):
        with pytest.raises(RequestRejected, match="vocabulary has 12 tokens") as error:
            engine.add_request(request("x", [1], sampling=SamplingParams(logprobs=13)))
        assert error.value.field == "logprobs"
        assert len(await collect(engine.add_request(request("ok", [1, 2], sampling=SamplingParams(logprobs=12))))) == 6

    run(body, SimulatedWorker(num_kv_blocks=64, vocab_size=12))


def test_a_request_that_fills_the_pool_exactly_is_served_and_one_token_more_is_refused():
    """A request holds KV for every token but its last, which is sampled and never fed back: on 4
    blocks of 4, a 16-token prompt may generate 1 token, an 8-token prompt 9."""
    async def body(engine, worker):
        for prompt_len, max_tokens in ((16, 1), (8, 9)):
            prompt = list(range(10, 10 + prompt_len))
            outputs = await collect(engine.add_request(request(f"fits-{prompt_len}", prompt, max_tokens)))
            assert tokens_of(outputs) == reference_generation(prompt, max_tokens, VOCAB)
        for prompt_len, max_tokens, field in ((17, 1, "prompt_token_ids"), (8, 10, "max_tokens")):
            with pytest.raises(RequestRejected) as refused:
                engine.add_request(request(f"too-big-{prompt_len}", list(range(10, 10 + prompt_len)), max_tokens))
            assert refused.value.field == field

    run(body, SimulatedWorker(num_kv_blocks=4, vocab_size=VOCAB))
