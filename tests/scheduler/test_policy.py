"""The scheduling policy against the real KV cache manager, step by step, with exact expectations."""
from __future__ import annotations

import pytest

from prefixcache.block_identity.hashing import BlockHasher
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.kv_cache import KVCacheManager
from prefixcache.scheduler.policy import SchedulingPolicy
from prefixcache.scheduler.request import EngineRequest
from prefixcache.step.messages import SamplingParams, StepOutput, TokenLogprobs

BLOCK = 4
EOS = 2


def make_policy(num_blocks=16, caching=True, **config) -> SchedulingPolicy:
    config = SchedulerConfig(block_size=BLOCK, enable_prefix_caching=caching, **config)
    kv = KVCacheManager(num_blocks, BlockHasher(BLOCK, "sha256", "test-model"), enable_caching=caching)
    return SchedulingPolicy(config, kv, eos_token_ids=(EOS,), max_model_len=config.max_model_len)


def request(request_id, prompt, max_tokens=8, **kwargs) -> EngineRequest:
    return EngineRequest(request_id, list(prompt), SamplingParams(), max_tokens, **kwargs)


def answer(policy: SchedulingPolicy, step, token=7, **tokens):
    """What a worker returns: one token for each request that has computed all its tokens."""
    sampled = {
        rid: tokens.get(rid, token)
        for rid in step.num_scheduled_tokens
        if policy.requests[rid].num_computed_tokens == policy.requests[rid].num_tokens
    }
    return policy.update_from_output(step, StepOutput(step.step_id, sampled))


def run_to_completion(policy: SchedulingPolicy, max_steps=200):
    outputs = []
    for _ in range(max_steps):
        if not policy.requests:
            return outputs
        outputs += answer(policy, policy.schedule())
    raise AssertionError("requests did not finish")


def test_unified_steps_chunk_a_long_prompt_under_the_token_budget():
    policy = make_policy(max_num_batched_tokens=10)
    policy.add_request(request("a", range(10, 17)))  # 7 tokens
    step = policy.schedule()
    answer(policy, step)
    policy.add_request(request("b", range(20, 33)))  # 13 tokens: more than the budget

    step = policy.schedule()
    assert step.num_scheduled_tokens == {"a": 1, "b": 9}  # a decodes, b gets what the budget leaves
    assert [(r.request_id, r.block_ids, r.num_computed_tokens) for r in step.new_requests] == [("b", [2, 3, 4], 0)]
    assert step.new_requests[0].token_ids == list(range(20, 33))  # the whole prompt, sent once
    outputs = answer(policy, step)
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [7])]  # b is mid-prefill

    step = policy.schedule()
    assert step.new_requests == []
    assert step.num_scheduled_tokens == {"a": 1, "b": 4}  # a decodes, b finishes its prompt
    assert [(r.request_id, r.new_block_ids, r.num_computed_tokens) for r in step.cached_requests] == [
        ("a", [5], 8),  # a's 9th token starts its third block
        ("b", [6], 9),
    ]
    outputs = answer(policy, step)
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("a", [7]), ("b", [7])]

    step = policy.schedule()
    assert step.num_scheduled_tokens == {"a": 1, "b": 1}


def test_a_prompt_that_would_not_finish_waits_rather_than_slow_down_the_prompts_in_the_step():
    policy = make_policy(max_num_batched_tokens=10)
    policy.add_request(request("a", range(10, 17)))  # 7 tokens
    policy.add_request(request("b", range(20, 29)))  # 9 tokens: only 3 would fit beside a
    policy.add_request(request("c", range(30, 32)))  # 2 tokens: would fit, but comes after b

    step = policy.schedule()
    assert step.num_scheduled_tokens == {"a": 7}  # a chunk of b would only make a's step longer
    assert [r.request_id for r in policy.waiting] == ["b", "c"]
    answer(policy, step)

    step = policy.schedule()
    assert step.num_scheduled_tokens == {"a": 1, "b": 9}  # b whole, in the next step
    answer(policy, step)
    step = policy.schedule()
    assert step.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2}
    answer(policy, step)
    run_to_completion(policy)
    assert policy.kv_cache.num_free_blocks == 16


def test_max_num_seqs_holds_requests_in_waiting_until_one_finishes():
    policy = make_policy(max_num_seqs=2)
    for rid, max_tokens in (("a", 1), ("b", 3), ("c", 1)):
        policy.add_request(request(rid, range(8), max_tokens=max_tokens))

    step = policy.schedule()
    assert list(step.num_scheduled_tokens) == ["a", "b"]
    outputs = answer(policy, step)
    assert [(o.request_id, o.finished, o.finish_reason) for o in outputs] == [("a", True, "length"), ("b", False, None)]

    step = policy.schedule()
    assert step.finished_request_ids == ["a"]  # the worker forgets a
    assert [r.request_id for r in step.new_requests] == ["c"]
    assert step.num_scheduled_tokens["b"] == 1
    answer(policy, step)
    run_to_completion(policy)
    assert policy.kv_cache.num_free_blocks == 16


def test_admission_takes_the_cached_prefix_and_computes_only_the_rest():
    policy = make_policy()
    shared = list(range(100, 108))  # two full blocks
    policy.add_request(request("a", shared + [1, 2], max_tokens=1))
    first = run_to_completion(policy)
    assert first[-1].usage.cached_tokens == 0
    assert first[0].cache_account.miss_reason == "cold"
    a_blocks = [0, 1]

    policy.add_request(request("b", shared + [3, 4, 5], max_tokens=3))
    step = policy.schedule()
    [new] = step.new_requests
    assert new.block_ids[:2] == a_blocks and new.num_computed_tokens == 8
    assert step.num_scheduled_tokens == {"b": 3}
    outputs = answer(policy, step) + run_to_completion(policy)
    assert outputs[0].cache_account.hit_tokens == 8  # on the first output ...
    assert outputs[-1].cache_account.hit_tokens == 8  # ... and on the last
    assert outputs[1].cache_account is None
    assert outputs[-1].usage.prompt_tokens == 11 and outputs[-1].usage.cached_tokens == 8
    assert outputs[-1].usage.completion_tokens == 3
    assert policy.kv_cache.num_free_blocks == 16


def test_a_fully_cached_prompt_recomputes_its_last_block():
    policy = make_policy()
    policy.add_request(request("a", range(12), max_tokens=1))
    run_to_completion(policy)
    policy.add_request(request("b", range(12), max_tokens=1))
    step = policy.schedule()
    assert step.new_requests[0].num_computed_tokens == 8
    assert step.num_scheduled_tokens == {"b": 4}


def test_caching_off_never_hits():
    policy = make_policy(caching=False)
    policy.add_request(request("a", range(12), max_tokens=1))
    run_to_completion(policy)
    policy.add_request(request("b", range(12), max_tokens=1))
    step = policy.schedule()
    assert step.new_requests[0].num_computed_tokens == 0 and step.num_scheduled_tokens == {"b": 12}
    assert policy.counters.queried_tokens == 0  # nothing is looked up with caching off


def test_preemption_frees_the_newest_request_which_then_hits_the_cache_again():
    policy = make_policy(num_blocks=4)
    policy.add_request(request("a", range(0, 8), max_tokens=3))  # 2 blocks each: the pool is full
    policy.add_request(request("b", range(50, 58), max_tokens=3))
    step = policy.schedule()
    assert [(r.request_id, r.block_ids) for r in step.new_requests] == [("a", [0, 1]), ("b", [2, 3])]
    answer(policy, step)

    # a's 9th token needs a third block: b, the most recently admitted, is preempted. Its blocks go
    # back in reverse order (3 then 2) to the free queue's tail; a's new block pops 3, evicting it.
    step = policy.schedule()
    assert step.finished_request_ids == ["b"]
    assert step.num_scheduled_tokens == {"a": 1}
    assert [(r.request_id, r.new_block_ids) for r in step.cached_requests] == [("a", [3])]
    assert [r.request_id for r in policy.waiting] == ["b"] and step.new_requests == []
    [batch] = policy.requests["a"].pending_evictions
    [event] = batch
    assert (event.block_id, event.evicting_request_id, event.storing_request_id) == (3, "a", "b")
    assert policy.counters.preemptions == 1 and policy.counters.evictions == 1
    outputs = answer(policy, step)
    assert outputs[0].evictions == (batch,)

    # b (8 prompt tokens + 1 generated) needs 3 blocks; only its first block is still cached and
    # a holds the others, so b waits until a finishes.
    step = policy.schedule()
    assert step.new_requests == [] and step.num_scheduled_tokens == {"a": 1}
    answer(policy, step)
    step = policy.schedule()
    assert step.finished_request_ids == ["a"]
    [resumed] = step.new_requests
    assert resumed.request_id == "b"
    assert resumed.token_ids == list(range(50, 58)) + [7]  # prompt + the token generated before
    assert resumed.block_ids[0] == 2 and resumed.num_computed_tokens == 4  # its first block hit
    assert step.num_scheduled_tokens == {"b": 5}
    outputs = answer(policy, step) + run_to_completion(policy)
    assert outputs[-1].usage.cached_tokens == 0  # what was cached at its first admission
    assert outputs[-1].num_preemptions == 1
    assert outputs[-1].usage.completion_tokens == 3
    assert policy.kv_cache.num_free_blocks == 4
    # The prefix-cache counters hold the two prompts as first looked up, not b's recompute.
    counters = policy.counters
    assert (counters.queried_tokens, counters.hit_tokens, counters.admissions) == (16, 0, 3)
    assert (policy.kv_cache.stats().queries, policy.kv_cache.stats().hits) == (16, 0)


def test_the_newest_request_preempts_itself_when_it_is_the_one_that_does_not_fit():
    policy = make_policy(num_blocks=3)
    policy.add_request(request("a", range(0, 4), max_tokens=8))
    policy.add_request(request("b", range(50, 54), max_tokens=8))
    answer(policy, policy.schedule())  # a: block 0, b: block 1, one token each
    step = policy.schedule()  # both need a second block; a, admitted first, takes the last one
    assert step.num_scheduled_tokens == {"a": 1}
    assert step.finished_request_ids == ["b"]
    assert [(r.request_id, r.new_block_ids) for r in step.cached_requests] == [("a", [2])]
    assert [r.request_id for r in policy.waiting] == ["b"]
    outputs = answer(policy, step) + run_to_completion(policy)
    assert [o.request_id for o in outputs if o.finished] == ["a", "b"]
    assert all(o.usage.completion_tokens == 8 for o in outputs if o.finished)
    assert policy.kv_cache.num_free_blocks == 3


@pytest.mark.parametrize(
    ("kwargs", "tokens", "reason", "count"),
    [
        ({}, [5, EOS], "stop", 2),
        ({"ignore_eos": True}, [5, EOS, 5, 5], "length", 4),
        ({"stop_token_ids": (9,)}, [5, 9], "stop", 2),
        ({}, [5, 5, 5, 5], "length", 4),
    ],
)
def test_stop_conditions(kwargs, tokens, reason, count):
    policy = make_policy()
    policy.add_request(request("a", range(10, 15), max_tokens=4, **kwargs))
    outputs = []
    for token in tokens:
        outputs += answer(policy, policy.schedule(), token=token)
    assert [o.new_token_ids[0] for o in outputs] == tokens[:count]
    assert outputs[-1].finished and outputs[-1].finish_reason == reason
    assert outputs[-1].usage.completion_tokens == count
    assert not policy.requests and policy.kv_cache.num_free_blocks == 16


def test_the_model_length_stops_generation():
    policy = make_policy(max_model_len=7)
    policy.add_request(request("a", range(5), max_tokens=10))
    outputs = run_to_completion(policy)
    assert len(outputs) == 2 and outputs[-1].finish_reason == "length"


def test_abort_frees_blocks_at_once_and_tells_the_worker():
    policy = make_policy()
    policy.add_request(request("a", range(10)))
    policy.add_request(request("w", range(20, 30)))
    step = policy.schedule()
    answer(policy, step)
    held = 16 - policy.kv_cache.num_free_blocks
    assert held == 6
    final = policy.abort("a")
    assert final.finished and final.finish_reason == "abort" and final.usage.completion_tokens == 1
    assert policy.kv_cache.num_free_blocks == 13
    assert policy.schedule().finished_request_ids == ["a"]
    assert policy.abort("a") is None  # already gone: ignored


def test_abort_of_a_waiting_request_never_reaches_the_worker():
    policy = make_policy(max_num_seqs=1)
    policy.add_request(request("a", range(10)))
    policy.add_request(request("b", range(10)))
    answer(policy, policy.schedule())
    policy.abort("b")
    assert policy.schedule().finished_request_ids == []
    assert not policy.waiting


def test_tokens_for_a_request_aborted_mid_step_are_dropped():
    policy = make_policy()
    policy.add_request(request("a", range(10)))
    step = policy.schedule()
    policy.abort("a")
    assert policy.update_from_output(step, StepOutput(step.step_id, {"a": 5})) == []
    assert policy.kv_cache.num_free_blocks == 16


def test_a_worker_answer_that_does_not_match_the_step_is_refused():
    policy = make_policy(max_num_batched_tokens=4)
    policy.add_request(request("a", range(10)))
    step = policy.schedule()  # a chunk of 4: nothing to sample yet
    with pytest.raises(ValueError, match="sampled for 'a'"):
        policy.update_from_output(step, StepOutput(step.step_id, {"a": 5}))
    with pytest.raises(ValueError, match="did not schedule"):
        policy.update_from_output(step, StepOutput(step.step_id, {"zz": 5}))


def test_an_answer_that_does_not_fit_changes_no_request():
    """Checked whole before any of it is taken: no request gets a token from an answer that is
    refused, so the engine can still run again the requests that streamed nothing."""
    policy = make_policy()
    policy.add_request(request("a", range(10)))
    policy.add_request(request("b", range(20, 30)))
    step = policy.schedule()
    with pytest.raises(ValueError, match="did not sample for 'b'"):
        policy.update_from_output(step, StepOutput(step.step_id, {"a": 5}))
    assert all(not r.output_token_ids and not r.sent_first_output for r in policy.requests.values())


def test_drop_all_frees_every_block():
    policy = make_policy(max_num_seqs=1)
    policy.add_request(request("a", range(10)))
    policy.add_request(request("b", range(10)))
    answer(policy, policy.schedule())
    assert policy.kv_cache.stats().cached_blocks > 0
    # "a" has produced its first token, "b" nothing: only "b" can be submitted again as it was.
    assert [(request_id, origin and origin.request_id) for request_id, origin in policy.drop_all()] == [
        ("a", None), ("b", "b")]
    assert policy.kv_cache.num_free_blocks == 16 and not policy.has_work()
    assert policy.kv_cache.stats().cached_blocks == 0  # the KV they named is gone with the worker


def test_config_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_logprobs_from_the_worker_reach_the_output():
    policy = make_policy()
    policy.add_request(request("a", range(5), max_tokens=1))
    step = policy.schedule()
    logprobs = TokenLogprobs(-0.5, ((7, -0.5), (3, -1.5)))
    [output] = policy.update_from_output(step, StepOutput(step.step_id, {"a": 7}, {"a": logprobs}))
    assert output.logprobs == (logprobs,)
