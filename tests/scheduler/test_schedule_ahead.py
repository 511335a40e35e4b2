"""Scheduling a step while the one before it is in flight, against the real KV cache manager and the
simulated worker, which runs each step as soon as it is sent and checks every KV slot a request reads.
The policy learns a step's tokens only after it has scheduled the next one."""
from __future__ import annotations

import asyncio
from collections import deque

from sim_worker import SimulatedWorker, reference_generation

from prefixcache.block_identity.hashing import BlockHasher
from prefixcache.scheduler.config import SchedulerConfig
from prefixcache.scheduler.kv_cache import KVCacheManager
from prefixcache.scheduler.policy import SchedulingPolicy
from prefixcache.scheduler.request import EngineRequest, RequestOutput
from prefixcache.step.messages import SamplingParams, SchedulerStep, StepOutput

BLOCK = 4
VOCAB = 1000


def make(num_blocks: int = 32, **config) -> tuple[SchedulingPolicy, SimulatedWorker]:
    config = SchedulerConfig(block_size=BLOCK, **config)
    kv_cache = KVCacheManager(num_blocks, BlockHasher(BLOCK, "sha256", "sim-model"))
    worker = SimulatedWorker(num_kv_blocks=num_blocks, vocab_size=VOCAB)
    asyncio.run(worker.initialize(BLOCK))
    return SchedulingPolicy(config, kv_cache, max_model_len=config.max_model_len), worker


def request(request_id: str, prompt, max_tokens: int = 6, **kwargs) -> EngineRequest:
    return EngineRequest(request_id, list(prompt), SamplingParams(), max_tokens, **kwargs)


class Pipeline:
    """Sends steps to the worker when they are scheduled and applies their outputs oldest first."""

    def __init__(self, policy: SchedulingPolicy, worker: SimulatedWorker) -> None:
        self.policy, self.worker = policy, worker
        self.in_flight: deque[tuple[SchedulerStep, StepOutput]] = deque()
        self.sent: list[SchedulerStep] = []

    def send(self) -> SchedulerStep:
        step = self.policy.schedule()
        self.sent.append(step)
        self.in_flight.append((step, self.worker.run(step)))
        return step

    def apply_oldest(self) -> list[RequestOutput]:
        step, output = self.in_flight.popleft()
        return self.policy.update_from_output(step, output)

    def run(self, max_steps: int = 500) -> list[RequestOutput]:
        """As EngineCore does: schedule ahead whenever the policy allows, until all requests end."""
        outputs: list[RequestOutput] = []
        for _ in range(max_steps):
            if not self.in_flight:
                if not self.policy.requests:
                    return outputs
                self.send()
            if self.policy.can_schedule_ahead():
                self.send()
            outputs += self.apply_oldest()
        raise AssertionError("requests did not finish")


def tokens_by_request(outputs: list[RequestOutput]) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for output in outputs:
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_decodes_scheduled_ahead_produce_the_tokens_of_one_step_at_a_time():
    policy, worker = make(max_num_batched_tokens=16)
    shared = list(range(100, 113))
    prompts = {"a": shared + [1, 2], "b": shared + [3], "c": list(range(300, 330)), "d": [7, 8]}
    lengths = {"a": 9, "b": 4, "c": 7, "d": 12}
    for request_id, prompt in prompts.items():
        policy.add_request(request(request_id, prompt, max_tokens=lengths[request_id]))
    pipeline = Pipeline(policy, worker)
    outputs = pipeline.run()

    assert tokens_by_request(outputs) == {
        rid: reference_generation(prompt, lengths[rid], VOCAB) for rid, prompt in prompts.items()}
    assert all(o.finish_reason == "length" for o in outputs if o.finished)
    ahead = [step for step in pipeline.sent if step.follows_step_id is not None]
    assert len(ahead) > len(pipeline.sent) // 2  # most steps decode only: they were sent ahead
    assert all(step.follows_step_id == step.step_id - 1 for step in ahead)
    # An ahead step decodes only: prompts (and chunks of them) wait for steps that are not.
    assert all(set(step.num_scheduled_tokens.values()) == {1} and not step.new_requests for step in ahead)
    assert policy.kv_cache.num_free_blocks == 32


def test_a_block_filled_by_a_pending_token_is_cached_once_the_token_is_known():
    policy, worker = make()
    policy.add_request(request("a", range(10, 16), max_tokens=4))  # 6 + 4 tokens: 2 full blocks
    pipeline = Pipeline(policy, worker)
    generated = tokens_by_request(pipeline.run())["a"]
    # The second block (positions 4-7) was filled by tokens the policy had not seen when it
    # scheduled them; a request continuing the sequence still finds both blocks.
    follower = request("b", list(range(10, 16)) + generated[:2] + [5, 6], max_tokens=1)
    policy.add_request(follower)
    step = policy.schedule()
    assert step.new_requests[0].num_computed_tokens == 8


def test_a_request_whose_pending_token_ends_it_by_length_is_not_scheduled_again():
    policy, worker = make()
    policy.add_request(request("a", range(10, 15), max_tokens=2))
    policy.add_request(request("b", range(20, 25), max_tokens=4))
    pipeline = Pipeline(policy, worker)
    pipeline.send()  # the prompts: each samples its first token
    assert policy.can_schedule_ahead()
    assert pipeline.send().num_scheduled_tokens == {"a": 1, "b": 1}  # a's second token is its last
    pipeline.apply_oldest()
    assert pipeline.send().num_scheduled_tokens == {"b": 1}  # a's last token is in flight: no more for a
    [final] = [o for o in pipeline.apply_oldest() if o.request_id == "a"]
    assert final.finished and final.finish_reason == "length" and final.usage.completion_tokens == 2
    assert pipeline.send().num_scheduled_tokens == {"b": 1}  # b's last token
    pipeline.apply_oldest()
    assert not policy.can_schedule_ahead()  # every token still to come is in flight
    [final] = pipeline.apply_oldest()
    assert final.finish_reason == "length" and final.usage.completion_tokens == 4
    assert policy.kv_cache.num_free_blocks == 32


def test_a_request_that_stops_while_its_next_step_is_in_flight_ends_with_the_token_that_stopped_it():
    policy, worker = make()
    prompt = list(range(10, 15))
    first, second = reference_generation(prompt, 2, VOCAB)
    policy.add_request(request("a", prompt, max_tokens=8, stop_token_ids=(first,)))
    policy.add_request(request("b", range(40, 45), max_tokens=3))
    pipeline = Pipeline(policy, worker)
    pipeline.send()
    step = pipeline.send()  # ahead: decodes a's first token, which will turn out to stop it
    assert step.num_scheduled_tokens == {"a": 1, "b": 1}
    outputs = pipeline.apply_oldest()
    [stopped] = [o for o in outputs if o.request_id == "a"]
    assert stopped.new_token_ids == [first] and stopped.finish_reason == "stop"
    assert "a" not in policy.requests
    # The step in flight computed a token for nothing: its sample is dropped, and the worker forgets
    # a at the next step.
    assert [o.request_id for o in pipeline.apply_oldest()] == ["b"]
    assert pipeline.send().finished_request_ids == ["a"]
    outputs = pipeline.run()
    assert tokens_by_request(outputs)["b"][-1] == reference_generation(list(range(40, 45)), 3, VOCAB)[-1]
    assert second not in tokens_by_request(outputs).get("a", [])
    assert policy.kv_cache.num_free_blocks == 32


def test_a_request_preempted_while_a_step_samples_for_it_keeps_that_token_and_resumes():
    policy, worker = make(num_blocks=4)
    prompts = {"a": list(range(0, 7)), "b": list(range(50, 57))}  # 2 blocks each: the pool is full
    for request_id, prompt in prompts.items():
        policy.add_request(request(request_id, prompt, max_tokens=4))
    pipeline = Pipeline(policy, worker)
    pipeline.send()  # both prompts; each samples its 8th token
    pipeline.send()  # ahead: both decode position 7, the last slot of their second block
    pipeline.apply_oldest()
    # a's next token needs a third block: b, admitted last, is preempted while the step in flight
    # still samples for it.
    step = pipeline.send()
    assert step.follows_step_id is not None
    assert step.finished_request_ids == ["b"] and step.num_scheduled_tokens == {"a": 1}
    assert not policy.can_schedule_ahead()  # b waits for admission
    [from_b] = [o for o in pipeline.apply_oldest() if o.request_id == "b"]
    assert from_b.new_token_ids == reference_generation(prompts["b"], 2, VOCAB)[1:]
    outputs = pipeline.run()
    resumed = next(step for step in reversed(pipeline.sent) if any(r.request_id == "b" for r in step.new_requests))
    [new_b] = [r for r in resumed.new_requests if r.request_id == "b"]
    assert new_b.token_ids == prompts["b"] + reference_generation(prompts["b"], 2, VOCAB)
    tokens = tokens_by_request(outputs)
    assert tokens["a"] == reference_generation(prompts["a"], 4, VOCAB)[2:]
    assert tokens["b"] == reference_generation(prompts["b"], 4, VOCAB)[2:]
    assert policy.kv_cache.num_free_blocks == 4


def test_nothing_is_scheduled_ahead_while_a_prompt_waits_or_is_being_chunked():
    policy, worker = make(max_num_batched_tokens=8)
    policy.add_request(request("a", range(10, 14), max_tokens=5))
    pipeline = Pipeline(policy, worker)
    pipeline.send()
    policy.add_request(request("long", range(100, 120), max_tokens=2))  # 20 tokens: three chunks
    assert not policy.can_schedule_ahead()  # it waits: the next step should admit it
    pipeline.apply_oldest()
    pipeline.send()  # a decodes; long's first chunk
    assert not policy.can_schedule_ahead()  # long is not done: its next chunk is no decode
    pipeline.run()
    assert policy.kv_cache.num_free_blocks == 32


def test_an_aborted_request_with_two_steps_in_flight_frees_its_blocks_at_once():
    policy, worker = make()
    policy.add_request(request("a", range(10, 18), max_tokens=6))
    pipeline = Pipeline(policy, worker)
    pipeline.send()
    pipeline.send()
    final = policy.abort("a")
    assert final.finish_reason == "abort" and policy.kv_cache.num_free_blocks == 32
    assert pipeline.apply_oldest() == [] and pipeline.apply_oldest() == []
    assert not policy.can_schedule_ahead()
    assert pipeline.send().finished_request_ids == ["a"]
